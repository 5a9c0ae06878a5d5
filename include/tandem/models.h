// Tandem's reference models (MLP, CNN, small causal transformer), used by the CLI, tests and
// benchmarks. Every model is a flat torch::nn::Sequential, so pipeline parallelism can cut it
// between any two children. None uses dropout; only cnn_bn has batch norm (buffers), so the
// others compute the same function on 1 or N workers given the same global batch.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/activation_checkpoint.h"
#include "tandem/parallelizable.h"

namespace tandem::models {

// Flatten, then Linear-ReLU for each hidden width, then Linear to `out`. Input [B, ...] with
// prod(...) == in. Default: 784-1024-1024-10 (1,863,690 parameters).
torch::nn::Sequential mlp(int64_t in = 784, const std::vector<int64_t>& hidden = {1024, 1024}, int64_t out = 10);

// For [B, 1, 28, 28] inputs: conv(1,32,3,p1)-relu-maxpool2-conv(32,64,3,p1)-relu-maxpool2-
// flatten-linear(3136,128)-relu-linear(128,10). No batch norm. 421,642 parameters.
torch::nn::Sequential cnn();

// cnn() with BatchNorm2d after each convolution (before its ReLU): has running-stat buffers,
// for buffer-synchronisation tests. 421,834 parameters.
torch::nn::Sequential cnn_bn();

struct TransformerConfig {
  int64_t vocab = 256;  // token ids in [0, vocab)
  int64_t d_model = 128;
  int64_t heads = 4;  // must divide d_model
  int64_t layers = 2;
  int64_t seq = 64;         // maximum sequence length (learned positions)
  int64_t mlp_ratio = 4;    // hidden width of the block MLP = mlp_ratio * d_model
  int64_t num_classes = 0;  // 0: language model, output [B, T, vocab]; else [B, num_classes]
  // >= 0: token id `pad_id` is padding (a padded model, see transformer() below); -1: none.
  int64_t pad_id = -1;
  // >= 0 (with pad_id -1): rows are packed documents each ending with token `eos_id`; positions
  // restart and attention is block-diagonal causal per document, as Megatron-LM's
  // reset_position_ids / reset_attention_mask (see transformer() below). -1: one sequence a row.
  int64_t eos_id = -1;
};

// Token + learned position embedding: int64 ids [B, T] (T <= seq) -> float [B, T, d_model].
// With pad_id >= 0 the output is [B, T, d_model + 1]: the last channel is the attention mask
// (1 for a real token, 0 for padding), carried through the padded blocks (see transformer()).
// With eos_id >= 0 instead, positions restart after each `eos_id` and the last channel is each
// token's position in its document (the document blocks derive their mask from it).
class TokenEmbeddingImpl : public torch::nn::Module, public tp::Parallelizable {
 public:
  TokenEmbeddingImpl(int64_t vocab, int64_t d_model, int64_t seq, int64_t pad_id = -1, int64_t eos_id = -1);
  torch::Tensor forward(const torch::Tensor& ids);
  // The token table split over the vocabulary, positions replicated (tp::ParallelTokenEmbedding).
  void check_tensor_parallel(int tp_size) const override;
  torch::nn::AnyModule to_tensor_parallel(const CommPtr& tp) const override;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  int64_t seq;
  int64_t pad_id = -1, eos_id = -1;
};
TORCH_MODULE(TokenEmbedding);

// TokenEmbedding's output from its token embedding `tokens` [B, T, D] of `ids`: the position
// embedding added and the channel of pad_id / eos_id appended (shared with its tensor-parallel
// form). `who` names the module in the error for a row longer than pos's table.
torch::Tensor with_positions(const torch::Tensor& tokens, const torch::Tensor& ids, torch::nn::Embedding pos,
                             int64_t pad_id, int64_t eos_id, const char* who);

// Pre-LN causal block: x + attn(ln1(x)), then + mlp(ln2(x)). Attention uses one fused qkv
// linear and at::scaled_dot_product_attention(is_causal); the MLP uses GELU. [B,T,D] -> [B,T,D].
// padded = true: input and output [B, T, D + 1], the last channel the mask of TokenEmbedding;
// attention is causal and skips padded keys (a position always sees itself). documents = true
// (with padded): the channel is the position in the document (TokenEmbedding with eos_id) and
// attention is causal within each document only.
// Selective recomputation (tandem/activation_checkpoint.h) recomputes its attention core.
class TransformerBlockImpl : public torch::nn::Module, public tp::Parallelizable, public SelectiveRecompute {
 public:
  TransformerBlockImpl(int64_t d_model, int64_t heads, int64_t mlp_ratio, bool padded = false, bool documents = false);
  torch::Tensor forward(const torch::Tensor& x);
  // Heads and the MLP's hidden units split (tp::ParallelTransformerBlock).
  void check_tensor_parallel(int tp_size) const override;
  torch::nn::AnyModule to_tensor_parallel(const CommPtr& tp) const override;
  void recompute_selectively(bool on) override { selective = on; }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
  int64_t heads;
  bool padded = false, documents = false;
  bool selective = false;
};
TORCH_MODULE(TransformerBlock);

// The attention mask of a padded block from the mask channel [B, T, 1] (1 real token, 0
// padding): bool [B, 1, T(query), T(key)], causal, and the key is real or the query itself (so
// a padded query still attends to something). For at::scaled_dot_product_attention.
torch::Tensor padded_attention_mask(const torch::Tensor& mask_channel);
// The attention mask of a document block from the position channel [B, T, 1] (each token's
// position in its document): query t attends to keys t - position[t] .. t, bool [B, 1, T, T].
torch::Tensor document_attention_mask(const torch::Tensor& position_channel);
// A channelled block's mask: document_attention_mask when `documents`, else padded_attention_mask.
inline torch::Tensor channel_attention_mask(const torch::Tensor& channel, bool documents) {
  return documents ? document_attention_mask(channel) : padded_attention_mask(channel);
}

// The attention core of a fused projection's output [B, T, 3 * heads * hd] (q | k | v, each head
// by head): scaled_dot_product_attention, causal without a mask, else under the bool mask
// [B, 1, T, T] -> [B, T, heads * hd]. `selective`: recomputed in backward from qkv (its
// attention output and softmax statistics not kept).
torch::Tensor self_attention_core(const torch::Tensor& qkv, int64_t heads, const torch::Tensor& mask, bool selective);

// [B, T, D] -> [B, D]: the last position, the only one that sees the whole causal sequence.
class LastTokenImpl : public torch::nn::Module, public tp::Parallelizable {
 public:
  torch::Tensor forward(const torch::Tensor& x);
  // Replicated; the Linear after it is a classification head.
  void check_tensor_parallel(int) const override {}
  torch::nn::AnyModule to_tensor_parallel(const CommPtr& tp) const override;
  bool pools() const override { return true; }
};
TORCH_MODULE(LastToken);

// Ends the padded part of a padded transformer: [B, T, D + 1] (mask in the last channel) ->
// [B, T, D] (pool = false: the mask dropped) or [B, D] (pool = true: the mean over the real
// tokens, padding excluded).
class UnpadImpl : public torch::nn::Module, public tp::Parallelizable {
 public:
  explicit UnpadImpl(bool pool) : pool(pool) {}
  torch::Tensor forward(const torch::Tensor& x);
  // Replicated; with pool, the Linear after it is a classification head.
  void check_tensor_parallel(int) const override {}
  torch::nn::AnyModule to_tensor_parallel(const CommPtr& tp) const override;
  bool pools() const override { return pool; }
  bool pool;
};
TORCH_MODULE(Unpad);

// TokenEmbedding, `layers` TransformerBlocks, final LayerNorm, then Linear(d_model, vocab)
// (LM head) or LastToken + Linear(d_model, num_classes). Throws std::invalid_argument for
// a non-positive size or d_model not divisible by heads.
// With config.pad_id >= 0 (padded, for right-padded text): TokenEmbedding(pad_id), `layers`
// padded TransformerBlocks, Unpad, final LayerNorm, then Linear(d_model, vocab) (Unpad drops
// the mask) or Linear(d_model, num_classes) (Unpad mean-pools the real tokens). The LM and the
// classifier share every parameter name but the head's, so one initialises the other.
// With config.eos_id >= 0 (packed documents, an LM): the same children and parameter names as
// the padded LM, the channel holding positions within documents (document blocks), so a model
// pre-trained on packed documents initialises the padded classifier too.
torch::nn::Sequential transformer(const TransformerConfig& config);

// The configuration behind make_model("transformer_tiny"): vocab 256, d_model 64, 4 heads,
// 2 layers, seq 64, LM head.
TransformerConfig transformer_tiny_config();

// A registered model by name (tandem/registry.h: the built-ins "mlp", "cnn", "cnn_bn",
// "transformer_tiny", then those of the program and of loaded plugins), as a Sequential.
// Throws std::invalid_argument listing the known names for an unknown one, and for a model
// whose factory returns another kind of module (tandem::make_registered_model builds those).
torch::nn::Sequential make_model(const std::string& name);
// Every registered model's name, the built-ins first.
std::vector<std::string> model_names();

// Number of scalar parameters (not buffers) in the module and its children.
int64_t count_parameters(torch::nn::Module& module);

}  // namespace tandem::models
