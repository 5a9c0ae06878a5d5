// Sequence parallelism (ParallelConfig::sequence_parallel, llama::tensor_parallel) on the Llama
// Sequential forms through tandem::Engine: tp2 with it trains as tp2 without it (per-step losses
// and every parameter's gradient of the first step, untied, tied, the sequence classifier, with
// LoRA adapters), its predictions are the whole logits, its tp traffic moves from all-reduces to
// all-gathers and reduce-scatters, and a sequence the tp size does not divide is refused. On 4
// ranks the same for a two-stage pipeline of tp2 stages.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "tandem/engine.h"
#include "tandem/grid.h"
#include "tandem/llama.h"
#include "tandem/lora.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

constexpr int64_t kVocab = 48, kSeq = 8, kBatch = 4, kLabels = 3;

enum class Variant { kUntied, kTied, kClassifier };
const char* name_of(Variant v) {
  const char* names[] = {"untied", "tied", "classifier"};
  return names[static_cast<int>(v)];
}

llama::LlamaConfig config(Variant v) {
  llama::LlamaConfig c;
  c.vocab_size = kVocab;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = kSeq;
  c.tie_word_embeddings = v == Variant::kTied;
  c.num_labels = kLabels;
  return c;
}

// The same model on every call (and rank); with LoRA, adapters whose B is not zero.
torch::nn::Sequential model(Variant v, bool lora) {
  torch::manual_seed(13);
  auto c = config(v);
  auto seq = v == Variant::kClassifier ? llama::sequence_classifier_sequential(c)
             : v == Variant::kTied     ? llama::tied_causal_lm_sequential(c)
                                       : llama::causal_lm_sequential(c);
  if (!lora) return seq;
  lora::LoraConfig lc;
  lc.rank = 4;
  lc.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  if (v == Variant::kClassifier) lc.trained_whole = {"score"};
  lora::attach(*seq, lc);
  torch::NoGradGuard ng;
  for (auto& p : seq->named_parameters())
    if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0.0, 0.05);
  return seq;
}

// Random ids; LM targets the next tokens, the classifier's a label per row.
std::pair<torch::Tensor, torch::Tensor> batch(Variant v, uint64_t seed, int64_t seq = kSeq) {
  auto g = at::detail::createCPUGenerator(seed);
  auto ids = torch::randint(0, kVocab, {kBatch, seq + 1}, g);
  auto x = ids.narrow(1, 0, seq).contiguous();
  if (v == Variant::kClassifier) return {x, torch::randint(0, kLabels, {kBatch}, g)};
  return {x, ids.narrow(1, 1, seq).contiguous()};
}

// The LM's training logits stay split over the vocabulary; the classifier pools the last position.
LossFn loss_of(Variant v, const CommPtr& tp) {
  if (v == Variant::kClassifier) {
    return [](const at::Tensor& scores, const at::Tensor& y) {
      return torch::nn::functional::cross_entropy(scores.select(1, -1), y);
    };
  }
  return [tp](const at::Tensor& logits, const at::Tensor& y) {
    return tp::vocab_parallel_cross_entropy(logits, y, tp).mean();
  };
}

std::unique_ptr<Engine> engine(Variant v, bool lora, int pp, bool sequence_parallel) {
  ParallelConfig c;
  c.strategy = Strategy::kDDP;
  c.tp = 2;
  c.pp = pp;
  c.micro_batches = pp > 1 ? 2 : 1;
  c.sequence_parallel = sequence_parallel;
  EngineOptions eo;
  eo.tensor_parallel = [](torch::nn::Sequential dense, CommPtr tp, const tp::TensorParallelOptions& o) {
    return llama::tensor_parallel(dense, tp, o);
  };
  OptimizerOptions oo;
  oo.kind = "sgd";
  oo.lr = 0.1;
  return std::make_unique<Engine>(runtime(), model(v, lora), oo, c, eo);
}

struct Run {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> first_grads;  // this rank's parameters' gradients of step 1
  EngineStats stats;                              // of the steps only
};

Run train(Engine& eng, Variant v, int steps) {
  Run r;
  eng.reset_stats();
  const auto loss = loss_of(v, eng.grid()->tp());
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(v, 90 + s);
    eng.zero_grad();
    r.losses.push_back(eng.forward_backward(x, y, loss).item<double>());
    if (s == 0) {
      for (auto& p : eng.module().named_parameters())
        if (p.value().grad().defined()) r.first_grads[p.key()] = p.value().grad().detach().clone();
    }
    eng.optimizer_step();
  }
  r.stats = eng.stats();
  return r;
}

void expect_same_training(const Run& sp, const Run& plain) {
  ASSERT_EQ(sp.losses.size(), plain.losses.size());
  for (size_t s = 0; s < sp.losses.size(); ++s)
    EXPECT_LE(std::abs(sp.losses[s] - plain.losses[s]), 1e-6 * std::abs(plain.losses[s])) << "step " << s;
  ASSERT_EQ(sp.first_grads.size(), plain.first_grads.size());
  ASSERT_FALSE(plain.first_grads.empty());
  for (const auto& [name, g] : plain.first_grads) {
    ASSERT_TRUE(sp.first_grads.count(name)) << name << " has no gradient with --sequence-parallel";
    EXPECT_LE(rel_err(sp.first_grads.at(name), g), 1e-6) << name;
  }
}

int64_t bytes(const EngineStats& s, const std::string& op) {
  auto it = s.comm.ops.find(op);
  return it == s.comm.ops.end() ? 0 : it->second.bytes;
}

class SequenceParallel : public ::testing::TestWithParam<std::tuple<Variant, bool>> {};

TEST_P(SequenceParallel, Tp2TrainsAsTp2WithoutIt) {
  ASSERT_EQ(world()->size(), 2) << "written for tp2 on 2 ranks";
  const auto [v, lora] = GetParam();
  auto sp_engine = engine(v, lora, 1, true);
  auto plain_engine = engine(v, lora, 1, false);
  const auto sp = train(*sp_engine, v, 5);
  const auto plain = train(*plain_engine, v, 5);
  expect_same_training(sp, plain);
  // The layers' all-reduces of [B, T, hidden] become all-gathers and reduce-scatters; what stays
  // all-reduced is small (the loss, the vocabulary-parallel cross-entropy's statistics, the
  // replicated weights' gradients).
  EXPECT_GT(bytes(sp.stats, "allgather"), 0);
  EXPECT_GT(bytes(sp.stats, "reduce_scatter"), 0);
  EXPECT_EQ(bytes(plain.stats, "reduce_scatter"), 0);
  EXPECT_LT(bytes(sp.stats, "allreduce"), bytes(plain.stats, "allreduce") / 4)
      << "with --sequence-parallel " << bytes(sp.stats, "allreduce") << " bytes all-reduced, without "
      << bytes(plain.stats, "allreduce");
}

INSTANTIATE_TEST_SUITE_P(
    Llama, SequenceParallel,
    ::testing::Values(std::make_tuple(Variant::kUntied, false), std::make_tuple(Variant::kTied, false),
                      std::make_tuple(Variant::kClassifier, false), std::make_tuple(Variant::kUntied, true),
                      std::make_tuple(Variant::kClassifier, true)),
    [](const auto& info) {
      return std::string(name_of(std::get<0>(info.param))) + (std::get<1>(info.param) ? "_lora" : "");
    });

// Evaluation mode gives the whole output on the output rank: the logits gathered over the
// sequence and the vocabulary, as without sequence parallelism.
TEST(SequenceParallelEval, PredictGivesTheWholeOutput) {
  ASSERT_EQ(world()->size(), 2) << "written for tp2 on 2 ranks";
  for (auto v : {Variant::kUntied, Variant::kTied, Variant::kClassifier}) {
    SCOPED_TRACE(name_of(v));
    auto sp = engine(v, false, 1, true);
    auto plain = engine(v, false, 1, false);
    const auto x = batch(v, 7).first;
    sp->train(false);  // evaluation mode: the LM's logits gathered over the vocabulary too
    plain->train(false);
    const auto got = sp->predict(x), want = plain->predict(x);
    if (!sp->is_output_rank()) continue;
    const int64_t width = v == Variant::kClassifier ? kLabels : kVocab;
    EXPECT_EQ(got.sizes(), (std::vector<int64_t>{kBatch, kSeq, width}));
    EXPECT_LE(rel_err(got, want), 1e-6);
  }
}

// A sequence of 7 tokens does not split over 2 ranks: refused on every rank, naming T and --tp.
TEST(SequenceParallelEval, RefusesASequenceTheTpSizeDoesNotDivide) {
  ASSERT_EQ(world()->size(), 2) << "written for tp2 on 2 ranks";
  auto eng = engine(Variant::kUntied, false, 1, true);
  auto [x, y] = batch(Variant::kUntied, 3, 7);
  try {
    eng->step(x, y, loss_of(Variant::kUntied, eng->grid()->tp()));
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    for (const char* part : {"T = 7", "--tp 2", "multiple of --tp"})
      EXPECT_NE(m.find(part), std::string::npos) << "missing '" << part << "' in: " << m;
  }
  EXPECT_THROW(tp::seq_shard_size(7, 2), std::invalid_argument);
  EXPECT_EQ(tp::seq_shard_size(8, 2), 4);
}

// Refused where it cannot apply: without tp, and by the generic converter (Tandem's transformer,
// an MLP), naming the flag.
TEST(SequenceParallelEval, RefusedWithoutTpAndOutsideLlama) {
  ParallelConfig c;
  c.sequence_parallel = true;
  try {
    validate(c, world()->size());
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--sequence-parallel"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--tp"), std::string::npos) << e.what();
  }
  torch::nn::Sequential mlp(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  tp::TensorParallelOptions o;
  o.sequence_parallel = true;
  try {
    tp::tensor_parallel(mlp, world(), o);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--sequence-parallel needs a Llama model"), std::string::npos) << e.what();
  }
}

// 4 ranks: a two-stage pipeline of tp2 stages, the shards crossing between the stages.
TEST(SequenceParallelPipeline, Pp2Tp2TrainsAsWithoutIt) {
  ASSERT_EQ(world()->size(), 4) << "written for pp2 x tp2 on 4 ranks";
  for (bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "lora" : "base");
    auto sp_engine = engine(Variant::kUntied, lora, 2, true);
    auto plain_engine = engine(Variant::kUntied, lora, 2, false);
    const auto sp = train(*sp_engine, Variant::kUntied, 5);
    const auto plain = train(*plain_engine, Variant::kUntied, 5);
    expect_same_training(sp, plain);
    EXPECT_GT(bytes(sp.stats, "reduce_scatter"), 0);
  }
}

}  // namespace
}  // namespace tandem::test
