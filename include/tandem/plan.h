// The scaling model behind `tandem plan` and `tandem bench`: given a model and a cluster
// description it predicts, for every data x context x tensor x pipeline layout and ZeRO stage,
// the memory per device and the step time (compute from FLOPs and the device rate, collectives
// by the alpha-beta model, bucketed overlap with backward, pipeline bubble, ring attention's
// transfers), and ranks the feasible layouts. Plain C++17 (no LibTorch) except the calibration functions at the end.
// Every function is deterministic; bad descriptions throw std::invalid_argument naming the field.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tandem/pipeline_schedule.h"

namespace tandem {
class Runtime;
struct ParallelConfig;
struct Report;
}  // namespace tandem

namespace tandem::plan {

// ---------------------------------------------------------------- model description
// One child of a flat Sequential (Tandem's dense built-ins), per sample: what the pipeline cuts
// between (balanced by parameter count as tandem::partition_by_parameters does) and what tensor
// parallelism splits (Linear pairs: column-parallel, then row-parallel; the rest replicated).
struct LayerSpec {
  std::string name;  // "linear", "conv", "relu", "pool", "flatten", "batchnorm"
  double parameters = 0;
  double forward_flops = 0;  // per sample
  double input_elems = 0;    // per sample
  double output_elems = 0;   // per sample (what crosses a stage boundary after this layer)
  std::string tp;            // "" (replicated), "column" or "row"
};

// Mixture-of-experts blocks (Mixtral's block_sparse_moe, tandem/moe.h): in every `every`-th
// block the MLP is a router (hidden -> experts, counted with the dense parameters) over
// `experts` SwiGLU experts of width `intermediate` (3 * hidden * intermediate parameters each),
// of which each token takes `top_k`. ModelSpec::parameters counts every expert.
//
// The model behind the estimate (balanced routing: every expert gets top_k * T / experts of the
// T tokens a rank holds, as the load-balancing loss aims for):
//  - compute: top_k * T token slots per MoE layer, 3 matmuls of hidden x intermediate each,
//    whatever the ep; with a capacity factor c < 1, c of them (the rest dropped);
//  - activations: per token slot the dispatched input and the expert's output (2 hidden) and
//    SwiGLU's four intermediate-wide tensors, per token the router's logits and probabilities
//    (2 experts). Dropless: top_k * T slots (balanced); with a capacity factor c: c * top_k * T,
//    the most a rank's experts may receive whatever the routing (each of its experts takes at
//    most ceil(c * top_k * T / experts) slots from each of the ep ranks);
//  - expert parallelism (Layout::ep): experts / ep experts per rank, their state sharded by ZeRO
//    over the dp * cp / ep ranks holding the same experts (the dense part over dp * cp); per MoE
//    layer and micro-batch 4 all-to-alls (dispatch and combine in forward, their gradients in
//    backward), each sending (ep - 1) / ep of the rank's kept slots, hidden values each, in the
//    training precision; on the critical path (nothing to hide behind: the experts wait for
//    their tokens).
struct MoeSpec {
  int64_t experts = 0;  // 0: no MoE blocks
  int64_t top_k = 2;
  int64_t intermediate = 0;      // each expert's SwiGLU width
  int64_t every = 1;             // every `every`-th block is MoE (1: all, Mixtral; 2: alternating, Switch)
  double capacity_factor = 0.0;  // 0: dropless
};

struct ModelSpec {
  std::string name = "custom";
  std::string kind = "transformer";  // transformer | dense (mlp/cnn: no heads, no sequence)
  double parameters = 0;             // Psi, scalar parameters
  // Those that train (LoRA adapters; 0: all). Frozen ones keep their parameter memory (ZeRO-3
  // shards them) but hold no gradient and no optimizer state.
  double trainable_parameters = 0;
  int64_t layers = 1;  // repeated blocks (pipeline stages cut between them)
  int64_t hidden = 0;  // d_model (transformer), widest layer (dense)
  int64_t heads = 0;   // attention heads (transformer); 0 for dense
  // Key/value heads (grouped-query attention); 0: as many as `heads`. Only context
  // parallelism's ring traffic depends on it: each rank sends k and v of
  // hidden * kv_heads / heads values per token.
  int64_t kv_heads = 0;
  int64_t seq = 1;  // tokens per sample (1 for images)
  int64_t vocab = 0;
  // Forward FLOPs per sample; 0: transformer estimate 2*Psi*seq + 4*layers*seq^2*hidden.
  double forward_flops_per_sample = 0;
  // Activation bytes kept for backward per sample (all layers, training precision); 0: the
  // transformer estimate of Korthikanti et al. (16-bit, per layer seq*hidden*(34 + 5*heads*seq/hidden)
  // for Megatron's layers with dropout and unfused attention), less what the two flags below
  // leave out.
  double activation_bytes_per_sample = 0;
  // Transformers: backward keeps the seq x seq attention scores (unfused attention). Tandem's
  // models call at::scaled_dot_product_attention, whose fused kernels keep none.
  bool attention_scores = false;
  // Transformers: dropout masks are kept (Tandem's models have no dropout).
  bool dropout = false;
  // Children of the Sequential, in order (the dense built-ins mlp, cnn, cnn_bn); empty for
  // descriptions by shape. With them, pipeline and tensor-parallel layouts are modelled layer by layer.
  std::vector<LayerSpec> children;
  MoeSpec moe;  // transformers described by shape only
};

bool is_moe(const ModelSpec& m);
int64_t moe_layers(const ModelSpec& m);               // blocks with a MoE MLP: layers / every
double expert_parameters(const ModelSpec& m);         // every expert of every MoE block
double moe_slots_per_token(const ModelSpec& m);       // slots computed: top_k * min(1, c) (dropless: top_k)
double moe_slots_held_per_token(const ModelSpec& m);  // slots held for backward: top_k * c (dropless: top_k)
// Bytes one rank sends in one all-to-all of one MoE layer for `tokens` of its tokens over an ep
// group: (ep - 1) / ep * slots * hidden * elem_bytes.
double all_to_all_bytes(const ModelSpec& m, int ep, double tokens, double elem_bytes);

// Built-in descriptions: Tandem's reference models (mlp, cnn, cnn_bn, transformer_tiny), counted
// analytically with the same shapes as models/, and published ones (resnet50, resnet101, gpt2,
// gpt3-1.3b, zero-7.5b, llama-7b, llama-13b, llama-70b, mixtral-8x7b) and moe_tiny, a small
// Mixtral-shaped model.
ModelSpec builtin_model(const std::string& name);
std::vector<std::string> builtin_model_names();
// A transformer from its shape: parameters 12*L*h^2 + (vocab+seq)*h unless `parameters` > 0.
ModelSpec transformer_model(int64_t layers, int64_t hidden, int64_t heads, int64_t seq, int64_t vocab,
                            double parameters = 0);
// A Llama-family model (RMSNorm, rotary positions, grouped-query attention, SwiGLU) from its
// shape, with the activations its training keeps counted from Tandem's layers (fp32 bytes;
// halved in 16-bit) rather than Megatron's GPT estimate, which undercounts SwiGLU and RoPE.
ModelSpec llama_model(int64_t layers, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t intermediate,
                      int64_t seq, int64_t vocab, double parameters);
// A Mixtral-family model (Llama's attention, every block's MLP a MoE block of `experts` SwiGLU
// experts, untied embeddings): parameters counted from the shape, activations as llama_model's
// without the dense MLP (the MoE blocks' are counted from ModelSpec::moe).
ModelSpec mixtral_model(int64_t layers, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t intermediate,
                        int64_t experts, int64_t top_k, int64_t seq, int64_t vocab);
// A Hugging Face config.json's model: model_type "llama" (llama_model) or "mixtral" (mixtral_model,
// from num_local_experts and num_experts_per_tok), parameters counted from the shape (tied
// embeddings once), at `seq` tokens per sample (0: 4096, or max_position_embeddings if smaller).
// Throws std::invalid_argument naming a missing field or another model_type.
ModelSpec hf_config_model(const std::string& config_json, int64_t seq = 0);
// Forward FLOPs per sample; MoE blocks count the experts' token slots, not every expert.
double forward_flops_per_sample(const ModelSpec& m);
// Per sample, all layers. With sequence_parallel (and tp > 1) the parts outside the
// tensor-parallel layers (norms, residual, dropout masks) are split over tp too.
double activation_bytes_per_sample(const ModelSpec& m, int tp = 1, bool sequence_parallel = false);
void validate(const ModelSpec& m);  // throws std::invalid_argument

// ---------------------------------------------------------------- cluster description
struct DeviceSpec {
  std::string name;
  double memory_bytes = 0;      // memory per device
  double flops = 0;             // dense peak FLOP/s in 16-bit (tensor cores)
  double flops_fp32 = 0;        // dense peak FLOP/s in float32
  double memory_bandwidth = 0;  // bytes/s (optimizer steps are bound by it)
  double mfu = 0.4;             // achieved fraction of peak on training kernels (assumed; see docs)
};

struct LinkSpec {
  std::string name;
  double bandwidth = 0;  // bytes/s per device (intra-node) or per node (inter-node), one direction
  double latency = 0;    // alpha, seconds per message step
};

// Nodes of one kind; a cluster of several groups is "mixed": synchronous training runs at the
// pace of the slowest device and fits in the smallest memory.
struct NodeGroup {
  int nodes = 1;
  int devices_per_node = 1;
  DeviceSpec device;
};

struct ClusterSpec {
  std::string name = "custom";
  std::vector<NodeGroup> groups;
  LinkSpec intra;  // within a node
  LinkSpec inter;  // between nodes (bandwidth per node)
  // Fraction of bucketed gradient communication that can run beside backward (1: GPUs with a
  // communication stream; measured on shared CPU cores it is close to 0).
  double overlap = 1.0;
  // CPU clusters: workers may outnumber cores (time-shared); compute rates come from a Calibration.
  bool cpu = false;
  double framework_overhead_s = 0;  // fixed seconds per step (launch, data, bookkeeping)
};

int total_devices(const ClusterSpec& c);
int devices_per_node(const ClusterSpec& c);       // smallest node
DeviceSpec slowest_device(const ClusterSpec& c);  // min flops*mfu, min memory
void validate(const ClusterSpec& c);              // throws std::invalid_argument

DeviceSpec device_preset(const std::string& name);  // v100 p100 a100-40g a100-80g h100 h200 cpu
LinkSpec link_preset(const std::string& name);      // nvlink3 nvlink4 pcie4 ib-hdr ib-ndr roce-25g eth-100g ...
// Whole clusters: "h100x8", "a100-ib", "mixed-a100-h100", "horovod-p100", "goyal-p100", "local" ...
ClusterSpec cluster_preset(const std::string& name);
std::vector<std::string> device_preset_names();
std::vector<std::string> link_preset_names();
std::vector<std::string> cluster_preset_names();

// ---------------------------------------------------------------- alpha-beta collectives
// Ring over n ranks: all-reduce 2(n-1)a + 2(n-1)/n * S/B; reduce-scatter and all-gather
// (n-1)a + (n-1)/n * S/B (S: the full buffer). Across nodes: hierarchical (reduce-scatter within
// the node, all-reduce of each shard across nodes on the node's link, all-gather within the node).
struct AlphaBeta {
  double alpha = 0;      // s per step
  double bandwidth = 0;  // bytes/s
};
double ring_allreduce_seconds(int n, double bytes, AlphaBeta ab);
double ring_reduce_scatter_seconds(int n, double bytes, AlphaBeta ab);
double ring_allgather_seconds(int n, double bytes, AlphaBeta ab);

// Measured on this machine: compute rates of a model, optimizer cost, collectives per world size.
struct ModelRates {
  double flops_1t = 0;          // FLOP/s of forward+backward, one process, one thread
  double flops_all = 0;         // one process, all cores
  double flops_concurrent = 0;  // per process, one thread each, `cores` processes at once
  // Per process with n processes at once (one thread each, a barrier after every forward+backward,
  // as a training step synchronises): measured at each calibrated world size, including n > cores.
  std::map<int, double> flops_synchronized;
  double overhead_s = 0;       // fixed seconds per step (intercept of time against batch)
  double overhead_all_s = -1;  // the same on all cores, fitted with flops_all (-1: not calibrated)
  double sgd_s_per_param = 0;  // optimizer step seconds per parameter (one thread)
  double adam_s_per_param = 0;
  double sgd_all_s_per_param = 0, adam_all_s_per_param = 0;  // the same, one process on all cores
  // Per child of the Sequential (ModelSpec::children), one process, one thread: forward+backward
  // time = layer_overhead_s + layer_s_per_sample * batch (the last child with the loss). Pipeline
  // stages and tensor-parallel shards are timed from these (micro-batches are small: the fixed
  // part matters).
  std::vector<double> layer_overhead_s, layer_s_per_sample;
  // Per child, the forward's share of its forward+backward time at the calibration's batch
  // (empty: not calibrated; then the FLOP split). Pooling and activations have no FLOPs but
  // take time, most of it in the forward for a max-pool (the CNN's: 82 %), and a stage's
  // forward/backward balance decides how GPipe's phases line up against 1F1B's interleaving.
  std::vector<double> layer_forward_share;
  // n workers of which a compute while the other n - a wait in a receive (a pipeline's bubble):
  // per computing process, one thread each, by n then a (a < n; a = n is flops_synchronized).
  std::map<int, std::map<int, double>> flops_while_waiting;
  // By world size n: seconds each blocking collective inside forward+backward adds beyond the
  // step's one synchronisation, as ZeRO-3 waits for every unit's gather: a 4 KiB all-gather
  // before each child with parameters and before its backward (the last one's excepted).
  std::map<int, double> sync_point_s;
  // By world size n, then tensor-parallel degree t (t divides n, t > 1): a t-way shard of the
  // model (1/t of each column- and row-parallel child, the rest whole) trained at the batch a
  // replica gets (the calibration's batch * t / n), all n ranks at once with a barrier after
  // each forward+backward, no tp collectives: {that batch, the slowest rank's seconds}. A
  // tensor-parallel layout's compute is scaled by it instead of by the whole model's
  // flops_synchronized, whose larger working set runs slower when ranks share cores.
  std::map<int, std::map<int, std::pair<double, double>>> tp_synchronized;
  // The two batches the fits above were timed at (0: not recorded, as in calibration files of
  // older versions). Far outside them the fits extrapolate (Estimate::caveat).
  int64_t fit_batch_lo = 0, fit_batch_hi = 0;
};
struct Calibration {
  std::string date, host;
  int cores = 1;
  double gemm_flops_1t = 0;                  // FLOP/s of a 512^3 float32 matmul, one thread
  double memory_bandwidth = 0;               // bytes/s, memcpy read+write
  std::map<std::string, ModelRates> models;  // by model name
  // Per world size: fitted alpha and bandwidth of each collective, in the ring formulas' terms.
  std::map<int, std::map<std::string, AlphaBeta>> collectives;  // n -> {"allreduce", ...}
  // The measured times behind those fits, (bytes, seconds) by size: on this machine a
  // collective's bandwidth depends on the size (caches; OpenMPI switches algorithms), so a
  // calibrated world size is timed by interpolating them (log-log), the fit only beyond them.
  std::map<int, std::map<std::string, std::vector<std::pair<double, double>>>> collective_times;
  // Point-to-point (a pipeline's activations and gradients) per world size n: alpha and
  // bandwidth of a send to a waiting receiver while every pair of ranks exchanges at once.
  std::map<int, AlphaBeta> p2p;
  // Per world size, (bytes, seconds) by size: from a send posted by a rank that goes on
  // computing to the message's arrival at a receiver waiting for it (the sender's progress
  // thread posts and progresses it when it gets a core), pairs of ranks at once.
  std::map<int, std::vector<std::pair<double, double>>> send_delay;
};

// ---------------------------------------------------------------- configurations
struct PlanOptions {
  int64_t global_batch = 0;         // samples per step; 0: 1024 for transformers, 256 otherwise
  std::string optimizer = "adam";   // adam | adamw | sgd (momentum) | sgd-plain | lars (momentum) | lamb
  std::string precision = "mixed";  // mixed (16-bit params/grads, fp32 master) | fp32 | bf16 (pure)
  std::vector<int> zero_stages = {0, 1, 2, 3};
  std::vector<double> bucket_bytes = {25.0 * 1024 * 1024};
  std::vector<int> dp_only_workers;  // non-empty: only dp layouts with these worker counts
  int devices = 0;                   // 0: every device of the cluster
  int max_tp = 8, max_pp = 64;
  // Expert parallelism (MoE models): 0 searches every power of two up to max_ep that divides
  // both dp and the experts; a positive ep fixes it (tandem finetune --ep).
  int ep = 0, max_ep = 8;
  // Context-parallel degrees to consider (tandem train --cp): each divides the devices (or
  // every worker count it is used with). Only {1} unless asked: context parallelism pays ring
  // transfers to split activations, and the search does not weigh it against the others.
  std::vector<int> cp = {1};
  bool activation_checkpointing = false;
  // Megatron sequence parallelism in tp layouts: less activation memory, the same tp bytes (a
  // ring reduce-scatter plus all-gather costs what the all-reduce it replaces does).
  bool sequence_parallel = false;
  // 1f1b | gpipe (same makespan with equal stages) | zb-h1 | zb-v (1F1B's bubble scaled by
  // pipeline_bubble_theory's ratio: 1/3 and 1/6, tandem/pipeline_schedule.h).
  PipelineSchedule pipeline_schedule = PipelineSchedule::k1F1B;
  // Where a model that lists its children is cut into stages, as `tandem train --pp-partition`:
  // "params" (balanced parameter counts), "time" (balanced per-child time at the micro-batch:
  // the calibration's fits on CPU, else FLOPs) or the children per stage, "3,7" (layouts with
  // another stage count are infeasible); "auto": the faster of params and time (Estimate::partition
  // says which cut, to pass to tandem train as a list).
  std::string pipeline_partition = "params";
  double memory_headroom = 0.9;  // use at most this fraction of device memory
  const Calibration* calibration = nullptr;
};

// A replica spans cp x tp x pp devices; dp replicas take different samples. The cp ranks of a
// replica take the same samples, T/cp tokens of each sequence apiece (tandem/context_parallel.h),
// and hold the same parameters, so the data-parallel strategies run over dp * cp ranks: ZeRO
// shards over dp * cp, and gradients are reduced over dp * cp.
struct Layout {
  int dp = 1, tp = 1, pp = 1;
  int cp = 1;  // context-parallel ranks per replica
  // Expert-parallel ranks (MoE models): groups of ep consecutive dp ranks split the experts;
  // divides dp and the experts. Does not change devices().
  int ep = 1;
  int zero = 0;               // 0: replicated (DDP); 1, 2, 3: ZeRO stages
  int64_t micro_batch = 1;    // samples per micro-batch per dp replica
  int64_t micro_batches = 1;  // per step (pipeline depth or gradient accumulation)
  double bucket_bytes = 25.0 * 1024 * 1024;
  // "single", "ddp", "zero1", ..., "dp2 tp2 pp2 zero1"; with cp > 1 "dp2 cp2 tp1 pp1 zero1";
  // with ep > 1 "dp4 ep2 tp1 pp1 zero1".
  std::string strategy_name() const;
  int devices() const { return dp * cp * tp * pp; }
};

struct MemoryBreakdown {
  double parameters = 0, gradients = 0, optimizer = 0, activations = 0;
  // ZeRO-2/3 with one micro-batch per step make the gradients during backward (and free them
  // in zero_grad()), while backward frees the activations layer by layer: the two never all
  // coexist, and the peak is the larger of forward's end (every activation) and backward's
  // end (every gradient and one layer's activations, `layer_activations`). Otherwise both
  // count in full.
  bool gradients_after_forward = false;
  double layer_activations = 0;
  // MoE models: the experts' share of parameters, gradients and optimizer (counted in those
  // three too) and of the activations (the routed token slots and the router's output).
  double expert_states = 0, expert_activations = 0;
  double total() const {
    const double step =
        gradients_after_forward ? std::max(activations, gradients + layer_activations) : gradients + activations;
    return parameters + optimizer + step;
  }
};

// The ZeRO paper's model-state memory per device (Rajbhandari et al. 2020, sec. 5): with
// bytes per parameter p (parameters), g (gradients) and K (optimizer state), for Nd devices:
// stage 0 (p+g+K)Psi; 1: (p+g)Psi + K Psi/Nd; 2: p Psi + (g+K)Psi/Nd; 3: (p+g+K)Psi/Nd.
struct StateBytes {
  double param = 4, grad = 4, optimizer = 8;
};
StateBytes state_bytes(const std::string& precision, const std::string& optimizer);
MemoryBreakdown zero_model_states(double parameters, int stage, int dp, StateBytes b);

struct Estimate {
  Layout layout;
  bool feasible = true;
  std::string why;  // when infeasible
  // Feasible, but priced where the calibration does not reach: a pass over fewer than half the
  // smaller, or more than twice the larger, of the batches its compute fits were timed at.
  std::string caveat;
  MemoryBreakdown memory;  // per device
  double compute_s = 0;    // forward+backward of this device's share
  double optimizer_s = 0;
  double comm_s = 0;          // all collectives of the step, if run alone
  double exposed_comm_s = 0;  // what is not hidden behind backward
  double bubble_s = 0;
  double step_s = 0;
  double samples_per_s = 0;
  double efficiency = 0;                     // useful compute time at the device rate / step time
  std::map<std::string, double> comm_parts;  // seconds by collective
  std::vector<int64_t> partition;            // children per pipeline stage (models that list them)
  // Per pipeline stage (pp > 1, models that list their children): the state of the stage's own
  // parameters, and the activations of its children times the micro-batches alive on it (1F1B:
  // pp - s on stage s; GPipe: all). `memory` above is the heaviest stage's model state with
  // evenly spread activations.
  std::vector<MemoryBreakdown> stage_memory;
  // Context parallelism (cp > 1): bytes this rank sends around the ring per step (every layer's
  // k/v blocks and their gradients, every micro-batch), the transfer time if run alone, and the
  // part not hidden behind the attention blocks' compute (in step_s through the pipeline slot).
  double ring_bytes = 0, ring_s = 0, ring_exposed_s = 0;
  // Expert parallelism (ep > 1): bytes this rank sends in the MoE layers' all-to-alls per step
  // and their seconds (in step_s whole, through the pipeline slot; comm_parts "ep all-to-all").
  double all_to_all_bytes = 0, all_to_all_s = 0;
};

Estimate estimate(const ModelSpec& m, const ClusterSpec& c, const Layout& l, const PlanOptions& o);
// tandem plan's per-rank memory for a run of `model` in layout `pc` on `world` ranks of this
// machine (the "local" preset) at `global_batch` with `optimizer`, into rep.plan_memory_bytes,
// and per pipeline stage for the run's `partition` (layers per stage; empty: the planner's own
// cut). Leaves them empty for a setting the planner does not model.
void add_planned_memory(const ModelSpec& model, const ParallelConfig& pc, int world, int64_t global_batch,
                        const std::string& optimizer, const std::vector<int64_t>& partition, Report& rep);
// Every layout over the cluster's devices (or o.dp_only_workers), for each cp of o.cp, best
// micro-batch and bucket per (dp, cp, tp, pp, zero); feasible ones first, by step time; then
// infeasible ones with the reason. Throws std::invalid_argument for a cp < 1 or one that divides
// neither the devices nor any of the worker counts.
std::vector<Estimate> plan(const ModelSpec& m, const ClusterSpec& c, const PlanOptions& o);

// The time a collective takes on the cluster for a group of n ranks (consecutive devices:
// within a node while it fits), or from the calibration when it has this n. op: "allreduce",
// "reduce_scatter", "allgather", or one of them + "_shm" (in place in symmetric memory: the MPI
// backend's shared-memory path), which takes its own calibrated curve where there is one.
inline bool is_shm_op(const std::string& op) { return op.size() > 4 && op.compare(op.size() - 4, 4, "_shm") == 0; }
double collective_seconds(const ClusterSpec& c, const PlanOptions& o, const std::string& op, int n, double bytes,
                          int stride = 1);
// One all-to-all of an ep group whose ranks lie `stride` devices apart, this rank sending `bytes`
// spread evenly over the ep - 1 others: (ep - 1) alpha + bytes / B on the intra-node link while
// the group fits in a node. Across nodes the share bound for other nodes goes over the node's
// link, which every device of the node shares (all exchange at once), beside the intra-node
// share: the slower of the two. On a calibrated CPU cluster, its point-to-point fit at `world`.
double all_to_all_seconds(const ClusterSpec& c, const PlanOptions& o, int ep, int stride, int world, double bytes);

// ---------------------------------------------------------------- calibration (needs LibTorch)
// Compute rates of a built-in model (forward+backward at two batch sizes, one and all threads)
// and optimizer step cost, GEMM rate and memcpy bandwidth, in this process.
void calibrate_compute(Calibration& cal, const std::vector<std::string>& models, int64_t batch);
// Per-rank concurrent compute rate (every rank at once, one thread each) and collective times
// at several sizes on rt's world, fitted to alpha and bandwidth. Every rank must call it; the
// result is complete on rank 0.
void calibrate_collectives(Runtime& rt, Calibration& cal, const std::vector<std::string>& models, int64_t batch);
std::string calibration_to_json(const Calibration& cal);
Calibration calibration_from_json(const std::string& text);  // throws std::invalid_argument

}  // namespace tandem::plan
