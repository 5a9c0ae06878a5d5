// Helpers shared by the strategy tests (DDP, ZeRO): a deterministic global batch, each rank's
// slice of it, the relative error against a reference, and a small transformer.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "tandem/models.h"

namespace tandem::test {

// n samples of 13 features and labels in [0, classes), the same on every rank for a seed.
inline std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t n, uint64_t seed, int64_t classes) {
  auto g = at::detail::createCPUGenerator(seed);
  return {torch::randn({n, 13}, g), torch::randint(0, classes, {n}, g)};
}

// Rank r's contiguous share of a global batch split evenly over `world` ranks.
inline torch::Tensor slice_for_rank(const torch::Tensor& t, int rank, int world) {
  int64_t b = t.size(0) / world;
  return t.narrow(0, rank * b, b);
}

// ||a - b|| / ||b|| in float64.
inline double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  auto d = (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>();
  auto r = b.to(torch::kDouble).norm().item<double>();
  return d / std::max(r, 1e-30);
}

// A transformer small enough for the tests, split evenly over 1, 2 or 4 tensor-parallel ranks.
inline models::TransformerConfig small_lm() {
  models::TransformerConfig c;
  c.vocab = 20;
  c.d_model = 16;
  c.heads = 4;
  c.layers = 2;
  c.seq = 6;
  c.mlp_ratio = 2;
  return c;
}

}  // namespace tandem::test
