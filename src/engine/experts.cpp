// Expert parallelism in the Engine (experts.h).
#include "engine/experts.h"

#include <torch/torch.h>

#include <limits>
#include <stdexcept>

#include "engine/wrapped.h"
#include "tandem/moe.h"
#include "tandem/optim.h"
#include "tandem/precision.h"
#include "tandem/zero.h"

namespace tandem::engine {

std::unique_ptr<ExpertShards> split_experts(Layout& L) {
  const int ep = L.cfg.ep, r = L.data->rank();
  auto X = std::make_unique<ExpertShards>();
  X->ep = L.data->split(/*color=*/r / ep, /*key=*/r % ep);
  X->edp = L.data->split(/*color=*/r % ep, /*key=*/r / ep);
  // A snapshot: the layers unregister their experts while we go.
  std::vector<std::shared_ptr<torch::nn::Module>> modules = L.net->modules(/*include_self=*/true);
  int64_t layers = 0;
  for (auto& module : modules) {
    if (auto* layer = dynamic_cast<moe::ExpertParallel*>(module.get())) {
      ++layers;
      layer->use_expert_parallel(X->ep);
    }
  }
  if (layers == 0) {
    throw std::invalid_argument(
        "--ep " + std::to_string(ep) +
        " spreads the experts of mixture-of-experts layers, and this model has none; use --ep 1");
  }
  return X;
}

void bank_experts(Layout& L, ExpertShards& X, const std::function<std::string(const std::string&)>& dense_name) {
  X.bank = std::make_shared<torch::nn::Module>("ExpertBank");
  int64_t index = 0;
  for (auto& m : L.trained_module->named_modules("", /*include_self=*/true)) {
    const auto* layer = as_or_wrapped<moe::ExpertParallel>(*m.value());
    if (!layer) continue;
    const std::string prefix = m.key().empty() ? "" : m.key() + ".";
    for (auto& local : layer->local_experts()) {
      const std::string child = std::to_string(index++);
      X.bank->register_module(child, local.module);
      // Whole, or a tensor-parallel expert's blocks (the edp ranks' copies told apart when the
      // state is saved: whole or sharded).
      for (auto& p : parameter_placements(*local.module, 0)) {
        X.placed[child + "." + p.name] = {child + "." + p.name, dense_name(prefix + local.name + "." + p.dense_name),
                                          p.placement};
      }
      for (auto& p : local.module->named_parameters(/*recurse=*/true))
        if (p.value().requires_grad()) X.trained.emplace_back(child + "." + p.key(), p.value());
    }
  }
}

namespace {

std::vector<at::Tensor> tensors(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> out;
  for (auto& kv : named) out.push_back(kv.second);
  return out;
}

// How a rank's kept experts are stepped after backward, each gradient averaged over the edp ranks
// holding the same experts and divided by ep. step(clip, norm) takes the whole model's norm
// (infinite: an fp16 overflow, skip).
class ExpertStepper {
 public:
  virtual ~ExpertStepper() = default;
  virtual void zero_grad() = 0;
  virtual void reduce() = 0;  // after the step's backward passes
  virtual void step(double clip, double norm) = 0;
  virtual void set_lr(double lr) = 0;
  virtual void state(std::vector<StatePiece>& out) = 0;
  virtual void prepare_load(const std::vector<std::string>& slots, int64_t step) = 0;
  virtual void finish_load() = 0;
  virtual void restore_loss_scaler(const CheckpointMeta& m) = 0;
  virtual void memory(EngineStats::Memory& s) const = 0;
};

// ddp, hsdp: every edp rank holds its experts whole, with their whole optimizer state; their
// gradients are averaged once, at the step.
class WholeExperts final : public ExpertStepper {
 public:
  // The masters are taken while the experts are still fp32, before the dense updater converts
  // the model (whose MoE layers convert their local experts with it): construct this first.
  WholeExperts(Layout& L, ExpertShards& X, const OptimizerOptions& oo) : X_(X), params_(tensors(X.trained)) {
    opt_ = std::make_unique<MixedPrecisionOptimizer>(params_, L.cfg.precision, oo, L.cfg.loss_scaler,
                                                     X.edp->size() > 1 ? X.edp : nullptr);
    if (L.cfg.precision != Precision::kFP32) X.bank->to(compute_dtype(L.cfg.precision));
    if (X.edp->size() > 1) averager_ = std::make_unique<GradientAverager>(params_, X.edp);
  }
  void zero_grad() override { opt_->zero_grad(); }
  // An expert no token reached has no gradient: zero, so that every rank reduces the same tensors.
  void reduce() override {
    torch::NoGradGuard ng;
    for (auto& p : params_)
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    if (averager_) averager_->average();
    const double ep = static_cast<double>(X_.ep->size());
    for (auto& p : params_) p.mutable_grad().div_(ep);
  }
  void step(double clip, double norm) override { opt_->step(clip, norm); }
  void set_lr(double lr) override { opt_->set_lr(lr); }
  void state(std::vector<StatePiece>& out) override {
    const auto masters = optimizer_tensors();
    for (size_t i = 0; i < X_.trained.size(); ++i) {
      const auto& placed = X_.placed.at(X_.trained[i].first);
      auto p = placed.placement;
      p.replica = p.replica * X_.edp->size() + X_.edp->rank();
      append_optimizer_pieces(out, placed.dense_name, p, masters.at(i), opt_->optimizer());
    }
  }
  void prepare_load(const std::vector<std::string>& slots, int64_t step) override {
    for (auto& m : optimizer_tensors()) reset_param_state(opt_->optimizer(), m, slots, step);
  }
  void finish_load() override {
    torch::NoGradGuard ng;
    const auto masters = optimizer_tensors();
    for (size_t i = 0; i < masters.size(); ++i)
      if (!masters[i].is_same(params_[i])) params_[i].detach().copy_(masters[i]);
  }
  void restore_loss_scaler(const CheckpointMeta& m) override {
    opt_->restore_loss_scaler(m.loss_scale, m.loss_scale_good_steps, m.skipped_steps);
  }
  void memory(EngineStats::Memory& s) const override {
    for (auto& p : X_.bank->parameters()) {
      s.parameter_bytes += p.numel() * p.element_size();
      if (p.grad().defined()) s.gradient_bytes += p.grad().numel() * p.grad().element_size();
    }
    s.optimizer_state_bytes += opt_->optimizer_state_bytes() + opt_->master_bytes();
  }

 private:
  std::vector<at::Tensor> optimizer_tensors() const { return opt_->optimizer().param_groups().at(0).params(); }
  ExpertShards& X_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<MixedPrecisionOptimizer> opt_;
  std::unique_ptr<GradientAverager> averager_;
};

// zero1-3: ZeRO-1 over the edp ranks (DeepSpeed-MoE's expert data parallelism): each holds its
// experts' weights and gradients whole and 1/edp of their fp32 masters and optimizer state;
// gradients are all-reduced in buckets during backward, divided by ep as they arrive.
class ShardedExperts final : public ExpertStepper {
 public:
  ShardedExperts(Layout& L, ExpertShards& X, const OptimizerOptions& oo) : X_(X) {
    const double ep = static_cast<double>(X.ep->size());
    // Registered before ZeRO's hooks, which reduce what has accumulated.
    for (auto& kv : X.trained) kv.second.register_hook([ep](const at::Tensor& g) { return g / ep; });
    ZeroOptions o;
    o.stage = 1;
    o.bucket_cap_bytes = (L.cfg.bucket_mb > 0 ? L.cfg.bucket_mb : 8) * 1024 * 1024;
    o.optimizer = oo;
    o.precision = L.cfg.precision;
    o.loss_scaler = L.cfg.loss_scaler;
    o.max_grad_norm = L.cfg.max_grad_norm;
    zero_ = std::make_unique<ZeroDataParallel>(X.bank, X.edp, o);
  }
  void zero_grad() override { zero_->zero_grad(); }
  void reduce() override {}  // in backward
  void step(double, double norm) override { zero_->step(norm); }
  void set_lr(double lr) override { zero_->set_lr(lr); }
  // Each owned range once: the edp ranks own disjoint ranges of every expert.
  void state(std::vector<StatePiece>& out) override { append_zero_pieces(out, *zero_, X_.placed); }
  void prepare_load(const std::vector<std::string>& slots, int64_t step) override {
    zero_->reset_optimizer_state(slots, step);
  }
  void finish_load() override { zero_->refresh_from_shards(); }
  void restore_loss_scaler(const CheckpointMeta& m) override {
    zero_->restore_loss_scaler(m.loss_scale, m.loss_scale_good_steps, m.skipped_steps);
  }
  void memory(EngineStats::Memory& s) const override {
    const auto m = zero_->memory();
    s.parameter_bytes += m.parameter_bytes;
    s.gradient_bytes += m.gradient_bytes;
    s.optimizer_state_bytes += m.optimizer_state_bytes;
  }

 private:
  ExpertShards& X_;
  std::unique_ptr<ZeroDataParallel> zero_;
};

// The dense weights through the strategy's updater, the experts through an ExpertStepper.
class WithExperts final : public Updater {
 public:
  WithExperts(const std::function<std::unique_ptr<Updater>()>& make_dense, Layout& L, ExpertShards& X,
              const OptimizerOptions& oo)
      : L_(L), X_(X), params_(tensors(X.trained)) {
    // Hybrid sharding keeps its collectives inside host groups, and edp spans them: its experts
    // stay whole, as ddp's.
    if (zero_stage(L.cfg.strategy) > 0 && !is_hybrid(L.cfg.strategy)) {
      experts_ = std::make_unique<ShardedExperts>(L, X, oo);
    } else {
      experts_ = std::make_unique<WholeExperts>(L, X, oo);
    }
    dense_ = make_dense();
  }

  void begin_step() override {
    dense_->begin_step();
    experts_->zero_grad();
  }
  void prepare_forward() override { dense_->prepare_forward(); }
  void prepare_predict() override { dense_->prepare_predict(); }
  at::Tensor forward(const at::Tensor& x) override { return dense_->forward(x); }
  at::Tensor scale_loss(const at::Tensor& loss) const override { return dense_->scale_loss(loss); }
  void after_pipeline_backward() override { dense_->after_pipeline_backward(); }
  // One global norm: the experts' (unscaled) squares join the dense updater's, which clips by
  // it and in fp16 skips an overflowed step. The experts take its verdict: skipped with it (their
  // loss scaler backs off as the dense one does, so the two stay equal), else clipped by the
  // same norm.
  bool step() override {
    experts_->reduce();
    const double clip = L_.cfg.max_grad_norm;
    const bool fp16 = L_.cfg.precision == Precision::kFP16;
    if (clip > 0 || fp16) {
      const double s = dense_->scaler().scale();
      dense_->add_squared_norm(expert_squares() / (s * s));
    }
    const bool stepped = dense_->step();
    const double norm = !stepped ? std::numeric_limits<double>::infinity() : clip > 0 ? dense_->last_grad_norm() : 0.0;
    experts_->step(clip, norm);
    return stepped;
  }
  void set_lr(double lr) override {
    dense_->set_lr(lr);
    experts_->set_lr(lr);
  }
  double lr() const override { return dense_->lr(); }
  double last_grad_norm() const override { return dense_->last_grad_norm(); }
  void add_squared_norm(double sq) override { dense_->add_squared_norm(sq); }
  const LossScaler& scaler() const override { return dense_->scaler(); }
  double gather_wait_seconds() const override { return dense_->gather_wait_seconds(); }
  at::Tensor accumulate(const at::Tensor& x, const at::Tensor& y, int64_t k, const MicroBatchPass& pass) override {
    return dense_->accumulate(x, y, k, pass);
  }
  void communication(EngineStats::DataParallel& s) const override { dense_->communication(s); }
  void reset_stats() override { dense_->reset_stats(); }

  std::vector<StatePiece> state() override {
    auto out = dense_->state();
    experts_->state(out);
    return out;
  }
  std::string optimizer_kind() const override { return dense_->optimizer_kind(); }
  int64_t optimizer_step() const override { return dense_->optimizer_step(); }
  void prepare_load(const std::vector<std::string>& slots, int64_t step) override {
    dense_->prepare_load(slots, step);
    experts_->prepare_load(slots, step);
  }
  void finish_load() override {
    dense_->finish_load();
    experts_->finish_load();
  }
  void restore_loss_scaler(const CheckpointMeta& m) override {
    dense_->restore_loss_scaler(m);
    experts_->restore_loss_scaler(m);
  }
  void memory(EngineStats::Memory& s) const override {
    dense_->memory(s);
    experts_->memory(s);
  }

 private:
  // The experts' gradient squares of the whole model: the ranks of an ep group hold distinct
  // experts, tp ranks distinct parts of them, pipeline stages distinct layers (the edp ranks
  // the same values again, counted once).
  double expert_squares() const {
    torch::NoGradGuard ng;
    const auto dev = params_.empty() ? at::Device(at::kCPU) : params_[0].device();
    auto sq = torch::zeros({1}, torch::TensorOptions().dtype(at::kDouble).device(dev));
    for (auto& p : params_)
      if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum();
    X_.ep->allreduce(sq, ReduceOp::kSum);
    if (L_.grid) {
      for (const auto& c : {L_.grid->tp(), L_.grid->pp()})
        if (c->size() > 1) c->allreduce(sq, ReduceOp::kSum);
    }
    return sq.cpu().item<double>();
  }

  Layout& L_;
  ExpertShards& X_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<ExpertStepper> experts_;
  std::unique_ptr<Updater> dense_;
};

}  // namespace

std::unique_ptr<Updater> with_experts(const std::function<std::unique_ptr<Updater>()>& make_dense, Layout& L,
                                      ExpertShards& X, const OptimizerOptions& optimizer) {
  return std::make_unique<WithExperts>(make_dense, L, X, optimizer);
}

}  // namespace tandem::engine
