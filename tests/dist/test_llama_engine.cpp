// The Llama model (tandem/llama.h) trained through tandem::Engine under ddp and zero1-3, tied
// and untied embeddings: every layout's losses and final parameters follow one process
// training plain LibTorch on the whole batch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>

#include "tandem/engine.h"
#include "tandem/llama.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

constexpr int64_t kVocab = 48, kSeq = 8, kBatch = 12;

llama::LlamaForCausalLM make_llama(bool tied) {
  llama::LlamaConfig c;
  c.vocab_size = kVocab;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = kSeq;
  c.tie_word_embeddings = tied;
  torch::manual_seed(21);
  return llama::LlamaForCausalLM(c);
}

// Next-token prediction on random ids: inputs the first kSeq tokens, targets the next ones.
std::pair<torch::Tensor, torch::Tensor> lm_batch(uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  auto ids = torch::randint(0, kVocab, {kBatch, kSeq + 1}, g);
  return {ids.narrow(1, 0, kSeq).contiguous(), ids.narrow(1, 1, kSeq).contiguous()};
}

const LossFn kNextToken = [](const at::Tensor& logits, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
};

using Param = std::tuple<Strategy, bool>;
class LlamaEngine : public ::testing::TestWithParam<Param> {};

TEST_P(LlamaEngine, EveryLayoutFollowsOneProcess) {
  const auto [strategy, tied] = GetParam();
  constexpr int kSteps = 5;
  auto ref = make_llama(tied);
  torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<double> want;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = lm_batch(40 + s);
    opt.zero_grad();
    auto loss = kNextToken(ref(x), y);
    loss.backward();
    opt.step();
    want.push_back(loss.item<double>());
  }

  OptimizerOptions adam;
  adam.kind = "adam";
  adam.lr = 1e-2;
  ParallelConfig config;
  config.strategy = strategy;
  Engine eng(runtime(), make_llama(tied), adam, config);
  const int world = eng.world_size(), rank = eng.world()->rank();
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = lm_batch(40 + s);
    auto loss = eng.step(slice_for_rank(x, rank, world), slice_for_rank(y, rank, world), kNextToken);
    auto l = loss.detach().reshape({1}).clone();
    eng.world()->allreduce(l, ReduceOp::kAvg);
    EXPECT_NEAR(l.item<double>(), want[s], 1e-5) << "step " << s;
  }
  const auto full = eng.full_parameters();
  const auto mine = ref->named_parameters();
  ASSERT_EQ(full.size(), mine.size());
  for (auto& p : mine) {
    ASSERT_TRUE(full.count(p.key())) << p.key();
    EXPECT_LT(rel_err(full.at(p.key()), p.value().detach()), 1e-4) << p.key();
  }
}

INSTANTIATE_TEST_SUITE_P(All, LlamaEngine,
                         ::testing::Combine(::testing::Values(Strategy::kDDP, Strategy::kZero1, Strategy::kZero2,
                                                              Strategy::kZero3),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_tied" : "_untied");
                         });

}  // namespace
}  // namespace tandem::test
