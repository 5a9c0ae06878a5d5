// Sharded checkpoints that reshard on load. tandem::Engine::save and load (tandem/engine.h) are
// the one API for every layout; a loop of its own over a replicated model (one worker, DDP)
// uses save_checkpoint/load_checkpoint below. A checkpoint is a directory `step-NNNNNNNN` under a
// root: manifest.json (model, strategy, world size, progress, RNG, precision, loss scale,
// optimizer, each shard file's size and checksum, and for every tensor of the state its global
// shape and the pieces the ranks wrote, each a Placement of tandem/placement.h) and one shard
// file per rank holding its pieces. Whatever the layout, a rank writes the pieces it holds as
// replica 0, so every element is written exactly once. Saving is atomic: files are written and
// fsync'ed in a temporary directory that is renamed into place only when every rank succeeded,
// so a crash mid-save leaves the previous checkpoint intact. Loading fills each piece the
// loading rank holds from the stored pieces it overlaps, reading only the shards that hold
// them, in any other layout; the manifest is checked first (pieces that leave an element out,
// hold one twice or disagree on a tensor's shape are refused, naming the tensor and files), and
// every problem is a std::runtime_error naming the file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/checkpoint_meta.h"  // CheckpointMeta
#include "tandem/comm.h"
#include "tandem/optim.h"
#include "tandem/placement.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn
namespace torch::optim {
class Optimizer;
}

namespace tandem {

class AsyncCheckpoint;

struct CheckpointSaveOptions {
  int keep = 0;  // keep the newest K complete checkpoints under the root; 0: keep all
  // Test hook, called on every rank after each stage of the save ("shard-written",
  // "manifest-written", "renamed"); a hook that kills the process simulates a crash. With
  // `async`, "shard-written" is called on the writer thread.
  std::function<void(const std::string& stage)> on_stage;
  // Asynchronous save: the save returns once this rank's state is copied (to the CPU), a
  // background thread writes the shard, and async->finish() commits the checkpoint. Until then
  // the previous checkpoint stays the newest complete one, and a crash loses nothing more than
  // this save. The directory the save returns exists only after finish().
  std::shared_ptr<AsyncCheckpoint> async;
};

// A save in flight (CheckpointSaveOptions::async), one per handle. The collectives of the save
// stay on the caller's thread: only the shard's write runs in the background, so training and
// the writer never share a communicator.
class AsyncCheckpoint {
 public:
  AsyncCheckpoint();
  // Joins the writer. A save never finished stays a temporary directory that the next save
  // under the same root removes; the previous checkpoint remains the newest.
  ~AsyncCheckpoint();
  AsyncCheckpoint(const AsyncCheckpoint&) = delete;
  AsyncCheckpoint& operator=(const AsyncCheckpoint&) = delete;

  bool pending() const;  // started and not yet finished
  bool written() const;  // local: this rank's writer is done (successfully or not)
  // Collective over the save's communicator: whether every rank's writer is done (one
  // all-reduce of a flag). Call finish() when it is, to commit without waiting.
  bool all_written(Communicator& comm) const;
  // Collective: waits for this rank's writer, then commits as a synchronous save does (sizes
  // and checksums gathered, manifest, rename, pruning) and returns the checkpoint's directory.
  // Throws std::runtime_error on every rank when any rank's write failed; the previous
  // checkpoints stay. Must be called with the communicator the save used.
  std::string finish(Communicator& comm);

  struct State;

 private:
  std::unique_ptr<State> s_;
  friend struct AsyncCheckpointAccess;
};

struct CheckpointLoadOptions {
  std::string expect_model;  // non-empty: the manifest's model must be this name
  bool restore_rng = true;   // restore this rank's CPU generator state (rank 0's if the rank did not exist)
};

// One piece of the state a rank holds: what a strategy reports for each parameter (its fp32
// values, the master copy where one is kept), optimizer slot and buffer. `data` is a 1-D view of
// the held elements, on any device, in the placement's order: a save reads it, a load writes it.
struct StatePiece {
  // "param/NAME", "<slot>/NAME" (optimizer state, e.g. "exp_avg/NAME"), "buffer/NAME"; NAME is
  // the parameter's name in the whole (dense) model, whatever the layout.
  std::string key;
  Placement placement;
  at::Tensor data;
};

// Appends the pieces of one parameter that an optimizer steps (`param`: the tensor it steps, the
// fp32 master where one is kept) at `placement`: its values and every state slot it has, keyed
// by `name`, the parameter's name in the dense model.
void append_optimizer_pieces(std::vector<StatePiece>& out, const std::string& name, const Placement& placement,
                             const at::Tensor& param, const torch::optim::Optimizer& opt);

// Collective over `comm` (CPU tensors: pass Runtime::cpu_world()): each rank writes its pieces
// with replica id 0; rank 0 records where every piece is. `optimizer_step` is Adam's count.
// Throws std::invalid_argument on every rank when the pieces do not cover a tensor exactly once
// (a strategy's bug), std::runtime_error on every rank when any rank's write failed (disk full,
// permissions); the previous checkpoints stay.
std::string save_state(const std::string& root, CheckpointMeta meta, const std::vector<StatePiece>& pieces,
                       int64_t optimizer_step, Communicator& comm, const CheckpointSaveOptions& o = {});

// What a load fills, for load_state.
struct StateTarget {
  // The whole model's parameters and buffers by name and shape: the checkpoint must hold
  // exactly these (a pipeline stage or a shard still names the whole model).
  std::vector<std::pair<std::string, std::vector<int64_t>>> params, buffers;
  std::string optimizer;  // the optimizer's kind; the checkpoint's must be the same
  // Called once the checkpoint is found to fit, before pieces(): make the optimizer's state
  // slots (zeros, with this step count; none when `slots` is empty), for the load to write.
  std::function<void(const std::vector<std::string>& slots, int64_t step)> prepare;
  std::function<std::vector<StatePiece>()> pieces;
};
// Fills every piece of t.pieces() from the checkpoint `dir`, reading only the shards that hold
// its elements, and restores the CPU generator state of `rank` (rank 0's when the checkpoint had
// fewer ranks). Everything is checked before anything changes. With `comm` (collective), a rank
// that fails (a damaged shard only it reads) makes every rank throw instead of leaving the others
// waiting in their next collective.
CheckpointMeta load_state(const std::string& dir, const StateTarget& t, int rank, Communicator* comm,
                          const CheckpointLoadOptions& o = {});

// Initial values of parameters by their names in the dense model (EngineOptions::init_from,
// load_parameters below), e.g.
// a Hugging Face directory's safetensors files. Once the model is cut and sharded, every rank is
// asked for exactly the elements it holds (tandem/placement.h): a pipeline stage's tensors, a
// tensor-parallel block's rows or columns, a ZeRO-3 shard's flat range.
class ParameterSource {
 public:
  virtual ~ParameterSource() = default;
  // Whether it holds a value for `name` (and its shape); false: the parameter keeps its own.
  virtual bool find(const std::string& name, std::vector<int64_t>* shape) const = 0;
  // Copies elements [first, first + dest.numel()) of the flattened tensor `name` into the 1-D
  // `dest` (converted to its dtype). Throws std::runtime_error naming what could not be read.
  virtual void read(const std::string& name, int64_t first, at::Tensor dest) const = 0;
};

// Collective over `comm`: fills every "param/NAME" piece whose NAME `source` has, run by run,
// so that a rank reads only the elements it holds. Throws std::runtime_error on every rank when
// any rank's read failed, or a value's shape is not the parameter's (the pieces are then partly
// written).
void load_parameters(const ParameterSource& source, const std::vector<StatePiece>& pieces, Communicator& comm);

// Collective over `comm` (CPU tensors: pass Runtime::cpu_world()). From a module whose
// parameters every rank holds in full (DDP, one worker): `opt` is the optimizer over the
// module's parameters in order (or over fp32 masters of them, MixedPrecisionOptimizer).
// Returns the checkpoint's directory. Throws std::runtime_error on every rank when any
// rank's write failed (disk full, permissions); the previous checkpoints stay.
std::string save_checkpoint(const std::string& root, CheckpointMeta meta, torch::nn::Module& model,
                            torch::optim::Optimizer& opt, Communicator& comm, const CheckpointSaveOptions& o = {});
// The newest complete checkpoint under root ("" when none; incomplete ones are ignored).
std::string latest_checkpoint(const std::string& root);

// Reads and validates the manifest (not the shards).
CheckpointMeta read_checkpoint_meta(const std::string& dir);

// A checkpoint assembled in full: every parameter (fp32 masters when mixed precision), buffer
// and optimizer state by parameter name, on the CPU.
struct FullCheckpoint {
  CheckpointMeta meta;
  std::vector<std::string> param_names;  // registration order
  std::map<std::string, at::Tensor> params, buffers;
  std::map<std::string, ParamOptimizerState> optim;
  std::vector<at::Tensor> rng;  // per saved rank: the CPU generator state
};
// Reads every shard (checking sizes and checksums) and assembles the full state. Local.
FullCheckpoint read_full_checkpoint(const std::string& dir);

// Local (no collective): loads into a replicated module/optimizer (as for save_checkpoint) from a
// checkpoint of any layout; `rank` selects the RNG state to restore. Checks the model name,
// parameter names and shapes, and optimizer kind before changing anything.
CheckpointMeta load_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& opt, int rank,
                               const CheckpointLoadOptions& o = {});

}  // namespace tandem
