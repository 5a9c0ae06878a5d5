// Optimizer factory, loss scaling and fp32 master weights (MixedPrecisionOptimizer).
#include "tandem/precision.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>
#include <stdexcept>
#include <utility>

#include "strategy/precision/layerwise.h"
#include "tandem/optim.h"

namespace tandem {

// ---- optimizers

void validate(const OptimizerOptions& o) {
  if (o.kind != "sgd" && o.kind != "adam" && o.kind != "adamw" && !is_layerwise(o)) {
    throw std::invalid_argument("unknown optimizer '" + o.kind + "' (use sgd, adam, adamw, lars or lamb)");
  }
  if (!(o.lr > 0.0) || !std::isfinite(o.lr)) throw std::invalid_argument("the learning rate must be a positive number");
  if (o.momentum < 0.0 || o.momentum >= 1.0) throw std::invalid_argument("momentum must be in [0, 1)");
  if (o.nesterov && (o.kind != "sgd" || o.momentum <= 0.0)) {
    throw std::invalid_argument("nesterov needs sgd with momentum > 0");
  }
  if (o.weight_decay < 0.0) throw std::invalid_argument("weight decay must be >= 0");
  if (o.beta1 < 0.0 || o.beta1 >= 1.0 || o.beta2 < 0.0 || o.beta2 >= 1.0) {
    throw std::invalid_argument("Adam betas must be in [0, 1)");
  }
  if (!(o.eps > 0.0)) throw std::invalid_argument("Adam eps must be positive");
  if (o.kind == "lars" && (!(o.trust_coefficient > 0.0) || !std::isfinite(o.trust_coefficient))) {
    throw std::invalid_argument("the LARS trust coefficient must be a positive number (You et al. use 0.001)");
  }
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<at::Tensor> params, const OptimizerOptions& o) {
  validate(o);
  if (o.kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).nesterov(o.nesterov).weight_decay(o.weight_decay));
  }
  if (is_layerwise(o)) {
    layerwise::Options lo;
    lo.lr(o.lr).momentum(o.momentum).beta1(o.beta1).beta2(o.beta2).eps(o.eps).weight_decay(o.weight_decay);
    lo.trust_coefficient(o.trust_coefficient).adapt_vectors(o.adapt_vectors);
    if (o.kind == "lars") return std::make_unique<layerwise::Lars>(std::move(params), lo);
    return std::make_unique<layerwise::Lamb>(std::move(params), lo);
  }
  if (o.kind == "adam") {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  }
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
}

std::string optimizer_kind(const torch::optim::Optimizer& opt) {
  if (dynamic_cast<const torch::optim::AdamW*>(&opt)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&opt)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&opt)) return "sgd";
  if (dynamic_cast<const layerwise::Lars*>(&opt)) return "lars";
  if (dynamic_cast<const layerwise::Lamb*>(&opt)) return "lamb";
  throw std::invalid_argument("checkpoints support the SGD, Adam, AdamW, LARS and LAMB optimizers only");
}

int optimizer_state_slots(const OptimizerOptions& o) {
  if (o.kind == "adam" || o.kind == "adamw" || o.kind == "lamb") return 2;
  return (o.kind == "sgd" || o.kind == "lars") && o.momentum != 0.0 ? 1 : 0;
}

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
    } else if (auto* lb = dynamic_cast<const layerwise::LambState*>(s)) {
      add(lb->exp_avg());
      add(lb->exp_avg_sq());
    } else if (auto* ls = dynamic_cast<const layerwise::LarsState*>(s)) {
      add(ls->momentum_buffer());
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

// ---- precision

Precision parse_precision(const std::string& name) {
  if (name == "fp32" || name == "float32") return Precision::kFP32;
  if (name == "bf16" || name == "bfloat16") return Precision::kBF16;
  if (name == "fp16" || name == "float16" || name == "half") return Precision::kFP16;
  throw std::invalid_argument("unknown precision '" + name + "' (use fp32, bf16 or fp16)");
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kBF16: return "bf16";
    case Precision::kFP16: return "fp16";
    default: return "fp32";
  }
}

c10::ScalarType compute_dtype(Precision p) {
  switch (p) {
    case Precision::kBF16: return at::kBFloat16;
    case Precision::kFP16: return at::kHalf;
    default: return at::kFloat;
  }
}

void validate(const LossScalerOptions& o) {
  if (!(o.init_scale > 0.0) || !std::isfinite(o.init_scale))
    throw std::invalid_argument("loss scale: init_scale must be positive");
  if (!(o.growth_factor > 1.0)) throw std::invalid_argument("loss scale: growth_factor must be > 1");
  if (!(o.backoff_factor > 0.0 && o.backoff_factor < 1.0))
    throw std::invalid_argument("loss scale: backoff_factor must be in (0, 1)");
  if (o.growth_interval < 1) throw std::invalid_argument("loss scale: growth_interval must be >= 1");
  if (!(o.min_scale > 0.0) || o.min_scale > o.init_scale) {
    throw std::invalid_argument("loss scale: min_scale must be positive and at most init_scale");
  }
}

LossScaler::LossScaler(bool dynamic, LossScalerOptions o)
    : dynamic_(dynamic), o_(o), scale_(dynamic ? o.init_scale : 1.0) {
  if (dynamic) validate(o_);
}

void LossScaler::update(bool found_inf) {
  if (!dynamic_) return;
  if (found_inf) {
    ++skipped_;
    good_ = 0;
    scale_ = std::max(o_.min_scale, scale_ * o_.backoff_factor);
  } else if (++good_ % o_.growth_interval == 0) {
    // Stays finite in fp32 arithmetic (GradScaler's cap).
    scale_ = std::min(scale_ * o_.growth_factor, 3.0e38);
  }
}

// ---- MixedPrecisionOptimizer

MixedPrecisionOptimizer::MixedPrecisionOptimizer(std::vector<at::Tensor> params, Precision p, const OptimizerOptions& o,
                                                 const LossScalerOptions& so, CommPtr comm)
    : precision_(p), params_(std::move(params)), scaler_(p == Precision::kFP16, so) {
  validate(o);
  if (precision_ == Precision::kFP32) {
    optim_ = make_optimizer(params_, o);
    return;
  }
  torch::NoGradGuard ng;
  for (auto& q : params_) {
    if (!at::isFloatingType(q.scalar_type()))
      throw std::invalid_argument("mixed precision: parameters must be floating point");
    auto m = q.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    if (comm) comm->broadcast(m, 0);
    m.set_requires_grad(true);
    masters_.push_back(m);
  }
  optim_ = make_optimizer(masters_, o);
}

MixedPrecisionOptimizer::~MixedPrecisionOptimizer() = default;

at::Tensor MixedPrecisionOptimizer::scale_loss(const at::Tensor& loss) const {
  return scaler_.dynamic() ? loss * scaler_.scale() : loss;
}

void MixedPrecisionOptimizer::set_model_parallel(std::vector<bool> sharded, CommPtr tp, CommPtr pp) {
  if (sharded.size() != params_.size()) {
    throw std::invalid_argument("MixedPrecisionOptimizer::set_model_parallel: " + std::to_string(sharded.size()) +
                                " flags for " + std::to_string(params_.size()) + " parameters");
  }
  if (dynamic_cast<const layerwise::Optimizer*>(optim_.get()) && tp && tp->size() > 1) {
    LayerwiseLayout L;  // the optimizer's tensors are whole parameters (or their masters)
    const auto& ours = masters_.empty() ? params_ : masters_;
    for (size_t i = 0; i < ours.size(); ++i) {
      L.segments.push_back({{0, ours[i].numel(), static_cast<int64_t>(i)}});
      L.dims.push_back(ours[i].dim());
    }
    L.reduce = shard_norm_reducer(nullptr, tp, sharded);
    set_layerwise_layout(*optim_, std::move(L));
  }
  sharded_ = std::move(sharded);
  mp_tp_ = std::move(tp);
  mp_pp_ = std::move(pp);
  model_parallel_ = true;
}

double MixedPrecisionOptimizer::global_squares(const at::Tensor& sq_sharded, const at::Tensor& sq_other) const {
  // One float64 pair per reduction (the communicators take tensors on their device).
  auto dev = params_.empty() ? at::Device(at::kCPU) : params_[0].device();
  auto sh = sq_sharded.to(dev, at::kDouble).reshape({1}).clone();
  if (mp_tp_ && mp_tp_->size() > 1) mp_tp_->allreduce(sh, ReduceOp::kSum);
  auto total = sh + sq_other.to(dev, at::kDouble).reshape({1});
  if (mp_pp_ && mp_pp_->size() > 1) mp_pp_->allreduce(total, ReduceOp::kSum);
  return total.item<double>();
}

bool MixedPrecisionOptimizer::step(double max_grad_norm, double given_norm) {
  torch::NoGradGuard ng;
  const double extra = std::exchange(extra_sq_, 0.0);
  if (precision_ == Precision::kFP32) {
    if (max_grad_norm > 0 && (model_parallel_ || given_norm >= 0 || extra > 0)) {
      if (given_norm >= 0) {
        last_norm_ = given_norm;
      } else {
        const auto opts = (params_.empty() ? at::TensorOptions() : params_[0].options()).dtype(at::kDouble);
        auto sh = at::zeros({}, opts), other = at::zeros({}, opts);
        for (size_t i = 0; i < params_.size(); ++i) {
          const auto& g = params_[i].grad();
          if (g.defined()) (model_parallel_ && sharded_[i] ? sh : other) += g.to(at::kDouble).pow(2).sum();
        }
        last_norm_ = std::sqrt(global_squares(sh, other) + extra);
      }
      const double coef = max_grad_norm / (last_norm_ + 1e-6);
      if (coef < 1.0)
        for (auto& p : params_)
          if (p.grad().defined()) p.mutable_grad().mul_(coef);
    } else {
      last_norm_ = max_grad_norm > 0 ? torch::nn::utils::clip_grad_norm_(params_, max_grad_norm) : -1.0;
    }
    optim_->step();
    return true;
  }
  const auto dtype = compute_dtype(precision_);
  const double inv = 1.0 / scaler_.scale();
  // fp32 gradients for the masters, unscaled; one sum of squares gives both the overflow
  // check and the norm for clipping (none when the caller gives the norm).
  auto sq = at::zeros({}, masters_.empty() ? at::TensorOptions(at::kDouble) : masters_[0].options().dtype(at::kDouble));
  auto sq_sharded = at::zeros_like(sq);  // model parallelism: the shards' part of sq
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& g = params_[i].grad();
    if (!g.defined()) {
      masters_[i].mutable_grad() = at::Tensor();
      continue;
    }
    if (g.scalar_type() != dtype) {
      throw std::runtime_error(std::string("mixed precision: a gradient is ") + c10::toString(g.scalar_type()) +
                               ", expected " + precision_name(precision_) +
                               "; convert the model with module->to(dtype) after building the MixedPrecisionOptimizer");
    }
    auto g32 = g.to(at::kFloat);
    if (inv != 1.0) g32.mul_(inv);
    if (given_norm < 0) (model_parallel_ && sharded_[i] ? sq_sharded : sq) += g32.to(at::kDouble).pow(2).sum();
    masters_[i].mutable_grad() = g32;
  }
  const double norm = given_norm >= 0
                          ? given_norm
                          : std::sqrt((model_parallel_ ? global_squares(sq_sharded, sq) : sq.item<double>()) + extra);
  bool found_inf = !std::isfinite(norm);
  scaler_.update(found_inf);
  if (found_inf) {
    if (!scaler_.dynamic()) {
      throw std::runtime_error(std::string("the gradient norm is not finite in ") + precision_name(precision_) +
                               "; lower the learning rate or use fp32");
    }
    for (auto& m : masters_) m.mutable_grad() = at::Tensor();
    last_norm_ = norm;
    return false;
  }
  last_norm_ = max_grad_norm > 0 ? norm : -1.0;
  if (max_grad_norm > 0) {
    double coef = max_grad_norm / (norm + 1e-6);
    if (coef < 1.0)
      for (auto& m : masters_)
        if (m.grad().defined()) m.mutable_grad().mul_(coef);
  }
  optim_->step();
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].detach().copy_(masters_[i]);
    masters_[i].mutable_grad() = at::Tensor();  // the fp32 gradients live only inside step()
  }
  return true;
}

void MixedPrecisionOptimizer::zero_grad() {
  for (auto& q : params_) {
    auto& g = q.mutable_grad();
    if (g.defined()) g.zero_();
  }
}

void MixedPrecisionOptimizer::set_lr(double lr) {
  for (auto& g : optim_->param_groups()) g.options().set_lr(lr);
}

int64_t MixedPrecisionOptimizer::master_bytes() const {
  int64_t n = 0;
  for (auto& m : masters_) n += m.numel() * m.element_size();
  return n;
}

int64_t MixedPrecisionOptimizer::optimizer_state_bytes() const { return tandem::optimizer_state_bytes(*optim_); }

}  // namespace tandem
