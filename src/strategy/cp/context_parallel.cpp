// Ring attention and the sequence layout of context parallelism (tandem/context_parallel.h).
//
// Which query rows of rank r attend to which keys of the block of rank s (chunks r, 2C-1-r
// against s, 2C-1-s, each of c = L/2 tokens, positions increasing within a rank):
//   s == r: all rows, all keys, causal (the local order is the global order);
//   s <  r: all rows see chunk s whole, none sees chunk 2C-1-s (it lies after both of r's);
//   s >  r: chunk r sees nothing of s (both lie after it), chunk 2C-1-r sees both whole.
// So every step but the first is one unmasked [L x c] or [c x L] block: the same work on every
// rank, which is what the chunk pairing balances.
#include "tandem/context_parallel.h"

#include "compat/torch_compat.h"

#include <torch/autograd.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tandem::cp {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kTagKV = 0x6370;    // "cp": key/value blocks, forward and backward
constexpr int kTagGrad = 0x6371;  // accumulated key/value gradients, backward
thread_local RingStats g_stats;

// The communicator travels through autograd as a capsule (an IValue the context can hold).
struct CommHolder : torch::CustomClassHolder {
  explicit CommHolder(CommPtr c) : comm(std::move(c)) {}
  CommPtr comm;
};
c10::IValue hold(const CommPtr& c) { return c10::IValue::make_capsule(c10::make_intrusive<CommHolder>(c)); }
CommPtr held(const c10::IValue& v) { return c10::static_intrusive_pointer_cast<CommHolder>(v.toCapsule())->comm; }

struct Block {
  int64_t q0, qn, k0, kn;
  bool causal;
};

Block block_of(int src, int rank, int64_t c) {
  if (src == rank) return {0, 2 * c, 0, 2 * c, true};
  if (src < rank) return {0, 2 * c, 0, c, false};
  return {c, c, 0, 2 * c, false};
}

at::ScalarType acc_type(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// Key/value heads repeated for their query heads: [B, KV, n, D] -> [B, H, n, D].
at::Tensor expand_heads(const at::Tensor& kv, int64_t groups) {
  return groups == 1 ? kv : kv.repeat_interleave(groups, /*dim=*/1);
}
// The reverse for gradients: [B, H, n, D] -> [B, KV, n, D], summed over each group.
at::Tensor sum_heads(const at::Tensor& g, int64_t groups) {
  if (groups == 1) return g;
  auto s = g.sizes().vec();
  return g.view({s[0], s[1] / groups, groups, s[2], s[3]}).sum(2);
}

// The block's scores q k^T / sqrt(D), masked above the diagonal when causal.
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const Block& b, double scale) {
  auto s = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (b.causal) {
    auto above = at::ones({b.qn, b.kn}, s.options().dtype(at::kBool)).triu(1);
    s = s.masked_fill(above, -std::numeric_limits<double>::infinity());
  }
  return s;
}

// One step's exchange: `send` to the next rank, `recv` filled from the previous one.
class Exchange {
 public:
  Exchange(const CommPtr& cp, const at::Tensor& send, const at::Tensor& recv, int tag) : recv_buf_(recv) {
    const int C = cp->size(), r = cp->rank();
    send_ = cp->send_async(send, (r + 1) % C, tag);
    recv_ = cp->recv_async(recv, (r - 1 + C) % C, tag);
    recv_->is_completed();  // starts a backend that launches point-to-point on first test (NCCL)
    g_stats.bytes += send.numel() * send.element_size();
  }
  at::Tensor wait() {
    const auto t0 = Clock::now();
    recv_->wait();
    send_->wait();
    g_stats.exposed_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    g_stats.transfer_seconds += std::max(recv_->seconds(), send_->seconds());
    return recv_buf_;
  }

 private:
  WorkPtr send_, recv_;
  at::Tensor recv_buf_;
};

// Merges a block's output and log-sum-exp into the running ones (online softmax), in place.
void merge(at::Tensor out, at::Tensor lse, const at::Tensor& block_out, const at::Tensor& block_lse) {
  auto merged = at::logaddexp(lse, block_lse);
  out.mul_((lse - merged).exp().unsqueeze(-1)).add_(block_out * (block_lse - merged).exp().unsqueeze(-1));
  lse.copy_(merged);
}

class RingAttention : public torch::autograd::Function<RingAttention> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, c10::IValue comm) {
    const auto cp = held(comm);
    const auto acc = acc_type(q_in);
    // k and v travel in their own dtype (half the bytes in 16-bit); each block is attended in acc.
    auto q = q_in.to(acc), kv = at::stack({k_in, v_in}).contiguous();
    const int C = cp->size(), r = cp->rank();
    const int64_t L = q.size(2), c = L / 2, groups = q.size(1) / k_in.size(1);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    auto out = at::zeros_like(q);
    auto lse = at::full({q.size(0), q.size(1), L}, -std::numeric_limits<double>::infinity(), q.options());
    for (int i = 0; i < C; ++i) {
      std::unique_ptr<Exchange> ex;
      if (i + 1 < C) ex = std::make_unique<Exchange>(cp, kv, at::empty_like(kv), kTagKV);
      const Block b = block_of((r - i + C) % C, r, c);
      auto [block_out, block_lse] = block_forward(q, kv, b, groups, scale);
      merge(out.narrow(2, b.q0, b.qn), lse.narrow(2, b.q0, b.qn), block_out, block_lse);
      if (ex) kv = ex->wait();
    }
    ctx->save_for_backward({q_in, k_in, v_in, out, lse});
    ctx->saved_data["cp"] = comm;
    return out.to(q_in.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto cp = held(ctx->saved_data["cp"]);
    const auto& q_in = saved[0];
    const auto acc = acc_type(q_in);
    auto q = q_in.to(acc), kv = at::stack({saved[1], saved[2]}).contiguous();
    auto out = saved[3], lse = saved[4], dout = grads[0].to(acc);
    const int C = cp->size(), r = cp->rank();
    const int64_t L = q.size(2), c = L / 2, groups = q.size(1) / saved[1].size(1);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    const auto delta = (dout * out).sum(-1);  // rowsum(dO * O): softmax's backward term
    auto dq = at::zeros_like(q);
    std::unique_ptr<Exchange> grad_ex;  // the accumulated gradient of the block coming next
    for (int i = 0; i < C; ++i) {
      std::unique_ptr<Exchange> ex;
      if (i + 1 < C) ex = std::make_unique<Exchange>(cp, kv, at::empty_like(kv), kTagKV);
      const Block b = block_of((r - i + C) % C, r, c);
      auto [dk, dv] = block_grads(q, kv, dout, out, lse, delta, dq, b, groups, scale);
      // This block's gradient so far arrives from the previous rank (none at the first step);
      // this rank's part is added into it in place.
      auto accumulated = grad_ex ? grad_ex->wait() : at::zeros(kv.sizes(), kv.options().dtype(acc));
      accumulated[0].narrow(2, b.k0, b.kn).add_(dk);
      accumulated[1].narrow(2, b.k0, b.kn).add_(dv);
      if (C == 1) return finish(q_in, saved, dq, accumulated);
      grad_ex = std::make_unique<Exchange>(cp, accumulated, at::empty_like(accumulated), kTagGrad);
      if (ex) kv = ex->wait();
    }
    // After C steps the gradient of this rank's own block has visited every rank.
    return finish(q_in, saved, dq, grad_ex->wait());
  }

 private:
  static torch::autograd::variable_list finish(const at::Tensor& q_in, const torch::autograd::variable_list& saved,
                                               const at::Tensor& dq, const at::Tensor& dkv) {
    return {dq.to(q_in.scalar_type()), dkv[0].to(saved[1].scalar_type()), dkv[1].to(saved[2].scalar_type()),
            torch::autograd::Variable()};
  }

  // One block's output and log-sum-exp: the fused kernel where there is one, else the scores.
  static std::pair<at::Tensor, at::Tensor> block_forward(const at::Tensor& q, const at::Tensor& kv, const Block& b,
                                                         int64_t groups, double scale) {
    auto qs = q.narrow(2, b.q0, b.qn).contiguous();
    auto ks = expand_heads(kv[0].narrow(2, b.k0, b.kn), groups).to(q.scalar_type()).contiguous();
    auto vs = expand_heads(kv[1].narrow(2, b.k0, b.kn), groups).to(q.scalar_type()).contiguous();
    if (compat::has_fused_block_attention(qs)) {
      auto [o, l] = compat::block_attention(qs, ks, vs, b.causal, scale);
      return {o, l.to(q.scalar_type())};
    }
    auto s = scores(qs, ks, b, scale);
    auto l = at::logsumexp(s, -1);
    return {at::matmul((s - l.unsqueeze(-1)).exp(), vs), l};
  }

  // One block's contribution: dq += for its rows; returned, dk and dv of the block's keys
  // ([B, KV, kn, D], summed over each key/value head's query heads).
  static std::pair<at::Tensor, at::Tensor> block_grads(const at::Tensor& q, const at::Tensor& kv,
                                                       const at::Tensor& dout, const at::Tensor& out,
                                                       const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dq,
                                                       const Block& b, int64_t groups, double scale) {
    auto qs = q.narrow(2, b.q0, b.qn).contiguous(), dos = dout.narrow(2, b.q0, b.qn).contiguous();
    auto ks = expand_heads(kv[0].narrow(2, b.k0, b.kn), groups).to(q.scalar_type()).contiguous();
    auto vs = expand_heads(kv[1].narrow(2, b.k0, b.kn), groups).to(q.scalar_type()).contiguous();
    if (compat::has_fused_block_attention(qs)) {
      // The kernel's softmax backward reads the whole row's output and log-sum-exp.
      auto [dqb, dkb, dvb] = compat::block_attention_backward(dos, qs, ks, vs, out.narrow(2, b.q0, b.qn).contiguous(),
                                                              lse.narrow(2, b.q0, b.qn).contiguous(), b.causal, scale);
      dq.narrow(2, b.q0, b.qn).add_(dqb);
      return {sum_heads(dkb, groups), sum_heads(dvb, groups)};
    }
    auto p = (scores(qs, ks, b, scale) - lse.narrow(2, b.q0, b.qn).unsqueeze(-1)).exp();
    auto dp = at::matmul(dos, vs.transpose(-2, -1));
    auto ds = p * (dp - delta.narrow(2, b.q0, b.qn).unsqueeze(-1)) * scale;
    dq.narrow(2, b.q0, b.qn).add_(at::matmul(ds, ks));
    return {sum_heads(at::matmul(ds.transpose(-2, -1), qs), groups),
            sum_heads(at::matmul(p.transpose(-2, -1), dos), groups)};
  }
};

class GatherSequence : public torch::autograd::Function<GatherSequence> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t dim, c10::IValue comm,
                            double grad_scale) {
    const auto cp = held(comm);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["rank"] = static_cast<int64_t>(cp->rank());
    ctx->saved_data["size"] = static_cast<int64_t>(cp->size());
    ctx->saved_data["scale"] = grad_scale;
    const int64_t C = cp->size(), L = x.size(dim), c = L / 2;
    auto mine = x.movedim(dim, 0).contiguous();
    auto rest = mine.sizes().vec();
    rest.erase(rest.begin());
    std::vector<int64_t> all_shape{C * L};
    all_shape.insert(all_shape.end(), rest.begin(), rest.end());
    auto all = at::empty(all_shape, mine.options());
    cp->allgather(all, mine);
    // all holds, per rank s, chunks s then 2C-1-s: chunk j is part 2j (j < C) or 2(2C-1-j)+1.
    std::vector<int64_t> order(2 * C);
    for (int64_t j = 0; j < 2 * C; ++j) order[j] = j < C ? 2 * j : 2 * (2 * C - 1 - j) + 1;
    std::vector<int64_t> chunked{2 * C, c};
    chunked.insert(chunked.end(), rest.begin(), rest.end());
    auto idx = at::tensor(order, at::TensorOptions().dtype(at::kLong)).to(x.device());
    return all.view(chunked).index_select(0, idx).view(all_shape).movedim(0, dim);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto dim = ctx->saved_data["dim"].toInt();
    auto g = split_sequence(grads[0], dim, static_cast<int>(ctx->saved_data["rank"].toInt()),
                            static_cast<int>(ctx->saved_data["size"].toInt()));
    const double scale = ctx->saved_data["scale"].toDouble();
    return {scale == 1.0 ? g : g * scale, torch::autograd::Variable(), torch::autograd::Variable(),
            torch::autograd::Variable()};
  }
};

}  // namespace

void check_length(int64_t T, int size) {
  if (size >= 1 && T % (2 * static_cast<int64_t>(size)) == 0 && T > 0) return;
  throw std::invalid_argument("context parallelism over " + std::to_string(size) + " ranks cuts each sequence into " +
                              std::to_string(2 * size) + " equal chunks (rank r holds chunks r and " +
                              std::to_string(2 * size - 1) + " - r), so the sequence length must be a multiple of " +
                              std::to_string(2 * size) + "; this one has " + std::to_string(T) +
                              " tokens (pad it, or choose --seq or --cp to fit)");
}

at::Tensor positions(int64_t local_len, int rank, int size) {
  const int64_t c = local_len / 2;
  auto opts = at::TensorOptions().dtype(at::kLong);
  return at::cat(
      {at::arange(rank * c, (rank + 1) * c, opts), at::arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, opts)});
}

at::Tensor split_sequence(const at::Tensor& x, int64_t dim, int rank, int size) {
  dim = dim < 0 ? dim + x.dim() : dim;
  const int64_t T = x.size(dim);
  check_length(T, size);
  const int64_t c = T / (2 * size);
  return at::cat({x.narrow(dim, rank * c, c), x.narrow(dim, (2 * size - 1 - rank) * c, c)}, dim);
}

at::Tensor gather_sequence(const at::Tensor& x, int64_t dim, const CommPtr& cp, double grad_scale) {
  dim = dim < 0 ? dim + x.dim() : dim;
  return GatherSequence::apply(x, dim, hold(cp), grad_scale);
}

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const CommPtr& cp) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "ring_attention: q [B, H, L, D], k and v [B, KV, L, D] expected, got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "ring_attention: KV heads must divide the query heads and the local length must be even (two chunks): ",
              q.sizes(), " against ", k.sizes());
  return RingAttention::apply(q, k, v, hold(cp));
}

RingStats ring_stats() { return g_stats; }
void reset_ring_stats() { g_stats = RingStats{}; }

}  // namespace tandem::cp
