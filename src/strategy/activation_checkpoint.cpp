#include "tandem/activation_checkpoint.h"

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <stdexcept>

#include "strategy/module_wrapper.h"
#include "tandem/moe.h"

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

std::atomic<int64_t> g_recompute_ns{0};

// What backward needs besides the saved inputs: the segment, its parameters (in the order of the
// node's inputs) and the RNG states before its forward. The parameters are not saved variables:
// ZeRO-3 frees and gathers their storage between forward and backward, which a saved variable's
// version check would take for a modification.
struct SegmentState : torch::CustomClassHolder {
  MultiSegmentFn fn;
  std::vector<at::Tensor> params;
  at::Tensor cpu_rng, device_rng;
};

// The RNG states of a segment's first forward, set for its recomputation and restored after it:
// the recomputation draws what the first forward drew (dropout's mask), and the generators go on
// from where they were.
class ReplayRng {
 public:
  ReplayRng(const SegmentState& s, const c10::Device& device) : cpu_(generator_of(c10::kCPU)) {
    cpu_now_ = get_rng(cpu_);
    set_rng(cpu_, s.cpu_rng);
    if (s.device_rng.defined()) {
      dev_ = generator_of(device);
      dev_now_ = get_rng(dev_);
      set_rng(dev_, s.device_rng);
    }
  }
  ~ReplayRng() {
    set_rng(cpu_, cpu_now_);
    if (dev_now_.defined()) set_rng(dev_, dev_now_);
  }
  ReplayRng(const ReplayRng&) = delete;
  ReplayRng& operator=(const ReplayRng&) = delete;

 private:
  at::Generator cpu_, dev_;
  at::Tensor cpu_now_, dev_now_;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, MultiSegmentFn fn, at::TensorList inputs,
                            at::TensorList params, bool draws) {
    auto state = c10::make_intrusive<SegmentState>();
    state->fn = std::move(fn);
    state->params = params.vec();
    auto cpu = generator_of(c10::kCPU);
    if (draws) state->cpu_rng = get_rng(cpu);
    if (draws && inputs[0].is_cuda()) {
      auto dev = generator_of(inputs[0].device());
      state->device_rng = get_rng(dev);
    }
    at::Tensor out;
    {
      at::NoGradGuard no_grad;
      out = state->fn(inputs.vec());
      // A view made without grad mode (Flatten, a reshape) may not become the output of a
      // node: it would share the input's version and base. Such outputs are small; copy them.
      if (out.is_view()) out = out.clone();
    }
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["segment"] = c10::IValue::make_capsule(state);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto state = c10::static_intrusive_pointer_cast<SegmentState>(ctx->saved_data["segment"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> xs;
    std::vector<at::Tensor> wrt;  // what gets a gradient: the inputs that need one, the parameters
    for (const auto& s : saved) {
      xs.push_back(s.detach());
      if (s.requires_grad()) wrt.push_back(xs.back().requires_grad_(true));
    }
    at::Tensor out;
    {
      const auto start = std::chrono::steady_clock::now();
      std::optional<ReplayRng> replay;
      if (state->cpu_rng.defined()) replay.emplace(*state, saved[0].device());
      at::AutoGradMode grad_on(true);
      out = state->fn(xs);
      g_recompute_ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    }
    // The parameters of the recorded node: whatever of them the recomputation used gets its
    // gradient; the others none.
    wrt.insert(wrt.end(), state->params.begin(), state->params.end());
    // fn, inputs..., params..., draws
    torch::autograd::variable_list result(1 + saved.size() + state->params.size() + 1);
    if (!out.requires_grad() || wrt.empty()) return result;
    auto grads = torch::autograd::grad({out}, wrt, {grad_out[0]}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    size_t k = 0;
    for (size_t i = 0; i < saved.size(); ++i)
      if (saved[i].requires_grad()) result[1 + i] = grads[k++];
    for (size_t i = 0; i < state->params.size(); ++i) result[1 + saved.size() + i] = grads[k++];
    return result;
  }
};

}  // namespace

at::Tensor checkpoint_many(const MultiSegmentFn& fn, const std::vector<at::Tensor>& inputs,
                           const std::vector<at::Tensor>& params, bool draws) {
  if (inputs.empty()) throw std::invalid_argument("tandem::checkpoint_many: no inputs given");
  if (!at::GradMode::is_enabled()) return fn(inputs);
  std::vector<at::Tensor> trainable;
  for (const auto& p : params) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  bool any_input_grad = false;
  for (const auto& x : inputs) any_input_grad = any_input_grad || x.requires_grad();
  if (!any_input_grad && trainable.empty()) {  // nothing to differentiate: no node
    at::NoGradGuard no_grad;
    return fn(inputs);
  }
  return CheckpointFunction::apply(fn, at::TensorList(inputs), at::TensorList(trainable), draws);
}

at::Tensor checkpoint(const SegmentFn& fn, const at::Tensor& input, const std::vector<at::Tensor>& params) {
  return checkpoint_many([fn](const std::vector<at::Tensor>& in) { return fn(in[0]); }, {input}, params);
}

double recompute_seconds() { return static_cast<double>(g_recompute_ns.load()) * 1e-9; }

int64_t recompute_selectively(const torch::nn::Sequential& model) {
  int64_t n = 0;
  std::string kinds;
  for (const auto& child : model->children()) {
    if (auto* layer = dynamic_cast<SelectiveRecompute*>(child.get())) {
      layer->recompute_selectively(true);
      ++n;
    }
    kinds += (kinds.empty() ? "" : ", ") + child->name();
  }
  if (n == 0) {
    throw std::invalid_argument(
        "--activation-checkpointing selective recomputes the attention core, RMSNorms and SwiGLU activations of "
        "transformer layers (Tandem's transformer blocks, Llama decoder layers) and keeps their projections' "
        "outputs; this model (" +
        kinds +
        ") has no such layer, and its activation functions' outputs are the next layer's saved inputs, so "
        "there is nothing to free without recomputing its matrix multiplies: use --activation-checkpointing every "
        "or N");
  }
  return n;
}

CheckpointedImpl::CheckpointedImpl(torch::nn::AnyModule inner) : inner_(std::move(inner)) {
  if (inner_.is_empty()) throw std::invalid_argument("tandem::Checkpointed: no module given");
  auto m = inner_.ptr();
  detail::adopt_members(*this, *m);
  Module::train(m->is_training());
  params_ = parameters();
  auto subs = modules(/*include_self=*/false);
  subs.push_back(m);  // the wrapped module itself is not among its adopted children
  for (auto& sub : subs) {
    if (auto* layer = dynamic_cast<moe::ExpertParallel*>(sub.get()))
      for (auto& e : layer->local_experts())
        for (auto& p : e.module->parameters()) params_.push_back(p);
  }
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
  if (text == "selective") {
    a.mode = ActivationCheckpointing::Mode::kSelective;
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
                                "': use none, every, selective (the attention core and element-wise ops of every "
                                "transformer layer), or N (a positive number of layers to recompute)");
  }
  a.mode = ActivationCheckpointing::Mode::kFirst;
  a.layers = n;
  return a;
}

std::string to_string(const ActivationCheckpointing& a) {
  switch (a.mode) {
    case ActivationCheckpointing::Mode::kNone: return "none";
    case ActivationCheckpointing::Mode::kEvery: return "every";
    case ActivationCheckpointing::Mode::kSelective: return "selective";
    case ActivationCheckpointing::Mode::kFirst: return std::to_string(a.layers);
  }
  return "none";
}

torch::nn::Sequential checkpoint_sequential(const torch::nn::Sequential& model, const ActivationCheckpointing& policy,
                                            const std::vector<int64_t>& layers_per_stage) {
  if (policy.mode == ActivationCheckpointing::Mode::kSelective) {  // inside the layers: none wrapped
    recompute_selectively(model);
    return model;
  }
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
