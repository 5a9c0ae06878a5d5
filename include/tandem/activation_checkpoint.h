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
//
// Selective recomputation (Megatron-LM's --recompute-granularity selective, torchtitan's op-level
// policy) checkpoints sub-blocks of a transformer layer instead of the whole: the outputs of its
// matrix multiplies (q/k/v/o and MLP projections) are kept, and the cheap parts between them are
// recomputed from those: the attention core (rotary, scores, softmax, attention x values) and
// the element-wise ops whose own saved tensors are more than their input (RMSNorm, SwiGLU's
// silu(gate) * up). A LayerNorm (it keeps only per-token statistics) or a lone GELU (its input is
// what it keeps, its output the next projection's input) saves nothing by recomputation, so they
// run once. A fused attention kernel (scaled_dot_product_attention on the CPU, flash attention)
// keeps no T x T probabilities: its recomputation then frees the rotated and repeated q/k/v and
// the softmax statistics only, so a Llama layer keeps about a quarter less, Tandem's transformer
// block (LayerNorm, GELU) little less; where attention materialises its probabilities (the
// math kernel, attention dropout) they are what it frees.
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

// fn(inputs), checkpointed: a segment of several inputs (the attention core's q, k and v), each
// kept for the recomputation and given its gradient where it needs one. `draws` false: fn draws
// no random numbers, so the generators' states (5 KB on the CPU) are neither kept nor replayed.
using MultiSegmentFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
at::Tensor checkpoint_many(const MultiSegmentFn& fn, const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>& params, bool draws = true);

// Seconds this process has spent recomputing segments in backward (all threads together), for
// the recompute share of a run's report.
double recompute_seconds();

// A layer that recomputes its attention core and element-wise ops in backward when told to
// (selective recomputation): Tandem's transformer block and the Llama decoder layer, dense or
// tensor-parallel.
class SelectiveRecompute {
 public:
  virtual ~SelectiveRecompute() = default;
  virtual void recompute_selectively(bool on) = 0;
};

// A module whose forward is checkpointed. It takes the wrapped module's children, parameters
// and buffers as its own, under the same names, so the model keeps its parameter names
// (checkpoints, ZeRO-3 units and tensor-parallel conversions see the same model), and train()
// and eval() reach the wrapped module. The experts a MoE layer inside keeps apart under expert
// parallelism (moe::ExpertParallel::local_experts, when it is split before the wrapping) are
// inputs of the recomputation too, so their gradients arrive as well.
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
// "block" method: fewer recomputations, less memory saved; or, selective, the sub-blocks above
// of every layer that is a SelectiveRecompute.
struct ActivationCheckpointing {
  enum class Mode { kNone, kEvery, kFirst, kSelective };
  Mode mode = Mode::kNone;
  int64_t layers = 0;  // kFirst: N >= 1
  bool enabled() const { return mode != Mode::kNone; }
};
// "none" | "every" | "selective" | "N" (a positive integer); anything else throws
// std::invalid_argument.
ActivationCheckpointing parse_activation_checkpointing(const std::string& text);
std::string to_string(const ActivationCheckpointing& a);

// The same Sequential (same children under the same names) with the children in [begin, end)
// chosen by `policy` wrapped in Checkpointed: the first N of the range, or all of it. Throws
// std::invalid_argument when N exceeds the range's layers.
torch::nn::Sequential checkpoint_sequential(const torch::nn::Sequential& model, const ActivationCheckpointing& policy,
                                            const std::vector<int64_t>& layers_per_stage = {});

// Turns on selective recomputation in every child of `model` that is a SelectiveRecompute and
// returns how many there are. Throws std::invalid_argument, naming the children's kinds, when
// none is: a model of Linear, convolution and activation layers keeps only what its matrix
// multiplies need (an activation's output is the next layer's input), so it has nothing that
// selective recomputation would free.
int64_t recompute_selectively(const torch::nn::Sequential& model);

}  // namespace tandem
