// The training loop behind `tandem train`: shards the data, wraps the model in the chosen
// strategy, trains with progress on rank 0, evaluates, and returns a report with time,
// throughput, accuracy, memory and communication figures (the same on every rank).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tandem/engine.h"
#include "tandem/runtime.h"

namespace tandem {

struct TrainConfig {
  std::string model = "cnn";
  // A registered model (tandem/registry.h: built in, or a plugin's; a path to a plugin's .so, or
  // PATH:NAME, loads it first) and dataset ("" = the model's default, else fashion-mnist), read
  // from the directory `data` when it needs files.
  std::string dataset;
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string strategy = "ddp";  // single | ddp | zero1 | zero2 | zero3 (ZeRO stages 1-3)
  std::string precision = "fp32";  // fp32 | bf16 | fp16 (fp32 master weights, fp16 with loss scaling)
  double max_grad_norm = 0.0;      // clip the global gradient norm; 0 = off
  double initial_loss_scale = 65536.0;  // fp16: the dynamic loss scale's start
  int epochs = 1;
  int64_t batch = 128;  // global batch, split evenly across ranks
  std::string optimizer = "sgd";  // sgd | adam | adamw
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 0.0;
  bool scale_lr = false;      // linear scaling rule: lr * world_size (Goyal et al.)
  int64_t warmup_steps = 0;   // linear warmup from lr to the (scaled) lr
  std::string schedule = "cosine";  // after warmup: cosine (decay to 0 at the last step) | constant
  uint64_t seed = 0;
  int64_t max_steps = -1;     // stop after this many steps (all epochs together); -1: no limit
  int64_t eval_limit = -1;    // evaluate on at most this many test samples; -1: all
  bool evaluate = true;
  std::string metrics_path;   // JSON lines, written by rank 0
  int64_t log_every = 50;     // plain progress lines every N steps when not on a terminal
  bool progress = true;
  // DDP knobs
  int64_t bucket_mb = 25;
  bool find_unused = false;
  std::string compress = "none";  // none | bf16 | fp16
  bool overlap = true;
  bool communicate = true;    // false only to measure the compute-only ceiling
  // Throughput of one worker on the same job (samples/s), measured by the launcher; 0 = unknown.
  double baseline_samples_per_second = 0.0;
  // Model parallelism (tandem/grid.h): each replica spans tp x pp ranks, the other
  // world / (tp * pp) ranks are data parallel (--strategy ddp or zero1 over the dp groups).
  int tp = 1;                              // tensor parallel: Linear pairs column/row-parallel
  int pp = 1;                              // pipeline stages (the Sequential cut by pp_partition)
  int64_t micro_batches = 4;               // per replica and step, when pp > 1
  // Gradient accumulation without a pipeline: each replica's batch (global batch / dp) runs
  // as this many micro-batches before one optimizer step (DDP communicates once per step).
  int64_t grad_accum = 1;
  std::string pipeline_schedule = "1f1b";  // gpipe | 1f1b
  // Where the stages are cut: "params" (balanced by parameter count, as DeepSpeed's default),
  // "time" (balanced by each layer's forward+backward time on a micro-batch, measured on rank 0
  // before training) or the layers per stage, "3,7".
  std::string pp_partition = "params";
  // Checkpoints (tandem/checkpoint.h): save every N steps (0: never) into checkpoint_dir,
  // keeping the newest checkpoint_keep (0: all); resume continues from the newest one there
  // (parameters, optimizer state, step, data position, RNG), in any strategy and world size.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int checkpoint_keep = 0;
  bool resume = false;
  // Heterogeneous clusters (tandem/shares.h): each data-parallel rank's share of the global
  // batch: "" equal, "auto" (calibrated over the first calibration_steps steps), "3,1"
  // (weights) or "counts:96,32" (samples per step); slow_rank "R:MS" sleeps MS ms per sample
  // on rank R (to test and demonstrate it).
  std::string batch_shares;
  int64_t calibration_steps = 8;
  std::string slow_rank;
};

struct TrainReport {
  int world_size = 1;
  int64_t steps = 0;
  int64_t samples = 0;             // global samples processed
  double wall_seconds = 0.0;       // training loop only (no data loading, no evaluation)
  double samples_per_second = 0.0;
  double step_ms_median = 0.0;     // median wall time of a step (after the first)
  double final_loss = 0.0;
  std::vector<double> losses;      // global (all-rank mean) loss of every step
  double test_accuracy = -1.0;     // in [0,1]; -1 when not evaluated
  int64_t test_samples = 0;
  std::vector<int64_t> peak_rss_bytes;  // per rank
  double comm_seconds = 0.0;       // rank 0's gradient all-reduce time on the engine
  double exposed_comm_seconds = 0.0;
  double hidden_fraction = 0.0;
  int64_t comm_bytes = 0;          // rank 0's gradient bytes all-reduced
  // What the strategy moved per training step on rank 0, from the Communicator's counters:
  // payload bytes handed to each collective, and the bytes a ring algorithm puts on the wire
  // per rank (all-reduce 2(N-1)/N S, reduce-scatter and all-gather (N-1)/N S of the full size S).
  std::map<std::string, double> comm_bytes_per_step;
  double wire_bytes_per_step = 0.0;
  double comm_engine_seconds = 0.0;  // rank 0's seconds on the engine over the loop, all operations
  std::string precision = "fp32";
  double loss_scale = 1.0;         // fp16: the final dynamic loss scale
  int64_t skipped_steps = 0;       // fp16: steps skipped on overflow
  int64_t peak_gathered_bytes = 0; // zero3: most gathered unit parameters alive at once
  // zero2/3 on CPU with more than one rank (rank 0): the shared-memory block that gradient
  // scratch and gathered units come from, and how many of them did not fit and took ordinary
  // memory (slower collectives: MPI's fifos instead of shared memory).
  int64_t zero_pool_bytes = 0;
  int64_t zero_pool_misses = 0;
  int64_t parameters = 0;
  // Rank 0's bytes of parameters, gradients and optimizer state held after training (for
  // zero1-3 the sharded figures, masters included in the optimizer state; see ZeroMemory in
  // tandem/zero.h).
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_state_bytes = 0;
  double speedup = 0.0;            // samples/s over baseline, when a baseline was given
  int64_t first_step = 0;          // steps done before this run (resumed from a checkpoint)
  // Layout: dp x tp x pp = world_size.
  int dp = 1, tp = 1, pp = 1;
  // Pipeline (pp > 1), from rank 0's replica, steps after the first: layers per stage, idle over
  // compute time of each stage's train_step (theory for balanced stages: (pp - 1) / micro-batches)
  // and the most micro-batches whose activations each stage held at once.
  std::vector<int64_t> partition;
  std::vector<double> bubble_per_stage;
  // Mean milliseconds per step (after the first) of each stage's train_step, and of its compute.
  std::vector<double> pipeline_step_ms_per_stage, pipeline_compute_ms_per_stage;
  double bubble_measured = 0.0;    // mean of bubble_per_stage
  double bubble_theory = 0.0;      // (pp - 1) / micro_batches
  std::vector<int64_t> peak_live_micro_batches;
  // Batch shares (dp > 1 without --tp/--pp): mode (equal, weights, counts, auto), each rank's
  // samples per step at the end, the forward samples/s the calibration measured (auto), and
  // per rank its samples over the loop's wall time and over its own forward seconds.
  std::string batch_shares_mode;
  std::vector<int64_t> batch_shares;
  std::vector<double> calibrated_samples_per_second;
  std::vector<double> rank_samples_per_second;
  std::vector<double> rank_forward_samples_per_second;
};

// Checks a configuration for `world` ranks without running anything (the launcher calls it
// before starting workers; train() calls it too). Throws std::invalid_argument naming the
// problem and what to do.
void validate_config(const TrainConfig& cfg, int world);

// The typed layout of a configuration: its strategy, precision, schedule, partition and
// compression names parsed (std::invalid_argument naming a bad one).
ParallelConfig parallel_config(const TrainConfig& cfg);

// Runs the whole job on this rank. Every rank must call it with the same config.
// Throws std::invalid_argument / std::runtime_error with a message naming the bad input.
TrainReport train(Runtime& rt, const TrainConfig& cfg);

// The human-readable report rank 0 prints at the end.
std::string format_report(const TrainConfig& cfg, const TrainReport& r);

}  // namespace tandem
