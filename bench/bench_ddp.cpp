// Step time of Tandem DDP on a reference model with synthetic data, for bench/ddp_vs_torch.py.
// Run under mpirun (or alone for one worker):
//   bench_ddp --model mlp|cnn --batch GLOBAL --steps N --warmup W --mode ddp|nocomm|nooverlap
// Prints one JSON line on rank 0: median/mean step ms over the timed steps, and DDP's
// communication accounting. "nocomm": every rank computes its share with no communication
// at all (the ceiling of the speedup on this machine).
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>

#include "tandem/ddp.h"
#include "tandem/models.h"
#include "tandem/runtime.h"

int main(int argc, char** argv) {
  std::string model_name = "cnn", mode = "ddp";
  int64_t batch = 128, steps = 30, warmup = 5, bucket_kb = 25 * 1024, first_kb = 0;  // 0: DDP's automatic choice
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_name = v;
    else if (k == "--mode") mode = v;
    else if (k == "--batch") batch = std::stoll(v);
    else if (k == "--steps") steps = std::stoll(v);
    else if (k == "--warmup") warmup = std::stoll(v);
    else if (k == "--bucket-kb") bucket_kb = std::stoll(v);
    else if (k == "--first-bucket-kb") first_kb = std::stoll(v);
    else {
      std::cerr << "bench_ddp: unknown option " << k << "\n";
      return 2;
    }
  }
  tandem::RuntimeOptions ro;
  ro.threads = 1;
  ro.device = "cpu";
  tandem::Runtime rt(ro);
  auto comm = rt.world();
  const int R = comm->size(), me = comm->rank();
  if (batch % R) {
    std::cerr << "bench_ddp: --batch must be a multiple of the world size\n";
    return 2;
  }
  torch::manual_seed(0);
  auto model = tandem::models::make_model(model_name);
  tandem::DDPOptions o;
  o.communicate = mode != "nocomm";
  o.overlap = mode != "nooverlap";
  o.bucket_cap_bytes = bucket_kb * 1024;
  o.first_bucket_bytes = first_kb * 1024;
  auto ddp = std::make_unique<tandem::DistributedDataParallel>(model.ptr(), comm, o);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const int64_t b = batch / R;
  auto gen = at::detail::createCPUGenerator(1234 + me);
  auto x = torch::randn({b, 1, 28, 28}, gen);
  auto y = torch::randint(0, 10, {b}, gen);

  std::vector<double> ms;
  comm->barrier();
  for (int64_t s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      ddp->reset_stats();
      comm->barrier();
    }
    auto t0 = std::chrono::steady_clock::now();
    ddp->prepare_forward();
    ddp->zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    opt.step();
    if (s >= warmup)
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  comm->barrier();
  // Rank 0 reports the slowest rank's median (a step is as slow as its slowest rank).
  std::sort(ms.begin(), ms.end());
  double median = ms[ms.size() / 2];
  auto t = torch::tensor({median}, torch::kDouble);
  comm->allreduce(t, tandem::ReduceOp::kMax);
  auto st = ddp->stats();
  auto plan = ddp->bucket_plan();
  if (me == 0) {
    double mean = 0;
    for (double v : ms) mean += v;
    mean /= static_cast<double>(ms.size());
    nlohmann::json j = {{"impl", "tandem"},
                        {"model", model_name},
                        {"mode", mode},
                        {"world", R},
                        {"batch", batch},
                        {"steps", steps},
                        {"median_ms", t.item<double>()},
                        {"rank0_mean_ms", mean},
                        {"comm_ms_per_step", 1000.0 * st.comm_seconds / steps},
                        {"exposed_ms_per_step", 1000.0 * st.exposed_seconds / steps},
                        {"hidden_fraction", st.hidden_fraction()},
                        {"buckets", plan.size()}};
    std::cout << j.dump() << std::endl;
  }
  return 0;
}
