// Mixed precision: the model computes in bf16 or fp16 while the optimizer steps fp32 master
// weights (Micikevicius et al., "Mixed Precision Training"); fp16 also needs dynamic loss
// scaling so that small gradients do not flush to zero. ZeroDataParallel takes a Precision and
// keeps the masters sharded; MixedPrecisionOptimizer gives the same policy to DDP and to one
// worker.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm.h"
#include "tandem/optim.h"

namespace torch::optim {
class Optimizer;
}

namespace tandem {

enum class Precision { kFP32, kBF16, kFP16 };

// "fp32" | "bf16" | "fp16" (also "float32", "bfloat16", "float16"); anything else throws
// std::invalid_argument listing the choices.
Precision parse_precision(const std::string& name);
const char* precision_name(Precision p);
// The dtype the model's parameters, activations and gradients use.
c10::ScalarType compute_dtype(Precision p);

struct LossScalerOptions {
  double init_scale = 65536.0;  // 2^16, as torch.cuda.amp.GradScaler and DeepSpeed
  double growth_factor = 2.0;   // after growth_interval steps without overflow
  double backoff_factor = 0.5;  // on an overflow (the step is skipped)
  int64_t growth_interval = 1000;
  double min_scale = 1.0;  // never back off below this
};

// Dynamic loss scaling. Multiply the loss by scale() before backward; after backward, divide
// the gradients by scale() and call update(found_inf): an overflow skips the step and halves
// the scale, growth_interval good steps in a row double it. Disabled (scale 1, never skips)
// for fp32 and bf16, whose exponent range is fp32's.
class LossScaler {
 public:
  LossScaler(bool dynamic, LossScalerOptions o = {});
  bool dynamic() const { return dynamic_; }
  double scale() const { return scale_; }
  void update(bool found_inf);
  int64_t skipped_steps() const { return skipped_; }
  int64_t overflow_free_steps() const { return good_; }
  // Restores a saved scaler (a checkpoint): the scale and the counts of good and skipped steps.
  void restore(double scale, int64_t overflow_free_steps, int64_t skipped_steps);

 private:
  bool dynamic_;
  LossScalerOptions o_;
  double scale_;
  int64_t good_ = 0, skipped_ = 0;
};

// Throws std::invalid_argument for non-positive or inconsistent scaler options.
void validate(const LossScalerOptions& o);

// Mixed precision for DDP and for one worker. Construct it over the model's parameters while
// they are still fp32 (the masters are copied from them; with `comm`, rank 0's values are
// broadcast so every rank starts from the same masters), then convert the model to
// compute_dtype(p) (module->to(dtype)) and wrap it in DDP if wanted. Per step: backward on
// scale_loss(loss), then step(): gradients are copied to fp32, unscaled, checked for inf/NaN
// (skipping the step and backing off when found), optionally clipped by global norm, stepped,
// and copied back into the low-precision parameters. With Precision::kFP32 it is a thin
// wrapper: the optimizer steps the parameters directly.
class MixedPrecisionOptimizer {
 public:
  MixedPrecisionOptimizer(std::vector<at::Tensor> params, Precision p, const OptimizerOptions& o,
                          const LossScalerOptions& so = {}, CommPtr comm = nullptr);
  ~MixedPrecisionOptimizer();

  at::Tensor scale_loss(const at::Tensor& loss) const;
  // Returns false when the step was skipped (fp16 overflow). max_grad_norm > 0 clips: by
  // `norm` when it is given (>= 0: the caller's global norm, which these parameters are part of),
  // else by the norm of these gradients (global under set_model_parallel, with add_squared_norm's).
  bool step(double max_grad_norm = 0.0, double norm = -1.0);
  void zero_grad();
  void set_lr(double lr);
  double last_grad_norm() const { return last_norm_; }
  const LossScaler& scaler() const { return scaler_; }
  // Restores the loss scaler from a checkpoint.
  void restore_loss_scaler(double scale, int64_t overflow_free_steps, int64_t skipped_steps) {
    scaler_.restore(scale, overflow_free_steps, skipped_steps);
  }
  torch::optim::Optimizer& optimizer() { return *optim_; }
  // Model parallelism: this rank's parameters are part of the model, so the gradient norm that
  // clipping (and fp16's overflow check) uses is a global one: parameter i's squares are summed
  // over `tp` when sharded[i] (a block of a larger tensor), counted once otherwise, and the stage's
  // total is summed over `pp`; LARS and LAMB sum the norms of the sharded parameters over `tp`
  // too. Either communicator may be null (no such split). Collective in step() when
  // max_grad_norm > 0, in mixed precision, or with LARS or LAMB and `tp`.
  void set_model_parallel(std::vector<bool> sharded, CommPtr tp, CommPtr pp);
  // Squares of gradients outside these parameters (expert parallelism's experts, already summed
  // over every rank holding a distinct part of them), added to the next step's squared norm.
  void add_squared_norm(double sq) { extra_sq_ += sq; }
  // Bytes of the fp32 masters (0 in fp32) and of the optimizer state.
  int64_t master_bytes() const;
  int64_t optimizer_state_bytes() const;

 private:
  Precision precision_;
  std::vector<at::Tensor> params_, masters_;
  std::unique_ptr<torch::optim::Optimizer> optim_;
  LossScaler scaler_;
  double last_norm_ = -1.0;
  std::vector<bool> sharded_;
  CommPtr mp_tp_, mp_pp_;
  bool model_parallel_ = false;
  double extra_sq_ = 0.0;  // add_squared_norm's, for the next step
  // The global sum of squares from this rank's sharded and other gradients' (see above).
  double global_squares(const at::Tensor& sq_sharded, const at::Tensor& sq_other) const;
};

}  // namespace tandem
