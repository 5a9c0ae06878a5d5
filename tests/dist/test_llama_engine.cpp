// The Llama model (tandem/llama.h) trained through tandem::Engine under ddp and zero1-3, tied
// and untied embeddings, and its Sequential form under per-layer ZeRO-3, a two-stage pipeline
// and tensor parallelism (the vocabulary-parallel loss): every layout's losses and final
// parameters follow one process training plain LibTorch on the whole batch. With .venv-hf, the
// logits of tp2, pp2 and zero3 (causal LM and sequence classifier, each rank reading only its
// part of the checkpoint) match transformers' on models transformers made, and the checkpoints
// of `tandem finetune --init-from` (both tasks) under tp2 and pp2 export to directories whose
// logits in transformers are Tandem's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <string>
#include <sys/stat.h>
#include <tuple>
#include <unistd.h>

#include "tandem/engine.h"
#include "tandem/grid.h"
#include "tandem/llama.h"
#include "tandem/text.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/llama_test_util.h"
#include "tests/dist/train_test_util.h"
#include "tests/hf/export_check.h"

namespace tandem::test {
namespace {

constexpr int64_t kVocab = 48, kSeq = 8, kBatch = 12;

llama::LlamaForCausalLM make_llama(bool tied) {
  auto c = tiny_llama_config(kVocab, kSeq);
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

// One process, plain LibTorch on the whole batch: the losses and the trained model.
std::vector<double> reference_losses(llama::LlamaForCausalLM& ref, int steps) {
  torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<double> want;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = lm_batch(40 + s);
    opt.zero_grad();
    auto loss = kNextToken(ref(x), y);
    loss.backward();
    opt.step();
    want.push_back(loss.item<double>());
  }
  return want;
}

OptimizerOptions adam() {
  OptimizerOptions o;
  o.kind = "adam";
  o.lr = 1e-2;
  return o;
}

// Trains `eng` for the reference's steps, this replica taking its rows (every stage of a
// replica passes the same rows), and compares losses and the whole model's final values.
void expect_follows(Engine& eng, int dp, const std::vector<double>& want, llama::LlamaForCausalLM& ref,
                    const std::function<std::string(const std::string&)>& to_hf, const LossFn& loss = kNextToken) {
  const int rank = eng.world()->rank();
  for (size_t s = 0; s < want.size(); ++s) {
    auto [x, y] = lm_batch(40 + s);
    if (dp > 1) {
      x = slice_for_rank(x, rank, dp);
      y = slice_for_rank(y, rank, dp);
    }
    auto l = eng.step(x, y, loss).detach().reshape({1}).clone();
    eng.world()->allreduce(l, ReduceOp::kAvg);
    EXPECT_NEAR(l.item<double>(), want[s], 1e-5) << "step " << s;
  }
  const auto full = eng.full_parameters();
  const auto mine = ref->named_parameters();
  ASSERT_EQ(full.size(), mine.size());
  for (auto& [name, value] : full) {
    const auto hf = to_hf ? to_hf(name) : name;
    ASSERT_TRUE(mine.contains(hf)) << hf;
    EXPECT_LT(rel_err(value, mine[hf].detach()), 1e-4) << hf;
  }
}

using Param = std::tuple<Strategy, bool>;
class LlamaEngine : public ::testing::TestWithParam<Param> {};

TEST_P(LlamaEngine, EveryLayoutFollowsOneProcess) {
  const auto [strategy, tied] = GetParam();
  auto ref = make_llama(tied);
  const auto want = reference_losses(ref, 5);
  ParallelConfig config;
  config.strategy = strategy;
  Engine eng(runtime(), make_llama(tied), adam(), config);
  expect_follows(eng, eng.world_size(), want, ref, nullptr);
}

// The untied model's Sequential form holding `from`'s values.
torch::nn::Sequential sequential_of(const llama::LlamaForCausalLM& from) {
  auto seq = llama::causal_lm_sequential(from->model->config);
  torch::NoGradGuard g;
  auto src = from->named_parameters();
  for (auto& p : seq->named_parameters()) p.value().copy_(src[llama::sequential_to_hf(p.key())]);
  return seq;
}

// The layouts of the Sequential form on an even number of ranks: per-layer ZeRO-3, a two-stage
// pipeline, tensor parallelism over 2 ranks, and (on 4 ranks) tp2 with ZeRO-3 over 2 replicas.
enum class SeqLayout { kZero3, kPp2, kTp2, kTp2Zero3 };
const char* name_of(SeqLayout l) {
  const char* names[] = {"zero3", "pp2", "tp2", "tp2 x zero3"};
  return names[static_cast<int>(l)];
}

// `init`: EngineOptions::init_from (null: the Sequential's values).
std::unique_ptr<Engine> sequential_engine(SeqLayout layout, torch::nn::Sequential seq,
                                          Precision precision = Precision::kFP32,
                                          std::shared_ptr<const ParameterSource> init = nullptr) {
  ParallelConfig config;
  config.precision = precision;
  const bool zero3 = layout == SeqLayout::kZero3 || layout == SeqLayout::kTp2Zero3;
  config.strategy = zero3 ? Strategy::kZero3 : Strategy::kDDP;
  config.pp = layout == SeqLayout::kPp2 ? 2 : 1;
  config.tp = layout == SeqLayout::kTp2 || layout == SeqLayout::kTp2Zero3 ? 2 : 1;
  config.micro_batches = layout == SeqLayout::kPp2 ? 3 : 1;
  EngineOptions eo;
  eo.tensor_parallel = [](torch::nn::Sequential dense, CommPtr tp, const tp::TensorParallelOptions& o) {
    return llama::tensor_parallel(dense, tp, o);
  };
  eo.init_from = std::move(init);
  return std::make_unique<Engine>(runtime(), seq, adam(), config, eo);
}

// The flat Sequential form (llama::causal_lm_sequential): ZeRO-3 with one unit per decoder
// layer, a two-stage pipeline cut between layers, and tp2 (q/k/v and gate/up column-parallel,
// o and down row-parallel, the vocabulary-parallel embedding and head, its logits left split for
// tp::vocab_parallel_cross_entropy).
TEST(LlamaSequentialEngine, PerLayerZero3PipelineAndTensorParallelFollowOneProcess) {
  auto ref = make_llama(false);
  auto initial = make_llama(false);
  const auto want = reference_losses(ref, 5);
  if (world()->size() % 2 != 0) GTEST_SKIP() << "pp 2 and tp 2 need an even number of ranks";
  for (auto layout : {SeqLayout::kZero3, SeqLayout::kPp2, SeqLayout::kTp2}) {
    SCOPED_TRACE(name_of(layout));
    auto eng = sequential_engine(layout, sequential_of(initial));
    LossFn loss = kNextToken;
    if (layout == SeqLayout::kTp2) {
      loss = [tp = eng->grid()->tp()](const at::Tensor& logits, const at::Tensor& y) {
        EXPECT_EQ(logits.size(-1), kVocab / 2) << "the training logits stay split over the vocabulary";
        return tp::vocab_parallel_cross_entropy(logits, y, tp).mean();
      };
    }
    expect_follows(*eng, eng->dp_size(), want, ref, llama::sequential_to_hf, loss);
  }
}

// Bad input: a tp size that does not divide the key/value heads (2 here) is refused, naming them.
TEST(LlamaSequentialEngine, TensorParallelRefusesIndivisibleHeads) {
  auto c = make_llama(false)->model->config;
  c.num_key_value_heads = 1;
  c.num_attention_heads = 3;
  c.hidden_size = 48;
  try {
    llama::check_tensor_parallel(c, 2);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("num_attention_heads (3)"), std::string::npos) << e.what();
  }
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.vocab_size = 47;
  EXPECT_THROW(llama::check_tensor_parallel(c, 2), std::invalid_argument);
  EXPECT_NO_THROW(llama::check_tensor_parallel(make_llama(false)->model->config, 2));
}

int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (auto& t : tensors) n += static_cast<int64_t>(t.nbytes());
  return n;
}

// The elements data-parallel rank `rank` of `world` owns under per-layer ZeRO-3 of `seq` with
// tensor parallelism over `tp` ranks: each child with parameters is one flat unit of its tp
// block, padded to a multiple of `world`, whose r-th chunk rank r holds; padding counts nothing.
// Under tp every matrix but the classifier's score head is split in tp blocks; the RMSNorm
// weights (the only vectors: Llama has no biases here) and the score head are replicated.
int64_t zero3_owned_elements(const torch::nn::Sequential& seq, int rank, int world, int tp = 1) {
  int64_t owned = 0;
  for (const auto& child : seq->children()) {
    const bool replicated = child->as<llama::ScoreHeadImpl>() != nullptr;
    int64_t n = 0;
    for (const auto& p : child->parameters()) n += p.dim() == 2 && !replicated ? p.numel() / tp : p.numel();
    const int64_t chunk = std::max<int64_t>((n + world - 1) / world, 1);
    if (n > 0) owned += std::clamp<int64_t>(n - rank * chunk, 0, chunk);
  }
  return owned;
}

// transformers builds a tiny random Llama and a sequence classifier (tests/hf/llama_reference.py)
// and their logits. Each rank reads its part of the checkpoint through its placements
// (EngineOptions::init_from): under tp2 and pp2 exactly the bytes of the parameters it trains,
// under 2/3 of the model's; under zero3 exactly the bytes of the elements of its flat shard,
// half the model's. The logits then match transformers' within
// 1e-4 in fp32 (the classifier's pooled at each row's last token that is not padding), and tp2
// and zero3 in bf16 within bf16's resolution (1.5 times transformers' own bf16 error).
TEST(LlamaSequentialEngine, LogitsOfEveryLayoutMatchTransformers) {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "TANDEM_SOURCE_DIR unset (ctest sets it)";
  const std::string python = std::string(src) + "/.venv-hf/bin/python";
  ASSERT_EQ(::access(python.c_str(), X_OK), 0) << python << " missing: run scripts/setup-hf-venv.sh";
  if (world()->size() % 2 != 0) GTEST_SKIP() << "pp 2 and tp 2 need an even number of ranks";
  const auto dir = shared_dir(*world(), "llama_layouts");
  int made = 0;
  if (world()->rank() == 0) {
    made = std::system(("HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 " + python + " " + src +
                        "/tests/hf/llama_reference.py make " + dir + " >/dev/null")
                           .c_str());
  }
  auto status = torch::tensor({made}, torch::kInt);
  world()->broadcast(status, 0);
  ASSERT_EQ(status.item<int>(), 0) << "llama_reference.py make failed";
  // bf16's resolution on these logits: how far transformers' own bf16 forward (the model cast to
  // bf16) lands from its fp32 logits; Tandem's bf16 may round in another order, hence the 1.5.
  const auto bf16 = safetensors::Checkpoint(dir + "/lm-ref-bf16.safetensors").get("logits");
  const auto lm_logits = safetensors::Checkpoint(dir + "/lm-ref.safetensors").get("logits");
  const double kBf16Logits = 1.5 * (bf16 - lm_logits).abs().max().item<double>();
  const std::tuple<std::string, SeqLayout, Precision, double> cases[] =
      {{"lm", SeqLayout::kTp2, Precision::kFP32, 1e-4},      {"lm", SeqLayout::kPp2, Precision::kFP32, 1e-4},
       {"lm", SeqLayout::kZero3, Precision::kFP32, 1e-4},    {"lm", SeqLayout::kTp2, Precision::kBF16, kBf16Logits},
       {"cls", SeqLayout::kTp2, Precision::kFP32, 1e-4},     {"cls", SeqLayout::kPp2, Precision::kFP32, 1e-4},
       {"cls", SeqLayout::kZero3, Precision::kFP32, 1e-4},   {"lm", SeqLayout::kZero3, Precision::kBF16, kBf16Logits},
       {"lm", SeqLayout::kTp2Zero3, Precision::kFP32, 1e-4}, {"cls", SeqLayout::kTp2Zero3, Precision::kFP32, 1e-4}};
  for (auto [variant, layout, precision, tolerance] : cases) {
    // tp2 x zero3 needs 4 ranks, and runs there alone (dist_llama_zero3_tp_np4).
    if ((layout == SeqLayout::kTp2Zero3) != (world()->size() == 4)) continue;
    const std::string name = variant + " " + name_of(layout) + (precision == Precision::kBF16 ? " bf16" : " fp32");
    SCOPED_TRACE(name);
    const safetensors::Checkpoint ref(dir + "/" + variant + "-ref.safetensors");
    const auto ids = ref.get("ids"), want = ref.get("logits");
    const auto config = llama::load_config(dir + "/" + variant);
    // Children named by position, as a pipeline stage and the tensor-parallel form name them.
    const auto named =
        variant == "cls" ? llama::sequence_classifier_sequential(config) : llama::causal_lm_sequential(config);
    torch::nn::Sequential seq;
    for (const auto& child : *named) seq->push_back(child);
    const auto to_hf = [&](const std::string& n) {
      return llama::positional_to_hf(n, config.num_hidden_layers, variant == "cls" ? "score" : "lm_head");
    };
    const safetensors::Checkpoint weights(dir + "/" + variant);
    llama::check_weights(*seq, weights, false, to_hf);
    const int64_t total = bytes_of(seq->parameters());  // before ZeRO-3 frees them
    const int64_t owned = zero3_owned_elements(seq, world()->rank(), world()->size());
    // tp2 x zero3: by data-parallel rank (2 replicas), the same on both tp ranks.
    const int64_t owned_tp2[] = {zero3_owned_elements(seq, 0, 2, 2), zero3_owned_elements(seq, 1, 2, 2)};
    for (const auto& n : weights.names()) ASSERT_EQ(weights.info(n).dtype, at::kFloat) << n;
    auto eng = sequential_engine(layout, seq, precision, safetensors::parameter_source(weights, to_hf));
    if (layout == SeqLayout::kTp2Zero3) {  // each rank: the elements it owns of its tp block
      EXPECT_EQ(weights.bytes_read(), 4 * owned_tp2[eng->grid()->dp_rank()]);
    } else if (layout == SeqLayout::kZero3) {  // 4-byte elements
      EXPECT_EQ(weights.bytes_read(), 4 * owned);
      auto sum = torch::tensor({static_cast<double>(weights.bytes_read())}, torch::kDouble);
      world()->allreduce(sum, ReduceOp::kSum);
      EXPECT_EQ(sum.item<double>(), static_cast<double>(total)) << "every byte read by exactly one rank";
    } else if (precision == Precision::kFP32) {  // the trained parameters are the checkpoint's dtype
      EXPECT_EQ(weights.bytes_read(), bytes_of(eng->trained_parameters()));
      EXPECT_LT(weights.bytes_read(), total * 2 / 3);
    }
    eng->train(false);  // the tensor-parallel head gathers its logits in evaluation mode
    auto got = eng->predict(ids);
    if (!eng->is_output_rank()) continue;
    if (variant == "cls") got = llama::pool_scores(got, llama::pooled_positions(ids, config.pad_token_id));
    ASSERT_EQ(got.sizes(), want.sizes());
    const double diff = (got.to(torch::kFloat) - want).abs().max().item<double>();
    EXPECT_LE(diff, tolerance);
    EXPECT_GT(want.abs().max().item<double>(), 0.1) << "logits too small to tell models apart";
    std::cout << name << ": Tandem vs transformers (fp32), max |logit diff| " << diff << " (bound " << tolerance
              << "); this rank read " << weights.bytes_read() << " of " << total << " bytes\n";
  }
  if (world()->rank() == 0) std::system(("rm -rf " + dir).c_str());
}

// tests/hf/hf_fixture.py's LM and classifier fine-tuned 3 steps under tp2 and under pp2 (2
// ranks), each checkpoint exported: transformers, loading the export, gives the logits Tandem
// computes from the checkpoint within 1e-5.
TEST(LlamaExport, TensorParallelAndPipelineCheckpointsExportToTransformers) {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "TANDEM_SOURCE_DIR unset (ctest sets it)";
  ASSERT_EQ(::access((std::string(src) + "/.venv-hf/bin/python").c_str(), X_OK), 0)
      << "no .venv-hf: run scripts/setup-hf-venv.sh";
  ASSERT_TRUE(text::have_sentencepiece()) << "built without SentencePiece (scripts/setup.sh installs it)";
  ASSERT_EQ(::access("/usr/share/games/fortunes", R_OK), 0) << "no fortunes corpus (scripts/setup.sh installs it)";
  if (world()->size() != 2) GTEST_SKIP() << "runs on 2 ranks";
  const auto dir = shared_dir(*world(), "llama_export");
  int made = 0;
  if (world()->rank() == 0)
    made = std::system((fixture_script("make ") + dir + "/fx > " + dir + "/fx.log 2>&1").c_str());
  auto status = torch::tensor({made}, torch::kInt);
  world()->broadcast(status, 0);
  ASSERT_EQ(status.item<int>(), 0) << "hf_fixture.py make failed: see " << dir << "/fx.log";
  std::string checks;  // OUT REF lm|cls, one triple per task and layout
  for (const char* layout : {"tp2", "pp2"}) {
    SCOPED_TRACE(layout);
    const std::string work = dir + "/" + layout;
    if (world()->rank() == 0) ::mkdir(work.c_str(), 0755);
    world()->barrier();
    for (auto task : {text::HfTask::kLm, text::HfTask::kClassify}) {
      const std::string sub = task == text::HfTask::kLm ? "lm" : "cls";
      const auto out = finetune_and_export(runtime(), dir + "/fx", work, sub, task, [&](text::HfFinetuneConfig& cfg) {
        cfg.loop.parallel.strategy = Strategy::kDDP;
        (std::string(layout) == "tp2" ? cfg.loop.parallel.tp : cfg.loop.parallel.pp) = 2;
      });
      checks += " " + out + " " + work + "/" + sub + "-ref.safetensors " + sub;
    }
  }
  if (world()->rank() == 0) EXPECT_EQ(std::system(fixture_script("check-export" + checks).c_str()), 0);
  if (world()->rank() == 0) std::system(("rm -rf " + dir).c_str());
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
