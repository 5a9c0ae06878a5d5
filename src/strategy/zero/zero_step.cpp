// ZeroDataParallel::step(): unscaling and the overflow check (fp16), clipping by the global norm,
// the optimizer over the owned chunks, and publishing the new shards.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>
#include <exception>
#include <stdexcept>
#include <string>

#include "strategy/zero/zero_impl.h"

namespace tandem {

// The optimizer's gradients: views of the averaged chunks (fp32), or fp32 copies of them
// (mixed precision; they live only inside step()).
void ZeroDataParallel::Impl::link_master_grads() {
  if (owned_summed) {
    for (auto& bk : buckets) grad_chunk(bk).div_(world);
    owned_summed = false;
  }
  average_over_replicas();
  for (auto& bk : buckets) {
    auto v = grad_chunk(bk);
    if (mixed) {
      bk.master.mutable_grad() = v.to(at::kFloat);
    } else if (!detail::same_view(bk.master.grad(), v)) {
      bk.master.mutable_grad() = v;
    }
  }
}

// The chunks hold their group's average; the replicas' average of those is the average over
// every data-parallel rank (the groups are equal in size). Once per step, after any number of
// backward passes, in the compute dtype as they were reduce-scattered.
void ZeroDataParallel::Impl::average_over_replicas() {
  if (!replicate) return;
  std::vector<WorkPtr> works;
  for (auto& bk : buckets) works.push_back(replicate->allreduce_async(grad_chunk(bk), ReduceOp::kAvg));
  wait_all(works);
}

void ZeroDataParallel::Impl::drop_master_grads() {
  if (!mixed) return;
  for (auto& bk : buckets) bk.master.mutable_grad() = at::Tensor();
}

// The whole model's sum of squares of the (unscaled) gradients: [all of this rank's chunk, its
// tensor-parallel shards' part] summed over the data-parallel ranks, the shards' part then over
// tp (the rest is the same on every tp rank), and the whole over the pipeline's stages.
double ZeroDataParallel::Impl::global_squares() {
  auto sq =
      at::zeros({2}, buckets.empty() ? at::TensorOptions(at::kDouble) : buckets[0].master.options().dtype(at::kDouble));
  for (size_t b = 0; b < buckets.size(); ++b) {
    const auto g = buckets[b].master.grad();
    sq[0] += g.to(at::kDouble).pow(2).sum();
    if (model_parallel)
      for (const auto& [from, to] : sharded_ranges[b])
        sq[1] += g.narrow(0, from, to - from).to(at::kDouble).pow(2).sum();
  }
  comm->allreduce(sq, ReduceOp::kSum);
  if (!model_parallel) return sq[0].cpu().item<double>();
  auto sh = sq.narrow(0, 1, 1).clone();
  if (mp_tp && mp_tp->size() > 1) mp_tp->allreduce(sh, ReduceOp::kSum);
  auto t = sq.narrow(0, 0, 1) - sq.narrow(0, 1, 1) + sh;
  if (mp_pp && mp_pp->size() > 1) mp_pp->allreduce(t, ReduceOp::kSum);
  return t.cpu().item<double>();
}

bool ZeroDataParallel::Impl::step(double given_norm) {
  torch::NoGradGuard ng;
  release_all();  // stage 3: gathered values are about to be stale
  link_master_grads();
  if (scaler.dynamic()) {
    for (auto& bk : buckets) bk.master.mutable_grad().mul_(1.0 / scaler.scale());
  }
  const bool clipping = opts.max_grad_norm > 0;
  last_norm = -1.0;
  if (clipping || scaler.dynamic()) {
    const double norm = given_norm >= 0 ? given_norm : std::sqrt(global_squares() + extra_sq);
    extra_sq = 0.0;
    const bool found_inf = !std::isfinite(norm);
    scaler.update(found_inf);
    if (found_inf) {
      drop_master_grads();
      if (scaler.dynamic()) return false;  // every rank saw the same sum: all skip
      throw std::runtime_error(where() + ": the global gradient norm is " + std::to_string(norm) +
                               "; lower the learning rate or check the loss for NaN/inf");
    }
    if (clipping) {
      last_norm = norm;
      double coef = opts.max_grad_norm / (norm + 1e-6);
      if (coef < 1.0)
        for (auto& bk : buckets) bk.master.mutable_grad().mul_(coef);
    }
  }
  optim->step();
  drop_master_grads();
  publish_shards();
  return true;
}

// The owned masters become the compute-dtype shards and (stages 1, 2) the whole parameters
// on every rank; stage 3's next forward gathers them. Collective for stages 1, 2.
void ZeroDataParallel::Impl::publish_shards() {
  if (mixed)
    for (auto& bk : buckets) bk.shard.copy_(bk.master);
  if (opts.stage == 3) return;
  std::vector<WorkPtr> works;
  // In place: the owned chunk is where the all-gather receives this rank's part.
  for (auto& bk : buckets) works.push_back(comm->allgather_async(bk.full, bk.shard));
  wait_all(works);
}

// Waits for every one of `works`, then rethrows the first failure.
void ZeroDataParallel::Impl::wait_all(std::vector<WorkPtr>& works) {
  std::exception_ptr err;
  for (auto& w : works) {
    try {
      w->wait();
    } catch (...) {
      if (!err) err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace tandem
