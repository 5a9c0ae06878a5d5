// Activation checkpointing through the Engine: on a model with dropout, every layout gives the
// same gradients and the same training with recomputation as without (the recomputation
// replays the random draws, ZeRO-3 gathers the unit again, tensor-parallel layers repeat their
// collectives, pipeline stages recompute their own layers); and selective recomputation of the
// Llama decoder layers under ZeRO-3, tensor, sequence and context parallelism and a two-stage
// pipeline trains as without.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "tandem/engine.h"
#include "tandem/grid.h"
#include "tandem/llama.h"
#include "tandem/tensor_parallel.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/llama_test_util.h"
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

// ---- selective recomputation of the Llama decoder layers

constexpr int64_t kVocab = 48, kSeq = 8, kBatch = 4;

struct LlamaLayout {
  std::string name;
  Strategy strategy;
  int tp = 1, cp = 1;
  bool sequence_parallel = false;
  int pp = 1;
};

struct Trained {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;
  double recompute_seconds = 0.0;
};

// Three Adam steps of the float64 causal LM (grouped-query attention) in `l`, with `recompute`.
Trained train_llama(const LlamaLayout& l, const std::string& recompute) {
  auto c = tiny_llama_config(kVocab, kSeq);
  c.rope_theta = 100.0;
  torch::manual_seed(21);
  auto seq = llama::causal_lm_sequential(c);
  seq->to(torch::kDouble);
  ParallelConfig pc;
  pc.strategy = l.strategy;
  pc.tp = l.tp;
  pc.cp = l.cp;
  pc.pp = l.pp;
  pc.micro_batches = l.pp > 1 ? 2 : 1;
  pc.sequence_parallel = l.sequence_parallel;
  pc.activation_checkpointing = parse_activation_checkpointing(recompute);
  EngineOptions eo;
  eo.tensor_parallel = [](torch::nn::Sequential dense, CommPtr tp, const tp::TensorParallelOptions& o) {
    return llama::tensor_parallel(dense, tp, o);
  };
  OptimizerOptions o;
  o.kind = "adam";
  o.lr = 1e-2;
  Engine eng(runtime(), seq, o, pc, eo);
  const CommPtr tp = l.tp > 1 ? eng.grid()->tp() : nullptr;
  const LossFn loss = [tp](const at::Tensor& logits, const at::Tensor& y) {
    if (tp) return tp::vocab_parallel_cross_entropy(logits, y, tp).mean();
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
  };
  Trained t;
  for (int s = 0; s < 3; ++s) {
    auto g = at::detail::createCPUGenerator(70 + s);
    auto ids = torch::randint(0, kVocab, {kBatch, kSeq + 1}, g);
    auto x = slice_for_rank(ids.narrow(1, 0, kSeq).contiguous(), eng.dp_rank(), eng.dp_size());
    auto y = slice_for_rank(ids.narrow(1, 1, kSeq).contiguous(), eng.dp_rank(), eng.dp_size());
    auto got = eng.step(x, y, loss);
    // Summed over the ranks that hold a loss (a pipeline's last stage only).
    auto v = got.defined() && eng.is_output_rank() ? got.detach().reshape({1}).to(torch::kDouble).clone()
                                                   : torch::zeros({1}, torch::kDouble);
    eng.world()->allreduce(v);
    t.losses.push_back(v.item<double>());
  }
  t.params = eng.full_parameters();
  t.recompute_seconds = eng.stats().recompute_seconds;
  return t;
}

class LlamaSelectiveActivationCheckpoint : public ::testing::TestWithParam<LlamaLayout> {};

TEST_P(LlamaSelectiveActivationCheckpoint, TrainsAsWithoutRecomputation) {
  const LlamaLayout l = GetParam();
  if (world()->size() != 2) GTEST_SKIP() << "the layouts are of 2 ranks";
  const auto plain = train_llama(l, "none");
  const auto selective = train_llama(l, "selective");
  EXPECT_EQ(plain.recompute_seconds, 0.0);
  EXPECT_GT(selective.recompute_seconds, 0.0) << l.name << ": nothing was recomputed";
  ASSERT_EQ(plain.losses.size(), selective.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i)
    EXPECT_LE(std::abs(selective.losses[i] - plain.losses[i]), 1e-6 * std::abs(plain.losses[i]))
        << l.name << ": step " << i;
  ASSERT_EQ(plain.params.size(), selective.params.size());
  for (const auto& [name, p] : plain.params) {
    ASSERT_TRUE(selective.params.count(name)) << name;
    EXPECT_LE(rel_err(selective.params.at(name), p), 1e-6) << l.name << ": " << name;
  }
}

INSTANTIATE_TEST_SUITE_P(All, LlamaSelectiveActivationCheckpoint,
                         ::testing::Values(LlamaLayout{"zero3", Strategy::kZero3},
                                           LlamaLayout{"tp2", Strategy::kDDP, 2},
                                           LlamaLayout{"tp2_sequence_parallel", Strategy::kDDP, 2, 1, true},
                                           LlamaLayout{"cp2", Strategy::kDDP, 1, 2},
                                           LlamaLayout{"pp2", Strategy::kDDP, 1, 1, false, 2}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace tandem::test
