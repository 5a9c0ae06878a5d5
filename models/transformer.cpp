// The reference causal transformer: pre-LN blocks, fused qkv, scaled_dot_product_attention, GELU.
#include "tandem/llama.h"
#include "tandem/models.h"
#include "tandem/pipeline.h"
#include "tandem/tensor_parallel.h"

#include <torch/torch.h>

#include <stdexcept>

namespace tandem::models {

TokenEmbeddingImpl::TokenEmbeddingImpl(int64_t vocab, int64_t d_model, int64_t seq_, int64_t pad_id_, int64_t eos_id_)
    : seq(seq_), pad_id(pad_id_), eos_id(eos_id_) {
  tok = register_module("tok", torch::nn::Embedding(vocab, d_model));
  pos = register_module("pos", torch::nn::Embedding(seq_, d_model));
  torch::NoGradGuard g;
  tok->weight.normal_(0.0, 0.02);
  pos->weight.normal_(0.0, 0.02);
}

torch::Tensor with_positions(const torch::Tensor& tokens, const torch::Tensor& ids, torch::nn::Embedding pos,
                             int64_t pad_id, int64_t eos_id, const char* who) {
  const int64_t t = ids.size(1), seq = pos->options.num_embeddings();
  TORCH_CHECK(t <= seq, who, ": sequence of ", t, " tokens is longer than the model's maximum ", seq,
              "; truncate it or raise config.seq");
  if (eos_id >= 0) {
    auto positions = llama::document_layout(ids, eos_id).positions;
    auto x = tokens + pos->forward(positions);
    return torch::cat({x, positions.unsqueeze(-1).to(x.dtype())}, -1);
  }
  auto positions = torch::arange(t, torch::TensorOptions().dtype(torch::kLong).device(ids.device()));
  auto x = tokens + pos->forward(positions).unsqueeze(0);
  if (pad_id < 0) return x;
  return torch::cat({x, ids.ne(pad_id).unsqueeze(-1).to(x.dtype())}, -1);
}

torch::Tensor TokenEmbeddingImpl::forward(const torch::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2, "tandem::models::TokenEmbedding: expected token ids [B, T], got ", ids.sizes());
  return with_positions(tok->forward(ids), ids, pos, pad_id, eos_id, "tandem::models::TokenEmbedding");
}

torch::Tensor document_attention_mask(const torch::Tensor& position_channel) {
  TORCH_CHECK(position_channel.dim() == 3 && position_channel.size(2) == 1,
              "tandem::models::document_attention_mask: expected the position channel [B, T, 1], got ",
              position_channel.sizes());
  const int64_t t = position_channel.size(1);
  auto opts = torch::TensorOptions().dtype(torch::kLong).device(position_channel.device());
  auto q = torch::arange(t, opts);
  // The document of query q starts at q - position[q]; keys from there to q.
  auto start = q.unsqueeze(0) - position_channel.squeeze(2).round().to(torch::kLong);  // [B, T]
  auto k = q.view({1, 1, t});
  auto mask = k.le(q.view({1, t, 1})) & k.ge(start.unsqueeze(2));
  return mask.unsqueeze(1);
}

torch::Tensor padded_attention_mask(const torch::Tensor& mask_channel) {
  TORCH_CHECK(mask_channel.dim() == 3 && mask_channel.size(2) == 1,
              "tandem::models::padded_attention_mask: expected the mask channel [B, T, 1], got ", mask_channel.sizes());
  const int64_t t = mask_channel.size(1);
  auto opts = torch::TensorOptions().dtype(torch::kBool).device(mask_channel.device());
  auto causal = torch::ones({t, t}, opts).tril();
  auto self = torch::eye(t, opts);
  // [B, 1, T(query), T(key)]: causal, and the key is real or the query itself.
  auto mask = causal.unsqueeze(0) & (mask_channel.squeeze(2).gt(0.5).unsqueeze(1) | self.unsqueeze(0));
  return mask.unsqueeze(1);
}

TransformerBlockImpl::TransformerBlockImpl(int64_t d_model, int64_t heads_, int64_t mlp_ratio, bool padded_,
                                           bool documents_)
    : heads(heads_), padded(padded_ || documents_), documents(documents_) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  qkv = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj = register_module("proj", torch::nn::Linear(d_model, d_model));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  fc1 = register_module("fc1", torch::nn::Linear(d_model, mlp_ratio * d_model));
  fc2 = register_module("fc2", torch::nn::Linear(mlp_ratio * d_model, d_model));
}

torch::Tensor self_attention_core(const torch::Tensor& qkv, int64_t heads, const torch::Tensor& mask, bool selective) {
  auto core = [heads, mask](const std::vector<torch::Tensor>& in) {
    const int64_t b = in[0].size(0), t = in[0].size(1), d = in[0].size(2) / 3, hd = d / heads;
    // [B, T, 3D] -> 3 x [B, H, T, hd]
    auto q_k_v = in[0].view({b, t, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    auto att = mask.defined() ? at::scaled_dot_product_attention(q_k_v[0], q_k_v[1], q_k_v[2], mask,
                                                                 /*dropout_p=*/0.0, /*is_causal=*/false)
                              : at::scaled_dot_product_attention(q_k_v[0], q_k_v[1], q_k_v[2], /*attn_mask=*/{},
                                                                 /*dropout_p=*/0.0, /*is_causal=*/true);
    return att.transpose(1, 2).reshape({b, t, d});
  };
  return selective ? checkpoint_many(core, {qkv}, {}, /*draws=*/false) : core({qkv});
}

namespace {
// The block's projections through tandem::linear: the same as Linear::forward, and under a
// zero-bubble pipeline schedule their weight gradients wait for the W pass.
torch::Tensor dense(const torch::nn::Linear& l, const torch::Tensor& x) {
  return tandem::linear(x, l->weight, l->bias);
}
}  // namespace

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 3, "tandem::models::TransformerBlock: expected [B, T, D], got ", x.sizes());
  if (padded) {
    const int64_t d = x.size(2) - 1;
    auto h0 = x.narrow(2, 0, d);
    auto m = x.narrow(2, d, 1);  // [B, T, 1]: 1 real, 0 padding (or the position in the document)
    auto att =
        self_attention_core(dense(qkv, ln1->forward(h0)), heads, channel_attention_mask(m, documents), selective);
    auto h = h0 + dense(proj, att);
    h = h + dense(fc2, torch::gelu(dense(fc1, ln2->forward(h))));
    return torch::cat({h, m}, 2);
  }
  auto h = x + dense(proj, self_attention_core(dense(qkv, ln1->forward(x)), heads, {}, selective));
  return h + dense(fc2, torch::gelu(dense(fc1, ln2->forward(h))));
}

torch::Tensor LastTokenImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 3, "tandem::models::LastToken: expected [B, T, D], got ", x.sizes());
  return x.select(1, x.size(1) - 1);
}

torch::Tensor UnpadImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) >= 2, "tandem::models::Unpad: expected [B, T, D + 1], got ", x.sizes());
  const int64_t d = x.size(2) - 1;
  auto h = x.narrow(2, 0, d);
  if (!pool) return h;
  auto m = x.narrow(2, d, 1);
  return (h * m).sum(1) / m.sum(1).clamp_min(1.0);
}

torch::nn::Sequential transformer(const TransformerConfig& c) {
  auto positive = [](const char* what, int64_t v) {
    if (v < 1) {
      throw std::invalid_argument(std::string("tandem::models::transformer: config.") + what + " must be >= 1, got " +
                                  std::to_string(v));
    }
  };
  positive("vocab", c.vocab);
  positive("d_model", c.d_model);
  positive("heads", c.heads);
  positive("layers", c.layers);
  positive("seq", c.seq);
  positive("mlp_ratio", c.mlp_ratio);
  if (c.num_classes < 0) {
    throw std::invalid_argument("tandem::models::transformer: config.num_classes must be >= 0 (0 = LM head), got " +
                                std::to_string(c.num_classes));
  }
  if (c.d_model % c.heads != 0) {
    throw std::invalid_argument("tandem::models::transformer: d_model " + std::to_string(c.d_model) +
                                " is not divisible by heads " + std::to_string(c.heads));
  }
  if (c.pad_id >= c.vocab) {
    throw std::invalid_argument("tandem::models::transformer: config.pad_id " + std::to_string(c.pad_id) +
                                " is not a token id below vocab " + std::to_string(c.vocab));
  }
  if (c.eos_id >= c.vocab || (c.eos_id >= 0 && (c.pad_id >= 0 || c.num_classes > 0))) {
    throw std::invalid_argument("tandem::models::transformer: config.eos_id " + std::to_string(c.eos_id) +
                                " must be a token id below vocab " + std::to_string(c.vocab) +
                                ", of an LM (num_classes 0) without pad_id (packed documents have no padding)");
  }
  torch::nn::Sequential net;
  if (c.pad_id >= 0 || c.eos_id >= 0) {  // padded or packed: the mask's source travels as the last channel
    const bool documents = c.eos_id >= 0;
    net->push_back(TokenEmbedding(c.vocab, c.d_model, c.seq, c.pad_id, c.eos_id));
    for (int64_t i = 0; i < c.layers; ++i) {
      net->push_back(TransformerBlock(c.d_model, c.heads, c.mlp_ratio, /*padded=*/true, documents));
    }
    net->push_back(Unpad(/*pool=*/c.num_classes > 0));
    net->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    net->push_back(torch::nn::Linear(c.d_model, c.num_classes > 0 ? c.num_classes : c.vocab));
    return net;
  }
  net->push_back(TokenEmbedding(c.vocab, c.d_model, c.seq));
  for (int64_t i = 0; i < c.layers; ++i) net->push_back(TransformerBlock(c.d_model, c.heads, c.mlp_ratio));
  net->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  if (c.num_classes == 0) {
    net->push_back(torch::nn::Linear(c.d_model, c.vocab));
  } else {
    net->push_back(LastToken());
    net->push_back(torch::nn::Linear(c.d_model, c.num_classes));
  }
  return net;
}

TransformerConfig transformer_tiny_config() {
  TransformerConfig c;
  c.vocab = 256;
  c.d_model = 64;
  c.heads = 4;
  c.layers = 2;
  c.seq = 64;
  c.mlp_ratio = 4;
  c.num_classes = 0;
  return c;
}

// ---- tensor parallelism (tandem/parallelizable.h)

namespace {
// A replicated layer's tensor-parallel form: the layer itself, shared.
template <typename Holder, typename Impl>
torch::nn::AnyModule itself(const Impl& layer) {
  return torch::nn::AnyModule(
      Holder(std::const_pointer_cast<Impl>(std::dynamic_pointer_cast<const Impl>(layer.shared_from_this()))));
}
}  // namespace

void TokenEmbeddingImpl::check_tensor_parallel(int tp_size) const {
  tp::shard_size(tok->options.num_embeddings(), tp_size, "the vocabulary");
}
torch::nn::AnyModule TokenEmbeddingImpl::to_tensor_parallel(const CommPtr& tp) const {
  return torch::nn::AnyModule(tp::ParallelTokenEmbedding(*this, tp));
}

void TransformerBlockImpl::check_tensor_parallel(int tp_size) const {
  tp::shard_size(heads, tp_size, "the number of attention heads");
  tp::shard_size(fc1->options.out_features(), tp_size, "the MLP hidden width");
}
torch::nn::AnyModule TransformerBlockImpl::to_tensor_parallel(const CommPtr& tp) const {
  return torch::nn::AnyModule(tp::ParallelTransformerBlock(*this, tp));
}

torch::nn::AnyModule LastTokenImpl::to_tensor_parallel(const CommPtr&) const { return itself<LastToken>(*this); }
torch::nn::AnyModule UnpadImpl::to_tensor_parallel(const CommPtr&) const { return itself<Unpad>(*this); }

}  // namespace tandem::models
