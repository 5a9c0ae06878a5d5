// Megatron-LM tensor parallelism: a layer's matrices split across the ranks of a tensor-parallel
// communicator (e.g. ProcessGrid::tp()). The collectives sit in autograd functions (copy_to_tp:
// identity forward, all-reduce backward; reduce_from_tp: the reverse), so the blocks below are
// ordinary modules: given the same dense weights on every tp rank, their outputs and gradients
// equal the dense layer's (up to summation order). Every tp rank must run the same forwards.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>

#include "tandem/comm.h"
#include "tandem/lora.h"
#include "tandem/models.h"
#include "tandem/parallelizable.h"
#include "tandem/placement.h"

namespace tandem::tp {

// ---- the autograd functions (all collective over `tp`) ----
at::Tensor copy_to_tp(const at::Tensor& x, const CommPtr& tp);      // f: identity / all-reduce(sum)
at::Tensor reduce_from_tp(const at::Tensor& x, const CommPtr& tp);  // g: all-reduce(sum) / identity
at::Tensor gather_from_tp(const at::Tensor& x, const CommPtr& tp);  // all-gather last dim / own slice
at::Tensor scatter_to_tp(const at::Tensor& x, const CommPtr& tp);   // own slice of last dim / all-gather

// ---- sequence parallelism (Megatron-LM, Korthikanti et al. 2022): between the tensor-parallel
// regions activations [B, T, H] are split along the sequence (dim 1), tp rank r holding positions
// [r*T/tp, (r+1)*T/tp). Each function throws std::invalid_argument (seq_shard_size's) when the
// length it splits is not divisible by the tp size.

// All-gather of the shards [B, T/tp, ...] -> [B, T, ...]. Backward: with `sum_grads` (the consumer
// is tensor-parallel, so each rank's gradient is a partial sum) the gradients are reduce-scattered;
// without (the consumer is replicated, every rank's gradient already complete) this rank's slice.
at::Tensor gather_seq_from_tp(const at::Tensor& x, const CommPtr& tp, bool sum_grads = true);
// Reduce-scatter of partial sums [B, T, ...] -> this rank's shard of the sum [B, T/tp, ...];
// backward all-gathers. Replaces reduce_from_tp after a row-parallel layer.
at::Tensor reduce_scatter_seq_to_tp(const at::Tensor& x, const CommPtr& tp);
// T / tp_size; throws std::invalid_argument naming T, --tp and the rule when tp_size does not
// divide T.
int64_t seq_shard_size(int64_t T, int tp_size);

// The input of column-parallel projections of one activation x (several may share it): `in` for
// their weights, whose backward sums the ranks' partial input gradients (copy_to_tp(x), or under
// sequence parallelism the all-gather of x's shards), and `whole` for their adapters' A, whose input
// gradient is complete on every rank (x itself, or the same gathered values whose backward keeps
// this rank's slice: no second all-gather).
struct ColumnInput {
  at::Tensor in, whole;
};
ColumnInput column_input(const at::Tensor& x, const CommPtr& tp, bool sequence_parallel);

// Cross-entropy over logits split along the last (vocabulary) dimension: rank r holds classes
// [r * V/tp, (r+1) * V/tp) of `local_logits` [..., V/tp]; `target` [...] holds global class ids.
// Returns the per-element loss [...] (identical on every tp rank); take .mean() for the usual loss.
// The full logits are never gathered (Megatron-LM's vocab-parallel cross-entropy).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target, const CommPtr& tp);

// The tp ranks' shards of `t` (same shape on every rank) concatenated along `dim`, rank order.
// Collective; no autograd.
at::Tensor gather_shards(const at::Tensor& t, int64_t dim, Communicator& tp);

// Shard `n` rows/columns: this rank's [begin, end). Throws std::invalid_argument naming `what`
// when n is not divisible by the tp size.
int64_t shard_size(int64_t n, int tp_size, const char* what);

// ---- layers ----

// y = x W^T + b with W's output rows split: rank r holds rows [r*out/tp, (r+1)*out/tp). Input
// replicated, output split along the last dim (or gathered when gather_output).
class ColumnParallelLinearImpl : public torch::nn::Module, public PlacedModule {
 public:
  // Shards a dense layer (same weights expected on every tp rank).
  ColumnParallelLinearImpl(const torch::nn::Linear& dense, CommPtr tp, bool gather_output = false);
  // From this rank's shard directly: weight [out/tp, in], bias [out/tp] or undefined.
  ColumnParallelLinearImpl(at::Tensor local_weight, at::Tensor local_bias, CommPtr tp, bool gather_output = false);
  torch::Tensor forward(const torch::Tensor& x);
  // This rank's output columns from `in`, plus the adapter's update of `whole`: column_input's
  // two tensors (several projections of one input share them).
  torch::Tensor project(const torch::Tensor& in, const torch::Tensor& whole);
  torch::Tensor weight, bias;
  lora::Down lora_A{nullptr};  // a LoRA adapter of the dense layer (tandem/lora.h): A whole,
  lora::Up lora_B{nullptr};    // B this rank's rows
  CommPtr tp;
  bool gather_output;
  // Gathers in evaluation mode (eval()) even without gather_output: an LM head whose training
  // loss is vocab_parallel_cross_entropy, scored on one rank in evaluation.
  bool gather_in_eval = false;
  // The input is split along the sequence (sequence parallelism) and all-gathered here.
  bool sequence_parallel = false;
  // The dense rows are this many equal sections (a fused q|k|v projection), and this rank holds
  // its block of each, stacked: the rows' placement (tandem/placement.h).
  int64_t sections = 1;
  // weight and bias: block tp rank of the output rows (of each section).
  std::vector<ParameterPlacement> parameter_placements() const override;
};
TORCH_MODULE(ColumnParallelLinear);

// y = x W^T + b with W's input columns split: rank r holds columns [r*in/tp, (r+1)*in/tp); the
// input is split along its last dim (input_is_parallel, e.g. a ColumnParallelLinear's output) or
// replicated (then this rank takes its slice); the output is all-reduced (under sequence
// parallelism reduce-scattered along the sequence); the bias is replicated.
class RowParallelLinearImpl : public torch::nn::Module, public PlacedModule {
 public:
  RowParallelLinearImpl(const torch::nn::Linear& dense, CommPtr tp, bool input_is_parallel = true);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;
  lora::Down lora_A{nullptr};  // a LoRA adapter of the dense layer: A this rank's columns,
  lora::Up lora_B{nullptr};    // B whole
  CommPtr tp;
  bool input_is_parallel;
  // The output is this rank's sequence shard [B, T/tp, out] of the sum. The adapter's partial
  // output joins the layer's before the reduce-scatter; the replicated bias and adapter B then
  // see only a shard or a partial sum, so their gradients are summed over tp.
  bool sequence_parallel = false;
  // weight: block tp rank of the input columns; bias: whole on every tp rank.
  std::vector<ParameterPlacement> parameter_placements() const override;

 private:
  torch::Tensor forward_sequence_parallel(const torch::Tensor& in);
};
TORCH_MODULE(RowParallelLinear);

// Embedding with the vocabulary split: rank r holds rows [r*V/tp, (r+1)*V/tp); ids outside give
// zeros locally and the partial results are all-reduced. The dense layer's padding_idx row gets
// no gradient here either.
class VocabParallelEmbeddingImpl : public torch::nn::Module, public PlacedModule {
 public:
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& dense, CommPtr tp);
  torch::Tensor forward(const torch::Tensor& ids);
  torch::Tensor weight;
  CommPtr tp;
  int64_t vocab_begin = 0, vocab_end = 0;
  int64_t padding_idx = -1;  // global id; -1: none
  // The partial results are reduce-scattered along the sequence instead: this rank's shard.
  bool sequence_parallel = false;
  std::vector<ParameterPlacement> parameter_placements() const override;  // rows [vocab_begin, vocab_end)
};
TORCH_MODULE(VocabParallelEmbedding);

// models::TokenEmbedding with a vocabulary-parallel token table (positions replicated); with
// pad_id >= 0 the mask channel (eos_id >= 0: the position channel) is appended as in the dense one.
class ParallelTokenEmbeddingImpl : public torch::nn::Module {
 public:
  ParallelTokenEmbeddingImpl(const models::TokenEmbeddingImpl& dense, CommPtr tp);
  torch::Tensor forward(const torch::Tensor& ids);
  VocabParallelEmbedding tok{nullptr};
  torch::nn::Embedding pos{nullptr};
  int64_t seq;
  int64_t pad_id = -1, eos_id = -1;
};
TORCH_MODULE(ParallelTokenEmbedding);

// Column-parallel fc1, GELU, row-parallel fc2: one all-reduce forward, one backward.
class ParallelMLPImpl : public torch::nn::Module {
 public:
  ParallelMLPImpl(const torch::nn::Linear& fc1, const torch::nn::Linear& fc2, CommPtr tp);
  torch::Tensor forward(const torch::Tensor& x);
  ColumnParallelLinear fc1{nullptr};
  RowParallelLinear fc2{nullptr};
};
TORCH_MODULE(ParallelMLP);

// Causal self-attention with the heads split: rank r computes heads [r*H/tp, (r+1)*H/tp) from its
// slice of the fused qkv projection (q, k and v rows of its heads), then a row-parallel output
// projection. Throws std::invalid_argument when heads is not divisible by the tp size.
class ParallelSelfAttentionImpl : public torch::nn::Module {
 public:
  ParallelSelfAttentionImpl(const torch::nn::Linear& qkv, const torch::nn::Linear& proj, int64_t heads, CommPtr tp);
  // [B, T, D] -> [B, T, D]; causal, or with attn_mask (bool, e.g. models::padded_attention_mask) instead.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& attn_mask = {});
  ColumnParallelLinear qkv{nullptr};
  RowParallelLinear proj{nullptr};
  int64_t heads, local_heads;
  bool selective = false;  // the attention core recomputed in backward (models::self_attention_core)
};
TORCH_MODULE(ParallelSelfAttention);

// models::TransformerBlock, tensor-parallel: x + attn(ln1(x)), then + mlp(ln2(x)); layer norms
// replicated. Two all-reduces forward, two backward. A padded block ([B, T, D + 1], the mask in
// the last channel) stays padded.
class ParallelTransformerBlockImpl : public torch::nn::Module, public PlacedModule, public SelectiveRecompute {
 public:
  ParallelTransformerBlockImpl(const models::TransformerBlockImpl& dense, CommPtr tp);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ParallelSelfAttention attn{nullptr};
  ParallelMLP mlp{nullptr};
  bool padded = false, documents = false;  // as the dense block's
  void recompute_selectively(bool on) override { attn->selective = on; }
  // Its projections' blocks under models::TransformerBlock's names (attn.qkv -> qkv, mlp.fc1 -> fc1).
  std::vector<ParameterPlacement> parameter_placements() const override;
};
TORCH_MODULE(ParallelTransformerBlock);

struct TensorParallelOptions {
  // Broadcast the dense model's parameters from tp rank 0 before sharding, so that every tp rank
  // shards the same weights whatever its seed.
  bool sync_dense = true;
  // LM head: false = gather the logits (output [B, T, V], any loss works); true = leave them split
  // along the vocabulary ([B, T, V/tp]) for vocab_parallel_cross_entropy.
  bool vocab_parallel_output = false;
  // With vocab_parallel_output: the logits are gathered anyway in evaluation mode (eval()), so
  // that Engine::evaluate's scoring on one rank sees the whole vocabulary.
  bool gather_logits_in_eval = false;
  // Sequence parallelism: the activations between the tensor-parallel regions (residual stream,
  // norms) split along the sequence. Only models whose converter implements it (tandem/llama.h's
  // llama::tensor_parallel); tp::tensor_parallel refuses it.
  bool sequence_parallel = false;
};

// Converts a Sequential into its tensor-parallel form over `tp` (collective). Each child that
// implements Parallelizable (tandem/parallelizable.h: models.h's TokenEmbedding and
// TransformerBlock, tandem/llama.h's decoder layers, a user's own layer) becomes its own
// tensor-parallel form; in such a model a plain torch::nn::Embedding child becomes a
// VocabParallelEmbedding and a final Linear, unless a pooling layer comes before it (a
// classification head, kept replicated), the column-parallel LM head. In a model without such
// layers (an MLP), Linear layers pair up as column-parallel then row-parallel across elementwise
// children (an odd last one stays replicated). Other children (LayerNorm, activations, Flatten)
// are shared as they are. The result is still a flat Sequential with the same children, so a
// Pipeline can cut it. Throws std::invalid_argument for heads, vocabulary or widths not
// divisible by the tp size, or for opts.sequence_parallel.
torch::nn::Sequential tensor_parallel(torch::nn::Sequential dense, CommPtr tp, TensorParallelOptions opts = {});

}  // namespace tandem::tp
