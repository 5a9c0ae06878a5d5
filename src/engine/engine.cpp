// tandem::Engine (tandem/engine.h): builds the layout once, then runs every step, checkpoint and
// report through the one Updater interface (updater.h) and, for pp > 1, the pipeline.
#include "tandem/engine.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <unordered_map>

#include "engine/experts.h"
#include "engine/updater.h"
#include "tandem/accumulate.h"
#include "tandem/context_parallel.h"
#include "tandem/ddp.h"
#include "tandem/grid.h"
#include "tandem/models.h"
#include "tandem/moe.h"
#include "tandem/pipeline.h"
#include "tandem/tensor_parallel.h"
#include "tandem/trace.h"
#include "tandem/zero.h"

namespace tandem {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream is(line.substr(6));
      int64_t kb = 0;
      is >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

// The bytes a ring algorithm puts on the wire per rank for the payloads the Communicator
// counted: all-reduce 2(N-1)/N S; reduce-scatter (N-1)/N S (S: its full-size input);
// all-gather (N-1) s (s: its per-rank input); broadcast S (a pipelined chain); sends as they are.
double wire_bytes(const std::map<std::string, OpStats>& st, int n) {
  auto get = [&](const char* k) {
    auto it = st.find(k);
    return it == st.end() ? 0.0 : static_cast<double>(it->second.bytes);
  };
  const double f = n > 1 ? static_cast<double>(n - 1) / n : 0.0;
  // An all-to-all's rows are spread over the ranks, its own share staying (balanced routing).
  return 2 * f * get("allreduce") + f * get("reduce_scatter") + (n - 1) * get("allgather") +
         (n > 1 ? get("broadcast") : 0.0) + get("send") + f * get("alltoall");
}

// Every child of the Sequential whose forward depends on where its tokens lie learns the cp
// group. A tensor-parallel layer (tp::Parallelizable) that cannot would attend within its own
// part of the sequence only, so the model is refused instead.
void use_context_parallel(const torch::nn::Sequential& net, const CommPtr& cp) {
  int found = 0;
  for (auto& child : net->named_children()) {
    auto* m = child.value().get();
    if (auto* c = dynamic_cast<cp::ContextParallel*>(m)) {
      c->use_context_parallel(cp);
      ++found;
    } else if (dynamic_cast<tp::Parallelizable*>(m)) {
      throw std::invalid_argument("--cp " + std::to_string(cp->size()) + ": layer '" + child.key() +
                                  "' depends on positions or attends over the sequence but does not implement "
                                  "cp::ContextParallel (tandem/context_parallel.h); use --cp 1 for this model");
    }
  }
  if (found == 0) {
    throw std::invalid_argument("--cp " + std::to_string(cp->size()) +
                                ": no layer of this model implements cp::ContextParallel (ring attention at "
                                "global positions); context parallelism needs one, as Llama's decoder layers do. "
                                "Use --cp 1");
  }
}

// The ranks every host holds, when every host holds as many and they are consecutive (the
// launcher's by-slot mapping): hsdp's default shard group. Otherwise the group must be given.
int ranks_per_host(const Runtime& rt, const std::string& strategy) {
  const auto& hosts = rt.hosts();
  const auto per_host = hosts.empty() ? rt.info().world_size : static_cast<int>(hosts[0].ranks.size());
  bool even = per_host > 0;
  for (const auto& h : hosts) {
    even = even && static_cast<int>(h.ranks.size()) == per_host;
    for (size_t i = 1; even && i < h.ranks.size(); ++i) even = h.ranks[i] == h.ranks[i - 1] + 1;
  }
  if (!even) {
    throw std::invalid_argument("--strategy " + strategy + " without --shard-group shards within each host, but " +
                                rt.layout() +
                                " do not hold as many consecutive ranks each; give --shard-group G (a divisor of the "
                                "data-parallel ranks)");
  }
  return per_host;
}

}  // namespace

struct Engine::Impl {
  engine::Layout L;
  std::unique_ptr<engine::Updater> up;
  int64_t parameters = 0;
  std::unique_ptr<Pipeline> eval_pipe;  // forward only: one micro-batch of any size
  bool fresh_step = false;              // zero_grad() ran and no forward since
  double forward_s = 0.0;
  // Statistics since reset_stats().
  std::vector<CommPtr> comms;
  std::vector<std::string> comm_names;  // each one's group name in EngineStats::Communication::groups
  std::vector<std::map<std::string, OpStats>> comm_before;
  int64_t steps = 0, pipe_steps = 0, peak_live = 0;
  int64_t peak_activation = -1;  // see EngineStats::Memory::peak_activation_bytes
  double recompute_s = 0.0;      // see EngineStats::recompute_seconds
  double pipe_step_s = 0.0, pipe_compute_s = 0.0;
  int uncounted_depth = 0;
  std::shared_ptr<AsyncCheckpoint> pending_save;  // an asynchronous save not yet committed
  int64_t saves = 0;
  double save_stall_s = 0.0;

  // stats() describes training steps: the communication of inference, checkpoints and
  // gathering the model is left out (it would be charged to the steps). The outermost guard
  // moves what happened during its life into the baseline.
  class Uncounted {
   public:
    explicit Uncounted(Impl& impl) : impl_(impl) {
      if (impl_.uncounted_depth++ > 0) return;
      for (auto& c : impl_.comms) at_start_.push_back(c->stats());
    }
    ~Uncounted() {
      if (--impl_.uncounted_depth > 0) return;
      for (size_t c = 0; c < at_start_.size(); ++c) {
        for (auto& [op, now] : impl_.comms[c]->stats()) {
          const auto it = at_start_[c].find(op);
          const OpStats start = it == at_start_[c].end() ? OpStats{} : it->second;
          auto& base = impl_.comm_before[c][op];
          base.calls += now.calls - start.calls;
          base.bytes += now.bytes - start.bytes;
          base.seconds += now.seconds - start.seconds;
        }
      }
    }
    Uncounted(const Uncounted&) = delete;
    Uncounted& operator=(const Uncounted&) = delete;

   private:
    Impl& impl_;
    std::vector<std::map<std::string, OpStats>> at_start_;
  };

  at::Tensor cast_input(const at::Tensor& x) const {
    if (L.cfg.precision == Precision::kFP32 || !x.is_floating_point()) return x;
    return x.to(compute_dtype(L.cfg.precision));
  }
  void build(std::shared_ptr<torch::nn::Module> model, ForwardFn forward, const OptimizerOptions& oo);
  at::Tensor pipeline_pass(const at::Tensor& x, const at::Tensor& y, const LossFn& loss_fn, const StepOptions& so);
  // Context parallelism: this rank's part of every sequence of x; targets with a token per
  // position are split alike (the loss is then per token, its gradient reduced with dp's);
  // other targets see the output gathered over the cp ranks, each rank back-propagating its own
  // tokens' share of the replica's loss times cp, which the dp x cp average divides again.
  struct CpParts {
    at::Tensor x, y;
    LossFn loss_fn;
  };
  CpParts split_for_cp(const at::Tensor& x, const at::Tensor& y, const LossFn& loss_fn, const StepOptions& so) const;
  at::Tensor split_input(const at::Tensor& x) const;
  // The output over whole sequences (inference), where the model gives one per position.
  at::Tensor gather_output(const at::Tensor& out) const;
  at::Tensor accumulate_pass(const at::Tensor& x, const at::Tensor& y, const LossFn& loss_fn, const StepOptions& so);
  void checkpoint_layers(std::vector<int64_t>& cut);
  void initialise(const ParameterSource& source);
  // The trained module's first name component -> the dense model's (a cut or converted
  // Sequential names its children otherwise), and a parameter's dense name through it.
  // The weight of MoE layers' auxiliary-loss gradients for a micro-batch whose mean loss the
  // step multiplies by `weight` (times the fp16 loss scale, as scale_loss applies to the loss).
  double aux_grad_scale(double weight) const {
    const LossScaler& sc = up->scaler();
    return sc.dynamic() ? weight * sc.scale() : weight;
  }
  void map_child_names();
  std::string dense_name(const std::string& name) const;
  std::map<std::string, std::string> child_name;
  void place_parameters();
  std::unique_ptr<engine::ExpertShards> experts;  // ep > 1
  void split_shard_groups();
  // What checkpoints hold: the strategy's pieces (frozen parameters unless save_frozen is off)
  // and the buffers.
  std::vector<StatePiece> state() {
    auto pieces = up->state();
    if (!L.opts.save_frozen) {
      pieces.erase(std::remove_if(pieces.begin(), pieces.end(),
                                  [&](const StatePiece& p) {
                                    return p.key.rfind("param/", 0) == 0 && frozen.count(p.key.substr(6));
                                  }),
                   pieces.end());
    }
    auto buffers = L.buffer_state();
    pieces.insert(pieces.end(), buffers.begin(), buffers.end());
    return pieces;
  }
  // The dense parameters a checkpoint must hold.
  std::vector<std::pair<std::string, std::vector<int64_t>>> saved_params() const {
    if (L.opts.save_frozen) return dense_params;
    std::vector<std::pair<std::string, std::vector<int64_t>>> out;
    for (const auto& p : dense_params)
      if (!frozen.count(p.first)) out.push_back(p);
    return out;
  }
  // The whole model's names and shapes, taken before any cut: what a checkpoint must hold.
  std::vector<std::pair<std::string, std::vector<int64_t>>> dense_params, dense_buffers;
  std::set<std::string> float64;  // parameters given in float64 (kept so by full_parameters)
  std::set<std::string> frozen;   // dense names of the parameters that do not require gradients
  int64_t trainable = 0;          // their complement's scalar count
};

// Wraps the chosen layers of `net` (after its tensor-parallel conversion, before the pipeline
// cut) in Checkpointed; with a pipeline the cut is fixed first, since "the first N" counts per
// stage. Parameter names do not change.
void Engine::Impl::checkpoint_layers(std::vector<int64_t>& cut) {
  const auto& cfg = L.cfg;
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(L.net);
  if (!seq) {
    throw std::invalid_argument("--activation-checkpointing " + to_string(cfg.activation_checkpointing) +
                                " recomputes children of a torch::nn::Sequential, and this model is not one; wrap "
                                "its blocks in tandem::Checkpointed (tandem/activation_checkpoint.h) instead");
  }
  torch::nn::Sequential net(seq);
  if (cfg.pp > 1 && cut.empty())
    cut = partition_by_parameters(net, cfg.pp * pipeline_chunks(cfg.schedule, cfg.virtual_stages));
  L.net = checkpoint_sequential(net, cfg.activation_checkpointing, cfg.pp > 1 ? cut : std::vector<int64_t>{}).ptr();
}

// L.placed: each trained parameter's placement under the dense model's names. A cut or
// converted Sequential names its children otherwise (a pipeline stage by their index, the
// tensor-parallel form as it builds them): the first component of a name is the child's
// position, and the dense model's name at that position replaces it.
void Engine::Impl::map_child_names() {
  if (!L.grid) return;
  std::vector<std::string> dense_names, net_names;
  for (auto& c : L.dense_sequential()->named_children()) dense_names.push_back(c.key());
  for (auto& c : L.net_sequential()->named_children()) net_names.push_back(c.key());
  for (size_t i = 0; i < dense_names.size() && i < net_names.size(); ++i)
    child_name[L.pipe ? std::to_string(i) : net_names[i]] = dense_names[i];
}

std::string Engine::Impl::dense_name(const std::string& name) const {
  const auto dot = name.find('.');
  auto it = child_name.find(name.substr(0, dot));
  if (it == child_name.end()) return name;
  return dot == std::string::npos ? it->second : it->second + name.substr(dot);
}

void Engine::Impl::place_parameters() {
  for (auto& p : parameter_placements(*L.trained_module, L.grid ? L.grid->tp()->rank() : 0)) {
    p.dense_name = dense_name(p.dense_name);
    L.placed[p.name] = p;
  }
}

void Engine::Impl::build(std::shared_ptr<torch::nn::Module> model, ForwardFn forward, const OptimizerOptions& oo) {
  auto& cfg = L.cfg;
  const int world = L.world->size();
  validate(cfg, world);
  validate(oo);
  if (!model) throw std::invalid_argument("tandem::Engine: the model is null");
  const bool sequential = static_cast<bool>(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model));
  if (!sequential && cfg.tp * cfg.pp * cfg.cp > 1) {
    throw std::invalid_argument("--tp " + std::to_string(cfg.tp) + " x --pp " + std::to_string(cfg.pp) + " x --cp " +
                                std::to_string(cfg.cp) +
                                " cuts the model between children or converts its layers, which needs a "
                                "torch::nn::Sequential; this model is not one (use --tp 1 --pp 1 --cp 1, or build "
                                "it as a Sequential)");
  }
  if (!sequential && !forward) {
    throw std::invalid_argument("tandem::Engine: a model that is not a torch::nn::Sequential needs its forward "
                                "function (pass the module holder, or a ForwardFn)");
  }
  L.dense = model;
  L.dense->to(L.rt->device());
  for (auto& p : L.dense->named_parameters()) {
    dense_params.emplace_back(p.key(), p.value().sizes().vec());
    if (p.value().scalar_type() == at::kDouble) float64.insert(p.key());
    if (!p.value().requires_grad()) frozen.insert(p.key());
    else trainable += p.value().numel();
  }
  for (auto& b : L.dense->named_buffers()) dense_buffers.emplace_back(b.key(), b.value().sizes().vec());
  parameters = models::count_parameters(*L.dense);
  if (cfg.tp * cfg.pp * cfg.cp > 1) L.grid = std::make_unique<ProcessGrid>(L.world, cfg.tp, cfg.pp, cfg.cp);
  L.dp = L.grid ? L.grid->dp_cp() : L.world;
  L.data = L.grid ? L.grid->dp() : L.world;
  L.cp = L.grid ? L.grid->cp() : nullptr;
  if (is_hybrid(cfg.strategy)) split_shard_groups();
  // Where the stages are cut: measured on the dense model (the tensor-parallel one would run its
  // collectives on rank 0 alone), before any step.
  std::vector<int64_t> cut;
  if (cfg.pp > 1 && cfg.partition.method == PartitionMethod::kLayers) cut = cfg.partition.layers;
  if (cfg.pp > 1 && cfg.partition.method == PartitionMethod::kTime) {
    if (!L.opts.partition_sample.defined()) {
      throw std::invalid_argument("--pp-partition time needs a micro-batch of inputs to time "
                                  "(EngineOptions::partition_sample)");
    }
    auto dense = L.dense_sequential();
    cut = partition_by_time(dense, L.opts.partition_sample.to(L.rt->device()),
                            cfg.pp * pipeline_chunks(cfg.schedule, cfg.virtual_stages), *L.world);
  }
  L.net = L.dense;
  if (cfg.tp > 1) {
    auto convert = L.opts.tensor_parallel
                       ? L.opts.tensor_parallel
                       : [](torch::nn::Sequential d, CommPtr tp, const tp::TensorParallelOptions& o) {
                           return tp::tensor_parallel(std::move(d), tp, o);
                         };
    tp::TensorParallelOptions o;
    o.sequence_parallel = cfg.sequence_parallel;
    L.net = convert(L.dense_sequential(), L.grid->tp(), o).ptr();
  }
  if (L.cp) use_context_parallel(L.net_sequential(), L.cp);
  if (cfg.ep > 1) experts = engine::split_experts(L);  // before wrappers adopt the layers' children
  if (cfg.activation_checkpointing.enabled()) checkpoint_layers(cut);
  if (cfg.pp > 1) {
    PipelineOptions po;
    po.partition = cut;
    po.micro_batches = cfg.micro_batches;
    po.schedule = cfg.schedule;
    po.virtual_stages = pipeline_chunks(cfg.schedule, cfg.virtual_stages);
    po.device = L.rt->device();
    L.pipe = std::make_unique<Pipeline>(L.net_sequential(), L.grid->pp(), po);
  }
  L.trained_module = L.pipe ? L.pipe->stage_module().ptr() : L.net;
  map_child_names();
  if (experts) engine::bank_experts(L, *experts, [this](const std::string& n) { return dense_name(n); });
  place_parameters();
  for (auto& p : L.trained_module->parameters())
    if (p.requires_grad()) L.trained.push_back(p);
  L.run = std::move(forward);
  if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(L.net)) {
    L.run = [seq](const at::Tensor& x) -> at::Tensor { return seq->forward(x); };
  }
  if (experts) {
    up = engine::with_experts([&] { return engine::make_updater(L, oo); }, L, *experts, oo);
  } else {
    up = engine::make_updater(L, oo);
  }
  if (L.opts.init_from) initialise(*L.opts.init_from);
  L.opts.init_from = nullptr;  // once: what it holds (mapped files) goes now
  comms = {L.world};
  comm_names = {"world"};
  if (L.grid) {
    comms.insert(comms.end(), {L.grid->tp(), L.grid->pp(), L.grid->dp()});
    comm_names.insert(comm_names.end(), {"tp", "pp", "dp"});
  }
  if (L.cp) {
    comms.insert(comms.end(), {L.grid->cp(), L.grid->dp_cp()});
    comm_names.insert(comm_names.end(), {"cp", "dp_cp"});
  }
  if (L.replicate) {
    comms.insert(comms.end(), {L.shard, L.replicate});
    comm_names.insert(comm_names.end(), {"shard", "replicate"});
  }
  if (experts) {
    comms.insert(comms.end(), {experts->ep, experts->edp});
    comm_names.insert(comm_names.end(), {"ep", "edp"});
  }
}

// hsdp, hsdp2: groups of G consecutive data-parallel ranks (L.shard) and the ranks holding the
// same shard index in every group (L.replicate; null for one group of them all, which is ZeRO
// and splits nothing, so that it runs where splitting cannot: replicas of several processes).
// G defaults to the ranks per host.
void Engine::Impl::split_shard_groups() {
  auto& cfg = L.cfg;
  const int dp = L.dp->size();
  if (cfg.shard_group == 0) cfg.shard_group = ranks_per_host(*L.rt, to_string(cfg.strategy));
  if (dp % cfg.shard_group != 0) {
    throw std::invalid_argument("--shard-group " + std::to_string(cfg.shard_group) + " does not divide the " +
                                std::to_string(dp) + " data-parallel ranks; give a divisor of " + std::to_string(dp));
  }
  const int g = cfg.shard_group, r = L.dp->rank();
  if (g == dp) {  // one group: ZeRO over the data-parallel ranks, nothing to split
    L.shard = L.dp;
    return;
  }
  L.shard = L.dp->split(/*color=*/r / g, /*key=*/r % g);
  L.replicate = L.dp->split(/*color=*/r % g, /*key=*/r / g);
}

Engine::Engine(Runtime& rt, std::shared_ptr<torch::nn::Module> model, ForwardFn forward, OptimizerOptions optimizer,
               ParallelConfig config, EngineOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->L.rt = &rt;
  impl_->L.cfg = std::move(config);
  impl_->L.opts = std::move(options);
  impl_->L.world = rt.world();
  impl_->build(std::move(model), std::move(forward), optimizer);
  reset_stats();
}

Engine::~Engine() {
  if (impl_->pending_save && impl_->pending_save->pending()) {
    std::cerr << "tandem: an asynchronous checkpoint was never committed (call Engine::wait_checkpoint() before the "
                 "Engine goes); the previous checkpoint stays the newest\n";
  }
}

// ---- steps

at::Tensor Engine::step(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss_fn,
                        const StepOptions& options) {
  zero_grad();
  auto loss = forward_backward(inputs, targets, loss_fn, options);
  optimizer_step();
  return loss;
}

void Engine::zero_grad() {
  impl_->up->begin_step();
  impl_->fresh_step = true;
  impl_->forward_s = 0.0;
}

at::Tensor Engine::forward(const at::Tensor& inputs) {
  auto& I = *impl_;
  if (I.L.pipe) throw std::logic_error("Engine::forward: with --pp the pipeline runs the step; call step()");
  if (!I.fresh_step) I.up->prepare_forward();
  I.fresh_step = false;
  return I.up->forward(I.split_input(I.cast_input(inputs)));
}

at::Tensor Engine::Impl::split_input(const at::Tensor& x) const {
  if (!L.cp) return x;
  if (x.dim() < 2) {
    throw std::invalid_argument("--cp " + std::to_string(L.cp->size()) +
                                " splits dimension 1 of the inputs (sequences [B, T, ...]); these are " +
                                c10::str(x.sizes()));
  }
  return cp::split_sequence(x, 1, L.cp->rank(), L.cp->size());
}

Engine::Impl::CpParts Engine::Impl::split_for_cp(const at::Tensor& x, const at::Tensor& y, const LossFn& loss_fn,
                                                 const StepOptions& so) const {
  CpParts parts{split_input(x), y, loss_fn};
  if (!L.cp) return parts;
  if (y.defined() && y.dim() >= 2 && y.size(1) == x.size(1)) {
    parts.y = cp::split_sequence(y, 1, L.cp->rank(), L.cp->size());
    return parts;
  }
  // A sum over the replica's terms counts each term on every cp rank: each takes 1/cp of it.
  const bool sum = so.reduction == LossReduction::kSum;
  const int64_t local = parts.x.size(1);
  parts.loss_fn = [loss_fn, cp = L.cp, sum, local](const at::Tensor& out, const at::Tensor& target) {
    if (out.dim() < 2 || out.size(1) != local) {
      throw std::invalid_argument("--cp: targets without a token per position need the model's output per position "
                                  "([B, T/cp, ...], gathered over the cp ranks for the loss); this output is " +
                                  c10::str(out.sizes()));
    }
    const double n = cp->size();
    auto l = loss_fn(cp::gather_sequence(out, 1, cp, /*grad_scale=*/n), target);
    return sum ? l / n : l;
  };
  return parts;
}

at::Tensor Engine::Impl::gather_output(const at::Tensor& out) const {
  if (!L.cp || !out.defined() || out.dim() < 2) return out;
  return cp::gather_sequence(out, 1, L.cp);
}

void Engine::backward(const at::Tensor& loss) { impl_->up->scale_loss(loss).backward(); }

bool Engine::optimizer_step() {
  auto& I = *impl_;
  ++I.steps;
  bool stepped = false;
  {
    trace::Span span("optimizer step", "compute");
    stepped = I.up->step();
  }
  if (I.pending_save) {  // every rank has one after the same save(): the check is collective
    Impl::Uncounted uncounted(I);
    auto cpu = I.L.rt->cpu_world();
    if (I.pending_save->all_written(*cpu)) wait_checkpoint();
  }
  return stepped;
}

at::Tensor Engine::forward_backward(const at::Tensor& inputs, const at::Tensor& targets, const LossFn& loss_fn,
                                    const StepOptions& options) {
  if (options.reduction == LossReduction::kSum && !(options.terms > 0)) {
    throw std::invalid_argument(
        "Engine: LossReduction::kSum needs StepOptions::terms, the loss terms of the global batch");
  }
  auto& I = *impl_;
  I.fresh_step = false;
  auto p = I.split_for_cp(I.cast_input(inputs), targets, loss_fn, options);
  const bool meter = MemoryMeter::installed();
  const int64_t base = meter ? MemoryMeter::current_bytes() : 0;
  if (meter) MemoryMeter::reset_peak();
  const double recompute_before = recompute_seconds();
  auto loss =
      I.L.pipe ? I.pipeline_pass(p.x, p.y, p.loss_fn, options) : I.accumulate_pass(p.x, p.y, p.loss_fn, options);
  if (meter) I.peak_activation = std::max(I.peak_activation, MemoryMeter::peak_bytes() - base);
  I.recompute_s += recompute_seconds() - recompute_before;
  // The replica's loss: the cp ranks' parts averaged (each a mean of as many tokens, or the
  // same value where the output was gathered).
  if (I.L.cp && loss.defined()) {
    loss = loss.detach().clone();
    I.L.cp->allreduce(loss, ReduceOp::kAvg);
  }
  return loss;
}

// The pipeline back-propagates each micro-batch's loss / m and returns their mean. kSum: the
// micro-batch's sum normalised by the global batch's terms (times dp, undone by the replicas'
// average) and times m makes both the step's. fp16: the last stage back-propagates the scaled
// loss; the step's loss is reported unscaled.
at::Tensor Engine::Impl::pipeline_pass(const at::Tensor& x, const at::Tensor& y, const LossFn& loss_fn,
                                       const StepOptions& so) {
  const double norm = static_cast<double>(L.dp_size()) / std::max(1.0, so.terms);
  const double m = static_cast<double>(L.cfg.micro_batches);
  const auto t0 = Clock::now();
  trace::Span span("pipeline forward and backward", "compute");
  moe::set_aux_grad_scale(aux_grad_scale((so.reduction == LossReduction::kSum ? 1.0 : so.loss_weight) / m));
  auto loss = L.pipe->train_step(x, y, [&](const at::Tensor& out, const at::Tensor& target) {
    at::Tensor l = loss_fn(out, target);
    if (so.reduction == LossReduction::kSum) {
      l = l * (norm * m);
    } else if (so.loss_weight != 1.0) {
      l = l * so.loss_weight;
    }
    return up->scale_loss(l);
  });
  forward_s += seconds_since(t0);
  const LossScaler& sc = up->scaler();
  if (sc.dynamic()) loss = loss / sc.scale();
  up->after_pipeline_backward();
  if (steps > 0) {  // the first step also agrees shapes
    pipe_step_s += L.pipe->stats().step_seconds;
    pipe_compute_s += L.pipe->stats().compute_seconds;
    ++pipe_steps;
  }
  peak_live = std::max(peak_live, L.pipe->stats().peak_live_micro_batches);
  return loss;
}

// --grad-accum K (tandem/accumulate.h): DDP and ZeRO-1 communicate once per step. kMean weights
// each micro-batch's mean loss by its rows; kSum normalises every part by the global batch's
// terms already, so the parts add up to the step's loss.
at::Tensor Engine::Impl::accumulate_pass(const at::Tensor& x, const at::Tensor& y, const LossFn& loss_fn,
                                         const StepOptions& so) {
  const double norm = static_cast<double>(L.dp_size()) / std::max(1.0, so.terms);
  return up->accumulate(x, y, L.cfg.grad_accum, [&](const at::Tensor& xp, const at::Tensor& yp, double w) {
    const auto t0 = Clock::now();
    const double waited = up->gather_wait_seconds();
    at::Tensor part;
    {
      trace::Span span("forward", "compute");
      moe::set_aux_grad_scale(aux_grad_scale(so.reduction == LossReduction::kSum ? w : w * so.loss_weight));
      part = loss_fn(up->forward(xp), yp);
    }
    // Time spent waiting for other ranks' parameters is theirs.
    forward_s += seconds_since(t0) - (up->gather_wait_seconds() - waited);
    trace::Span span("backward", "compute");
    if (so.reduction == LossReduction::kSum) {
      at::Tensor l = part * norm;
      up->scale_loss(l).backward();
      return l;
    }
    at::Tensor weighted = so.loss_weight != 1.0 ? part * so.loss_weight : part;
    if (w != 1.0) weighted = weighted * w;
    up->scale_loss(weighted).backward();
    return w == 1.0 ? part : part * w;
  });
}

at::Tensor Engine::predict(const at::Tensor& inputs) {
  auto& I = *impl_;
  Impl::Uncounted uncounted(I);
  torch::NoGradGuard ng;
  I.up->prepare_predict();
  auto x = I.split_input(I.cast_input(inputs));
  if (!I.L.pipe) return I.gather_output(I.up->forward(x));
  if (!I.eval_pipe) {
    PipelineOptions po = I.L.pipe->options();
    po.micro_batches = 1;
    po.partition = I.L.pipe->partition();
    I.eval_pipe = std::make_unique<Pipeline>(I.L.net_sequential(), I.L.grid->pp(), po);
  }
  return I.gather_output(I.eval_pipe->forward(x));
}

bool Engine::is_output_rank() const {
  const auto* g = impl_->L.grid.get();
  const auto* pipe = impl_->L.pipe.get();
  return !g || (g->tp_rank() == 0 && g->cp_rank() == 0 && (pipe ? pipe->is_last() : g->pp_rank() == g->pp_size() - 1));
}

void Engine::evaluate(const at::Tensor& inputs, int64_t n, int64_t rows, const ScoreFn& score) {
  const int dp = dp_size(), r = dp_rank();
  n = std::min<int64_t>(n, inputs.size(0));
  rows = std::max<int64_t>(1, rows);
  const int64_t rounds = (n + rows * dp - 1) / (rows * dp);
  const bool counts = is_output_rank();
  Impl::Uncounted uncounted(*impl_);
  train(false);
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t from = std::min(n, (k * dp + r) * rows), to = std::min(n, from + rows);
    auto x = (from < to ? inputs.narrow(0, from, to - from) : inputs.narrow(0, 0, 1)).to(impl_->L.rt->device());
    auto out = predict(x);
    if (from < to && counts) score(out, from, to);
  }
  train(true);
}

void Engine::train(bool on) { impl_->L.net->train(on); }

void Engine::set_lr(double lr) { impl_->up->set_lr(lr); }
double Engine::lr() const { return impl_->up->lr(); }

// ---- checkpoints

std::string Engine::wait_checkpoint() {
  auto& I = *impl_;
  if (!I.pending_save) return "";
  Impl::Uncounted uncounted(I);
  auto pending = std::move(I.pending_save);
  trace::Span span("checkpoint commit", "checkpoint");
  return pending->finish(*I.L.rt->cpu_world());
}

std::string Engine::save(const std::string& root, CheckpointMeta meta, const CheckpointSaveOptions& options) {
  auto& I = *impl_;
  Impl::Uncounted uncounted(I);
  wait_checkpoint();
  trace::Span span("checkpoint save", "checkpoint");
  const auto t0 = Clock::now();
  const auto& cfg = I.L.cfg;
  if (meta.model.empty()) meta.model = I.L.opts.model_name;
  if (meta.model_description.empty()) {
    meta.model_description = meta.model + " (" + std::to_string(I.parameters) + " parameters)";
  }
  if (meta.strategy.empty()) {
    meta.strategy = std::string(to_string(cfg.strategy)) + (cfg.pp > 1 ? " x pp" + std::to_string(cfg.pp) : "");
  }
  meta.precision = precision_name(cfg.precision);
  const LossScaler& sc = I.up->scaler();
  meta.loss_scale = sc.scale();
  meta.loss_scale_good_steps = sc.overflow_free_steps();
  meta.skipped_steps = sc.skipped_steps();
  meta.optimizer = I.up->optimizer_kind();
  auto dir = save_state(root, meta, I.state(), I.up->optimizer_step(), *I.L.rt->cpu_world(), options);
  if (options.async) I.pending_save = options.async;
  ++I.saves;
  I.save_stall_s += seconds_since(t0);
  return dir;
}

CheckpointMeta Engine::load(const std::string& dir_or_root, CheckpointLoadOptions options) {
  namespace fs = std::filesystem;
  Impl::Uncounted uncounted(*impl_);
  wait_checkpoint();
  std::string dir = dir_or_root;
  if (!fs::exists(fs::path(dir) / "manifest.json")) {
    dir = latest_checkpoint(dir_or_root);
    if (dir.empty()) {
      throw std::runtime_error("no complete checkpoint in '" + dir_or_root +
                               "' (neither a checkpoint directory nor a root holding step-N checkpoints)");
    }
  }
  auto& I = *impl_;
  if (options.expect_model.empty()) options.expect_model = I.L.opts.model_name;
  StateTarget t;
  t.params = I.saved_params();
  t.buffers = I.dense_buffers;
  t.optimizer = I.up->optimizer_kind();
  t.prepare = [&I](const std::vector<std::string>& slots, int64_t step) { I.up->prepare_load(slots, step); };
  t.pieces = [&I] { return I.state(); };
  auto meta = load_state(dir, t, I.L.world->rank(), I.L.rt->cpu_world().get(), options);
  I.up->finish_load();
  I.up->restore_loss_scaler(meta);
  return meta;
}

// Every rank reads the elements it holds of each parameter the source has (load_parameters),
// then the strategy carries them to its shards and compute copies.
void Engine::Impl::initialise(const ParameterSource& source) {
  load_parameters(source, up->state(), *L.rt->cpu_world());
  up->finish_load();
}

// Every rank's pieces of the parameters written into whole tensors that are zero elsewhere, then
// summed over the world: each element comes from the one rank that holds it as replica 0.
std::map<std::string, at::Tensor> Engine::full_parameters() {
  auto& I = *impl_;
  Impl::Uncounted uncounted(I);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, shape] : I.dense_params)
    out[name] = at::zeros(shape, I.float64.count(name) ? at::kDouble : at::kFloat);
  torch::NoGradGuard ng;
  for (const auto& piece : I.up->state()) {
    if (piece.key.rfind("param/", 0) != 0 || piece.placement.replica != 0) continue;
    auto flat = out.at(piece.key.substr(6)).view({-1});
    const auto data = piece.data.to(at::kCPU, flat.scalar_type());
    for (const auto& r : placement_runs(piece.placement))
      flat.narrow(0, r.global, r.length).copy_(data.narrow(0, r.held, r.length));
  }
  auto cpu = I.L.rt->cpu_world();
  if (cpu->size() > 1)
    for (auto& [name, t] : out) cpu->allreduce(t, ReduceOp::kSum);
  return out;
}

// ---- statistics

EngineStats Engine::stats() const {
  const auto& I = *impl_;
  EngineStats s;
  s.steps = I.steps;
  s.checkpoints.saved = I.saves;
  s.checkpoints.stall_seconds = I.save_stall_s;
  for (size_t c = 0; c < I.comms.size(); ++c) {
    std::map<std::string, OpStats> delta;
    for (auto& [op, st] : I.comms[c]->stats()) {
      OpStats d = st;
      auto it = I.comm_before[c].find(op);
      if (it != I.comm_before[c].end()) {
        d.calls -= it->second.calls;
        d.bytes -= it->second.bytes;
        d.seconds -= it->second.seconds;
      }
      if (d.calls <= 0) continue;
      delta[op] = d;
      s.comm.groups[I.comm_names[c]][op] = d;
      auto& sum = s.comm.ops[op];
      sum.calls += d.calls;
      sum.bytes += d.bytes;
      sum.seconds += d.seconds;
      s.comm.seconds += d.seconds;
    }
    s.comm.wire_bytes += wire_bytes(delta, I.comms[c]->size());
  }
  I.up->communication(s.ddp);
  if (I.L.cp) {
    const auto ring = cp::ring_stats();
    s.cp.transfer_seconds = ring.transfer_seconds;
    s.cp.exposed_seconds = ring.exposed_seconds;
    s.cp.bytes = ring.bytes;
    s.cp.hidden_fraction =
        ring.transfer_seconds > 0 ? std::clamp(1.0 - ring.exposed_seconds / ring.transfer_seconds, 0.0, 1.0) : 0.0;
  }
  s.moe = moe::moe_stats();
  I.up->memory(s.memory);
  s.memory.peak_rss_bytes = peak_rss_bytes();
  s.memory.peak_activation_bytes = I.peak_activation;
  s.recompute_seconds = I.recompute_s;
  if (I.L.pipe) {
    double step_s = I.pipe_step_s, compute_s = I.pipe_compute_s;
    int64_t n = I.pipe_steps;
    if (compute_s <= 0.0) {  // one step only: that one
      step_s = I.L.pipe->stats().step_seconds;
      compute_s = I.L.pipe->stats().compute_seconds;
      n = 1;
    }
    s.pipeline.bubble = compute_s > 0 ? std::max(0.0, step_s - compute_s) / compute_s : 0.0;
    s.pipeline.step_ms = step_s * 1e3 / static_cast<double>(std::max<int64_t>(1, n));
    s.pipeline.compute_ms = compute_s * 1e3 / static_cast<double>(std::max<int64_t>(1, n));
    s.pipeline.peak_live_micro_batches = I.peak_live;
  }
  s.scaler.scale = I.up->scaler().scale();
  s.scaler.skipped_steps = I.up->scaler().skipped_steps();
  return s;
}

void Engine::reset_stats() {
  auto& I = *impl_;
  I.comm_before.clear();
  for (auto& c : I.comms) I.comm_before.push_back(c->stats());
  I.steps = 0;
  I.pipe_steps = 0;
  I.pipe_step_s = I.pipe_compute_s = 0.0;
  I.peak_live = 0;
  I.saves = 0;
  I.save_stall_s = 0.0;
  cp::reset_ring_stats();
  moe::reset_moe_stats();
  I.up->reset_stats();
}

// ---- layout

const ParallelConfig& Engine::config() const { return impl_->L.cfg; }
int Engine::world_size() const { return impl_->L.world->size(); }
int Engine::dp_size() const { return impl_->L.data->size(); }
int Engine::dp_rank() const { return impl_->L.data->rank(); }
c10::Device Engine::device() const { return impl_->L.rt->device(); }
CommPtr Engine::world() const { return impl_->L.world; }
CommPtr Engine::dp_group() const { return impl_->L.data; }
CommPtr Engine::ep_group() const { return impl_->experts ? impl_->experts->ep : nullptr; }
const ProcessGrid* Engine::grid() const { return impl_->L.grid.get(); }
const Pipeline* Engine::pipeline() const { return impl_->L.pipe.get(); }
std::vector<int64_t> Engine::partition() const {
  return impl_->L.pipe ? impl_->L.pipe->partition() : std::vector<int64_t>{};
}
torch::nn::Module& Engine::module() { return *impl_->L.trained_module; }
std::vector<at::Tensor> Engine::trained_parameters() const {
  auto out = impl_->L.trained;
  if (impl_->experts)  // the experts this rank keeps, banked apart from the module the strategy wraps
    for (auto& [name, p] : impl_->experts->trained) out.push_back(p);
  return out;
}
const LossScaler& Engine::loss_scaler() const { return impl_->up->scaler(); }
int64_t Engine::parameters() const { return impl_->parameters; }
int64_t Engine::trainable_parameters() const { return impl_->trainable; }
double Engine::last_forward_seconds() const { return impl_->forward_s; }
double Engine::last_grad_norm() const { return impl_->up->last_grad_norm(); }

}  // namespace tandem
