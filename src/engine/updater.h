// The Engine's one strategy interface (private to src/engine): how this rank's gradients become
// an update over the data-parallel ranks. Two implementations: replicas with a
// MixedPrecisionOptimizer, under DistributedDataParallel or averaged after a pipeline's step
// (single, ddp), and ZeroDataParallel (zero1-3). The Engine's step, checkpoint and report code
// talk to this interface only; which one exists is decided once, in make_updater().
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/accumulate.h"
#include "tandem/checkpoint.h"
#include "tandem/engine.h"
#include "tandem/grid.h"
#include "tandem/placement.h"

namespace tandem {

class DistributedDataParallel;
class ZeroDataParallel;

namespace engine {

// What the Engine built before the updater: the grid, the model as it runs on this rank and the
// pipeline stage. Owned by the Engine; the updater keeps a reference.
struct Layout {
  Runtime* rt = nullptr;
  ParallelConfig cfg;
  EngineOptions opts;
  // dp: the group the strategy reduces gradients over (the data-parallel and context-parallel
  // ranks of this rank's shard); data: the data-parallel replicas alone (different samples);
  // cp: the ranks sharing each sequence (null without context parallelism).
  CommPtr world, dp, data, cp;
  // hsdp, hsdp2: the shard group (consecutive dp ranks) and the ranks holding the same shard
  // index in every group (null when one group holds them all); null under the other strategies.
  CommPtr shard, replicate;
  std::unique_ptr<ProcessGrid> grid;
  std::shared_ptr<torch::nn::Module> dense;  // the model as given (the checkpoints' names)
  std::shared_ptr<torch::nn::Module> net;    // what runs: `dense`, or its tensor-parallel form
  std::unique_ptr<Pipeline> pipe;
  std::shared_ptr<torch::nn::Module> trained_module;  // the stage (pp > 1) or `net`
  std::vector<at::Tensor> trained;                    // its trainable parameters (requires_grad)
  std::function<at::Tensor(const at::Tensor&)> run;   // net's forward (its own when not a Sequential)
  // Where each parameter of trained_module lies in the dense model (tandem/placement.h), by its
  // name in trained_module: its dense name, and its block for a tensor-parallel rank (replica
  // id: its copy's number among the tp ranks). Set once the module is cut and converted.
  std::map<std::string, ParameterPlacement> placed;

  int dp_size() const { return dp->size(); }
  torch::nn::Sequential net_sequential() const;  // throws when net is not a Sequential
  torch::nn::Sequential dense_sequential() const;
  // This rank's buffers (whole, replica id: the rank's place among those holding them).
  std::vector<StatePiece> buffer_state() const;
  // This rank's frozen parameters (requires_grad false) as the replicas hold them: each whole (or
  // its tensor-parallel block), no optimizer state.
  std::vector<StatePiece> frozen_state() const;
  // The rank's number among the tp x dp ranks that hold the same stage, and the part the
  // data-parallel rank adds to a tp replica id (every dp rank but 0 holds a copy).
  int64_t replica_rank() const;
  int64_t dp_replica() const { return static_cast<int64_t>(cfg.tp) * dp->rank(); }
};

class Updater {
 public:
  virtual ~Updater() = default;
  // Before a step's first forward: buffers synchronised, hooks armed, gradients zeroed.
  virtual void begin_step() = 0;
  // Before every later micro-batch's forward (gradient accumulation).
  virtual void prepare_forward() = 0;
  // Before an inference forward.
  virtual void prepare_predict() = 0;
  // The model's forward through the strategy (ZeRO-3 gathers unit by unit).
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  virtual at::Tensor scale_loss(const at::Tensor& loss) const = 0;
  // After a pipeline's whole backward: the stage's gradients averaged over the replicas
  // (ZeRO reduces in its hooks already).
  virtual void after_pipeline_backward() = 0;
  virtual bool step() = 0;
  virtual void set_lr(double lr) = 0;
  virtual double lr() const = 0;
  virtual double last_grad_norm() const = 0;  // negative: not computed by the last step
  // Squares of gradients this updater does not step (the experts' under --ep, summed over the
  // ranks holding distinct parts of them), joining the next step()'s global norm for clipping.
  virtual void add_squared_norm(double sq) = 0;
  virtual const LossScaler& scaler() const = 0;
  // Seconds this rank waited for other ranks' parameters (ZeRO-3), for timing its own compute.
  virtual double gather_wait_seconds() const { return 0.0; }
  // --grad-accum: `pass` over k micro-batches of this replica's batch, communicating as the
  // strategy does (tandem/accumulate.h).
  virtual at::Tensor accumulate(const at::Tensor& x, const at::Tensor& y, int64_t k, const MicroBatchPass& pass) = 0;
  // The strategy's own communication figures (DDP's exposed and hidden all-reduce time).
  virtual void communication(EngineStats::DataParallel&) const {}
  virtual void reset_stats() {}

  // State that moves (checkpoints, initial values): what this rank holds of every parameter
  // (its fp32 values: the masters where kept apart) and optimizer slot, as views by dense name
  // (tandem/checkpoint.h's StatePiece). A save reads them; a load writes them between
  // prepare_load() and finish_load().
  virtual std::vector<StatePiece> state() = 0;
  virtual std::string optimizer_kind() const = 0;
  virtual int64_t optimizer_step() const = 0;
  // Makes the optimizer's slots (zeros, with this step count; none when `slots` is empty).
  virtual void prepare_load(const std::vector<std::string>& slots, int64_t step) = 0;
  // Carries the loaded values to where they are computed with (low-precision parameters, ZeRO's
  // replicas and shards). Collective over the data-parallel group for ZeRO.
  virtual void finish_load() = 0;
  virtual void restore_loss_scaler(const CheckpointMeta& meta) = 0;
  virtual void memory(EngineStats::Memory& s) const = 0;
};

std::unique_ptr<Updater> make_updater(Layout& layout, const OptimizerOptions& optimizer);

// The pieces `zero` owns (each a flat range of the parameter as this rank holds it, with its
// optimizer slots) under the dense names and placements of `placed` (by name in zero's module),
// their replica ids raised by `replica`.
void append_zero_pieces(std::vector<StatePiece>& out, ZeroDataParallel& zero,
                        const std::map<std::string, ParameterPlacement>& placed, int64_t replica = 0);

}  // namespace engine
}  // namespace tandem
