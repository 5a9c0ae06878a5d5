// Sharded checkpoints that reshard on load. tandem::Engine::save and load (tandem/engine.h) are
// the one API for every layout; a loop of its own over a replicated model (one worker, DDP)
// uses save_checkpoint/load_checkpoint below. A checkpoint is a directory `step-NNNNNNNN` under a
// root: manifest.json (model, strategy, world size, progress, RNG, precision, loss scale,
// optimizer, the layout of each rank's shard, and each shard file's size and checksum) and
// one shard file per rank with what that rank owns (DDP: rank 0 holds everything; pipeline:
// one rank per stage holds that stage). Saving is
// atomic: files are written and fsync'ed in a temporary directory that is renamed into place
// only when every rank succeeded, so a crash mid-save leaves the previous checkpoint intact.
// Loading reads whatever shards it needs, checks sizes and checksums, assembles full
// per-parameter values and optimizer state, and hands each strategy (any world size) its part;
// every problem is a std::runtime_error naming the file, and nothing is written.
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

namespace torch::nn {
class Module;
class SequentialImpl;
}  // namespace torch::nn
namespace torch::optim {
class Optimizer;
}

namespace tandem {

class Pipeline;
class ZeroDataParallel;
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

// Collective over `comm` (CPU tensors: pass Runtime::cpu_world()). From a module whose
// parameters every rank holds in full (DDP, one worker): `opt` is the optimizer over the
// module's parameters in order (or over fp32 masters of them, MixedPrecisionOptimizer).
// Returns the checkpoint's directory. Throws std::runtime_error on every rank when any
// rank's write failed (disk full, permissions); the previous checkpoints stay.
std::string save_checkpoint(const std::string& root, CheckpointMeta meta, torch::nn::Module& model,
                            torch::optim::Optimizer& opt, Communicator& comm, const CheckpointSaveOptions& o = {});
// What a tensor-parallel rank trains, for its checkpoints: `parallel` is the whole model made
// by tp::tensor_parallel() from a model of models.h, `dense` a model of the dense shape on the
// same device used as scratch (its values are overwritten), `tp` the tensor-parallel group.
// With `pipe`, the rank trains that pipeline's stage of `parallel`. The trained values and
// their optimizer state come from `opt` (over the trained parameters in order, or their
// masters) or from `zero` (ZeRO over the data-parallel replicas `dp`). `dp` is also needed with
// `pipe`: the first tp rank of each stage's first replica writes the stage.
struct TensorParallelState {
  std::shared_ptr<torch::nn::SequentialImpl> parallel, dense;
  CommPtr tp;
  const Pipeline* pipe = nullptr;
  torch::optim::Optimizer* opt = nullptr;
  ZeroDataParallel* zero = nullptr;
  CommPtr dp;
};
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

// Local (no collective): loads into a replicated module/optimizer (as for save) or into ZeRO
// of any stage and world size; `rank` selects the RNG state to restore. Checks the model
// name, parameter names and shapes, and optimizer kind before changing anything.
CheckpointMeta load_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& opt, int rank,
                               const CheckpointLoadOptions& o = {});
// ---- the per-layout forms behind tandem::Engine::save and load (tandem/engine.h). Programs
// call the Engine, or the replicated forms above in a loop of their own; these stay visible
// for the Engine and for tests of each layout.
namespace detail {

// From a pipeline stage (tandem/pipeline.h; data-parallel replicas of a stage hold the same
// values): `opt` is the optimizer over pipe.parameters() (or their masters). The ranks with
// `writer` set, exactly one per stage (e.g. those of replica 0), write their stage's parameters,
// buffers and optimizer state; the manifest records where each is and pipe.partition().
// Loading reassembles the whole model, so it resumes under any strategy and world size.
// Throws std::invalid_argument on every rank when a stage has no writer or two.
std::string save_checkpoint(const std::string& root, CheckpointMeta meta, const Pipeline& pipe,
                            torch::optim::Optimizer& opt, bool writer, Communicator& comm,
                            const CheckpointSaveOptions& o = {});
// From ZeRO (any stage) over the data-parallel replicas of a pipeline stage (`zero` built over
// pipe.stage_module() and `dp`): the stage's chunks are gathered over `dp` (collective) and the
// replica with dp rank 0 writes the stage whole, as the other overload's writer does: the
// checkpoint loads under any strategy and world size.
std::string save_checkpoint(const std::string& root, CheckpointMeta meta, const Pipeline& pipe, ZeroDataParallel& zero,
                            const CommPtr& dp, Communicator& comm, const CheckpointSaveOptions& o = {});
// From ZeRO (any stage): each rank writes its chunks (fp32 masters and optimizer state).
std::string save_checkpoint(const std::string& root, CheckpointMeta meta, ZeroDataParallel& zero, Communicator& comm,
                            const CheckpointSaveOptions& o = {});

// Collective over `comm` (and the groups in `s`): the shards of the values and of each optimizer
// slot are gathered over tp (and dp for ZeRO) into whole tensors; without a pipeline `comm`'s
// rank 0 writes the whole model (a replicated checkpoint), with one each stage's writer its
// stage (as a pipeline's). Either loads under any strategy, tensor-parallel degree and world size.
std::string save_tensor_parallel_checkpoint(const std::string& root, CheckpointMeta meta, const TensorParallelState& s,
                                            Communicator& comm, const CheckpointSaveOptions& o = {});

// Into a pipeline stage: its parameters (by their names in the whole model), buffers and
// optimizer state, from a checkpoint of any layout; the checkpoint may hold more (other stages).
CheckpointMeta load_checkpoint(const std::string& dir, const Pipeline& pipe, torch::optim::Optimizer& opt, int rank,
                               const CheckpointLoadOptions& o = {});
CheckpointMeta load_checkpoint(const std::string& dir, ZeroDataParallel& zero, int rank,
                               const CheckpointLoadOptions& o = {});
// Into ZeRO over the replicas of a pipeline stage: the stage's parameters, from a checkpoint of
// any layout (it may hold more: other stages).
CheckpointMeta load_checkpoint(const std::string& dir, const Pipeline& pipe, ZeroDataParallel& zero, int rank,
                               const CheckpointLoadOptions& o = {});
// Into a tensor-parallel rank (as for save_tensor_parallel_checkpoint), from a checkpoint of any
// layout: the whole values are cut as tp::tensor_parallel() cuts them for this tp rank,
// optimizer state likewise. Local (no collective).
CheckpointMeta load_tensor_parallel_checkpoint(const std::string& dir, const TensorParallelState& s, int rank,
                                               const CheckpointLoadOptions& o = {});

}  // namespace detail

}  // namespace tandem
