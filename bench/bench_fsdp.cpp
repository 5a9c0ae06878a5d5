// Tandem's side of bench/fsdp_compare.sh: tandem::models::transformer (TokenEmbedding, `layers`
// blocks, LayerNorm, LM head) trained through the Engine with AdamW on random token ids, under
// DDP, ZeRO-3 (a unit per Sequential child) or ZeRO-3 with every child's activations recomputed.
// Run under mpirun (scripts/mpirun-local.sh -n N), one compute thread per rank:
//   bench_fsdp --mode ddp|zero3|zero3_ac [--layers 8] [--d-model 256] [--heads 4] [--seq 128]
//              [--vocab 512] [--batch 8] [--steps 6] [--warmup 2]
// Prints one JSON line on rank 0 with the slowest rank's median step ms and, per rank, the metric
// bench/torch_fsdp_cpu.py measures the same way (bench/heap_peak.c, LD_PRELOADed): during the
// timed steps, the peak of the bytes held through malloc plus this rank's share of the resident
// pages of its shared mappings (MPI's segments, DDP's and ZeRO's symmetric blocks, which malloc
// does not see), sampled together, above the heap held just before the model was built (so the
// model, its state and a step's transients count, its construction not); the heap's peak alone;
// and the shared mappings' Pss after the steps. Beside them Tandem's own figures:
// MemoryMeter's activation peak above a step's start, the model state held at that start, the gathered peak,
// and tandem plan's per-rank prediction for the layout.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "tandem/engine.h"
#include "tandem/models.h"
#include "tandem/pipeline.h"
#include "tandem/plan.h"
#include "tandem/runtime.h"

using namespace tandem;

namespace {

// bench/heap_peak.c's counters, or -1 when it is not preloaded.
int64_t heap_call(const char* name) {
  auto* f = reinterpret_cast<long long (*)()>(dlsym(RTLD_DEFAULT, name));
  return f ? f() : -1;
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// tandem plan's per-rank memory (parameters, gradients, optimizer state, activations, and the
// peak they make together) for this shape and layout, as `tandem plan --layers ... --precision
// fp32` prices it.
std::vector<double> plan_memory(const models::TransformerConfig& c, double params, int world, int zero, bool ac,
                                int64_t batch) {
  auto m = plan::transformer_model(c.layers, c.d_model, c.heads, c.seq, c.vocab, params);
  plan::PlanOptions o;
  o.global_batch = batch;
  o.optimizer = "adamw";
  o.precision = "fp32";
  o.activation_checkpointing = ac;
  plan::Layout l;
  l.dp = world;
  l.zero = zero;
  l.micro_batch = batch / world;
  auto cl = plan::cluster_preset("local");
  cl.groups.at(0).devices_per_node = std::max(cl.groups.at(0).devices_per_node, world);
  const auto e = plan::estimate(m, cl, l, o);
  return {e.memory.parameters, e.memory.gradients, e.memory.optimizer, e.memory.activations, e.memory.total()};
}

// This process's proportional share (Pss: a page mapped by k processes counts 1/k) of its shared
// mappings (smaps entries with an 's' permission: MPI's shared-memory segments, the symmetric
// blocks of DDP and ZeRO); once touched their pages stay until unmapped.
int64_t shared_resident_bytes() {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  bool shared = false;
  int64_t kb = 0;
  while (std::getline(in, line)) {
    if (line.rfind("Pss:", 0) == 0) {
      if (shared) kb += std::stoll(line.substr(4));
    } else if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
               line.find('-') != std::string::npos) {
      const auto sp = line.find(' ');
      shared = sp != std::string::npos && line.size() > sp + 4 && line[sp + 4] == 's';
    }
  }
  return kb * 1024;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tandem's transformer under DDP / ZeRO-3 for bench/fsdp_compare.sh"};
  std::string mode = "zero3";
  models::TransformerConfig c;
  c.layers = 8;
  c.d_model = 256;
  c.heads = 4;
  c.seq = 128;
  c.vocab = 512;
  int64_t batch = 8;
  int steps = 6, warmup = 2;
  app.add_option("--mode", mode, "ddp | zero3 | zero3_ac")->check(CLI::IsMember({"ddp", "zero3", "zero3_ac"}));
  app.add_option("--layers", c.layers);
  app.add_option("--d-model", c.d_model);
  app.add_option("--heads", c.heads);
  app.add_option("--seq", c.seq);
  app.add_option("--vocab", c.vocab);
  app.add_option("--batch", batch, "global batch (sequences)");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first");
  CLI11_PARSE(app, argc, argv);

  MemoryMeter::install();
  RuntimeOptions ro;
  ro.threads = 1;
  ro.device = "cpu";
  Runtime rt(ro);
  const int world = rt.world_size(), rank = rt.rank();
  if (batch % world != 0) {
    if (rank == 0) std::cout << nlohmann::json{{"error", "--batch must split over the workers"}}.dump() << "\n";
    return 3;
  }
  const int64_t heap_base = heap_call("heap_peak_reset");
  torch::manual_seed(0);
  auto net = models::transformer(c);
  const double params = static_cast<double>(models::count_parameters(*net));

  ParallelConfig pc;
  pc.strategy = mode == "ddp" ? Strategy::kDDP : Strategy::kZero3;
  if (mode == "zero3_ac") pc.activation_checkpointing = parse_activation_checkpointing("every");
  OptimizerOptions oo;
  oo.kind = "adamw";
  oo.lr = 1e-3;
  Engine eng(rt, net, oo, pc);

  const int64_t b = batch / world;
  auto g = at::detail::createCPUGenerator(1234 + rank);
  auto ids = torch::randint(0, c.vocab, {b, c.seq + 1}, g);
  auto x = ids.narrow(1, 0, c.seq).contiguous(), y = ids.narrow(1, 1, c.seq).contiguous();
  const LossFn loss_fn = [](const at::Tensor& out, const at::Tensor& t) {
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), t.reshape({-1}));
  };
  std::vector<double> ms;
  double loss_first = 0, loss_last = 0;
  eng.world()->barrier();
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      eng.world()->barrier();
      heap_call("heap_peak_reset");  // the timed steps' peak, not the model's construction
    }
    const auto t0 = std::chrono::steady_clock::now();
    const double loss = eng.step(x, y, loss_fn).item<double>();
    if (s >= warmup)
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (s == 0) loss_first = loss;
    loss_last = loss;
  }
  const auto st = eng.stats().memory;
  // The model state held at a step's start, which MemoryMeter's peak is measured above:
  // parameters, optimizer state, and the gradients of a strategy that keeps them across steps
  // (DDP's buckets; ZeRO-2/3 free theirs in zero_grad() and count them in the peak when alive).
  eng.zero_grad();
  const auto at_start = eng.stats().memory;
  // Per rank: heap peak above the start, activation peak, model state, gathered peak, step ms,
  // shared memory resident after the steps, ZeRO's block reserved, heap + shared peak.
  const int64_t heap = heap_base < 0 ? -1 : heap_call("heap_peak_bytes") - heap_base;
  const int64_t total = heap_base < 0 ? -1 : heap_call("heap_peak_total") - heap_base;
  auto mine = torch::tensor({static_cast<double>(heap), static_cast<double>(st.peak_activation_bytes),
                             static_cast<double>(at_start.parameter_bytes + at_start.gradient_bytes +
                                                 at_start.optimizer_state_bytes),
                             static_cast<double>(st.peak_gathered_bytes), median(ms),
                             static_cast<double>(shared_resident_bytes()), static_cast<double>(st.pool_bytes),
                             static_cast<double>(total)},
                            torch::kDouble);
  auto all = torch::zeros({world, mine.numel()}, torch::kDouble);
  eng.world()->allgather(all.view({-1}), mine);
  if (rank == 0) {
    auto col = [&](int k) {
      std::vector<double> v;
      for (int r = 0; r < world; ++r) v.push_back(all[r][k].item<double>());
      return v;
    };
    const auto step_ms = col(4);
    nlohmann::json j{{"impl", "tandem"},
                     {"mode", mode},
                     {"world", world},
                     {"batch", batch},
                     {"steps", steps},
                     {"parameters", params},
                     {"median_ms", *std::max_element(step_ms.begin(), step_ms.end())},
                     {"peak_bytes", col(7)},
                     {"heap_peak_bytes", col(0)},
                     {"shared_resident_bytes", col(5)},
                     {"zero_pool_bytes", col(6)},
                     {"activation_peak_bytes", col(1)},
                     {"model_state_bytes", col(2)},
                     {"gathered_peak_bytes", col(3)},
                     {"plan_bytes", plan_memory(c, params, world, zero_stage(pc.strategy),
                                                pc.activation_checkpointing.enabled(), batch)},
                     {"loss_first", loss_first},
                     {"loss_last", loss_last}};
    std::cout << j.dump() << std::endl;
  }
  return 0;
}
