// The built-in models in the registry (tandem/registry.h), and the Sequential-only lookups
// that the pipeline, tensor parallelism, the planner and the benchmarks use.
#include <torch/torch.h>

#include <stdexcept>

#include "registry/builtins.h"
#include "tandem/models.h"
#include "tandem/registry.h"

namespace tandem::models {

void register_builtin_models() {
  register_model("mlp", model_factory([] { return mlp(); }), "784-1024-1024-10 MLP (1.9 M parameters)");
  register_model("cnn", model_factory(cnn), "two conv layers, two linear layers, for 28x28 images (422 k parameters)");
  register_model("cnn_bn", model_factory(cnn_bn), "cnn with batch norm after each convolution (422 k parameters)");
  register_model("transformer_tiny", model_factory([] { return transformer(transformer_tiny_config()); }),
                 "causal transformer language model, 2 layers, d_model 64, vocabulary 256 (token ids, not images)");
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& m : registered_models()) names.push_back(m.name);
  return names;
}

torch::nn::Sequential make_model(const std::string& name) {
  auto module = make_registered_model(name);
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module);
  if (!seq) {
    throw std::invalid_argument("model '" + name + "' is a " + module->name() +
                                ", not a torch::nn::Sequential; pipeline and tensor parallelism (and "
                                "tandem::models::make_model) need its factory to return a Sequential");
  }
  return torch::nn::Sequential(seq);
}

int64_t count_parameters(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters(/*recurse=*/true)) n += p.numel();
  return n;
}

}  // namespace tandem::models
