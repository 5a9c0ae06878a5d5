// Internal: the two autograd seams every strategy needs, kept in one place because LibTorch
// exposes them only through torch/csrc headers that change between versions.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

namespace tandem::detail {

// Calls `fn` each time autograd has accumulated a gradient into `param.grad()` (once per
// backward pass per parameter). The returned handle keeps the gradient accumulator alive;
// drop it to stop caring (the hook itself stays, so `fn` must tolerate its owner being gone).
std::shared_ptr<void> add_post_accumulate_grad_hook(const at::Tensor& param, std::function<void()> fn);

// add_post_accumulate_grad_hook for every parameter: `fn(i)` runs when params[i]'s gradient
// has been accumulated. Returns the handles, in parameter order.
std::vector<std::shared_ptr<void>> add_post_accumulate_grad_hooks(const std::vector<at::Tensor>& params,
                                                                  std::function<void(size_t)> fn);

// Runs `fn` when the backward pass that is executing now has finished, before backward()
// returns. Only valid from inside a hook that runs during backward.
void queue_backward_callback(std::function<void()> fn);

}  // namespace tandem::detail
