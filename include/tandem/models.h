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

namespace tandem::models {

// Flatten, then Linear-ReLU for each hidden width, then Linear to `out`. Input [B, ...] with
// prod(...) == in. Default: 784-1024-1024-10 (1,863,690 parameters).
torch::nn::Sequential mlp(int64_t in = 784, const std::vector<int64_t>& hidden = {1024, 1024},
                          int64_t out = 10);

// For [B, 1, 28, 28] inputs: conv(1,32,3,p1)-relu-maxpool2-conv(32,64,3,p1)-relu-maxpool2-
// flatten-linear(3136,128)-relu-linear(128,10). No batch norm. 421,642 parameters.
torch::nn::Sequential cnn();

// cnn() with BatchNorm2d after each convolution (before its ReLU): has running-stat buffers,
// for buffer-synchronisation tests. 421,834 parameters.
torch::nn::Sequential cnn_bn();

struct TransformerConfig {
  int64_t vocab = 256;      // token ids in [0, vocab)
  int64_t d_model = 128;
  int64_t heads = 4;        // must divide d_model
  int64_t layers = 2;
  int64_t seq = 64;         // maximum sequence length (learned positions)
  int64_t mlp_ratio = 4;    // hidden width of the block MLP = mlp_ratio * d_model
  int64_t num_classes = 0;  // 0: language model, output [B, T, vocab]; else [B, num_classes]
};

// Token + learned position embedding: int64 ids [B, T] (T <= seq) -> float [B, T, d_model].
class TokenEmbeddingImpl : public torch::nn::Module {
 public:
  TokenEmbeddingImpl(int64_t vocab, int64_t d_model, int64_t seq);
  torch::Tensor forward(const torch::Tensor& ids);
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  int64_t seq;
};
TORCH_MODULE(TokenEmbedding);

// Pre-LN causal block: x + attn(ln1(x)), then + mlp(ln2(x)). Attention uses one fused qkv
// linear and at::scaled_dot_product_attention(is_causal); the MLP uses GELU. [B,T,D] -> [B,T,D].
class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(int64_t d_model, int64_t heads, int64_t mlp_ratio);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
  int64_t heads;
};
TORCH_MODULE(TransformerBlock);

// [B, T, D] -> [B, D]: the last position, the only one that sees the whole causal sequence.
class LastTokenImpl : public torch::nn::Module {
 public:
  torch::Tensor forward(const torch::Tensor& x);
};
TORCH_MODULE(LastToken);

// TokenEmbedding, `layers` TransformerBlocks, final LayerNorm, then Linear(d_model, vocab)
// (LM head) or LastToken + Linear(d_model, num_classes). Throws std::invalid_argument for
// a non-positive size or d_model not divisible by heads.
torch::nn::Sequential transformer(const TransformerConfig& config);

// The configuration behind make_model("transformer_tiny"): vocab 256, d_model 64, 4 heads,
// 2 layers, seq 64, LM head.
TransformerConfig transformer_tiny_config();

// Registry: "mlp", "cnn", "cnn_bn", "transformer_tiny". Throws std::invalid_argument listing
// the known names for anything else.
torch::nn::Sequential make_model(const std::string& name);
std::vector<std::string> model_names();

// Number of scalar parameters (not buffers) in the module and its children.
int64_t count_parameters(torch::nn::Module& module);

}  // namespace tandem::models
