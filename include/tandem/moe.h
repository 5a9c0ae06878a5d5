// Mixture of experts: a sparse MoE block (a top-k router over SwiGLU experts, as Mixtral's
// block_sparse_moe) and expert parallelism, its experts spread over the ranks of an ep group with
// tokens dispatched to them and combined back by all-to-all.
//
// Routing (Mixtral): probabilities softmax(x W_gate^T) in float32 (float64 input: float64), the
// top k of them per token, renormalised to sum to 1; the token's output is the weighted sum of
// its k experts' down(silu(w1 x) * w3 x). Tokens are sorted by expert and every expert runs one
// matrix product per projection over its contiguous block of tokens (grouped computation, never
// a loop over tokens). Dropless by default; a capacity factor c > 0 lets each expert take at most
// ceil(c * tokens * k / experts) of a micro-batch's token slots (this rank's tokens, in token
// order), the rest dropped (their slot adds nothing: the residual stream carries the token) and
// counted.
//
// Auxiliary losses reach the gradient without passing through the loss function: each MoE layer
// adds its share of the load-balancing (and router z-) loss's gradient to the router's in
// backward, weighted by the micro-batch's share of the replica's loss (set_aux_grad_scale, which
// tandem::Engine sets), so they work under gradient accumulation and in every pipeline stage.
// The loss a loop reports is the language-model loss plus coef * aux_loss (moe_stats()).
// Load balancing (Switch / Mixtral): aux = E * sum_e f_e * P_e, f_e the token slots routed to
// expert e (before any drop) per token (so sum_e f_e = k, as transformers counts them) and P_e
// the mean router probability of e, over the tokens of one micro-batch on one rank (as
// transformers computes it in one forward). Only the probabilities carry a gradient.
//  - kPooled: f and P pooled over all MoE layers of the model, as transformers'
//    load_balancing_loss_func (MixtralForCausalLM(output_router_logits=True)). Needs every MoE
//    layer in this process for the micro-batch (no pipeline).
//  - kPerLayer: aux computed per layer and averaged over the layers (Megatron-core's form); each
//    layer's gradient is known in its own forward, so it works across pipeline stages.
// Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2, per layer, averaged over the
// layers, weighted by z_loss_coef.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm.h"
#include "tandem/parallelizable.h"
#include "tandem/placement.h"

namespace tandem::moe {

enum class AuxLossForm { kPooled, kPerLayer };
AuxLossForm parse_aux_loss_form(const std::string& name);  // "pooled" | "per-layer"; else std::invalid_argument
const char* to_string(AuxLossForm f);

struct MoeConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // each expert's SwiGLU width
  int64_t num_experts = 0;        // Mixtral's num_local_experts
  int64_t top_k = 2;              // num_experts_per_tok
  double aux_loss_coef = 0.0;     // router_aux_loss_coef; 0: no load-balancing loss
  double z_loss_coef = 0.0;       // 0: no router z-loss
  double capacity_factor = 0.0;   // 0: dropless
  AuxLossForm aux_form = AuxLossForm::kPooled;
};
// Throws std::invalid_argument naming the field: sizes not positive, top_k outside
// [1, num_experts], negative coefficients or capacity factor.
void validate(const MoeConfig& c);

// ---- all-to-all (collective over `comm`) ------------------------------------------------------

// send_counts[j]: rows this rank sends to rank j. Returns recv_counts (recv_counts[j]: rows rank
// j sends to this rank), exchanged with one all-to-all of the counts. Throws std::invalid_argument
// unless send_counts has comm.size() non-negative entries.
std::vector<int64_t> exchange_counts(Communicator& comm, const std::vector<int64_t>& send_counts);

// Rows of `input` [sum(send_counts), ...] in rank order, send_counts[j] of them to rank j; returns
// [sum(recv_counts), ...], recv_counts[j] rows from rank j, in rank order. Any count may be zero (a
// rank may send or receive nothing and still takes part). Autograd: the gradient travels back by
// the reverse all-to-all. Seconds and bytes go to this thread's moe_stats().
at::Tensor all_to_all(const at::Tensor& input, const std::vector<int64_t>& send_counts,
                      const std::vector<int64_t>& recv_counts, const CommPtr& comm);

// ---- statistics (this thread's, since reset_moe_stats) ---------------------------------------
// A layer adds to them in each forward in training mode (Module::is_training()) with grad mode
// on, so once per micro-batch also when activation checkpointing runs its first forward without
// grad mode and recomputes it in backward (counted for the thread that ran the first forward).

struct MoeStats {
  // Token slots routed to each expert (global index) from this rank's tokens, summed over layers
  // and micro-batches, before any drop. Empty until a MoE layer ran.
  std::vector<int64_t> tokens_per_expert;
  int64_t routed = 0;   // token slots routed (tokens x top_k x layers)
  int64_t dropped = 0;  // of them, over an expert's capacity
  // Load-balancing loss values (without the coefficient): one term per micro-batch (kPooled) or
  // per layer and micro-batch (kPerLayer); the mean is aux_loss_sum / aux_loss_terms.
  double aux_loss_sum = 0.0;
  int64_t aux_loss_terms = 0;
  double z_loss_sum = 0.0;  // router z-loss values, one term per layer and micro-batch
  int64_t z_loss_terms = 0;
  double aux_loss_coef = 0.0;  // the coefficients the layers ran with
  double z_loss_coef = 0.0;
  // all_to_all(): calls, seconds on the communication engine, bytes sent to the other ranks
  // (forward and backward).
  int64_t all_to_alls = 0;
  double all_to_all_seconds = 0.0;
  int64_t all_to_all_bytes = 0;
  // The means of the terms (0 without any).
  double aux_loss() const { return aux_loss_terms > 0 ? aux_loss_sum / static_cast<double>(aux_loss_terms) : 0.0; }
  double z_loss() const { return z_loss_terms > 0 ? z_loss_sum / static_cast<double>(z_loss_terms) : 0.0; }
};
MoeStats moe_stats();
void reset_moe_stats();
// For the layers and all_to_all(): adds to this thread's statistics.
MoeStats& mutable_moe_stats();

// The weight of the auxiliary losses' gradients for the micro-batches that follow on this
// thread: the factor by which the step multiplies a micro-batch's mean loss (its share of the
// replica's batch, times the fp16 loss scale). Default 1.
void set_aux_grad_scale(double scale);
double aux_grad_scale();

// ---- the block --------------------------------------------------------------------------------

// What the MoE layers of one model share for kPooled: each layer's routing counts and
// probability sums of the last micro-batch, by layer index (a recomputation in backward writes
// the same values again and keeps the aux_grad_scale() of the first forward). Its layer count is
// the L that kPerLayer and the z-loss average over.
class RouterLog;

// One expert: down(silu(w1 x) * w3 x), Mixtral's names (w1 gate, w3 up, w2 down; no biases).
class ExpertImpl : public torch::nn::Module, public PlacedModule {
 public:
  ExpertImpl(int64_t hidden, int64_t intermediate);
  // Part `part` of `parts` of a dense expert (Megatron's cut of a SwiGLU MLP): w1 and w3 rows
  // [part * I / parts, (part + 1) * I / parts), w2 the same columns, copied (the dense expert is
  // left as it was; the generator is not drawn from). Its output is a partial sum: the parts'
  // outputs add up to the dense expert's. Throws std::invalid_argument naming intermediate_size
  // when parts does not divide it.
  ExpertImpl(const ExpertImpl& dense, int part, int parts);
  at::Tensor forward(const at::Tensor& x);  // [rows, hidden] -> [rows, hidden]
  // A part's blocks of the dense weights (w1, w3: rows; w2: columns); a whole expert lists none.
  std::vector<ParameterPlacement> parameter_placements() const override;
  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
  int part = 0, parts = 1;
};
TORCH_MODULE(Expert);

// A layer that can spread its experts over an ep group implements this. tandem::Engine calls it
// (ParallelConfig::ep > 1) on every such module of the model it trains, before the strategy
// wraps it. The layer keeps experts [r * E / ep, (r + 1) * E / ep) of ep rank r, no longer as
// registered children, and dispatches tokens to their owners by all_to_all over `ep`. It returns
// its local experts with the names they had in the layer ("experts.3"), which the Engine
// registers elsewhere: their gradients are reduced over the ranks holding the same experts only.
// Throws std::invalid_argument naming both numbers when ep does not divide the experts.
class ExpertParallel {
 public:
  virtual ~ExpertParallel() = default;
  struct LocalExpert {
    std::string name;  // as a child of the layer before the call: "experts.<global index>"
    std::shared_ptr<torch::nn::Module> module;
  };
  virtual std::vector<LocalExpert> use_expert_parallel(const CommPtr& ep) = 0;
  // What use_expert_parallel returned (empty before it).
  virtual std::vector<LocalExpert> local_experts() const = 0;
  virtual int64_t num_experts() const = 0;
};

// Mixtral's block_sparse_moe: gate (Linear hidden -> experts, no bias) and experts (a ModuleList
// of Expert). x [..., hidden] -> [..., hidden]. Under expert parallelism the router, the scores
// and the weighted sum stay on the token's rank (the router's gradient is local); each forward
// makes one all-gather of the per-expert counts and two all_to_all() (the rows out, the outputs
// back; their reverse in backward) on every rank of the ep group, whatever it routes or holds.
//
// Tensor parallelism (the tp form, made from a dense block): every tp rank routes the same tokens
// with the same (shared, replicated) gate and runs its part of every expert (ExpertImpl's cut), so
// the weighted sum is a partial sum, all-reduced over tp once per layer (under sequence
// parallelism the input's shards are all-gathered first and the sum reduce-scattered back). In
// backward each rank's gradient of the scores is a partial sum too: the input's gradient is
// all-reduced over tp as a column-parallel layer's, the gate's is summed over tp (its weight
// enters through tp::copy_to_tp), and the auxiliary losses' gradients, whole on every rank, enter
// with weight 1/tp. Expert parallelism composes: the ep group is ranks of one tp rank, each
// dispatching its part's rows.
class SparseMoeBlockImpl : public torch::nn::Module, public ExpertParallel, public tp::Parallelizable {
 public:
  // `layer`: this layer's index among the model's MoE layers (0-based); `log` shared by them all.
  SparseMoeBlockImpl(const MoeConfig& config, std::shared_ptr<RouterLog> log, int64_t layer);
  // The tp form of `dense` (before expert parallelism): its gate, RouterLog and layer shared, its
  // experts cut over `tp` (tp rank r keeps part r). Throws std::invalid_argument naming
  // intermediate_size when tp's size does not divide it, std::logic_error after use_expert_parallel.
  SparseMoeBlockImpl(const SparseMoeBlockImpl& dense, const CommPtr& tp);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<LocalExpert> use_expert_parallel(const CommPtr& ep) override;
  std::vector<LocalExpert> local_experts() const override;
  int64_t num_experts() const override { return config.num_experts; }
  // As a child of a Sequential that tp::tensor_parallel converts: the tp form. Throws
  // std::invalid_argument naming intermediate_size when tp_size does not divide it.
  void check_tensor_parallel(int tp_size) const override;
  torch::nn::AnyModule to_tensor_parallel(const CommPtr& tp) const override;
  // Also the local experts once they are no longer children (expert parallelism).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  MoeConfig config;
  torch::nn::Linear gate{nullptr};
  torch::nn::ModuleList experts{nullptr};  // all of them; null under expert parallelism (released)
  std::vector<Expert> local;               // the experts this rank computes (all without ep)
  int64_t first_local = 0;                 // global index of local[0]
  CommPtr ep;                              // null without expert parallelism
  CommPtr tp;                              // the tp form's group; null in a dense block
  bool sequence_parallel = false;          // tp form: x is tp's sequence shard [B, T / tp, hidden]
  std::shared_ptr<RouterLog> log;
  int64_t layer = 0;
};
TORCH_MODULE(SparseMoeBlock);

// A RouterLog for a model with `layers` MoE layers.
std::shared_ptr<RouterLog> make_router_log(int64_t layers);

}  // namespace tandem::moe
