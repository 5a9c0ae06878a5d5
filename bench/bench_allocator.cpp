// The CNN's forward+backward (batch 96, one thread) with glibc malloc as it comes and with
// tandem::tune_allocator(), after a history that moves malloc's dynamic mmap threshold:
//   fresh    nothing before;
//   threads  the MLP at batch 48 and 192 on two threads first (as `tandem plan --calibrate` does);
//   mlp      the MLP at batch 48 and 192 on one thread first.
// Prints the median step and the minor page faults per step. Usage:
//   bench_allocator [fresh|threads|mlp] [tuned|system]
// Run each pair in fresh processes (malloc's state is the subject): see docs/BENCHMARKS.md.
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "tandem/data.h"
#include "tandem/models.h"
#include "tandem/runtime.h"

int main(int argc, char** argv) {
  const std::string history = argc > 1 ? argv[1] : "fresh";
  const std::string malloc_mode = argc > 2 ? argv[2] : "tuned";
  if (history != "fresh" && history != "threads" && history != "mlp") {
    std::fprintf(stderr, "usage: bench_allocator [fresh|threads|mlp] [tuned|system]\n");
    return 2;
  }
  if (malloc_mode == "tuned" && !tandem::tune_allocator()) std::fprintf(stderr, "tune_allocator: not applied\n");
  at::set_num_threads(1);
  at::set_num_interop_threads(1);
  torch::manual_seed(0);
  const auto test = tandem::data::load_fashion_mnist(tandem::data::kFashionMnistDir, /*train=*/false);
  if (history != "fresh") {
    auto mlp = tandem::models::make_model("mlp");
    for (int64_t b : {48, 192}) {
      if (history == "threads") at::set_num_threads(2);
      auto x = torch::randn({b, 1, 28, 28});
      auto y = torch::randint(0, 10, {b}, torch::kLong);
      for (int i = 0; i < 9; ++i) {
        mlp->zero_grad(false);
        torch::nn::functional::cross_entropy(mlp->forward(x), y).backward();
      }
      at::set_num_threads(1);
    }
  }
  auto model = tandem::models::make_model("cnn");
  const int64_t b = 96;
  auto idx = torch::arange(b, torch::kLong);
  const at::Tensor x = test.images.index_select(0, idx), y = test.labels.index_select(0, idx);
  std::vector<double> ms;
  rusage r0{}, r1{};
  for (int i = 0; i < 32; ++i) {
    if (i == 2) getrusage(RUSAGE_SELF, &r0);
    auto t0 = std::chrono::steady_clock::now();
    model->zero_grad(false);
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    (void)loss.item<double>();
    if (i >= 2) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  getrusage(RUSAGE_SELF, &r1);
  std::sort(ms.begin(), ms.end());
  std::printf("%s %s: median %.1f ms, %ld page faults per step\n", history.c_str(), malloc_mode.c_str(),
              ms[ms.size() / 2], (r1.ru_minflt - r0.ru_minflt) / static_cast<long>(ms.size()));
  return 0;
}
