// safetensors files (the Hugging Face checkpoint format) read and written from C++. Reading maps
// the file and validates its whole header first (every violation names the file and tensor);
// tensors come back as views over the mapping, which they keep alive, so opening a 10 GB file
// costs nothing until bytes are touched, and a rank that reads a slice of a tensor (tensor
// parallelism, ZeRO-3) reads only that slice's bytes. Writing is atomic (a temporary file
// renamed into place). Sharded checkpoints follow `save_pretrained`: model.safetensors, or
// model-0000k-of-0000n.safetensors and model.safetensors.index.json. Supported dtypes: F64,
// F32, F16, BF16, I64, I32, I16, I8, U8, BOOL. Little-endian hosts only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tandem {
class ParameterSource;
}

namespace tandem::safetensors {

// Tensors in the order they are written (the file lays them out by dtype size, then name).
using TensorList = std::vector<std::pair<std::string, at::Tensor>>;
using Metadata = std::map<std::string, std::string>;

struct TensorInfo {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // of the first byte in the file
  int64_t bytes = 0;
};

// One mapped .safetensors file. Copies share the mapping; it is unmapped when the last copy and
// the last tensor viewing it are gone. Immutable once built, so safe to share between threads.
class File {
 public:
  // Maps and validates; throws std::runtime_error naming the file and what is wrong.
  explicit File(const std::string& path);

  const std::string& path() const;
  // Tensor names in file order (by offset).
  const std::vector<std::string>& names() const;
  bool contains(const std::string& name) const;
  // Throws std::out_of_range naming the tensor and the file when it is absent.
  const TensorInfo& info(const std::string& name) const;
  // The "__metadata__" map (empty when the file has none).
  const Metadata& metadata() const;

  // The whole tensor, a copy-on-write view of the mapping when its bytes are aligned to the
  // element size (writes to it never reach the file), else a copy.
  at::Tensor get(const std::string& name) const;
  // The slice [begin, end) along `dim`, as a contiguous tensor of its own: only the bytes of the
  // slice are read (for dim 0 one range; for dim d, one range per index of the dims before d).
  // Throws std::out_of_range for a dim or range outside the tensor.
  at::Tensor read_slice(const std::string& name, int64_t dim, int64_t begin, int64_t end) const;
  at::Tensor read_rows(const std::string& name, int64_t begin, int64_t end) const {
    return read_slice(name, 0, begin, end);
  }
  // Elements [first, first + count) of the tensor in row-major order, as a 1-D tensor of its
  // dtype: a tensor lies contiguous in the file, so this is one byte range, the only bytes read
  // (a ZeRO-3 rank's flat shard of it). Throws std::out_of_range naming the tensor and the file
  // for a range outside its elements.
  at::Tensor read_flat(const std::string& name, int64_t first, int64_t count) const;
  // Bytes of the tensors get(), read_slice() and read_flat() have handed out so far, over every
  // copy of this File: what a reader that copies them reads from the file (a slice counts its
  // own bytes only).
  int64_t bytes_read() const;

 private:
  struct State;
  std::shared_ptr<const State> state_;
};

// Every tensor of a file, in file order, as File::get gives them.
TensorList load_file(const std::string& path, Metadata* metadata = nullptr);

// Writes the tensors (any device; copied to the CPU contiguous) with `metadata` as
// "__metadata__" to `path`, atomically: `path` is either untouched or the complete new file.
// Throws std::invalid_argument for a repeated or empty name or an unsupported dtype (naming
// it), std::runtime_error when the file cannot be written.
void save_file(const std::string& path, const TensorList& tensors, const Metadata& metadata = {});

// A Hugging Face checkpoint directory (or one .safetensors file, or an index file): the tensors
// of model.safetensors, or of the shards that model.safetensors.index.json's weight_map names,
// each shard mapped on first use (thread-safe).
class Checkpoint {
 public:
  // `path`: a directory holding model.safetensors.index.json or model.safetensors, an
  // *.index.json file, or a .safetensors file. Throws std::runtime_error naming what is missing
  // or malformed (the index is read and validated here; shards when first used).
  explicit Checkpoint(const std::string& path);

  // Every tensor name, sorted.
  const std::vector<std::string>& names() const;
  bool contains(const std::string& name) const;
  // The shard holding `name`, mapped by the first call that needs it. Throws
  // std::out_of_range naming the tensor and the checkpoint when it is absent,
  // std::runtime_error when the index names a shard that is missing, malformed, or does not
  // hold the tensor.
  const File& file_of(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const { return file_of(name).info(name); }
  at::Tensor get(const std::string& name) const { return file_of(name).get(name); }
  at::Tensor read_slice(const std::string& name, int64_t dim, int64_t begin, int64_t end) const {
    return file_of(name).read_slice(name, dim, begin, end);
  }
  at::Tensor read_flat(const std::string& name, int64_t first, int64_t count) const {
    return file_of(name).read_flat(name, first, count);
  }
  // The index's "metadata" (values that are not strings as JSON text, e.g. total_size), or the
  // single file's "__metadata__".
  const Metadata& metadata() const;
  // Shards mapped so far.
  int64_t open_files() const;
  // File::bytes_read over the shards mapped so far: the bytes of tensors, slices and flat
  // ranges read.
  int64_t bytes_read() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

struct SaveOptions {
  // A shard is closed before a tensor would take it past this many bytes (a tensor larger than
  // the limit gets a shard of its own); everything fits in one: model.safetensors, no index.
  int64_t max_shard_bytes = int64_t{5} << 30;
  std::string base = "model";              // file names: <base>.safetensors, <base>-00001-of-00002.safetensors
  Metadata metadata = {{"format", "pt"}};  // written into every file
};

// Writes `tensors` into directory `dir` (created if needed) as save_pretrained does, each file
// atomically, the index last; returns the file names written, the index included.
std::vector<std::string> save_checkpoint(const std::string& dir, const TensorList& tensors,
                                         const SaveOptions& options = {});

// The checkpoint's tensors as initial values for tandem::Engine (EngineOptions::init_from,
// tandem/engine.h): each rank reads only the bytes of the elements it holds. `to_name` maps a
// parameter's name in the dense model to its name in the files; "" (or a name the files lack
// when `allow_missing`) leaves the parameter its own values. Without allow_missing, a name the
// files lack is a std::runtime_error naming it and the directory.
std::shared_ptr<const ParameterSource> parameter_source(
    Checkpoint checkpoint, std::function<std::string(const std::string&)> to_name = nullptr,
    bool allow_missing = false);

}  // namespace tandem::safetensors
