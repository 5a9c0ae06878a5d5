// Step time, communication and per-rank memory of Tandem's ZeRO stages (and DDP as the
// reference) on a reference model with synthetic data, for bench/zero_vs_torch.py.
// Run under mpirun (or alone for one worker):
//   bench_zero --model mlp|cnn --batch GLOBAL --steps N --warmup W --mode ddp|zero1|zero2|zero3
//              [--optimizer adamw|adam] [--lr 1e-3] [--bucket-kb KB]
// Every mode uses the same optimizer (AdamW by default): DDP with LibTorch's optimizer over
// the full model, ZeRO through ZeroOptions::optimizer over the owned shard.
// Prints one JSON line on rank 0: the slowest rank's median step ms, the Communicator's
// per-operation counters over the timed steps (calls, bytes handed to the operation, engine
// seconds; divided by the steps), and the per-rank memory (ZeroDataParallel::memory() for
// ZeRO; parameters, gradients and optimizer state counted from the tensors for DDP).
// A configuration the library rejects (e.g. a stage it does not have yet) prints
// {"error": "..."} on rank 0 and exits 3.
#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <iostream>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "tandem/ddp.h"
#include "tandem/models.h"
#include "tandem/runtime.h"
#include "tandem/zero.h"
#if __has_include("tandem/optim.h")
#include "tandem/optim.h"  // optimizer_state_bytes() (it moved here from zero.h)
#endif

namespace {

// ZeroDataParallel::forward(x), when the header provides one (stage 3 gathers each unit's
// parameters in it); otherwise the module's own forward.
template <typename Z, typename = void>
struct HasForward : std::false_type {};
template <typename Z>
struct HasForward<Z, std::void_t<decltype(std::declval<Z&>().forward(std::declval<torch::Tensor>()))>>
    : std::true_type {};

// ZeroMemory fields that only newer headers have (stage 3, mixed precision).
template <typename M, typename = void>
struct HasGathered : std::false_type {};
template <typename M>
struct HasGathered<M, std::void_t<decltype(std::declval<M&>().peak_gathered_bytes)>> : std::true_type {};
template <typename M, typename = void>
struct HasMaster : std::false_type {};
template <typename M>
struct HasMaster<M, std::void_t<decltype(std::declval<M&>().master_bytes)>> : std::true_type {};

template <typename Z>
torch::Tensor zero_forward(Z& zero, torch::nn::Sequential& model, const torch::Tensor& x) {
  if constexpr (HasForward<Z>::value) {
    return zero.forward(x);
  } else {
    return model->forward(x);
  }
}

int64_t tensor_bytes(const torch::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

nlohmann::json memory_json(const tandem::ZeroMemory& m) {
  return {{"stage", m.stage},
          {"world_size", m.world_size},
          {"parameters", m.parameters},
          {"parameter_bytes", m.parameter_bytes},
          {"gradient_bytes", m.gradient_bytes},
          {"optimizer_state_bytes", m.optimizer_state_bytes},
          {"total_bytes", m.total()},
          {"model_parameter_bytes", m.model_parameter_bytes},
          {"model_gradient_bytes", m.model_gradient_bytes},
          {"model_optimizer_state_bytes", m.model_optimizer_state_bytes},
          {"model_total_bytes", m.model_total()},
          {"peak_scratch_bytes", m.peak_scratch_bytes}};
}

template <typename M>
void memory_extras(const M& m, nlohmann::json& j) {
  if constexpr (HasGathered<M>::value) j["peak_gathered_bytes"] = m.peak_gathered_bytes;
  if constexpr (HasMaster<M>::value) j["master_bytes"] = m.master_bytes;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_name = "mlp", mode = "zero2", optimizer = "adamw";
  int64_t batch = 128, steps = 30, warmup = 5, bucket_kb = -1;  // -1: each strategy's default
  double lr = 1e-3;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_name = v;
    else if (k == "--mode") mode = v;
    else if (k == "--optimizer") optimizer = v;
    else if (k == "--lr") lr = std::stod(v);
    else if (k == "--batch") batch = std::stoll(v);
    else if (k == "--steps") steps = std::stoll(v);
    else if (k == "--warmup") warmup = std::stoll(v);
    else if (k == "--bucket-kb") bucket_kb = std::stoll(v);
    else {
      std::cerr << "bench_zero: unknown option " << k << "\n";
      return 2;
    }
  }
  if (mode != "ddp" && mode != "zero1" && mode != "zero2" && mode != "zero3") {
    std::cerr << "bench_zero: --mode must be ddp, zero1, zero2 or zero3\n";
    return 2;
  }
  if (optimizer != "adam" && optimizer != "adamw") {
    std::cerr << "bench_zero: --optimizer must be adam or adamw\n";
    return 2;
  }
  tandem::RuntimeOptions ro;
  ro.threads = 1;
  ro.device = "cpu";
  tandem::Runtime rt(ro);
  auto comm = rt.world();
  const int R = comm->size(), me = comm->rank();
  if (batch % R) {
    std::cerr << "bench_zero: --batch must be a multiple of the world size\n";
    return 2;
  }
  torch::manual_seed(0);
  auto model = tandem::models::make_model(model_name);
  const int64_t psi = tandem::models::count_parameters(*model);

  std::unique_ptr<tandem::DistributedDataParallel> ddp;
  std::unique_ptr<torch::optim::Optimizer> ddp_opt;
  std::unique_ptr<tandem::ZeroDataParallel> zero;
  try {
    if (mode == "ddp") {
      tandem::DDPOptions o;
      if (bucket_kb > 0) o.bucket_cap_bytes = bucket_kb * 1024;
      ddp = std::make_unique<tandem::DistributedDataParallel>(model.ptr(), comm, o);
      if (optimizer == "adamw") {
        ddp_opt = std::make_unique<torch::optim::AdamW>(model->parameters(),
                                                        torch::optim::AdamWOptions(lr).weight_decay(0.0));
      } else {
        ddp_opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(lr));
      }
    } else {
      tandem::ZeroOptions o;
      o.stage = mode.back() - '0';
      if (bucket_kb > 0) o.bucket_cap_bytes = bucket_kb * 1024;
      o.optimizer.kind = optimizer;
      o.optimizer.lr = lr;
      o.optimizer.weight_decay = 0.0;
      zero = std::make_unique<tandem::ZeroDataParallel>(model.ptr(), comm, o);
    }
  } catch (const std::exception& e) {
    if (me == 0) {
      nlohmann::json j = {{"impl", "tandem"}, {"model", model_name}, {"mode", mode}, {"world", R}, {"error", e.what()}};
      std::cout << j.dump() << std::endl;
    }
    return 3;
  }

  const int64_t b = batch / R;
  auto gen = at::detail::createCPUGenerator(1234 + me);
  auto x = torch::randn({b, 1, 28, 28}, gen);
  auto y = torch::randint(0, 10, {b}, gen);

  std::vector<double> ms;
  std::map<std::string, tandem::OpStats> st;
  double loss_first = 0, loss_last = 0;
  comm->barrier();
  for (int64_t s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      comm->barrier();
      comm->reset_stats();
    }
    auto t0 = std::chrono::steady_clock::now();
    torch::Tensor loss;
    if (ddp) {
      ddp->prepare_forward();
      ddp->zero_grad();
      loss = torch::nn::functional::cross_entropy(model->forward(x), y);
      loss.backward();
      ddp_opt->step();
    } else {
      zero->prepare_forward();
      zero->zero_grad();
      loss = torch::nn::functional::cross_entropy(zero_forward(*zero, model, x), y);
      loss.backward();
      zero->step();
    }
    if (s >= warmup)
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (s == 0) loss_first = loss.item<double>();
    if (s == warmup + steps - 1) {
      loss_last = loss.item<double>();
      st = comm->stats();  // before the barriers and the reduction below
    }
  }
  comm->barrier();
  // Rank 0 reports the slowest rank's median (a step is as slow as its slowest rank).
  std::sort(ms.begin(), ms.end());
  double median = ms[ms.size() / 2];
  auto t = torch::tensor({median}, torch::kDouble);
  comm->allreduce(t, tandem::ReduceOp::kMax);

  nlohmann::json memory;
  if (zero) {
    auto zm = zero->memory();
    memory = memory_json(zm);
    memory_extras(zm, memory);
  } else {
    int64_t pb = 0, gb = 0;
    for (auto& p : model->parameters()) {
      pb += tensor_bytes(p);
      gb += tensor_bytes(p.grad());
    }
    int64_t ob = tandem::optimizer_state_bytes(*ddp_opt);
    memory = {{"stage", 0},
              {"world_size", R},
              {"parameters", psi},
              {"parameter_bytes", pb},
              {"gradient_bytes", gb},
              {"optimizer_state_bytes", ob},
              {"total_bytes", pb + gb + ob}};
  }
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  auto rss = torch::tensor({static_cast<double>(ru.ru_maxrss) * 1024.0}, torch::kDouble);  // Linux: KiB
  comm->allreduce(rss, tandem::ReduceOp::kMax);

  if (me == 0) {
    double mean = 0;
    for (double v : ms) mean += v;
    mean /= static_cast<double>(ms.size());
    nlohmann::json comm_j = nlohmann::json::object();
    for (auto& [op, s] : st) {
      if (op == "barrier") continue;
      comm_j[op] = {{"calls_per_step", static_cast<double>(s.calls) / steps},
                    {"bytes_per_step", static_cast<double>(s.bytes) / steps},
                    {"ms_per_step", 1000.0 * s.seconds / steps}};
    }
    nlohmann::json j = {{"impl", "tandem"},
                        {"model", model_name},
                        {"mode", mode},
                        {"optimizer", optimizer},
                        {"world", R},
                        {"batch", batch},
                        {"steps", steps},
                        {"parameters", psi},
                        {"median_ms", t.item<double>()},
                        {"rank0_mean_ms", mean},
                        {"loss_first", loss_first},
                        {"loss_last", loss_last},
                        {"forward_through_wrapper", zero && HasForward<tandem::ZeroDataParallel>::value},
                        {"comm", comm_j},
                        {"memory", memory},
                        {"max_rss_bytes", rss.item<double>()}};
    std::cout << j.dump() << std::endl;
  }
  return 0;
}
