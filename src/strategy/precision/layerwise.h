// LARS and LAMB as LibTorch optimizers (private to src/strategy/precision/; others reach them
// through tandem/optim.h). Both scale each parameter's update by a trust ratio of whole-parameter
// norms, so a step sums this rank's pieces of those norms, reduces them once through the layout's
// reducer, and only then updates.
#pragma once

#include <torch/optim/optimizer.h>

#include "tandem/optim.h"

namespace tandem::layerwise {

// The options of both algorithms (each reads its own fields; see OptimizerOptions).
struct Options : public torch::optim::OptimizerCloneableOptions<Options> {
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, beta1) = 0.9;
  TORCH_ARG(double, beta2) = 0.999;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(double, trust_coefficient) = 0.001;
  TORCH_ARG(bool, adapt_vectors) = false;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double v) override { lr(v); }
};

struct LambState : public torch::optim::OptimizerCloneableParamState<LambState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
};

struct LarsState : public torch::optim::OptimizerCloneableParamState<LarsState> {
  TORCH_ARG(at::Tensor, momentum_buffer);
};

// The common step: directions, the sums of squares per logical parameter, one reduction, then
// the update of every segment by its parameter's trust ratio.
class Optimizer : public torch::optim::Optimizer {
 public:
  Optimizer(std::vector<at::Tensor> params, const Options& o);
  at::Tensor step(LossClosure closure = nullptr) override;
  void set_layout(LayerwiseLayout layout);

 protected:
  // This tensor's direction before weight decay and trust ratio (advances its state).
  virtual at::Tensor direction(const at::Tensor& p, const at::Tensor& g, const Options& o) = 0;
  // What the trust ratio compares with the weights of an adapted segment (LAMB: the direction
  // plus weight decay, written into `d`; LARS: the gradient).
  virtual at::Tensor measured(const at::Tensor& w, at::Tensor d, const at::Tensor& g, const Options& o) = 0;
  // Updates the segment `w` (or its direction `d`) from its gradient `g`, whether it is adapted,
  // and the whole parameter's norms of the weights and of what measured() gave.
  virtual void update(at::Tensor w, at::Tensor d, const at::Tensor& g, bool adapt, double w_norm, double x_norm,
                      const Options& o) = 0;
  // After every segment of `p` is updated (LARS: the momentum step over the whole tensor).
  virtual void finish(const at::Tensor& p, const at::Tensor& d, const Options& o) = 0;

 private:
  LayerwiseLayout layout_;
  bool has_layout_ = false;
  const LayerwiseLayout& layout();
  at::Device params_device() const;
};

// LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2; as NVIDIA
// Apex's FusedLAMB and timm's Lamb, without their built-in gradient clipping):
//   m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2,   t = t + 1
//   u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd w
//   r = ||w|| / ||u||  (1 when either norm is 0),   w = w - lr r u
// A parameter of dimension <= 1 (unless adapt_vectors) takes r = 1 and wd = 0: Adam's step.
class Lamb final : public Optimizer {
 public:
  using Optimizer::Optimizer;

 private:
  at::Tensor direction(const at::Tensor& p, const at::Tensor& g, const Options& o) override;
  at::Tensor measured(const at::Tensor& w, at::Tensor d, const at::Tensor& g, const Options& o) override;
  void update(at::Tensor w, at::Tensor d, const at::Tensor& g, bool adapt, double w_norm, double d_norm,
              const Options& o) override;
  void finish(const at::Tensor&, const at::Tensor&, const Options&) override {}
};

// LARS (You, Gitman and Ginsburg 2017, "Large Batch Training of Convolutional Networks",
// Algorithm 1, with the global learning rate inside the momentum as there):
//   local_lr = eta ||w|| / (||g|| + wd ||w|| + eps)  (1 when either norm is 0)
//   v = m v + lr local_lr (g + wd w),   w = w - v
// A parameter of dimension <= 1 (unless adapt_vectors) takes local_lr = 1 and wd = 0: SGD with
// momentum.
class Lars final : public Optimizer {
 public:
  using Optimizer::Optimizer;

 private:
  at::Tensor direction(const at::Tensor& p, const at::Tensor& g, const Options& o) override;
  at::Tensor measured(const at::Tensor&, at::Tensor, const at::Tensor& g, const Options&) override { return g; }
  void update(at::Tensor w, at::Tensor d, const at::Tensor& g, bool adapt, double w_norm, double g_norm,
              const Options& o) override;
  void finish(const at::Tensor& p, const at::Tensor& d, const Options& o) override;
};

}  // namespace tandem::layerwise
