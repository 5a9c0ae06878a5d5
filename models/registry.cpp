// Model registry: names used by the CLI and benchmarks -> freshly initialised models.
#include "tandem/models.h"

#include <torch/torch.h>

#include <stdexcept>

namespace tandem::models {

std::vector<std::string> model_names() { return {"mlp", "cnn", "cnn_bn", "transformer_tiny"}; }

torch::nn::Sequential make_model(const std::string& name) {
  if (name == "mlp") return mlp();
  if (name == "cnn") return cnn();
  if (name == "cnn_bn") return cnn_bn();
  if (name == "transformer_tiny") return transformer(transformer_tiny_config());
  std::string known;
  for (const auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("tandem::models::make_model: unknown model '" + name + "'; known models: " + known);
}

int64_t count_parameters(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters(/*recurse=*/true)) n += p.numel();
  return n;
}

}  // namespace tandem::models
