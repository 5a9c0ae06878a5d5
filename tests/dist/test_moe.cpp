// Expert parallelism (tandem/moe.h): a SparseMoeBlock whose experts are spread over the world
// (ep = world size, run with 2 and 4 ranks) against the full block on every rank, each rank with
// its own tokens, in float64: outputs, the input's and router's gradients equal, each local
// expert's gradient the sum over ranks of the full block's; capacity drops and auxiliary losses;
// a rank the router sends nothing, a rank without tokens; experts that ep does not divide.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "tandem/moe.h"
#include "tests/dist/dist_env.h"
#include "tests/unit/moe_test_util.h"

namespace tandem::test {
namespace {

using moe::MoeConfig;
using moe::SparseMoeBlock;

constexpr double kTol = 1e-10;

// The same weights on every rank (same seed), float64.
SparseMoeBlock full_block(const MoeConfig& c, uint64_t seed) { return moe_block(c, moe::make_router_log(1), 0, seed); }

at::Tensor rank_randn(std::vector<int64_t> shape, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return torch::randn(shape, g, torch::kDouble);
}

// Runs `x` through an expert-parallel copy of `ref`'s weights and through `ref` itself, and
// checks outputs, gradients and statistics.
void check_against_full(const MoeConfig& c, const SparseMoeBlock& ref_in, const at::Tensor& x0, uint64_t seed) {
  auto comm = world();
  const int ranks = comm->size(), me = comm->rank();
  SparseMoeBlock ref = ref_in;
  auto ep = full_block(c, seed);
  copy_moe_weights(ref, ep);
  const auto locals = ep->use_expert_parallel(comm);
  const int64_t per = c.num_experts / ranks;
  EXPECT_EQ(static_cast<int64_t>(locals.size()), per);
  EXPECT_EQ(locals.at(0).name, "experts." + std::to_string(me * per));
  EXPECT_EQ(ep->first_local, me * per);
  EXPECT_EQ(ep->named_parameters().keys(), std::vector<std::string>{"gate.weight"}) << "experts unregistered";

  const auto gy = rank_randn(x0.sizes().vec(), 500 + me);
  auto x = x0.clone().requires_grad_(true), xr = x0.clone().requires_grad_(true);
  moe::reset_moe_stats();
  const auto y = ep->forward(x);
  (y * gy).sum().backward();
  const auto got = moe::moe_stats();
  moe::reset_moe_stats();
  const auto yr = ref->forward(xr);
  (yr * gy).sum().backward();
  const auto want = moe::moe_stats();

  EXPECT_LE(moe_rel(y, yr), kTol);
  EXPECT_LE(moe_rel(x.grad(), xr.grad()), kTol);
  EXPECT_LE(moe_rel(ep->gate->weight.grad(), ref->gate->weight.grad()), kTol);
  // Every expert's gradient summed over the ranks (all ranks reduce all experts, in order); the
  // local experts' against it.
  for (int64_t e = 0; e < c.num_experts; ++e) {
    auto full = ref->experts[static_cast<size_t>(e)]->as<moe::ExpertImpl>();
    const bool local = e >= me * per && e < (me + 1) * per;
    auto mine = local ? ep->local[static_cast<size_t>(e - me * per)] : moe::Expert(nullptr);
    const std::vector<std::pair<torch::nn::Linear, torch::nn::Linear>> pairs{{local ? mine->w1 : nullptr, full->w1},
                                                                             {local ? mine->w2 : nullptr, full->w2},
                                                                             {local ? mine->w3 : nullptr, full->w3}};
    for (const auto& [a, b] : pairs) {
      auto summed = b->weight.grad().clone();
      comm->allreduce(summed);
      if (!local) continue;
      EXPECT_TRUE(a->weight.grad().defined()) << "local expert " << e;
      if (a->weight.grad().defined()) EXPECT_LE(moe_rel(a->weight.grad(), summed), kTol) << "local expert " << e;
    }
  }
  EXPECT_EQ(got.tokens_per_expert, want.tokens_per_expert);
  EXPECT_EQ(got.routed, want.routed);
  EXPECT_EQ(got.dropped, want.dropped);
  EXPECT_DOUBLE_EQ(got.aux_loss_sum, want.aux_loss_sum);
  EXPECT_GT(got.all_to_alls, 0);
}

TEST(ExpertParallel, MatchesTheFullBlockOnEveryRank) {
  const int ranks = world()->size(), me = world()->rank();
  MoeConfig c{6, 5, 2 * ranks, 2};
  // Unequal token counts per rank.
  const auto x = rank_randn({2, 3 + me, 6}, 100 + me);
  check_against_full(c, full_block(c, 7), x, 7);
}

TEST(ExpertParallel, CapacityAndAuxiliaryLossesAsTheFullBlock) {
  const int ranks = world()->size(), me = world()->rank();
  MoeConfig c{6, 5, 2 * ranks, 3};
  c.capacity_factor = 0.75;
  c.aux_loss_coef = 0.2;
  c.z_loss_coef = 0.05;
  for (auto form : {moe::AuxLossForm::kPooled, moe::AuxLossForm::kPerLayer}) {
    c.aux_form = form;
    const auto x = rank_randn({9 + 2 * me, 6}, 200 + me);
    check_against_full(c, full_block(c, 8), x, 8);
  }
}

TEST(ExpertParallel, RankSentNothingAndRankWithoutTokens) {
  // The router sends every token to rank 0's experts (x > 0, their gate rows positive, the
  // others negative): the other ranks receive nothing. The last rank has no tokens at all.
  const int ranks = world()->size(), me = world()->rank();
  MoeConfig c{6, 5, 2 * ranks, 2};
  auto ref = full_block(c, 9);
  {
    torch::NoGradGuard no_grad;
    ref->gate->weight.abs_();
    ref->gate->weight.narrow(0, 2, c.num_experts - 2).neg_();
  }
  const int64_t rows = me == ranks - 1 ? 0 : 4 + me;
  const auto x = rank_randn({rows, 6}, 300 + me).abs() + 0.1;
  check_against_full(c, ref, x, 9);
}

TEST(ExpertParallel, RefusesExpertsThatEpDoesNotDivide) {
  const int ranks = world()->size();
  MoeConfig c{6, 5, ranks + 1, 1};
  auto b = full_block(c, 1);
  try {
    b->use_expert_parallel(world());
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("num_local_experts " + std::to_string(ranks + 1)), std::string::npos) << m;
    EXPECT_NE(m.find("--ep " + std::to_string(ranks)), std::string::npos) << m;
  }
  EXPECT_EQ(b->named_parameters().size(), static_cast<size_t>(1 + 3 * (ranks + 1))) << "left as it was";
  EXPECT_EQ(b->ep, nullptr);
}

}  // namespace
}  // namespace tandem::test
