// The two updaters behind the Engine (updater.h): replicas with a MixedPrecisionOptimizer
// (single, ddp) and ZeroDataParallel (zero1-3), each with its checkpoint layouts.
#include "engine/updater.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <map>
#include <stdexcept>

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

TensorParallelState Layout::tp_state(torch::optim::Optimizer* opt, ZeroDataParallel* zero) {
  if (!tp_scratch) {
    if (!opts.make_dense) {
      throw std::invalid_argument("tensor-parallel checkpoints need EngineOptions::make_dense (a function that builds "
                                  "the dense model: its shape is the checkpoint's)");
    }
    // Its initialisation draws from the generator: keep the run's random stream as it was.
    auto gen = at::detail::getDefaultCPUGenerator();
    const auto state = gen.get_state();
    tp_scratch = opts.make_dense();
    gen.set_state(state);
    tp_scratch->to(rt->device());
  }
  TensorParallelState s;
  s.parallel = net_sequential().ptr();
  s.dense = tp_scratch.ptr();
  s.tp = grid->tp();
  s.pipe = pipe.get();
  s.opt = opt;
  s.zero = zero;
  s.dp = dp;
  return s;
}

namespace {

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

std::vector<bool> shard_flags(const Layout& L) {
  if (!L.pipe) return tp::sharded_parameters(L.net_sequential(), 0, -1);
  std::vector<bool> flags;  // the stage's parameters, chunk by chunk
  for (auto [first, end] : L.pipe->layer_ranges()) {
    const auto f = tp::sharded_parameters(L.net_sequential(), first, end);
    flags.insert(flags.end(), f.begin(), f.end());
  }
  return flags;
}

// ZeroOptions::init_shard over EngineOptions::init_shard: each piece told the shape of its
// parameter on this rank and the tp rank, since under --tp a flat range of a block is no flat
// range of the dense tensor. The shapes are taken now: ZeRO-3 frees the parameters.
std::function<bool(const std::string&, int64_t, at::Tensor)> shard_initialiser(const Layout& L) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : L.trained_module->named_parameters()) shapes[p.key()] = p.value().sizes().vec();
  const int tp_rank = L.grid ? L.grid->tp()->rank() : 0, tp_size = L.cfg.tp;
  return [init = L.opts.init_shard, shapes = std::move(shapes), tp_rank, tp_size](const std::string& name,
                                                                                  int64_t first, at::Tensor dest) {
    return init(ShardPiece{name, shapes.at(name), tp_rank, tp_size, first, std::move(dest)});
  };
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
  const LossScaler& scaler() const override { return opt_->scaler(); }
  DistributedDataParallel* ddp() override { return ddp_.get(); }

  std::string save(const std::string& root, const CheckpointMeta& m, const CheckpointSaveOptions& o) override {
    auto cpu = L_.rt->cpu_world();
    auto& opt = opt_->optimizer();
    if (L_.cfg.tp > 1) return detail::save_tensor_parallel_checkpoint(root, m, L_.tp_state(&opt, nullptr), *cpu, o);
    if (L_.pipe)
      return detail::save_checkpoint(root, m, *L_.pipe, opt, L_.grid->dp_rank() == 0, *cpu, o);  // one writer per stage
    return save_checkpoint(root, m, *L_.net, opt, *cpu, o);
  }
  CheckpointMeta load(const std::string& dir, int rank, const CheckpointLoadOptions& o) override {
    auto& opt = opt_->optimizer();
    auto meta = L_.cfg.tp > 1 ? detail::load_tensor_parallel_checkpoint(dir, L_.tp_state(&opt, nullptr), rank, o)
                : L_.pipe     ? detail::load_checkpoint(dir, *L_.pipe, opt, rank, o)
                              : load_checkpoint(dir, *L_.net, opt, rank, o);
    opt_->restore_loss_scaler(meta.loss_scale, meta.loss_scale_good_steps, meta.skipped_steps);
    return meta;
  }
  std::map<std::string, at::Tensor> masters() override {
    std::map<std::string, at::Tensor> out;
    if (L_.cfg.precision == Precision::kFP32) return out;
    const auto& masters = opt_->optimizer().param_groups().at(0).params();
    auto named = L_.trained_module->named_parameters();
    for (size_t i = 0; i < named.size(); ++i) out[named[i].key()] = masters.at(i).detach();
    return out;
  }
  void memory(EngineStats& s) const override {
    for (auto& p : L_.trained) {
      s.parameter_bytes += p.numel() * p.element_size();
      if (p.grad().defined()) s.gradient_bytes += p.grad().numel() * p.grad().element_size();
    }
    s.optimizer_state_bytes = opt_->optimizer_state_bytes() + opt_->master_bytes();
  }

 private:
  static double lr_of(torch::optim::Optimizer& o) { return o.param_groups().at(0).options().get_lr(); }
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
    if (L.init_by_shard()) o.init_shard = shard_initialiser(L);
    zero_ = std::make_unique<ZeroDataParallel>(L.trained_module, L.dp, o);
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
  const LossScaler& scaler() const override { return zero_->loss_scaler(); }
  double gather_wait_seconds() const override { return zero_->gather_wait_seconds(); }
  ZeroDataParallel* zero() override { return zero_.get(); }

  std::string save(const std::string& root, const CheckpointMeta& m, const CheckpointSaveOptions& o) override {
    auto cpu = L_.rt->cpu_world();
    if (L_.cfg.tp > 1)
      return detail::save_tensor_parallel_checkpoint(root, m, L_.tp_state(nullptr, zero_.get()), *cpu, o);
    // A stage's chunks are gathered over its replicas; the first replica writes it.
    if (L_.pipe) return detail::save_checkpoint(root, m, *L_.pipe, *zero_, L_.dp, *cpu, o);
    return detail::save_checkpoint(root, m, *zero_, *cpu, o);
  }
  CheckpointMeta load(const std::string& dir, int rank, const CheckpointLoadOptions& o) override {
    if (L_.cfg.tp > 1) return detail::load_tensor_parallel_checkpoint(dir, L_.tp_state(nullptr, zero_.get()), rank, o);
    if (L_.pipe) return detail::load_checkpoint(dir, *L_.pipe, *zero_, rank, o);
    return detail::load_checkpoint(dir, *zero_, rank, o);
  }
  // The fp32 values of the shards (masters, or the parameters in fp32), gathered over the
  // replicas; empty for stages 1-2 in fp32, whose parameters hold them whole.
  std::map<std::string, at::Tensor> masters() override {
    std::map<std::string, at::Tensor> out;
    if (zero_->stage() != 3 && L_.cfg.precision == Precision::kFP32) return out;
    auto st = zero_->shard_state();
    std::vector<at::Tensor> full(st.buckets.size());
    for (size_t b = 0; b < st.buckets.size(); ++b) {
      auto chunk = st.buckets[b].slots.at("param").to(L_.rt->device(), torch::kFloat).contiguous();
      auto whole = torch::empty({st.buckets[b].chunk * st.world_size}, chunk.options());
      L_.dp->allgather(whole, chunk);
      full[b] = whole.cpu();
    }
    for (const auto& p : st.params) out[p.name] = full[p.bucket].narrow(0, p.offset, p.numel).view(p.shape).clone();
    return out;
  }
  void memory(EngineStats& s) const override {
    auto m = zero_->memory();
    s.parameter_bytes = m.parameter_bytes;
    s.gradient_bytes = m.gradient_bytes;
    s.optimizer_state_bytes = m.optimizer_state_bytes;
    s.peak_gathered_bytes = m.peak_gathered_bytes;
    s.zero_pool_bytes = m.pool_bytes;
    s.zero_pool_misses = m.pool_misses;
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

std::unique_ptr<Updater> make_updater(Layout& L, const OptimizerOptions& oo) {
  if (zero_stage(L.cfg.strategy) > 0) return std::make_unique<Sharded>(L, oo);
  return std::make_unique<Replicated>(L, oo);
}

}  // namespace tandem::engine
