// The tensor-parallel form of the sparse MoE block (tandem/moe.h) on thread communicators, float64,
// against the dense block: outputs, the input's, the router's and every expert part's gradient
// (auxiliary and z-losses, capacity drops included), with and without sequence parallelism; the
// parts' placements; and tp 2 x ep 2 against the dense block of each ep rank's tokens.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "tandem/backends.h"
#include "tandem/comm.h"
#include "tandem/moe.h"
#include "tandem/placement.h"
#include "tests/unit/moe_test_util.h"
#include "tests/unit/thread_ranks.h"

namespace tandem::test {
namespace {

using moe::MoeConfig;
using moe::SparseMoeBlock;

constexpr double kTol = 1e-10;

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return torch::randn(shape, g, torch::kDouble);
}

moe::ExpertImpl& expert(SparseMoeBlock b, int64_t e) {
  return *b->experts[static_cast<size_t>(e)]->as<moe::ExpertImpl>();
}

// Part `r` of `parts` of each of the dense expert's gradients: w1 and w3 rows, w2 columns.
void expect_part_gradients(const moe::ExpertImpl& part, const moe::ExpertImpl& dense, int r, int parts,
                           const std::string& where) {
  const int64_t n = dense.w1->weight.size(0) / parts;
  ASSERT_TRUE(part.w1->weight.grad().defined()) << where;
  EXPECT_LE(moe_rel(part.w1->weight.grad(), dense.w1->weight.grad().narrow(0, r * n, n)), kTol) << where << " w1";
  EXPECT_LE(moe_rel(part.w3->weight.grad(), dense.w3->weight.grad().narrow(0, r * n, n)), kTol) << where << " w3";
  EXPECT_LE(moe_rel(part.w2->weight.grad(), dense.w2->weight.grad().narrow(1, r * n, n)), kTol) << where << " w2";
}

struct Case {
  MoeConfig config;
  int tp = 2;
  bool sequence_parallel = false;
};

// The dense block on x [2, T, hidden] with output gradient gy, then its tp form on `tp` threads
// (each from its own dense copy, as each process holds one), every rank given x whole or, with
// sequence parallelism, its sequence shard.
void check_against_dense(const Case& k) {
  const auto& c = k.config;
  const int64_t T = 4 * k.tp;
  const auto x0 = randn({2, T, c.hidden_size}, 21), gy = randn({2, T, c.hidden_size}, 22);
  auto ref = moe_block(c, moe::make_router_log(1), 0, 5);
  auto xr = x0.clone().requires_grad_(true);
  moe::reset_moe_stats();
  auto yr = ref->forward(xr);
  (yr * gy).sum().backward();
  const auto want = moe::moe_stats();

  const auto comms = make_thread_communicators(k.tp, CommOptions{});
  std::vector<SparseMoeBlock> dense, parts;
  for (int r = 0; r < k.tp; ++r) {
    dense.push_back(moe_block(c, moe::make_router_log(1), 0, 5));
    parts.emplace_back(*dense.back(), comms[static_cast<size_t>(r)]);
    parts.back()->sequence_parallel = k.sequence_parallel;
  }
  on_threads(comms, [&](const CommPtr&, int r) {
    const std::string where = "tp rank " + std::to_string(r);
    auto& b = parts[static_cast<size_t>(r)];
    const int64_t s = k.sequence_parallel ? T / k.tp : T, at = k.sequence_parallel ? r * s : 0;
    auto x = x0.narrow(1, at, s).clone().requires_grad_(true);
    moe::reset_moe_stats();
    auto y = b->forward(x);
    (y * gy.narrow(1, at, s)).sum().backward();
    const auto got = moe::moe_stats();
    EXPECT_LE(moe_rel(y, yr.narrow(1, at, s)), kTol) << where;
    EXPECT_LE(moe_rel(x.grad(), xr.grad().narrow(1, at, s)), kTol) << where;
    EXPECT_LE(moe_rel(b->gate->weight.grad(), ref->gate->weight.grad()), kTol) << where << " gate";
    for (int64_t e = 0; e < c.num_experts; ++e)
      expect_part_gradients(expert(b, e), expert(ref, e), r, k.tp, where + " expert " + std::to_string(e));
    EXPECT_EQ(got.tokens_per_expert, want.tokens_per_expert) << where;
    EXPECT_EQ(got.dropped, want.dropped) << where;
    EXPECT_DOUBLE_EQ(got.aux_loss_sum, want.aux_loss_sum) << where;
    EXPECT_DOUBLE_EQ(got.z_loss_sum, want.z_loss_sum) << where;
  });
}

TEST(MoeTensorParallel, MatchesTheDenseBlock) {
  for (int tp : {2, 3}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    check_against_dense({MoeConfig{6, 6, 4, 2}, tp});
  }
}

TEST(MoeTensorParallel, AuxiliaryLossesAndCapacityAsTheDenseBlock) {
  MoeConfig c{6, 4, 5, 2};
  c.aux_loss_coef = 0.3;
  c.z_loss_coef = 0.1;
  c.capacity_factor = 0.6;
  for (auto form : {moe::AuxLossForm::kPooled, moe::AuxLossForm::kPerLayer}) {
    c.aux_form = form;
    SCOPED_TRACE(moe::to_string(form));
    check_against_dense({c, 2});
  }
}

TEST(MoeTensorParallel, SequenceParallelAsTheDenseBlock) {
  MoeConfig c{6, 6, 4, 2};
  c.aux_loss_coef = 0.2;
  check_against_dense({c, 2, /*sequence_parallel=*/true});
}

TEST(MoeTensorParallel, PartsArePlacedAsBlocksOfTheDenseWeights) {
  MoeConfig c{6, 4, 3, 1};
  auto dense = moe_block(c, moe::make_router_log(1), 0, 1);
  const auto comms = make_thread_communicators(2, CommOptions{});
  SparseMoeBlock part(*dense, comms[1]);
  std::map<std::string, Placement> placed;
  for (auto& p : parameter_placements(*part, 0)) placed[p.name] = p.placement;
  EXPECT_EQ(placed.at("experts.2.w1.weight"), Placement::split({4, 6}, 0, 1, 2));
  EXPECT_EQ(placed.at("experts.2.w3.weight"), Placement::split({4, 6}, 0, 1, 2));
  EXPECT_EQ(placed.at("experts.0.w2.weight"), Placement::split({6, 4}, 1, 1, 2));
  EXPECT_EQ(placed.at("gate.weight"), Placement::whole({3, 6}));
  EXPECT_TRUE(part->gate->weight.is_same(dense->gate->weight)) << "the router is the dense block's";
  EXPECT_EQ(expert(dense, 0).w1->weight.size(0), 4) << "the dense block is left whole";
  // A width tp does not divide is refused, naming it.
  const auto three = make_thread_communicators(3, CommOptions{});
  try {
    SparseMoeBlock bad(*dense, three[0]);
    FAIL() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("intermediate_size"), std::string::npos) << e.what();
  }
  // Made before expert parallelism only.
  dense->use_expert_parallel(make_thread_communicators(1, CommOptions{})[0]);
  EXPECT_THROW(SparseMoeBlock(*dense, comms[0]), std::logic_error);
}

// tp 2 x ep 2 on 4 threads: tp groups {0, 1} and {2, 3} (ep ranks 0 and 1), ep groups {0, 2} and
// {1, 3}; each tp group routes its own tokens. Each rank matches the dense block on its group's
// tokens, and each of its expert parts the sum over the ep ranks of the dense blocks' gradients.
TEST(MoeTensorParallel, ComposesWithExpertParallelism) {
  MoeConfig c{6, 4, 4, 2};
  c.aux_loss_coef = 0.1;
  const int64_t T = 6;
  std::vector<SparseMoeBlock> ref;
  std::vector<at::Tensor> xs, gys, xgrads, ys;
  for (int g = 0; g < 2; ++g) {
    ref.push_back(moe_block(c, moe::make_router_log(1), 0, 9));
    xs.push_back(randn({1 + g, T, 6}, 40 + g));
    gys.push_back(randn({1 + g, T, 6}, 50 + g));
    auto x = xs.back().clone().requires_grad_(true);
    auto y = ref.back()->forward(x);
    (y * gys.back()).sum().backward();
    ys.push_back(y.detach());
    xgrads.push_back(x.grad());
  }
  const auto world = make_thread_communicators(4, CommOptions{});
  std::vector<CommPtr> tp(4), ep(4);
  on_threads(world, [&](const CommPtr& w, int r) {
    tp[static_cast<size_t>(r)] = w->split(/*color=*/r / 2, /*key=*/r % 2);
    ep[static_cast<size_t>(r)] = w->split(/*color=*/r % 2, /*key=*/r / 2);
  });
  std::vector<SparseMoeBlock> dense, parts;
  for (int r = 0; r < 4; ++r) {
    dense.push_back(moe_block(c, moe::make_router_log(1), 0, 9));
    parts.emplace_back(*dense.back(), tp[static_cast<size_t>(r)]);
  }
  on_threads(world, [&](const CommPtr&, int r) {
    const int g = r / 2, part = r % 2;
    const std::string where = "rank " + std::to_string(r);
    auto& b = parts[static_cast<size_t>(r)];
    const auto locals = b->use_expert_parallel(ep[static_cast<size_t>(r)]);
    ASSERT_EQ(locals.size(), 2u);
    EXPECT_EQ(locals[0].name, "experts." + std::to_string(2 * g));
    auto x = xs[static_cast<size_t>(g)].clone().requires_grad_(true);
    auto y = b->forward(x);
    (y * gys[static_cast<size_t>(g)]).sum().backward();
    EXPECT_LE(moe_rel(y, ys[static_cast<size_t>(g)]), kTol) << where;
    EXPECT_LE(moe_rel(x.grad(), xgrads[static_cast<size_t>(g)]), kTol) << where;
    EXPECT_LE(moe_rel(b->gate->weight.grad(), ref[static_cast<size_t>(g)]->gate->weight.grad()), kTol) << where;
    for (size_t i = 0; i < locals.size(); ++i) {
      const int64_t e = 2 * g + static_cast<int64_t>(i);
      auto& mine = *b->local[i];
      auto& a = expert(ref[0], e);
      auto& z = expert(ref[1], e);
      const int64_t n = 2;
      const std::string w = where + " expert " + std::to_string(e);
      EXPECT_LE(moe_rel(mine.w1->weight.grad(), (a.w1->weight.grad() + z.w1->weight.grad()).narrow(0, part * n, n)),
                kTol)
          << w;
      EXPECT_LE(moe_rel(mine.w2->weight.grad(), (a.w2->weight.grad() + z.w2->weight.grad()).narrow(1, part * n, n)),
                kTol)
          << w;
    }
  });
}

}  // namespace
}  // namespace tandem::test
