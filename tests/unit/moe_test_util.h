// Helpers of the MoE tests (unit and dist): float64 blocks with chosen weights, relative errors.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "tandem/moe.h"

namespace tandem::test {

// max |a - b| relative to the larger of max |b| and 1e-6: with top-1 routing the router's
// gradient is zero up to rounding (the renormalised score is p / p). Empty tensors agree.
inline double moe_rel(const at::Tensor& a, const at::Tensor& b) {
  if (b.numel() == 0) return a.numel() == 0 ? 0.0 : 1.0;
  return (a - b).abs().max().item<double>() / std::max(1e-6, b.abs().max().item<double>());
}

// A float64 block initialised from `seed` (the same weights on every rank for the same seed).
inline moe::SparseMoeBlock moe_block(const moe::MoeConfig& c, const std::shared_ptr<moe::RouterLog>& log, int64_t layer,
                                     uint64_t seed) {
  torch::manual_seed(seed);
  moe::SparseMoeBlock b(c, log, layer);
  b->to(torch::kDouble);
  return b;
}

// `to` takes `from`'s parameter values, by name.
inline void copy_moe_weights(moe::SparseMoeBlock from, moe::SparseMoeBlock to) {
  torch::NoGradGuard no_grad;
  auto src = from->named_parameters();
  for (auto& p : to->named_parameters()) p.value().copy_(src[p.key()]);
}

}  // namespace tandem::test
