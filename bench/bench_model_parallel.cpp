// Model parallelism side by side in one run on 2 ranks (scripts/mpirun-local.sh -n 2):
//  1. pipeline, 2 stages vs 1 worker: an MLP of `--layers` Linear(W,W)+GELU, global batch B, GPipe
//     and 1F1B for m = 1, 2, 4, 8 micro-batches; step time, speedup, measured bubble beside theory;
//  2. tensor parallel, 2 vs 1: one transformer block (models::TransformerBlock) forward+backward;
//  3. stage-0 peak activation memory of GPipe and 1F1B (MemoryMeter) for m = 2, 4, 8.
// Repetitions alternate between the configurations; medians are printed (markdown) by rank 0.
// "1 worker" = rank 0 runs the whole model on the whole batch while rank 1 waits in a barrier;
// 1 compute thread per rank throughout.
//   bench_model_parallel [--reps 5] [--steps 3] [--width 512] [--layers 8] [--batch 128]
//                        [--d-model 256] [--heads 8] [--seq 128] [--tp-batch 8]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>

#include "tandem/models.h"
#include "tandem/pipeline.h"
#include "tandem/runtime.h"
#include "tandem/tensor_parallel.h"

using namespace tandem;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Slowest rank's value (a step is as slow as its slowest rank).
double max_over(Communicator& c, double v) {
  auto t = torch::tensor({v}, torch::kDouble);
  c.allreduce(t, ReduceOp::kMax);
  return t.item<double>();
}
double mean_over(Communicator& c, double v) {
  auto t = torch::tensor({v}, torch::kDouble);
  c.allreduce(t, ReduceOp::kAvg);
  return t.item<double>();
}

torch::nn::Sequential make_mlp(int64_t width, int64_t layers) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int64_t i = 0; i < layers; ++i) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::GELU());
  }
  net->push_back(torch::nn::Linear(width, 10));
  return net;
}

at::Tensor ce(const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); }

}  // namespace

int main(int argc, char** argv) {
  int64_t reps = 5, steps = 3, width = 512, layers = 8, batch = 128, d_model = 256, heads = 8, seq = 128, tp_batch = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    int64_t v = std::stoll(argv[i + 1]);
    if (k == "--reps") reps = v;
    else if (k == "--steps") steps = v;
    else if (k == "--width") width = v;
    else if (k == "--layers") layers = v;
    else if (k == "--batch") batch = v;
    else if (k == "--d-model") d_model = v;
    else if (k == "--heads") heads = v;
    else if (k == "--seq") seq = v;
    else if (k == "--tp-batch") tp_batch = v;
    else {
      std::cerr << "bench_model_parallel: unknown option " << k << "\n";
      return 2;
    }
  }
  RuntimeOptions ro;
  ro.threads = 1;
  ro.device = "cpu";
  Runtime rt(ro);
  auto comm = rt.world();
  const int P = comm->size(), me = comm->rank();
  if (P != 2) {
    if (me == 0) std::cerr << "bench_model_parallel: run on 2 ranks (scripts/mpirun-local.sh -n 2)\n";
    return 2;
  }
  MemoryMeter::install();
  auto gen = at::detail::createCPUGenerator(7);
  auto x = torch::randn({batch, width}, gen);
  auto y = torch::randint(0, 10, {batch}, gen);

  // ---- the configurations, each a function returning one rep's ms per step (slowest rank)
  auto single = make_mlp(width, layers);
  // One worker: rank 0 alone while rank 1 waits in a barrier (MPI yields when idle).
  auto time_single = [&] {
    comm->barrier();
    double ms = 0;
    if (me == 0) {
      auto t0 = Clock::now();
      for (int64_t s = 0; s < steps; ++s) {
        single->zero_grad();
        ce(single->forward(x), y).backward();
      }
      ms = ms_since(t0) / steps;
    }
    return max_over(*comm, ms);
  };
  struct PipeRun {
    std::unique_ptr<Pipeline> pipe;
    std::vector<double> ms, bubble_ratio, bubble_fraction;
  };
  std::map<std::pair<int, int64_t>, PipeRun> pipes;
  const std::vector<int64_t> ms_list = {1, 2, 4, 8};
  for (auto sched : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
    for (int64_t m : ms_list) {
      PipelineOptions o;
      o.schedule = sched;
      o.micro_batches = m;
      o.partition = {layers, layers + 1};  // first half of the blocks | second half and the head
      pipes[{static_cast<int>(sched), m}].pipe = std::make_unique<Pipeline>(make_mlp(width, layers), comm, o);
    }
  }
  auto time_pipe = [&](PipeRun& r) {
    comm->barrier();
    auto t0 = Clock::now();
    double ratio = 0, frac = 0;
    for (int64_t s = 0; s < steps; ++s) {
      for (auto& p : r.pipe->parameters()) p.mutable_grad() = at::Tensor();
      r.pipe->train_step(x, y, ce);
      ratio += r.pipe->stats().bubble_ratio();
      frac += r.pipe->stats().bubble_fraction();
    }
    r.ms.push_back(max_over(*comm, ms_since(t0) / steps));
    r.bubble_ratio.push_back(mean_over(*comm, ratio / steps));
    r.bubble_fraction.push_back(mean_over(*comm, frac / steps));
  };

  // Tensor parallel: one transformer block.
  torch::manual_seed(1);
  models::TransformerBlock dense(d_model, heads, 4);
  torch::manual_seed(1);
  models::TransformerBlock dense_copy(d_model, heads, 4);
  tp::ParallelTransformerBlock par(*dense_copy, comm);
  auto tx = torch::randn({tp_batch, seq, d_model}, gen);
  // alone: rank 0 only (the dense baseline); else every rank (the tensor-parallel block).
  auto time_block = [&](torch::nn::Module& block, const std::function<at::Tensor(const at::Tensor&)>& fwd, bool alone) {
    comm->barrier();
    double ms = 0;
    if (!alone || me == 0) {
      auto t0 = Clock::now();
      for (int64_t s = 0; s < steps; ++s) {
        block.zero_grad();
        fwd(tx).sum().backward();
      }
      ms = ms_since(t0) / steps;
    }
    return max_over(*comm, ms);
  };
  std::vector<double> single_ms, dense_ms, tp_ms;
  // Warm-up of everything once.
  time_single();
  for (auto& [k, r] : pipes) {
    time_pipe(r);
    r.ms.clear();
    r.bubble_ratio.clear();
    r.bubble_fraction.clear();
  }
  time_block(
      *dense, [&](const at::Tensor& t) { return dense->forward(t); }, true);
  time_block(
      *par, [&](const at::Tensor& t) { return par->forward(t); }, false);
  for (int64_t rep = 0; rep < reps; ++rep) {
    single_ms.push_back(time_single());
    for (auto& [k, r] : pipes) time_pipe(r);
    dense_ms.push_back(time_block(
        *dense, [&](const at::Tensor& t) { return dense->forward(t); }, true));
    tp_ms.push_back(time_block(
        *par, [&](const at::Tensor& t) { return par->forward(t); }, false));
  }

  // Memory: stage 0's peak above the step's start (gradients preallocated), with the global batch
  // fixed (micro-batch B/m) and with the micro-batch fixed at B/8 (global batch B/8 * m).
  std::map<std::pair<int, int64_t>, int64_t> mem, mem_fixed_mb, live;
  for (auto& [k, r] : pipes) {
    for (auto& p : r.pipe->parameters()) p.mutable_grad() = at::zeros_like(p);
    comm->barrier();
    r.pipe->train_step(x, y, ce);
    mem[k] = r.pipe->stats().peak_activation_bytes;
    live[k] = r.pipe->stats().peak_live_micro_batches;
    const int64_t n = batch / 8 * k.second;
    comm->barrier();
    r.pipe->train_step(x.narrow(0, 0, n), y.narrow(0, 0, n), ce);
    mem_fixed_mb[k] = r.pipe->stats().peak_activation_bytes;
  }

  if (me == 0) {
    const double s1 = median(single_ms);
    std::printf("## Model parallelism (2 ranks, 1 thread each, medians of %ld alternating reps x %ld steps)\n\n",
                static_cast<long>(reps), static_cast<long>(steps));
    std::printf("Pipeline: MLP %ld x Linear(%ld,%ld)+GELU + Linear(%ld,10), float32, global batch %ld, "
                "partition {%ld, %ld} children.\n\n",
                static_cast<long>(layers), static_cast<long>(width), static_cast<long>(width), static_cast<long>(width),
                static_cast<long>(batch), static_cast<long>(layers), static_cast<long>(layers + 1));
    std::printf("| config | step ms | speedup vs 1 worker | bubble idle/compute (theory (p-1)/m) | idle share of step "
                "(theory (p-1)/(m+p-1)) |\n");
    std::printf("|---|---|---|---|---|\n");
    std::printf("| 1 worker, whole model | %.1f | 1.00x | - | - |\n", s1);
    for (auto& [k, r] : pipes) {
      const int64_t m = k.second;
      std::printf("| 2 stages, %s, m=%ld | %.1f | %.2fx | %.2f (%.2f) | %.2f (%.2f) |\n",
                  to_string(static_cast<PipelineSchedule>(k.first)), static_cast<long>(m), median(r.ms),
                  s1 / median(r.ms), median(r.bubble_ratio), (P - 1.0) / m, median(r.bubble_fraction),
                  (P - 1.0) / (m + P - 1.0));
    }
    std::printf("\nTensor parallel: one TransformerBlock, d_model %ld, %ld heads, MLP 4x, input [%ld, %ld, %ld], "
                "float32, forward+backward.\n\n",
                static_cast<long>(d_model), static_cast<long>(heads), static_cast<long>(tp_batch),
                static_cast<long>(seq), static_cast<long>(d_model));
    std::printf("| config | step ms | speedup |\n|---|---|---|\n");
    std::printf("| dense block, 1 worker | %.1f | 1.00x |\n", median(dense_ms));
    std::printf("| tensor-parallel block, tp=2 | %.1f | %.2fx |\n", median(tp_ms), median(dense_ms) / median(tp_ms));
    std::printf("\nStage-0 peak memory during a step (MemoryMeter: bytes allocated above the step's start; "
                "includes backward's transient gradient buffers):\n\n");
    std::printf("| m | live micro-batches GPipe / 1F1B | batch %ld: GPipe KiB | 1F1B KiB | micro-batch %ld (batch "
                "%ld*m): GPipe KiB | 1F1B KiB |\n",
                static_cast<long>(batch), static_cast<long>(batch / 8), static_cast<long>(batch / 8));
    std::printf("|---|---|---|---|---|---|\n");
    for (int64_t m : ms_list) {
      std::printf("| %ld | %ld / %ld | %.0f | %.0f | %.0f | %.0f |\n", static_cast<long>(m),
                  static_cast<long>(live[{0, m}]), static_cast<long>(live[{1, m}]), mem[{0, m}] / 1024.0,
                  mem[{1, m}] / 1024.0, mem_fixed_mb[{0, m}] / 1024.0, mem_fixed_mb[{1, m}] / 1024.0);
    }
    std::fflush(stdout);
  }
  comm->barrier();
  return 0;
}
