// The optimizers every strategy builds (LibTorch's SGD, Adam and AdamW; LARS and LAMB of our
// own), from one description, and the bytes of their state. ZeroDataParallel builds them over
// its shard, MixedPrecisionOptimizer over fp32 master weights, the trainer over the whole model.
// LARS and LAMB need each parameter's whole norm; a strategy whose optimizer tensors are not
// whole parameters says how they are cut with set_layerwise_layout().
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm.h"

namespace torch::optim {
class Optimizer;
}

namespace tandem {

struct OptimizerOptions {
  std::string kind = "adamw";  // sgd | adam | adamw | lars | lamb
  double lr = 1e-3;
  double momentum = 0.0;  // sgd, lars
  bool nesterov = false;  // sgd
  // sgd and adam: L2 added to the gradient; adamw and lamb: decoupled; lars: beta in the
  // trust ratio and the update (You et al. 2017)
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adam, adamw, lamb; eps also lars's
  double trust_coefficient = 0.001;               // lars: eta, the scale of the trust ratio
  // lars, lamb: parameters of dimension <= 1 (biases, norm layers' weights) get no trust ratio
  // and no weight decay, as in Apex's FusedLAMB and timm; true gives them both.
  bool adapt_vectors = false;
};

// Throws std::invalid_argument naming the bad field (unknown kind, negative lr, ...).
void validate(const OptimizerOptions& o);

// SGD, Adam, AdamW (LibTorch's), LARS or LAMB over `params` with these options.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<at::Tensor> params, const OptimizerOptions& o);

// "sgd" | "adam" | "adamw" | "lars" | "lamb": what make_optimizer built (checkpoints record it).
// Throws std::invalid_argument for another optimizer.
std::string optimizer_kind(const torch::optim::Optimizer& opt);

// lars and lamb: the update of each parameter depends on its whole norm.
bool is_layerwise(const OptimizerOptions& o);

// How a LARS or LAMB optimizer's tensors map onto the model's (logical) parameters. Without a
// layout each tensor is one whole parameter held by this rank alone.
struct LayerwiseLayout {
  struct Segment {
    int64_t offset = 0, numel = 0;  // elements of the flattened optimizer tensor
    int64_t param = 0;              // the logical parameter: an index into `dims`
  };
  // Per optimizer tensor (param_groups' order), the pieces of parameters it holds; elements in
  // no segment (padding) are never updated.
  std::vector<std::vector<Segment>> segments;
  std::vector<int64_t> dims;  // per logical parameter: its dimension (<= 1: excluded, see above)
  // Sums a [logical parameters, k] float64 tensor of this rank's partial sums of squares over
  // the ranks that hold pieces of the parameters, in place. Collective (called once per step on
  // every rank); null: every parameter is whole here.
  std::function<void(at::Tensor&)> reduce;
};
// Installs `layout` in an optimizer from make_optimizer(lars|lamb). Throws std::invalid_argument
// for another optimizer or a segment outside its tensor or parameter list.
void set_layerwise_layout(torch::optim::Optimizer& opt, LayerwiseLayout layout);
// The reducer of a layout whose parameters are chunked over `dp` (pieces summed) and, where
// tp_sharded[i], split over `tp` (summed; the other parameters are the same on every tp rank
// and taken from tp rank 0). One all-reduce per group; either group may be null.
std::function<void(at::Tensor&)> shard_norm_reducer(CommPtr dp, CommPtr tp, std::vector<bool> tp_sharded);

// Bytes of the tensors in an optimizer's state (SGD momentum buffers, Adam moments, ...).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt);

// How many parameter-sized state tensors the optimizer keeps: Adam/AdamW/LAMB 2, SGD or LARS
// with momentum 1, without 0 (the "K" of the ZeRO paper's memory model, in elements).
int optimizer_state_slots(const OptimizerOptions& o);

// One parameter's optimizer state as named tensors: "exp_avg" and "exp_avg_sq" (Adam, AdamW,
// LAMB), "momentum_buffer" (SGD, LARS); `step` is the per-parameter step count of Adam and LAMB
// (0 for SGD and LARS). Empty slots: the optimizer holds no state for it yet (before its first
// step). Used by checkpoints.
struct ParamOptimizerState {
  std::map<std::string, at::Tensor> slots;
  int64_t step = 0;
};
// The state the optimizer keeps for `param` (one of its parameters), tensors shared, not copied.
ParamOptimizerState get_param_state(const torch::optim::Optimizer& opt, const at::Tensor& param);
// Replaces that state with copies of `s` (none when s.slots is empty). Throws
// std::invalid_argument when the slots do not fit the optimizer (Adam and LAMB need exp_avg
// and exp_avg_sq, SGD and LARS momentum_buffer) or a tensor's size differs from the parameter's.
void set_param_state(torch::optim::Optimizer& opt, const at::Tensor& param, const ParamOptimizerState& s);
// Replaces that state by zeros in `slots` with this step count (none when `slots` is empty): the
// state a checkpoint's load then writes into.
void reset_param_state(torch::optim::Optimizer& opt, const at::Tensor& param, const std::vector<std::string>& slots,
                       int64_t step);

}  // namespace tandem
