// Activation checkpointing (recomputation, Chen et al. 2016; torch.utils.checkpoint, Megatron's
// --recompute-granularity full): a segment's forward runs without keeping its activations, only
// its input; backward runs the segment again, with the random-number state of the first run
// (so dropout draws the same mask), and back-propagates through it. Memory: one input per
// segment instead of every intermediate; time: one more forward per segment.
//
// The segment's parameters are inputs of the recorded node, so their gradients arrive through
// the ordinary autograd graph: DDP's and ZeRO's gradient hooks fire as without checkpointing,
// ZeRO-3 gathers the segment's unit again when its output's gradient arrives (before the
// recomputation), and tensor-parallel layers repeat their forward collectives on every tp rank
// in the same order. A segment with batch normalisation updates its running statistics twice per
// step (as in PyTorch).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tandem {

using SegmentFn = std::function<at::Tensor(const at::Tensor&)>;

// fn(input), checkpointed. `params`: the tensors fn reads that need gradients (the segment's
// parameters). Without grad mode (inference) it is fn(input).
at::Tensor checkpoint(const SegmentFn& fn, const at::Tensor& input, const std::vector<at::Tensor>& params);

// A module whose forward is checkpointed. It takes the wrapped module's children, parameters
// and buffers as its own, under the same names, so the model keeps its parameter names
// (checkpoints, ZeRO-3 units and tensor-parallel conversions see the same model), and train()
// and eval() reach the wrapped module.
class CheckpointedImpl : public torch::nn::Module {
 public:
  explicit CheckpointedImpl(torch::nn::AnyModule inner);
  at::Tensor forward(const at::Tensor& x);
  void train(bool on = true) override;
  const torch::nn::AnyModule& inner() const { return inner_; }

 private:
  torch::nn::AnyModule inner_;
  std::vector<at::Tensor> params_;  // the wrapped module's (the same tensors), collected once
};
TORCH_MODULE(Checkpointed);

// Which layers (children of a Sequential, or of each pipeline stage) are checkpointed:
// none; every one; or the first N of the model (of each stage with a pipeline), Megatron's
// "block" method: fewer recomputations, less memory saved.
struct ActivationCheckpointing {
  enum class Mode { kNone, kEvery, kFirst };
  Mode mode = Mode::kNone;
  int64_t layers = 0;  // kFirst: N >= 1
  bool enabled() const { return mode != Mode::kNone; }
};
// "none" | "every" | "N" (a positive integer); anything else throws std::invalid_argument.
ActivationCheckpointing parse_activation_checkpointing(const std::string& text);
std::string to_string(const ActivationCheckpointing& a);

// The same Sequential (same children under the same names) with the children in [begin, end)
// chosen by `policy` wrapped in Checkpointed: the first N of the range, or all of it. Throws
// std::invalid_argument when N exceeds the range's layers.
torch::nn::Sequential checkpoint_sequential(const torch::nn::Sequential& model, const ActivationCheckpointing& policy,
                                            const std::vector<int64_t>& layers_per_stage = {});

}  // namespace tandem
