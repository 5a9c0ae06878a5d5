// Data parallelism: DistributedDataParallel wraps any torch::nn::Module so that every rank
// holds the same replica and, after loss.backward() returns, every parameter's .grad() holds
// the gradient averaged over all ranks. Gradients are packed into buckets as autograd
// produces them and each full bucket's all-reduce starts at once, overlapping the rest of
// backward (PyTorch DDP's design: reverse registration order, small first bucket, buckets
// rebuilt after the first iteration from the order gradients actually arrived).
// The average is unweighted: when ranks take unequal numbers of samples (heterogeneous
// clusters), multiply each rank's mean loss by share_loss_weight(n_r, N, world) from
// tandem/shares.h (world * n_r / N) before backward; the averaged gradient is then the
// gradient of the mean loss over all N samples (the same holds for ZeroDataParallel).
#pragma once

#include <torch/nn/module.h>

#include <c10/util/Optional.h>

#include <memory>
#include <string>
#include <vector>

#include "tandem/no_sync.h"

#include "tandem/comm.h"

namespace tandem {

// PowerSGD (Vogels et al., NeurIPS 2019; PyTorch's powerSGD_hook): each gradient viewed as a
// matrix M, n x m (a convolution kernel [out, in, kh, kw] as [out, in * kh * kw]), travels as
// two rank-r factors. Per bucket: P = M Q for each of its matrices, one all-reduce (average) of
// all its P's together with the bucket's tensors that are not compressed, P orthonormalised
// (QR), Q = M^T P, one all-reduce (average) of all its Q's, and M is replaced by P Q^T: the
// projection of the average gradient onto the shared column space. Error feedback: each rank
// adds to its next gradient the part of this one the projection left out (M - P Q_local^T),
// so nothing is lost, only delayed. Warm start: Q is kept from step to step, so one power
// iteration per step tracks the dominant subspace; its first value is drawn from `seed`, the
// same on every rank. Compressed: tensors of 2 or more dimensions where the factors are
// smaller, (n + m) r * min_compression_rate < n m (r clipped to min(n, m)); the others
// (biases, small matrices) are all-reduced as they are, in the P all-reduce.
// The residuals and Q live in memory only: a resume from a checkpoint starts them afresh (zero
// residual, a new Q from the seed, start_step uncompressed steps again), as PyTorch's hook does.
struct PowerSGDOptions {
  int64_t rank = 1;  // r, the approximation's rank (>= 1)
  // Synchronized steps averaged uncompressed before compression starts (PyTorch's
  // start_powerSGD_iter): the first steps' gradients are the largest and change fastest, and a
  // residual carried from them would be applied with a delay when it is stale.
  int64_t start_step = 10;
  // Compress a matrix only when it shrinks at least this much (PyTorch's default 2: below that
  // the extra compute and the approximation cost more than the bytes saved). 0: every matrix.
  double min_compression_rate = 2.0;
  uint64_t seed = 0;  // Q's first values, drawn on every rank alike
};

struct DDPOptions {
  int64_t bucket_cap_bytes = 25 * 1024 * 1024;
  // A small first bucket lets communication start early in backward. 0 = automatic: 1 MiB for
  // CUDA tensors (NCCL runs beside the compute), the full cap for CPU tensors, where the
  // all-reduce needs the very cores backward is using and an early bucket only adds
  // contention (measured: docs/BENCHMARKS.md, "DDP bucket policy on CPU").
  int64_t first_bucket_bytes = 0;
  // Re-plan buckets after the first step from the order gradients arrived in.
  bool rebuild_buckets = true;
  // Parameters that get no gradient in a step: true = treat them as zero gradients (after a
  // check that costs one traversal of the graph); false = throw, naming them.
  bool find_unused_parameters = false;
  // Broadcast buffers (e.g. batch-norm running stats) from rank 0 before each forward.
  bool broadcast_buffers = true;
  // Gradients on the wire in this dtype (bf16/fp16) instead of the parameters' dtype.
  c10::optional<at::ScalarType> compress_dtype;
  // Low-rank gradient compression (above), instead of compress_dtype.
  c10::optional<PowerSGDOptions> powersgd;
  // false: all-reduce every bucket only after backward has finished (no overlap; for
  // measuring how much overlap hides).
  bool overlap = true;
  // false: no communication at all (each rank keeps its local gradient; for measuring the
  // compute-only ceiling of a speedup). Never use for real training.
  bool communicate = true;
};

// Per-step accounting, reset by DistributedDataParallel::reset_stats().
struct DDPStats {
  int64_t steps = 0;
  int64_t buckets = 0;           // buckets in the current plan
  int64_t bytes = 0;             // bytes all-reduced by this rank (as sent: compressed)
  double comm_seconds = 0.0;     // time at least one all-reduce was running on the engine
  double exposed_seconds = 0.0;  // time backward's end waited for communication
  // Share of communication hidden behind backward: 1 - exposed / comm (0 when no comm).
  double hidden_fraction() const;
};

class DistributedDataParallel {
 public:
  // Broadcasts parameters and buffers from rank 0 and checks that every rank has the same
  // parameter names, shapes and dtypes; throws naming the first mismatch.
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, CommPtr comm, DDPOptions opts = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  torch::nn::Module& module() { return *module_; }
  std::shared_ptr<torch::nn::Module> module_ptr() { return module_; }

  // Call before each forward: synchronizes buffers and arms the gradient hooks for the step.
  void prepare_forward();

  // Zeroes every gradient in place (one memset per bucket). Use this, or the optimizer's
  // zero_grad() with its default set_to_none=true; zero_grad(false) cannot detach the
  // gradients, which are views into the buckets after the first step.
  void zero_grad();

  // Gradient accumulation: while the guard lives, backward accumulates local gradients and
  // communicates nothing; the first backward after it ends averages everything accumulated.
  using NoSyncGuard = tandem::NoSyncGuard;
  NoSyncGuard no_sync();

  // Names of the buckets' parameters in the current plan (for tests and reports).
  std::vector<std::vector<std::string>> bucket_plan() const;

  DDPStats stats() const;
  void reset_stats();

  // PowerSGD: this rank's error-feedback residual of each parameter (registration order), to be
  // added to its next gradient; undefined for parameters sent uncompressed and before the first
  // compressed step. Empty without PowerSGD.
  std::vector<at::Tensor> powersgd_residuals() const;

  struct Impl;

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem
