// Context parallelism (ParallelConfig::cp, tandem/context_parallel.h) through tandem::Engine on
// the Llama Sequential forms, in float64: every layout's gradients after one step (read from
// one plain-SGD step at lr 1 on the whole model) and its losses over 5 Adam steps follow one
// process training plain LibTorch on the whole sequences. The causal LM (targets per token:
// each cp rank's loss over its own tokens) with a mean and with a summed loss, and the
// sequence classifier (one target per sample: the output gathered over the cp ranks).
// 2 ranks: cp2 under ddp, zero1 and zero3. 4 ranks: cp4, cp2 x dp2 under zero3, tp2 x cp2 (also
// with sequence parallelism inside each cp rank's part) and pp2 x cp2. A sequence whose length is not a multiple of 2 *
// cp is refused with the rule.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>

#include "tandem/context_parallel.h"
#include "tandem/engine.h"
#include "tandem/grid.h"
#include "tandem/llama.h"
#include "tandem/tensor_parallel.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

constexpr int64_t kVocab = 48, kSeq = 16, kBatch = 4, kLabels = 3;

llama::LlamaConfig config() {
  llama::LlamaConfig c;
  c.vocab_size = kVocab;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = kSeq;
  c.num_labels = kLabels;
  c.rope_theta = 100.0;  // positions matter at this length
  return c;
}

torch::nn::Sequential make_model(bool classifier) {
  torch::manual_seed(33);
  auto seq = classifier ? llama::sequence_classifier_sequential(config()) : llama::causal_lm_sequential(config());
  seq->to(torch::kDouble);
  return seq;
}

struct Batch {
  torch::Tensor x, y;
};
Batch batch(uint64_t seed, bool classifier) {
  auto g = at::detail::createCPUGenerator(seed);
  auto ids = torch::randint(0, kVocab, {kBatch, kSeq + 1}, g);
  if (classifier) return {ids.narrow(1, 0, kSeq).contiguous(), torch::randint(0, kLabels, {kBatch}, g)};
  return {ids.narrow(1, 0, kSeq).contiguous(), ids.narrow(1, 1, kSeq).contiguous()};
}

enum class Loss { kLmMean, kLmSum, kClassifierMean, kClassifierSum };
bool is_classifier(Loss l) { return l == Loss::kClassifierMean || l == Loss::kClassifierSum; }
bool is_sum(Loss l) { return l == Loss::kLmSum || l == Loss::kClassifierSum; }
const char* name_of(Loss l) {
  const char* names[] = {"LM mean", "LM sum", "classifier mean", "classifier sum"};
  return names[static_cast<int>(l)];
}

// The loss of an output and its targets; `tp` set: the LM's logits are split over the vocabulary.
LossFn loss_fn(Loss l, const CommPtr& tp) {
  const bool sum = is_sum(l);
  auto reduce = [sum](const at::Tensor& per) { return sum ? per.sum() : per.mean(); };
  namespace F = torch::nn::functional;
  const auto none = F::CrossEntropyFuncOptions().reduction(torch::kNone);
  if (is_classifier(l)) {
    return [reduce, none](const at::Tensor& scores, const at::Tensor& y) {
      auto last = scores.select(1, scores.size(1) - 1);  // no pad token: the last position
      return reduce(F::cross_entropy(last, y, none));
    };
  }
  if (tp) {
    return [tp, reduce](const at::Tensor& logits, const at::Tensor& y) {
      return reduce(tp::vocab_parallel_cross_entropy(logits, y, tp));
    };
  }
  return [reduce, none](const at::Tensor& logits, const at::Tensor& y) {
    return reduce(F::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}), none));
  };
}

double terms(Loss l) { return is_classifier(l) ? kBatch : kBatch * kSeq; }

struct Reference {
  std::map<std::string, torch::Tensor> grads;  // of the first batch
  std::vector<double> losses;                  // of 5 Adam steps
};

Reference reference(Loss l) {
  Reference r;
  auto model = make_model(is_classifier(l));
  auto f = loss_fn(l, nullptr);
  auto b = batch(50, is_classifier(l));
  auto loss = f(model->forward(b.x), b.y);
  (is_sum(l) ? loss / terms(l) : loss).backward();
  for (auto& p : model->named_parameters()) r.grads[p.key()] = p.value().grad().clone();
  model = make_model(is_classifier(l));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  for (int s = 0; s < 5; ++s) {
    auto bs = batch(50 + s, is_classifier(l));
    opt.zero_grad();
    auto ls = f(model->forward(bs.x), bs.y);
    if (is_sum(l)) ls = ls / terms(l);
    ls.backward();
    opt.step();
    r.losses.push_back(ls.item<double>());
  }
  return r;
}

struct Layout {
  const char* name;
  int cp, tp, pp;
  Strategy strategy;
  bool sequence_parallel = false;
};

std::unique_ptr<Engine> engine(const Layout& lay, Loss l, const std::string& optimizer, double lr) {
  ParallelConfig c;
  c.cp = lay.cp;
  c.tp = lay.tp;
  c.pp = lay.pp;
  c.micro_batches = lay.pp > 1 ? 2 : 1;
  c.strategy = lay.strategy;
  c.sequence_parallel = lay.sequence_parallel;
  EngineOptions eo;
  eo.tensor_parallel = [](torch::nn::Sequential dense, CommPtr tp, const tp::TensorParallelOptions& o) {
    return llama::tensor_parallel(dense, tp, o);
  };
  OptimizerOptions o;
  o.kind = optimizer;
  o.lr = lr;
  return std::make_unique<Engine>(runtime(), make_model(is_classifier(l)), o, c, eo);
}

// One step of this layout: the replica's rows of the batch, the loss as the layout takes it.
at::Tensor step(Engine& eng, Loss l, uint64_t seed) {
  auto b = batch(seed, is_classifier(l));
  const int dp = eng.dp_size();
  auto x = slice_for_rank(b.x, eng.dp_rank(), dp), y = slice_for_rank(b.y, eng.dp_rank(), dp);
  StepOptions so;
  if (is_sum(l)) {
    so.reduction = LossReduction::kSum;
    so.terms = terms(l);
  }
  auto loss = eng.step(x, y, loss_fn(l, eng.grid() && eng.grid()->tp_size() > 1 ? eng.grid()->tp() : nullptr), so);
  // Every rank's report: the replica's loss on the output ranks (the pipeline's last stage).
  auto mine = loss.defined() && eng.is_output_rank() ? loss.detach().reshape({1}).to(torch::kDouble)
                                                     : torch::zeros({1}, torch::kDouble);
  auto count = torch::tensor({eng.is_output_rank() ? 1.0 : 0.0}, torch::kDouble);
  eng.world()->allreduce(mine);
  eng.world()->allreduce(count);
  return mine / count;
}

void expect_follows(const Layout& lay, Loss l, const Reference& ref) {
  SCOPED_TRACE(std::string(lay.name) + ", " + name_of(l));
  {
    auto eng = engine(lay, l, "sgd", 1.0);
    const auto before = eng->full_parameters();
    step(*eng, l, 50);
    const auto after = eng->full_parameters();
    for (auto& [name, g] : ref.grads) {
      ASSERT_TRUE(before.count(name)) << name;
      EXPECT_LT(rel_err(before.at(name) - after.at(name), g), 1e-5) << "gradient of " << name;
    }
  }
  auto eng = engine(lay, l, "adam", 1e-2);
  for (int s = 0; s < 5; ++s) {
    const double got = step(*eng, l, 50 + s).item<double>();
    EXPECT_LT(std::abs(got - ref.losses[s]) / std::abs(ref.losses[s]), 1e-5)
        << "step " << s << ": " << got << " against " << ref.losses[s];
  }
}

std::vector<Layout> layouts() {
  if (world()->size() == 2) {
    return {{"cp2 ddp", 2, 1, 1, Strategy::kDDP},
            {"cp2 zero1", 2, 1, 1, Strategy::kZero1},
            {"cp2 zero3", 2, 1, 1, Strategy::kZero3}};
  }
  return {{"cp4 ddp", 4, 1, 1, Strategy::kDDP},
          {"cp2 x dp2 zero3", 2, 1, 1, Strategy::kZero3},
          {"tp2 x cp2", 2, 2, 1, Strategy::kDDP},
          {"tp2 x cp2, sequence parallel", 2, 2, 1, Strategy::kDDP, true},
          {"pp2 x cp2", 2, 1, 2, Strategy::kDDP}};
}

TEST(ContextParallelLayouts, LmGradientsAndLossesFollowOneProcess) {
  for (Loss l : {Loss::kLmMean, Loss::kLmSum}) {
    const auto ref = reference(l);
    for (const auto& lay : layouts()) expect_follows(lay, l, ref);
  }
}

TEST(ContextParallelLayouts, ClassifierGradientsAndLossesFollowOneProcess) {
  for (Loss l : {Loss::kClassifierMean, Loss::kClassifierSum}) {
    const auto ref = reference(l);
    for (const auto& lay : layouts()) expect_follows(lay, l, ref);
  }
}

// The replica's output of a whole sequence is gathered for inference: predict() gives the same
// logits as one process.
TEST(ContextParallelLayouts, PredictGathersTheWholeSequence) {
  auto ref = make_model(false);
  auto b = batch(70, false);
  torch::Tensor want;
  {
    torch::NoGradGuard ng;
    want = ref->forward(b.x);
  }
  const Layout lay = layouts()[0];
  auto eng = engine(lay, Loss::kLmMean, "sgd", 0.1);
  eng->train(false);
  auto got = eng->predict(b.x);
  EXPECT_EQ(got.sizes(), want.sizes());
  EXPECT_LT(rel_err(got, want), 1e-10);
}

TEST(ContextParallelLayouts, SequenceNotAMultipleOfTwiceCpIsRefused) {
  const int cp = world()->size();
  auto eng = engine({"cp", cp, 1, 1, Strategy::kDDP}, Loss::kLmMean, "sgd", 0.1);
  auto ids = torch::zeros({1, 2 * cp + 1}, torch::kLong);
  try {
    eng->step(ids, ids, loss_fn(Loss::kLmMean, nullptr));
    FAIL() << "a sequence of " << 2 * cp + 1 << " tokens was accepted under cp " << cp;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of " + std::to_string(2 * cp)), std::string::npos) << e.what();
  }
}

// A model without a layer that knows its positions is refused at construction, by name.
TEST(ContextParallelLayouts, ModelWithoutContextParallelLayersIsRefused) {
  ParallelConfig c;
  c.cp = 2;
  torch::nn::Sequential mlp(torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
  try {
    Engine eng(runtime(), mlp, OptimizerOptions{}, c);
    FAIL() << "an MLP was accepted under --cp 2";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cp::ContextParallel"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tandem::test
