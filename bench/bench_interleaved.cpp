// The pipeline bubble of plain 1F1B against Megatron-LM's interleaved 1F1B (v = 2 and 4 model
// chunks per rank) and the zero-bubble zb-h1 and zb-v on one model in one run on p = 2 or 4
// ranks (scripts/mpirun-local.sh -n p), for m = 2p and 4p micro-batches. The bubble of a stage is what
// tandem::PipelineStats measures: (step time - compute time) / compute time, where compute is the stage's forwards,
// losses and backwards and the rest is time blocked in receives (waiting for a neighbour, the bubble) or posting sends.
// Theory for equal stages (pipeline_bubble_theory, what tandem plan uses): (p - 1) / m for 1F1B, (p - 1) / (m v)
// interleaved, (p - 1) / (3m) zb-h1, (p - 1) / (6m) zb-v. Repetitions alternate between the configurations, each
// starting at another one; rank 0 prints medians (markdown).
//   bench_interleaved [--reps 5] [--steps 4] [--width 512] [--blocks 8] [--batch 128]
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "tandem/pipeline.h"
#include "tandem/runtime.h"

using namespace tandem;

namespace {

struct Config {
  PipelineSchedule schedule;
  int chunks;
  int64_t m;
  std::unique_ptr<Pipeline> pipe;
  std::vector<double> step_ms;
  std::vector<std::vector<double>> bubble;  // per stage, one entry per measured step
};

double middle(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// `blocks` x (Linear(width, width) + GELU), then Linear(width, 10): 2 * blocks + 1 children.
torch::nn::Sequential blocks_model(int64_t width, int64_t blocks) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int64_t b = 0; b < blocks; ++b) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::GELU());
  }
  net->push_back(torch::nn::Linear(width, 10));
  return net;
}

// Equal blocks per virtual stage; the head joins the last one.
std::vector<int64_t> equal_cut(int64_t blocks, int parts) {
  std::vector<int64_t> cut(parts, 2 * blocks / parts);
  cut.back() += 1;
  return cut;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t reps = 5, steps = 4, width = 512, blocks = 8, batch = 128;
  CLI::App app("bench_interleaved: the bubble of 1F1B against interleaved 1F1B, zb-h1 and zb-v on 2 or 4 ranks");
  app.add_option("--reps", reps, "alternating repetitions of every configuration")->capture_default_str();
  app.add_option("--steps", steps, "steps per repetition")->capture_default_str();
  app.add_option("--width", width, "width of the Linear layers")->capture_default_str();
  app.add_option("--blocks", blocks, "Linear+GELU blocks (a multiple of 4)")->capture_default_str();
  app.add_option("--batch", batch, "global batch (a multiple of 8)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  RuntimeOptions ro;
  ro.threads = 1;
  ro.device = "cpu";
  Runtime rt(ro);
  auto comm = rt.world();
  const int P = comm->size();
  if ((P != 2 && P != 4) || blocks % 4 != 0 || batch % (4 * P) != 0) {
    if (comm->rank() == 0) {
      std::cerr << "bench_interleaved: run on 2 or 4 ranks with --blocks a multiple of 4 and --batch a multiple of "
                   "4 x ranks\n";
    }
    return 2;
  }
  auto gen = at::detail::createCPUGenerator(7);
  auto x = torch::randn({batch, width}, gen);
  auto y = torch::randint(0, 10, {batch}, gen);
  auto loss = [](const at::Tensor& out, const at::Tensor& t) { return torch::nn::functional::cross_entropy(out, t); };

  std::vector<Config> configs;
  const std::vector<std::pair<PipelineSchedule, int>> schedules = {{PipelineSchedule::k1F1B, 1},
                                                                   {PipelineSchedule::kInterleaved, 2},
                                                                   {PipelineSchedule::kInterleaved, 4},
                                                                   {PipelineSchedule::kZBH1, 1},
                                                                   {PipelineSchedule::kZBV, 2}};
  for (int64_t m : {2 * P, 4 * P}) {
    for (auto [sched, chunks] : schedules) {
      if ((2 * blocks) % (P * chunks) != 0) continue;  // equal virtual stages only
      PipelineOptions o;
      o.schedule = sched;
      o.virtual_stages = chunks;
      o.micro_batches = m;
      o.partition = equal_cut(blocks, P * chunks);
      configs.push_back({sched, chunks, m, std::make_unique<Pipeline>(blocks_model(width, blocks), comm, o), {}, {}});
    }
  }
  // One rep of a configuration: `steps` steps, each stage's bubble gathered on every rank.
  auto run = [&](Config& c, bool keep) {
    comm->barrier();
    for (int64_t s = 0; s < steps; ++s) {
      for (auto& p : c.pipe->parameters()) p.mutable_grad() = at::Tensor();
      c.pipe->train_step(x, y, loss);
      const auto& st = c.pipe->stats();
      auto mine = torch::tensor({st.bubble_ratio(), st.step_seconds * 1e3}, torch::kDouble);
      auto all = torch::empty({2 * P}, torch::kDouble);
      comm->allgather(all, mine);
      if (!keep) continue;
      c.bubble.resize(P);
      double slowest = 0.0;
      for (int r = 0; r < P; ++r) {
        c.bubble[r].push_back(all[2 * r].item<double>());
        slowest = std::max(slowest, all[2 * r + 1].item<double>());
      }
      c.step_ms.push_back(slowest);
    }
  };
  for (auto& c : configs) run(c, false);  // warm-up; the first step also agrees shapes
  // Each rep starts at another configuration, so that no configuration always runs first.
  for (int64_t rep = 0; rep < reps; ++rep) {
    for (size_t k = 0; k < configs.size(); ++k) run(configs[(k + static_cast<size_t>(rep)) % configs.size()], true);
  }

  if (comm->rank() == 0) {
    std::printf("## Pipeline bubble: 1F1B vs interleaved 1F1B, zb-h1 and zb-v (%d ranks, 1 thread each, medians of %ld "
                "alternating reps x %ld steps)\n\n",
                P, static_cast<long>(reps), static_cast<long>(steps));
    std::printf("Model: %ld x (Linear(%ld,%ld)+GELU) + Linear(%ld,10), float32, global batch %ld; equal blocks per "
                "virtual stage. Bubble = (step - compute) / compute per stage.\n\n",
                static_cast<long>(blocks), static_cast<long>(width), static_cast<long>(width), static_cast<long>(width),
                static_cast<long>(batch));
    std::printf("| schedule | m | v | step ms | bubble per stage | mean | theory |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    for (auto& c : configs) {
      double mean = 0.0;
      std::string stages;
      for (int r = 0; r < P; ++r) {
        mean += middle(c.bubble[r]) / P;
        char buf[32];
        std::snprintf(buf, sizeof buf, "%s%.3f", r ? " / " : "", middle(c.bubble[r]));
        stages += buf;
      }
      const std::string name = to_string(c.schedule);
      const double theory = pipeline_bubble_theory(c.schedule, P, c.m, c.chunks);
      std::printf("| %s | %ld | %d | %.1f | %s | %.3f | %.3f = %s |\n", name.c_str(), static_cast<long>(c.m), c.chunks,
                  middle(c.step_ms), stages.c_str(), mean, theory, pipeline_bubble_formula(c.schedule).c_str());
    }
    std::fflush(stdout);
  }
  comm->barrier();
  return 0;
}
