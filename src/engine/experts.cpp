// Expert parallelism in the Engine (experts.h).
#include "engine/experts.h"

#include <torch/torch.h>

#include <limits>
#include <stdexcept>

#include "tandem/activation_checkpoint.h"
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

namespace {
// The MoE layer a module is, or wraps (activation checkpointing and ZeRO-3 units adopt the wrapped
// module's children, not the module itself).
const moe::ExpertParallel* expert_layer(torch::nn::Module& m) {
  if (auto* e = dynamic_cast<const moe::ExpertParallel*>(&m)) return e;
  if (auto* c = m.as<CheckpointedImpl>()) return dynamic_cast<const moe::ExpertParallel*>(c->inner().ptr().get());
  if (auto* u = m.as<ShardedUnitImpl>()) return dynamic_cast<const moe::ExpertParallel*>(u->inner().ptr().get());
  return nullptr;
}
}  // namespace

void bank_experts(Layout& L, ExpertShards& X, const std::function<std::string(const std::string&)>& dense_name) {
  X.bank = std::make_shared<torch::nn::Module>("ExpertBank");
  int64_t index = 0;
  for (auto& m : L.trained_module->named_modules("", /*include_self=*/true)) {
    const auto* layer = expert_layer(*m.value());
    if (!layer) continue;
    const std::string prefix = m.key().empty() ? "" : m.key() + ".";
    for (auto& local : layer->local_experts()) {
      const std::string child = std::to_string(index++);
      X.bank->register_module(child, local.module);
      // Whole, or a tensor-parallel expert's blocks; the edp ranks hold them again.
      for (auto& p : parameter_placements(*local.module, 0)) {
        p.placement.replica = p.placement.replica * X.edp->size() + X.edp->rank();
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

// The dense weights through the strategy's updater, the experts through their own optimizer.
class WithExperts final : public Updater {
 public:
  WithExperts(const std::function<std::unique_ptr<Updater>()>& make_dense, Layout& L, ExpertShards& X,
              const OptimizerOptions& oo)
      : L_(L), X_(X), params_(tensors(X.trained)) {
    // The masters are taken while the experts are still fp32, before the dense updater converts
    // the model (whose MoE layers convert their local experts with it).
    opt_ = std::make_unique<MixedPrecisionOptimizer>(params_, L.cfg.precision, oo, L.cfg.loss_scaler,
                                                     X.edp->size() > 1 ? X.edp : nullptr);
    dense_ = make_dense();
    if (L.cfg.precision != Precision::kFP32) X.bank->to(compute_dtype(L.cfg.precision));
    if (X.edp->size() > 1) averager_ = std::make_unique<GradientAverager>(params_, X.edp);
  }

  void begin_step() override {
    dense_->begin_step();
    opt_->zero_grad();
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
    reduce_expert_gradients();
    const double clip = L_.cfg.max_grad_norm;
    const bool fp16 = L_.cfg.precision == Precision::kFP16;
    if (clip > 0 || fp16) {
      const double s = dense_->scaler().scale();
      dense_->add_squared_norm(expert_squares() / (s * s));
    }
    const bool stepped = dense_->step();
    const double norm = !stepped ? std::numeric_limits<double>::infinity() : clip > 0 ? dense_->last_grad_norm() : 0.0;
    opt_->step(clip, norm);
    return stepped;
  }
  void set_lr(double lr) override {
    dense_->set_lr(lr);
    opt_->set_lr(lr);
  }
  double lr() const override { return dense_->lr(); }
  double last_grad_norm() const override { return dense_->last_grad_norm(); }
  void add_squared_norm(double sq) override { dense_->add_squared_norm(sq); }
  const LossScaler& scaler() const override { return dense_->scaler(); }
  double gather_wait_seconds() const override { return dense_->gather_wait_seconds(); }
  // The experts' gradients accumulate over the micro-batches and are reduced once, in step().
  at::Tensor accumulate(const at::Tensor& x, const at::Tensor& y, int64_t k, const MicroBatchPass& pass) override {
    return dense_->accumulate(x, y, k, pass);
  }
  void communication(EngineStats::DataParallel& s) const override { dense_->communication(s); }
  void reset_stats() override { dense_->reset_stats(); }

  std::vector<StatePiece> state() override {
    auto out = dense_->state();
    const auto masters = optimizer_tensors();
    for (size_t i = 0; i < X_.trained.size(); ++i) {
      const auto& placed = X_.placed.at(X_.trained[i].first);
      append_optimizer_pieces(out, placed.dense_name, placed.placement, masters.at(i), opt_->optimizer());
    }
    return out;
  }
  std::string optimizer_kind() const override { return dense_->optimizer_kind(); }
  int64_t optimizer_step() const override { return dense_->optimizer_step(); }
  void prepare_load(const std::vector<std::string>& slots, int64_t step) override {
    dense_->prepare_load(slots, step);
    for (auto& m : optimizer_tensors()) reset_param_state(opt_->optimizer(), m, slots, step);
  }
  void finish_load() override {
    dense_->finish_load();
    torch::NoGradGuard ng;
    const auto masters = optimizer_tensors();
    for (size_t i = 0; i < masters.size(); ++i)
      if (!masters[i].is_same(params_[i])) params_[i].detach().copy_(masters[i]);
  }
  void restore_loss_scaler(const CheckpointMeta& m) override {
    dense_->restore_loss_scaler(m);
    opt_->restore_loss_scaler(m.loss_scale, m.loss_scale_good_steps, m.skipped_steps);
  }
  void memory(EngineStats::Memory& s) const override {
    dense_->memory(s);
    for (auto& p : X_.bank->parameters()) {
      s.parameter_bytes += p.numel() * p.element_size();
      if (p.grad().defined()) s.gradient_bytes += p.grad().numel() * p.grad().element_size();
    }
    s.optimizer_state_bytes += opt_->optimizer_state_bytes() + opt_->master_bytes();
  }

 private:
  // An expert no token reached has no gradient: zero, so that every rank reduces the same tensors.
  void reduce_expert_gradients() {
    torch::NoGradGuard ng;
    for (auto& p : params_)
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    if (averager_) averager_->average();
    const double ep = static_cast<double>(X_.ep->size());
    for (auto& p : params_) p.mutable_grad().div_(ep);
  }
  // The experts' gradient squares of the whole model: the ranks of an ep group hold distinct
  // experts, tp ranks distinct parts of them, pipeline stages distinct layers (the edp ranks
  // the same values again, counted once).
  double expert_squares() const {
    torch::NoGradGuard ng;
    const auto dev = params_.empty() ? at::Device(at::kCPU) : params_[0].device();
    auto sq = torch::zeros({1}, torch::TensorOptions().dtype(at::kDouble).device(dev));
    for (auto& p : params_) sq += p.grad().to(at::kDouble).pow(2).sum();
    X_.ep->allreduce(sq, ReduceOp::kSum);
    if (L_.grid) {
      for (const auto& c : {L_.grid->tp(), L_.grid->pp()})
        if (c->size() > 1) c->allreduce(sq, ReduceOp::kSum);
    }
    return sq.cpu().item<double>();
  }
  std::vector<at::Tensor> optimizer_tensors() const { return opt_->optimizer().param_groups().at(0).params(); }

  Layout& L_;
  std::unique_ptr<Updater> dense_;
  ExpertShards& X_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<MixedPrecisionOptimizer> opt_;
  std::unique_ptr<GradientAverager> averager_;
};

}  // namespace

std::unique_ptr<Updater> with_experts(const std::function<std::unique_ptr<Updater>()>& make_dense, Layout& L,
                                      ExpertShards& X, const OptimizerOptions& optimizer) {
  return std::make_unique<WithExperts>(make_dense, L, X, optimizer);
}

}  // namespace tandem::engine
