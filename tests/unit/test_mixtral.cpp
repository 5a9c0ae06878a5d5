// Tests for Mixtral in tandem/llama.h (num_local_experts > 0): config.json parsing and its
// refusals, the Hugging Face parameter names of block_sparse_moe, tensor parallelism refused, and
// (in .venv-hf, scripts/setup-hf-venv.sh) logits and the training loss (the LM loss plus
// router_aux_loss_coef x the load-balancing loss, pooled over the layers as transformers, or per
// layer) against transformers' MixtralForCausalLM on checkpoints each side wrote.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdlib>
#include <set>

#include "tandem/llama.h"
#include "tandem/moe.h"
#include "tandem/safetensors.h"
#include "temp_dir.h"

namespace ll = tandem::llama;
namespace moe = tandem::moe;
namespace st = tandem::safetensors;
using tandem::test::TempDir;

namespace {

// What transformers 5 saves for a MixtralConfig (num_local_experts 8, top 2).
std::string mixtral_json(const std::string& extra = "") {
  return R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 300,
  "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-05, "hidden_act": "silu",
  "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0,
  "output_router_logits": false, "sliding_window": null, "tie_word_embeddings": false,
  "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"})" +
         extra + "}";
}

// The message of the std::invalid_argument that parse_config throws, "" when it accepts.
std::string refusal(const std::string& json) {
  try {
    ll::parse_config(json);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

bool mentions(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

torch::Tensor pick(const std::vector<std::pair<std::string, torch::Tensor>>& tensors, const std::string& name) {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  throw std::runtime_error("no tensor " + name);
}

// The next-token cross-entropy of logits [B, T, V] for ids [B, T] (every position but the last
// predicts the next), as transformers' loss with labels = ids.
torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& ids) {
  const auto T = ids.size(1), V = logits.size(2);
  return torch::nn::functional::cross_entropy(logits.narrow(1, 0, T - 1).reshape({-1, V}),
                                              ids.narrow(1, 1, T - 1).reshape({-1}));
}

// A training forward of `model` on ids: logits and the mean of the load-balancing loss terms the
// MoE layers recorded (moe::moe_stats).
template <typename M>
std::pair<torch::Tensor, double> forward_with_aux(M& model, const torch::Tensor& ids) {
  moe::reset_moe_stats();
  model->train();
  auto logits = model->forward(ids);
  const auto s = moe::moe_stats();
  EXPECT_GT(s.aux_loss_terms, 0);
  return {logits, s.aux_loss_terms > 0 ? s.aux_loss_sum / static_cast<double>(s.aux_loss_terms) : 0.0};
}

}  // namespace

TEST(MixtralConfig, ParsesTheMoeFieldsAndWritesThemBack) {
  const auto c = ll::parse_config(mixtral_json());
  EXPECT_TRUE(c.is_moe());
  EXPECT_EQ(c.num_local_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_DOUBLE_EQ(c.router_aux_loss_coef, 0.02);
  EXPECT_DOUBLE_EQ(c.rope_theta, 5000.0);
  EXPECT_FALSE(ll::parse_config(R"({"model_type": "llama", "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4})")
                   .is_moe());
  // MixtralConfig's defaults: 8 experts, rope theta 1e6.
  auto bare = ll::parse_config(R"({"model_type": "mixtral", "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4})");
  EXPECT_EQ(bare.num_local_experts, 8);
  EXPECT_DOUBLE_EQ(bare.rope_theta, 1e6);

  const auto j = nlohmann::json::parse(ll::config_json(c));
  EXPECT_EQ(j["model_type"], "mixtral");
  EXPECT_EQ(j["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(j["num_local_experts"], 8);
  EXPECT_EQ(j["num_experts_per_tok"], 2);
  EXPECT_DOUBLE_EQ(j["router_aux_loss_coef"].get<double>(), 0.02);
  EXPECT_EQ(j["router_jitter_noise"], 0.0);
  EXPECT_TRUE(j["sliding_window"].is_null());
  EXPECT_FALSE(j.contains("mlp_bias"));
  const auto back = ll::parse_config(ll::config_json(c));
  EXPECT_EQ(back.num_local_experts, 8);
  EXPECT_DOUBLE_EQ(back.router_aux_loss_coef, 0.02);
  EXPECT_EQ(nlohmann::json::parse(ll::config_json(ll::parse_config(R"({"vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4})")))["model_type"],
            "llama");

  const auto m = ll::moe_config(c);
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.top_k, 2);
  EXPECT_EQ(m.intermediate_size, 48);
  EXPECT_DOUBLE_EQ(m.aux_loss_coef, 0.02);
}

TEST(MixtralConfig, RefusesWhatItsLayersCannotRun) {
  EXPECT_TRUE(mentions(refusal(mixtral_json(R"(, "router_jitter_noise": 0.01)")), "\"router_jitter_noise\" is 0.01;"));
  EXPECT_TRUE(mentions(refusal(mixtral_json(R"(, "num_experts_per_tok": 9)")), "\"num_experts_per_tok\" is 9"));
  EXPECT_TRUE(mentions(refusal(mixtral_json(R"(, "num_experts_per_tok": 0)")), "num_experts_per_tok"));
  EXPECT_TRUE(mentions(refusal(mixtral_json(R"(, "num_local_experts": 0)")), "num_local_experts"));
  EXPECT_TRUE(mentions(refusal(mixtral_json(R"(, "sliding_window": 32)")), "\"sliding_window\" is 32"));
  EXPECT_EQ(refusal(mixtral_json(R"(, "sliding_window": 64)")), "");  // no shorter than any sequence
  EXPECT_TRUE(mentions(refusal(mixtral_json(R"(, "router_aux_loss_coef": -1)")), "router_aux_loss_coef"));
  EXPECT_TRUE(mentions(refusal(R"({"model_type": "qwen2_moe", "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4})"),
                       "not \"llama\" or \"mixtral\""));
}

TEST(Mixtral, ParameterNamesAreTheHuggingFaceNames) {
  ll::LlamaForCausalLM m(ll::parse_config(mixtral_json()));
  auto params = m->named_parameters();
  std::set<std::string> names;
  for (auto& p : params) names.insert(p.key());
  for (const char* n :
       {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.7.w1.weight",
        "model.layers.1.block_sparse_moe.experts.0.w2.weight", "model.layers.0.block_sparse_moe.experts.3.w3.weight",
        "model.layers.1.self_attn.q_proj.weight"})
    EXPECT_TRUE(names.count(n)) << n;
  for (auto& n : names) EXPECT_FALSE(mentions(n, ".mlp.")) << n;
  // Per layer: 4 attention projections, 2 norms, the gate and 8 experts x 3.
  EXPECT_EQ(names.size(), 2u + (4 + 2 + 1 + 8 * 3) * 2 + 1);
  EXPECT_EQ(params["model.layers.0.block_sparse_moe.gate.weight"].sizes(), torch::IntArrayRef({8, 64}));
  EXPECT_EQ(params["model.layers.0.block_sparse_moe.experts.2.w1.weight"].sizes(), torch::IntArrayRef({48, 64}));
  EXPECT_EQ(params["model.layers.0.block_sparse_moe.experts.2.w3.weight"].sizes(), torch::IntArrayRef({48, 64}));
  EXPECT_EQ(params["model.layers.0.block_sparse_moe.experts.2.w2.weight"].sizes(), torch::IntArrayRef({64, 48}));
  // The Sequential form's names map to the same.
  std::set<std::string> mapped;
  for (auto& p : ll::causal_lm_sequential(ll::parse_config(mixtral_json()))->named_parameters())
    mapped.insert(ll::sequential_to_hf(p.key()));
  EXPECT_EQ(mapped, names);
}

// A Mixtral layer is tensor-parallel when tp divides the heads and each expert's width
// (intermediate_size), as a Llama layer's MLP.
TEST(Mixtral, TensorParallelChecksTheExpertWidth) {
  auto c = ll::parse_config(mixtral_json());
  EXPECT_NO_THROW(ll::check_tensor_parallel(c, 2));
  ll::SequentialDecoderLayer layer(c);
  EXPECT_NO_THROW(layer->check_tensor_parallel(2));
  c.intermediate_size = 50;
  c.num_key_value_heads = 4;
  try {
    ll::check_tensor_parallel(c, 4);
    FAIL() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_TRUE(mentions(e.what(), "does not divide intermediate_size (50)")) << e.what();
    EXPECT_TRUE(mentions(e.what(), "a --tp of 2")) << e.what();
  }
}

// Selective recomputation recomputes the attention core and the norms and leaves the experts
// as they are: the same outputs and gradients.
TEST(Mixtral, SelectiveRecomputeKeepsOutputsAndGradients) {
  torch::manual_seed(7);
  ll::LlamaForCausalLM plain(ll::parse_config(mixtral_json()));
  ll::LlamaForCausalLM selective(ll::parse_config(mixtral_json()));
  {
    torch::NoGradGuard g;
    auto src = plain->named_parameters();
    for (auto& p : selective->named_parameters()) p.value().copy_(src[p.key()]);
  }
  for (auto& l : *selective->model->layers) l->as<ll::DecoderLayerImpl>()->set_selective(true);
  const auto ids = torch::randint(1, 300, {2, 9}, torch::kLong);
  auto a = plain(ids), b = selective(ids);
  EXPECT_TRUE(torch::allclose(a, b, 1e-6, 1e-6));
  a.pow(2).mean().backward();
  b.pow(2).mean().backward();
  auto theirs = selective->named_parameters();
  for (auto& p : plain->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(torch::allclose(p.value().grad(), theirs[p.key()].grad(), 1e-5, 1e-6)) << p.key();
  }
}

// transformers builds and saves a tiny random Mixtral and computes its logits and loss; Tandem
// loads it and matches the logits within 1e-4 (fp32) and the loss (LM loss + 0.02 x the pooled
// load-balancing loss) within rel 1e-5, and the per-layer form gives the mean of each layer's;
// Tandem saves it again and transformers, loading that, matches Tandem's logits and the loss.
TEST(Mixtral, MatchesTransformersBothWays) {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "TANDEM_SOURCE_DIR unset (ctest sets it)";
  const std::string python = std::string(src) + "/.venv-hf/bin/python";
  ASSERT_EQ(::access(python.c_str(), X_OK), 0) << python << " missing: run scripts/setup-hf-venv.sh";
  const std::string run =
      "HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 " + python + " " + src + "/tests/hf/mixtral_reference.py ";
  TempDir d;
  ASSERT_EQ(std::system((run + "make " + d.path).c_str()), 0);
  const auto ref = st::load_file(d.file("mixtral-ref.safetensors"));
  const auto ids = pick(ref, "ids");
  const auto want = pick(ref, "logits");
  const double want_loss = pick(ref, "loss").item<double>(), want_aux = pick(ref, "aux_loss").item<double>();
  const double want_per_layer = pick(ref, "aux_per_layer").item<double>();
  // The two forms differ on this model by far more than the tolerance, so the check tells them apart.
  ASSERT_GT(std::abs(want_aux - want_per_layer), 1e-3 * want_aux);

  auto m = ll::load_causal_lm(d.file("mixtral"));
  ASSERT_TRUE(m->model->config.is_moe());
  const double coef = m->model->config.router_aux_loss_coef;
  EXPECT_DOUBLE_EQ(coef, 0.02);
  auto [logits, aux] = forward_with_aux(m, ids);
  const double diff = (logits - want).abs().max().item<double>();
  EXPECT_LE(diff, 1e-4);
  EXPECT_GT(want.abs().max().item<double>(), 0.1) << "logits too small to tell models apart";
  const double loss = lm_loss(logits, ids).item<double>() + coef * aux;
  EXPECT_LE(std::abs(aux - want_aux) / want_aux, 1e-5) << aux << " vs " << want_aux;
  EXPECT_LE(std::abs(loss - want_loss) / want_loss, 1e-5) << loss << " vs " << want_loss;
  std::cout << "mixtral: Tandem vs transformers, logits max |diff| " << diff << ", loss " << loss << " vs " << want_loss
            << ", aux " << aux << " vs " << want_aux << "\n";

  // The Sequential form (pipeline stages, per-layer units), loaded under the Hugging Face names.
  auto seq = ll::causal_lm_sequential(m->model->config);
  ll::load_weights(*seq, st::Checkpoint(d.file("mixtral")), false, ll::sequential_to_hf);
  auto [seq_logits, seq_aux] = forward_with_aux(seq, ids);
  EXPECT_LE((seq_logits - want).abs().max().item<double>(), 1e-4);
  EXPECT_LE(std::abs(seq_aux - want_aux) / want_aux, 1e-5);

  // Per layer (Megatron-core's form): the mean of each layer's own loss.
  auto per_layer_config = m->model->config;
  per_layer_config.moe_aux_form = moe::AuxLossForm::kPerLayer;
  ll::LlamaForCausalLM per_layer(per_layer_config);
  ll::load_weights(*per_layer, st::Checkpoint(d.file("mixtral")));
  const double per_layer_aux = forward_with_aux(per_layer, ids).second;
  EXPECT_LE(std::abs(per_layer_aux - want_per_layer) / want_per_layer, 1e-5)
      << per_layer_aux << " vs " << want_per_layer;

  ll::save_pretrained(m, d.file("cc-mixtral"));
  m->eval();
  torch::NoGradGuard no_grad;
  st::save_file(d.file("cc-mixtral-logits.safetensors"), {{"logits", m(ids)}});
  EXPECT_EQ(std::system((run + "check " + d.path).c_str()), 0);
}
