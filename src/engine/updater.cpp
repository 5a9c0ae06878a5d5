// The two updaters behind the Engine (updater.h): replicas with a MixedPrecisionOptimizer
// (single, ddp) and ZeroDataParallel (zero1-3), each reporting the pieces of state it holds.
#include "engine/updater.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <map>
#include <stdexcept>

#include "tandem/activation_checkpoint.h"
#include "tandem/ddp.h"
#include "tandem/tensor_parallel.h"
#include "tandem/zero.h"

namespace tandem::engine {

namespace {
constexpr int64_t kMiB = 1024 * 1024;
}

torch::nn::Sequential Layout::net_sequential() const {
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net);
  if (!seq) throw std::invalid_argument("this layout needs the model to be a torch::nn::Sequential");
  return torch::nn::Sequential(seq);
}

torch::nn::Sequential Layout::dense_sequential() const {
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(dense);
  if (!seq) throw std::invalid_argument("this layout needs the model to be a torch::nn::Sequential");
  return torch::nn::Sequential(seq);
}

int64_t Layout::replica_rank() const { return (grid ? grid->tp()->rank() : 0) + dp_replica(); }

std::vector<StatePiece> Layout::buffer_state() const {
  std::vector<StatePiece> out;
  for (auto& kv : trained_module->named_buffers(true)) {
    auto p = Placement::whole(kv.value().sizes().vec());
    p.replica = replica_rank();
    out.push_back({"buffer/" + kv.key(), p, kv.value().detach().view({-1})});
  }
  return out;
}

std::vector<StatePiece> Layout::frozen_state() const {
  std::vector<StatePiece> out;
  for (auto& kv : trained_module->named_parameters(true)) {
    if (kv.value().requires_grad()) continue;
    const auto& placed = this->placed.at(kv.key());
    auto p = placed.placement;
    p.replica += dp_replica();
    out.push_back({"param/" + placed.dense_name, p, kv.value().detach().view({-1})});
  }
  return out;
}

namespace {

// The trainable parameters of the trained module with their names, in its order (the order of
// Layout::trained and of the strategies' parameter lists).
std::vector<std::pair<std::string, at::Tensor>> trainable_named(const Layout& L) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& kv : L.trained_module->named_parameters())
    if (kv.value().requires_grad()) out.emplace_back(kv.key(), kv.value());
  return out;
}

// A split model clips, and in fp16 checks overflow, by the norm of the whole model's gradient:
// the tensor-parallel shards' squares summed over tp, each stage's total over pp, so that every
// stage and shard clips by one coefficient and skips a step together.
bool whole_model_norm(const Layout& L) {
  return L.grid && (L.cfg.max_grad_norm > 0 || L.cfg.precision == Precision::kFP16);
}

// The strategies learn which parameters are tensor-parallel shards: for the norm above, and for
// LARS and LAMB, whose trust ratios need each shard's norm summed over tp.
bool model_parallel_norms(const Layout& L, const OptimizerOptions& oo) {
  return whole_model_norm(L) || (L.grid && L.cfg.tp > 1 && is_layerwise(oo));
}

// Which of the trained parameters are blocks of a larger tensor (their squares summed over tp),
// in the trained module's order.
std::vector<bool> shard_flags(const Layout& L) {
  std::vector<bool> flags;
  for (auto& p : trainable_named(L)) {
    const auto& pl = L.placed.at(p.first).placement;
    flags.push_back(pl.local_shape != pl.global_shape);
  }
  return flags;
}

// single and ddp: every replica holds the whole (stage of the) model and steps it.
class Replicated final : public Updater {
 public:
  Replicated(Layout& L, const OptimizerOptions& oo) : L_(L) {
    const int dp = L.dp_size();
    // The fp32 masters are taken before the model is converted to the compute dtype.
    opt_ = std::make_unique<MixedPrecisionOptimizer>(L.trained, L.cfg.precision, oo, L.cfg.loss_scaler,
                                                     dp > 1 ? L.dp : nullptr);
    if (L.cfg.precision != Precision::kFP32) L.net->to(compute_dtype(L.cfg.precision));
    if (model_parallel_norms(L, oo)) opt_->set_model_parallel(shard_flags(L), L.grid->tp(), L.grid->pp());
    // DDP over the replicas; a pipeline stage's gradients are complete only after the whole
    // micro-batched step and are averaged in one all-reduce instead.
    if (is_ddp(L.cfg.strategy) && !L.pipe && (!L.grid || dp > 1)) {
      DDPOptions o;
      o.bucket_cap_bytes = (L.cfg.bucket_mb > 0 ? L.cfg.bucket_mb : 25) * kMiB;
      o.find_unused_parameters = L.cfg.find_unused;
      if (L.cfg.compress == Compression::kBF16) o.compress_dtype = at::kBFloat16;
      if (L.cfg.compress == Compression::kFP16) o.compress_dtype = at::kHalf;
      if (L.cfg.compress == Compression::kPowerSGD) o.powersgd = L.cfg.powersgd;
      o.overlap = L.cfg.overlap;
      o.communicate = L.cfg.communicate;
      ddp_ = std::make_unique<DistributedDataParallel>(L.net, L.dp, o);
    }
    if (L.pipe && dp > 1) averager_ = std::make_unique<GradientAverager>(L.trained, L.dp);
  }

  void begin_step() override {
    if (ddp_) {
      ddp_->prepare_forward();
      ddp_->zero_grad();
    } else {
      opt_->zero_grad();
    }
  }
  void prepare_forward() override {
    if (ddp_) ddp_->prepare_forward();
  }
  void prepare_predict() override {}
  at::Tensor forward(const at::Tensor& x) override { return L_.run(x); }
  at::Tensor scale_loss(const at::Tensor& loss) const override { return opt_->scale_loss(loss); }
  void after_pipeline_backward() override {
    if (averager_) averager_->average();
  }
  bool step() override { return opt_->step(L_.cfg.max_grad_norm); }
  void set_lr(double lr) override { opt_->set_lr(lr); }
  double lr() const override { return lr_of(opt_->optimizer()); }
  double last_grad_norm() const override { return opt_->last_grad_norm(); }
  void add_squared_norm(double sq) override { opt_->add_squared_norm(sq); }
  const LossScaler& scaler() const override { return opt_->scaler(); }
  at::Tensor accumulate(const at::Tensor& x, const at::Tensor& y, int64_t k, const MicroBatchPass& pass) override {
    return accumulate_gradients(x, y, k, ddp_.get(), nullptr, pass);
  }
  void communication(EngineStats::DataParallel& s) const override {
    if (!ddp_) return;
    auto d = ddp_->stats();
    s.comm_seconds = d.comm_seconds;
    s.exposed_seconds = d.exposed_seconds;
    s.hidden_fraction = d.hidden_fraction();
    s.bytes = d.bytes;
  }
  void reset_stats() override {
    if (ddp_) ddp_->reset_stats();
  }

  std::vector<StatePiece> state() override {
    std::vector<StatePiece> out = L_.frozen_state();
    const auto masters = optimizer_tensors();
    const auto named = trainable_named(L_);
    for (size_t i = 0; i < named.size(); ++i) {
      const auto& placed = L_.placed.at(named[i].first);
      auto p = placed.placement;
      p.replica += L_.dp_replica();
      append_optimizer_pieces(out, placed.dense_name, p, masters.at(i), opt_->optimizer());
    }
    return out;
  }
  std::string optimizer_kind() const override { return tandem::optimizer_kind(opt_->optimizer()); }
  int64_t optimizer_step() const override {
    int64_t step = 0;
    for (auto& m : optimizer_tensors()) step = std::max(step, get_param_state(opt_->optimizer(), m).step);
    return step;
  }
  void prepare_load(const std::vector<std::string>& slots, int64_t step) override {
    for (auto& m : optimizer_tensors()) reset_param_state(opt_->optimizer(), m, slots, step);
  }
  void finish_load() override {
    torch::NoGradGuard ng;
    const auto masters = optimizer_tensors();
    for (size_t i = 0; i < masters.size(); ++i)
      if (!masters[i].is_same(L_.trained[i])) L_.trained[i].detach().copy_(masters[i]);
  }
  void restore_loss_scaler(const CheckpointMeta& m) override {
    opt_->restore_loss_scaler(m.loss_scale, m.loss_scale_good_steps, m.skipped_steps);
  }
  void memory(EngineStats::Memory& s) const override {
    for (auto& p : L_.trained_module->parameters()) {  // frozen ones included
      s.parameter_bytes += p.numel() * p.element_size();
      if (p.grad().defined()) s.gradient_bytes += p.grad().numel() * p.grad().element_size();
    }
    s.optimizer_state_bytes = opt_->optimizer_state_bytes() + opt_->master_bytes();
  }

 private:
  static double lr_of(torch::optim::Optimizer& o) { return o.param_groups().at(0).options().get_lr(); }
  // What the optimizer steps, in the trained module's parameter order (fp32 masters or the
  // parameters themselves).
  std::vector<at::Tensor> optimizer_tensors() const { return opt_->optimizer().param_groups().at(0).params(); }
  Layout& L_;
  std::unique_ptr<MixedPrecisionOptimizer> opt_;
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<GradientAverager> averager_;
};

// zero1-3: ZeroDataParallel over the data-parallel ranks of this rank's stage / shard.
class Sharded final : public Updater {
 public:
  Sharded(Layout& L, const OptimizerOptions& oo)
      : L_(L), sequential_(static_cast<bool>(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(L.trained_module))) {
    ZeroOptions o;
    o.stage = zero_stage(L.cfg.strategy);
    o.bucket_cap_bytes = (L.cfg.bucket_mb > 0 ? L.cfg.bucket_mb : 8) * kMiB;
    o.optimizer = oo;
    o.precision = L.cfg.precision;
    o.loss_scaler = L.cfg.loss_scaler;
    o.max_grad_norm = L.cfg.max_grad_norm;
    zero_ = L.shard ? std::make_unique<ZeroDataParallel>(L.trained_module, L.shard, L.replicate, o)
                    : std::make_unique<ZeroDataParallel>(L.trained_module, L.dp, o);
    if (model_parallel_norms(L, oo)) zero_->set_model_parallel(shard_flags(L), L.grid->tp(), L.grid->pp());
    if (L.pipe && o.stage == 3) run_pipeline_layers_unit_by_unit(*L.pipe);
  }

  void begin_step() override {
    zero_->prepare_forward();
    zero_->zero_grad();
  }
  void prepare_forward() override { zero_->prepare_forward(); }
  void prepare_predict() override { zero_->prepare_forward(); }
  at::Tensor forward(const at::Tensor& x) override {
    // A Sequential runs unit by unit (stage 3 gathers each); another module runs its own forward
    // on the parameters prepare_forward() gathered.
    return sequential_ ? zero_->forward(x) : L_.run(x);
  }
  at::Tensor scale_loss(const at::Tensor& loss) const override { return zero_->scale_loss(loss); }
  void after_pipeline_backward() override {}  // reduced in its hooks
  bool step() override { return zero_->step(); }
  void set_lr(double lr) override { zero_->set_lr(lr); }
  double lr() const override { return zero_->lr(); }
  double last_grad_norm() const override { return zero_->last_grad_norm(); }
  void add_squared_norm(double sq) override { zero_->add_squared_norm(sq); }
  const LossScaler& scaler() const override { return zero_->loss_scaler(); }
  double gather_wait_seconds() const override { return zero_->gather_wait_seconds(); }
  at::Tensor accumulate(const at::Tensor& x, const at::Tensor& y, int64_t k, const MicroBatchPass& pass) override {
    return accumulate_gradients(x, y, k, nullptr, zero_.get(), pass);
  }

  // Each owned piece is a flat range of the parameter as this rank holds it (its
  // tensor-parallel block, or the whole tensor); the data-parallel ranks hold disjoint ranges,
  // but for hybrid sharding's groups, which hold the same ranges: group k's copy is replica k.
  std::vector<StatePiece> state() override {
    // Frozen parameters ZeRO shards (stage 3) come among its pieces, without optimizer slots;
    // those it leaves whole on every rank are the replicas'.
    std::vector<StatePiece> out;
    if (zero_->frozen_numel() == 0) out = L_.frozen_state();
    append_zero_pieces(out, *zero_, L_.placed,
                       L_.replicate ? static_cast<int64_t>(L_.cfg.tp) * L_.replicate->rank() : 0);
    return out;
  }
  std::string optimizer_kind() const override { return tandem::optimizer_kind(zero_->optimizer()); }
  int64_t optimizer_step() const override { return zero_->optimizer_step(); }
  void prepare_load(const std::vector<std::string>& slots, int64_t step) override {
    zero_->reset_optimizer_state(slots, step);
  }
  void finish_load() override { zero_->refresh_from_shards(); }
  void restore_loss_scaler(const CheckpointMeta& m) override {
    zero_->restore_loss_scaler(m.loss_scale, m.loss_scale_good_steps, m.skipped_steps);
  }
  void memory(EngineStats::Memory& s) const override {
    auto m = zero_->memory();
    s.parameter_bytes = m.parameter_bytes;
    s.gradient_bytes = m.gradient_bytes;
    s.optimizer_state_bytes = m.optimizer_state_bytes;
    s.peak_gathered_bytes = m.peak_gathered_bytes;
    s.pool_bytes = m.pool_bytes;
    s.pool_misses = m.pool_misses;
  }

 private:
  // ZeRO-3 keeps only shards resident: the pipeline runs its chunks through the stage's units,
  // each gathered around its forward (per micro-batch) and again for its backward. The stage's
  // children are named by their index in the whole model, chunk after chunk.
  void run_pipeline_layers_unit_by_unit(Pipeline& pipe) {
    std::map<int64_t, int64_t> position;
    int64_t k = 0;
    for (const auto& child : pipe.stage_module()->named_children()) position[std::stoll(child.key())] = k++;
    ZeroDataParallel* z = zero_.get();
    pipe.set_run_layers([z, position](int64_t first, int64_t end, const at::Tensor& x) {
      return first == end ? x : z->forward(x, position.at(first), position.at(end - 1) + 1);
    });
  }

  Layout& L_;
  std::unique_ptr<ZeroDataParallel> zero_;
  bool sequential_;
};

}  // namespace

void append_zero_pieces(std::vector<StatePiece>& out, ZeroDataParallel& zero,
                        const std::map<std::string, ParameterPlacement>& placed, int64_t replica) {
  for (auto& z : zero.owned_pieces()) {
    const auto& pl = placed.at(z.name);
    auto p = pl.placement.flat_range(z.first, z.first + z.count);
    p.replica += replica;
    out.push_back({"param/" + pl.dense_name, p, z.value});
    for (auto& [k, v] : z.slots) out.push_back({k + "/" + pl.dense_name, p, v});
  }
}

std::unique_ptr<Updater> make_updater(Layout& L, const OptimizerOptions& oo) {
  if (zero_stage(L.cfg.strategy) > 0) return std::make_unique<Sharded>(L, oo);
  return std::make_unique<Replicated>(L, oo);
}

}  // namespace tandem::engine
