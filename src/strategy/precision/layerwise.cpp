// LARS and LAMB (layerwise.h): the common step over a LayerwiseLayout, both algorithms' updates,
// and the layout's public entry points (tandem/optim.h).
#include "strategy/precision/layerwise.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

namespace tandem {
namespace layerwise {
namespace {

// A contiguous tensor's elements as one dimension.
at::Tensor flat(const at::Tensor& t) {
  if (!t.is_contiguous()) throw std::invalid_argument("LARS/LAMB: parameters and gradients must be contiguous");
  return t.view({-1});
}

bool adapts(int64_t dim, const Options& o) { return dim > 1 || o.adapt_vectors(); }

// ||w|| / ||x|| scaled, or 1 when a norm is 0 (a zero-initialised layer, an unused one).
double ratio(double num, double den) { return num > 0.0 && den > 0.0 ? num / den : 1.0; }

}  // namespace

Optimizer::Optimizer(std::vector<at::Tensor> params, const Options& o)
    : torch::optim::Optimizer(std::move(params), std::make_unique<Options>(o)) {}

void Optimizer::set_layout(LayerwiseLayout layout) {
  size_t n = 0;
  for (const auto& g : param_groups()) n += g.params().size();
  if (layout.segments.size() != n) {
    throw std::invalid_argument("LARS/LAMB layout: " + std::to_string(layout.segments.size()) + " segment lists for " +
                                std::to_string(n) + " optimizer tensors");
  }
  size_t k = 0;
  for (const auto& g : param_groups()) {
    for (const auto& p : g.params()) {
      for (const auto& s : layout.segments[k]) {
        if (s.offset < 0 || s.numel < 0 || s.offset + s.numel > p.numel() || s.param < 0 ||
            s.param >= static_cast<int64_t>(layout.dims.size())) {
          throw std::invalid_argument("LARS/LAMB layout: a segment of tensor " + std::to_string(k) +
                                      " lies outside it or names no parameter");
        }
      }
      ++k;
    }
  }
  layout_ = std::move(layout);
  has_layout_ = true;
}

const LayerwiseLayout& Optimizer::layout() {
  if (!has_layout_) {
    for (const auto& g : param_groups()) {
      for (const auto& p : g.params()) {
        layout_.segments.push_back({{0, p.numel(), static_cast<int64_t>(layout_.dims.size())}});
        layout_.dims.push_back(p.dim());
      }
    }
    has_layout_ = true;
  }
  return layout_;
}

at::Tensor Optimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode grad(true);
    loss = closure();
  }
  torch::NoGradGuard ng;
  const auto& L = layout();
  struct Item {
    at::Tensor p, g, d;
    const Options* o;
    size_t k;
  };
  std::vector<Item> items;
  size_t k = 0;
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const Options&>(group.options());
    for (auto& p : group.params()) {
      if (p.grad().defined()) {
        auto g = flat(p.grad());
        items.push_back({p, g, direction(p, g, o), &o, k});
      }
      ++k;
    }
  }
  // Sums of squares per logical parameter: [weights, what the trust ratio compares them with].
  std::vector<at::Tensor> w_sq, x_sq;
  std::vector<int64_t> index;
  for (auto& it : items) {
    auto w = flat(it.p);
    for (const auto& s : L.segments[it.k]) {
      if (!adapts(L.dims[s.param], *it.o)) continue;
      auto ws = w.narrow(0, s.offset, s.numel);
      auto x = measured(ws, it.d.narrow(0, s.offset, s.numel), it.g.narrow(0, s.offset, s.numel), *it.o);
      w_sq.push_back(ws.to(at::kDouble).square().sum());
      x_sq.push_back(x.to(at::kDouble).square().sum());
      index.push_back(s.param);
    }
  }
  const auto dev = params_device();
  auto sums = at::zeros({static_cast<int64_t>(L.dims.size()), 2}, at::TensorOptions(at::kDouble).device(dev));
  if (!index.empty()) {
    sums.index_add_(0, at::tensor(index, at::kLong).to(dev), at::stack({at::stack(w_sq), at::stack(x_sq)}, 1));
  }
  if (L.reduce) L.reduce(sums);  // every rank, even one without gradients: it is collective
  const auto norms = sums.sqrt().cpu().contiguous();
  const auto n = norms.accessor<double, 2>();
  for (auto& it : items) {
    auto w = flat(it.p);
    for (const auto& s : L.segments[it.k]) {
      update(w.narrow(0, s.offset, s.numel), it.d.narrow(0, s.offset, s.numel), it.g.narrow(0, s.offset, s.numel),
             adapts(L.dims[s.param], *it.o), n[s.param][0], n[s.param][1], *it.o);
    }
    finish(it.p, it.d, *it.o);
  }
  return loss;
}

at::Device Optimizer::params_device() const {
  for (const auto& g : param_groups())
    for (const auto& p : g.params()) return p.device();
  return at::Device(at::kCPU);
}

// ---- LAMB

at::Tensor Lamb::direction(const at::Tensor& p, const at::Tensor& g, const Options& o) {
  auto& slot = state_[p.unsafeGetTensorImpl()];
  if (!slot) {
    auto st = std::make_unique<LambState>();
    st->exp_avg(at::zeros_like(p, at::MemoryFormat::Contiguous));
    st->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
    slot = std::move(st);
  }
  auto& st = static_cast<LambState&>(*slot);
  st.step(st.step() + 1);
  auto m = flat(st.exp_avg()), v = flat(st.exp_avg_sq());
  m.mul_(o.beta1()).add_(g, 1.0 - o.beta1());
  v.mul_(o.beta2()).addcmul_(g, g, 1.0 - o.beta2());
  const double bc1 = 1.0 - std::pow(o.beta1(), static_cast<double>(st.step()));
  const double bc2 = 1.0 - std::pow(o.beta2(), static_cast<double>(st.step()));
  return (m / bc1).div_((v / bc2).sqrt_().add_(o.eps()));
}

at::Tensor Lamb::measured(const at::Tensor& w, at::Tensor d, const at::Tensor&, const Options& o) {
  if (o.weight_decay() != 0.0) d.add_(w, o.weight_decay());
  return d;
}

void Lamb::update(at::Tensor w, at::Tensor d, const at::Tensor&, bool adapt, double w_norm, double u_norm,
                  const Options& o) {
  w.add_(d, -o.lr() * (adapt ? ratio(w_norm, u_norm) : 1.0));
}

// ---- LARS

at::Tensor Lars::direction(const at::Tensor&, const at::Tensor& g, const Options&) { return at::zeros_like(g); }

void Lars::update(at::Tensor w, at::Tensor d, const at::Tensor& g, bool adapt, double w_norm, double g_norm,
                  const Options& o) {
  const double wd = adapt ? o.weight_decay() : 0.0;
  const double local = adapt ? ratio(o.trust_coefficient() * w_norm, g_norm + wd * w_norm + o.eps()) : 1.0;
  d.add_(g, o.lr() * local);
  if (wd != 0.0) d.add_(w, o.lr() * local * wd);
}

void Lars::finish(const at::Tensor& p, const at::Tensor& d, const Options& o) {
  if (o.momentum() == 0.0) {
    flat(p).sub_(d);
    return;
  }
  auto& slot = state_[p.unsafeGetTensorImpl()];
  if (!slot) {
    auto st = std::make_unique<LarsState>();
    st->momentum_buffer(d.view(p.sizes()).clone());
    slot = std::move(st);
  } else {
    flat(static_cast<LarsState&>(*slot).momentum_buffer()).mul_(o.momentum()).add_(d);
  }
  flat(p).sub_(flat(static_cast<LarsState&>(*slot).momentum_buffer()));
}

}  // namespace layerwise

// ---- tandem/optim.h

bool is_layerwise(const OptimizerOptions& o) { return o.kind == "lars" || o.kind == "lamb"; }

void set_layerwise_layout(torch::optim::Optimizer& opt, LayerwiseLayout layout) {
  auto* lw = dynamic_cast<layerwise::Optimizer*>(&opt);
  if (!lw) throw std::invalid_argument("set_layerwise_layout: the optimizer is not LARS or LAMB");
  lw->set_layout(std::move(layout));
}

std::function<void(at::Tensor&)> shard_norm_reducer(CommPtr dp, CommPtr tp, std::vector<bool> tp_sharded) {
  if (dp && dp->size() < 2) dp = nullptr;
  if (tp && tp->size() < 2) tp = nullptr;
  if (!dp && !tp) return nullptr;
  return [dp, tp, sharded = std::move(tp_sharded)](at::Tensor& sums) {
    if (dp) dp->allreduce(sums, ReduceOp::kSum);
    if (!tp) return;
    if (static_cast<int64_t>(sharded.size()) != sums.size(0)) {
      throw std::invalid_argument("LARS/LAMB: " + std::to_string(sharded.size()) + " tensor-parallel flags for " +
                                  std::to_string(sums.size(0)) + " parameters");
    }
    if (tp->rank() != 0) {
      // A replicated parameter's norm is the same on every tp rank: count rank 0's only.
      std::vector<double> keep(sharded.begin(), sharded.end());
      sums.mul_(at::tensor(keep, at::kDouble).to(sums.device()).unsqueeze(1));
    }
    tp->allreduce(sums, ReduceOp::kSum);
  };
}

}  // namespace tandem
