// LARS and LAMB through the Engine: under ddp, zero1-3 and tensor parallelism (alone and with
// ddp or zero1 over the replicas) training follows one process stepping the whole model with
// the same optimizer, which holds only when every trust ratio sees its parameter's whole norm
// (ZeRO's chunks cut parameters, tp splits matrices); and checkpoints resume under another
// layout.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "tandem/engine.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

constexpr int kSteps = 20;

// Two Linear pairs (tensor parallelism shards each pair) around a LayerNorm, and a last Linear
// that tensor parallelism leaves whole on every rank: matrices that are adapted, sharded or
// replicated, and biases and a norm weight that are not.
torch::nn::Sequential make_net(uint64_t seed = 5) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(13, 32), torch::nn::Tanh(), torch::nn::Linear(32, 24),
                               torch::nn::LayerNorm(torch::nn::LayerNormOptions({24})), torch::nn::ReLU(),
                               torch::nn::Linear(24, 16), torch::nn::ReLU(), torch::nn::Linear(16, 8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 5));
}

OptimizerOptions optimizer(const std::string& kind) {
  OptimizerOptions o;
  o.kind = kind;
  if (kind == "lars") {
    o.lr = 0.1;
    o.momentum = 0.9;
    o.weight_decay = 1e-3;
    o.trust_coefficient = 0.1;
  } else {
    o.lr = 0.02;
    o.weight_decay = 0.01;
  }
  return o;
}

const LossFn kCrossEntropy = [](const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
};

// Step s's global batch: 24 random rows labelled by their largest of the first 5 features, so
// that training has something to learn.
std::pair<at::Tensor, at::Tensor> batch(int s) {
  auto x = global_batch(24, 700 + s, 5).first;
  return {x, x.narrow(1, 0, 5).argmax(1)};
}

// One process, the whole batch of each step: the reference.
std::vector<double> one_worker(const std::string& kind) {
  auto net = make_net();
  auto opt = make_optimizer(net->parameters(), optimizer(kind));
  std::vector<double> out;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    opt->zero_grad();
    auto loss = kCrossEntropy(net->forward(x), y);
    loss.backward();
    opt->step();
    out.push_back(loss.item<double>());
  }
  return out;
}

// Steps [first, first + n) of the run, each replica on its slice of the global batch; the mean
// loss over the replicas.
std::vector<double> train(Engine& eng, int first, int n) {
  std::vector<double> out;
  for (int s = first; s < first + n; ++s) {
    auto [x, y] = batch(s);
    auto loss = eng.step(slice_for_rank(x, eng.dp_rank(), eng.dp_size()),
                         slice_for_rank(y, eng.dp_rank(), eng.dp_size()), kCrossEntropy);
    auto l = loss.detach().to(torch::kDouble).reshape({1}).clone();
    eng.world()->allreduce(l, ReduceOp::kAvg);
    out.push_back(l.item<double>());
  }
  return out;
}

struct Layout {
  std::string name;
  Strategy strategy;
  int tp = 1;
  std::string kind;
};

ParallelConfig config(const Layout& l) {
  ParallelConfig c;
  c.strategy = l.strategy;
  c.tp = l.tp;
  return c;
}

class LayerwiseLayouts : public ::testing::TestWithParam<Layout> {};

TEST_P(LayerwiseLayouts, LossesFollowOneWorker) {
  const Layout l = GetParam();
  const auto ref = one_worker(l.kind);
  Engine eng(runtime(), make_net(), optimizer(l.kind), config(l));
  const auto got = train(eng, 0, kSteps);
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5) << l.name << ": step " << i;
  EXPECT_LT(ref.back(), 0.8 * ref.front()) << l.kind << " does not train the reference: a weak comparison";
}

std::vector<Layout> layouts() {
  std::vector<Layout> out;
  for (const std::string kind : {"lars", "lamb"}) {
    out.push_back({kind + "_ddp", Strategy::kDDP, 1, kind});
    out.push_back({kind + "_zero1", Strategy::kZero1, 1, kind});
    out.push_back({kind + "_zero2", Strategy::kZero2, 1, kind});
    out.push_back({kind + "_zero3", Strategy::kZero3, 1, kind});
    out.push_back({kind + "_tp2_ddp", Strategy::kDDP, 2, kind});
    out.push_back({kind + "_tp2_zero1", Strategy::kZero1, 2, kind});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(All, LayerwiseLayouts, ::testing::ValuesIn(layouts()),
                         [](const auto& info) { return info.param.name; });

// Saved under ZeRO-2 halfway, resumed under ZeRO-2, DDP and ZeRO-3: the second half follows the
// one worker's (the state slots and LAMB's step count travel; a fresh state would not).
TEST(LayerwiseCheckpoint, ResumesUnderAnotherLayout) {
  for (const std::string kind : {"lars", "lamb"}) {
    const auto ref = one_worker(kind);
    const std::string root = shared_dir(*world(), "layerwise_" + kind);
    {
      Engine eng(runtime(), make_net(), optimizer(kind), config({"zero2", Strategy::kZero2}));
      train(eng, 0, kSteps / 2);
      CheckpointMeta m;
      m.step = kSteps / 2;
      eng.save(root, m);
    }
    for (Strategy s : {Strategy::kZero2, Strategy::kDDP, Strategy::kZero3}) {
      // Other initial values: everything must come from the checkpoint.
      Engine eng(runtime(), make_net(99), optimizer(kind), config({"resumed", s}));
      eng.load(root);
      const auto got = train(eng, kSteps / 2, kSteps / 2);
      for (int i = 0; i < kSteps / 2; ++i) {
        EXPECT_NEAR(got[i], ref[kSteps / 2 + i], 1e-5) << kind << " resumed under " << to_string(s) << ": step " << i;
      }
    }
  }
}

}  // namespace
}  // namespace tandem::test
