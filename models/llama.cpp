#include "tandem/llama.h"

#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tandem/activation_checkpoint.h"
#include "tandem/lora.h"

namespace tandem::llama {
namespace {

using nlohmann::json;

[[noreturn]] void bad_config(const std::string& where, const std::string& what) {
  throw std::invalid_argument("Llama config '" + where + "': " + what);
}

bool is_mixtral(const json& j) { return j.contains("model_type") && j["model_type"] == "mixtral"; }

// A field that may be absent or null (then `fallback`), else of type T.
template <typename T>
T field(const json& j, const char* key, T fallback, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  const json& v = j[key];
  const bool ok = std::is_same_v<T, bool> ? v.is_boolean()
                  : std::is_integral_v<T> ? v.is_number_integer()
                                          : v.is_number();
  if (!ok) bad_config(where, std::string("\"") + key + "\" has the wrong type: " + v.dump());
  return v.get<T>();
}

int64_t required(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j[key].is_number_integer())
    bad_config(where, std::string("needs the integer \"") + key + "\"");
  return j[key].get<int64_t>();
}

// The rope theta of either spelling (top-level rope_theta, or transformers 5's rope_parameters),
// refusing any scaling other than the default.
double rope_theta(const json& j, const std::string& where, double fallback) {
  auto check_type = [&](const json& p, const char* key) {
    if (!p.is_object()) return;
    const auto type = p.value("rope_type", p.value("type", std::string("default")));
    if (type != "default")
      bad_config(where, std::string("\"") + key + "\" asks for rope type '" + type +
                            "'; only the default (unscaled) rotary embedding is supported");
  };
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) check_type(j["rope_scaling"], "rope_scaling");
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    check_type(j["rope_parameters"], "rope_parameters");
    return field<double>(j["rope_parameters"], "rope_theta", field<double>(j, "rope_theta", fallback, where), where);
  }
  return field<double>(j, "rope_theta", fallback, where);
}

void validate(const LlamaConfig& c, const std::string& where) {
  const std::pair<const char*, int64_t> sizes[] = {{"vocab_size", c.vocab_size},
                                                   {"hidden_size", c.hidden_size},
                                                   {"intermediate_size", c.intermediate_size},
                                                   {"num_hidden_layers", c.num_hidden_layers},
                                                   {"num_attention_heads", c.num_attention_heads},
                                                   {"num_key_value_heads", c.num_key_value_heads},
                                                   {"max_position_embeddings", c.max_position_embeddings},
                                                   {"num_labels", c.num_labels}};
  for (auto& [name, v] : sizes)
    if (v <= 0) bad_config(where, std::string("\"") + name + "\" must be positive, not " + std::to_string(v));
  if (c.head_dim <= 0 && c.hidden_size % c.num_attention_heads != 0)
    bad_config(where, "hidden_size " + std::to_string(c.hidden_size) + " is not a multiple of num_attention_heads " +
                          std::to_string(c.num_attention_heads) + " (or give head_dim)");
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    bad_config(where, "num_attention_heads " + std::to_string(c.num_attention_heads) +
                          " is not a multiple of num_key_value_heads " + std::to_string(c.num_key_value_heads));
  if (c.head_size() % 2 != 0) bad_config(where, "the head size " + std::to_string(c.head_size()) + " must be even");
  if (c.rms_norm_eps <= 0) bad_config(where, "\"rms_norm_eps\" must be positive");
  if (c.rope_theta <= 0) bad_config(where, "\"rope_theta\" must be positive");
  if (c.pad_token_id >= c.vocab_size) bad_config(where, "\"pad_token_id\" is outside the vocabulary");
  if (c.num_local_experts < 0) bad_config(where, "\"num_local_experts\" must be positive");
  if (c.is_moe() && (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_local_experts))
    bad_config(where, "\"num_experts_per_tok\" is " + std::to_string(c.num_experts_per_tok) +
                          "; each token is routed to between 1 and num_local_experts (" +
                          std::to_string(c.num_local_experts) + ") experts");
  if (c.is_moe() && c.router_aux_loss_coef < 0) bad_config(where, "\"router_aux_loss_coef\" must not be negative");
}

// Mixtral's fields (model_type "mixtral"), refusing what its layers cannot run.
void parse_mixtral(const json& j, const std::string& where, LlamaConfig& c) {
  c.num_local_experts = field<int64_t>(j, "num_local_experts", 8, where);
  if (c.num_local_experts <= 0)
    bad_config(where, "\"num_local_experts\" must be positive, not " + std::to_string(c.num_local_experts));
  c.num_experts_per_tok = field<int64_t>(j, "num_experts_per_tok", 2, where);
  c.router_aux_loss_coef = field<double>(j, "router_aux_loss_coef", 0.001, where);
  c.output_router_logits = field<bool>(j, "output_router_logits", false, where);
  const double jitter = field<double>(j, "router_jitter_noise", 0.0, where);
  if (jitter != 0.0)
    bad_config(where, "\"router_jitter_noise\" is " + j["router_jitter_noise"].dump() +
                          "; random noise on the router's input is not supported: set it to 0");
  const int64_t window = field<int64_t>(j, "sliding_window", 0, where);
  if (window > 0 && window < c.max_position_embeddings)
    bad_config(where, "\"sliding_window\" is " + std::to_string(window) + ", shorter than max_position_embeddings " +
                          std::to_string(c.max_position_embeddings) +
                          "; sliding-window attention is not supported (set it to null, or "
                          "max_position_embeddings to at most the window)");
  if (j.value("attention_bias", false) || j.value("mlp_bias", false))
    bad_config(where, "a Mixtral config with biases (attention_bias, mlp_bias) is not supported");
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read '" + path + "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool is_json_file(const std::string& path) { return path.size() >= 5 && path.substr(path.size() - 5) == ".json"; }

torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// padding_idx as transformers sets it: the pad token's embedding gets no gradient.
torch::nn::Embedding embedding(const LlamaConfig& c) {
  auto options = torch::nn::EmbeddingOptions(c.vocab_size, c.hidden_size);
  if (c.pad_token_id >= 0) options.padding_idx(c.pad_token_id);
  return torch::nn::Embedding(options);
}

// [B, H, T, D]: the second half negated and moved before the first.
torch::Tensor rotate_half(const torch::Tensor& x) {
  const auto half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// Causal attention of projected q [B, T, heads * d], k and v [B, T, kv_heads * d], rotary
// applied to q and k -> [B, T, heads * d]. With a cp group, the T tokens are this rank's part of
// the sequence (cos and sin at their global positions) and attention is ring attention.
torch::Tensor attend(const torch::Tensor& q_proj, const torch::Tensor& k_proj, const torch::Tensor& v_proj,
                     const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, const CommPtr& cp, const torch::Tensor& mask) {
  const auto B = q_proj.size(0), T = q_proj.size(1);
  auto split = [&](const torch::Tensor& t, int64_t h) { return t.view({B, T, h, head_dim}).transpose(1, 2); };
  auto q = split(q_proj, heads), k = split(k_proj, kv_heads), v = split(v_proj, kv_heads);
  const auto c = cos.to(q.scalar_type()), s = sin.to(q.scalar_type());
  q = q * c + rotate_half(q) * s;
  k = k * c + rotate_half(k) * s;
  if (cp) return cp::ring_attention(q, k, v, cp).transpose(1, 2).reshape({B, T, heads * head_dim});
  // Each key/value head serves heads / kv_heads consecutive query heads.
  if (kv_heads != heads) {
    k = k.repeat_interleave(heads / kv_heads, /*dim=*/1);
    v = v.repeat_interleave(heads / kv_heads, /*dim=*/1);
  }
  auto y = mask.defined() ? at::scaled_dot_product_attention(q, k, v, mask.to(q.device()), 0.0, /*is_causal=*/false)
                          : at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  return y.transpose(1, 2).reshape({B, T, heads * head_dim});
}

// attend(), recomputed in backward from q, k and v when `selective` (Megatron's core-attention
// recomputation): the rotated, repeated and attended tensors are not kept.
torch::Tensor attend_maybe_recomputed(bool selective, const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const torch::Tensor& cos, const torch::Tensor& sin,
                                      int64_t heads, int64_t kv_heads, int64_t head_dim, const CommPtr& cp,
                                      const torch::Tensor& mask) {
  if (!selective) return attend(q, k, v, cos, sin, heads, kv_heads, head_dim, cp, mask);
  return checkpoint_many(
      [=](const std::vector<torch::Tensor>& in) {
        return attend(in[0], in[1], in[2], cos, sin, heads, kv_heads, head_dim, cp, mask);
      },
      {q, k, v}, {}, /*draws=*/false);
}

// SwiGLU's silu(gate) * up; when `selective`, recomputed in backward from gate and up, so that
// silu(gate) is not kept.
torch::Tensor swiglu(bool selective, const torch::Tensor& gate, const torch::Tensor& up) {
  auto f = [](const std::vector<torch::Tensor>& in) { return torch::silu(in[0]) * in[1]; };
  return selective ? checkpoint_many(f, {gate, up}, {}, /*draws=*/false) : f({gate, up});
}

// An RMSNorm; when `selective`, recomputed in backward from x (which the residual stream keeps
// anyway), so that its normalised float copy is not kept.
torch::Tensor normed(bool selective, const RMSNorm& norm, const torch::Tensor& x) {
  const auto n = norm.ptr();
  if (!selective) return n->forward(x);
  return checkpoint_many([n](const std::vector<torch::Tensor>& in) { return n->forward(in[0]); }, {x}, {n->weight},
                         /*draws=*/false);
}

// The parameters under their Hugging Face names: the module's own names, which mirror them.
safetensors::TensorList hf_tensors(const torch::nn::Module& module,
                                   const std::function<std::string(const std::string&)>& to_hf) {
  safetensors::TensorList out;
  for (auto& p : module.named_parameters(/*recurse=*/true))
    out.emplace_back(to_hf ? to_hf(p.key()) : p.key(), p.value().detach());
  return out;
}

void save_dir(const torch::nn::Module& module, const LlamaConfig& config, const std::string& architecture,
              const std::string& dir, const safetensors::SaveOptions& options,
              const std::function<std::string(const std::string&)>& to_hf = nullptr) {
  safetensors::save_checkpoint(dir, hf_tensors(module, to_hf), options);
  std::ofstream f(dir + "/config.json");
  f << config_json(config, architecture) << "\n";
  if (!f.flush()) throw std::runtime_error("cannot write '" + dir + "/config.json'");
}

}  // namespace

// ---- configuration --------------------------------------------------------------------------

LlamaConfig parse_config(const std::string& json_text, const std::string& where) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    bad_config(where, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) bad_config(where, "must be a JSON object");
  if (j.contains("model_type") && j["model_type"] != "llama" && !is_mixtral(j))
    bad_config(where, "model_type is " + j["model_type"].dump() + ", not \"llama\" or \"mixtral\"");
  const auto act = j.value("hidden_act", std::string("silu"));
  if (act != "silu") bad_config(where, "\"hidden_act\" is '" + act + "'; only silu (SwiGLU) is supported");
  LlamaConfig c;
  c.vocab_size = required(j, "vocab_size", where);
  c.hidden_size = required(j, "hidden_size", where);
  c.intermediate_size = required(j, "intermediate_size", where);
  c.num_hidden_layers = required(j, "num_hidden_layers", where);
  c.num_attention_heads = required(j, "num_attention_heads", where);
  c.num_key_value_heads = field<int64_t>(j, "num_key_value_heads", c.num_attention_heads, where);
  c.head_dim = field<int64_t>(j, "head_dim", 0, where);
  c.max_position_embeddings = field<int64_t>(j, "max_position_embeddings", 2048, where);
  c.rms_norm_eps = field<double>(j, "rms_norm_eps", 1e-6, where);
  c.rope_theta = rope_theta(j, where, is_mixtral(j) ? 1e6 : 10000.0);  // each config class's default
  c.tie_word_embeddings = field<bool>(j, "tie_word_embeddings", false, where);
  c.attention_bias = field<bool>(j, "attention_bias", false, where);
  c.mlp_bias = field<bool>(j, "mlp_bias", false, where);
  c.pad_token_id = field<int64_t>(j, "pad_token_id", -1, where);
  if (j.contains("id2label") && j["id2label"].is_object()) c.num_labels = static_cast<int64_t>(j["id2label"].size());
  else c.num_labels = field<int64_t>(j, "num_labels", 2, where);
  if (is_mixtral(j)) parse_mixtral(j, where, c);
  validate(c, where);
  return c;
}

LlamaConfig load_config(const std::string& path) {
  const auto file = is_json_file(path) ? path : path + "/config.json";
  return parse_config(read_text(file), file);
}

std::string config_json(const LlamaConfig& c, const std::string& architecture) {
  json id2label = json::object(), label2id = json::object();
  for (int64_t i = 0; i < c.num_labels; ++i) {
    id2label[std::to_string(i)] = "LABEL_" + std::to_string(i);
    label2id["LABEL_" + std::to_string(i)] = i;
  }
  std::string arch = architecture;
  if (c.is_moe() && arch.rfind("Llama", 0) == 0) arch = "Mixtral" + arch.substr(5);
  json j = {{"architectures", {arch}},
            {"model_type", c.is_moe() ? "mixtral" : "llama"},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.intermediate_size},
            {"num_hidden_layers", c.num_hidden_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.num_key_value_heads},
            {"head_dim", c.head_size()},
            {"max_position_embeddings", c.max_position_embeddings},
            {"rms_norm_eps", c.rms_norm_eps},
            {"rope_theta", c.rope_theta},
            {"rope_parameters", {{"rope_theta", c.rope_theta}, {"rope_type", "default"}}},
            {"hidden_act", "silu"},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {"attention_bias", c.attention_bias},
            {"mlp_bias", c.mlp_bias},
            {"pad_token_id", c.pad_token_id >= 0 ? json(c.pad_token_id) : json(nullptr)},
            {"id2label", id2label},
            {"label2id", label2id},
            {"dtype", "float32"}};
  if (c.is_moe()) {  // MixtralConfig has no biases; its MoE fields instead
    j.erase("attention_bias");
    j.erase("mlp_bias");
    j["num_local_experts"] = c.num_local_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
    j["router_jitter_noise"] = 0.0;
    j["output_router_logits"] = c.output_router_logits;
    j["sliding_window"] = nullptr;
  }
  return j.dump(2);
}

moe::MoeConfig moe_config(const LlamaConfig& c) {
  moe::MoeConfig m;
  m.hidden_size = c.hidden_size;
  m.intermediate_size = c.intermediate_size;
  m.num_experts = c.num_local_experts;
  m.top_k = c.num_experts_per_tok;
  m.aux_loss_coef = c.router_aux_loss_coef;
  m.z_loss_coef = c.moe_z_loss_coef;
  m.capacity_factor = c.moe_capacity_factor;
  m.aux_form = c.moe_aux_form;
  return m;
}

// ---- modules --------------------------------------------------------------------------------

RMSNormImpl::RMSNormImpl(int64_t size, double eps) : eps(eps) {
  weight = register_parameter("weight", torch::ones({size}));
}

RMSNormImpl::RMSNormImpl(torch::Tensor w, double eps, CommPtr tp_) : eps(eps), tp(std::move(tp_)) {
  const bool trained = w.requires_grad();
  weight = register_parameter("weight", std::move(w), trained);
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  auto h = x.to(torch::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (tp ? tp::copy_to_tp(weight, tp) : weight) * h.to(x.scalar_type());
}

AttentionImpl::AttentionImpl(const LlamaConfig& c)
    : heads(c.num_attention_heads), kv_heads(c.num_key_value_heads), head_dim(c.head_size()) {
  q_proj = register_module("q_proj", linear(c.hidden_size, heads * head_dim, c.attention_bias));
  k_proj = register_module("k_proj", linear(c.hidden_size, kv_heads * head_dim, c.attention_bias));
  v_proj = register_module("v_proj", linear(c.hidden_size, kv_heads * head_dim, c.attention_bias));
  o_proj = register_module("o_proj", linear(heads * head_dim, c.hidden_size, c.attention_bias));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const torch::Tensor& mask) {
  return lora::linear(o_proj,
                      attend_maybe_recomputed(selective, lora::linear(q_proj, x), lora::linear(k_proj, x),
                                              lora::linear(v_proj, x), cos, sin, heads, kv_heads, head_dim, cp, mask));
}

MLPImpl::MLPImpl(const LlamaConfig& c) {
  gate_proj = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias));
  up_proj = register_module("up_proj", linear(c.hidden_size, c.intermediate_size, c.mlp_bias));
  down_proj = register_module("down_proj", linear(c.intermediate_size, c.hidden_size, c.mlp_bias));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  return lora::linear(down_proj, swiglu(selective, lora::linear(gate_proj, x), lora::linear(up_proj, x)));
}

DecoderLayerImpl::DecoderLayerImpl(const LlamaConfig& c, std::shared_ptr<moe::RouterLog> router_log, int64_t layer) {
  self_attn = register_module("self_attn", Attention(c));
  if (c.is_moe()) {
    if (!router_log) router_log = moe::make_router_log(c.num_hidden_layers);
    block_sparse_moe = register_module("block_sparse_moe", moe::SparseMoeBlock(moe_config(c), router_log, layer));
  } else {
    mlp = register_module("mlp", MLP(c));
  }
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                        const torch::Tensor& mask) {
  auto h = x + self_attn(normed(selective, input_layernorm, x), cos, sin, mask);
  const auto n = normed(selective, post_attention_layernorm, h);
  return h + (mlp ? mlp(n) : block_sparse_moe(n));
}

void DecoderLayerImpl::set_selective(bool on) {
  selective = self_attn->selective = on;
  if (mlp) mlp->selective = on;
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c) : config(c) {
  validate(c, "LlamaConfig");
  embed_tokens = register_module("embed_tokens", embedding(c));
  layers = register_module("layers", torch::nn::ModuleList());
  const auto router_log = c.is_moe() ? moe::make_router_log(c.num_hidden_layers) : nullptr;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(DecoderLayer(c, router_log, i));
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

std::pair<torch::Tensor, torch::Tensor> rotary_tables(const LlamaConfig& config, int64_t T) {
  return rotary_tables_at(config, torch::arange(T, torch::kLong));
}

std::pair<torch::Tensor, torch::Tensor> rotary_tables_at(const LlamaConfig& config, const torch::Tensor& positions) {
  const auto d = config.head_size();
  auto inv_freq = 1.0 / torch::pow(config.rope_theta, torch::arange(0, d, 2, torch::kLong).to(torch::kFloat) / d);
  auto freqs = positions.to(torch::kFloat).unsqueeze(-1) * inv_freq;
  auto emb = torch::cat({freqs, freqs}, -1);
  if (positions.dim() == 2) emb = emb.unsqueeze(1);  // [B, 1, T, d]: the same for every head
  return {emb.cos(), emb.sin()};
}

DocumentLayout document_layout(const torch::Tensor& ids, int64_t separator) {
  TORCH_CHECK(ids.dim() == 2, "Llama: document_layout takes ids [B, T], not ", ids.sizes());
  const auto B = ids.size(0), T = ids.size(1);
  const auto opts = ids.options().dtype(torch::kLong);
  auto sep = ids.eq(separator).to(torch::kLong);
  auto doc = sep.cumsum(1) - sep;  // a token's document: the separators before it
  auto t = torch::arange(T, opts).expand({B, T});
  // A document starts after the last separator before it: the running maximum of (s + 1) at
  // separators s, shifted by one.
  auto after = (t + 1) * sep;
  auto before = torch::cat({torch::zeros({B, 1}, opts), after.narrow(1, 0, T - 1)}, 1);
  auto start = std::get<0>(before.cummax(1));
  auto causal = torch::ones({T, T}, ids.options().dtype(torch::kBool)).tril();
  return {t - start, (doc.unsqueeze(2).eq(doc.unsqueeze(1)) & causal).unsqueeze(1)};
}

torch::Tensor DocumentEmbeddingImpl::forward(const torch::Tensor& ids) {
  documents->current = document_layout(ids, documents->separator);
  return torch::nn::EmbeddingImpl::forward(ids);
}

torch::Tensor DocumentVocabEmbeddingImpl::forward(const torch::Tensor& ids) {
  documents->current = document_layout(ids, documents->separator);
  return tp::VocabParallelEmbeddingImpl::forward(ids);
}

torch::Tensor LlamaModelImpl::forward(const torch::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == torch::kLong, "Llama: token ids must be int64 [B, T], not ",
              ids.scalar_type(), ids.sizes());
  const auto T = ids.size(1);
  TORCH_CHECK(T <= config.max_position_embeddings, "Llama: ", T, " tokens exceed max_position_embeddings ",
              config.max_position_embeddings);
  torch::Tensor mask;
  auto [cos, sin] = rotary_tables(config, T);
  if (config.document_separator >= 0) {
    auto docs = document_layout(ids, config.document_separator);
    std::tie(cos, sin) = rotary_tables_at(config, docs.positions);
    mask = docs.mask;
  }
  cos = cos.to(embed_tokens->weight.device());
  sin = sin.to(embed_tokens->weight.device());
  auto h = embed_tokens(ids);
  for (auto& layer : *layers) h = layer->as<DecoderLayer>()->forward(h, cos, sin, mask);
  return norm(h);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c) {
  model = register_module("model", LlamaModel(c));
  if (!c.tie_word_embeddings) lm_head = register_module("lm_head", linear(c.hidden_size, c.vocab_size, false));
}

torch::Tensor LlamaForCausalLMImpl::forward(const torch::Tensor& ids) {
  auto h = model(ids);
  return lm_head ? lm_head(h) : torch::linear(h, model->embed_tokens->weight);
}

LlamaForSequenceClassificationImpl::LlamaForSequenceClassificationImpl(const LlamaConfig& c) {
  model = register_module("model", LlamaModel(c));
  score = register_module("score", linear(c.hidden_size, c.num_labels, false));
}

torch::Tensor pooled_positions(const torch::Tensor& ids, int64_t pad_token_id) {
  const auto T = ids.size(1);
  if (pad_token_id < 0) return torch::full({ids.size(0)}, T - 1, ids.options().dtype(torch::kLong));
  // The last position holding a real token (0 when every token is padding), as transformers.
  auto positions = torch::arange(T, ids.options().dtype(torch::kLong));
  return (positions * (ids != pad_token_id).to(torch::kLong)).argmax(-1);
}

torch::Tensor pool_scores(const torch::Tensor& scores, const torch::Tensor& positions) {
  TORCH_CHECK(scores.dim() == 3 && positions.dim() == 1 && positions.size(0) == scores.size(0),
              "Llama: pool_scores takes scores [B, T, L] and positions [B], not ", scores.sizes(), " and ",
              positions.sizes());
  auto at = positions.to(scores.device(), torch::kLong);
  return scores.index({torch::arange(scores.size(0), at.options()), at});
}

torch::Tensor LlamaForSequenceClassificationImpl::forward(const torch::Tensor& ids) {
  return pool_scores(score(model(ids)), pooled_positions(ids, model->config.pad_token_id));
}

ScoreHeadImpl::ScoreHeadImpl(int64_t hidden, int64_t labels) {
  // nn::Linear's initialisation, so that a new head starts as LlamaForSequenceClassification's.
  weight = register_parameter("weight", linear(hidden, labels, false)->weight.detach().clone());
}

ScoreHeadImpl::ScoreHeadImpl(torch::Tensor w, CommPtr tp_) : tp(std::move(tp_)) {
  const bool trained = w.requires_grad();
  weight = register_parameter("weight", std::move(w), trained);
}

torch::Tensor ScoreHeadImpl::forward(const torch::Tensor& x) {
  return torch::linear(tp ? tp::gather_seq_from_tp(x, tp, /*sum_grads=*/false) : x, weight);
}

namespace {
// A decoder layer's rotary tables for its input's tokens (a cp rank's at their global positions,
// packed documents' at their positions in their document) and its attention mask (packed
// documents': block-diagonal; else undefined, causal). T: the tokens attention sees (a
// sequence-parallel layer's gathered ones).
struct LayerTables {
  torch::Tensor cos, sin, mask;
};
LayerTables layer_tables(const LlamaConfig& config, const torch::Tensor& x, int64_t T, const CommPtr& cp,
                         const DocumentState* documents) {
  if (documents) {
    TORCH_CHECK(!cp, "Llama: packed documents cannot be split by context parallelism");
    const auto& d = documents->current;
    TORCH_CHECK(d.positions.defined() && d.positions.size(1) == T,
                "Llama: a decoder layer of a model with a document_separator ran before its DocumentEmbedding "
                "(a pipeline stage after the first?)");
    auto [cos, sin] = rotary_tables_at(config, d.positions);
    return {cos.to(x.device()), sin.to(x.device()), d.mask};
  }
  auto [cos, sin] = cp ? rotary_tables_at(config, cp::positions(T, cp->rank(), cp->size())) : rotary_tables(config, T);
  return {cos.to(x.device()), sin.to(x.device()), {}};
}
}  // namespace

torch::Tensor SequentialDecoderLayerImpl::forward(const torch::Tensor& x) {
  const auto t = layer_tables(config, x, x.size(1), self_attn->cp, documents.get());
  return DecoderLayerImpl::forward(x, t.cos, t.sin, t.mask);
}

void SequentialDecoderLayerImpl::use_context_parallel(const CommPtr& cp) { self_attn->cp = cp; }

// ---- tensor parallelism ----------------------------------------------------------------------

void check_tensor_parallel(const LlamaConfig& c, int tp_size) {
  const std::pair<const char*, int64_t> sizes[] = {{"num_attention_heads", c.num_attention_heads},
                                                   {"num_key_value_heads", c.num_key_value_heads},
                                                   {"intermediate_size", c.intermediate_size},
                                                   {"vocab_size", c.vocab_size}};
  for (auto& [name, v] : sizes) {
    if (tp_size >= 1 && v % tp_size == 0) continue;
    std::string fits;
    for (int t = 2; t <= 8; ++t) {
      bool all = true;
      for (auto& s : sizes) all = all && s.second % t == 0;
      if (all) fits += (fits.empty() ? "" : ", ") + std::to_string(t);
    }
    throw std::invalid_argument("Llama: the tensor-parallel size " + std::to_string(tp_size) + " does not divide " +
                                name + " (" + std::to_string(v) + "); use " +
                                (fits.empty() ? std::string("--tp 1 (no size up to 8 divides every cut dimension)")
                                              : "a --tp of " + fits + " (or 1)"));
  }
}

void SequentialDecoderLayerImpl::check_tensor_parallel(int tp_size) const {
  llama::check_tensor_parallel(config, tp_size);
}

torch::nn::AnyModule SequentialDecoderLayerImpl::to_tensor_parallel(const CommPtr& tp) const {
  return torch::nn::AnyModule(ParallelDecoderLayer(*this, tp));
}

ParallelAttentionImpl::ParallelAttentionImpl(const AttentionImpl& d, const CommPtr& tp_)
    : local_heads(tp::shard_size(d.heads, tp_->size(), "num_attention_heads")),
      local_kv_heads(tp::shard_size(d.kv_heads, tp_->size(), "num_key_value_heads")), head_dim(d.head_dim), tp(tp_) {
  q_proj = register_module("q_proj", tp::ColumnParallelLinear(d.q_proj, tp));
  k_proj = register_module("k_proj", tp::ColumnParallelLinear(d.k_proj, tp));
  v_proj = register_module("v_proj", tp::ColumnParallelLinear(d.v_proj, tp));
  o_proj = register_module("o_proj", tp::RowParallelLinear(d.o_proj, tp, /*input_is_parallel=*/true));
}

torch::Tensor ParallelAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                             const torch::Tensor& mask) {
  // One input collective for the three projections (each ColumnParallelLinear would add its own).
  const auto in = tp::column_input(x, tp, sequence_parallel);
  auto y = attend_maybe_recomputed(selective, q_proj->project(in.in, in.whole), k_proj->project(in.in, in.whole),
                                   v_proj->project(in.in, in.whole), cos, sin, local_heads, local_kv_heads, head_dim,
                                   cp, mask);
  return o_proj(y);
}

ParallelMLPImpl::ParallelMLPImpl(const MLPImpl& d, const CommPtr& tp_) : tp(tp_) {
  gate_proj = register_module("gate_proj", tp::ColumnParallelLinear(d.gate_proj, tp));
  up_proj = register_module("up_proj", tp::ColumnParallelLinear(d.up_proj, tp));
  down_proj = register_module("down_proj", tp::RowParallelLinear(d.down_proj, tp, /*input_is_parallel=*/true));
}

torch::Tensor ParallelMLPImpl::forward(const torch::Tensor& x) {
  const auto in = tp::column_input(x, tp, sequence_parallel);
  return down_proj(swiglu(selective, gate_proj->project(in.in, in.whole), up_proj->project(in.in, in.whole)));
}

ParallelDecoderLayerImpl::ParallelDecoderLayerImpl(const SequentialDecoderLayerImpl& d, const CommPtr& tp)
    : config(d.config), documents(d.documents) {
  self_attn = register_module("self_attn", ParallelAttention(*d.self_attn, tp));
  if (d.mlp) mlp = register_module("mlp", ParallelMLP(*d.mlp, tp));
  if (d.block_sparse_moe)
    block_sparse_moe = register_module("block_sparse_moe", moe::SparseMoeBlock(*d.block_sparse_moe, tp));
  input_layernorm = register_module("input_layernorm", d.input_layernorm);
  post_attention_layernorm = register_module("post_attention_layernorm", d.post_attention_layernorm);
  recompute_selectively(d.selective);
}

void ParallelDecoderLayerImpl::use_context_parallel(const CommPtr& cp) { self_attn->cp = cp; }

void ParallelDecoderLayerImpl::recompute_selectively(bool on) {
  self_attn->selective = on;
  if (mlp) mlp->selective = on;  // a Mixtral layer's experts keep their activations, as the dense layer's
}

void ParallelDecoderLayerImpl::split_sequence() {
  const auto& tp = self_attn->tp;
  self_attn->sequence_parallel = self_attn->o_proj->sequence_parallel = true;
  if (mlp) mlp->sequence_parallel = mlp->down_proj->sequence_parallel = true;
  if (block_sparse_moe) block_sparse_moe->sequence_parallel = true;
  input_layernorm = replace_module("input_layernorm", RMSNorm(input_layernorm->weight, input_layernorm->eps, tp));
  post_attention_layernorm = replace_module("post_attention_layernorm", RMSNorm(post_attention_layernorm->weight,
                                                                                post_attention_layernorm->eps, tp));
}

torch::Tensor ParallelDecoderLayerImpl::forward(const torch::Tensor& x) {
  // Attention runs on the gathered sequence: the tables cover all of it (with cp, this rank's
  // part of the sequence, at its global positions).
  const auto T = self_attn->sequence_parallel ? x.size(1) * self_attn->tp->size() : x.size(1);
  const auto t = layer_tables(config, x, T, self_attn->cp, documents.get());
  const bool selective = self_attn->selective;
  auto h = x + self_attn(normed(selective, input_layernorm, x), t.cos, t.sin, t.mask);
  const auto n = normed(selective, post_attention_layernorm, h);
  return h + (mlp ? mlp(n) : block_sparse_moe(n));
}

namespace {
// The converted model's children with the sequence split between the embedding and the head:
// the embedding reduce-scatters its output, the decoder layers and the final norm take shards,
// the head all-gathers them. Replaced children (the norm, the score head) are new modules over
// the same parameters, so that the dense model's stay as they were.
torch::nn::Sequential split_sequence(const torch::nn::Sequential& model, const CommPtr& tp) {
  const auto n = model->size();
  torch::nn::Sequential out;
  auto child = model->begin();
  for (size_t i = 0; i < n; ++i, ++child) {
    auto* m = child->ptr().get();
    const bool head = i + 1 == n;
    if (auto* e = m->as<tp::VocabParallelEmbeddingImpl>(); e && i == 0) {
      e->sequence_parallel = true;
    } else if (auto* layer = m->as<ParallelDecoderLayerImpl>()) {
      layer->split_sequence();
    } else if (auto* norm = m->as<RMSNormImpl>(); norm && !head) {
      out->push_back(RMSNorm(norm->weight, norm->eps, tp));
      continue;
    } else if (auto* lm = m->as<tp::ColumnParallelLinearImpl>(); lm && head) {
      lm->sequence_parallel = true;
    } else if (auto* tied = m->as<TiedHeadImpl>(); tied && head) {
      tied->sequence_parallel = true;
    } else if (auto* score = m->as<ScoreHeadImpl>(); score && head) {
      out->push_back(ScoreHead(score->weight, tp));
      continue;
    } else {
      throw std::invalid_argument("Llama: --sequence-parallel splits the sequence of causal_lm_sequential, "
                                  "tied_causal_lm_sequential or sequence_classifier_sequential; child " +
                                  std::to_string(i) + " of this model is none of their layers");
    }
    out->push_back(*child);
  }
  return out;
}
}  // namespace

torch::nn::Sequential tensor_parallel(torch::nn::Sequential dense, const CommPtr& tp,
                                      const tp::TensorParallelOptions& opts) {
  // tp::tensor_parallel checks every decoder layer (check_tensor_parallel) before any collective.
  tp::TensorParallelOptions o;
  o.sync_dense = opts.sync_dense;
  o.vocab_parallel_output = true;
  o.gather_logits_in_eval = true;
  auto* packed = dense->size() > 0 ? dense->ptr(0)->as<DocumentEmbeddingImpl>() : nullptr;
  const auto documents = packed ? packed->documents : nullptr;
  auto first = packed ? torch::nn::Embedding(std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(dense->ptr(0)))
                      : torch::nn::Embedding(nullptr);
  auto out = tp::tensor_parallel(std::move(dense), tp, o);
  if (documents) {  // the vocabulary-parallel embedding that also records the documents
    torch::nn::Sequential with;
    with->push_back(DocumentVocabEmbedding(first, tp, documents));
    auto child = out->begin();
    for (++child; child != out->end(); ++child) with->push_back(*child);
    out = with;
  }
  const auto n = out->size();
  if (n >= 2 && out->ptr(n - 1)->as<TiedHeadImpl>()) {
    // The tied head (shared with the dense model by the converter) gets its own module over the
    // vocabulary-parallel embedding's shard.
    auto* embedding = out->ptr(0)->as<tp::VocabParallelEmbeddingImpl>();
    if (!embedding)
      throw std::invalid_argument("Llama: a TiedHead needs the embedding as the Sequential's first child");
    torch::nn::Sequential tied;
    auto child = out->begin();
    for (size_t i = 0; i + 1 < n; ++i, ++child) tied->push_back(*child);
    tied->push_back(TiedHead(embedding->weight, tp));
    out = tied;
  }
  return opts.sequence_parallel ? split_sequence(out, tp) : out;
}

torch::Tensor TiedHeadImpl::forward(const torch::Tensor& x) {
  if (!tp) return torch::linear(x, weight);
  const auto in = sequence_parallel ? tp::gather_seq_from_tp(x, tp) : tp::copy_to_tp(x, tp);
  auto y = torch::linear(in, weight);
  return is_training() ? y : tp::gather_from_tp(y, tp);
}

namespace {
std::shared_ptr<DocumentState> document_state(const LlamaConfig& c) {
  if (c.document_separator < 0) return nullptr;
  auto d = std::make_shared<DocumentState>();
  d->separator = c.document_separator;
  return d;
}

// embed_tokens, layer0 .. layer<N-1>, norm: the body of both Sequential forms.
torch::nn::Sequential decoder_sequential(const LlamaConfig& c) {
  validate(c, "LlamaConfig");
  torch::nn::Sequential seq;
  auto documents = document_state(c);
  if (documents) {
    seq->push_back("embed_tokens", DocumentEmbedding(embedding(c)->options, documents));
  } else {
    seq->push_back("embed_tokens", embedding(c));
  }
  const auto router_log = c.is_moe() ? moe::make_router_log(c.num_hidden_layers) : nullptr;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    SequentialDecoderLayer layer(c, router_log, i);
    layer->documents = documents;
    seq->push_back("layer" + std::to_string(i), layer);
  }
  seq->push_back("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  return seq;
}
}  // namespace

torch::nn::Sequential tied_causal_lm_sequential(const LlamaConfig& c) {
  if (!c.tie_word_embeddings) throw std::invalid_argument("Llama: tied_causal_lm_sequential needs tied embeddings");
  auto seq = decoder_sequential(c);
  seq->push_back("lm_head", TiedHead(seq->ptr(0)->as<torch::nn::EmbeddingImpl>()->weight));
  return seq;
}

torch::nn::Sequential causal_lm_sequential(const LlamaConfig& c) {
  if (c.tie_word_embeddings)
    throw std::invalid_argument(
        "Llama: causal_lm_sequential needs untied embeddings (tie_word_embeddings false): a pipeline "
        "cannot share embed_tokens' weight between its first and last stage");
  auto seq = decoder_sequential(c);
  seq->push_back("lm_head", linear(c.hidden_size, c.vocab_size, false));
  return seq;
}

torch::nn::Sequential sequence_classifier_sequential(const LlamaConfig& c) {
  auto seq = decoder_sequential(c);
  seq->push_back("score", ScoreHead(c.hidden_size, c.num_labels));
  return seq;
}

std::string sequential_to_hf(const std::string& name) {
  auto starts = [&](const std::string& p) { return name.compare(0, p.size(), p) == 0; };
  if (starts("embed_tokens.") || starts("norm.")) return "model." + name;
  if (starts("lm_head.") || starts("score.")) return name;
  if (starts("layer")) {
    const auto dot = name.find('.');
    const auto index = name.substr(5, dot == std::string::npos ? std::string::npos : dot - 5);
    if (dot != std::string::npos && !index.empty() && index.find_first_not_of("0123456789") == std::string::npos)
      return "model.layers." + index + name.substr(dot);
  }
  throw std::invalid_argument("Llama: '" + name +
                              "' is not a parameter name of causal_lm_sequential or sequence_classifier_sequential");
}

std::string positional_to_hf(const std::string& name, int64_t layers, const std::string& head) {
  const auto dot = name.find('.');
  const auto index = name.substr(0, dot);
  if (dot == std::string::npos || index.empty() || index.size() > 9 ||
      index.find_first_not_of("0123456789") != std::string::npos || std::stoll(index) > layers + 2)
    throw std::invalid_argument("Llama: '" + name + "' is not a parameter name of a Sequential form of " +
                                std::to_string(layers) + " layers with positional children");
  const int64_t i = std::stoll(index);
  const std::string rest = name.substr(dot);
  if (i == 0) return "model.embed_tokens" + rest;
  if (i <= layers) return "model.layers." + std::to_string(i - 1) + rest;
  return (i == layers + 1 ? std::string("model.norm") : head) + rest;
}

// ---- loading and saving ---------------------------------------------------------------------

namespace {
// The checkpoint tensor parameter `param` loads from ("" when to_hf skips it). Throws
// std::runtime_error when the checkpoint lacks it.
std::string source_of(const std::string& param, const safetensors::Checkpoint& checkpoint,
                      const std::function<std::string(const std::string&)>& to_hf) {
  auto name = to_hf ? to_hf(param) : param;
  if (!name.empty() && !checkpoint.contains(name))
    throw std::runtime_error("Llama checkpoint: no tensor '" + name + "' for the model's parameter '" + param +
                             "'; is it a Llama checkpoint of this configuration?");
  return name;
}
}  // namespace

void check_weights(const torch::nn::Module& module, const safetensors::Checkpoint& checkpoint, bool allow_unused,
                   const std::function<std::string(const std::string&)>& to_hf) {
  std::set<std::string> used;
  for (auto& p : module.named_parameters(/*recurse=*/true)) {
    const auto name = source_of(p.key(), checkpoint, to_hf);
    if (name.empty()) continue;
    const auto& shape = checkpoint.info(name).shape;
    if (p.value().sizes() != c10::IntArrayRef(shape))
      throw std::runtime_error("Llama checkpoint: tensor '" + name + "' has shape " +
                               c10::str(c10::IntArrayRef(shape)) + " but the configuration gives " +
                               c10::str(p.value().sizes()));
    used.insert(name);
  }
  if (allow_unused) return;
  for (auto& name : checkpoint.names()) {
    const bool tied_head = name == "lm_head.weight" && !used.count(name);
    if (!used.count(name) && !tied_head)
      throw std::runtime_error("Llama checkpoint: tensor '" + name +
                               "' matches no parameter of the model (another architecture or configuration?)");
  }
}

void load_weights(torch::nn::Module& module, const safetensors::Checkpoint& checkpoint, bool allow_unused,
                  const std::function<std::string(const std::string&)>& to_hf) {
  check_weights(module, checkpoint, allow_unused, to_hf);
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters(/*recurse=*/true)) {
    const auto name = source_of(p.key(), checkpoint, to_hf);
    if (!name.empty()) p.value().copy_(checkpoint.get(name));
  }
}

LlamaForCausalLM load_causal_lm(const std::string& dir) {
  LlamaForCausalLM m(load_config(dir));
  load_weights(*m, safetensors::Checkpoint(dir));
  return m;
}

LlamaForSequenceClassification load_sequence_classifier(const std::string& dir) {
  LlamaForSequenceClassification m(load_config(dir));
  load_weights(*m, safetensors::Checkpoint(dir));
  return m;
}

void save_pretrained(const LlamaForCausalLM& model, const std::string& dir, const safetensors::SaveOptions& options) {
  save_dir(*model, model->model->config, "LlamaForCausalLM", dir, options);
}

void save_pretrained(const LlamaForSequenceClassification& model, const std::string& dir,
                     const safetensors::SaveOptions& options) {
  save_dir(*model, model->model->config, "LlamaForSequenceClassification", dir, options);
}

void save_pretrained(const torch::nn::Sequential& model, const LlamaConfig& config, const std::string& dir,
                     const safetensors::SaveOptions& options) {
  const bool classifier = !model->is_empty() && model->ptr(model->size() - 1)->as<ScoreHeadImpl>();
  save_dir(*model, config, classifier ? "LlamaForSequenceClassification" : "LlamaForCausalLM", dir, options,
           sequential_to_hf);
}

}  // namespace tandem::llama
