// ZeRO-3's just-in-time parameters: a unit is all-gathered before its forward and again before its
// backward (the next one prefetched), and its memory is freed in between.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <chrono>

#include "compat/torch_compat.h"
#include "strategy/zero/zero_impl.h"

namespace tandem {

// A ShardedUnit's forward: gathered (the next unit prefetched), run, freed; its output's
// gradient gathers it again for backward.
at::Tensor ZeroDataParallel::Impl::run_unit(int u, torch::nn::AnyModule& inner, const at::Tensor& x) {
  gather_unit(u);
  const int U = static_cast<int>(unit_bucket.size());
  for (int d = 1; d <= opts.prefetch && u + d < U; ++d) prefetch_unit(u + d);
  at::Tensor y = inner.forward<at::Tensor>(x);
  if (at::GradMode::is_enabled() && y.requires_grad()) {
    unit_backward[u] = 1;
    std::weak_ptr<Impl*> weak = self;
    const int lo = root_bucket >= 0 ? 1 : 0;  // the root stays gathered through the step
    y.register_hook([weak, u, lo](const at::TensorBase&) {
      if (auto s = weak.lock()) (*s)->pre_backward(u, lo);
    });
  }
  release_unit(u);
  return y;
}

void ZeroDataParallel::Impl::gather_unit(int u) {
  if (auto* t = trained_bucket(u)) start_gather(*t);
  if (auto* f = frozen_bucket(u)) start_gather(*f);
  if (auto* t = trained_bucket(u)) ensure_gathered(*t);
  if (auto* f = frozen_bucket(u)) ensure_gathered(*f);
}

void ZeroDataParallel::Impl::prefetch_unit(int u) {
  if (auto* t = trained_bucket(u)) start_gather(*t);
  if (auto* f = frozen_bucket(u)) start_gather(*f);
}

void ZeroDataParallel::Impl::release_unit(int u) {
  if (auto* t = trained_bucket(u)) release(*t);
  if (auto* f = frozen_bucket(u)) release(*f);
}

void ZeroDataParallel::Impl::start_gather(Bucket& bk) {
  if (bk.state != Gather::kFree) return;
  if (auto slot = pool.take(bk.padded); slot.defined()) {
    compat::place_storage(bk.full, slot.data_ptr(), static_cast<size_t>(detail::nbytes(bk.full)), slot);
  } else {
    compat::alloc_storage(bk.full, static_cast<size_t>(detail::nbytes(bk.full)));
  }
  gathered_live += detail::nbytes(bk.full);
  gathered_peak = std::max(gathered_peak, gathered_live);
  bk.state = Gather::kInFlight;
  bk.gather = comm->allgather_async(bk.full, bk.shard);
}

void ZeroDataParallel::Impl::ensure_gathered(Bucket& bk) {
  start_gather(bk);
  if (bk.state == Gather::kInFlight) {
    auto w = std::move(bk.gather);
    bk.gather.reset();
    bk.state = Gather::kReady;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      w->wait();
    } catch (...) {
      release(bk);
      throw;
    }
    gather_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
}

void ZeroDataParallel::Impl::release(Bucket& bk) {
  if (opts.stage < 3 || bk.state == Gather::kFree) return;
  if (bk.gather) {
    auto w = std::move(bk.gather);
    bk.gather.reset();
    const auto t0 = std::chrono::steady_clock::now();
    try {
      w->wait();  // the engine must be done writing before the memory goes
    } catch (...) {
    }
    gather_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const void* p = bk.full.storage().data();
  compat::free_storage(bk.full);
  if (p) pool.give_back(p);
  gathered_live -= detail::nbytes(bk.full);
  bk.state = Gather::kFree;
}

void ZeroDataParallel::Impl::release_all() {
  for (auto& bk : buckets) release(bk);
  for (auto& bk : frozen_buckets) release(bk);
}

// Children [first, end) of the Sequential; prefetching stays inside the range (a pipeline
// stage runs its chunks at other times).
at::Tensor ZeroDataParallel::Impl::forward(const at::Tensor& input, int64_t first, int64_t end) {
  const bool grad = at::GradMode::is_enabled();
  int lo = -1, hi = -1;  // the units in the range
  for (int64_t k = first; k < end; ++k) {
    if (child_unit[k] < 0) continue;
    if (lo < 0) lo = child_unit[k];
    hi = child_unit[k];
  }
  at::Tensor x = input;
  for (int64_t k = first; k < end; ++k) {
    auto& child = *(sequential->begin() + k);
    const int u = child_unit[k];
    if (u < 0) {
      x = child.forward(x);
      continue;
    }
    gather_unit(u);
    for (int d = 1; d <= opts.prefetch && u + d <= hi; ++d) prefetch_unit(u + d);
    x = child.forward(x);
    const bool backward_comes = grad && x.requires_grad();
    if (backward_comes) {
      unit_backward[u] = 1;
      std::weak_ptr<Impl*> weak = self;
      x.register_hook([weak, u, lo](const at::TensorBase&) {
        if (auto s = weak.lock()) (*s)->pre_backward(u, lo);
      });
    }
    // The range's last unit's backward runs first: keep it.
    if (!(backward_comes && u == hi)) release_unit(u);
  }
  return x;
}

// The gradient of unit u's output arrived: u's backward comes next. In a Sequential that output
// is the next unit's input, so the next unit's backward is complete, frozen parameters
// included (wrapped units may branch: theirs wait for the final callback).
void ZeroDataParallel::Impl::pre_backward(int u, int lo) {
  arm_final_callback();
  if (sequential && u + 1 < static_cast<int>(unit_frozen.size()))
    if (auto* f = frozen_bucket(u + 1)) release(*f);
  gather_unit(u);
  for (int d = 1; d <= opts.prefetch && u - d >= lo; ++d) {
    if (auto* prev = trained_bucket(u - d); prev && prev->pending > 0) start_gather(*prev);
    if (auto* f = frozen_bucket(u - d); f && unit_backward[u - d]) start_gather(*f);
  }
}

}  // namespace tandem
