// ZeRO stages 1 and 2 (Rajbhandari et al., DeepSpeed): data parallelism whose optimizer
// state (stage 1) and also gradients (stage 2) are partitioned over the ranks. Every rank
// keeps a full copy of the parameters; rank r steps only the 1/N it owns, then the updated
// parameters are all-gathered. In fp32 with elementwise optimizers (SGD, Adam, AdamW) a step
// gives the same result as DistributedDataParallel followed by the same optimizer.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>

#include "tandem/comm.h"

namespace tandem {

// The optimizer ZeroDataParallel builds over the owned shard (LibTorch's own classes).
struct ZeroOptimizerOptions {
  std::string kind = "adamw";  // sgd | adam | adamw
  double lr = 1e-3;
  double momentum = 0.0;      // sgd
  bool nesterov = false;      // sgd
  double weight_decay = 0.0;  // sgd and adam: L2 added to the gradient; adamw: decoupled
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adam, adamw
};

struct ZeroOptions {
  int stage = 1;  // 1: optimizer state sharded; 2: gradients sharded too
  // Gradients are flattened (reverse registration order) into buckets of at most this many
  // bytes (a single larger parameter gets a bucket of its own); each bucket is padded to a
  // multiple of the world size and rank r owns the r-th chunk of every bucket. A full
  // bucket's all-reduce (stage 1) or reduce-scatter (stage 2) starts during backward.
  int64_t bucket_cap_bytes = 8 * 1024 * 1024;
  // Clip the global gradient norm (computed across the shards) to this value; 0 = off.
  double max_grad_norm = 0.0;
  // Broadcast buffers (batch-norm running stats) from rank 0 in prepare_forward().
  bool broadcast_buffers = true;
  // Stage 2: reduce-scatters in flight at once (each holds one bucket of gradient scratch).
  int max_inflight_buckets = 2;
  ZeroOptimizerOptions optimizer;
};

// Per-rank bytes actually held (persistent tensors, after a step), and the ZeRO paper's model.
// Model (fp32 everywhere, Ψ = parameter count, N = world size, 4-byte elements):
//   parameters        4Ψ            (a full replica on every rank, both stages)
//   gradients         stage 1: 4Ψ   stage 2: 4Ψ/N
//   optimizer state   Adam/AdamW: 8Ψ/N (exp_avg, exp_avg_sq); SGD with momentum: 4Ψ/N; else 0
// Measured values include the padding of each bucket to a multiple of N (< N elements per
// bucket) and nothing transient (stage 2's in-flight bucket scratch is freed after backward).
struct ZeroMemory {
  int stage = 1;
  int world_size = 1;
  int64_t parameters = 0;  // Ψ
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_state_bytes = 0;
  int64_t model_parameter_bytes = 0;
  int64_t model_gradient_bytes = 0;
  int64_t model_optimizer_state_bytes = 0;
  // Stage 2: the most bucket scratch (local gradients on their way to the reduce-scatter)
  // alive at once during any backward so far; bounded by about max_inflight_buckets + 1
  // buckets, not the full gradient size. 0 for stage 1.
  int64_t peak_scratch_bytes = 0;
  int64_t total() const { return parameter_bytes + gradient_bytes + optimizer_state_bytes; }
  int64_t model_total() const { return model_parameter_bytes + model_gradient_bytes + model_optimizer_state_bytes; }
};

// Bytes of the tensors in an optimizer's state (SGD momentum buffers, Adam moments); for
// comparing a plain (unsharded) optimizer with ZeroDataParallel's.
int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt);

class ZeroDataParallel {
 public:
  // Collective. Checks that every rank has the same model, broadcasts parameters and buffers
  // from rank 0, moves the parameters into one flat buffer (they become views of it) and
  // builds the optimizer over this rank's shard. All parameters that require grad must share
  // one dtype and device.
  ZeroDataParallel(std::shared_ptr<torch::nn::Module> module, CommPtr comm, ZeroOptions opts = {});
  ~ZeroDataParallel();
  ZeroDataParallel(const ZeroDataParallel&) = delete;
  ZeroDataParallel& operator=(const ZeroDataParallel&) = delete;

  torch::nn::Module& module() { return *module_; }
  std::shared_ptr<torch::nn::Module> module_ptr() { return module_; }

  // Before each forward: synchronizes buffers and arms the gradient hooks.
  void prepare_forward();
  // Zeroes the gradients (stage 1: the full flat buffer; stage 2: this rank's shard).
  void zero_grad();
  // After one loss.backward(): clips (when max_grad_norm > 0), steps the owned shard, and
  // all-gathers the parameters. Stage 2 supports one backward per step (no accumulation).
  void step();

  void set_lr(double lr);
  double lr() const;
  // Global gradient norm before clipping, from the last step (-1 when clipping is off).
  double last_grad_norm() const;

  ZeroMemory memory() const;
  int stage() const;
  // Elements of this rank's shard (padding included) and of the padded flat buffer.
  int64_t shard_numel() const;
  int64_t padded_numel() const;
  // The optimizer over the shard (its parameters are views of the owned chunks).
  torch::optim::Optimizer& optimizer();

  struct Impl;

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem
