// Context parallelism: every sequence split over the ranks of a cp communicator
// (ProcessGrid::cp()), attention computed as ring attention (Liu et al. 2023): the key/value
// blocks travel around the ring while each rank attends its queries to the block it holds,
// accumulating with an online softmax, and their gradients travel back the same way.
//
// Layout (load-balanced causal masking, as Megatron-core and torchtitan): a sequence of T tokens
// is cut into 2C chunks of T/(2C); rank r of C holds chunks r and 2C-1-r, in that order. Every
// rank then has the same share of the causal attention's work. Positions (RoPE) are the global
// ones (positions()). T must be a multiple of 2C.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "tandem/comm.h"

namespace tandem::cp {

// Throws std::invalid_argument naming T, the cp size and the rule unless 2 * size divides T.
void check_length(int64_t T, int size);

// The global positions [T/C] (int64) of rank `rank`'s tokens of a sequence of T = C * local_len.
at::Tensor positions(int64_t local_len, int rank, int size);

// This rank's tokens of `x` along `dim` (a copy; autograd flows through it): chunks rank and
// 2 * size - 1 - rank of 2 * size. Throws as check_length for a length not a multiple of 2C.
at::Tensor split_sequence(const at::Tensor& x, int64_t dim, int rank, int size);

// The whole sequence along `dim` from every rank's split_sequence part (collective over `cp`).
// Autograd: the gradient of this rank's part is its slice of the output's gradient times
// grad_scale (every rank back-propagates the same loss of the whole sequence, and each sends
// back only its own tokens' share).
at::Tensor gather_sequence(const at::Tensor& x, int64_t dim, const CommPtr& cp, double grad_scale = 1.0);

// Causal attention of this rank's queries over the whole sequence (collective over `cp`, ranks
// in the layout above). q [B, H, L, D], k and v [B, KV, L, D] with KV dividing H (each key/value
// head serves H/KV consecutive query heads), L = T/C; rotary already applied at the global
// positions. Returns [B, H, L, D] = softmax(q k^T / sqrt(D), causal) v over the whole sequence.
// Forward: C steps; the next block's transfer (k and v of the previous rank) runs while this
// block is computed. Backward: the key/value blocks travel again, each with its accumulated
// gradient, which reaches its owner after C steps. Softmax statistics in float32 (float64 for
// float64 inputs).
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CommPtr& cp);

// Seconds of this thread's ring transfers, and the part that was waited for (not hidden behind
// a block's compute), since the last reset: the hidden share is 1 - exposed / total.
struct RingStats {
  double transfer_seconds = 0.0;
  double exposed_seconds = 0.0;
  int64_t bytes = 0;  // bytes sent
};
RingStats ring_stats();
void reset_ring_stats();

// A layer whose forward depends on where its tokens lie in the sequence (attention, positions)
// implements this; tandem::Engine calls it on every child of the (tensor-parallel) Sequential
// when ParallelConfig::cp > 1, and refuses a model with a tensor-parallel layer
// (tp::Parallelizable) that does not implement it, whose forward would see only its own part.
class ContextParallel {
 public:
  virtual ~ContextParallel() = default;
  virtual void use_context_parallel(const CommPtr& cp) = 0;
};

}  // namespace tandem::cp
