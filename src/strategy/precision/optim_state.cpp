// Reading and replacing one parameter's LibTorch optimizer state (checkpoints), and restoring
// a loss scaler. LibTorch keys Optimizer::state() by the parameter's TensorImpl.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <stdexcept>

#include "strategy/precision/layerwise.h"
#include "tandem/optim.h"
#include "tandem/precision.h"

namespace tandem {
namespace {

at::Tensor slot(const ParamOptimizerState& s, const char* name, const at::Tensor& param, const char* opt) {
  auto it = s.slots.find(name);
  if (it == s.slots.end() || !it->second.defined()) {
    throw std::invalid_argument(std::string(opt) + " state needs '" + name + "'");
  }
  if (it->second.numel() != param.numel()) {
    throw std::invalid_argument(std::string(opt) + " state '" + name + "' has " + std::to_string(it->second.numel()) +
                                " elements, the parameter " + std::to_string(param.numel()));
  }
  return it->second.detach().to(param.options()).reshape(param.sizes()).clone();
}

}  // namespace

ParamOptimizerState get_param_state(const torch::optim::Optimizer& opt, const at::Tensor& param) {
  ParamOptimizerState out;
  auto it = opt.state().find(param.unsafeGetTensorImpl());
  if (it == opt.state().end()) return out;
  const auto* s = it->second.get();
  if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
    out.slots["exp_avg"] = a->exp_avg();
    out.slots["exp_avg_sq"] = a->exp_avg_sq();
    out.step = a->step();
  } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
    out.slots["exp_avg"] = w->exp_avg();
    out.slots["exp_avg_sq"] = w->exp_avg_sq();
    out.step = w->step();
  } else if (auto* g = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
    if (g->momentum_buffer().defined()) out.slots["momentum_buffer"] = g->momentum_buffer();
  } else if (auto* lb = dynamic_cast<const layerwise::LambState*>(s)) {
    out.slots["exp_avg"] = lb->exp_avg();
    out.slots["exp_avg_sq"] = lb->exp_avg_sq();
    out.step = lb->step();
  } else if (auto* ls = dynamic_cast<const layerwise::LarsState*>(s)) {
    out.slots["momentum_buffer"] = ls->momentum_buffer();
  } else {
    throw std::invalid_argument("get_param_state: only SGD, Adam, AdamW, LARS and LAMB state is supported");
  }
  return out;
}

void set_param_state(torch::optim::Optimizer& opt, const at::Tensor& param, const ParamOptimizerState& s) {
  void* key = param.unsafeGetTensorImpl();
  if (s.slots.empty()) {
    opt.state().erase(key);
    return;
  }
  if (dynamic_cast<torch::optim::AdamW*>(&opt)) {
    auto st = std::make_unique<torch::optim::AdamWParamState>();
    st->step(s.step);
    st->exp_avg(slot(s, "exp_avg", param, "AdamW"));
    st->exp_avg_sq(slot(s, "exp_avg_sq", param, "AdamW"));
    opt.state()[key] = std::move(st);
  } else if (dynamic_cast<torch::optim::Adam*>(&opt)) {
    auto st = std::make_unique<torch::optim::AdamParamState>();
    st->step(s.step);
    st->exp_avg(slot(s, "exp_avg", param, "Adam"));
    st->exp_avg_sq(slot(s, "exp_avg_sq", param, "Adam"));
    opt.state()[key] = std::move(st);
  } else if (dynamic_cast<torch::optim::SGD*>(&opt)) {
    auto st = std::make_unique<torch::optim::SGDParamState>();
    st->momentum_buffer(slot(s, "momentum_buffer", param, "SGD"));
    opt.state()[key] = std::move(st);
  } else if (dynamic_cast<layerwise::Lamb*>(&opt)) {
    auto st = std::make_unique<layerwise::LambState>();
    st->step(s.step);
    st->exp_avg(slot(s, "exp_avg", param, "LAMB"));
    st->exp_avg_sq(slot(s, "exp_avg_sq", param, "LAMB"));
    opt.state()[key] = std::move(st);
  } else if (dynamic_cast<layerwise::Lars*>(&opt)) {
    auto st = std::make_unique<layerwise::LarsState>();
    st->momentum_buffer(slot(s, "momentum_buffer", param, "LARS"));
    opt.state()[key] = std::move(st);
  } else {
    throw std::invalid_argument("set_param_state: only SGD, Adam, AdamW, LARS and LAMB state is supported");
  }
}

void LossScaler::restore(double scale, int64_t overflow_free_steps, int64_t skipped_steps) {
  if (!(scale > 0.0)) throw std::invalid_argument("LossScaler::restore: the scale must be positive");
  if (dynamic_) scale_ = scale;
  good_ = overflow_free_steps;
  skipped_ = skipped_steps;
}

void reset_param_state(torch::optim::Optimizer& opt, const at::Tensor& param, const std::vector<std::string>& slots,
                       int64_t step) {
  ParamOptimizerState s;
  s.step = step;
  for (const auto& k : slots) s.slots[k] = at::zeros_like(param);
  set_param_state(opt, param, s);
}

}  // namespace tandem
