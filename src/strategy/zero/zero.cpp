// ZeroDataParallel: ZeRO stages 1 and 2 as one class whose stage is a switch (llm.c's
// zero.cuh), not a hierarchy.
//
// Layout: the parameters (reverse registration order, the order backward produces their
// gradients) are packed into buckets of at most bucket_cap_bytes; each bucket is padded to a
// multiple of the world size N and the buckets lie one after another in one flat buffer, of
// which the model's parameters become views. Rank r owns chunk r of every bucket, so a
// bucket's reduce-scatter delivers exactly the gradient chunk rank r steps. The optimizer's
// parameters are views of the owned chunks (no second copy of the parameters).
//
// Per step: post-accumulate hooks copy each finished gradient into its bucket; a full bucket
// (in bucket order, identical on every rank) is all-reduced (stage 1, into a full-size
// gradient buffer the parameters' .grad() are views of) or reduce-scattered into the rank's
// gradient shard (stage 2, from a per-bucket scratch freed once the collective finished; the
// parameters' .grad() are released). An autograd final callback waits for the collectives.
// step() clips by the global norm (sum of squares of the shards, all-reduced), steps the
// shard and all-gathers every bucket's parameters.
#include "tandem/zero.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <sstream>

#include "strategy/autograd_hooks.h"
#include "strategy/model_sync.h"

namespace tandem {

int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt) {
  int64_t total = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) total += t.numel() * t.element_size();
  };
  for (auto& kv : opt.state()) {
    const auto* s = kv.second.get();
    if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
      add(a->exp_avg());
      add(a->exp_avg_sq());
      add(a->max_exp_avg_sq());
    } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
      add(w->exp_avg());
      add(w->exp_avg_sq());
      add(w->max_exp_avg_sq());
    } else if (auto* g = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
      add(g->momentum_buffer());
    } else if (auto* ad = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
      add(ad->sum());
    } else if (auto* rm = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
      add(rm->square_avg());
      add(rm->momentum_buffer());
      add(rm->grad_avg());
    }
  }
  return total;
}

namespace {

struct Bucket {
  std::vector<size_t> params;  // indices into Impl::params, in flat order
  int64_t offset = 0;          // first element in the flat buffers
  int64_t numel = 0;           // elements of its parameters
  int64_t padded = 0;          // numel rounded up to a multiple of N
  int64_t chunk = 0;           // padded / N: what each rank owns
  int64_t shard_offset = 0;    // where this bucket's chunk lies in the rank's shard
  size_t pending = 0;          // parameters still waiting for their gradient this step
  at::Tensor scratch;          // stage 2: the bucket's local gradients while reduce-scattered
  WorkPtr work;
};

bool same_view(const at::Tensor& g, const at::Tensor& v) {
  return g.defined() && g.data_ptr() == v.data_ptr() && g.sizes() == v.sizes() && g.strides() == v.strides();
}

}  // namespace

struct ZeroDataParallel::Impl {
  CommPtr comm;
  ZeroOptions opts;
  int world = 1, rank = 0;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  std::vector<std::shared_ptr<void>> accumulators;
  std::shared_ptr<Impl*> self;  // hooks hold a weak_ptr to this

  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;
  std::vector<int64_t> offset_of;  // element offset of each parameter in `flat`
  int64_t psi = 0;
  at::Tensor flat;        // every parameter (the module's parameters are views of it)
  at::Tensor grad_flat;   // stage 1: every gradient, averaged after backward
  at::Tensor grad_shard;  // stage 2: this rank's averaged gradient chunks
  std::vector<at::Tensor> shard_params;  // views of flat: the owned chunks
  std::unique_ptr<torch::optim::Optimizer> optim;

  std::vector<char> ready;
  size_t next_bucket = 0;
  bool callback_queued = false;
  std::deque<size_t> inflight;  // stage 2: launched, scratch still held
  double last_norm = -1.0;
  int64_t scratch_live = 0, scratch_peak = 0;  // stage 2: bytes of bucket scratch alive

  at::Tensor new_scratch(const Bucket& bk) {
    auto t = at::zeros({bk.padded}, flat.options());
    scratch_live += t.numel() * t.element_size();
    scratch_peak = std::max(scratch_peak, scratch_live);
    return t;
  }
  void free_scratch(Bucket& bk) {
    if (bk.scratch.defined()) scratch_live -= bk.scratch.numel() * bk.scratch.element_size();
    bk.scratch = at::Tensor();
  }

  std::string where() const { return "rank " + std::to_string(rank) + ": ZeRO-" + std::to_string(opts.stage); }

  at::Tensor param_view(const at::Tensor& buf, size_t i) const {
    return buf.narrow(0, offset_of[i], params[i].numel()).view(params[i].sizes());
  }

  void build_layout() {
    const int64_t esize = params.empty() ? 4 : params[0].element_size();
    Bucket cur;
    int64_t cur_bytes = 0;
    auto close = [&] {
      if (!cur.params.empty()) buckets.push_back(std::move(cur));
      cur = Bucket();
      cur_bytes = 0;
    };
    for (size_t k = 0; k < params.size(); ++k) {
      size_t i = params.size() - 1 - k;  // reverse registration order
      int64_t bytes = params[i].numel() * esize;
      if (!cur.params.empty() && cur_bytes + bytes > opts.bucket_cap_bytes) close();
      cur.params.push_back(i);
      cur_bytes += bytes;
    }
    close();
    bucket_of.assign(params.size(), 0);
    offset_of.assign(params.size(), 0);
    int64_t off = 0, shard_off = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      auto& bk = buckets[b];
      bk.offset = off;
      for (size_t i : bk.params) {
        bucket_of[i] = b;
        offset_of[i] = off + bk.numel;
        bk.numel += params[i].numel();
      }
      bk.padded = (bk.numel + world - 1) / world * world;
      if (bk.padded == 0) bk.padded = world;
      bk.chunk = bk.padded / world;
      bk.shard_offset = shard_off;
      bk.pending = bk.params.size();
      off += bk.padded;
      shard_off += bk.chunk;
    }
    torch::NoGradGuard ng;
    auto opts_t = params.empty() ? at::TensorOptions().dtype(at::kFloat) : params[0].options().requires_grad(false);
    flat = at::zeros({std::max<int64_t>(off, 1)}, opts_t);
    for (size_t i = 0; i < params.size(); ++i) {
      auto v = param_view(flat, i);
      v.copy_(params[i].detach());
      params[i].set_data(v);
    }
    for (auto& bk : buckets) shard_params.push_back(flat.narrow(0, bk.offset + rank * bk.chunk, bk.chunk));
    if (opts.stage == 1) {
      grad_flat = at::zeros_like(flat);
    } else {
      grad_shard = at::zeros({std::max<int64_t>(shard_off, 1)}, opts_t);
    }
    link_shard_grads();
    ready.assign(params.size(), 0);
  }

  void build_optimizer() {
    const auto& o = opts.optimizer;
    if (o.kind == "sgd") {
      optim = std::make_unique<torch::optim::SGD>(
          shard_params,
          torch::optim::SGDOptions(o.lr).momentum(o.momentum).nesterov(o.nesterov).weight_decay(o.weight_decay));
    } else if (o.kind == "adam") {
      optim = std::make_unique<torch::optim::Adam>(
          shard_params,
          torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
    } else if (o.kind == "adamw") {
      optim = std::make_unique<torch::optim::AdamW>(
          shard_params,
          torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
    } else {
      throw std::invalid_argument(where() + ": unknown optimizer '" + o.kind + "' (use sgd, adam or adamw)");
    }
  }

  // ---- per step, from the autograd hooks
  void on_grad_ready(size_t i) {
    if (!callback_queued) {
      callback_queued = true;
      std::weak_ptr<Impl*> weak = self;
      detail::queue_backward_callback([weak] {
        if (auto s = weak.lock()) (*s)->finalize();
      });
    }
    if (ready[i]) return;
    ready[i] = 1;
    take_gradient(i);
    auto& bk = buckets[bucket_of[i]];
    if (--bk.pending == 0) launch_ready();
  }

  // Moves parameter i's gradient where its bucket's collective will find it.
  void take_gradient(size_t i) {
    torch::NoGradGuard ng;
    auto& g = params[i].mutable_grad();
    if (opts.stage == 1) {
      auto v = param_view(grad_flat, i);
      if (same_view(g, v)) return;  // accumulated in place
      if (g.defined()) {
        v.copy_(g);
      } else {
        v.zero_();  // no gradient this step (unused parameter): zero
      }
      g = v;
    } else {
      auto& bk = buckets[bucket_of[i]];
      if (!bk.scratch.defined()) bk.scratch = new_scratch(bk);
      if (g.defined()) bk.scratch.narrow(0, offset_of[i] - bk.offset, params[i].numel()).view(params[i].sizes()).copy_(g);
      g = at::Tensor();  // stage 2 keeps no full-size gradient
    }
  }

  void launch_ready() {
    // In bucket order on every rank, so that the collectives match.
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) launch(next_bucket++);
  }

  void wait_oldest() {
    size_t b = inflight.front();
    inflight.pop_front();
    auto w = std::move(buckets[b].work);
    buckets[b].work.reset();
    try {
      w->wait();
    } catch (...) {
      free_scratch(buckets[b]);
      throw;
    }
    free_scratch(buckets[b]);
  }

  void launch(size_t b) {
    auto& bk = buckets[b];
    if (opts.stage == 1) {
      bk.work = comm->allreduce_async(grad_flat.narrow(0, bk.offset, bk.padded), ReduceOp::kAvg);
    } else {
      while (static_cast<int>(inflight.size()) >= std::max(1, opts.max_inflight_buckets)) wait_oldest();
      if (!bk.scratch.defined()) bk.scratch = new_scratch(bk);
      bk.work = comm->reduce_scatter_async(grad_shard.narrow(0, bk.shard_offset, bk.chunk), bk.scratch, ReduceOp::kAvg);
      inflight.push_back(b);
    }
  }

  void finalize() {
    callback_queued = false;
    for (size_t i = 0; i < params.size(); ++i) {
      if (ready[i]) continue;
      ready[i] = 1;
      take_gradient(i);
    }
    for (auto& bk : buckets) bk.pending = 0;
    std::exception_ptr err;
    try {
      launch_ready();
    } catch (...) {
      err = std::current_exception();
    }
    if (opts.stage == 1) {
      for (auto& bk : buckets) {
        try {
          if (bk.work) bk.work->wait();
        } catch (...) {
          if (!err) err = std::current_exception();
        }
        bk.work.reset();
      }
    } else {
      while (!inflight.empty()) {
        try {
          wait_oldest();
        } catch (...) {
          if (!err) err = std::current_exception();
        }
      }
      for (auto& bk : buckets) free_scratch(bk);
    }
    for (auto& bk : buckets) bk.pending = bk.params.size();
    std::fill(ready.begin(), ready.end(), 0);
    next_bucket = 0;
    if (err) std::rethrow_exception(err);
  }

  double clip() {
    torch::NoGradGuard ng;
    auto sq = at::zeros({1}, flat.options().dtype(at::kDouble));
    for (auto& s : shard_params) sq += s.grad().to(at::kDouble).pow(2).sum();
    comm->allreduce(sq, ReduceOp::kSum);
    double norm = std::sqrt(sq.cpu().item<double>());
    if (!std::isfinite(norm)) {
      throw std::runtime_error(where() + ": the global gradient norm is " + std::to_string(norm) +
                               "; lower the learning rate or check the loss for NaN/inf");
    }
    double coef = opts.max_grad_norm / (norm + 1e-6);
    if (coef < 1.0)
      for (auto& s : shard_params) s.mutable_grad().mul_(coef);
    return norm;
  }

  // The optimizer's gradients are views of the averaged gradients; re-point them in case
  // someone reset them (optimizer().zero_grad() sets them to none).
  void link_shard_grads() {
    for (size_t b = 0; b < buckets.size(); ++b) {
      const auto& bk = buckets[b];
      auto v = opts.stage == 1 ? grad_flat.narrow(0, bk.offset + rank * bk.chunk, bk.chunk)
                               : grad_shard.narrow(0, bk.shard_offset, bk.chunk);
      if (!same_view(shard_params[b].grad(), v)) shard_params[b].mutable_grad() = v;
    }
  }

  void step() {
    link_shard_grads();
    last_norm = opts.max_grad_norm > 0 ? clip() : -1.0;
    optim->step();
    torch::NoGradGuard ng;
    std::vector<WorkPtr> works;
    for (size_t b = 0; b < buckets.size(); ++b) {
      auto& bk = buckets[b];
      // A copy of the owned chunk: MPI forbids the input to alias the output.
      works.push_back(comm->allgather_async(flat.narrow(0, bk.offset, bk.padded), shard_params[b].clone()));
    }
    std::exception_ptr err;
    for (auto& w : works) {
      try {
        w->wait();
      } catch (...) {
        if (!err) err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
  }
};

ZeroDataParallel::ZeroDataParallel(std::shared_ptr<torch::nn::Module> module, CommPtr comm, ZeroOptions opts)
    : module_(std::move(module)), impl_(std::make_unique<Impl>()) {
  if (!module_) throw std::invalid_argument("ZeroDataParallel needs a module");
  if (!comm) throw std::invalid_argument("ZeroDataParallel needs a communicator");
  if (opts.stage != 1 && opts.stage != 2) {
    throw std::invalid_argument("ZeroDataParallel supports stages 1 and 2, not " + std::to_string(opts.stage));
  }
  if (opts.bucket_cap_bytes <= 0) throw std::invalid_argument("ZeRO bucket_cap_bytes must be positive");
  if (opts.max_grad_norm < 0) throw std::invalid_argument("ZeRO max_grad_norm must be >= 0 (0 = off)");
  const auto& kind = opts.optimizer.kind;
  if (kind != "sgd" && kind != "adam" && kind != "adamw") {
    throw std::invalid_argument("ZeroDataParallel: unknown optimizer '" + kind + "' (use sgd, adam or adamw)");
  }
  auto& I = *impl_;
  I.comm = std::move(comm);
  I.opts = opts;
  I.world = I.comm->size();
  I.rank = I.comm->rank();
  I.self = std::make_shared<Impl*>(impl_.get());
  for (auto& kv : module_->named_parameters(/*recurse=*/true)) {
    if (!kv.value().requires_grad()) continue;
    I.names.push_back(kv.key());
    I.params.push_back(kv.value());
  }
  for (auto& kv : module_->named_buffers(/*recurse=*/true)) I.buffers.emplace_back(kv.key(), kv.value());
  for (size_t i = 1; i < I.params.size(); ++i) {
    if (I.params[i].scalar_type() != I.params[0].scalar_type() || I.params[i].device() != I.params[0].device()) {
      throw std::invalid_argument(I.where() + ": all parameters must share one dtype and device; '" + I.names[i] +
                                  "' differs from '" + I.names[0] + "'. Convert the model first (module->to(...)).");
    }
  }
  if (!I.params.empty() && !at::isFloatingType(I.params[0].scalar_type())) {
    throw std::invalid_argument(I.where() + ": parameters must be floating point");
  }
  detail::check_same_model(*I.comm, I.names, I.params, I.buffers, "ZeroDataParallel");
  detail::broadcast_from_rank0(*I.comm, I.params, I.buffers, /*include_params=*/true);
  for (auto& p : I.params) I.psi += p.numel();
  I.build_layout();
  I.build_optimizer();

  std::weak_ptr<Impl*> weak = I.self;
  I.accumulators = detail::add_post_accumulate_grad_hooks(I.params, [weak](size_t i) {
    if (auto s = weak.lock()) (*s)->on_grad_ready(i);
  });
}

ZeroDataParallel::~ZeroDataParallel() = default;

void ZeroDataParallel::prepare_forward() {
  auto& I = *impl_;
  if (I.opts.broadcast_buffers && !I.buffers.empty()) {
    detail::broadcast_from_rank0(*I.comm, I.params, I.buffers, /*include_params=*/false);
  }
}

void ZeroDataParallel::zero_grad() {
  torch::NoGradGuard ng;
  auto& I = *impl_;
  if (I.opts.stage == 1) {
    I.grad_flat.zero_();
    for (size_t i = 0; i < I.params.size(); ++i) {
      auto& g = I.params[i].mutable_grad();
      if (g.defined() && !same_view(g, I.param_view(I.grad_flat, i))) g.zero_();
    }
  } else {
    I.grad_shard.zero_();
    for (auto& p : I.params) p.mutable_grad() = at::Tensor();
  }
}

void ZeroDataParallel::step() { impl_->step(); }

void ZeroDataParallel::set_lr(double lr) {
  for (auto& g : impl_->optim->param_groups()) g.options().set_lr(lr);
}

double ZeroDataParallel::lr() const { return impl_->optim->param_groups().at(0).options().get_lr(); }

double ZeroDataParallel::last_grad_norm() const { return impl_->last_norm; }

int ZeroDataParallel::stage() const { return impl_->opts.stage; }

int64_t ZeroDataParallel::shard_numel() const {
  int64_t n = 0;
  for (auto& bk : impl_->buckets) n += bk.chunk;
  return n;
}

int64_t ZeroDataParallel::padded_numel() const {
  int64_t n = 0;
  for (auto& bk : impl_->buckets) n += bk.padded;
  return n;
}

torch::optim::Optimizer& ZeroDataParallel::optimizer() { return *impl_->optim; }

ZeroMemory ZeroDataParallel::memory() const {
  const auto& I = *impl_;
  auto bytes = [](const at::Tensor& t) -> int64_t { return t.defined() ? t.numel() * t.element_size() : 0; };
  ZeroMemory m;
  m.stage = I.opts.stage;
  m.world_size = I.world;
  m.parameters = I.psi;
  m.parameter_bytes = bytes(I.flat);  // the parameters are views of it
  m.gradient_bytes = bytes(I.grad_flat) + bytes(I.grad_shard);
  for (auto& bk : I.buckets) m.gradient_bytes += bytes(bk.scratch);
  for (size_t i = 0; i < I.params.size(); ++i) {
    const auto& g = I.params[i].grad();
    if (g.defined() && !(I.grad_flat.defined() && same_view(g, I.param_view(I.grad_flat, i)))) m.gradient_bytes += bytes(g);
  }
  m.optimizer_state_bytes = optimizer_state_bytes(*I.optim);
  m.peak_scratch_bytes = I.scratch_peak;
  const int64_t e = I.flat.element_size();
  const int64_t N = I.world;
  m.model_parameter_bytes = e * I.psi;
  m.model_gradient_bytes = I.opts.stage == 1 ? e * I.psi : e * I.psi / N;
  const auto& k = I.opts.optimizer.kind;
  int64_t states = (k == "adam" || k == "adamw") ? 2 : (k == "sgd" && I.opts.optimizer.momentum != 0.0 ? 1 : 0);
  m.model_optimizer_state_bytes = states * e * I.psi / N;
  return m;
}

}  // namespace tandem
