// An example Tandem plugin: a model and a dataset registered by name, for
//   tandem train --model path/to/libmynet.so -n 2
// which trains "tiny_mlp" on "blobs" (its default dataset; --dataset chooses another).
#include <ATen/CPUGeneratorImpl.h>
#include <tandem/registry.h>
#include <torch/torch.h>

#include <string>

namespace {

// 784-128-10 with a ReLU between the two Linear layers: any module trains with DDP and ZeRO; a
// Sequential can also be cut into pipeline stages (--pp) and split by tensor parallelism (--tp).
torch::nn::Sequential tiny_mlp() {
  return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 128), torch::nn::ReLU(),
                               torch::nn::Linear(128, 10));
}

// Ten classes of 28x28 single-channel images: a fixed random prototype per class plus unit
// Gaussian noise per pixel, the prototypes faint enough (0.15 per pixel) that the classes
// overlap a little. Generated, not read (the directory is ignored), from LibTorch's own seeded
// generator: every worker and every run gets the same samples.
tandem::DatasetSplits blobs(const std::string& /*dir*/) {
  auto gen = at::detail::createCPUGenerator(/*seed_in=*/20261130);
  const torch::Tensor prototypes = 0.15 * torch::randn({10, 1, 28, 28}, gen);
  auto split = [&](int64_t n) {
    tandem::data::Dataset d;
    d.labels = torch::randint(0, 10, {n}, gen);  // int64
    d.images = prototypes.index_select(0, d.labels) + torch::randn({n, 1, 28, 28}, gen);
    return d;
  };
  tandem::DatasetSplits s;
  s.train = split(2000);
  s.test = split(500);
  return s;
}

}  // namespace

TANDEM_REGISTER_MODEL("tiny_mlp", tiny_mlp, "784-128-10 MLP (example plugin)", "blobs");
TANDEM_REGISTER_DATASET("blobs", blobs,
                        "10 classes of noisy 28x28 prototypes, 2000 training + 500 test samples, generated "
                        "(example plugin)");
TANDEM_PLUGIN()
