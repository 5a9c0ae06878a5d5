// Checkpoint internals: the shard file format and the POSIX file operations (write + fsync,
// directory fsync, recursive removal) that saving atomically needs. std::filesystem's
// remove_all is avoided on purpose (it crashes with pip torch's libstdc++ ABI mix).
//
// Shard file, little-endian: "TANDEMSH" | u32 version (1) | u32 entry count | entries, each
// u32 name length | name | i32 dtype (c10::ScalarType) | u32 ndim | i64 sizes[ndim] |
// u64 byte count | the tensor's bytes (contiguous). The manifest stores the file's size and
// FNV-1a 64-bit hash, so truncation and corruption are caught before anything is parsed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoint/manifest.h"  // Digest

namespace tandem::ckpt {

uint64_t fnv1a64(const void* data, size_t n, uint64_t h = 14695981039346656037ull);
std::string hex64(uint64_t v);

// Serializes the tensors (copied to the CPU, contiguous) and writes them with write_synced().
Digest write_shard(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& entries);
// Reads a shard, checks it against the manifest's size and hash, and parses it. Throws
// std::runtime_error naming the file and the problem.
std::map<std::string, at::Tensor> read_shard(const std::string& path, const Digest& expect);

// Creates/truncates `path`, writes all of `data`, fsyncs and closes; throws naming the file.
void write_synced(const std::string& path, const std::string& data);
// The same for data given in pieces (written in order, never joined in memory).
void write_synced(const std::string& path, const std::vector<std::string_view>& pieces);
// Whole file; throws std::runtime_error naming the file when it cannot be read.
std::string read_all(const std::string& path);
void fsync_dir(const std::string& path);
void make_dirs(const std::string& path);    // mkdir -p
void remove_tree(const std::string& path);  // rm -rf (no error when missing)
bool is_dir(const std::string& path);
bool exists(const std::string& path);
std::vector<std::string> list_dir(const std::string& path);  // names, without . and ..
void rename_path(const std::string& from, const std::string& to);

}  // namespace tandem::ckpt
