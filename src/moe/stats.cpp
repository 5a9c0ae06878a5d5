// The MoE layer's small shared pieces: its configuration's parsing and checks, this thread's
// statistics and the weight of the auxiliary losses' gradients (tandem/moe.h).
#include <cmath>
#include <stdexcept>
#include <string>

#include "tandem/moe.h"

namespace tandem::moe {

namespace {

// Per thread: replicas of one process (the thread backend) each run their own layers and steps.
thread_local MoeStats t_stats;
thread_local double t_aux_grad_scale = 1.0;

void check_positive(int64_t v, const char* field) {
  if (v <= 0)
    throw std::invalid_argument(std::string("MoeConfig.") + field + " must be positive, got " + std::to_string(v));
}

void check_non_negative(double v, const char* field) {
  if (!(v >= 0.0) || !std::isfinite(v)) {
    throw std::invalid_argument(std::string("MoeConfig.") + field + " must be a finite number >= 0, got " +
                                std::to_string(v));
  }
}

}  // namespace

AuxLossForm parse_aux_loss_form(const std::string& name) {
  if (name == "pooled") return AuxLossForm::kPooled;
  if (name == "per-layer") return AuxLossForm::kPerLayer;
  throw std::invalid_argument("unknown load-balancing loss form '" + name + "'; choose pooled or per-layer");
}

const char* to_string(AuxLossForm f) {
  switch (f) {
    case AuxLossForm::kPooled: return "pooled";
    case AuxLossForm::kPerLayer: return "per-layer";
  }
  return "?";
}

void validate(const MoeConfig& c) {
  check_positive(c.hidden_size, "hidden_size");
  check_positive(c.intermediate_size, "intermediate_size");
  check_positive(c.num_experts, "num_experts");
  if (c.top_k < 1 || c.top_k > c.num_experts) {
    throw std::invalid_argument("MoeConfig.top_k must lie in [1, num_experts = " + std::to_string(c.num_experts) +
                                "], got " + std::to_string(c.top_k));
  }
  check_non_negative(c.aux_loss_coef, "aux_loss_coef");
  check_non_negative(c.z_loss_coef, "z_loss_coef");
  check_non_negative(c.capacity_factor, "capacity_factor");
}

MoeStats moe_stats() { return t_stats; }
void reset_moe_stats() { t_stats = MoeStats{}; }
MoeStats& mutable_moe_stats() { return t_stats; }

void set_aux_grad_scale(double scale) {
  if (!std::isfinite(scale)) {
    throw std::invalid_argument("set_aux_grad_scale: the scale must be finite, got " + std::to_string(scale));
  }
  t_aux_grad_scale = scale;
}
double aux_grad_scale() { return t_aux_grad_scale; }

}  // namespace tandem::moe
