// Pipeline parallelism: a flat torch::nn::Sequential cut between children into contiguous stages,
// one stage per rank of a stage communicator (e.g. ProcessGrid::pp()). A global batch is cut into
// equal micro-batches; activations go forward and their gradients back with the Communicator's
// send/recv. Schedules: GPipe (all forwards, then all backwards: every micro-batch's activations
// alive at once), 1F1B (PipeDream-Flush: after p - s - 1 warm-up forwards one forward, one
// backward; stage s holds at most p - s micro-batches) and Megatron-LM's interleaved 1F1B (the
// model cut into p * v virtual stages, rank r holding the v non-adjacent ones r, r + p, ...:
// activations wrap from rank p - 1 to rank 0 between chunks, and the bubble shrinks from
// (p - 1) / m to (p - 1) / (m v)), and the zero-bubble schedules of Qi et al. 2024 (zb-h1: 1F1B
// with the backward split into B, the input gradients, and W, the weight gradients, W filling
// the bubble; zb-v: two chunks per rank in a V, rank r holding virtual stages r and 2p - 1 - r,
// near-zero bubble at 1F1B's activation memory; tandem/pipeline_schedule.h). Gradients are summed over micro-batches
// with the loss scaled by 1/m, so after train_step the stage's parameters hold exactly the gradient of the mean loss
// over the global batch, as single-process training would.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tandem/comm.h"
#include "tandem/pipeline_schedule.h"

namespace tandem {

// Whether the schedule splits the backward into B and W operations (zb-h1, zb-v).
bool splits_backward(PipelineSchedule s);
// Model chunks per rank the schedule runs with `virtual_stages` asked: 2 for zb-v (which takes
// 1 or 2), `virtual_stages` otherwise.
int pipeline_chunks(PipelineSchedule s, int virtual_stages);

// ---- the split backward (zb-h1, zb-v): deferred weight gradients ----

// tandem::linear is at::linear whose backward can defer the weight (and bias) gradient, as
// Megatron-LM's and the zero-bubble paper's WeightGradStore: while a WeightGradStore::Capture
// lives, its backward computes only the input gradient and queues (grad_output, input) in the
// store; WeightGradStore::flush() later computes weight.grad (and bias.grad) from them with one
// matrix product each and accumulates them through autograd (the parameters' AccumulateGrad
// nodes, so gradient hooks - ZeRO's reduce-scatter - fire as in any backward). It records only
// while a WeightGradStore::Recording lives (the pipeline's forwards of a split schedule) and only
// for leaf parameters; otherwise, and for backwards outside a Capture, it is at::linear. The
// pipeline runs the torch::nn::Linear children of its chunks through it; tensor-parallel linear
// layers, the built-in transformer blocks and the Llama's projections (lora::linear) call it.
// Other layers (norms, embeddings) get their parameters' gradients in B.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias = {});

class WeightGradStore {
 public:
  // While alive (one at a time per process): linear() records its inputs for deferral.
  struct Recording {
    Recording();
    ~Recording();
    Recording(const Recording&) = delete;
    Recording& operator=(const Recording&) = delete;
  };
  // While alive (one at a time per process, around a backward): linear()'s backward queues its
  // weight gradients in `store` instead of computing them.
  struct Capture {
    explicit Capture(WeightGradStore& store);
    ~Capture();
    Capture(const Capture&) = delete;
    Capture& operator=(const Capture&) = delete;
  };
  // Computes the queued weight and bias gradients and accumulates them into the parameters'
  // .grad through autograd; empties the store. Returns whether there was anything to compute.
  bool flush();
  bool empty() const { return entries_.empty(); }
  // For linear()'s backward.
  void add(at::Tensor grad_output, at::Tensor input, at::Tensor weight, at::Tensor bias);

 private:
  struct Entry {
    at::Tensor grad_output, input, weight, bias;
  };
  std::vector<Entry> entries_;
};

// ---- partitions: layers (children of the Sequential) per stage, contiguous, in order ----

// Throws std::invalid_argument naming the problem: more stages than layers, a wrong number of
// entries, a stage with no layer, counts that do not add up to the model's layers.
void validate_partition(const std::vector<int64_t>& layers_per_stage, int64_t layers, int stages);
// balance_partition(costs, stages) and pipeline_order(): tandem/pipeline_schedule.h.
// Balanced by parameter count (a parameterless layer counts as one parameter).
std::vector<int64_t> partition_by_parameters(torch::nn::Sequential& model, int stages);
// Balanced by measured forward+backward time of each layer on `sample_input` (a micro-batch).
// Collective over `comm`: rank 0 measures, its partition is broadcast so all ranks agree. Runs
// backward on rank 0's model, then clears its gradients and restores its buffers (call it
// before training).
std::vector<int64_t> partition_by_time(torch::nn::Sequential& model, const at::Tensor& sample_input, int stages,
                                       Communicator& comm, int reps = 3);
// The cut a --pp-partition option names (parse_partition_option): a list as given; "time":
// partition_by_time on the first `micro_batch` rows of `samples`, moved to `device` (collective
// over `comm`); "params": empty, for Pipeline's cut by parameter count.
std::vector<int64_t> partition_for_option(const std::string& option, torch::nn::Sequential& model,
                                          const at::Tensor& samples, int64_t micro_batch, c10::Device device,
                                          int stages, Communicator& comm);

// loss_fn(output of the model for a micro-batch, its targets) -> scalar mean loss of the micro-batch.
using PipelineLossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

struct PipelineOptions {
  int64_t micro_batches = 1;
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  // Model chunks per rank (kInterleaved; kZBV runs two and takes 1 or 2; the others take 1): the
  // model is cut into stages * chunks virtual stages, chunk c of rank r being virtual stage
  // c * stages + r (kZBV: r and 2 * stages - 1 - r, pipeline_virtual_stage).
  int virtual_stages = 1;
  // Layers per virtual stage (stages * virtual_stages entries, adding up to model->size());
  // empty: partition_by_parameters.
  std::vector<int64_t> partition;
  // Broadcast the step's loss from the last stage so that train_step returns it on every stage.
  bool broadcast_loss = true;
  // Where received activations are placed when the stage has no parameters to tell (else theirs).
  c10::Device device = c10::kCPU;
  // Called before each backward with (micro-batch, is it the step's last backward);
  // e.g. to keep a DistributedDataParallel::NoSyncGuard alive until the last one. With a split
  // schedule (zb-h1, zb-v) it is called before each B and each W (each a backward through
  // autograd), the last one being the step's final W: a parameter accumulates gradients in B
  // (norms, embeddings) or in W (linear layers), so a strategy that needs every parameter's
  // final gradient within one backward cannot use it; ZeRO's per-backward reduce-scatter and
  // the engine's all-reduce after the step can.
  std::function<void(int64_t, bool)> before_backward;
  // Runs the model's children [first, end) (one of this rank's chunks) on an input; empty: the
  // chunk's own forward. ZeRO-3 sets it to gather each layer's parameters around its forward.
  std::function<at::Tensor(int64_t first, int64_t end, const at::Tensor& input)> run_layers;
};

// Accounting of the last train_step (and totals since reset_stats()).
struct PipelineStats {
  int64_t steps = 0;
  int64_t micro_batches = 0;
  double step_seconds = 0.0;     // wall time of the last train_step
  double compute_seconds = 0.0;  // forward + backward + loss in the last step on this stage
  double wait_seconds = 0.0;     // blocked in receives in the last step (includes the bubble)
  // Largest number of micro-batches whose activations (autograd graphs) this stage held at once
  // (forward done, backward B not yet; per chunk with several chunks).
  int64_t peak_live_micro_batches = 0;
  // Peak bytes allocated above the step's start, measured by MemoryMeter (-1 when not installed).
  int64_t peak_activation_bytes = -1;
  int64_t bytes_sent = 0, bytes_received = 0;  // activations and gradients, last step
  // W operations of the last step that computed deferred weight gradients (split schedules).
  int64_t weight_passes = 0;
  // Idle share of the step on this stage: (step - compute) / step.
  double bubble_fraction() const;
  // Idle time over compute time: the quantity whose theory is (p - 1) / m for balanced stages.
  double bubble_ratio() const;
};

// Counting wrapper around LibTorch's CPU allocator (c10::SetCPUAllocator): bytes currently
// allocated by CPU tensors in this process and the peak since reset_peak(). Process-wide and
// opt-in, for measuring activation memory in tests and benchmarks; install() once, early.
class MemoryMeter {
 public:
  static void install();
  static bool installed();
  static int64_t current_bytes();
  static int64_t peak_bytes();
  static void reset_peak();  // peak := current
};

class Pipeline {
 public:
  // `model` is the whole model (same on every stage, e.g. built from the same seed); this rank
  // keeps the children of its chunks (layer_ranges()) as its stage (shared, not copied), which is
  // stage_comm->rank(). Validates the partition and the virtual stages (std::invalid_argument).
  // Not collective.
  Pipeline(torch::nn::Sequential model, CommPtr stage_comm, PipelineOptions opts = {});

  int stage() const { return stage_; }
  int stages() const { return stages_; }
  int virtual_stages() const { return chunks_; }
  bool is_first() const { return stage_ == 0; }  // feeds the inputs (virtual stage 0)
  // Computes the loss (holds the last virtual stage: the last rank, rank 0 with zb-v's V).
  bool is_last() const { return stage_ == pipeline_stage_owner(last_virtual(), stages_, v_shape_).first; }
  // The children [first, end) of the whole model that each of this rank's chunks holds, in chunk order.
  const std::vector<std::pair<int64_t, int64_t>>& layer_ranges() const { return ranges_; }
  // The one contiguous range of a rank with one chunk; std::logic_error with several.
  int64_t first_layer() const;
  int64_t end_layer() const;
  // The rank holding each child of the whole model.
  std::vector<int> layer_owners() const;
  const std::vector<int64_t>& partition() const { return partition_; }  // layers per virtual stage
  const PipelineOptions& options() const { return opts_; }
  // PipelineOptions::run_layers, for a strategy built after the pipeline.
  void set_run_layers(std::function<at::Tensor(int64_t, int64_t, const at::Tensor&)> run) {
    opts_.run_layers = std::move(run);
  }
  // Every child of this rank's chunks, named by its index in the whole model (so parameter names
  // are the whole model's); the pipeline runs the chunks, never this module's forward.
  torch::nn::Sequential stage_module() const { return stage_module_; }
  // The parameters this stage trains (build the optimizer over these).
  std::vector<at::Tensor> parameters() const;

  // One training step over a global batch, on every stage. Stage 0 needs `inputs`, the last stage
  // `targets` ([B, ...], B divisible by micro_batches, else std::invalid_argument); others may pass
  // undefined tensors (passing the batch everywhere makes every stage check it). Accumulates into
  // the stage's .grad() (zero them before, as usual). Returns the mean loss over the batch (a
  // float64 scalar on the last stage, on every stage with broadcast_loss; undefined otherwise).
  at::Tensor train_step(const at::Tensor& inputs, const at::Tensor& targets, const PipelineLossFn& loss_fn);

  // Forward only (no autograd), micro-batched; returns the model's output on the last stage
  // (undefined on the others).
  at::Tensor forward(const at::Tensor& inputs);

  const PipelineStats& stats() const { return stats_; }
  void reset_stats();

  // The operations a stage runs in one step, in order (for tests and docs); `chunks` is the
  // virtual stages per rank (1 unless interleaved; zb-v runs 2 whatever it is).
  static std::vector<PipelineOp> schedule_for(PipelineSchedule s, int stage, int stages, int64_t micro_batches,
                                              int chunks = 1);

 private:
  at::Tensor run_chunk(int chunk, const at::Tensor& x);
  int64_t last_virtual() const { return static_cast<int64_t>(stages_) * chunks_ - 1; }
  int64_t virtual_stage(int chunk) const { return pipeline_virtual_stage(chunk, stage_, stages_, v_shape_); }

  torch::nn::Sequential stage_module_;
  std::vector<torch::nn::Sequential> chunk_modules_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;
  CommPtr comm_;
  PipelineOptions opts_;
  std::vector<int64_t> partition_;
  int stage_ = 0, stages_ = 1, chunks_ = 1;
  bool v_shape_ = false, split_ = false;
  c10::Device device_{c10::kCPU};
  PipelineStats stats_;
};

}  // namespace tandem
