// The sparse MoE block (tandem/moe.h): routing, grouped expert computation with optional
// capacity, expert parallelism by all-to-all, and the auxiliary losses' gradients injected in
// backward.
#include "tandem/moe.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/torch.h>

#include <cmath>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "tandem/tensor_parallel.h"

namespace tandem::moe {

namespace sparse_block {
// E * sum_e (C_e / R) * (P_e / R): C the slots routed to each expert, P the sums of its
// probabilities, over R tokens. NaN when R is 0.
double balance_loss(const std::vector<int64_t>& counts, const at::Tensor& prob_sums, int64_t rows) {
  if (rows == 0) return std::nan("");
  const auto c = torch::tensor(counts, torch::TensorOptions().dtype(at::kLong)).to(at::kDouble);
  const double s = (c * prob_sums.to(at::kCPU, at::kDouble)).sum().item<double>();
  const double r = static_cast<double>(rows);
  return static_cast<double>(counts.size()) * s / (r * r);
}
}  // namespace sparse_block

// What every MoE layer of a model recorded in its last forward (a recomputation records the same
// routing again and keeps the first forward's scale and statistics: on a GPU it runs on
// autograd's device thread).
class RouterLog {
 public:
  struct Entry {
    std::vector<int64_t> counts;  // token slots routed to each expert, before drops
    at::Tensor prob_sums;         // [E] detached; defined where the aux loss is on
    int64_t rows = -1;            // tokens; -1: the layer has not run
    double scale = 1.0;           // aux_grad_scale() when the layer ran
    MoeStats* stats = nullptr;    // the statistics of the thread that ran it
  };

  explicit RouterLog(int64_t layers) : entries_(static_cast<size_t>(layers)) {}
  int64_t layers() const { return static_cast<int64_t>(entries_.size()); }

  void record(int64_t layer, Entry e, bool recomputation) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = entries_[static_cast<size_t>(layer)];
    if (recomputation) {
      e.scale = slot.scale;
      e.stats = slot.stats;
    }
    slot = std::move(e);
  }
  double scale(int64_t layer) const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_[static_cast<size_t>(layer)].scale;
  }
  MoeStats* stats(int64_t layer) const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_[static_cast<size_t>(layer)].stats;
  }

  // Counts and rows summed over the layers (transformers' load_balancing_loss_func pools them).
  std::pair<std::vector<int64_t>, int64_t> pooled_counts(int64_t experts) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> c(static_cast<size_t>(experts), 0);
    int64_t rows = 0;
    for (size_t l = 0; l < entries_.size(); ++l) {
      const auto& e = entries_[l];
      if (e.rows < 0 || static_cast<int64_t>(e.counts.size()) != experts) {
        throw std::logic_error("tandem::moe: MoE layer " + std::to_string(l) + " of " +
                               std::to_string(entries_.size()) +
                               " did not run in this micro-batch; the pooled load-balancing loss needs every layer "
                               "of the RouterLog in this process (use the per-layer form otherwise)");
      }
      for (size_t i = 0; i < c.size(); ++i) c[i] += e.counts[i];
      rows += e.rows;
    }
    return {c, rows};
  }

  // The balance loss with C, P and R summed over the layers.
  double pooled_aux(int64_t experts) const {
    const auto [c, rows] = pooled_counts(experts);
    at::Tensor p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& e : entries_) p = p.defined() ? p + e.prob_sums.cpu() : e.prob_sums.cpu();
    }
    return sparse_block::balance_loss(c, p, rows);
  }

 private:
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
};

std::shared_ptr<RouterLog> make_router_log(int64_t layers) {
  if (layers < 1)
    throw std::invalid_argument("tandem::moe::make_router_log: layers must be >= 1, got " + std::to_string(layers));
  return std::make_shared<RouterLog>(layers);
}

ExpertImpl::ExpertImpl(int64_t hidden, int64_t intermediate) {
  w1 = register_module("w1", torch::nn::Linear(torch::nn::LinearOptions(hidden, intermediate).bias(false)));
  w2 = register_module("w2", torch::nn::Linear(torch::nn::LinearOptions(intermediate, hidden).bias(false)));
  w3 = register_module("w3", torch::nn::Linear(torch::nn::LinearOptions(hidden, intermediate).bias(false)));
}

namespace {
// The CPU generator's state, put back when this goes: a Linear draws its initial weight, which a
// cut of existing weights overwrites at once (so that converting a model changes no random stream).
class KeepGenerator {
 public:
  KeepGenerator() : g_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(g_.mutex());
    state_ = g_.get_state();
  }
  ~KeepGenerator() {
    std::lock_guard<std::mutex> lock(g_.mutex());
    g_.set_state(state_);
  }
  KeepGenerator(const KeepGenerator&) = delete;
  KeepGenerator& operator=(const KeepGenerator&) = delete;

 private:
  at::Generator g_;
  at::Tensor state_;
};

// A Linear (no bias) over a copy of `w` [out, in], trained when `trained`.
torch::nn::Linear linear_over(const at::Tensor& w, bool trained) {
  torch::nn::Linear l(torch::nn::LinearOptions(w.size(1), w.size(0)).bias(false));
  torch::NoGradGuard no_grad;
  l->weight.set_data(w.detach().clone());
  l->weight.requires_grad_(trained);
  return l;
}
}  // namespace

ExpertImpl::ExpertImpl(const ExpertImpl& dense, int part_, int parts_) : part(part_), parts(parts_) {
  const int64_t n = tp::shard_size(dense.w1->weight.size(0), parts, "intermediate_size");
  const int64_t at = n * part;
  KeepGenerator keep;
  w1 = register_module("w1", linear_over(dense.w1->weight.narrow(0, at, n), dense.w1->weight.requires_grad()));
  w2 = register_module("w2", linear_over(dense.w2->weight.narrow(1, at, n), dense.w2->weight.requires_grad()));
  w3 = register_module("w3", linear_over(dense.w3->weight.narrow(0, at, n), dense.w3->weight.requires_grad()));
}

at::Tensor ExpertImpl::forward(const at::Tensor& x) {
  return w2->forward(torch::silu(w1->forward(x)) * w3->forward(x));
}

std::vector<ParameterPlacement> ExpertImpl::parameter_placements() const {
  if (parts == 1) return {};
  const int64_t hidden = w1->weight.size(1), width = w1->weight.size(0) * parts;
  return {{"w1.weight", "w1.weight", Placement::split({width, hidden}, 0, part, parts)},
          {"w2.weight", "w2.weight", Placement::split({hidden, width}, 1, part, parts)},
          {"w3.weight", "w3.weight", Placement::split({width, hidden}, 0, part, parts)}};
}

namespace sparse_block {
namespace {

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const auto c = t.to(at::kCPU, at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

at::Tensor long_tensor(const std::vector<int64_t>& v, const c10::Device& device) {
  return torch::tensor(v, torch::TensorOptions().dtype(at::kLong)).to(device);
}

// A forward run by the autograd engine: an activation-checkpointed layer recomputing in backward.
bool in_backward() { return torch::autograd::get_current_graph_task_id() != -1; }

struct Routing {
  at::Tensor logits;   // [N, E] the gate's output in float32 (or float64)
  at::Tensor probs;    // [N, E] softmax
  at::Tensor scores;   // [N, k] renormalised top-k probabilities
  at::Tensor experts;  // [N, k] their experts
};

Routing route(const at::Tensor& gate_weight, const at::Tensor& x2, int64_t k) {
  Routing r;
  // float32 (float64 stays float64), as transformers' router_logits.float().
  r.logits = torch::linear(x2, gate_weight);
  r.logits = r.logits.to(at::promote_types(r.logits.scalar_type(), at::kFloat));
  r.probs = torch::softmax(r.logits, -1);
  auto [top, idx] = torch::topk(r.probs, k, -1);
  r.scores = top / top.sum(-1, true);
  r.experts = idx;
  return r;
}

// The (token, slot) pairs of this rank sorted by expert (stable: token order within an expert),
// with an expert's slots beyond its capacity left out.
struct Dispatch {
  at::Tensor tokens;            // [M] token of each kept slot, grouped by expert
  at::Tensor weights;           // [M] score of each kept slot (the probabilities' dtype)
  std::vector<int64_t> counts;  // [E] slots routed to each expert (before drops)
  std::vector<int64_t> kept;    // [E] of them kept
};

Dispatch plan_dispatch(const Routing& r, int64_t experts, double capacity_factor) {
  const int64_t n = r.experts.size(0), k = r.experts.size(1);
  const auto flat = r.experts.reshape(-1);
  auto order = std::get<1>(flat.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  Dispatch d;
  d.counts = to_vector(torch::bincount(flat, {}, experts));
  d.kept = d.counts;
  if (capacity_factor > 0) {
    const auto cap =
        static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(n * k) / static_cast<double>(experts)));
    std::vector<int64_t> offsets(d.counts.size(), 0);
    std::exclusive_scan(d.counts.begin(), d.counts.end(), offsets.begin(), int64_t{0});
    const auto sorted_e = flat.index_select(0, order);
    const auto pos =
        torch::arange(n * k, order.options()) - long_tensor(offsets, order.device()).index_select(0, sorted_e);
    order = order.masked_select(pos < cap);
    for (auto& c : d.kept) c = std::min(c, cap);
  }
  d.tokens = order.div(k, "floor");
  d.weights = r.scores.reshape(-1).index_select(0, order);
  return d;
}

// Every expert on its contiguous block of `rows` (counts[i] rows for local[i], in order); an
// empty block still runs, so that every expert's weights get a (zero) gradient.
at::Tensor run_experts(const std::vector<Expert>& local, const at::Tensor& rows, const std::vector<int64_t>& counts) {
  std::vector<at::Tensor> outs;
  int64_t at = 0;
  for (size_t i = 0; i < local.size(); ++i) {
    Expert e = local[i];
    outs.push_back(e->forward(rows.narrow(0, at, counts[i])));
    at += counts[i];
  }
  return torch::cat(outs, 0);
}

// The experts' outputs back on the tokens: y[t] = sum of score * output over t's kept slots.
at::Tensor combine(const at::Tensor& out, const at::Tensor& tokens, const at::Tensor& weights, int64_t n) {
  const auto weighted = (out.to(weights.scalar_type()) * weights.unsqueeze(1)).to(out.scalar_type());
  return torch::zeros({n, out.size(1)}, out.options()).index_add(0, tokens, weighted);
}

// Expert parallelism: the kept slots' rows (grouped by expert, so by owner) go to the ranks that
// own their experts, run there grouped by local expert, and come back in the order they left.
// Every rank makes the same three collectives whatever its counts (an all-gather of the counts,
// two all-to-alls; their reverse in backward).
at::Tensor exchange_and_run(const at::Tensor& rows, const std::vector<int64_t>& kept, const std::vector<Expert>& local,
                            const CommPtr& ep) {
  const int ranks = ep->size(), me = ep->rank();
  const auto experts = static_cast<int64_t>(kept.size()), per_rank = experts / ranks;
  const auto device = rows.device();
  // counts[i * E + e]: slots rank i sends to expert e (after its capacity).
  const auto mine = long_tensor(kept, device);
  auto all = torch::empty({ranks * experts}, mine.options());
  ep->allgather(all, mine);
  const auto counts = to_vector(all);
  std::vector<int64_t> send(ranks, 0), recv(ranks, 0), per_local(per_rank, 0), from(ranks * per_rank);
  for (int j = 0; j < ranks; ++j) {
    for (int64_t e = 0; e < per_rank; ++e) {
      send[j] += counts[me * experts + j * per_rank + e];
      const int64_t in = counts[j * experts + me * per_rank + e];
      recv[j] += in;
      per_local[e] += in;
      from[j * per_rank + e] = in;
    }
  }
  const auto received = all_to_all(rows, send, recv, ep);
  // Received rows come by source rank, each source's by local expert: regroup them by expert.
  const auto local_expert = torch::arange(per_rank, torch::TensorOptions().dtype(at::kLong).device(device))
                                .repeat({ranks})
                                .repeat_interleave(long_tensor(from, device));
  const auto perm = std::get<1>(local_expert.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const auto out = run_experts(local, received.index_select(0, perm), per_local);
  const auto inverse = torch::empty_like(perm).scatter_(0, perm, torch::arange(perm.numel(), perm.options()));
  return all_to_all(out.index_select(0, inverse), recv, send, ep);
}

// What the backward of one layer's auxiliary losses needs.
struct AuxState : torch::CustomClassHolder {
  std::shared_ptr<RouterLog> log;
  AuxLossForm form = AuxLossForm::kPooled;
  int64_t layer = 0, layers = 1, experts = 0, rows = 0;
  double aux_coef = 0, z_coef = 0, scale = 1;
  std::vector<int64_t> counts;  // this layer's, before drops
  at::Tensor probs;             // [N, E] detached
  at::Tensor lse;               // [N] logsumexp of the logits, detached (z-loss)
};

// d(coef * aux) / d probs[n, e] = coef * E * C_e / R^2 (the same for every token n), C and R
// pooled over the layers (kPooled) or this layer's over L layers (kPerLayer, with 1 / L).
at::Tensor aux_prob_grad(const AuxState& s) {
  std::vector<int64_t> c = s.counts;
  int64_t rows = s.rows;
  double per = 1.0;
  if (s.form == AuxLossForm::kPooled) {
    std::tie(c, rows) = s.log->pooled_counts(s.experts);
  } else {
    per = 1.0 / static_cast<double>(s.layers);
  }
  const double r = static_cast<double>(rows);
  const double factor = s.aux_coef * s.scale * per * static_cast<double>(s.experts) / (r * r);
  return long_tensor(c, s.probs.device()).to(s.probs.scalar_type()) * factor;
}

// The kept slots' scores unchanged; in backward the auxiliary losses' gradients join the router
// logits' gradient. The scores (not the block's output, which the caller may modify in place)
// are what passes through: every output gradient reaches them, also when no slot was kept.
struct InjectAuxGrad : torch::autograd::Function<InjectAuxGrad> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& scores, const at::Tensor& logits,
                            const c10::intrusive_ptr<AuxState>& state) {
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return scores;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto s = c10::static_intrusive_pointer_cast<AuxState>(ctx->saved_data["state"].toCapsule());
    auto g = torch::zeros_like(s->probs);
    if (s->rows > 0 && s->aux_coef > 0) {
      // Through the softmax: dL/dlogit = p * (dL/dp - sum_j p_j dL/dp_j).
      const auto a = aux_prob_grad(*s);
      g += s->probs * (a - (s->probs * a).sum(-1, true));
    }
    if (s->rows > 0 && s->z_coef > 0) {
      // d/dlogit of z_coef / L * mean_n lse_n^2 = z_coef / L * 2 lse_n p / N.
      const double f = 2.0 * s->z_coef * s->scale / (static_cast<double>(s->rows) * static_cast<double>(s->layers));
      g += s->probs * (s->lse * f).unsqueeze(1);
    }
    return {grad_out[0], g, at::Tensor()};
  }
};

}  // namespace
}  // namespace sparse_block

SparseMoeBlockImpl::SparseMoeBlockImpl(const MoeConfig& c, std::shared_ptr<RouterLog> router_log, int64_t index)
    : config(c), log(std::move(router_log)), layer(index) {
  validate(config);
  if (!log) throw std::invalid_argument("tandem::moe::SparseMoeBlock: no RouterLog given (make_router_log(layers))");
  if (layer < 0 || layer >= log->layers()) {
    throw std::invalid_argument("tandem::moe::SparseMoeBlock: layer " + std::to_string(layer) +
                                " is outside the RouterLog's " + std::to_string(log->layers()) + " MoE layers");
  }
  gate =
      register_module("gate",
                      torch::nn::Linear(torch::nn::LinearOptions(config.hidden_size, config.num_experts).bias(false)));
  experts = register_module("experts", torch::nn::ModuleList());
  for (int64_t e = 0; e < config.num_experts; ++e) {
    Expert ex(config.hidden_size, config.intermediate_size);
    experts->push_back(ex);
    local.push_back(ex);
  }
}

SparseMoeBlockImpl::SparseMoeBlockImpl(const SparseMoeBlockImpl& dense, const CommPtr& comm)
    : config(dense.config), tp(comm), log(dense.log), layer(dense.layer) {
  if (!tp) throw std::invalid_argument("tandem::moe::SparseMoeBlock: no tensor-parallel communicator given");
  if (dense.ep || !dense.experts) {
    throw std::logic_error("tandem::moe::SparseMoeBlock: the tp form is made from a block that holds all its "
                           "experts (before use_expert_parallel)");
  }
  tp::shard_size(config.intermediate_size, tp->size(), "intermediate_size");  // before any copy
  gate = register_module("gate", dense.gate);
  experts = register_module("experts", torch::nn::ModuleList());
  for (const auto& m : *dense.experts) {
    Expert part(std::make_shared<ExpertImpl>(*m->as<ExpertImpl>(), tp->rank(), tp->size()));
    experts->push_back(part);
    local.push_back(part);
  }
}

void SparseMoeBlockImpl::check_tensor_parallel(int tp_size) const {
  tp::shard_size(config.intermediate_size, tp_size, "intermediate_size");
}

torch::nn::AnyModule SparseMoeBlockImpl::to_tensor_parallel(const CommPtr& comm) const {
  return torch::nn::AnyModule(SparseMoeBlock(*this, comm));
}

std::vector<ExpertParallel::LocalExpert> SparseMoeBlockImpl::use_expert_parallel(const CommPtr& comm) {
  if (!comm) throw std::invalid_argument("tandem::moe::SparseMoeBlock::use_expert_parallel: no communicator");
  if (ep) throw std::logic_error("tandem::moe::SparseMoeBlock::use_expert_parallel: called twice on one layer");
  const int64_t ranks = comm->size();
  if (config.num_experts % ranks != 0) {
    throw std::invalid_argument("expert parallelism: num_local_experts " + std::to_string(config.num_experts) +
                                " is not divisible by --ep " + std::to_string(ranks) +
                                "; choose an ep that divides the number of experts");
  }
  const int64_t per_rank = config.num_experts / ranks;
  unregister_module("experts");
  first_local = comm->rank() * per_rank;
  local.clear();
  for (int64_t e = first_local; e < first_local + per_rank; ++e)
    local.emplace_back(std::dynamic_pointer_cast<ExpertImpl>(experts->ptr(static_cast<size_t>(e))));
  // The other ranks' experts go: the memory expert parallelism saves.
  experts = nullptr;
  ep = comm;
  return local_experts();
}

std::vector<ExpertParallel::LocalExpert> SparseMoeBlockImpl::local_experts() const {
  std::vector<LocalExpert> out;
  if (!ep) return out;
  for (size_t i = 0; i < local.size(); ++i)
    out.push_back({"experts." + std::to_string(first_local + static_cast<int64_t>(i)), local[i].ptr()});
  return out;
}

void SparseMoeBlockImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  Module::to(device, dtype, non_blocking);
  if (ep)
    for (auto& e : local) e->to(device, dtype, non_blocking);
}
void SparseMoeBlockImpl::to(torch::Dtype dtype, bool non_blocking) {
  Module::to(dtype, non_blocking);
  if (ep)
    for (auto& e : local) e->to(dtype, non_blocking);
}
void SparseMoeBlockImpl::to(torch::Device device, bool non_blocking) {
  Module::to(device, non_blocking);
  if (ep)
    for (auto& e : local) e->to(device, non_blocking);
}

namespace sparse_block {
namespace {

// The layer's routing into the RouterLog (every forward), and, in a training forward with grad
// mode on, into the statistics of the thread that runs the micro-batch. An activation-checkpointed
// layer counts once: its first forward runs without grad mode, its recomputation with it.
void note_routing(SparseMoeBlockImpl& b, const Routing& r, const Dispatch& d, const at::Tensor& lse,
                  bool recomputation) {
  const auto& c = b.config;
  const int64_t rows = r.probs.size(0);
  RouterLog::Entry e;
  e.counts = d.counts;
  e.rows = rows;
  e.scale = aux_grad_scale();
  e.stats = &mutable_moe_stats();
  if (c.aux_loss_coef > 0) e.prob_sums = r.probs.detach().sum(0);
  b.log->record(b.layer, e, recomputation);
  if (!b.is_training() || !at::GradMode::is_enabled()) return;

  auto& s = *b.log->stats(b.layer);
  if (static_cast<int64_t>(s.tokens_per_expert.size()) < c.num_experts) s.tokens_per_expert.resize(c.num_experts, 0);
  int64_t kept = 0;
  for (int64_t i = 0; i < c.num_experts; ++i) {
    s.tokens_per_expert[static_cast<size_t>(i)] += d.counts[static_cast<size_t>(i)];
    kept += d.kept[static_cast<size_t>(i)];
  }
  s.routed += rows * c.top_k;
  s.dropped += rows * c.top_k - kept;
  if (c.aux_loss_coef > 0) {
    s.aux_loss_coef = c.aux_loss_coef;
    double v = std::nan("");
    if (c.aux_form == AuxLossForm::kPooled && b.layer == b.log->layers() - 1) v = b.log->pooled_aux(c.num_experts);
    if (c.aux_form == AuxLossForm::kPerLayer && rows > 0) v = balance_loss(d.counts, e.prob_sums, rows);
    if (!std::isnan(v)) {
      s.aux_loss_sum += v;
      s.aux_loss_terms += 1;
    }
  }
  if (c.z_loss_coef > 0) {
    s.z_loss_coef = c.z_loss_coef;
    if (rows > 0) {
      s.z_loss_sum += lse.square().mean().item<double>();
      s.z_loss_terms += 1;
    }
  }
}

// The kept slots' scores through InjectAuxGrad where a training backward will follow.
at::Tensor inject_aux(SparseMoeBlockImpl& b, const Routing& r, const Dispatch& d, const at::Tensor& lse) {
  const auto& c = b.config;
  if ((c.aux_loss_coef <= 0 && c.z_loss_coef <= 0) || !b.is_training() || !at::GradMode::is_enabled() ||
      !r.logits.requires_grad()) {
    return d.weights;
  }
  auto s = c10::make_intrusive<AuxState>();
  s->log = b.log;
  s->form = c.aux_form;
  s->layer = b.layer;
  s->layers = b.log->layers();
  s->experts = c.num_experts;
  s->rows = r.probs.size(0);
  s->aux_coef = c.aux_loss_coef;
  s->z_coef = c.z_loss_coef;
  // The first forward's, also in a recomputation; under tp every rank injects 1/tp of it, since
  // the scores' gradients (into which it goes) are summed over tp.
  s->scale = b.log->scale(b.layer) / (b.tp ? static_cast<double>(b.tp->size()) : 1.0);
  s->counts = d.counts;
  s->probs = r.probs.detach();
  s->lse = lse;
  return InjectAuxGrad::apply(d.weights, r.logits, s);
}

}  // namespace
}  // namespace sparse_block

torch::Tensor SparseMoeBlockImpl::forward(const torch::Tensor& x) {
  const int64_t h = config.hidden_size;
  if (x.dim() < 1 || x.size(-1) != h) {
    throw std::invalid_argument("tandem::moe::SparseMoeBlock: input's last dimension is " +
                                (x.dim() < 1 ? std::string("missing") : std::to_string(x.size(-1))) +
                                ", the block's hidden_size is " + std::to_string(h));
  }
  // The tp form: the tokens every tp rank routes (gathered under sequence parallelism), whose
  // gradient sums the ranks' partial ones.
  const auto in = tp ? tp::column_input(x, tp, sequence_parallel).in : x;
  const auto x2 = in.reshape({-1, h});
  const auto r = sparse_block::route(tp ? tp::copy_to_tp(gate->weight, tp) : gate->weight, x2, config.top_k);
  const auto d = sparse_block::plan_dispatch(r, config.num_experts, config.capacity_factor);
  at::Tensor lse;
  if (config.z_loss_coef > 0) lse = torch::logsumexp(r.logits.detach(), -1);
  const bool recomputation = sparse_block::in_backward();
  sparse_block::note_routing(*this, r, d, lse, recomputation);
  const auto rows = x2.index_select(0, d.tokens);
  const auto out =
      ep ? sparse_block::exchange_and_run(rows, d.kept, local, ep) : sparse_block::run_experts(local, rows, d.kept);
  const auto weights = sparse_block::inject_aux(*this, r, d, lse);
  const auto y = sparse_block::combine(out, d.tokens, weights, x2.size(0)).reshape(in.sizes());
  if (!tp) return y;
  return sequence_parallel ? tp::reduce_scatter_seq_to_tp(y, tp) : tp::reduce_from_tp(y, tp);
}

}  // namespace tandem::moe
