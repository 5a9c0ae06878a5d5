// PowerSGD as a DDP bucket reduction (tandem/ddp.h, PowerSGDOptions). When a bucket is full its
// P = M Q products go out at once, together with its uncompressed tensors, overlapping the rest
// of backward; the second half (orthonormalise P, Q = M^T P, its all-reduce, M = P Q^T) needs
// every P back and runs after backward, for all buckets' Q all-reduces to be in flight together.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <exception>

#include "strategy/ddp/reducer.h"

namespace tandem::detail {

namespace {

// One gradient of a bucket compressed as an n x m matrix with rank-r factors P (n x r, at
// p_off of the P wire) and Q (m x r, at q_off of the Q wire).
struct LowRankSlot {
  size_t slot = 0;
  int64_t n = 0, m = 0, r = 0, p_off = 0, q_off = 0;
};

// A bucket's layout: the slots sent as they are (first on the P wire), then the P's; the Q's.
struct PowerSGDBucket {
  std::vector<size_t> dense;
  std::vector<LowRankSlot> low;
  int64_t dense_numel = 0;
  at::Tensor p_wire, q_wire;
};

class PowerSGDReducer final : public BucketReducer {
 public:
  PowerSGDReducer(Communicator& comm, const std::vector<at::Tensor>& params, const PowerSGDOptions& o, int64_t& bytes)
      : comm_(comm), params_(params), o_(o), bytes_(bytes), warmup_(make_dense_reducer(comm, c10::nullopt, bytes)),
        q_(params.size()), err_(params.size()) {}

  void planned(const std::vector<Bucket>& buckets) override {
    layout_.assign(buckets.size(), PowerSGDBucket());
    for (size_t b = 0; b < buckets.size(); ++b) plan_bucket(buckets[b], layout_[b]);
  }

  void start(size_t b, Bucket& bk) override {
    if (warming_up()) return warmup_->start(b, bk);
    auto& L = layout_.at(b);
    int64_t off = 0;
    for (size_t s : L.dense) {
      auto g = bk.slot(params_, s);
      L.p_wire.narrow(0, off, g.numel()).copy_(g);
      off += g.numel();
    }
    for (const auto& x : L.low) {
      const size_t i = bk.params[x.slot];
      auto M = matrix(bk, x);
      if (err_[i].defined()) M.add_(err_[i]);  // error feedback
      if (!q_[i].defined()) q_[i] = initial_q(i, x, M.options());
      auto P = p_of(L, x);
      at::mm_out(P, M, q_[i]);
    }
    bytes_ += L.p_wire.numel() * L.p_wire.element_size();
    const auto at = DDPClock::now();
    bk.works.emplace_back(comm_.allreduce_async(L.p_wire, ReduceOp::kAvg), at);
  }

  void finish(std::vector<Bucket>& buckets) override {
    if (warming_up()) {
      warmup_->finish(buckets);
      ++step_;
      return;
    }
    try {
      for (size_t b = 0; b < buckets.size(); ++b) project(buckets[b], layout_.at(b));
      for (size_t b = 0; b < buckets.size(); ++b) expand(buckets[b], layout_.at(b));
    } catch (...) {
      drain(buckets);
      throw;
    }
    ++step_;
  }

  std::vector<at::Tensor> residuals() const override { return err_; }

 private:
  bool warming_up() const { return step_ < o_.start_step; }

  void plan_bucket(const Bucket& bk, PowerSGDBucket& L) {
    int64_t p_numel = 0, q_numel = 0;
    for (size_t s = 0; s < bk.params.size(); ++s) {
      const auto& p = params_[bk.params[s]];
      LowRankSlot x;
      x.slot = s;
      if (p.dim() >= 2 && p.numel() > 0) {
        x.n = p.size(0);
        x.m = p.numel() / x.n;
        x.r = std::min({o_.rank, x.n, x.m});
      }
      const double full = static_cast<double>(x.n) * static_cast<double>(x.m);
      if (x.r > 0 && static_cast<double>((x.n + x.m) * x.r) * o_.min_compression_rate < full) {
        x.p_off = p_numel;
        x.q_off = q_numel;
        p_numel += x.n * x.r;
        q_numel += x.m * x.r;
        L.low.push_back(x);
      } else {
        L.dense.push_back(s);
        L.dense_numel += p.numel();
      }
    }
    for (auto& x : L.low) x.p_off += L.dense_numel;
    // Symmetric memory (the MPI backend's shared-memory all-reduce on one node), like the buckets.
    const auto opts = bk.flat.options();
    L.p_wire = symmetric_empty(comm_, L.dense_numel + p_numel, opts);
    if (q_numel > 0) L.q_wire = symmetric_empty(comm_, q_numel, opts);
  }

  at::Tensor matrix(const Bucket& bk, const LowRankSlot& x) const { return bk.slot(params_, x.slot).view({x.n, x.m}); }
  static at::Tensor p_of(const PowerSGDBucket& L, const LowRankSlot& x) {
    return L.p_wire.narrow(0, x.p_off, x.n * x.r).view({x.n, x.r});
  }
  static at::Tensor q_of(const PowerSGDBucket& L, const LowRankSlot& x) {
    return L.q_wire.narrow(0, x.q_off, x.m * x.r).view({x.m, x.r});
  }

  // Orthonormal columns of x in place (Householder QR: stable when columns are nearly
  // dependent, as they are when r reaches the gradient's rank).
  static void orthonormalise(at::Tensor x) { x.copy_(std::get<0>(at::linalg_qr(x, "reduced"))); }

  // The same on every rank: a generator seeded by the options' seed and the parameter's index.
  at::Tensor initial_q(size_t i, const LowRankSlot& x, const at::TensorOptions& opts) const {
    auto gen = at::detail::createCPUGenerator(o_.seed * 1000003ULL + i);
    auto q = at::randn({x.m, x.r}, gen, at::TensorOptions().dtype(at::kFloat)).to(opts);
    orthonormalise(q);
    return q;
  }

  // Once P is back: the uncompressed gradients averaged, P orthonormalised, this rank's
  // Q = M^T P and its residual M - P Q^T kept, then the Q all-reduce started.
  void project(Bucket& bk, PowerSGDBucket& L) {
    bk.works.at(0).first->wait();
    int64_t off = 0;
    for (size_t s : L.dense) {
      auto g = bk.slot(params_, s);
      g.copy_(L.p_wire.narrow(0, off, g.numel()));
      off += g.numel();
    }
    if (L.low.empty()) return;
    for (const auto& x : L.low) {
      const size_t i = bk.params[x.slot];
      auto M = matrix(bk, x);
      auto P = p_of(L, x);
      auto Q = q_of(L, x);
      orthonormalise(P);
      at::mm_out(Q, M.t(), P);
      err_[i] = at::addmm(M, P, Q.t(), /*beta=*/1, /*alpha=*/-1);
    }
    bytes_ += L.q_wire.numel() * L.q_wire.element_size();
    const auto at = DDPClock::now();
    bk.works.emplace_back(comm_.allreduce_async(L.q_wire, ReduceOp::kAvg), at);
  }

  // Once Q is back: M = P Q^T, and Q kept for the next step (warm start).
  void expand(Bucket& bk, PowerSGDBucket& L) {
    if (L.low.empty()) return;
    bk.works.at(1).first->wait();
    for (const auto& x : L.low) {
      auto Q = q_of(L, x);
      q_[bk.params[x.slot]].copy_(Q);
      auto M = matrix(bk, x);
      at::mm_out(M, p_of(L, x), Q.t());
    }
  }

  static void drain(std::vector<Bucket>& buckets) {
    for (auto& bk : buckets) {
      for (auto& w : bk.works) {
        try {
          w.first->wait();
        } catch (...) {  // the first failure is the one rethrown
        }
      }
    }
  }

  Communicator& comm_;
  const std::vector<at::Tensor>& params_;
  PowerSGDOptions o_;
  int64_t& bytes_;
  std::unique_ptr<BucketReducer> warmup_;  // the first start_step steps
  int64_t step_ = 0;                       // synchronized steps so far
  std::vector<at::Tensor> q_, err_;        // per parameter: Q (warm start), residual
  std::vector<PowerSGDBucket> layout_;
};

}  // namespace

std::unique_ptr<BucketReducer> make_powersgd_reducer(Communicator& comm, const std::vector<at::Tensor>& params,
                                                     const PowerSGDOptions& opts, int64_t& bytes) {
  return std::make_unique<PowerSGDReducer>(comm, params, opts, bytes);
}

}  // namespace tandem::detail
