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

#include "tandem/checkpoint.h"
#include "tandem/engine.h"
#include "tandem/grid.h"

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
  CommPtr world, dp;
  std::unique_ptr<ProcessGrid> grid;
  std::shared_ptr<torch::nn::Module> dense;  // the model as given (the checkpoints' names)
  std::shared_ptr<torch::nn::Module> net;    // what runs: `dense`, or its tensor-parallel form
  std::unique_ptr<Pipeline> pipe;
  std::shared_ptr<torch::nn::Module> trained_module;  // the stage (pp > 1) or `net`
  std::vector<at::Tensor> trained;                    // its parameters
  std::function<at::Tensor(const at::Tensor&)> run;   // net's forward (its own when not a Sequential)
  // Tensor-parallel checkpoints: a dense model of the same shape, made on first use.
  torch::nn::Sequential tp_scratch{nullptr};

  int dp_size() const { return dp->size(); }
  torch::nn::Sequential net_sequential() const;  // throws when net is not a Sequential
  torch::nn::Sequential dense_sequential() const;
  TensorParallelState tp_state(torch::optim::Optimizer* opt, ZeroDataParallel* zero);
  // Whether opts.init_shard fills the parameters (ZeRO-3's flat shards) rather than
  // opts.init_parameters; under --tp each piece names the rank's block it lies in.
  bool init_by_shard() const { return opts.init_shard && zero_stage(cfg.strategy) == 3; }
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
  virtual const LossScaler& scaler() const = 0;
  // Seconds this rank waited for other ranks' parameters (ZeRO-3), for timing its own compute.
  virtual double gather_wait_seconds() const { return 0.0; }
  // For tandem::accumulate_gradients (null when not that strategy).
  virtual DistributedDataParallel* ddp() { return nullptr; }
  virtual ZeroDataParallel* zero() { return nullptr; }

  virtual std::string save(const std::string& root, const CheckpointMeta& meta, const CheckpointSaveOptions& o) = 0;
  virtual CheckpointMeta load(const std::string& dir, int rank, const CheckpointLoadOptions& o) = 0;
  // fp32 values of the trained module's parameters where the strategy keeps them apart from the
  // parameters (masters of mixed precision, ZeRO's shards gathered over dp), by the trained
  // module's parameter names; empty when the parameters themselves hold them. Collective.
  virtual std::map<std::string, at::Tensor> masters() = 0;
  virtual void memory(EngineStats& s) const = 0;
};

std::unique_ptr<Updater> make_updater(Layout& layout, const OptimizerOptions& optimizer);

}  // namespace engine
}  // namespace tandem
