// Gradient accumulation without a pipeline (--grad-accum K of tandem train, pretrain and
// finetune), over DistributedDataParallel or ZeroDataParallel: one loop and one set of checks
// for both trainers.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace tandem {

class DistributedDataParallel;
class ZeroDataParallel;

// Splits x and y (first dimension) into min(k, rows) micro-batches of near-equal size (the first
// rows % parts one row longer) and calls pass(x_part, y_part, weight) for each, weight = its rows
// / all rows; `pass` runs the forward and the backward of its part of the step's loss (its mean
// loss times `weight`, or a loss it normalises itself) and returns that part. Before every
// micro-batch after the first it calls prepare_forward() of `ddp` and `zero` (either may be
// null). Every backward but the last runs under no_sync() of DDP and of ZeRO stage 1, so they
// communicate once per step; ZeRO-2/3 reduce-scatter after each backward. Returns the step's
// loss: the sum of the parts (detached), pass's own with one part.
using MicroBatchPass = std::function<at::Tensor(const at::Tensor& x, const at::Tensor& y, double weight)>;
at::Tensor accumulate_gradients(const at::Tensor& x, const at::Tensor& y, int64_t k, DistributedDataParallel* ddp,
                                ZeroDataParallel* zero, const MicroBatchPass& pass);

// The checks of --grad-accum k: at least 1, not with a pipeline (pp > 1: its --micro-batches
// accumulate already), and at least k samples per data-parallel replica. Throws
// std::invalid_argument naming what to use instead.
void validate_grad_accum(int64_t k, int pp, int64_t micro_batches, int64_t batch, int dp);

}  // namespace tandem
