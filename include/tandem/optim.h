// The optimizers every strategy builds (LibTorch's own classes), from one description, and
// the bytes of their state. ZeroDataParallel builds them over its shard, MixedPrecisionOptimizer
// over fp32 master weights, the trainer over the whole model.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace tandem {

struct OptimizerOptions {
  std::string kind = "adamw";  // sgd | adam | adamw
  double lr = 1e-3;
  double momentum = 0.0;                          // sgd
  bool nesterov = false;                          // sgd
  double weight_decay = 0.0;                      // sgd and adam: L2 added to the gradient; adamw: decoupled
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adam, adamw
};

// Throws std::invalid_argument naming the bad field (unknown kind, negative lr, ...).
void validate(const OptimizerOptions& o);

// LibTorch's SGD, Adam or AdamW over `params` with these options.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<at::Tensor> params, const OptimizerOptions& o);

// Bytes of the tensors in an optimizer's state (SGD momentum buffers, Adam moments, ...).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt);

// How many parameter-sized state tensors the optimizer keeps: Adam/AdamW 2, SGD with
// momentum 1, plain SGD 0 (the "K" of the ZeRO paper's memory model, in elements).
int optimizer_state_slots(const OptimizerOptions& o);

// One parameter's optimizer state as named tensors: "exp_avg" and "exp_avg_sq" (Adam, AdamW),
// "momentum_buffer" (SGD); `step` is Adam's per-parameter step count (0 for SGD). Empty slots:
// the optimizer holds no state for it yet (before its first step). Used by checkpoints.
struct ParamOptimizerState {
  std::map<std::string, at::Tensor> slots;
  int64_t step = 0;
};
// The state the optimizer keeps for `param` (one of its parameters), tensors shared, not copied.
ParamOptimizerState get_param_state(const torch::optim::Optimizer& opt, const at::Tensor& param);
// Replaces that state with copies of `s` (none when s.slots is empty). Throws
// std::invalid_argument when the slots do not fit the optimizer (Adam needs exp_avg and
// exp_avg_sq, SGD momentum_buffer) or a tensor's size differs from the parameter's.
void set_param_state(torch::optim::Optimizer& opt, const at::Tensor& param, const ParamOptimizerState& s);

}  // namespace tandem
