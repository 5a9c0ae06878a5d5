// The checkpoint manifest (manifest.json) parsed and validated into plain structs, without
// LibTorch: everything loading checks before it reads a shard or touches a tensor. Shared by
// the library (checkpoint.cpp) and the fuzz target (tests/fuzz/fuzz_manifest.cpp).
//
// Version 2 writes one layout, "pieces": for every tensor of the state (parameter, optimizer
// slot, buffer) its global shape and the pieces the ranks wrote, each a Placement
// (tandem/placement.h) and the shard entry holding its elements. Version 1's layouts are read
// into the same per-tensor pieces: "replicated" (one rank's shard holds every parameter),
// "zero" (each parameter at an offset of a flat bucket that is the concatenation of the ranks'
// equal chunks) and "stages" (each tensor whole in the shard of the rank that wrote its stage).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tandem/checkpoint_meta.h"
#include "tandem/placement.h"

namespace tandem::ckpt {

// What manifest.json says it is; the reader refuses other formats and versions.
inline constexpr const char* kManifestFormat = "tandem-checkpoint";
inline constexpr int kManifestVersion = 2;  // written; 1 is read too

struct Digest {
  int64_t bytes = 0;
  uint64_t fnv1a64 = 0;
};

struct TensorDesc {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;
  int64_t numel = 0;  // product of shape (validated: no overflow, < 2^56)
};

enum class LayoutKind { kReplicated, kZero, kStages, kPieces };

// Elements of one tensor in one rank's shard: `placement` says which (its held elements), and
// they are elements [entry_offset, entry_offset + placement.held_numel()) of entry `entry`.
struct StoredPiece {
  int rank = 0;
  std::string entry;
  int64_t entry_offset = 0;
  Placement placement;
};
struct StoredTensor {
  std::vector<int64_t> shape;
  std::string dtype;
  std::vector<StoredPiece> pieces;  // validated: they hold every element exactly once
};

// Keys of the state's tensors: "param/NAME", "<slot>/NAME" (optimizer state), "buffer/NAME".
std::string state_key(const std::string& kind, const std::string& name);

struct ZeroBucket {
  int64_t numel = 0, padded = 0, chunk = 0;  // padded == chunk * world_size, numel <= padded
};

struct Manifest {
  CheckpointMeta meta;
  std::vector<TensorDesc> params, buffers;  // the model's, in registration order
  std::vector<std::string> slots;           // optimizer state slots per parameter
  int64_t optimizer_step = 0;
  std::vector<std::string> files;  // per rank: the shard's file name (no '/', not hidden)
  std::vector<Digest> digests;     // per rank
  LayoutKind layout = LayoutKind::kReplicated;
  // replicated and stages: per params[i] / buffers[i], the rank whose shard holds it
  // (zero: buffers are in rank 0's shard).
  std::vector<int> param_owner, buffer_owner;
  // zero: the stage, the buckets, and per params[i] its bucket and offset in it.
  int zero_stage = 0;
  std::vector<ZeroBucket> buckets;
  std::vector<size_t> param_bucket;
  std::vector<int64_t> param_offset;
  // stages: layers per pipeline stage.
  std::vector<int64_t> partition;
  // Every layout: each tensor's pieces, by key (state_key). A parameter's optimizer slot may be
  // absent (state not yet made for it).
  std::map<std::string, StoredTensor> tensors;
};

// Parses manifest.json's text. Throws std::runtime_error naming `path` and the first problem:
// not JSON, another format or version, a missing field or one of the wrong type, an integer
// out of range, shards that do not match the world size, an invalid shard file name or
// checksum, a layout that places a parameter outside its bucket, twice or not at all, pieces of
// a tensor that leave an element out, hold one twice or disagree with its shape (naming the
// tensor and the shard files).
Manifest parse_manifest(const std::string& text, const std::string& path);

}  // namespace tandem::ckpt
