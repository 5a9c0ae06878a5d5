// tandem::Engine: the one entry point for training a model under any layout. Give it a model
// (any torch::nn::Module; a torch::nn::Sequential when it is cut into pipeline stages or
// converted to tensor parallelism by the built-in conversion), an optimizer description and a
// typed ParallelConfig; it builds the dp x tp x pp grid, the tensor-parallel form, the pipeline
// stage, DDP or ZeRO over the data-parallel ranks and mixed precision, and then runs steps,
// saves and loads resharding checkpoints, and reports communication, memory and the bubble.
// Every rank constructs it with the same arguments (collective). The configuration is checked
// once, at construction, and a conflict throws std::invalid_argument naming the settings.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/activation_checkpoint.h"
#include "tandem/checkpoint.h"
#include "tandem/comm.h"
#include "tandem/ddp.h"
#include "tandem/moe.h"
#include "tandem/optim.h"
#include "tandem/pipeline.h"
#include "tandem/precision.h"
#include "tandem/runtime.h"
#include "tandem/tensor_parallel.h"

namespace tandem {

class ProcessGrid;

// How the data-parallel ranks share the work: one worker, replicas averaging gradients (DDP),
// or ZeRO stage 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters). Hybrid
// sharding (FSDP's HYBRID_SHARD and _HYBRID_SHARD_ZERO2, DeepSpeed's hpZ, torchtitan's
// dp_replicate x dp_shard): ZeRO-3 (hsdp) or ZeRO-2 (hsdp2) within groups of
// ParallelConfig::shard_group consecutive data-parallel ranks, the groups replicas of each other
// whose gradient shards are averaged by an all-reduce between the ranks holding the same shard.
enum class Strategy { kSingle, kDDP, kZero1, kZero2, kZero3, kHsdp, kHsdp2 };
// "single" | "ddp" | "zero1" | "zero2" | "zero3" | "hsdp" | "hsdp2"; anything else throws
// std::invalid_argument listing the choices. The one place strategy names are read.
Strategy parse_strategy(const std::string& name);
const char* to_string(Strategy s);
// The ZeRO stage (1-3; hsdp 3, hsdp2 2), 0 for single and ddp.
int zero_stage(Strategy s);
inline bool is_single(Strategy s) { return s == Strategy::kSingle; }
inline bool is_ddp(Strategy s) { return s == Strategy::kDDP; }
inline bool is_hybrid(Strategy s) { return s == Strategy::kHsdp || s == Strategy::kHsdp2; }

// DDP's gradients on the wire: as they are, rounded to bf16 / fp16, or PowerSGD's low-rank
// factors (ParallelConfig::powersgd).
enum class Compression { kNone, kBF16, kFP16, kPowerSGD };
Compression parse_compression(const std::string& name);  // "none" | "bf16" | "fp16" | "powersgd"
const char* to_string(Compression c);

// Where a pipeline's stages are cut: balanced parameter counts (DeepSpeed's default), balanced
// measured forward+backward time of each layer on one micro-batch, or the layers per stage.
enum class PartitionMethod { kParameters, kTime, kLayers };
struct Partition {
  PartitionMethod method = PartitionMethod::kParameters;
  std::vector<int64_t> layers;  // kLayers: one positive count per stage
};
// "params" | "time" | "3,7" (one count per stage, virtual stage with an interleaved schedule);
// throws std::invalid_argument otherwise.
Partition parse_partition(const std::string& text, int stages);
std::string to_string(const Partition& p);

struct ParallelConfig {
  Strategy strategy = Strategy::kDDP;
  // hsdp, hsdp2: data-parallel ranks per shard group (it must divide the data-parallel size);
  // 0: the ranks per host, when every host holds as many consecutive ranks (mpirun's by-slot
  // mapping), so that all-gathers and reduce-scatters stay inside a host and only the
  // all-reduce of each shard crosses hosts. Engine::config() holds the group it resolved.
  int shard_group = 0;
  Precision precision = Precision::kFP32;  // compute precision; fp32 masters for bf16/fp16
  LossScalerOptions loss_scaler;           // fp16's dynamic loss scaling
  // Layout: each replica spans tp x pp x cp ranks; the world size / (tp * pp * cp) replicas are
  // data parallel.
  int tp = 1;  // tensor-parallel ranks (Megatron column/row-parallel layers)
  // Megatron-LM sequence parallelism over the tp ranks (needs tp > 1 and a converter that
  // implements it, llama::tensor_parallel): the activations outside the tensor-parallel regions
  // (residual stream, norms) split along the sequence, all-gathers and reduce-scatters in place of
  // the all-reduces. Sequences must be a multiple of tp long (of 2 * cp * tp with cp).
  bool sequence_parallel = false;
  int pp = 1;  // pipeline stages
  // Context-parallel ranks (tandem/context_parallel.h): each sequence split over cp ranks (2 * cp
  // chunks, load-balanced for causal attention), attention as ring attention. The model must be
  // a Sequential whose position-dependent layers implement cp::ContextParallel (Llama's decoder
  // layers). Inputs [B, T, ...] with T a multiple of 2 * cp; targets [B, T, ...] are split the
  // same way and the loss taken per token on each rank; other targets (one per sample) see the
  // output gathered over the cp ranks. The cp ranks' gradients are reduced with dp's.
  int cp = 1;
  // Expert parallelism (tandem/moe.h): the experts of every MoE layer (moe::ExpertParallel) spread
  // over groups of ep consecutive data-parallel ranks, each rank's tokens dispatched to their
  // experts' owners and combined back by all-to-all. The dense weights stay data-parallel over
  // the dp ranks, the experts over the dp / ep ranks holding the same ones: under zero1-3 by
  // ZeRO-1 whatever the stage (weights and gradients whole, gradients all-reduced in buckets
  // during backward, fp32 masters and optimizer state sharded), else whole on each, their
  // gradients averaged at the step. ep must divide the data-parallel ranks and every MoE
  // layer's experts. With --tp each tp rank
  // has its ep groups, whose experts are that rank's parts (the tp form of moe::SparseMoeBlock).
  // --max-grad-norm clips by the whole model's norm, the experts' included, and fp16 skips an
  // overflowed step for the whole model; recomputed layers (activation checkpointing, whole or
  // selective) recompute their kept experts. Any strategy shards the dense weights (ddp, zero1-3,
  // hsdp, hsdp2). Not with --cp (MoE layers are not context-parallel).
  int ep = 1;
  int64_t micro_batches = 1;  // per replica and step, when pp > 1
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  // Model chunks per pipeline rank (interleaved schedule only): pp * virtual_stages virtual
  // stages, rank r holding r, r + pp, ...; the partition then lists one count per virtual stage.
  int virtual_stages = 1;
  Partition partition;
  // Without a pipeline: each replica's batch runs as this many micro-batches before one
  // optimizer step (DDP and ZeRO-1 communicate once per step, ZeRO-2/3 after each backward).
  int64_t grad_accum = 1;
  double max_grad_norm = 0.0;  // clip the global gradient norm (whole model, across shards); 0: off
  // Recompute the activations of these layers in backward instead of keeping them
  // (tandem/activation_checkpoint.h; needs a Sequential: its children are the layers).
  ActivationCheckpointing activation_checkpointing;
  // DDP
  Compression compress = Compression::kNone;
  PowerSGDOptions powersgd;  // with Compression::kPowerSGD: rank, warm-up steps (tandem/ddp.h)
  int64_t bucket_mb = 0;     // gradient buckets (DDP, ZeRO-1/2); 0: the strategy's default (DDP 25, ZeRO 8)
  bool find_unused = false;  // DDP: parameters without a gradient count as zero instead of failing
  bool overlap = true;       // DDP: all-reduce buckets during backward
  bool communicate = true;   // DDP: false only to measure the compute-only ceiling
};

// Checks a configuration for `world` ranks, and a global batch when `global_batch` > 0 (it
// must split over the replicas and, with a pipeline, into micro-batches). Throws
// std::invalid_argument naming the conflicting settings and what to use instead.
void validate(const ParallelConfig& c, int world, int64_t global_batch = 0);
// The data-parallel replicas of a valid configuration: world / (tp * pp * cp).
int data_parallel_size(const ParallelConfig& c, int world);

// The learning rate of every step (0-based) of a run of total_steps: a linear warmup over
// warmup_steps from warmup_start to peak, then a cosine decay to min_ratio * peak at the last
// step, or the peak kept (cosine = false). One schedule for every loop. A step may be
// fractional: a run whose global batch is a fraction of the one the schedule counts steps of
// (an elastic run at fewer workers with --elastic-lr scale) advances it by that fraction.
struct LrSchedule {
  double peak = 1e-3;
  double warmup_start = 0.0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  bool cosine = true;
  double min_ratio = 0.0;
  double at(double step) const;
};

// loss_fn(model output of a micro-batch, its targets) -> a scalar loss (see LossReduction).
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

enum class LossReduction {
  // loss_fn returns the mean over its micro-batch; micro-batches are weighted by their rows and
  // the replicas averaged (DDP's convention: exact when every replica has as many rows).
  kMean,
  // loss_fn returns the sum over its loss terms (tokens, samples) and StepOptions::terms counts
  // them over the whole global batch: the gradient is that of the mean over every term of the
  // global batch, whatever the layout (Megatron's per-token loss).
  kSum,
};

struct StepOptions {
  LossReduction reduction = LossReduction::kMean;
  double terms = 0.0;        // kSum: loss terms in the global batch (every rank passes the same)
  double loss_weight = 1.0;  // this rank's loss is multiplied by it (unequal batch shares)
};

struct EngineOptions {
  // Tensor parallelism: converts the dense Sequential into its tensor-parallel form over the tp
  // group (collective), honouring the options' sequence_parallel (ParallelConfig's) or refusing it.
  // Default: tp::tensor_parallel (Linear pairs, Tandem's transformer; refuses sequence parallelism).
  std::function<torch::nn::Sequential(torch::nn::Sequential dense, CommPtr tp, const tp::TensorParallelOptions& opts)>
      tensor_parallel;
  // Initial values of the parameters it holds, read by every rank for only the elements that rank
  // holds, after the model is cut, converted and sharded (DDP's broadcast and ZeRO's shards come
  // first, so the source's values win). Null: the model keeps the values it was given.
  std::shared_ptr<const ParameterSource> init_from;
  // PartitionMethod::kTime: a batch of inputs whose first micro-batch is timed layer by layer.
  at::Tensor partition_sample;
  // The model's name, recorded in checkpoints; load() refuses a checkpoint of another name.
  std::string model_name = "model";
  // Frozen parameters (requires_grad false: a LoRA base) get no gradient and no optimizer state
  // under any strategy; ZeRO-3 still shards them. false: checkpoints hold only the trained
  // parameters (and buffers), and a resume takes the frozen ones from init_from again.
  bool save_frozen = true;
};

// This rank's figures since construction or reset_stats(), one group per component: a reader
// finds a component's figures together, and a new component adds a group of its own.
struct EngineStats {
  int64_t steps = 0;  // optimizer steps taken, those an fp16 overflow skipped included

  // Every communicator the engine uses (world and the grid's groups).
  struct Communication {
    std::map<std::string, OpStats> ops;  // payload per operation, summed over the communicators
    double seconds = 0.0;                // seconds on the communication engine, all operations
    double wire_bytes = 0.0;             // bytes a ring algorithm puts on the wire for that payload
    // The same payload per group: "world", and by layout "tp", "pp", "dp", "cp", "dp_cp", or for
    // hsdp/hsdp2 "shard" (within a shard group) and "replicate" (across the groups). Groups and
    // operations without a call are left out.
    std::map<std::string, std::map<std::string, OpStats>> groups;
  } comm;

  // DDP only: its gradient all-reduces (zero under another strategy).
  struct DataParallel {
    double comm_seconds = 0.0;     // seconds in its all-reduces
    double exposed_seconds = 0.0;  // the part not hidden behind backward
    double hidden_fraction = 0.0;  // the hidden share, 1 - exposed / comm
    int64_t bytes = 0;             // payload all-reduced
  } ddp;

  // Bytes this rank holds.
  struct Memory {
    int64_t parameter_bytes = 0;        // parameters held now
    int64_t gradient_bytes = 0;         // gradients held now
    int64_t optimizer_state_bytes = 0;  // optimizer state held now (fp32 masters included)
    int64_t peak_gathered_bytes = 0;    // ZeRO-3: most gathered parameters alive at once
    // ZeRO stages 2, 3 on CPU (tandem/zero.h): the block that scratch and gathered units are
    // carved from, and how many of those buffers did not fit in it.
    int64_t pool_bytes = 0;
    int64_t pool_misses = 0;
    int64_t peak_rss_bytes = 0;  // this process's resident peak
    // The most CPU memory allocated above a step's start during its forward and backward
    // passes: activations and the step's transient buffers, measured by MemoryMeter
    // (tandem/pipeline.h) where the process installed it, else -1.
    int64_t peak_activation_bytes = -1;
  } memory;

  // Seconds of the forward-backward passes spent recomputing checkpointed segments in backward
  // (--activation-checkpointing; this process's, all threads).
  double recompute_seconds = 0.0;

  // Pipeline only: this stage's schedule, over the steps after the first.
  struct PipelineStage {
    double step_ms = 0.0;     // mean step milliseconds
    double compute_ms = 0.0;  // mean compute milliseconds
    // Idle over compute (theory (pp - 1) / (m v), v the virtual stages).
    double bubble = 0.0;
    // The most micro-batches (micro-batch and chunk pairs) held at once.
    int64_t peak_live_micro_batches = 0;
  } pipeline;

  // The loss scaler (tandem/precision.h; disabled for fp32 and bf16: scale 1, never skips).
  struct LossScaling {
    double scale = 1.0;         // the current loss scale
    int64_t skipped_steps = 0;  // steps skipped for an overflow
  } scaler;

  // Context parallelism (cp > 1): this rank's ring-attention transfers of key/value blocks and
  // their gradients (tandem/context_parallel.h), on the thread that ran the steps.
  struct ContextParallel {
    double transfer_seconds = 0.0;  // on the communication engine
    double exposed_seconds = 0.0;   // waited for, not hidden behind a block's compute
    double hidden_fraction = 0.0;   // 1 - exposed / transfer
    int64_t bytes = 0;              // sent
  } cp;

  // Mixture-of-experts layers (tandem/moe.h) on this rank's thread: their routing and
  // auxiliary losses, and the all-to-all of expert parallelism.
  moe::MoeStats moe;

  // Checkpoints saved with save().
  struct Checkpointing {
    int64_t saved = 0;  // checkpoints saved
    // The seconds save() held training (asynchronous: gathering and copying the state; the write
    // runs beside the steps).
    double stall_seconds = 0.0;
  } checkpoints;
};

// The model's forward on one input: [B, ...] -> output.
using ForwardFn = std::function<at::Tensor(const at::Tensor&)>;

class Engine {
 public:
  // Collective over rt.world(). The model is moved to rt.device(); parameters are broadcast so
  // every replica starts equal. `forward` runs the model (the engine calls it instead of a
  // Sequential's forward; null for a Sequential). Throws std::invalid_argument for an invalid
  // configuration, or a model that cannot take it (tp or pp > 1 need a Sequential).
  Engine(Runtime& rt, std::shared_ptr<torch::nn::Module> model, ForwardFn forward, OptimizerOptions optimizer,
         ParallelConfig config, EngineOptions options = {});
  // Any module holder whose forward takes and returns one tensor (a Sequential, or a user
  // module made with TORCH_MODULE): its forward is called.
  template <typename M>
  Engine(Runtime& rt, torch::nn::ModuleHolder<M> model, OptimizerOptions optimizer, ParallelConfig config,
         EngineOptions options = {})
      : Engine(
            rt, std::shared_ptr<torch::nn::Module>(model.ptr()),
            [m = model.ptr()](const at::Tensor& x) -> at::Tensor { return m->forward(x); }, std::move(optimizer),
            std::move(config), std::move(options)) {}
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // One training step over this replica's share of the global batch (every tp, pp and cp rank
  // of a replica passes the same batch; with cp > 1 each cp rank takes its part of the sequence): zero the gradients,
  // forward and backward over the micro-batches (the pipeline's schedule, or gradient accumulation), loss scaling,
  // clipping and the optimizer step. Returns this replica's loss for the step (a detached scalar; the average over the
  // replicas is the global batch's loss). An fp16 overflow skips the update.
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss_fn,
                  const StepOptions& options = {});

  // The same step in parts, for custom loops (no pipeline: pp must be 1):
  //   engine.zero_grad(); auto out = engine.forward(x); engine.backward(loss_fn(out, y));
  //   engine.optimizer_step();
  // Several forward/backward pairs between zero_grad() and optimizer_step() accumulate.
  // With cp > 1, forward() takes the whole sequence and returns this rank's part of the output
  // (cp::split_sequence of the targets along dim 1 gives the matching targets).
  void zero_grad();
  at::Tensor forward(const at::Tensor& inputs);
  void backward(const at::Tensor& loss);  // scales the loss (fp16) and back-propagates
  bool optimizer_step();                  // false when an fp16 overflow skipped it
  // forward + backward over this replica's batch, as step() runs them, without zero_grad and
  // optimizer_step; returns the replica's loss.
  at::Tensor forward_backward(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss_fn,
                              const StepOptions& options = {});

  // Inference forward without autograd on every rank (ZeRO-3 gathers, tp ranks compute
  // together, a pipeline runs its stages): the output where is_output_rank(), undefined on
  // the other stages of a pipeline.
  at::Tensor predict(const at::Tensor& inputs);
  // One rank per replica holds the replica's output to count: tp rank 0 of the last stage.
  bool is_output_rank() const;
  // Inference over rows [0, n) of `inputs`: replica r takes the blocks r, r + dp, ... of
  // `rows` rows; every rank runs the same number of forwards (an empty block runs one row,
  // which keeps ZeRO-3's gathers and a pipeline's stages in step), and the output rank of each
  // replica calls score(output, from, to) for its real blocks. The model is in evaluation mode
  // during, in training mode after. Collective.
  using ScoreFn = std::function<void(const at::Tensor& output, int64_t from, int64_t to)>;
  void evaluate(const at::Tensor& inputs, int64_t n, int64_t rows, const ScoreFn& score);
  void train(bool on = true);  // training or evaluation mode of the model

  void set_lr(double lr);
  double lr() const;

  // Checkpoints (tandem/checkpoint.h's format and guarantees: atomic, sharded, loadable under any
  // strategy, layout and world size). save(): collective; writes root/step-N (meta.step) and
  // returns that directory; the engine fills the layout, strategy, precision, loss scaler and
  // model name. load(): a checkpoint directory, or a root whose newest complete checkpoint is
  // taken (throws std::runtime_error naming the root when it holds none); restores parameters,
  // optimizer state, loss scaler and this rank's RNG, and returns the saved meta. Collective.
  //
  // With options.async set, save() returns once the state is copied and a background thread
  // writes it; the engine commits it (collective) at the first optimizer_step() after every
  // rank's writer is done, at the next save() or load(), or at wait_checkpoint(). Call
  // wait_checkpoint() before the engine goes: a save never committed is lost (the previous
  // checkpoint stays the newest).
  std::string save(const std::string& root, CheckpointMeta meta = {}, const CheckpointSaveOptions& options = {});
  CheckpointMeta load(const std::string& dir_or_root, CheckpointLoadOptions options = {});
  // Collective: commits the asynchronous save in flight, if any, and returns its directory
  // ("" when none was in flight). Throws as save() does when a rank's write failed.
  std::string wait_checkpoint();
  // The whole model's fp32 values (float64 for parameters given in float64) by the dense model's
  // parameter names, on the CPU, on every rank (collective: each element comes from the rank
  // that holds it as replica 0, tandem/placement.h).
  std::map<std::string, at::Tensor> full_parameters();

  EngineStats stats() const;
  void reset_stats();

  // Layout and parts, for reports and custom loops.
  const ParallelConfig& config() const;
  int world_size() const;
  int dp_size() const;  // data-parallel replicas (the cp ranks of a replica take the same samples)
  int dp_rank() const;
  c10::Device device() const;  // this rank's (the Runtime's)
  CommPtr world() const;
  CommPtr dp_group() const;                // the data-parallel replicas' group (size dp_size())
  CommPtr ep_group() const;                // expert parallelism's group (null when ep == 1)
  const ProcessGrid* grid() const;         // null when tp * pp * cp == 1
  const Pipeline* pipeline() const;        // null when pp == 1
  std::vector<int64_t> partition() const;  // layers per stage (pp > 1)
  torch::nn::Module& module();             // what runs on this rank (its stage, its shards)
  // This rank's (stage's, shard's) trainable parameters; under --ep its kept experts too, last.
  std::vector<at::Tensor> trained_parameters() const;
  const LossScaler& loss_scaler() const;
  int64_t parameters() const;            // scalar parameters of the whole dense model
  int64_t trainable_parameters() const;  // those of them that require gradients
  // Seconds of the last step's forward passes and losses on this rank, less what ZeRO-3 waited
  // for other ranks' parameters: this rank's own forward compute (for batch-share calibration).
  double last_forward_seconds() const;
  // The global gradient norm (whole model, before clipping) of the last optimizer step, where
  // the step computed it (max_grad_norm > 0); negative otherwise.
  double last_grad_norm() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem
