#include "tandem/activation_checkpoint.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <mutex>
#include <stdexcept>

#include "strategy/module_wrapper.h"

namespace tandem {

namespace {

// The default generators and their states: what dropout and the other random ops of a segment
// draw from (the CPU's always, a device's for a segment on it).
at::Generator generator_of(const c10::Device& device) { return at::globalContext().defaultGenerator(device); }
at::Tensor get_rng(at::Generator& g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}
void set_rng(at::Generator& g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

// What backward needs besides the saved input: the segment, its parameters (in the order of the
// node's inputs) and the RNG states before its forward. The parameters are not saved variables:
// ZeRO-3 frees and gathers their storage between forward and backward, which a saved variable's
// version check would take for a modification.
struct SegmentState : torch::CustomClassHolder {
  SegmentFn fn;
  std::vector<at::Tensor> params;
  at::Tensor cpu_rng, device_rng;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, SegmentFn fn, const at::Tensor& input,
                            at::TensorList params) {
    auto state = c10::make_intrusive<SegmentState>();
    state->fn = std::move(fn);
    state->params = params.vec();
    auto cpu = generator_of(c10::kCPU);
    state->cpu_rng = get_rng(cpu);
    if (input.is_cuda()) {
      auto dev = generator_of(input.device());
      state->device_rng = get_rng(dev);
    }
    at::Tensor out;
    {
      at::NoGradGuard no_grad;
      out = state->fn(input);
      // A view made without grad mode (Flatten, a reshape) may not become the output of a
      // node: it would share the input's version and base. Such outputs are small; copy them.
      if (out.is_view()) out = out.clone();
    }
    ctx->save_for_backward({input});
    ctx->saved_data["segment"] = c10::IValue::make_capsule(state);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto state = c10::static_intrusive_pointer_cast<SegmentState>(ctx->saved_data["segment"].toCapsule());
    const at::Tensor saved = ctx->get_saved_variables()[0];
    const bool input_grad = saved.requires_grad();
    at::Tensor x = saved.detach();
    if (input_grad) x.requires_grad_(true);
    // The recomputation draws what the first forward drew; the generators go on from where they
    // were afterwards.
    auto cpu = generator_of(c10::kCPU);
    const at::Tensor cpu_now = get_rng(cpu);
    set_rng(cpu, state->cpu_rng);
    at::Generator dev;
    at::Tensor dev_now;
    if (state->device_rng.defined()) {
      dev = generator_of(saved.device());
      dev_now = get_rng(dev);
      set_rng(dev, state->device_rng);
    }
    at::Tensor out;
    {
      at::AutoGradMode grad_on(true);
      out = state->fn(x);
    }
    set_rng(cpu, cpu_now);
    if (dev_now.defined()) set_rng(dev, dev_now);

    // The parameters of the recorded node: whatever of them the recomputation used gets its
    // gradient; the others none.
    std::vector<at::Tensor> inputs;
    if (input_grad) inputs.push_back(x);
    inputs.insert(inputs.end(), state->params.begin(), state->params.end());
    torch::autograd::variable_list result(2 + state->params.size());  // fn, input, params...
    if (!out.requires_grad() || inputs.empty()) return result;
    auto grads = torch::autograd::grad({out}, inputs, {grad_out[0]}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    size_t k = 0;
    if (input_grad) result[1] = grads[k++];
    for (size_t i = 0; i < state->params.size(); ++i) result[2 + i] = grads[k++];
    return result;
  }
};

}  // namespace

at::Tensor checkpoint(const SegmentFn& fn, const at::Tensor& input, const std::vector<at::Tensor>& params) {
  if (!at::GradMode::is_enabled()) return fn(input);
  std::vector<at::Tensor> trainable;
  for (const auto& p : params) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  if (!input.requires_grad() && trainable.empty()) {  // nothing to differentiate: no node
    at::NoGradGuard no_grad;
    return fn(input);
  }
  return CheckpointFunction::apply(fn, input, at::TensorList(trainable));
}

CheckpointedImpl::CheckpointedImpl(torch::nn::AnyModule inner) : inner_(std::move(inner)) {
  if (inner_.is_empty()) throw std::invalid_argument("tandem::Checkpointed: no module given");
  auto m = inner_.ptr();
  detail::adopt_members(*this, *m);
  Module::train(m->is_training());
  params_ = parameters();
}

at::Tensor CheckpointedImpl::forward(const at::Tensor& x) {
  return checkpoint([this](const at::Tensor& in) { return inner_.forward<at::Tensor>(in); }, x, params_);
}

void CheckpointedImpl::train(bool on) {
  Module::train(on);
  inner_.ptr()->train(on);
}

ActivationCheckpointing parse_activation_checkpointing(const std::string& text) {
  ActivationCheckpointing a;
  if (text == "none" || text.empty()) return a;
  if (text == "every") {
    a.mode = ActivationCheckpointing::Mode::kEvery;
    return a;
  }
  size_t used = 0;
  long long n = 0;
  try {
    n = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || n < 1) {
    throw std::invalid_argument("--activation-checkpointing '" + text +
                                "': use none, every, or N (a positive number of layers to recompute)");
  }
  a.mode = ActivationCheckpointing::Mode::kFirst;
  a.layers = n;
  return a;
}

std::string to_string(const ActivationCheckpointing& a) {
  switch (a.mode) {
    case ActivationCheckpointing::Mode::kNone: return "none";
    case ActivationCheckpointing::Mode::kEvery: return "every";
    case ActivationCheckpointing::Mode::kFirst: return std::to_string(a.layers);
  }
  return "none";
}

torch::nn::Sequential checkpoint_sequential(const torch::nn::Sequential& model, const ActivationCheckpointing& policy,
                                            const std::vector<int64_t>& layers_per_stage) {
  const auto n = static_cast<int64_t>(model->size());
  std::vector<int64_t> ranges = layers_per_stage.empty() ? std::vector<int64_t>{n} : layers_per_stage;
  std::vector<bool> wrap(n, false);
  int64_t begin = 0;
  for (size_t s = 0; s < ranges.size(); ++s) {
    const int64_t len = ranges[s];
    int64_t take = len;
    if (policy.mode == ActivationCheckpointing::Mode::kNone) take = 0;
    if (policy.mode == ActivationCheckpointing::Mode::kFirst) {
      if (policy.layers > len) {
        throw std::invalid_argument(
            "--activation-checkpointing " + std::to_string(policy.layers) + ": " +
            (ranges.size() > 1 ? "pipeline stage " + std::to_string(s) + " has " : "the model has ") +
            std::to_string(len) + " layers; use at most " + std::to_string(len) + ", or every");
      }
      take = policy.layers;
    }
    for (int64_t i = begin; i < begin + take && i < n; ++i) wrap[i] = true;
    begin += len;
  }
  torch::nn::Sequential out;
  const auto names = model->named_children();
  int64_t i = 0;
  for (auto it = model->begin(); it != model->end(); ++it, ++i) {
    const std::string& name = names[i].key();
    if (wrap[i] && !it->ptr()->as<CheckpointedImpl>()) {
      torch::nn::AnyModule wrapped{Checkpointed(*it)};
      out->push_back(name, wrapped);
    } else {
      out->push_back(name, *it);
    }
  }
  out->train(model->is_training());
  return out;
}

}  // namespace tandem
