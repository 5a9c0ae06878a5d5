// How a layer says it can be split over tensor-parallel ranks (tandem/tensor_parallel.h): the
// model describes its layers, the conversion never inspects model types. A Sequential's child
// that implements Parallelizable is replaced by its tensor-parallel form; where that form's
// parameters lie in this layer's is said by tandem::PlacedModule (tandem/placement.h), on the
// form or on its tensor-parallel layers, so checkpoints, export and initialisation follow.
#pragma once

#include <torch/nn/modules/container/any.h>

#include "tandem/comm.h"

namespace tandem::tp {

class Parallelizable {
 public:
  virtual ~Parallelizable() = default;
  // Throws std::invalid_argument naming the size that `tp_size` does not divide. Called for
  // every child before any collective, so that bad input fails at once on every rank.
  virtual void check_tensor_parallel(int tp_size) const = 0;
  // This layer's form over `tp`, cut from its current values for tp's rank (the layer itself
  // when it is replicated).
  virtual torch::nn::AnyModule to_tensor_parallel(const CommPtr& tp) const = 0;
  // Whether a Linear after this layer maps one pooled vector per sequence (a classification
  // head, kept whole on every tp rank) rather than every position's (the LM head, split over
  // the vocabulary).
  virtual bool pools() const { return false; }
};

}  // namespace tandem::tp
