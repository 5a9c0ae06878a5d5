// A Llama-architecture causal language model (RMSNorm, rotary position embeddings, SwiGLU MLP,
// grouped-query attention, tied or untied embeddings) and its sequence-classification variant,
// built from a Hugging Face config.json and loaded from / saved to a Hugging Face checkpoint
// directory; with num_local_experts > 0 it is Mixtral (MixtralForCausalLM): each decoder layer's
// SwiGLU MLP replaced by a sparse mixture of experts (block_sparse_moe, tandem/moe.h). The module tree mirrors
// transformers' LlamaForCausalLM, so every parameter name is the Hugging Face name itself (model.embed_tokens.weight,
// model.layers.N.self_attn.q_proj.weight,
// ..., model.norm.weight, lm_head.weight / score.weight) and the decoder layers are the children
// of one ModuleList (model.layers), one unit each for per-layer sharding or pipeline cuts.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/activation_checkpoint.h"
#include "tandem/context_parallel.h"
#include "tandem/lora.h"
#include "tandem/moe.h"
#include "tandem/safetensors.h"
#include "tandem/tensor_parallel.h"

namespace tandem::llama {

// The fields of a Hugging Face LlamaConfig (or MixtralConfig) that the architecture uses.
struct LlamaConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;  // SwiGLU width (Mixtral: each expert's)
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;  // divides num_attention_heads (grouped-query attention)
  int64_t head_dim = 0;              // 0: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;  // lm_head uses embed_tokens' weight
  bool attention_bias = false;       // q/k/v/o projections with bias
  bool mlp_bias = false;             // gate/up/down projections with bias
  int64_t pad_token_id = -1;         // -1: none (the classifier then pools the last position)
  int64_t num_labels = 2;            // the sequence-classification head's outputs
  // Not a Hugging Face field (config.json neither holds nor gets it): >= 0 makes every row of ids
  // packed documents, each ending with this token (EOS), attended to and positioned apart
  // (document_layout); -1: one sequence per row.
  int64_t document_separator = -1;

  // Mixtral (model_type "mixtral"): > 0 makes every decoder layer's FFN a sparse mixture of this
  // many SwiGLU experts (block_sparse_moe), each token routed to num_experts_per_tok of them.
  int64_t num_local_experts = 0;  // 0: dense (Llama)
  int64_t num_experts_per_tok = 2;
  double router_aux_loss_coef = 0.001;  // the load-balancing loss's weight in the training loss
  bool output_router_logits = false;    // as config.json says (written back unchanged)
  // Run options of the MoE layers, not Hugging Face fields (config.json neither holds nor gets
  // them): the router z-loss's weight, the experts' capacity factor (0: dropless) and the form
  // of the load-balancing loss (pooled over the layers as transformers, or per layer).
  double moe_z_loss_coef = 0.0;
  double moe_capacity_factor = 0.0;
  moe::AuxLossForm moe_aux_form = moe::AuxLossForm::kPooled;

  bool is_moe() const { return num_local_experts > 0; }
  int64_t head_size() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
};

// Parses config.json's text (model_type "llama", or "mixtral"). Throws std::invalid_argument
// naming `where` and the field for a missing or ill-typed required field, a non-positive size,
// heads that do not divide the width or each other, an activation other than silu, or rope
// scaling (not supported); for Mixtral also for num_experts_per_tok outside
// [1, num_local_experts], router_jitter_noise other than 0 (random noise on the router's input
// in training, not supported), and a sliding_window shorter than max_position_embeddings.
LlamaConfig parse_config(const std::string& json_text, const std::string& where = "config.json");
// config.json of a checkpoint directory (or the file itself).
LlamaConfig load_config(const std::string& path);
// As transformers writes it (model_type "llama", architectures given), for save_pretrained; a
// Mixtral config as MixtralConfig writes it (model_type "mixtral", the MoE fields, the
// architecture's "Llama" prefix read as "Mixtral").
std::string config_json(const LlamaConfig& config, const std::string& architecture = "LlamaForCausalLM");
// The MoE layers' configuration of a Mixtral config (is_moe()).
moe::MoeConfig moe_config(const LlamaConfig& config);

// x * rsqrt(mean(x^2) + eps) * weight, computed in float32 as transformers does.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t size, double eps);
  // Over an existing weight (registered as this module's parameter, shared), for the sequence
  // shards of `tp` (sequence parallelism): each rank normalises its positions only, so the
  // weight's gradient is summed over tp (tp::copy_to_tp in forward).
  RMSNormImpl(torch::Tensor weight, double eps, CommPtr tp);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  double eps;
  CommPtr tp;  // set under sequence parallelism only
};
TORCH_MODULE(RMSNorm);

// Packed documents in rows of ids [B, T], each ending with `separator`, as Megatron-LM's
// reset_position_ids and reset_attention_mask from its EOD token: a separator belongs to the
// document it ends, positions restart at 0 after it, and a token attends to its own document's
// tokens up to itself only (block-diagonal causal attention). A row without separators is one
// sequence (positions 0..T-1, causal attention).
struct DocumentLayout {
  torch::Tensor positions;  // int64 [B, T]
  torch::Tensor mask;       // bool [B, 1, T, T]: query t may attend to key s
};
DocumentLayout document_layout(const torch::Tensor& ids, int64_t separator);

// Where the Sequential forms of a model with a document_separator keep the current batch's
// layout: their first child (DocumentEmbedding, or its vocabulary-parallel form) computes it from
// the ids, and the decoder layers after it read it. Only a model whose layers run after its
// embedding in the same process can share it: not the stages of a pipeline after the first.
struct DocumentState {
  int64_t separator = -1;
  DocumentLayout current;  // of the last ids embedded
};

// Causal self-attention with rotary embeddings; num_key_value_heads key/value heads shared by
// groups of query heads. [B, T, hidden] -> [B, T, hidden]. With `cp` set, x holds this rank's
// tokens of each sequence (tandem/context_parallel.h) and attention is ring attention over cp.
class AttentionImpl : public torch::nn::Module, public lora::Adaptable {
 public:
  explicit AttentionImpl(const LlamaConfig& config);
  // mask: DocumentLayout::mask, or undefined for causal attention over the whole row.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask = {});
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  int64_t heads, kv_heads, head_dim;
  CommPtr cp;
  bool selective = false;  // the attention core (rotary to attention x values) recomputed in backward
};
TORCH_MODULE(Attention);

// down_proj(silu(gate_proj(x)) * up_proj(x)).
class MLPImpl : public torch::nn::Module, public lora::Adaptable {
 public:
  explicit MLPImpl(const LlamaConfig& config);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  bool selective = false;  // silu(gate) * up recomputed in backward from the projections' outputs
};
TORCH_MODULE(MLP);

// The rotary tables cos and sin [T, head_dim] of positions 0..T-1, in float32 (as transformers
// computes them).
std::pair<torch::Tensor, torch::Tensor> rotary_tables(const LlamaConfig& config, int64_t T);
// The same tables at the given positions (int64 [T]; a context-parallel rank's global ones; or
// [B, T] per row, giving [B, 1, T, head_dim] to broadcast over the heads).
std::pair<torch::Tensor, torch::Tensor> rotary_tables_at(const LlamaConfig& config, const torch::Tensor& positions);

// x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x)); a Mixtral layer
// (config.is_moe()) has block_sparse_moe instead of mlp, layer `layer` of the MoE layers that
// share `router_log` (moe::make_router_log(num_hidden_layers); null makes one of its own).
class DecoderLayerImpl : public torch::nn::Module {
 public:
  explicit DecoderLayerImpl(const LlamaConfig& config, std::shared_ptr<moe::RouterLog> router_log = nullptr,
                            int64_t layer = 0);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask = {});
  // Selective recomputation (tandem/activation_checkpoint.h): the norms, the attention core and
  // the SwiGLU product recomputed in backward; the projections' outputs kept. A Mixtral layer's
  // experts are not recomputed (their routed activations are kept).
  void set_selective(bool on);
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  MLP mlp{nullptr};                               // null in a Mixtral layer
  moe::SparseMoeBlock block_sparse_moe{nullptr};  // Mixtral's, else null
  bool selective = false;
};
TORCH_MODULE(DecoderLayer);

// Token ids int64 [B, T] (T <= max_position_embeddings) -> the final norm's output [B, T, hidden].
// Mixtral's layers share one moe::RouterLog.
class LlamaModelImpl : public torch::nn::Module {
 public:
  explicit LlamaModelImpl(const LlamaConfig& config);
  torch::Tensor forward(const torch::Tensor& ids);
  LlamaConfig config;
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

// ids [B, T] -> logits [B, T, vocab_size]. Tied: no lm_head module; the logits use
// model.embed_tokens.weight, and the parameter list holds it once.
class LlamaForCausalLMImpl : public torch::nn::Module {
 public:
  explicit LlamaForCausalLMImpl(const LlamaConfig& config);
  torch::Tensor forward(const torch::Tensor& ids);
  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null when tied
};
TORCH_MODULE(LlamaForCausalLM);

// The position transformers' LlamaForSequenceClassification pools in each row of ids [B, T]: the
// last token that is not pad_token_id (right padding; 0 when every token is padding), or T - 1
// when pad_token_id < 0. int64 [B].
torch::Tensor pooled_positions(const torch::Tensor& ids, int64_t pad_token_id);
// Per-position scores [B, T, L] at each row's position [B] -> [B, L].
torch::Tensor pool_scores(const torch::Tensor& scores, const torch::Tensor& positions);

// ids [B, T] -> [B, num_labels]: score (no bias) of the last token that is not pad_token_id
// (right padding; the last position when there is no pad token), as transformers'
// LlamaForSequenceClassification.
class LlamaForSequenceClassificationImpl : public torch::nn::Module {
 public:
  explicit LlamaForSequenceClassificationImpl(const LlamaConfig& config);
  torch::Tensor forward(const torch::Tensor& ids);
  LlamaModel model{nullptr};
  torch::nn::Linear score{nullptr};
};
TORCH_MODULE(LlamaForSequenceClassification);

// A decoder layer as a child of a Sequential: forward(x) builds its rotary tables from x's
// length (the same values as LlamaModel's, which builds them once for all layers), or at the
// global positions of a context-parallel rank's tokens. Its tensor-parallel form is
// ParallelDecoderLayer (tp::tensor_parallel converts it).
class SequentialDecoderLayerImpl : public DecoderLayerImpl,
                                   public tp::Parallelizable,
                                   public cp::ContextParallel,
                                   public SelectiveRecompute {
 public:
  explicit SequentialDecoderLayerImpl(const LlamaConfig& config, std::shared_ptr<moe::RouterLog> router_log = nullptr,
                                      int64_t layer = 0)
      : DecoderLayerImpl(config, std::move(router_log), layer), config(config) {}
  torch::Tensor forward(const torch::Tensor& x);
  // Throws std::invalid_argument unless tp_size divides num_attention_heads,
  // num_key_value_heads and intermediate_size (a Mixtral expert's width).
  void check_tensor_parallel(int tp_size) const override;
  torch::nn::AnyModule to_tensor_parallel(const CommPtr& tp) const override;
  void use_context_parallel(const CommPtr& cp) override;
  void recompute_selectively(bool on) override { set_selective(on); }
  LlamaConfig config;
  std::shared_ptr<DocumentState> documents;  // set when config.document_separator >= 0
};
TORCH_MODULE(SequentialDecoderLayer);

// The token embedding of a Sequential form with a document_separator: an Embedding (the same
// parameter, the same name) that also records the ids' DocumentLayout in `documents`.
class DocumentEmbeddingImpl : public torch::nn::EmbeddingImpl {
 public:
  DocumentEmbeddingImpl(const torch::nn::EmbeddingOptions& options, std::shared_ptr<DocumentState> documents)
      : torch::nn::EmbeddingImpl(options), documents(std::move(documents)) {}
  torch::Tensor forward(const torch::Tensor& ids);
  std::shared_ptr<DocumentState> documents;
};
TORCH_MODULE(DocumentEmbedding);

// ---- tensor parallelism (tandem/tensor_parallel.h): Megatron-LM's cut of a decoder layer.
// Parameter names are those of the dense layer; every tp rank runs the same forwards.

// Attention with the heads split: tp rank r holds query heads [r*H/tp, (r+1)*H/tp) and
// key/value heads [r*KV/tp, (r+1)*KV/tp) (q/k/v column-parallel; each query head's key/value head
// is on its rank), and o_proj row-parallel. One all-reduce forward, one backward.
class ParallelAttentionImpl : public torch::nn::Module {
 public:
  ParallelAttentionImpl(const AttentionImpl& dense, const CommPtr& tp);
  // x: [B, T, hidden], or this rank's sequence shard [B, T/tp, hidden] under sequence
  // parallelism (all-gathered before the projections, o_proj's output reduce-scattered back);
  // cos and sin of the whole sequence.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask = {});
  tp::ColumnParallelLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr};
  tp::RowParallelLinear o_proj{nullptr};
  int64_t local_heads, local_kv_heads, head_dim;
  CommPtr tp;
  CommPtr cp;                      // ring attention over this context-parallel group when set
  bool sequence_parallel = false;  // set with o_proj's by ParallelDecoderLayer::split_sequence
  bool selective = false;          // as AttentionImpl's
};
TORCH_MODULE(ParallelAttention);

// SwiGLU with gate/up column-parallel and down row-parallel.
class ParallelMLPImpl : public torch::nn::Module {
 public:
  ParallelMLPImpl(const MLPImpl& dense, const CommPtr& tp);
  torch::Tensor forward(const torch::Tensor& x);  // sequence shards as ParallelAttention's
  tp::ColumnParallelLinear gate_proj{nullptr}, up_proj{nullptr};
  tp::RowParallelLinear down_proj{nullptr};
  CommPtr tp;
  bool sequence_parallel = false;
  bool selective = false;  // as MLPImpl's
};
TORCH_MODULE(ParallelMLP);

// The tensor-parallel SequentialDecoderLayer; its RMSNorms are the dense layer's (replicated). A
// Mixtral layer's block_sparse_moe is the dense block's tp form (tandem/moe.h: every expert cut as
// ParallelMLP cuts the MLP, the router replicated).
class ParallelDecoderLayerImpl : public torch::nn::Module, public cp::ContextParallel, public SelectiveRecompute {
 public:
  ParallelDecoderLayerImpl(const SequentialDecoderLayerImpl& dense, const CommPtr& tp);
  // Sequence parallelism: the layer then maps this rank's sequence shard [B, T/tp, hidden] (the
  // residual stream and the norms on it) to its shard of the output. The norms become new
  // modules over the same weights, so the dense layer is left as it was.
  void split_sequence();
  torch::Tensor forward(const torch::Tensor& x);
  void use_context_parallel(const CommPtr& cp) override;
  void recompute_selectively(bool on) override;  // as DecoderLayerImpl::set_selective
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  ParallelAttention self_attn{nullptr};
  ParallelMLP mlp{nullptr};                       // null in a Mixtral layer
  moe::SparseMoeBlock block_sparse_moe{nullptr};  // Mixtral's, else null
  LlamaConfig config;
  std::shared_ptr<DocumentState> documents;  // the dense layer's
};
TORCH_MODULE(ParallelDecoderLayer);

// DocumentEmbedding's vocabulary-parallel form (llama::tensor_parallel makes it).
class DocumentVocabEmbeddingImpl : public tp::VocabParallelEmbeddingImpl {
 public:
  DocumentVocabEmbeddingImpl(const torch::nn::Embedding& dense, CommPtr tp, std::shared_ptr<DocumentState> documents)
      : tp::VocabParallelEmbeddingImpl(dense, std::move(tp)), documents(std::move(documents)) {}
  torch::Tensor forward(const torch::Tensor& ids);
  std::shared_ptr<DocumentState> documents;
};
TORCH_MODULE(DocumentVocabEmbedding);

// Throws std::invalid_argument naming the field (num_attention_heads, num_key_value_heads,
// intermediate_size, vocab_size) that tp_size does not divide, and the tp sizes that would.
void check_tensor_parallel(const LlamaConfig& config, int tp_size);

// The Engine's converter (EngineOptions::tensor_parallel) for the causal LM's Sequential:
// tp::tensor_parallel with the embedding vocabulary-parallel and the LM head column-parallel over
// the vocabulary (a TiedHead: over the embedding's shard), its logits left split ([B, T, V/tp],
// for tp::vocab_parallel_cross_entropy) in training mode and gathered in evaluation mode. Throws std::invalid_argument
// naming the configuration field that tp does not divide. Of `opts` it takes sync_dense and
// sequence_parallel: then the embedding's output is reduce-scattered along the sequence, the decoder
// layers and the final norm run on sequence shards (ParallelDecoderLayer::split_sequence), and the
// head (LM head, TiedHead or ScoreHead) all-gathers the sequence first, so its outputs are as
// without it. Token sequences must then be a multiple of the tp size long.
torch::nn::Sequential tensor_parallel(torch::nn::Sequential dense, const CommPtr& tp,
                                      const tp::TensorParallelOptions& opts = {});

// The untied causal LM as a flat Sequential, for pipeline cuts and per-layer ZeRO-3 units:
// children embed_tokens, layer0 .. layer<N-1> (SequentialDecoderLayer), norm, lm_head; the same
// function of ids [B, T] as LlamaForCausalLM. Parameter names differ from the Hugging Face
// ones only by prefix (sequential_to_hf maps them). Throws std::invalid_argument for tied
// embeddings, which a pipeline cannot share between its first and last stage. The layers of a
// Mixtral config share one moe::RouterLog, as LlamaModel's.
torch::nn::Sequential causal_lm_sequential(const LlamaConfig& config);
// The tied LM head as the last child of a Sequential: logits x W^T with W the weight of the
// embedding (the Sequential's first child), held without registering it, so the parameter list
// holds W once, under the embedding. Given `tp`, W is this rank's vocabulary shard (a
// VocabParallelEmbedding's) and the logits stay split in training, gathered in evaluation.
class TiedHeadImpl : public torch::nn::Module {
 public:
  explicit TiedHeadImpl(torch::Tensor weight, CommPtr tp = nullptr) : weight(std::move(weight)), tp(std::move(tp)) {}
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  CommPtr tp;
  bool sequence_parallel = false;  // x is tp's sequence shard, all-gathered first
};
TORCH_MODULE(TiedHead);

// The classifier's score head as the last child of a Sequential: x W^T (no bias) at every
// position, [B, T, hidden] -> [B, T, num_labels], as transformers computes it before pooling
// (pool_scores at pooled_positions of the ids gives LlamaForSequenceClassification's logits).
// Not a Linear, so that tp::tensor_parallel keeps it replicated (no vocabulary to split, and
// num_labels need not divide by tp): its input, the final norm's output, is the same on every
// tp rank, and so is its gradient.
class ScoreHeadImpl : public torch::nn::Module {
 public:
  ScoreHeadImpl(int64_t hidden, int64_t labels);
  // Over an existing weight (shared) whose input is `tp`'s sequence shard (sequence
  // parallelism): the shards are all-gathered first, and x's gradient is this rank's slice of
  // the (replicated) whole.
  ScoreHeadImpl(torch::Tensor weight, CommPtr tp);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  CommPtr tp;  // set under sequence parallelism only
};
TORCH_MODULE(ScoreHead);

// The sequence classifier as a flat Sequential, for pipeline cuts, tensor parallelism and
// per-layer ZeRO-3 units: children embed_tokens, layer0 .. layer<N-1>, norm, score (a
// ScoreHead); ids [B, T] -> per-position scores [B, T, num_labels]. Tied embeddings are
// irrelevant to it (it has no LM head). sequential_to_hf maps its names.
torch::nn::Sequential sequence_classifier_sequential(const LlamaConfig& config);

// causal_lm_sequential's form of a tied model: the last child a TiedHead over embed_tokens'
// weight. For tensor parallelism (llama::tensor_parallel shares the embedding's shard), not for
// a pipeline (the head's use of the weight would not reach the first stage) or ZeRO-3 (which
// frees the weight outside its unit). Throws std::invalid_argument for untied embeddings.
torch::nn::Sequential tied_causal_lm_sequential(const LlamaConfig& config);

// "layer3.mlp.up_proj.weight" -> "model.layers.3.mlp.up_proj.weight", "embed_tokens.weight" ->
// "model.embed_tokens.weight", "norm.weight" -> "model.norm.weight", "lm_head.weight" and
// "score.weight" unchanged. Throws std::invalid_argument for a name of no child of
// causal_lm_sequential or sequence_classifier_sequential.
std::string sequential_to_hf(const std::string& name);

// The Hugging Face name of a parameter of either Sequential form with its children named by
// position, as a pipeline stage and tensor-parallel conversion name them: "0.weight" ->
// "model.embed_tokens.weight", "3.mlp.up_proj.weight" -> "model.layers.2.mlp.up_proj.weight",
// child num_hidden_layers + 1 -> "model.norm...", the last -> `head` ("lm_head" or "score").
// Throws std::invalid_argument for a name that does not start with a child's position.
std::string positional_to_hf(const std::string& name, int64_t num_hidden_layers, const std::string& head);

// Copies every parameter of `module` from the checkpoint tensor of the same name (converted to
// the parameter's dtype). Throws std::runtime_error naming the checkpoint and the tensor for a
// missing one or a shape mismatch, and, unless `allow_unused`, for a checkpoint tensor that
// no parameter takes (lm_head.weight of a tied model is always allowed).
// `to_hf` maps a parameter's name to the checkpoint's (null: the same name).
void load_weights(torch::nn::Module& module, const safetensors::Checkpoint& checkpoint, bool allow_unused = false,
                  const std::function<std::string(const std::string&)>& to_hf = nullptr);

// load_weights' checks without reading any tensor's bytes (names, shapes from the headers): the
// same errors, for a model built whole on every rank whose ranks then read only their part
// (tandem::safetensors::parameter_source). A parameter that `to_hf` maps to "" keeps its values
// (e.g. a new head).
void check_weights(const torch::nn::Module& module, const safetensors::Checkpoint& checkpoint,
                   bool allow_unused = false, const std::function<std::string(const std::string&)>& to_hf = nullptr);

// A causal LM from a Hugging Face directory: config.json and model.safetensors (or the shards
// of model.safetensors.index.json).
LlamaForCausalLM load_causal_lm(const std::string& dir);
LlamaForSequenceClassification load_sequence_classifier(const std::string& dir);

// Writes config.json and the parameters (by their Hugging Face names; a tied model without
// lm_head.weight, as save_pretrained) into `dir`, sharded above options.max_shard_bytes.
void save_pretrained(const LlamaForCausalLM& model, const std::string& dir,
                     const safetensors::SaveOptions& options = {});
void save_pretrained(const LlamaForSequenceClassification& model, const std::string& dir,
                     const safetensors::SaveOptions& options = {});
// The Sequential of causal_lm_sequential(config) or sequence_classifier_sequential(config)
// (then as LlamaForSequenceClassification), saved under the Hugging Face names.
void save_pretrained(const torch::nn::Sequential& model, const LlamaConfig& config, const std::string& dir,
                     const safetensors::SaveOptions& options = {});

}  // namespace tandem::llama
