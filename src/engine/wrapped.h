// Interfaces a model's module implements, found through the stand-ins the strategies wrap it in
// (private to src/engine).
#pragma once

#include <torch/nn/module.h>

#include "tandem/activation_checkpoint.h"
#include "tandem/zero.h"

namespace tandem::engine {

// `m` as a T, or the module it wraps as a T: activation checkpointing's Checkpointed and ZeRO-3's
// ShardedUnit adopt the wrapped module's children and parameters under the same names, but not
// the module itself, so what it implements is found here. Null when neither is a T.
template <typename T>
const T* as_or_wrapped(torch::nn::Module& m) {
  if (const auto* t = dynamic_cast<const T*>(&m)) return t;
  if (auto* c = m.as<CheckpointedImpl>()) return dynamic_cast<const T*>(c->inner().ptr().get());
  if (auto* u = m.as<ShardedUnitImpl>()) return dynamic_cast<const T*>(u->inner().ptr().get());
  return nullptr;
}

}  // namespace tandem::engine
