#include "strategy/autograd_hooks.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <stdexcept>

namespace tandem::detail {

std::shared_ptr<void> add_post_accumulate_grad_hook(const at::Tensor& param, std::function<void()> fn) {
  if (!param.requires_grad() || !param.is_leaf()) {
    throw std::invalid_argument("gradient hooks need a leaf tensor that requires grad");
  }
  std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(param);
  acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [fn = std::move(fn)](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
        fn();
        return outputs;
      }));
  return acc;
}

std::vector<std::shared_ptr<void>> add_post_accumulate_grad_hooks(const std::vector<at::Tensor>& params,
                                                                  std::function<void(size_t)> fn) {
  std::vector<std::shared_ptr<void>> handles;
  handles.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    handles.push_back(add_post_accumulate_grad_hook(params[i], [fn, i] { fn(i); }));
  }
  return handles;
}

void queue_backward_callback(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

}  // namespace tandem::detail
