// Hybrid sharding through the Engine on 4 ranks: hsdp (ZeRO-3 within shard groups) and hsdp2
// (ZeRO-2) with groups of 2 follow DDP; groups of 4 are zero3, groups of 1 DDP's replication;
// all-gathers and reduce-scatters stay within the groups and only the shards' all-reduce crosses
// them; a bad group is refused; a checkpoint saved under hsdp resumes under zero3 on 2 ranks,
// ddp on 1 and hsdp2 with other groups.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/shard_io.h"
#include "tandem/engine.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

constexpr int64_t kRows = 24;  // per global batch: splits over 1, 2 and 4 workers

// A Sequential, so that ZeRO-3 runs it unit by unit (gathering each Linear in turn).
torch::nn::Sequential make_mlp(uint64_t seed = 7) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(13, 32), torch::nn::ReLU(), torch::nn::Linear(32, 32),
                               torch::nn::ReLU(), torch::nn::Linear(32, 5));
}

const LossFn kCrossEntropy = [](const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
};

ParallelConfig with(Strategy s, int shard_group = 0) {
  ParallelConfig c;
  c.strategy = s;
  c.shard_group = shard_group;
  return c;
}

// The global batch's loss of each of `steps` steps (each rank its slice, averaged over them).
std::vector<double> train(Engine& eng, int steps, int first = 0) {
  std::vector<double> out;
  const int world = eng.world_size(), rank = eng.world()->rank();
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(kRows, 500 + first + s, 5);
    auto loss = eng.step(slice_for_rank(x, rank, world), slice_for_rank(y, rank, world), kCrossEntropy);
    auto l = loss.detach().reshape({1}).clone();
    eng.world()->allreduce(l, ReduceOp::kAvg);
    out.push_back(l.item<double>());
  }
  return out;
}

struct Run {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;
};

Run run(const ParallelConfig& c, int steps = 4) {
  Engine eng(runtime(), make_mlp(), adamw(), c);
  Run r;
  r.losses = train(eng, steps);
  r.params = eng.full_parameters();
  return r;
}

void expect_same(const Run& got, const Run& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_LE(std::abs(got.losses[i] - want.losses[i]), 1e-6 * std::abs(want.losses[i])) << what << " step " << i;
  }
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  for (const auto& [name, t] : want.params) EXPECT_LE(rel_err(got.params.at(name), t), 1e-6) << what << " " << name;
}

class Hsdp : public ::testing::TestWithParam<Strategy> {
 protected:
  void SetUp() override { ASSERT_EQ(world()->size(), 4) << "declared for 4 ranks (tests/dist/zero.cmake)"; }
};

// Groups of 2 (ranks 0-1 and 2-3): the same steps as DDP over the 4 ranks.
TEST_P(Hsdp, GroupsOfTwoFollowDdp) {
  const auto ddp = run(with(Strategy::kDDP));
  double moved = 0.0;
  for (const auto& kv : make_mlp()->named_parameters())
    moved = std::max(moved, rel_err(ddp.params.at(kv.key()), kv.value()));
  EXPECT_GT(moved, 1e-2) << "the steps hardly move the parameters: a weak comparison";
  expect_same(run(with(GetParam(), 2)), ddp, to_string(GetParam()));
}

// One group of all 4 ranks is ZeRO at the same stage; groups of 1 replicate the whole model
// with an all-reduce of every gradient, as DDP.
TEST_P(Hsdp, WholeGroupIsZeroAndSingleRankGroupsAreDdp) {
  const Strategy zero = zero_stage(GetParam()) == 3 ? Strategy::kZero3 : Strategy::kZero2;
  expect_same(run(with(GetParam(), 4)), run(with(zero)), "groups of 4");
  expect_same(run(with(GetParam(), 1)), run(with(Strategy::kDDP)), "groups of 1");
}

// All-gathers and reduce-scatters run within the shard groups only; across them goes one
// all-reduce of this rank's shard per step (its Ψ/G elements, padding aside) and nothing else.
TEST_P(Hsdp, GathersStayWithinGroups) {
  Engine eng(runtime(), make_mlp(), adamw(), with(GetParam(), 2));
  const int steps = 3;
  train(eng, steps);
  const auto groups = eng.stats().comm.groups;
  ASSERT_TRUE(groups.count("shard") && groups.count("replicate"));
  const auto& shard = groups.at("shard");
  const auto& across = groups.at("replicate");
  EXPECT_TRUE(shard.count("allgather") && shard.count("reduce_scatter"));
  EXPECT_EQ(across.count("allgather"), 0u);
  EXPECT_EQ(across.count("reduce_scatter"), 0u);
  ASSERT_EQ(across.count("allreduce"), 1u);
  const int64_t psi = eng.parameters(), buckets = 3;  // stage 3: a bucket per Linear; stage 2: one
  const int64_t per_step = across.at("allreduce").bytes / steps;
  EXPECT_GE(per_step, 4 * psi / 2);
  EXPECT_LE(per_step, 4 * (psi / 2 + buckets));
  for (const auto& [group, ops] : groups) {
    if (group == "shard") continue;
    EXPECT_EQ(ops.count("allgather") + ops.count("reduce_scatter"), 0u) << "group " << group;
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, Hsdp, ::testing::Values(Strategy::kHsdp, Strategy::kHsdp2),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(HsdpConfig, RefusesBadGroupsAndDefaultsToRanksPerHost) {
  const int world = tandem::test::world()->size();
  auto expect_refused = [&](const ParallelConfig& c, const std::string& needle) {
    expect_invalid_argument([&] { Engine eng(runtime(), make_mlp(), adamw(), c); }, needle);
  };
  expect_refused(with(Strategy::kHsdp, world + 1), "--shard-group " + std::to_string(world + 1) +
                                                       " does not divide the " + std::to_string(world) +
                                                       " data-parallel ranks");
  expect_refused(with(Strategy::kHsdp2, -1), "--shard-group -1");
  expect_refused(with(Strategy::kZero3, 2), "--shard-group 2 applies to --strategy hsdp or hsdp2 only");
  ParallelConfig tp = with(Strategy::kHsdp, 1);
  tp.tp = world;
  expect_refused(tp, "shards over the data-parallel ranks alone");
  EXPECT_EQ(parse_strategy("hsdp"), Strategy::kHsdp);
  EXPECT_EQ(zero_stage(parse_strategy("hsdp2")), 2);
  // Every rank of this test runs on one host: the default group is all of them.
  Engine eng(runtime(), make_mlp(), adamw(), with(Strategy::kHsdp));
  EXPECT_EQ(eng.config().shard_group, world);
}

// Saved under hsdp with groups of 2 (group 1's shards are replicas, not written); loaded by the
// placement machinery into zero3 on 2 ranks, ddp on 1 and hsdp2 with groups of 4: each
// continues as the run that went on.
TEST(HsdpCheckpoint, ResumesUnderOtherLayouts) {
  ASSERT_EQ(world()->size(), 4) << "declared for 4 ranks (tests/dist/zero.cmake)";
  const std::string root = shared_dir(*world(), "hsdp");
  const int rank = world()->rank();
  std::vector<double> continued;
  {
    Engine eng(runtime(), make_mlp(), adamw(), with(Strategy::kHsdp, 2));
    train(eng, 3);
    CheckpointMeta m;
    m.step = 3;
    eng.save(root, m);
    continued = train(eng, 3, 3);
  }
  auto resume = [&](Runtime& rt, const ParallelConfig& c, const std::string& what) {
    Engine eng(rt, make_mlp(99), adamw(), c);  // other initial values: all must come from the checkpoint
    EXPECT_EQ(eng.load(root).step, 3) << what;
    const auto resumed = train(eng, 3, 3);
    for (size_t i = 0; i < continued.size(); ++i) EXPECT_NEAR(resumed[i], continued[i], 1e-5) << what << " step " << i;
  };
  resume(runtime(), with(Strategy::kHsdp2, 4), "hsdp2, groups of 4");
  if (auto two = world()->split(rank < 2 ? 0 : -1, rank)) {
    Runtime rt = runtime_over(two);
    resume(rt, with(Strategy::kZero3), "zero3 on 2 ranks");
  }
  world()->barrier();
  if (auto one = world()->split(rank == 0 ? 0 : -1, rank)) {
    Runtime rt = runtime_over(one);
    resume(rt, with(Strategy::kDDP), "ddp on 1 rank");
  }
  world()->barrier();
  if (rank == 0) ckpt::remove_tree(root);
}

}  // namespace
}  // namespace tandem::test
