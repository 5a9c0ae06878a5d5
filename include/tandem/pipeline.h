// Pipeline parallelism: a flat torch::nn::Sequential cut between children into contiguous stages,
// one stage per rank of a stage communicator (e.g. ProcessGrid::pp()). A global batch is cut into
// equal micro-batches; activations go forward and their gradients back with the Communicator's
// send/recv. Schedules: GPipe (all forwards, then all backwards: every micro-batch's activations
// alive at once), 1F1B (PipeDream-Flush: after p - s - 1 warm-up forwards one forward, one
// backward; stage s holds at most p - s micro-batches) and Megatron-LM's interleaved 1F1B (the
// model cut into p * v virtual stages, rank r holding the v non-adjacent ones r, r + p, ...:
// activations wrap from rank p - 1 to rank 0 between chunks, and the bubble shrinks from
// (p - 1) / m to (p - 1) / (m v)). Gradients are summed over micro-batches with the loss scaled
// by 1/m, so after train_step the stage's parameters hold exactly the gradient of the mean loss
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

enum class PipelineSchedule { kGPipe, k1F1B, kInterleaved };
const char* to_string(PipelineSchedule s);
// "gpipe", "1f1b" or "interleaved"; throws std::invalid_argument otherwise.
PipelineSchedule parse_pipeline_schedule(const std::string& s);

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
  // Model chunks per rank (kInterleaved only; the others take 1): the model is cut into
  // stages * virtual_stages virtual stages and chunk c of rank r is virtual stage c * stages + r.
  int virtual_stages = 1;
  // Layers per virtual stage (stages * virtual_stages entries, adding up to model->size());
  // empty: partition_by_parameters.
  std::vector<int64_t> partition;
  // Broadcast the step's loss from the last stage so that train_step returns it on every stage.
  bool broadcast_loss = true;
  // Where received activations are placed when the stage has no parameters to tell (else theirs).
  c10::Device device = c10::kCPU;
  // Called before each backward with (micro-batch, is it the step's last backward);
  // e.g. to keep a DistributedDataParallel::NoSyncGuard alive until the last one.
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
  // Largest number of micro-batches whose activations (autograd graphs) this stage held at once.
  int64_t peak_live_micro_batches = 0;
  // Peak bytes allocated above the step's start, measured by MemoryMeter (-1 when not installed).
  int64_t peak_activation_bytes = -1;
  int64_t bytes_sent = 0, bytes_received = 0;  // activations and gradients, last step
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
  bool is_first() const { return stage_ == 0; }           // feeds the inputs (virtual stage 0)
  bool is_last() const { return stage_ == stages_ - 1; }  // computes the loss (the last virtual stage)
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
  // virtual stages per rank (1 unless interleaved).
  static std::vector<PipelineOp> schedule_for(PipelineSchedule s, int stage, int stages, int64_t micro_batches,
                                              int chunks = 1);

 private:
  at::Tensor run_chunk(int chunk, const at::Tensor& x);

  torch::nn::Sequential stage_module_;
  std::vector<torch::nn::Sequential> chunk_modules_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;
  CommPtr comm_;
  PipelineOptions opts_;
  std::vector<int64_t> partition_;
  int stage_ = 0, stages_ = 1, chunks_ = 1;
  c10::Device device_{c10::kCPU};
  PipelineStats stats_;
};

}  // namespace tandem
