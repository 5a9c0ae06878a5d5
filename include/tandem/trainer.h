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

struct TrainConfig {
  std::string model = "cnn";
  // A registered model (tandem/registry.h: built in, or a plugin's; a path to a plugin's .so, or
  // PATH:NAME, loads it first) and dataset ("" = the model's default, else fashion-mnist), read
  // from the directory `data` when it needs files.
  std::string dataset;
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string strategy = "ddp";                   // single | ddp | zero1 | zero2 | zero3 (ZeRO stages 1-3)
  std::string precision = "fp32";                 // fp32 | bf16 | fp16 (fp32 master weights, fp16 with loss scaling)
  double max_grad_norm = 0.0;                     // clip the global gradient norm; 0 = off
  std::string activation_checkpointing = "none";  // none | every | N (tandem/activation_checkpoint.h)
  double initial_loss_scale = 65536.0;            // fp16: the dynamic loss scale's start
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
  int64_t log_every = 50;    // plain progress lines every N steps when not on a terminal
  bool progress = true;
  // DDP knobs
  int64_t bucket_mb = 25;
  bool find_unused = false;
  std::string compress = "none";  // none | bf16 | fp16
  bool overlap = true;
  bool communicate = true;  // false only to measure the compute-only ceiling
  // Throughput of one worker on the same job (samples/s), measured by the launcher; 0 = unknown.
  double baseline_samples_per_second = 0.0;
  // Model parallelism (tandem/grid.h): each replica spans tp x pp ranks, the other
  // world / (tp * pp) ranks are data parallel (--strategy ddp or zero1 over the dp groups).
  int tp = 1;                 // tensor parallel: Linear pairs column/row-parallel
  int pp = 1;                 // pipeline stages (the Sequential cut by pp_partition)
  int64_t micro_batches = 4;  // per replica and step, when pp > 1
  // Gradient accumulation without a pipeline: each replica's batch (global batch / dp) runs
  // as this many micro-batches before one optimizer step (DDP communicates once per step).
  int64_t grad_accum = 1;
  std::string pipeline_schedule = "1f1b";  // gpipe | 1f1b | interleaved
  int virtual_stages = 1;                  // model chunks per pipeline rank (interleaved)
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

// The typed layout of a configuration: its strategy, precision, schedule, partition and
// compression names parsed (std::invalid_argument naming a bad one).
ParallelConfig parallel_config(const TrainConfig& cfg);

// Runs the whole job on this rank. Every rank must call it with the same config.
// Throws std::invalid_argument / std::runtime_error with a message naming the bad input.
TrainReport train(Runtime& rt, const TrainConfig& cfg);

}  // namespace tandem
