// The end-of-run report of a training loop on the Engine: what ran, the loop's time and
// losses, the evaluation, and the Engine's communication, memory and pipeline figures. Every
// command (`tandem train`, `pretrain`, `finetune`) fills one and prints it with the one
// formatter, so each figure has the same name and the same form everywhere; a custom loop can
// do the same:
//
//   tandem::Report rep;
//   rep.command = "my-train"; rep.model = "resnet"; ...
//   tandem::record_loop(rep, steps, samples, wall_seconds, step_ms);
//   tandem::collect_engine_report(engine, rep);  // collective
//   if (engine.world()->rank() == 0) std::cout << tandem::format_report(rep);
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tandem/pipeline_schedule.h"

namespace tandem {

class Engine;
struct EngineStats;

// One step's figures beside its loss, rank 0's: each step's line of a --metrics file and the
// curves of --tensorboard (tandem/tensorboard.h).
struct StepFigures {
  double lr = 0.0;
  double samples_per_second = 0.0;  // the step's global samples over its wall time
  // The global gradient norm before clipping, where the engine computes it (--max-grad-norm);
  // negative: not computed.
  double grad_norm = -1.0;
  double loss_scale = 1.0;     // the loss scale after the step (fp16's dynamic one; 1 otherwise)
  int64_t peak_rss_bytes = 0;  // this process's resident peak so far
  // Seconds on the communication engine during the step over the step's wall seconds (what
  // overlaps compute counts too).
  double comm_share = 0.0;
  // A mixture-of-experts model: the step's load-balancing and router z-loss (without their
  // coefficients; the step's loss includes coef x each), the mean of the MoE layers' terms over
  // every rank. Negative: none.
  double aux_loss = -1.0, z_loss = -1.0;
};

// Reads a loop's StepFigures off the engine's counters, step after step. Local.
class StepMeter {
 public:
  explicit StepMeter(const Engine& engine);  // after the engine's reset_stats(), before the first step
  // The step that just ended: its wall milliseconds and the global samples it trained on.
  StepFigures next(double step_ms, int64_t samples);

 private:
  const Engine& engine_;
  double comm_seconds_ = 0.0;
};

struct Report {
  // ---- what ran (filled by the command)
  std::string command = "train";  // the title: "== tandem <command> report =="
  std::string model;              // name or description of the model
  std::string strategy = "single";
  int shard_group = 0;  // hsdp, hsdp2: data-parallel ranks per shard group (0 otherwise)
  std::string precision = "fp32";
  int world_size = 1;
  int dp = 1, tp = 1, pp = 1, cp = 1;  // dp x cp x tp x pp = world_size
  bool sequence_parallel = false;      // activations between the tp layers split along the sequence
  int64_t parameters = 0;
  int64_t trainable_parameters = 0;  // those that require gradients (fewer with LoRA adapters)
  int64_t global_batch = 0;
  int64_t grad_accum = 1;
  int64_t micro_batches = 1;                                     // pipeline micro-batches per replica and step (pp > 1)
  PipelineSchedule pipeline_schedule = PipelineSchedule::k1F1B;  // pp > 1
  int virtual_stages = 1;                                        // model chunks per pipeline rank (interleaved)
  std::vector<int64_t> partition;                                // layers per (virtual) pipeline stage (pp > 1)
  std::string activation_checkpointing = "none";  // none | every | selective | N (tandem/activation_checkpoint.h)
  double recompute_seconds = 0.0;                 // rank 0's seconds recomputing in backward (EngineStats)
  double baseline_samples_per_second = 0.0;       // one worker's, when known: gives the speedup
  // Lines the command adds after the layout, as (label, text): e.g. the data and where the
  // weights came from.
  std::vector<std::pair<std::string, std::string>> context;

  // ---- the loop (record_loop, and the command's global losses)
  int64_t first_step = 0;  // steps done before this run (resumed from a checkpoint)
  int64_t steps = 0;
  int64_t samples = 0;        // global samples processed
  double wall_seconds = 0.0;  // the training loop only (no data loading, no evaluation)
  double samples_per_second = 0.0;
  double step_ms_median = 0.0;            // median wall time of a step, the first left out
  double speedup = 0.0;                   // over baseline_samples_per_second, from the median step
  std::vector<double> step_ms;            // this rank's wall milliseconds of every step
  std::vector<double> losses;             // the global batch's loss of every step
  std::vector<StepFigures> step_figures;  // rank 0's figures of every step (beside losses)
  double final_loss = 0.0;

  // ---- the evaluation (filled by the command; negative: not evaluated)
  double eval_loss = -1.0;      // validation loss per token (language models)
  double test_accuracy = -1.0;  // in [0, 1]
  int64_t test_samples = 0;
  std::string test_unit = "samples";  // what test_samples counts: "samples", "documents"
  std::string evaluation_detail;      // printed after the accuracy (e.g. a confusion table)

  // ---- the Engine's figures (collect_engine_report)
  std::vector<int64_t> peak_rss_bytes;  // every rank's resident peak
  // Every rank's EngineStats::memory.peak_activation_bytes (empty where not measured).
  std::vector<int64_t> peak_activation_bytes;
  // tandem plan's memory model of this run's layout, per rank: parameters, gradients, optimizer
  // state, activations (empty where the model has no description for the planner).
  std::vector<double> plan_memory_bytes;
  // The same four figures for each pipeline stage (pp > 1, models that list their children).
  std::vector<std::vector<double>> plan_memory_bytes_per_stage;
  // Every rank's model state (parameter, gradient, optimizer state bytes) and pipeline stage.
  std::vector<std::vector<int64_t>> model_state_bytes_per_rank;
  std::vector<int64_t> pipeline_stage_per_rank;
  // Rank 0's model state after training: for ZeRO the sharded figures, masters included in
  // the optimizer state (tandem/zero.h, ZeroMemory).
  int64_t parameter_bytes = 0, gradient_bytes = 0, optimizer_state_bytes = 0;
  int64_t peak_gathered_bytes = 0;  // ZeRO-3: most gathered unit parameters alive at once
  // ZeRO-2/3 on CPU with several ranks: the shared-memory block that gradient scratch and
  // gathered units come from, and how many buffers did not fit and took ordinary memory
  // (their collectives go through MPI's fifos, slower).
  int64_t zero_pool_bytes = 0, zero_pool_misses = 0;
  // Checkpoints saved during the loop and rank 0's seconds of training they held (asynchronous:
  // gathering and copying the state only); the command says whether they were asynchronous.
  int64_t checkpoints_saved = 0;
  double checkpoint_stall_seconds = 0.0;
  bool checkpoint_async = false;
  double loss_scale = 1.0;    // fp16: the final dynamic loss scale
  int64_t skipped_steps = 0;  // fp16: steps skipped on overflow
  // Rank 0's traffic per step, from the Communicator's counters over every group: payload per
  // collective, and what a ring algorithm puts on the wire per rank (all-reduce 2(N-1)/N S,
  // reduce-scatter and all-gather (N-1)/N S of the full size S).
  std::map<std::string, double> comm_bytes_per_step;
  // The same payload per group (EngineStats::Communication::groups): for hsdp/hsdp2 "shard"
  // (all-gathers and reduce-scatters within a shard group) and "replicate" (the all-reduce of
  // each shard across the groups).
  std::map<std::string, std::map<std::string, double>> comm_group_bytes_per_step;
  double wire_bytes_per_step = 0.0;
  double comm_engine_seconds = 0.0;  // rank 0's seconds on the communication engine
  // DDP's own all-reduces (rank 0): time, bytes, the part not hidden behind backward.
  double comm_seconds = 0.0, exposed_comm_seconds = 0.0, hidden_fraction = 0.0;
  int64_t comm_bytes = 0;
  // Context parallelism (rank 0): the ring's key/value transfers, and the share hidden behind
  // the attention blocks' compute.
  double ring_seconds = 0.0, ring_exposed_seconds = 0.0, ring_hidden_fraction = 0.0;
  int64_t ring_bytes = 0;
  // Mixture of experts (moe_experts > 0 when the model has MoE layers), over every rank, layer
  // and step: token slots routed to each expert (the least and most loaded expert), those
  // dropped over capacity, the mean load-balancing and router z-losses (no coefficients), and
  // expert parallelism's all-to-all (the slowest rank's seconds, bytes sent per rank per step).
  int ep = 1;
  int64_t moe_experts = 0, moe_tokens_min = 0, moe_tokens_max = 0, moe_routed = 0, moe_dropped = 0;
  double moe_aux_loss = 0.0, moe_z_loss = 0.0;
  double moe_aux_coef = 0.0, moe_z_coef = 0.0;  // their coefficients
  double all_to_all_seconds = 0.0, all_to_all_bytes_per_step = 0.0;
  // Pipeline (pp > 1), the stages of rank 0's replica over the steps after the first: idle over
  // compute time of each stage (theory for balanced stages: (pp - 1) / micro-batches), mean
  // step and compute milliseconds, and the most micro-batches whose activations a stage held.
  std::vector<double> bubble_per_stage;
  std::vector<double> pipeline_step_ms_per_stage, pipeline_compute_ms_per_stage;
  double bubble_measured = 0.0;  // mean of bubble_per_stage
  double bubble_theory = 0.0;
  std::vector<int64_t> peak_live_micro_batches;

  // ---- batch shares (tandem/shares.h; data parallelism over unequal devices)
  std::string batch_shares_mode;      // equal | weights | counts | auto
  std::vector<int64_t> batch_shares;  // each rank's samples per step at the end
  std::vector<double> calibrated_samples_per_second;
  std::vector<double> rank_samples_per_second, rank_forward_samples_per_second;
};

// The layout into the report: strategy, precision, world and dp x tp x pp, parameters,
// accumulation, the pipeline's micro-batches, schedule and cut, and the recomputation. The
// command fills command, model, global_batch and the baseline. Local.
void describe_engine(const Engine& engine, Report& rep);

// The loop's figures from its wall time and each step's milliseconds: throughput, the median
// step (the first step left out: it warms caches and allocators) and, with a baseline, the
// speedup. Local: no communication.
void record_loop(Report& rep, int64_t steps, int64_t samples, double wall_seconds, const std::vector<double>& step_ms);

// The Engine's figures into the report: traffic, DDP's overlap, the loss scaler, the pipeline's
// stages, every rank's peak memory and rank 0's model state. Collective over engine.world():
// every rank calls it, after the loop. `loop` is engine.stats() read when the loop ended, so
// that what the command communicates after it (its global losses, its evaluation's counts) is
// not charged to the steps; the memory figures are read at the call (peaks include evaluation).
void collect_engine_report(Engine& engine, const EngineStats& loop, Report& rep);
void collect_engine_report(Engine& engine, Report& rep);  // loop = engine.stats() now

// The human-readable report (rank 0 prints it).
std::string format_report(const Report& rep);

// The report as one line of JSON: every figure above under its field name, plus "report": true
// and "layout": "dp A x tp B x pp C" (the last line of a --metrics file).
std::string report_json(const Report& rep);

// A --metrics file: a JSON line per step ({"step", "loss", "step_ms"} and, where recorded, the
// step's StepFigures: "lr", "samples_per_second", "grad_norm" (where computed), "loss_scale",
// "peak_rss_bytes", "comm_share"; steps counted from first_step + 1), then the report_json
// line. Throws std::runtime_error naming the path when it cannot be written.
void write_metrics(const std::string& path, const Report& rep);

}  // namespace tandem
