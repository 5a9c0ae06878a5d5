// ZeroDataParallel's construction and public methods, and ShardedUnit. The design (layout, steps,
// stage-3 gathering) is described in zero_impl.h.
#include "tandem/zero.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "strategy/autograd_hooks.h"
#include "strategy/model_sync.h"
#include "strategy/module_wrapper.h"
#include "strategy/zero/zero_impl.h"

namespace tandem {

ZeroDataParallel::ZeroDataParallel(std::shared_ptr<torch::nn::Module> module, CommPtr comm, ZeroOptions opts)
    : ZeroDataParallel(std::move(module), std::move(comm), nullptr, std::move(opts)) {}

ZeroDataParallel::ZeroDataParallel(std::shared_ptr<torch::nn::Module> module, CommPtr comm, CommPtr replicate,
                                   ZeroOptions opts)
    : module_(std::move(module)), impl_(std::make_unique<Impl>()) {
  if (!module_) throw std::invalid_argument("ZeroDataParallel needs a module");
  if (!comm) throw std::invalid_argument("ZeroDataParallel needs a communicator");
  if (opts.stage < 1 || opts.stage > 3) {
    throw std::invalid_argument("ZeRO stage must be 1, 2 or 3, not " + std::to_string(opts.stage));
  }
  if (opts.bucket_cap_bytes <= 0) throw std::invalid_argument("ZeRO bucket_cap_bytes must be positive");
  if (opts.max_grad_norm < 0) throw std::invalid_argument("ZeRO max_grad_norm must be >= 0 (0 = off)");
  if (opts.prefetch < 0) throw std::invalid_argument("ZeRO prefetch must be >= 0 (0 = gather each unit when needed)");
  if (opts.max_inflight_buckets < -1) {
    throw std::invalid_argument("ZeRO max_inflight_buckets must be >= 0 (0: each reduce-scatter finishes before "
                                "backward goes on), or -1 for the default");
  }
  validate(opts.optimizer);
  if (opts.precision == Precision::kFP16) validate(opts.loss_scaler);
  auto& I = *impl_;
  I.comm = std::move(comm);
  if (replicate && replicate->size() > 1) I.replicate = std::move(replicate);
  I.opts = opts;
  I.world = I.comm->size();
  I.rank = I.comm->rank();
  I.self = std::make_shared<Impl*>(impl_.get());
  I.scaler = LossScaler(opts.precision == Precision::kFP16, opts.loss_scaler);
  if (opts.stage == 3) I.sequential = dynamic_cast<torch::nn::SequentialImpl*>(module_.get());
  I.module = module_.get();
  for (auto& kv : module_->named_parameters(/*recurse=*/true)) {
    if (kv.value().requires_grad()) {
      I.names.push_back(kv.key());
      I.params.push_back(kv.value());
    } else if (opts.stage == 3) {  // sharded too, never reduced or stepped
      I.frozen_names.push_back(kv.key());
      I.frozen.push_back(kv.value());
    }
  }
  for (auto& kv : module_->named_buffers(/*recurse=*/true)) I.buffers.emplace_back(kv.key(), kv.value());
  for (size_t i = 1; i < I.params.size(); ++i) {
    if (I.params[i].scalar_type() != I.params[0].scalar_type() || I.params[i].device() != I.params[0].device()) {
      throw std::invalid_argument(I.where() + ": all parameters must share one dtype and device; '" + I.names[i] +
                                  "' differs from '" + I.names[0] + "'. Convert the model first (module->to(...)).");
    }
  }
  if (!I.params.empty()) {
    const auto dt = I.params[0].scalar_type();
    if (!at::isFloatingType(dt)) throw std::invalid_argument(I.where() + ": parameters must be floating point");
    if (opts.precision != Precision::kFP32) {
      if (dt != at::kFloat && dt != compute_dtype(opts.precision)) {
        throw std::invalid_argument(I.where() + ": precision " + precision_name(opts.precision) +
                                    " needs fp32 parameters (they are " + c10::toString(dt) + ")");
      }
      I.mixed = true;
    }
  }
  // Within the shard group first, then from group 0 to the others: every rank ends with rank
  // 0's values of group 0.
  for (auto* c : I.groups()) {
    detail::check_same_model(*c, I.names, I.params, I.buffers, "ZeroDataParallel");
    detail::broadcast_from_rank0(*c, I.params, I.buffers, /*include_params=*/true);
    if (!I.frozen.empty()) detail::broadcast_from_rank0(*c, I.frozen, {}, /*include_params=*/true);
  }
  for (auto& p : I.params) I.psi += p.numel();
  if (I.opts.max_inflight_buckets < 0) {
    const bool cpu = I.params.empty() || I.params[0].device().is_cpu();
    I.opts.max_inflight_buckets = I.opts.stage == 3 && cpu ? 0 : 2;
  }
  I.build_layout();
  I.build_optimizer();

  std::weak_ptr<Impl*> weak = I.self;
  I.accumulators = detail::add_post_accumulate_grad_hooks(I.params, [weak](size_t i) {
    if (auto s = weak.lock()) (*s)->on_grad_ready(i);
  });
}

ShardedUnitImpl::ShardedUnitImpl(torch::nn::AnyModule inner) : inner_(std::move(inner)) {
  if (inner_.is_empty()) throw std::invalid_argument("tandem::ShardedUnit: no module given");
  auto m = inner_.ptr();
  detail::adopt_members(*this, *m);
  Module::train(m->is_training());
}

at::Tensor ShardedUnitImpl::forward(const at::Tensor& x) {
  return runner_ ? runner_(inner_, x) : inner_.forward<at::Tensor>(x);
}

void ShardedUnitImpl::train(bool on) {
  Module::train(on);
  inner_.ptr()->train(on);
}

ZeroDataParallel::~ZeroDataParallel() = default;

void ZeroDataParallel::prepare_forward() {
  auto& I = *impl_;
  if (I.opts.broadcast_buffers && !I.buffers.empty()) {
    for (auto* c : I.groups()) detail::broadcast_from_rank0(*c, I.params, I.buffers, /*include_params=*/false);
  }
  if (I.opts.stage == 3 && !I.sequential) {
    if (!I.wrapped_units) {
      for (auto* group : {&I.buckets, &I.frozen_buckets})
        for (auto& bk : *group) I.ensure_gathered(bk);
    } else if (I.root_bucket >= 0) {
      I.gather_unit(0);
    }
  }
}

at::Tensor ZeroDataParallel::forward(const at::Tensor& input, int64_t first, int64_t end) {
  auto& I = *impl_;
  auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(module_.get());
  if (!seq)
    throw std::invalid_argument(I.where() + ": forward(input, first, end) runs children of a torch::nn::Sequential");
  const auto n = static_cast<int64_t>(seq->size());
  if (first < 0 || first > end || end > n) {
    throw std::invalid_argument(I.where() + ": children [" + std::to_string(first) + ", " + std::to_string(end) +
                                ") out of the Sequential's " + std::to_string(n));
  }
  if (I.opts.stage == 3) return I.forward(input, first, end);
  at::Tensor x = input;
  for (int64_t k = first; k < end; ++k) x = (seq->begin() + k)->forward(x);
  return x;
}

at::Tensor ZeroDataParallel::forward(const at::Tensor& input) {
  auto& I = *impl_;
  if (I.opts.stage == 3 && I.sequential) return I.forward(input, 0, static_cast<int64_t>(I.sequential->size()));
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(module_.get())) {
    if (I.opts.stage == 3) I.release_all();  // not reached: stage 3 Sequentials take the path above
    return seq->forward(input);
  }
  throw std::invalid_argument(I.where() + ": forward() runs a torch::nn::Sequential; for another module call "
                                          "prepare_forward() and then the module's own forward");
}

at::Tensor ZeroDataParallel::scale_loss(const at::Tensor& loss) const {
  return impl_->scaler.dynamic() ? loss * impl_->scaler.scale() : loss;
}

void ZeroDataParallel::zero_grad() {
  torch::NoGradGuard ng;
  auto& I = *impl_;
  I.owned_summed = false;
  if (I.opts.stage == 1) {
    I.grad_flat.zero_();
    for (size_t i = 0; i < I.params.size(); ++i) {
      auto& g = I.params[i].mutable_grad();
      if (g.defined() && !detail::same_view(g, I.grad_view(i))) g.zero_();
    }
  } else {
    // The chunks go (forward runs without them, as PyTorch's set_to_none); launch() makes new ones.
    for (auto& bk : I.buckets) {
      bk.grad = at::Tensor();
      bk.master.mutable_grad() = at::Tensor();
    }
    for (auto& p : I.params) p.mutable_grad() = at::Tensor();
  }
}

NoSyncGuard ZeroDataParallel::no_sync() {
  auto& I = *impl_;
  if (I.opts.stage != 1) {
    throw std::invalid_argument(I.where() + ": no_sync() needs stage 1 (stage " + std::to_string(I.opts.stage) +
                                " keeps no full-size gradient to accumulate into; it reduce-scatters every backward)");
  }
  return NoSyncGuard(&I.no_sync);
}

bool ZeroDataParallel::step(double norm) { return impl_->step(norm); }

void ZeroDataParallel::set_lr(double lr) {
  for (auto& g : impl_->optim->param_groups()) g.options().set_lr(lr);
}

double ZeroDataParallel::lr() const { return impl_->optim->param_groups().at(0).options().get_lr(); }

double ZeroDataParallel::last_grad_norm() const { return impl_->last_norm; }

void ZeroDataParallel::add_squared_norm(double sq) { impl_->extra_sq += sq; }

double ZeroDataParallel::gather_wait_seconds() const { return impl_->gather_wait_s; }

void ZeroDataParallel::set_model_parallel(const std::vector<bool>& sharded, CommPtr tp, CommPtr pp) {
  auto& I = *impl_;
  if (sharded.size() != I.params.size()) {
    throw std::invalid_argument(I.where() + ": set_model_parallel got " + std::to_string(sharded.size()) +
                                " flags for " + std::to_string(I.params.size()) + " parameters");
  }
  I.sharded_ranges.assign(I.buckets.size(), {});
  for (size_t b = 0; b < I.buckets.size(); ++b) {
    for (const auto& [i, from, to] : I.owned_pieces(I.buckets[b]))
      if (sharded[i]) I.sharded_ranges[b].emplace_back(from, to);
  }
  if (is_layerwise(I.opts.optimizer)) set_layerwise_layout(*I.optim, I.layerwise_layout(tp, sharded));
  I.mp_tp = std::move(tp);
  I.mp_pp = std::move(pp);
  I.model_parallel = true;
}

const LossScaler& ZeroDataParallel::loss_scaler() const { return impl_->scaler; }

Precision ZeroDataParallel::precision() const { return impl_->opts.precision; }

int ZeroDataParallel::units() const { return impl_->opts.stage == 3 ? static_cast<int>(impl_->unit_bucket.size()) : 0; }

int64_t ZeroDataParallel::frozen_numel() const {
  int64_t n = 0;
  for (const auto& p : impl_->frozen) n += p.numel();
  return n;
}

int ZeroDataParallel::stage() const { return impl_->opts.stage; }

int64_t ZeroDataParallel::shard_numel() const {
  int64_t n = 0;
  for (auto& bk : impl_->buckets) n += bk.chunk;
  return n;
}

int64_t ZeroDataParallel::padded_numel() const {
  int64_t n = 0;
  for (auto& bk : impl_->buckets) n += bk.padded;
  return n;
}

torch::optim::Optimizer& ZeroDataParallel::optimizer() { return *impl_->optim; }

std::vector<ZeroOwnedPiece> ZeroDataParallel::owned_pieces() {
  auto& I = *impl_;
  std::vector<ZeroOwnedPiece> out;
  for (auto& bk : I.buckets) {
    const auto state = get_param_state(*I.optim, bk.master);
    const int64_t lo = static_cast<int64_t>(I.rank) * bk.chunk;
    for (const auto& [i, from, to] : I.owned_pieces(bk)) {
      ZeroOwnedPiece p;
      p.name = I.names[i];
      p.first = lo + from - I.offset_of[i];
      p.count = to - from;
      p.value = bk.master.detach().narrow(0, from, to - from);
      for (const auto& [k, v] : state.slots) p.slots[k] = v.detach().view({-1}).narrow(0, from, to - from);
      out.push_back(std::move(p));
    }
  }
  // Stage 3's frozen shards: values only.
  for (auto& bk : I.frozen_buckets) {
    const int64_t lo = static_cast<int64_t>(I.rank) * bk.chunk, hi = lo + bk.chunk;
    for (size_t j : bk.params) {
      const int64_t from = std::max(lo, I.frozen_offset[j]),
                    to = std::min(hi, I.frozen_offset[j] + I.frozen[j].numel());
      if (from >= to) continue;
      ZeroOwnedPiece p;
      p.name = I.frozen_names[j];
      p.first = from - I.frozen_offset[j];
      p.count = to - from;
      p.value = bk.shard.narrow(0, from - lo, to - from);
      out.push_back(std::move(p));
    }
  }
  return out;
}

int64_t ZeroDataParallel::optimizer_step() const {
  int64_t step = 0;
  for (auto& bk : impl_->buckets) step = std::max(step, get_param_state(*impl_->optim, bk.master).step);
  return step;
}

void ZeroDataParallel::reset_optimizer_state(const std::vector<std::string>& slots, int64_t step) {
  auto& I = *impl_;
  for (auto& bk : I.buckets) reset_param_state(*I.optim, bk.master, slots, step);
}

void ZeroDataParallel::refresh_from_shards() {
  auto& I = *impl_;
  torch::NoGradGuard ng;
  I.release_all();  // stage 3: gathered values are stale now
  I.publish_shards();
}

void ZeroDataParallel::restore_loss_scaler(double scale, int64_t overflow_free_steps, int64_t skipped_steps) {
  impl_->scaler.restore(scale, overflow_free_steps, skipped_steps);
}

ZeroMemory ZeroDataParallel::memory() const {
  using detail::nbytes;
  using detail::same_view;
  const auto& I = *impl_;
  ZeroMemory m;
  m.stage = I.opts.stage;
  m.world_size = I.world;
  m.parameters = I.psi;
  if (I.opts.stage < 3) {
    m.parameter_bytes = nbytes(I.flat);  // the parameters are views of it
  } else {
    for (const auto* group : {&I.buckets, &I.frozen_buckets})
      for (auto& bk : *group)
        m.parameter_bytes += nbytes(bk.shard) + (bk.state == Impl::Gather::kFree ? 0 : nbytes(bk.full));
  }
  m.gradient_bytes = nbytes(I.grad_flat);
  for (auto& bk : I.buckets) m.gradient_bytes += nbytes(bk.grad) + nbytes(bk.scratch) + nbytes(bk.accum);
  for (size_t i = 0; i < I.params.size(); ++i) {
    const auto& g = I.params[i].grad();
    if (g.defined() && !(I.grad_flat.defined() && same_view(g, I.grad_view(i)))) m.gradient_bytes += nbytes(g);
  }
  if (I.mixed)
    for (auto& bk : I.buckets) m.master_bytes += nbytes(bk.master);
  m.optimizer_state_bytes = optimizer_state_bytes(*I.optim) + m.master_bytes;
  m.peak_scratch_bytes = I.scratch_peak;
  m.peak_gathered_bytes = I.gathered_peak;
  m.pool_bytes = I.pool.bytes();
  m.pool_misses = I.pool.misses();
  const int64_t e =
      I.opts.stage < 3 ? I.flat.element_size() : (I.buckets.empty() ? 4 : I.buckets[0].shard.element_size());
  const int64_t N = I.world;
  m.model_parameter_bytes = I.opts.stage < 3 ? e * I.psi : e * I.psi / N;
  m.model_gradient_bytes = I.opts.stage == 1 ? e * I.psi : e * I.psi / N;
  m.model_optimizer_state_bytes = (4 * optimizer_state_slots(I.opts.optimizer) + (I.mixed ? 4 : 0)) * I.psi / N;
  return m;
}

}  // namespace tandem
