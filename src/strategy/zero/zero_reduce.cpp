// ZeroDataParallel's backward: gradient hooks fill the buckets, full buckets are reduce-scattered
// in bucket order, and the final callback waits for the collectives.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <exception>

#include "strategy/autograd_hooks.h"
#include "strategy/zero/zero_impl.h"

namespace tandem {

// Uninitialised but for the padding: take_gradient() writes every parameter's slice (its
// gradient, or zeros), which saves a memset of the bucket every step.
at::Tensor ZeroDataParallel::Impl::new_scratch(const Bucket& bk) {
  pool.mark_keep();
  auto t = pool.take(bk.padded);
  if (!t.defined()) t = at::empty({bk.padded}, bk.shard.options());
  t.narrow(0, bk.numel, bk.padded - bk.numel).zero_();
  scratch_live += detail::nbytes(t);
  scratch_peak = std::max(scratch_peak, scratch_live);
  return t;
}

void ZeroDataParallel::Impl::free_scratch(Bucket& bk) {
  scratch_live -= detail::nbytes(bk.scratch);
  if (bk.scratch.defined()) pool.give_back(bk.scratch.data_ptr());
  bk.scratch = at::Tensor();
}

void ZeroDataParallel::Impl::arm_final_callback() {
  if (callback_queued) return;
  callback_queued = true;
  std::weak_ptr<Impl*> weak = self;
  detail::queue_backward_callback([weak] {
    if (auto s = weak.lock()) (*s)->finalize();
  });
}

void ZeroDataParallel::Impl::on_grad_ready(size_t i) {
  // Autograd adds into the parameter's .grad (a view of the flat buffer after the first
  // synced backward; before it, a tensor of its own that take_gradient() copies in).
  if (no_sync) return;
  arm_final_callback();
  if (ready[i]) return;
  ready[i] = 1;
  take_gradient(i);
  auto& bk = buckets[bucket_of[i]];
  if (--bk.pending == 0) {
    release(bk);  // stage 3: the unit's trained parameters are done with (frozen ones: pre_backward)
    launch_ready();
  }
}

// Moves parameter i's gradient where its bucket's collective will find it.
void ZeroDataParallel::Impl::take_gradient(size_t i) {
  torch::NoGradGuard ng;
  auto& g = params[i].mutable_grad();
  if (opts.stage == 1) {
    auto v = grad_view(i);
    if (detail::same_view(g, v)) return;  // accumulated in place
    if (g.defined()) {
      v.copy_(g);
    } else {
      v.zero_();  // no gradient this step (unused parameter): zero
    }
    g = v;
  } else {
    auto& bk = buckets[bucket_of[i]];
    if (!bk.scratch.defined()) bk.scratch = new_scratch(bk);
    if (g.defined()) {
      param_view(bk.scratch, i).copy_(g);
    } else {
      param_view(bk.scratch, i).zero_();  // no gradient this step (unused parameter): zero
    }
    g = at::Tensor();  // stages 2, 3 keep no full-size gradient
  }
}

void ZeroDataParallel::Impl::launch_ready() {
  // In bucket order on every rank, so that the collectives match.
  while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) launch(next_bucket++);
}

void ZeroDataParallel::Impl::wait_oldest() {
  size_t b = inflight.front();
  inflight.pop_front();
  auto& bk = buckets[b];
  auto w = std::move(bk.work);
  bk.work.reset();
  try {
    w->wait();
  } catch (...) {
    free_scratch(bk);
    bk.accum = at::Tensor();
    throw;
  }
  free_scratch(bk);
  if (bk.accum.defined()) {
    bk.grad.add_(bk.accum);
    bk.accum = at::Tensor();
  }
}

void ZeroDataParallel::Impl::launch(size_t b) {
  auto& bk = buckets[b];
  if (opts.stage == 1) {
    auto whole = grad_flat.narrow(0, bk.offset, bk.padded);
    bk.work = comm->reduce_scatter_async(whole.narrow(0, rank * bk.chunk, bk.chunk), whole, ReduceOp::kSum);
    return;
  }
  while (static_cast<int>(inflight.size()) >= std::max(1, opts.max_inflight_buckets)) wait_oldest();
  if (!bk.scratch.defined()) bk.scratch = new_scratch(bk).zero_();
  // The first backward to reach the bucket since zero_grad() writes its reduced chunk, a later
  // one adds to it. The chunk is made here, not kept across steps, so that forward runs
  // without gradients.
  at::Tensor& out = bk.grad.defined() ? bk.accum : bk.grad;
  out = at::empty({bk.chunk}, bk.shard.options());
  bk.work = comm->reduce_scatter_async(out, bk.scratch, ReduceOp::kAvg);
  inflight.push_back(b);
  if (opts.max_inflight_buckets == 0) wait_oldest();
}

void ZeroDataParallel::Impl::finalize() {
  callback_queued = false;
  std::exception_ptr err;
  auto keep_first = [&] {
    if (!err) err = std::current_exception();
  };
  try {
    for (size_t i = 0; i < params.size(); ++i) {
      if (ready[i]) continue;
      ready[i] = 1;
      take_gradient(i);
    }
    for (auto& bk : buckets) bk.pending = 0;
    launch_ready();
  } catch (...) {
    keep_first();
  }
  if (opts.stage == 1) {
    torch::NoGradGuard ng;
    for (auto& bk : buckets) {
      try {
        if (bk.work) bk.work->wait();
      } catch (...) {
        keep_first();
      }
      bk.work.reset();
      // The in-place reduce-scatter clobbered the other ranks' chunks: zero them, so that
      // another backward before step() adds only its own gradients there.
      grad_flat.narrow(0, bk.offset, rank * bk.chunk).zero_();
      grad_flat.narrow(0, bk.offset + (rank + 1) * bk.chunk, (world - rank - 1) * bk.chunk).zero_();
    }
    owned_summed = true;
  } else {
    while (!inflight.empty()) {
      try {
        wait_oldest();
      } catch (...) {
        keep_first();
      }
    }
    for (auto& bk : buckets) free_scratch(bk);
  }
  release_all();
  pool.release_pages();
  for (auto& bk : buckets) bk.pending = bk.params.size();
  std::fill(ready.begin(), ready.end(), 0);
  std::fill(unit_backward.begin(), unit_backward.end(), 0);
  next_bucket = 0;
  if (err) std::rethrow_exception(err);
}

}  // namespace tandem
