// ZeRO stages 1, 2 and 3 (Rajbhandari et al., DeepSpeed): data parallelism whose optimizer
// state (stage 1), also gradients (stage 2) and also parameters (stage 3) are partitioned over
// the ranks. Rank r steps only the 1/N it owns. Stages 1 and 2 keep a full replica of the
// parameters and all-gather the updated ones after each step; stage 3 keeps only its shard and
// gathers each unit's parameters just before the unit's forward and again before its backward,
// freeing them after each. In fp32 a step gives the same result as DistributedDataParallel
// followed by the same optimizer: elementwise ones (SGD, Adam, AdamW) directly, LARS and LAMB
// by summing each parameter's norms over the chunks that hold it.
//
// Mixed precision (bf16, fp16): the model's parameters, activations and gradients are in the
// low precision; the owning rank keeps fp32 master weights of its shard, and the optimizer
// (state in fp32) steps those. fp16 uses dynamic loss scaling: multiply the loss by
// scale_loss() before backward; step() unscales, and skips the step on inf/NaN.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm.h"
#include "tandem/no_sync.h"
#include "tandem/optim.h"
#include "tandem/precision.h"

namespace tandem {

// The optimizer ZeroDataParallel builds over the owned shard (LibTorch's own classes).
using ZeroOptimizerOptions = OptimizerOptions;

struct ZeroOptions {
  int stage = 1;  // 1: optimizer state sharded; 2: gradients too; 3: parameters too
  // Stages 1 and 2: gradients are flattened (reverse registration order) into buckets of at
  // most this many bytes (a single larger parameter gets a bucket of its own). Stage 3: one
  // bucket per unit (see below), whatever its size. Each bucket is padded to a multiple of
  // the world size and rank r owns the r-th chunk of every bucket. A full bucket's all-reduce
  // (stage 1) or reduce-scatter (stages 2, 3) starts during backward.
  int64_t bucket_cap_bytes = 8 * 1024 * 1024;
  // Clip the global gradient norm (computed across the shards) to this value; 0 = off.
  double max_grad_norm = 0.0;
  // Broadcast buffers (batch-norm running stats) from rank 0 in prepare_forward().
  bool broadcast_buffers = true;
  // Stages 2, 3: reduce-scatters left in flight while backward goes on (each holds its bucket's
  // gradient scratch); 0: each finishes before backward goes on. -1: 0 for stage 3 on CPU, 2
  // otherwise. On CPU the collective runs on the cores backward uses, so leaving it in flight
  // won no step time in our measurements, while each bucket in flight holds a whole unit's
  // gradient and raises backward's peak (docs/BENCHMARKS.md, the 8-block transformer).
  int max_inflight_buckets = -1;
  // Stage 3 units. When the module is a torch::nn::Sequential, each child that holds
  // parameters is a unit and forward() gathers it just before it runs (all-gathering the next
  // `prefetch` units meanwhile), frees it after, and gathers it again when the gradient of its
  // output arrives in backward. In any other module each ShardedUnit (below), at any depth, is
  // a unit handled the same way around its own forward, and the parameters outside every
  // ShardedUnit form the root unit, gathered by prepare_forward() and freed after backward (with
  // no ShardedUnit, that is the whole module).
  int prefetch = 1;
  // Mixed precision: the module is converted to compute_dtype(precision) at construction;
  // fp32 masters of the shard are taken from its values before the conversion.
  Precision precision = Precision::kFP32;
  LossScalerOptions loss_scaler;  // fp16 only
  ZeroOptimizerOptions optimizer;
};

// Per-rank bytes actually held (persistent tensors, after a step), and the ZeRO paper's model
// (Ψ = parameter count, N = world size, e = bytes per element of the parameters: 4 in fp32,
// 2 in bf16/fp16; masters and optimizer state are fp32):
//   parameters        stages 1, 2: eΨ          stage 3: eΨ/N
//   gradients         stage 1: eΨ              stages 2, 3: eΨ/N
//   optimizer state   (4K + (e == 2 ? 4 : 0))Ψ/N, K = state tensors (Adam 2, SGD+momentum 1)
//                     i.e. fp32 masters count as optimizer state, as in the paper (Adam in
//                     mixed precision: 2Ψ + 2Ψ + 12Ψ for no sharding).
// Measured values include the padding of each bucket to a multiple of N (< N elements per
// bucket) and nothing transient (bucket scratch and stage 3's gathered units are freed after
// backward; their peaks are reported separately).
struct ZeroMemory {
  int stage = 1;
  int world_size = 1;
  int64_t parameters = 0;  // Ψ
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_state_bytes = 0;  // optimizer state + fp32 masters
  int64_t master_bytes = 0;           // of which fp32 masters (0 in fp32)
  int64_t model_parameter_bytes = 0;
  int64_t model_gradient_bytes = 0;
  int64_t model_optimizer_state_bytes = 0;
  // Stages 2, 3: the most bucket scratch (local gradients on their way to the reduce-scatter)
  // alive at once during any backward so far; bounded by about max_inflight_buckets + 1
  // buckets, not the full gradient size. 0 for stage 1. gradient_bytes counts what is held
  // now: stages 2, 3 hold none from zero_grad() to the next backward.
  int64_t peak_scratch_bytes = 0;
  // Stage 3: the most bytes of gathered (full) unit parameters alive at once; 0 otherwise.
  int64_t peak_gathered_bytes = 0;
  // Stages 2, 3 on CPU with more than one rank: the block (symmetric memory on one node) that
  // scratch and gathered units are carved from, allocated once; and how many of those buffers
  // did not fit in it and took ordinary memory (collectives on them go through MPI's fifos).
  int64_t pool_bytes = 0;
  int64_t pool_misses = 0;
  int64_t total() const { return parameter_bytes + gradient_bytes + optimizer_state_bytes; }
  int64_t model_total() const { return model_parameter_bytes + model_gradient_bytes + model_optimizer_state_bytes; }
};

// What one rank owns of one parameter, as views (ZeroDataParallel::owned_pieces): elements
// [first, first + count) of the flattened parameter `name` are `value` (its fp32 master: the
// shard itself in fp32) and, per optimizer slot ("exp_avg", ...), the slot's elements.
struct ZeroOwnedPiece {
  std::string name;
  int64_t first = 0, count = 0;
  at::Tensor value;
  std::map<std::string, at::Tensor> slots;
};

// A block of a model that ZeRO-3 gathers as one unit around its forward (FSDP's wrapped
// module). LibTorch modules have no forward hooks, so the unit boundaries of a model that is
// not a Sequential are marked by wrapping: `blocks->push_back(tandem::ShardedUnit(Block(...)))`,
// then `blocks[i]->as<tandem::ShardedUnitImpl>()->forward(h)`. Units nest (a unit's parameters
// are those outside the units inside it). The wrapper takes the wrapped module's children,
// parameters and buffers as its own under the same names (as Checkpointed does), so parameter
// names and checkpoints are those of the unwrapped model; outside ZeRO-3 it is the wrapped
// module's forward.
class ShardedUnitImpl : public torch::nn::Module {
 public:
  explicit ShardedUnitImpl(torch::nn::AnyModule inner);
  template <typename M>
  explicit ShardedUnitImpl(torch::nn::ModuleHolder<M> inner)
      : ShardedUnitImpl(torch::nn::AnyModule(std::move(inner))) {}
  at::Tensor forward(const at::Tensor& x);
  void train(bool on = true) override;
  const torch::nn::AnyModule& inner() const { return inner_; }
  // Set by ZeroDataParallel (stage 3): runs the wrapped module with the unit gathered.
  using Runner = std::function<at::Tensor(torch::nn::AnyModule& inner, const at::Tensor& x)>;
  void set_runner(Runner run) { runner_ = std::move(run); }

 private:
  torch::nn::AnyModule inner_;
  Runner runner_;
};
TORCH_MODULE(ShardedUnit);

class ZeroDataParallel {
 public:
  // Collective. Checks that every rank has the same model, broadcasts parameters and buffers
  // from rank 0, moves the parameters into flat buffers (they become views of them), builds
  // the optimizer over this rank's shard and (stage 3) frees all but the shard. All
  // parameters that require grad must share one dtype and device. Throws
  // std::invalid_argument for a stage, precision or optimizer that cannot work.
  ZeroDataParallel(std::shared_ptr<torch::nn::Module> module, CommPtr comm, ZeroOptions opts = {});
  // Hybrid sharding (FSDP's HYBRID_SHARD, DeepSpeed's hpZ): ZeRO over `shard` (every all-gather
  // and reduce-scatter stays in it), replicated over `replicate`, the ranks of the other shard
  // groups that hold the same shard index: step() first averages each owned gradient chunk over
  // them (one all-reduce per bucket), so that every group steps the same values. Parameters
  // and buffers start as rank 0's of shard group 0. Null `replicate`, or one of size 1: plain
  // ZeRO over `shard`. Collective over both.
  ZeroDataParallel(std::shared_ptr<torch::nn::Module> module, CommPtr shard, CommPtr replicate, ZeroOptions opts);
  ~ZeroDataParallel();
  ZeroDataParallel(const ZeroDataParallel&) = delete;
  ZeroDataParallel& operator=(const ZeroDataParallel&) = delete;

  torch::nn::Module& module() { return *module_; }
  std::shared_ptr<torch::nn::Module> module_ptr() { return module_; }

  // Before each forward: synchronizes buffers; stage 3 with a module that is not a Sequential
  // gathers its parameters.
  void prepare_forward();
  // The module's forward. Stage 3 with a Sequential: unit by unit, gathering and freeing
  // parameters (the only correct way to run such a model: its parameters are not resident
  // outside). Otherwise the module's own forward (Sequential: input -> output tensor).
  at::Tensor forward(const at::Tensor& input);
  // The Sequential's children [first, end) only (a pipeline stage's chunk), unit by unit as
  // above for stage 3; std::invalid_argument for another module or a range out of bounds.
  at::Tensor forward(const at::Tensor& input, int64_t first, int64_t end);
  // The loss to call backward() on: loss * the loss scale (fp16), else loss itself.
  at::Tensor scale_loss(const at::Tensor& loss) const;
  // Zeroes the gradients (stage 1: the full flat buffer). Stages 2, 3 free this rank's gradient
  // chunks instead (PyTorch's set_to_none), so that forward runs without them; backward makes
  // them again.
  void zero_grad();
  // Stage 1, gradient accumulation: while the guard lives, backward adds into the full-size
  // local gradients and reduce-scatters nothing; the first backward after it ends
  // reduce-scatters everything accumulated (DeepSpeed's ZeRO-1 reduces at the accumulation
  // boundary too). Stages 2 and 3 keep no full-size gradient to accumulate into, so they
  // reduce-scatter after every backward; no_sync() throws std::invalid_argument for them.
  NoSyncGuard no_sync();
  // After one or more backward passes (gradients accumulate over them; call zero_grad()
  // before the first backward of every step): unscales
  // (fp16), checks for inf/NaN, clips (when max_grad_norm > 0), steps the owned shard, and
  // (stages 1, 2) all-gathers the parameters. Returns false when an fp16 overflow skipped
  // the step (the loss scale is backed off). `norm` >= 0: the caller's global gradient norm
  // (these parameters are part of a larger model) for the overflow check and clipping, instead
  // of the norm of these gradients.
  bool step(double norm = -1.0);

  void set_lr(double lr);
  double lr() const;
  // Global gradient norm before clipping, from the last step (-1 when clipping is off).
  double last_grad_norm() const;
  // Stage 3: seconds the calling thread has spent blocked on parameter all-gathers since
  // construction (forward and backward); 0 for stages 1 and 2. A rank's forward time less
  // what it waited there is its own compute, which --batch-shares auto compares across ranks.
  double gather_wait_seconds() const;
  // A model split over tensor-parallel ranks and/or pipeline stages (ZeRO over the data-parallel
  // group of one shard / stage): the norm for clipping and fp16's overflow check becomes the
  // whole model's, summing the parameters flagged in `sharded` (blocks of a larger tensor, tandem/placement.h: in the
  // module's parameter order) over `tp` and everything over `pp`, so that every shard and
  // stage clips by one coefficient and skips an overflowed step together. LARS and LAMB sum
  // the flagged parameters' norms over `tp` too. Either may be null. Collective in step() over
  // both groups.
  void set_model_parallel(const std::vector<bool>& sharded, CommPtr tp, CommPtr pp);
  // Squares of gradients outside this module (expert parallelism's experts, already summed over
  // every rank that holds a distinct part of them), added to the next step()'s global squared
  // norm before clipping, then forgotten.
  void add_squared_norm(double sq);
  const LossScaler& loss_scaler() const;
  Precision precision() const;
  // Stage 3: the number of units (1 for a module that is not a Sequential); 0 otherwise.
  int units() const;
  // Stage 3: scalars of the frozen parameters (requires_grad false) it shards; 0 otherwise.
  int64_t frozen_numel() const;

  ZeroMemory memory() const;
  int stage() const;
  // Elements of this rank's shard (padding included) and of the padded flat buffer.
  int64_t shard_numel() const;
  int64_t padded_numel() const;
  // The optimizer over the shard (its parameters are views of the owned chunks).
  torch::optim::Optimizer& optimizer();

  // State that moves (checkpoints, initial values), without copies: every piece of a parameter
  // this rank owns, as views of its masters and optimizer state. Write them, then call
  // refresh_from_shards(). Local.
  std::vector<ZeroOwnedPiece> owned_pieces();
  int64_t optimizer_step() const;  // Adam's step count (0 for SGD or before the first step)
  // Replaces the optimizer state of the owned chunks by zeros in `slots` with this step count
  // (none when `slots` is empty), for a load to write into. Local.
  void reset_optimizer_state(const std::vector<std::string>& slots, int64_t step);
  // After the owned masters were written: the compute-dtype shards follow them, stages 1 and 2
  // all-gather the whole parameters (collective over the communicator), stage 3 frees what it
  // had gathered.
  void refresh_from_shards();
  // Restores the fp16 loss scaler (no effect on the scale for fp32/bf16).
  void restore_loss_scaler(double scale, int64_t overflow_free_steps, int64_t skipped_steps);

  struct Impl;

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem
