// The reference multi-layer perceptron.
#include "tandem/models.h"

#include <torch/torch.h>

#include <stdexcept>

namespace tandem::models {

torch::nn::Sequential mlp(int64_t in, const std::vector<int64_t>& hidden, int64_t out) {
  if (in < 1 || out < 1) {
    throw std::invalid_argument("tandem::models::mlp: in and out must be >= 1, got in=" + std::to_string(in) +
                                " out=" + std::to_string(out));
  }
  torch::nn::Sequential net;
  net->push_back(torch::nn::Flatten());
  int64_t width = in;
  for (int64_t h : hidden) {
    if (h < 1) throw std::invalid_argument("tandem::models::mlp: hidden widths must be >= 1, got " + std::to_string(h));
    net->push_back(torch::nn::Linear(width, h));
    net->push_back(torch::nn::ReLU());
    width = h;
  }
  net->push_back(torch::nn::Linear(width, out));
  return net;
}

}  // namespace tandem::models
