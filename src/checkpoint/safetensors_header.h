// The safetensors header (https://github.com/huggingface/safetensors, "Format"), parsed and
// validated without LibTorch, and written back: shared by the reader and writer
// (safetensors.cpp) and the fuzz target (tests/fuzz/fuzz_safetensors.cpp).
//
// File: u64 little-endian N | N bytes of UTF-8 JSON (an object; trailing spaces allowed) | the
// byte buffer. The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin,
// end]} (offsets into the byte buffer), and the optional "__metadata__" to a string-to-string
// object. A parsed header guarantees: unique names; every dtype known; shapes of non-negative
// extents whose product fits in 2^62 bytes; end - begin == numel * element size; the ranges,
// ordered by begin, tile the whole byte buffer without hole or overlap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tandem::ckpt {

enum class StDtype { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

struct StEntry {
  std::string name;
  StDtype dtype = StDtype::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data buffer
};

struct StHeader {
  uint64_t data_start = 0;       // 8 + N: the byte buffer's offset in the file
  std::vector<StEntry> tensors;  // ordered by begin
  std::map<std::string, std::string> metadata;
};

// Headers longer than this are refused before anything is allocated (the reference
// implementation's limit).
constexpr uint64_t kStMaxHeaderBytes = 100'000'000;

size_t st_dtype_size(StDtype d);
const char* st_dtype_name(StDtype d);

// Parses the header from the first `available` bytes of a file of `file_size` bytes (available
// must hold the 8-byte prefix and the JSON; fewer is reported as a truncated file). Throws
// std::runtime_error naming `file`, the tensor when there is one, and the rule broken.
StHeader parse_st_header(const uint8_t* data, size_t available, uint64_t file_size, const std::string& file);

// The 8-byte length and the JSON of `header.tensors` and `header.metadata`, padded with
// spaces so that the byte buffer starts 8-byte aligned. The entries' offsets are written as
// given (the caller lays them out).
std::string format_st_header(const StHeader& header);

}  // namespace tandem::ckpt
