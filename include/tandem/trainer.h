// The training loop behind `tandem train`: shards the data, wraps the model in the chosen
// strategy, trains with progress on rank 0, evaluates, and returns a report with time,
// throughput, accuracy, memory and communication figures (the same on every rank).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tandem/engine.h"
#include "tandem/report.h"
#include "tandem/runtime.h"

namespace tandem {

// tandem train's layout unless told otherwise: DDP, 4 micro-batches per step under a pipeline,
// 25 MiB gradient buckets under every strategy.
ParallelConfig default_train_parallel();

struct TrainConfig {
  std::string model = "cnn";
  // A registered model (tandem/registry.h: built in, or a plugin's; a path to a plugin's .so, or
  // PATH:NAME, loads it first) and dataset ("" = the model's default, else fashion-mnist), read
  // from the directory `data` when it needs files.
  std::string dataset;
  std::string data = "/usr/share/datasets/fashion-mnist";
  // The layout and its numerics: strategy, precision, loss scaling, clipping, tp x pp, the
  // pipeline's micro-batches, schedule and cut, gradient accumulation, activation checkpointing and
  // DDP's buckets (tandem/engine.h; checked by tandem::validate).
  ParallelConfig parallel = default_train_parallel();
  int epochs = 1;
  int64_t batch = 128;            // global batch, split evenly across ranks
  std::string optimizer = "sgd";  // sgd | adam | adamw | lars | lamb
  double lr = 0.05;
  double momentum = 0.9;  // sgd, lars
  double weight_decay = 0.0;
  double trust_coefficient = 0.001;  // lars: eta
  bool adapt_vectors = false;        // lars, lamb: trust ratio and weight decay for biases and norms too
  bool scale_lr = false;             // linear scaling rule: lr * world_size (Goyal et al.)
  int64_t warmup_steps = 0;          // linear warmup from lr to the (scaled) lr
  std::string schedule = "cosine";   // after warmup: cosine (decay to 0 at the last step) | constant
  uint64_t seed = 0;
  int64_t max_steps = -1;   // stop after this many steps (all epochs together); -1: no limit
  int64_t eval_limit = -1;  // evaluate on at most this many test samples; -1: all
  bool evaluate = true;
  std::string metrics_path;  // JSON lines, written by rank 0
  // TensorBoard event files of the same figures, written by rank 0 while it trains
  // (tandem/tensorboard.h); "" for none.
  std::string tensorboard;
  int64_t log_every = 50;  // plain progress lines every N steps when not on a terminal
  bool progress = true;
  // Throughput of one worker on the same job (samples/s), measured by the launcher; 0 = unknown.
  double baseline_samples_per_second = 0.0;
  // Checkpoints (tandem/checkpoint.h): save every N steps (0: never) into checkpoint_dir,
  // keeping the newest checkpoint_keep (0: all); resume continues from the newest one there
  // (parameters, optimizer state, step, data position, RNG), in any strategy and world size.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int checkpoint_keep = 0;
  // Write checkpoints on a background thread while training goes on (the same atomicity: a
  // checkpoint exists once complete); the last one is committed before the loop returns.
  bool checkpoint_async = false;
  // A Chrome trace-event timeline of the training loop, every rank's, written by rank 0
  // (tandem/trace.h); "" for none.
  std::string trace;
  bool resume = false;
  // Elastic runs with --elastic-lr scale: a resume may find another global batch. The data
  // position continues by samples (the epoch goes on with the samples that come next), and the
  // learning-rate schedule, --warmup-steps and --max-steps count steps of schedule_batch (the
  // global batch at MAX workers), which a step of `batch` samples advances by
  // batch / schedule_batch. schedule_batch 0: --batch, or the checkpoint's on a resume. Without
  // batch_may_change a resume needs the checkpoint's batch.
  bool batch_may_change = false;
  int64_t schedule_batch = 0;
  // A file that asks the run to end early (an elastic launcher's request, tandem/elastic.h):
  // at each checkpoint boundary rank 0 looks for it and all ranks agree; when it exists, the run
  // ends after that checkpoint is committed and rank 0 deletes it. "" for none.
  std::string stop_file;
  // Heterogeneous clusters (tandem/shares.h): each data-parallel rank's share of the global
  // batch: "" equal, "auto" (calibrated over the first calibration_steps steps), "3,1"
  // (weights) or "counts:96,32" (samples per step); slow_rank "R:MS" sleeps MS ms per sample
  // on rank R (to test and demonstrate it).
  std::string batch_shares;
  int64_t calibration_steps = 8;
  std::string slow_rank;
};

// tandem train's report: the one report of every command (tandem/report.h).
using TrainReport = Report;

// Checks a configuration for `world` ranks without running anything (the launcher calls it
// before starting workers; train() calls it too). Throws std::invalid_argument naming the
// problem and what to do.
void validate_config(const TrainConfig& cfg, int world);

// Runs the whole job on this rank. Every rank must call it with the same config.
// Throws std::invalid_argument / std::runtime_error with a message naming the bad input.
TrainReport train(Runtime& rt, const TrainConfig& cfg);

}  // namespace tandem
