// Activation checkpointing through the Engine: on a model with dropout, every layout gives the
// same gradients and the same training with recomputation as without (the recomputation
// replays the random draws, ZeRO-3 gathers the unit again, tensor-parallel layers repeat their
// collectives, pipeline stages recompute their own layers).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "tandem/engine.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

torch::nn::Sequential dropout_net() {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(13, 32), torch::nn::ReLU(), torch::nn::Dropout(0.3),
                               torch::nn::Linear(32, 32), torch::nn::ReLU(), torch::nn::Dropout(0.3),
                               torch::nn::Linear(32, 16), torch::nn::Tanh(), torch::nn::Linear(16, 5));
}

const LossFn kCrossEntropy = [](const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
};

struct Layout {
  std::string name;
  Strategy strategy;
  int tp = 1, pp = 1;
  std::string recompute = "every";
};

// The whole model's values after one step at lr 1 (parameter - gradient: the gradients show
// through unscaled) and two more at lr 0.05.
std::map<std::string, at::Tensor> train(const Layout& l, const std::string& recompute, std::vector<double>* losses) {
  ParallelConfig c;
  c.strategy = l.strategy;
  c.tp = l.tp;
  c.pp = l.pp;
  c.micro_batches = l.pp > 1 ? 2 : 1;
  c.activation_checkpointing = parse_activation_checkpointing(recompute);
  OptimizerOptions o;
  o.kind = "sgd";
  o.lr = 1.0;
  Engine eng(runtime(), dropout_net(), o, c);
  int wrapped = 0;
  for (const auto& m : eng.module().modules()) wrapped += m->as<CheckpointedImpl>() != nullptr;
  if (recompute == "none") {
    EXPECT_EQ(wrapped, 0);
  } else {
    EXPECT_GT(wrapped, 0) << l.name << ": no layer of this rank is recomputed";
  }
  torch::manual_seed(99);  // the dropout masks' stream, the same for both runs
  for (int s = 0; s < 3; ++s) {
    if (s == 1) eng.set_lr(0.05);
    auto [x, y] = global_batch(24, 500 + s, 5);
    auto loss = eng.step(slice_for_rank(x, eng.dp_rank(), eng.dp_size()),
                         slice_for_rank(y, eng.dp_rank(), eng.dp_size()), kCrossEntropy);
    losses->push_back(loss.item<double>());
  }
  return eng.full_parameters();
}

class ActivationCheckpointLayouts : public ::testing::TestWithParam<Layout> {};

TEST_P(ActivationCheckpointLayouts, SameGradientsAndTraining) {
  const Layout l = GetParam();
  std::vector<double> plain_losses, recomputed_losses;
  const auto plain = train(l, "none", &plain_losses);
  const auto recomputed = train(l, l.recompute, &recomputed_losses);
  ASSERT_EQ(plain.size(), recomputed.size());
  for (const auto& [name, p] : plain) {
    ASSERT_TRUE(recomputed.count(name)) << name;
    const double diff = (recomputed.at(name) - p).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6) << l.name << ": " << name;
  }
  ASSERT_EQ(plain_losses.size(), recomputed_losses.size());
  for (size_t i = 0; i < plain_losses.size(); ++i) {
    EXPECT_NEAR(plain_losses[i], recomputed_losses[i], 1e-6) << l.name << ": step " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(All, ActivationCheckpointLayouts,
                         ::testing::Values(Layout{"ddp", Strategy::kDDP}, Layout{"zero1", Strategy::kZero1},
                                           Layout{"zero3", Strategy::kZero3},
                                           Layout{"zero3_first2", Strategy::kZero3, 1, 1, "2"},
                                           Layout{"tp2", Strategy::kDDP, 2, 1}, Layout{"pp2", Strategy::kDDP, 1, 2},
                                           Layout{"pp2_first1", Strategy::kDDP, 1, 2, "1"}),
                         [](const auto& info) { return info.param.name; });

TEST(ActivationCheckpointRefusal, TooManyLayers) {
  ParallelConfig c;
  c.strategy = Strategy::kDDP;
  c.activation_checkpointing = parse_activation_checkpointing("12");
  OptimizerOptions o;
  o.kind = "sgd";
  try {
    Engine eng(runtime(), dropout_net(), o, c);
    ADD_FAILURE() << "12 of 9 layers was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("the model has 9 layers"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tandem::test
