// Megatron-LM tensor parallelism: the four autograd functions that carry the collectives, the
// vocabulary-parallel cross-entropy, the sharded layers and the dense -> tensor-parallel converter.
#include "tandem/tensor_parallel.h"

#include "tandem/pipeline.h"

#include <torch/torch.h>

#include <set>
#include <stdexcept>

#include "tandem/activation_checkpoint.h"
#include "tandem/grid.h"

namespace tandem::tp {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// The communicator travels through autograd's saved data as a capsule.
struct CommHolder : torch::CustomClassHolder {
  explicit CommHolder(CommPtr c) : comm(std::move(c)) {}
  CommPtr comm;
};
c10::IValue hold(const CommPtr& c) { return c10::IValue::make_capsule(c10::make_intrusive<CommHolder>(c)); }
CommPtr held(const c10::IValue& v) { return c10::static_intrusive_pointer_cast<CommHolder>(v.toCapsule())->comm; }

at::Tensor allreduced(const at::Tensor& t, Communicator& comm) {
  auto r = t.clone(at::MemoryFormat::Contiguous);  // never reduce into a gradient others may share
  comm.allreduce(r, ReduceOp::kSum);
  return r;
}

// [..., n] on every rank -> [..., tp * n], rank r's block at [r*n, (r+1)*n).
at::Tensor allgather_last_dim(const at::Tensor& t, Communicator& comm) {
  auto in = t.contiguous();
  std::vector<int64_t> shape{comm.size()};
  for (auto s : in.sizes()) shape.push_back(s);
  auto out = at::empty(shape, in.options());
  comm.allgather(out, in);
  return at::cat(out.unbind(0), -1);
}

at::Tensor own_slice_last_dim(const at::Tensor& t, Communicator& comm) {
  const int64_t n = shard_size(t.size(-1), comm.size(), "the last dimension");
  return t.narrow(-1, comm.rank() * n, n).contiguous();
}

struct CopyToTP : torch::autograd::Function<CopyToTP> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue comm) {
    ctx->saved_data["comm"] = comm;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {allreduced(g[0], *held(ctx->saved_data["comm"])), at::Tensor()};
  }
};

struct ReduceFromTP : torch::autograd::Function<ReduceFromTP> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, c10::IValue comm) {
    return allreduced(x, *held(comm));
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct GatherFromTP : torch::autograd::Function<GatherFromTP> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue comm) {
    ctx->saved_data["comm"] = comm;
    return allgather_last_dim(x, *held(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {own_slice_last_dim(g[0], *held(ctx->saved_data["comm"])), at::Tensor()};
  }
};

struct ScatterToTP : torch::autograd::Function<ScatterToTP> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue comm) {
    ctx->saved_data["comm"] = comm;
    return own_slice_last_dim(x, *held(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {allgather_last_dim(g[0], *held(ctx->saved_data["comm"])), at::Tensor()};
  }
};

// The collectives chunk dim 0 of a contiguous buffer: the sequence (dim 1) goes first, and back.
at::Tensor swap_batch_and_sequence(const at::Tensor& t) { return t.transpose(0, 1).contiguous(); }

// [B, n, ...] on every rank -> [B, tp * n, ...], rank r's shard at positions [r*n, (r+1)*n).
at::Tensor allgather_seq(const at::Tensor& t, Communicator& comm) {
  auto in = swap_batch_and_sequence(t);
  auto shape = in.sizes().vec();
  shape[0] *= comm.size();
  auto out = at::empty(shape, in.options());
  comm.allgather(out, in);
  return swap_batch_and_sequence(out);
}

// [B, T, ...] partial sums -> this rank's positions of the sum, [B, T/tp, ...].
at::Tensor reduce_scatter_seq(const at::Tensor& t, Communicator& comm) {
  const int64_t n = seq_shard_size(t.size(1), comm.size());
  auto in = swap_batch_and_sequence(t);
  auto shape = in.sizes().vec();
  shape[0] = n;
  auto out = at::empty(shape, in.options());
  comm.reduce_scatter(out, in, ReduceOp::kSum);
  return swap_batch_and_sequence(out);
}

at::Tensor own_slice_seq(const at::Tensor& t, Communicator& comm) {
  const int64_t n = seq_shard_size(t.size(1), comm.size());
  return t.narrow(1, comm.rank() * n, n).contiguous();
}

void check_sequence(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 2, "tandem::tp: sequence parallelism splits dim 1 of [B, T, ...], got ", x.sizes());
}

struct GatherSeqFromTP : torch::autograd::Function<GatherSeqFromTP> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue comm, bool sum_grads) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["sum"] = sum_grads;
    return allgather_seq(x, *held(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto& comm = *held(ctx->saved_data["comm"]);
    auto grad = ctx->saved_data["sum"].toBool() ? reduce_scatter_seq(g[0], comm) : own_slice_seq(g[0], comm);
    return {grad, at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterSeqToTP : torch::autograd::Function<ReduceScatterSeqToTP> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue comm) {
    ctx->saved_data["comm"] = comm;
    return reduce_scatter_seq(x, *held(comm));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {allgather_seq(g[0], *held(ctx->saved_data["comm"])), at::Tensor()};
  }
};

// `gathered` (the all-gather of the shards `x`, detached) as a function of x for a replicated
// consumer: the gradient reaching it is complete on every rank, so x's is this rank's slice.
struct GatheredAsReplicated : torch::autograd::Function<GatheredAsReplicated> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor&, const at::Tensor& gathered, c10::IValue comm) {
    ctx->saved_data["comm"] = comm;
    return gathered;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {own_slice_seq(g[0], *held(ctx->saved_data["comm"])), at::Tensor(), at::Tensor()};
  }
};

// Megatron-LM's _VocabParallelCrossEntropy: three all-reduces of [...]-sized tensors (max, the
// target's logit, the sum of exponentials) instead of gathering [..., V] logits.
struct VocabParallelCE : torch::autograd::Function<VocabParallelCE> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target, c10::IValue cv) {
    auto comm = held(cv);
    const int64_t n = logits.size(-1), begin = comm->rank() * n, end = begin + n;
    auto lg = logits.contiguous();
    auto mx = std::get<0>(lg.max(-1)).contiguous();
    comm->allreduce(mx, ReduceOp::kMax);
    auto shifted = lg - mx.unsqueeze(-1);
    auto outside = (target < begin).logical_or(target >= end);
    auto local_t = (target - begin).masked_fill(outside, 0);
    auto pred = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0).contiguous();
    comm->allreduce(pred, ReduceOp::kSum);
    auto e = shifted.exp();
    auto sum = e.sum(-1).contiguous();
    comm->allreduce(sum, ReduceOp::kSum);
    auto softmax = e.div_(sum.unsqueeze(-1));
    ctx->save_for_backward({softmax, outside, local_t});
    return sum.log() - pred;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();
    auto inside = saved[1].logical_not().to(grad.scalar_type()).unsqueeze(-1);
    grad.scatter_add_(-1, saved[2].unsqueeze(-1), -inside);
    grad.mul_(g[0].unsqueeze(-1));
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor copy_to_tp(const at::Tensor& x, const CommPtr& tp) { return CopyToTP::apply(x, hold(tp)); }
at::Tensor reduce_from_tp(const at::Tensor& x, const CommPtr& tp) { return ReduceFromTP::apply(x, hold(tp)); }
at::Tensor gather_from_tp(const at::Tensor& x, const CommPtr& tp) { return GatherFromTP::apply(x, hold(tp)); }
at::Tensor scatter_to_tp(const at::Tensor& x, const CommPtr& tp) { return ScatterToTP::apply(x, hold(tp)); }

at::Tensor gather_seq_from_tp(const at::Tensor& x, const CommPtr& tp, bool sum_grads) {
  check_sequence(x);
  return GatherSeqFromTP::apply(x, hold(tp), sum_grads);
}
at::Tensor reduce_scatter_seq_to_tp(const at::Tensor& x, const CommPtr& tp) {
  check_sequence(x);
  seq_shard_size(x.size(1), tp->size());  // the same refusal on every rank, before the collective
  return ReduceScatterSeqToTP::apply(x, hold(tp));
}

int64_t seq_shard_size(int64_t T, int tp_size) {
  if (tp_size < 1 || T % tp_size != 0) {
    throw std::invalid_argument("tandem::tp: sequence parallelism (--sequence-parallel) splits each sequence over the "
                                "--tp " +
                                std::to_string(tp_size) + " ranks, but T = " + std::to_string(T) +
                                " tokens is not divisible by " + std::to_string(tp_size) +
                                "; the sequence length must be a multiple of --tp");
  }
  return T / tp_size;
}

ColumnInput column_input(const at::Tensor& x, const CommPtr& tp, bool sequence_parallel) {
  if (!sequence_parallel) return {copy_to_tp(x, tp), x};
  auto in = gather_seq_from_tp(x, tp, /*sum_grads=*/true);
  return {in, GatheredAsReplicated::apply(x, in.detach(), hold(tp))};
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target, const CommPtr& tp) {
  if (local_logits.dim() != target.dim() + 1 || local_logits.sizes().slice(0, target.dim()) != target.sizes()) {
    throw std::invalid_argument("tandem::tp::vocab_parallel_cross_entropy: logits " + c10::str(local_logits.sizes()) +
                                " do not match targets " + c10::str(target.sizes()) +
                                "; expected logits [..., V/tp] for targets [...]");
  }
  return VocabParallelCE::apply(local_logits, target, hold(tp));
}

int64_t shard_size(int64_t n, int tp_size, const char* what) {
  if (tp_size < 1 || n % tp_size != 0) {
    throw std::invalid_argument(std::string("tandem::tp: ") + what + " (" + std::to_string(n) +
                                ") is not divisible by the tensor-parallel size " + std::to_string(tp_size) +
                                "; choose a tp size that divides it");
  }
  return n / tp_size;
}

// ---------------------------------------------------------------- layers

namespace {
at::Tensor shard(const at::Tensor& t, int64_t dim, int64_t n, int rank) {
  return t.detach().narrow(dim, rank * n, n).clone();
}
}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& dense, CommPtr tp_, bool gather)
    : tp(std::move(tp_)), gather_output(gather) {
  const int64_t n =
      shard_size(dense->options.out_features(), tp->size(), "the output features of a column-parallel linear");
  weight = register_parameter("weight", shard(dense->weight, 0, n, tp->rank()), dense->weight.requires_grad());
  if (dense->options.bias())
    bias = register_parameter("bias", shard(dense->bias, 0, n, tp->rank()), dense->bias.requires_grad());
  // An adapter's B splits as the rows of W; A stays whole (its input is replicated).
  if (auto a = lora::adapter_of(*dense)) {
    lora_A = register_module("lora_A", lora::Down(a.down->weight.detach().clone(), a.down->dropout));
    lora_B = register_module("lora_B", lora::Up(shard(a.up->weight, 0, n, tp->rank()), a.up->scaling));
    lora_A->weight.set_requires_grad(a.down->weight.requires_grad());
    lora_B->weight.set_requires_grad(a.up->weight.requires_grad());
  }
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(at::Tensor w, at::Tensor b, CommPtr tp_, bool gather)
    : tp(std::move(tp_)), gather_output(gather) {
  weight = register_parameter("weight", w.detach().clone());
  if (b.defined()) bias = register_parameter("bias", b.detach().clone());
}

namespace {
// A block of a tensor whose dimension `dim` is split over the tp ranks: the global shape is the
// local one with that dimension times the tp size.
ParameterPlacement block_of(const char* name, const at::Tensor& local, int64_t dim, int64_t sections,
                            const Communicator& tp) {
  auto global = local.sizes().vec();
  global[dim] *= tp.size();
  return {name, name, Placement::split_sections(global, dim, sections, tp.rank(), tp.size())};
}
ParameterPlacement replicated(const char* name, const at::Tensor& t, const Communicator& tp) {
  auto p = Placement::whole(t.sizes().vec());
  p.replica = tp.rank();
  return {name, name, p};
}
}  // namespace

std::vector<ParameterPlacement> ColumnParallelLinearImpl::parameter_placements() const {
  std::vector<ParameterPlacement> out{block_of("weight", weight, 0, sections, *tp)};
  if (bias.defined()) out.push_back(block_of("bias", bias, 0, sections, *tp));
  if (lora_A) {
    out.push_back(replicated("lora_A.weight", lora_A->weight, *tp));
    out.push_back(block_of("lora_B.weight", lora_B->weight, 0, 1, *tp));
  }
  return out;
}

torch::Tensor ColumnParallelLinearImpl::project(const torch::Tensor& in, const torch::Tensor& whole) {
  auto y = tandem::linear(in, weight, bias);  // defers its weight gradient under a split pipeline schedule
  if (!lora_A) return y;
  // A's output is the same on every tp rank; the gradient reaching it is the sum of every rank's
  // rows' part, hence the all-reduce of copy_to_tp in backward.
  return y + lora_B->forward(copy_to_tp(lora_A->forward(whole), tp));
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  const auto ci = column_input(x, tp, sequence_parallel);
  auto y = project(ci.in, ci.whole);
  return gather_output || (gather_in_eval && !is_training()) ? gather_from_tp(y, tp) : y;
}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& dense, CommPtr tp_, bool parallel_in)
    : tp(std::move(tp_)), input_is_parallel(parallel_in) {
  const int64_t n = shard_size(dense->options.in_features(), tp->size(), "the input features of a row-parallel linear");
  weight = register_parameter("weight", shard(dense->weight, 1, n, tp->rank()), dense->weight.requires_grad());
  if (dense->options.bias())
    bias = register_parameter("bias", dense->bias.detach().clone(), dense->bias.requires_grad());
  // An adapter's A splits as the columns of W; B stays whole (its input is all-reduced).
  if (auto a = lora::adapter_of(*dense)) {
    lora_A = register_module("lora_A", lora::Down(shard(a.down->weight, 1, n, tp->rank()), a.down->dropout));
    lora_B = register_module("lora_B", lora::Up(a.up->weight.detach().clone(), a.up->scaling));
    lora_A->weight.set_requires_grad(a.down->weight.requires_grad());
    lora_B->weight.set_requires_grad(a.up->weight.requires_grad());
  }
}

std::vector<ParameterPlacement> RowParallelLinearImpl::parameter_placements() const {
  std::vector<ParameterPlacement> out{block_of("weight", weight, 1, 1, *tp)};
  if (bias.defined()) out.push_back(replicated("bias", bias, *tp));
  if (lora_A) {
    out.push_back(block_of("lora_A.weight", lora_A->weight, 1, 1, *tp));
    out.push_back(replicated("lora_B.weight", lora_B->weight, *tp));
  }
  return out;
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  auto in = input_is_parallel ? x : scatter_to_tp(x, tp);
  if (sequence_parallel) return forward_sequence_parallel(in);
  auto y = reduce_from_tp(tandem::linear(in, weight), tp);
  // The adapter's rank-r activations are summed over tp (few bytes), so that B's gradient is
  // whole on every rank.
  if (lora_A) y = y + lora_B->forward(reduce_from_tp(lora_A->forward(in), tp));
  return bias.defined() ? y + bias : y;
}

torch::Tensor RowParallelLinearImpl::forward_sequence_parallel(const torch::Tensor& in) {
  auto y = tandem::linear(in, weight);
  // B (whole) maps this rank's partial A output: a partial sum of the update, reduced with the
  // layer's. B's gradient from it is partial too, hence copy_to_tp's all-reduce in backward.
  if (lora_A) y = y + at::linear(lora_A->forward(in), copy_to_tp(lora_B->weight, tp)) * lora_B->scaling;
  y = reduce_scatter_seq_to_tp(y, tp);
  // The bias meets this rank's positions only: its gradient is summed over tp.
  return bias.defined() ? y + copy_to_tp(bias, tp) : y;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const torch::nn::Embedding& dense, CommPtr tp_)
    : tp(std::move(tp_)) {
  const int64_t n = shard_size(dense->options.num_embeddings(), tp->size(), "the vocabulary");
  vocab_begin = tp->rank() * n;
  vocab_end = vocab_begin + n;
  if (dense->options.padding_idx()) padding_idx = *dense->options.padding_idx();
  weight = register_parameter("weight", shard(dense->weight, 0, n, tp->rank()), dense->weight.requires_grad());
}

std::vector<ParameterPlacement> VocabParallelEmbeddingImpl::parameter_placements() const {
  return {block_of("weight", weight, 0, 1, *tp)};
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& ids) {
  auto outside = (ids < vocab_begin).logical_or(ids >= vocab_end);
  // Ids outside the shard read row 0; their outputs are zeroed below, so they give it no gradient.
  const int64_t local_pad = padding_idx >= vocab_begin && padding_idx < vocab_end ? padding_idx - vocab_begin : -1;
  auto local = at::embedding(weight, (ids - vocab_begin).masked_fill(outside, 0), local_pad);
  local = local.masked_fill(outside.unsqueeze(-1), 0.0);
  return sequence_parallel ? reduce_scatter_seq_to_tp(local, tp) : reduce_from_tp(local, tp);
}

ParallelTokenEmbeddingImpl::ParallelTokenEmbeddingImpl(const models::TokenEmbeddingImpl& dense, CommPtr tp)
    : seq(dense.seq), pad_id(dense.pad_id), eos_id(dense.eos_id) {
  this->tok = register_module("tok", VocabParallelEmbedding(dense.tok, tp));
  pos = register_module("pos", dense.pos);
}

torch::Tensor ParallelTokenEmbeddingImpl::forward(const torch::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2, "tandem::tp::ParallelTokenEmbedding: expected token ids [B, T], got ", ids.sizes());
  return models::with_positions(tok->forward(ids), ids, pos, pad_id, eos_id, "tandem::tp::ParallelTokenEmbedding");
}

ParallelMLPImpl::ParallelMLPImpl(const torch::nn::Linear& d1, const torch::nn::Linear& d2, CommPtr tp) {
  fc1 = register_module("fc1", ColumnParallelLinear(d1, tp, false));
  fc2 = register_module("fc2", RowParallelLinear(d2, tp, true));
}

torch::Tensor ParallelMLPImpl::forward(const torch::Tensor& x) { return fc2->forward(torch::gelu(fc1->forward(x))); }

ParallelSelfAttentionImpl::ParallelSelfAttentionImpl(const torch::nn::Linear& dqkv, const torch::nn::Linear& dproj,
                                                     int64_t heads_, CommPtr tp)
    : heads(heads_) {
  const int64_t d = dqkv->options.in_features();
  local_heads = shard_size(heads, tp->size(), "the number of attention heads");
  if (d % heads != 0 || dqkv->options.out_features() != 3 * d) {
    throw std::invalid_argument(
        "tandem::tp::ParallelSelfAttention: expected a fused qkv linear [3*D, D] with D divisible by heads");
  }
  if (lora::adapter_of(*dqkv) || lora::adapter_of(*dproj)) {
    throw std::invalid_argument("tandem::tp::ParallelSelfAttention: LoRA adapters of a fused qkv projection are not "
                                "split by tensor parallelism; adapt separate q/k/v projections (tandem/llama.h)");
  }
  const int64_t hd = d / heads, r = tp->rank();
  // Rows of the fused projection are (q|k|v, head, dim): keep this rank's heads of each.
  auto w = dqkv->weight.detach().view({3, heads, hd, d}).narrow(1, r * local_heads, local_heads).reshape({-1, d});
  at::Tensor b;
  if (dqkv->options.bias())
    b = dqkv->bias.detach().view({3, heads, hd}).narrow(1, r * local_heads, local_heads).reshape({-1});
  qkv = register_module("qkv", ColumnParallelLinear(w, b, tp, false));
  qkv->sections = 3;
  proj = register_module("proj", RowParallelLinear(dproj, tp, true));
}

torch::Tensor ParallelSelfAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& attn_mask) {
  TORCH_CHECK(x.dim() == 3, "tandem::tp::ParallelSelfAttention: expected [B, T, D], got ", x.sizes());
  return proj->forward(models::self_attention_core(qkv->forward(x), local_heads, attn_mask, selective));
}

ParallelTransformerBlockImpl::ParallelTransformerBlockImpl(const models::TransformerBlockImpl& dense, CommPtr tp)
    : padded(dense.padded), documents(dense.documents) {
  ln1 = register_module("ln1", dense.ln1);
  attn = register_module("attn", ParallelSelfAttention(dense.qkv, dense.proj, dense.heads, tp));
  ln2 = register_module("ln2", dense.ln2);
  mlp = register_module("mlp", ParallelMLP(dense.fc1, dense.fc2, tp));
  recompute_selectively(dense.selective);
}

std::vector<ParameterPlacement> ParallelTransformerBlockImpl::parameter_placements() const {
  std::vector<ParameterPlacement> out;
  auto add = [&out](std::vector<ParameterPlacement> l) { out.insert(out.end(), l.begin(), l.end()); };
  add(prefixed(attn->qkv->parameter_placements(), "attn.qkv.", "qkv."));
  add(prefixed(attn->proj->parameter_placements(), "attn.proj.", "proj."));
  add(prefixed(mlp->fc1->parameter_placements(), "mlp.fc1.", "fc1."));
  add(prefixed(mlp->fc2->parameter_placements(), "mlp.fc2.", "fc2."));
  return out;
}

torch::Tensor ParallelTransformerBlockImpl::forward(const torch::Tensor& x) {
  if (padded) {
    const int64_t d = x.size(2) - 1;
    auto h0 = x.narrow(2, 0, d);
    auto m = x.narrow(2, d, 1);
    auto h = h0 + attn->forward(ln1->forward(h0), models::channel_attention_mask(m, documents));
    h = h + mlp->forward(ln2->forward(h));
    return torch::cat({h, m}, 2);
  }
  auto h = x + attn->forward(ln1->forward(x));
  return h + mlp->forward(ln2->forward(h));
}

// ---------------------------------------------------------------- the converter

namespace {
enum class Action { kKeep, kVocabEmbedding, kOwnForm, kColumn, kColumnGather, kRow };

const Parallelizable* parallelizable(const std::shared_ptr<torch::nn::Module>& m) {
  return dynamic_cast<const Parallelizable*>(m.get());
}

bool elementwise(const std::shared_ptr<torch::nn::Module>& m) {
  return m->as<torch::nn::ReLUImpl>() || m->as<torch::nn::GELUImpl>() || m->as<torch::nn::TanhImpl>() ||
         m->as<torch::nn::SigmoidImpl>() || m->as<torch::nn::SiLUImpl>() || m->as<torch::nn::DropoutImpl>();
}
}  // namespace

torch::nn::Sequential tensor_parallel(torch::nn::Sequential dense, CommPtr tp, TensorParallelOptions opts) {
  if (!dense) throw std::invalid_argument("tandem::tp::tensor_parallel: no model given");
  if (!tp) throw std::invalid_argument("tandem::tp::tensor_parallel: no tensor-parallel communicator given");
  if (opts.sequence_parallel) {
    throw std::invalid_argument(
        "--sequence-parallel needs a Llama model converted by tandem::llama::tensor_parallel (the converter that "
        "`tandem finetune` uses); this model's converter, tandem::tp::tensor_parallel (Tandem's transformer, "
        "Linear pairs), does not split the sequence: drop --sequence-parallel");
  }
  const int T = tp->size();
  std::vector<std::shared_ptr<torch::nn::Module>> kids;
  for (auto it = dense->begin(); it != dense->end(); ++it) kids.push_back(it->ptr());
  const size_t n = kids.size();

  // Plan (and check every size) before any collective, so that bad input fails at once everywhere.
  std::vector<Action> plan(n, Action::kKeep);
  // A model whose layers say how they split is a transformer: its plain Embedding is the token
  // table (vocabulary-parallel) and a final Linear after no pooling layer the LM head.
  bool is_transformer = false, classifier = false;
  for (auto& k : kids) {
    if (auto* own = parallelizable(k)) {
      is_transformer = true;
      classifier = classifier || own->pools();
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (auto* own = parallelizable(kids[i])) {
      own->check_tensor_parallel(T);
      plan[i] = Action::kOwnForm;
    } else if (auto* v = kids[i]->as<torch::nn::EmbeddingImpl>(); v && is_transformer) {
      shard_size(v->options.num_embeddings(), T, "the vocabulary");
      plan[i] = Action::kVocabEmbedding;
    }
  }
  if (is_transformer) {
    if (n >= 2 && kids[n - 1]->as<torch::nn::LinearImpl>() && !classifier) {
      shard_size(kids[n - 1]->as<torch::nn::LinearImpl>()->options.out_features(), T, "the vocabulary of the LM head");
      plan[n - 1] = opts.vocab_parallel_output ? Action::kColumn : Action::kColumnGather;
    }
  } else {
    // Pair Linear layers: column-parallel, elementwise children, row-parallel.
    for (size_t i = 0; i < n; ++i) {
      auto* a = kids[i]->as<torch::nn::LinearImpl>();
      if (!a || plan[i] != Action::kKeep) continue;
      size_t j = i + 1;
      while (j < n && elementwise(kids[j])) ++j;
      if (j < n && kids[j]->as<torch::nn::LinearImpl>() && plan[j] == Action::kKeep) {
        shard_size(a->options.out_features(), T, "the hidden width of a Linear pair");
        plan[i] = Action::kColumn;
        plan[j] = Action::kRow;
        i = j;
      }
    }
  }

  if (opts.sync_dense) broadcast_parameters(dense->parameters(), *tp, 0);

  torch::nn::Sequential out;
  for (size_t i = 0; i < n; ++i) {
    auto it = dense->begin() + static_cast<std::ptrdiff_t>(i);
    switch (plan[i]) {
      case Action::kKeep: out->push_back(*it); break;
      case Action::kVocabEmbedding:
        out->push_back(
            VocabParallelEmbedding(torch::nn::Embedding(std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(kids[i])),
                                   tp));
        break;
      case Action::kOwnForm: out->push_back(parallelizable(kids[i])->to_tensor_parallel(tp)); break;
      case Action::kColumn:
      case Action::kColumnGather: {
        ColumnParallelLinear head(torch::nn::Linear(std::dynamic_pointer_cast<torch::nn::LinearImpl>(kids[i])), tp,
                                  plan[i] == Action::kColumnGather);
        head->gather_in_eval = opts.gather_logits_in_eval && is_transformer && i + 1 == n;  // the LM head only
        out->push_back(head);
        break;
      }
      case Action::kRow:
        out->push_back(
            RowParallelLinear(torch::nn::Linear(std::dynamic_pointer_cast<torch::nn::LinearImpl>(kids[i])), tp, true));
        break;
    }
  }
  return out;
}

// ---------------------------------------------------------------- back to dense

at::Tensor gather_shards(const at::Tensor& t, int64_t dim, Communicator& comm) {
  auto in = t.detach().contiguous();
  std::vector<int64_t> shape{comm.size()};
  for (auto s : in.sizes()) shape.push_back(s);
  auto out = at::empty(shape, in.options());
  comm.allgather(out, in);
  return at::cat(out.unbind(0), dim);
}

}  // namespace tandem::tp
