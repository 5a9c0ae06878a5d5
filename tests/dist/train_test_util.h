// Helpers shared by the strategy tests (DDP, ZeRO): a deterministic global batch, each rank's
// slice of it, the relative error against a reference, a small transformer, and a directory
// for checkpoints.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tandem/comm.h"
#include "tandem/models.h"
#include "tandem/optim.h"

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
// AdamW: two moments and a step count for the tests to carry across layouts.
inline OptimizerOptions adamw(double lr = 1e-2, double weight_decay = 0.01) {
  OptimizerOptions o;
  o.kind = "adamw";
  o.lr = lr;
  o.weight_decay = weight_decay;
  return o;
}

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

// Calls `build` (constructing what must be refused) and expects std::invalid_argument whose
// message contains `needle`.
template <typename Build>
void expect_invalid_argument(Build&& build, const std::string& needle) {
  try {
    build();
    ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A new directory /tmp/tandem_<tag>_XXXXXX that every rank of `comm` agrees on (rank 0 makes
// it). std::filesystem's remove_all is not used: pip torch's libstdc++ mix makes it crash.
inline std::string shared_dir(Communicator& comm, const std::string& tag) {
  auto buf = torch::zeros({256}, torch::kUInt8);
  if (comm.rank() == 0) {
    std::string tmpl = "/tmp/tandem_" + tag + "_XXXXXX";
    std::vector<char> t(tmpl.begin(), tmpl.end());
    t.push_back('\0');
    if (!::mkdtemp(t.data())) throw std::runtime_error("mkdtemp failed");
    std::memcpy(buf.data_ptr(), t.data(), t.size());
  }
  comm.broadcast(buf, 0);
  return std::string(reinterpret_cast<const char*>(buf.data_ptr()));
}

}  // namespace tandem::test
