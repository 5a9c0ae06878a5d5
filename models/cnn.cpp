// The reference convolutional network for 1x28x28 images, with and without batch norm.
#include "tandem/models.h"

#include <torch/torch.h>

namespace tandem::models {
namespace {

torch::nn::Sequential make_cnn(bool batch_norm) {
  namespace nn = torch::nn;
  nn::Sequential net;
  net->push_back(nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)));
  if (batch_norm) net->push_back(nn::BatchNorm2d(32));
  net->push_back(nn::ReLU());
  net->push_back(nn::MaxPool2d(2));
  net->push_back(nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)));
  if (batch_norm) net->push_back(nn::BatchNorm2d(64));
  net->push_back(nn::ReLU());
  net->push_back(nn::MaxPool2d(2));
  net->push_back(nn::Flatten());
  net->push_back(nn::Linear(64 * 7 * 7, 128));
  net->push_back(nn::ReLU());
  net->push_back(nn::Linear(128, 10));
  return net;
}

}  // namespace

torch::nn::Sequential cnn() { return make_cnn(false); }
torch::nn::Sequential cnn_bn() { return make_cnn(true); }

}  // namespace tandem::models
