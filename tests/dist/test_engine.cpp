// tandem::Engine with a user's nested model (blocks in a ModuleList, not a Sequential): every
// strategy follows one process training on the whole batch; the low-level calls equal step();
// checkpoints resume bitwise and reshard across strategies; bad configurations are refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdlib.h>

#include <cmath>
#include <cstring>

#include "tandem/engine.h"
#include "tandem/zero.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

struct ResidualBlockImpl : torch::nn::Module {
  explicit ResidualBlockImpl(int64_t d) {
    fc1 = register_module("fc1", torch::nn::Linear(d, 2 * d));
    fc2 = register_module("fc2", torch::nn::Linear(2 * d, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ResidualBlock);

// A user model: stem, residual blocks in a ModuleList, head.
struct NestedNetImpl : torch::nn::Module {
  explicit NestedNetImpl(int64_t blocks = 3) {
    stem = register_module("stem", torch::nn::Linear(13, 24));
    body = register_module("body", torch::nn::ModuleList());
    for (int64_t i = 0; i < blocks; ++i) body->push_back(ResidualBlock(24));
    head = register_module("head", torch::nn::Linear(24, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(stem(x));
    for (const auto& b : *body) h = b->as<ResidualBlock>()->forward(h);
    return head(h);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  torch::nn::ModuleList body{nullptr};
};
TORCH_MODULE(NestedNet);

NestedNet make_net() {
  torch::manual_seed(7);
  return NestedNet();
}

OptimizerOptions adam() {
  OptimizerOptions o;
  o.kind = "adam";
  o.lr = 1e-2;
  return o;
}

const LossFn kCrossEntropy = [](const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
};

// Losses of `steps` steps on global batches of 24 rows; each rank takes its slice.
std::vector<double> train_losses(Engine& eng, int steps, int first_seed = 0) {
  std::vector<double> out;
  const int world = eng.world_size(), rank = eng.world()->rank();
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(24, 100 + first_seed + s, 5);
    auto loss = eng.step(slice_for_rank(x, rank, world), slice_for_rank(y, rank, world), kCrossEntropy);
    auto l = loss.detach().reshape({1}).clone();
    eng.world()->allreduce(l, ReduceOp::kAvg);
    out.push_back(l.item<double>());
  }
  return out;
}

// One process, plain LibTorch, the whole batch: the reference (the trained net in *trained).
std::vector<double> reference_losses(int steps, NestedNet* trained = nullptr) {
  auto net = make_net();
  auto opt = torch::optim::Adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<double> out;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(24, 100 + s, 5);
    opt.zero_grad();
    auto loss = kCrossEntropy(net->forward(x), y);
    loss.backward();
    opt.step();
    out.push_back(loss.item<double>());
  }
  if (trained) *trained = net;
  return out;
}

ParallelConfig with(Strategy s) {
  ParallelConfig c;
  c.strategy = s;
  return c;
}

class EngineStrategies : public ::testing::TestWithParam<Strategy> {};

TEST_P(EngineStrategies, NestedModelFollowsOneProcess) {
  NestedNet trained{nullptr};
  const auto ref = reference_losses(6, &trained);
  Engine eng(runtime(), make_net(), adam(), with(GetParam()));
  const auto got = train_losses(eng, 6);
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5) << "step " << i;
  // Inference through the strategy (ZeRO-3 gathers the whole module) equals the reference's,
  // twice: a second predict and a step after it must find the parameters as they were.
  auto [x, y] = global_batch(10, 300, 5);
  torch::Tensor expect;
  {
    torch::NoGradGuard ng;
    expect = trained->forward(x);
  }
  for (int round = 0; round < 2; ++round) {
    auto out = eng.predict(x);
    EXPECT_LT(rel_err(out, expect), 1e-5) << "predict, round " << round;
  }
  const int world = eng.world_size(), rank = eng.world()->rank();
  auto after = eng.step(slice_for_rank(x, rank, world), slice_for_rank(y, rank, world), kCrossEntropy);
  EXPECT_TRUE(std::isfinite(after.item<double>()));
  // The whole model's values agree with the reference's after training.
  auto full = eng.full_parameters();
  EXPECT_EQ(full.size(), make_net()->named_parameters().size());
  EXPECT_TRUE(full.count("body.2.fc2.weight"));
}

INSTANTIATE_TEST_SUITE_P(All, EngineStrategies,
                         ::testing::Values(Strategy::kDDP, Strategy::kZero1, Strategy::kZero2, Strategy::kZero3),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(Engine, LowLevelCallsEqualStep) {
  Engine a(runtime(), make_net(), adam(), with(Strategy::kZero2));
  Engine b(runtime(), make_net(), adam(), with(Strategy::kZero2));
  const int world = a.world_size(), rank = a.world()->rank();
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = global_batch(24, 200 + s, 5);
    auto xs = slice_for_rank(x, rank, world), ys = slice_for_rank(y, rank, world);
    auto la = a.step(xs, ys, kCrossEntropy);
    b.zero_grad();
    auto lb = kCrossEntropy(b.forward(xs), ys);
    b.backward(lb);
    EXPECT_TRUE(b.optimizer_step());
    EXPECT_EQ(la.item<double>(), lb.item<double>()) << "step " << s;
  }
  auto pa = a.full_parameters(), pb = b.full_parameters();
  for (auto& [name, t] : pa) EXPECT_TRUE(torch::equal(t, pb.at(name))) << name;
}

// Saved under one strategy, resumed under each: the continuation equals the run that went on.
TEST(Engine, CheckpointResumesBitwiseAcrossStrategies) {
  const std::string root = shared_dir(*world(), "engine");
  std::vector<double> continued;
  {
    Engine eng(runtime(), make_net(), adam(), with(Strategy::kZero2));
    train_losses(eng, 3);
    CheckpointMeta m;
    m.step = 3;
    eng.save(root, m);
    continued = train_losses(eng, 3, 3);
  }
  for (Strategy s : {Strategy::kZero2, Strategy::kDDP, Strategy::kZero3}) {
    torch::manual_seed(99);  // different initial values: everything must come from the checkpoint
    Engine eng(runtime(), NestedNet(), adam(), with(s));
    auto meta = eng.load(root);  // the root: its newest checkpoint
    EXPECT_EQ(meta.step, 3);
    auto resumed = train_losses(eng, 3, 3);
    for (size_t i = 0; i < continued.size(); ++i) {
      if (s == Strategy::kZero2) {
        EXPECT_EQ(resumed[i], continued[i]) << to_string(s) << " step " << i;
      } else {  // another reduction order: equal up to rounding
        EXPECT_NEAR(resumed[i], continued[i], 1e-5) << to_string(s) << " step " << i;
      }
    }
  }
}

// The same model with each block a ZeRO-3 unit: same names, same initial values (the blocks
// are built in the same order), so the reference above applies.
struct UnitNetImpl : torch::nn::Module {
  UnitNetImpl() {
    stem = register_module("stem", torch::nn::Linear(13, 24));
    body = register_module("body", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) body->push_back(ShardedUnit(ResidualBlock(24)));
    head = register_module("head", torch::nn::Linear(24, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(stem(x));
    for (const auto& b : *body) h = b->as<ShardedUnitImpl>()->forward(h);
    return head(h);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  torch::nn::ModuleList body{nullptr};
};
TORCH_MODULE(UnitNet);

int64_t fp32_bytes(const std::vector<at::Tensor>& ps) {
  int64_t n = 0;
  for (const auto& p : ps) n += p.numel() * 4;
  return n;
}

// ZeRO-3 with a unit per block inside a ModuleList: the steps and inference follow one process,
// and at most the root (stem, head) and two blocks (the one running and the one prefetched)
// are gathered at once, less than the whole model.
TEST(EngineShardedUnits, BlocksInAModuleListAreUnits) {
  NestedNet trained{nullptr};
  const auto ref = reference_losses(6, &trained);
  torch::manual_seed(7);
  UnitNet net;
  const int64_t whole = fp32_bytes(net->parameters());
  const int64_t block = fp32_bytes(net->body[0]->parameters());
  Engine eng(runtime(), net, adam(), with(Strategy::kZero3));
  const auto got = train_losses(eng, 6);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5) << "step " << i;
  auto [x, y] = global_batch(10, 300, 5);
  torch::NoGradGuard ng;
  EXPECT_LT(rel_err(eng.predict(x), trained->forward(x)), 1e-5);
  const int64_t peak = eng.stats().memory.peak_gathered_bytes;
  const int64_t slack = 3 * 4 * eng.world_size();  // each unit padded to a multiple of the ranks
  EXPECT_GT(peak, 0);
  EXPECT_LE(peak, whole - block + slack) << "whole model " << whole << " bytes, a block " << block;
  EXPECT_TRUE(eng.full_parameters().count("body.2.fc2.weight"));
}

// Units nest: an outer unit holding its own layer and two inner units. ZeRO-3 follows DDP on
// the same model.
struct TwoBlocksImpl : torch::nn::Module {
  TwoBlocksImpl() {
    mix = register_module("mix", torch::nn::Linear(24, 24));
    a = register_module("a", ShardedUnit(ResidualBlock(24)));
    b = register_module("b", ShardedUnit(ResidualBlock(24)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(mix(x)))); }
  torch::nn::Linear mix{nullptr};
  ShardedUnit a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoBlocks);

struct NestedUnitsImpl : torch::nn::Module {
  NestedUnitsImpl() {
    stem = register_module("stem", torch::nn::Linear(13, 24));
    body = register_module("body", ShardedUnit(TwoBlocks()));
    head = register_module("head", torch::nn::Linear(24, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(body(torch::relu(stem(x)))); }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  ShardedUnit body{nullptr};
};
TORCH_MODULE(NestedUnits);

TEST(EngineShardedUnits, NestedUnitsFollowDDP) {
  std::vector<std::vector<double>> losses;
  for (Strategy s : {Strategy::kDDP, Strategy::kZero3}) {
    torch::manual_seed(11);
    Engine eng(runtime(), NestedUnits(), adam(), with(s));
    losses.push_back(train_losses(eng, 6));
  }
  for (size_t i = 0; i < losses[0].size(); ++i) EXPECT_NEAR(losses[1][i], losses[0][i], 1e-5) << "step " << i;
}

TEST(Engine, RefusesWhatCannotWork) {
  const int world = tandem::test::world()->size();
  auto expect_refused = [&](const ParallelConfig& c, const std::string& needle) {
    expect_invalid_argument([&] { Engine eng(runtime(), make_net(), adam(), c); }, needle);
  };
  ParallelConfig tp = with(Strategy::kDDP);
  tp.tp = world;
  expect_refused(tp, "needs a torch::nn::Sequential");
  ParallelConfig odd = with(Strategy::kDDP);
  odd.pp = world + 1;
  expect_refused(odd, "does not divide the " + std::to_string(world) + " workers");
  expect_refused(with(Strategy::kSingle), "strategy single runs one worker");
  ParallelConfig comp = with(Strategy::kZero1);
  comp.compress = Compression::kBF16;
  expect_refused(comp, "--compress applies to --strategy ddp only");
  OptimizerOptions bad = adam();
  bad.kind = "lamb9";
  EXPECT_THROW(Engine(runtime(), make_net(), bad, with(Strategy::kDDP)), std::invalid_argument);
}

TEST(Engine, ParsesNamesOnce) {
  EXPECT_EQ(parse_strategy("zero3"), Strategy::kZero3);
  EXPECT_EQ(zero_stage(parse_strategy("zero2")), 2);
  EXPECT_THROW(parse_strategy("zero4"), std::invalid_argument);
  EXPECT_EQ(parse_partition("3,2", 2).layers, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(parse_partition("time", 2).method, PartitionMethod::kTime);
  EXPECT_THROW(parse_partition("3,x", 2), std::invalid_argument);
  EXPECT_EQ(parse_compression("bf16"), Compression::kBF16);
  EXPECT_THROW(parse_compression("int8"), std::invalid_argument);
}

}  // namespace
}  // namespace tandem::test
