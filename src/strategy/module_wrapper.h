// Wrappers that stand in for a module in a model (Checkpointed, ShardedUnit) take its children,
// parameters and buffers as their own under the same names, so the model's parameter names,
// checkpoints and strategies see the unwrapped model.
#pragma once

#include <torch/nn/module.h>

namespace tandem::detail {

inline void adopt_members(torch::nn::Module& wrapper, torch::nn::Module& inner) {
  for (const auto& c : inner.named_children()) wrapper.register_module(c.key(), c.value());
  for (const auto& p : inner.named_parameters(/*recurse=*/false)) {
    wrapper.register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : inner.named_buffers(/*recurse=*/false)) wrapper.register_buffer(b.key(), b.value());
}

}  // namespace tandem::detail
