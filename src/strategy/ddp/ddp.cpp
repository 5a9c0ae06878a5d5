// DistributedDataParallel: gradient buckets filled by post-accumulate hooks, each full
// bucket all-reduced asynchronously while backward goes on, and one wait at the end of
// backward (an autograd final callback), after which param.grad() holds the average.
#include "tandem/ddp.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <sstream>

#include "strategy/autograd_hooks.h"
#include "strategy/ddp/reducer.h"
#include "strategy/model_sync.h"

namespace tandem {

double DDPStats::hidden_fraction() const {
  if (comm_seconds <= 0.0) return 0.0;
  return std::clamp(1.0 - exposed_seconds / comm_seconds, 0.0, 1.0);
}

namespace {

void check(const PowerSGDOptions& o, bool with_dtype) {
  if (o.rank < 1) {
    throw std::invalid_argument("PowerSGD rank must be at least 1 (got " + std::to_string(o.rank) +
                                "); e.g. --powersgd-rank 4");
  }
  if (o.start_step < 0) {
    throw std::invalid_argument("PowerSGD start step must be >= 0 (got " + std::to_string(o.start_step) + ")");
  }
  if (!(o.min_compression_rate >= 0)) {
    throw std::invalid_argument("PowerSGD min_compression_rate must be >= 0 (0: compress every matrix)");
  }
  if (with_dtype) {
    throw std::invalid_argument("DDP compresses gradients either to bf16/fp16 (compress_dtype) or with PowerSGD, "
                                "not both");
  }
}

using Clock = detail::DDPClock;
using detail::Bucket;

}  // namespace

struct DistributedDataParallel::Impl {
  CommPtr comm;
  DDPOptions opts;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  std::vector<std::shared_ptr<void>> accumulators;
  std::shared_ptr<Impl*> self;  // hooks hold a weak_ptr to this, so they outlive us safely

  std::vector<Bucket> buckets;
  std::unique_ptr<detail::BucketReducer> reducer;  // what goes on the wire (DDPOptions)
  std::vector<std::pair<size_t, size_t>> where;    // param -> (bucket, slot)
  std::vector<char> ready;
  size_t next_bucket = 0;
  bool callback_queued = false;
  bool no_sync = false;
  Clock::time_point backward_started;

  // Works of the last step with their launch times: their engine time is known only once they
  // completed, which on CUDA (where wait() only orders streams) is later than the end of backward.
  // Buckets in flight together overlap in time, so the communication time is the union of
  // their intervals, not the sum: with no overlap every bucket goes out at the end of backward
  // and the whole of that union is exposed.
  std::vector<std::pair<WorkPtr, Clock::time_point>> finished;
  void collect_seconds() {
    std::vector<std::pair<WorkPtr, Clock::time_point>> still;
    std::vector<std::pair<Clock::time_point, Clock::time_point>> spans;
    for (auto& [w, at] : finished) {
      if (w->is_completed()) {
        spans.emplace_back(at, at + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(w->seconds())));
      } else {
        still.emplace_back(w, at);
      }
    }
    finished.swap(still);
    std::sort(spans.begin(), spans.end());
    Clock::time_point covered = Clock::time_point::min();
    for (const auto& [from, to] : spans) {
      const auto start = std::max(from, covered);
      if (to > start) stats.comm_seconds += std::chrono::duration<double>(to - start).count();
      covered = std::max(covered, to);
    }
  }

  std::vector<size_t> arrival;  // gradient order of the first synchronized step
  bool plan_final = false;      // buckets rebuilt (or rebuilding not wanted)
  bool rebuild_pending = false;
  DDPStats stats;

  at::Device device() const { return params.empty() ? at::Device(at::kCPU) : params[0].device(); }

  // ---- construction-time checks and broadcast (shared with ZeRO: strategy/model_sync.h)
  void check_same_model() { detail::check_same_model(*comm, names, params, buffers, "DistributedDataParallel"); }

  void broadcast_state(bool include_params) { detail::broadcast_from_rank0(*comm, params, buffers, include_params); }

  // ---- buckets
  void plan(const std::vector<size_t>& order) {
    // Finish with the old buffers: keep any gradient they hold.
    std::vector<at::Tensor> old_grads(params.size());
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].grad().defined()) old_grads[i] = params[i].grad().clone();

    buckets.clear();
    where.assign(params.size(), {0, 0});
    Bucket cur;
    int64_t cur_bytes = 0;
    auto close = [&] {
      if (!cur.params.empty()) buckets.push_back(std::move(cur));
      cur = Bucket();
      cur_bytes = 0;
    };
    for (size_t i : order) {
      const auto& p = params[i];
      int64_t bytes = p.numel() * p.element_size();
      int64_t cap = buckets.empty() ? opts.first_bucket_bytes : opts.bucket_cap_bytes;
      bool other_kind = !cur.params.empty() && (params[cur.params[0]].scalar_type() != p.scalar_type() ||
                                                params[cur.params[0]].device() != p.device());
      if (!cur.params.empty() && (cur_bytes + bytes > cap || other_kind)) close();
      cur.params.push_back(i);
      cur_bytes += bytes;
    }
    close();
    for (size_t b = 0; b < buckets.size(); ++b) {
      auto& bk = buckets[b];
      int64_t total = 0;
      for (size_t s = 0; s < bk.params.size(); ++s) {
        bk.offsets.push_back(total);
        total += params[bk.params[s]].numel();
        where[bk.params[s]] = {b, s};
      }
      const auto& p0 = params[bk.params[0]];
      // Symmetric memory: on one node, the MPI backend all-reduces it in place through shared memory.
      bk.flat = symmetric_empty(*comm, total, p0.options().requires_grad(false));
      bk.flat.zero_();
      bk.pending = bk.params.size();
    }
    // Parameters whose gradient lived in an old bucket now point at the new one.
    for (size_t i = 0; i < params.size(); ++i) {
      if (old_grads[i].defined()) {
        auto v = view(i);
        v.copy_(old_grads[i]);
        params[i].mutable_grad() = v;
      }
    }
    reducer->planned(buckets);
    ready.assign(params.size(), 0);
    next_bucket = 0;
    stats.buckets = static_cast<int64_t>(buckets.size());
  }

  at::Tensor view(size_t i) {
    auto [b, s] = where[i];
    auto& bk = buckets[b];
    return bk.flat.narrow(0, bk.offsets[s], params[i].numel()).view(params[i].sizes());
  }

  bool is_view(const at::Tensor& g, const at::Tensor& v) const {
    return g.defined() && g.data_ptr() == v.data_ptr() && g.sizes() == v.sizes() && g.strides() == v.strides();
  }

  void copy_into_bucket(size_t i) {
    auto v = view(i);
    const auto& g = params[i].grad();
    if (is_view(g, v)) return;
    torch::NoGradGuard ng;
    if (g.defined()) {
      v.copy_(g);
    } else {
      v.zero_();
    }
  }

  // ---- per step
  void on_grad_ready(size_t i) {
    if (!opts.communicate || no_sync) return;
    if (!callback_queued) {
      callback_queued = true;
      backward_started = Clock::now();
      std::weak_ptr<Impl*> weak = self;
      detail::queue_backward_callback([weak] {
        if (auto s = weak.lock()) (*s)->finalize();
      });
    }
    if (ready[i]) return;
    ready[i] = 1;
    if (!plan_final) arrival.push_back(i);
    copy_into_bucket(i);
    auto& bk = buckets[where[i].first];
    if (--bk.pending == 0 && opts.overlap) launch_ready();
  }

  void launch_ready() {
    // Buckets go out in plan order on every rank, so collectives match across ranks.
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) launch(next_bucket++);
  }

  void launch(size_t b) { reducer->start(b, buckets[b]); }

  void finalize() {
    callback_queued = false;
    std::vector<size_t> missing;
    for (size_t i = 0; i < params.size(); ++i)
      if (!ready[i]) missing.push_back(i);
    for (size_t i : missing) {
      // A gradient accumulated in earlier no_sync steps still counts; otherwise zero.
      copy_into_bucket(i);
      ready[i] = 1;
      if (!plan_final) arrival.push_back(i);
    }
    for (auto& bk : buckets) bk.pending = 0;
    // Exposed: from the launch of the buckets backward did not start (all of them without
    // overlap) to the last one done.
    auto t0 = Clock::now();
    torch::NoGradGuard ng;
    launch_ready();
    std::exception_ptr err;
    try {
      reducer->finish(buckets);
    } catch (...) {
      err = std::current_exception();
    }
    stats.exposed_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    if (err) std::rethrow_exception(err);
    for (auto& bk : buckets) {
      finished.insert(finished.end(), bk.works.begin(), bk.works.end());
      bk.works.clear();
      bk.pending = bk.params.size();
    }
    for (size_t i = 0; i < params.size(); ++i) {
      auto v = view(i);
      if (!is_view(params[i].grad(), v)) params[i].mutable_grad() = v;
    }
    std::fill(ready.begin(), ready.end(), 0);
    next_bucket = 0;
    stats.steps += 1;
    if (!plan_final) {
      plan_final = true;
      rebuild_pending = opts.rebuild_buckets;
    }
    if (!missing.empty() && !opts.find_unused_parameters) {
      std::ostringstream msg;
      msg << "rank " << comm->rank() << ": " << missing.size() << " parameter(s) received no gradient in this step:";
      for (size_t k = 0; k < std::min<size_t>(missing.size(), 8); ++k) msg << " '" << names[missing[k]] << "'";
      if (missing.size() > 8) msg << " ...";
      msg << ". Their gradients were taken as zero. If this is intended, enable find_unused_parameters "
             "(tandem train --find-unused); otherwise make sure every parameter takes part in the loss.";
      throw std::runtime_error(msg.str());
    }
  }

  void rebuild_from_arrival() {
    rebuild_pending = false;
    // Rank 0's arrival order decides, so that every rank builds the same buckets.
    auto order =
        at::full({static_cast<int64_t>(params.size())}, -1, at::TensorOptions().dtype(at::kLong).device(device()));
    if (comm->rank() == 0 && arrival.size() == params.size()) {
      auto host = at::tensor(std::vector<int64_t>(arrival.begin(), arrival.end()), at::kLong);
      order.copy_(host);
    }
    comm->broadcast(order, 0);
    auto host = order.cpu();
    std::vector<size_t> o;
    for (int64_t k = 0; k < host.numel(); ++k) {
      int64_t v = host[k].item<int64_t>();
      if (v < 0) return;  // rank 0 saw an incomplete order (unused parameters): keep the plan
      o.push_back(static_cast<size_t>(v));
    }
    std::vector<size_t> current;
    for (auto& bk : buckets) current.insert(current.end(), bk.params.begin(), bk.params.end());
    if (o != current) plan(o);
  }
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, CommPtr comm,
                                                 DDPOptions opts)
    : module_(std::move(module)), impl_(std::make_unique<Impl>()) {
  if (!module_) throw std::invalid_argument("DistributedDataParallel needs a module");
  if (!comm) throw std::invalid_argument("DistributedDataParallel needs a communicator");
  if (opts.bucket_cap_bytes <= 0 || opts.first_bucket_bytes < 0) {
    throw std::invalid_argument("DDP bucket sizes must be positive (first_bucket_bytes 0 = automatic)");
  }
  if (opts.compress_dtype && *opts.compress_dtype != at::kBFloat16 && *opts.compress_dtype != at::kHalf) {
    throw std::invalid_argument("DDP gradient compression supports bfloat16 and float16 only");
  }
  if (opts.powersgd) check(*opts.powersgd, opts.compress_dtype.has_value());
  auto& I = *impl_;
  I.comm = std::move(comm);
  I.opts = opts;
  I.self = std::make_shared<Impl*>(impl_.get());
  for (auto& kv : module_->named_parameters(/*recurse=*/true)) {
    if (!kv.value().requires_grad()) continue;
    I.names.push_back(kv.key());
    I.params.push_back(kv.value());
  }
  for (auto& kv : module_->named_buffers(/*recurse=*/true)) I.buffers.emplace_back(kv.key(), kv.value());

  if (I.opts.first_bucket_bytes == 0) {
    bool cuda = !I.params.empty() && I.params[0].is_cuda();
    I.opts.first_bucket_bytes =
        cuda ? std::min<int64_t>(1024 * 1024, I.opts.bucket_cap_bytes) : I.opts.bucket_cap_bytes;
  }
  I.reducer = detail::make_bucket_reducer(*I.comm, I.params, I.opts, I.stats.bytes);
  I.check_same_model();
  I.broadcast_state(/*include_params=*/true);

  std::vector<size_t> order(I.params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;  // reverse registration
  I.plan(order);

  std::weak_ptr<Impl*> weak = I.self;
  I.accumulators = detail::add_post_accumulate_grad_hooks(I.params, [weak](size_t i) {
    if (auto s = weak.lock()) (*s)->on_grad_ready(i);
  });
}

DistributedDataParallel::~DistributedDataParallel() = default;

void DistributedDataParallel::prepare_forward() {
  auto& I = *impl_;
  if (!I.opts.communicate) return;
  I.collect_seconds();
  if (I.rebuild_pending && !I.no_sync) I.rebuild_from_arrival();
  if (I.opts.broadcast_buffers && !I.buffers.empty()) I.broadcast_state(/*include_params=*/false);
}

void DistributedDataParallel::zero_grad() {
  torch::NoGradGuard ng;
  auto& I = *impl_;
  for (auto& bk : I.buckets) bk.flat.zero_();
  for (size_t i = 0; i < I.params.size(); ++i) {
    auto& g = I.params[i].mutable_grad();
    if (g.defined() && !I.is_view(g, I.view(i))) g.zero_();
  }
}

NoSyncGuard DistributedDataParallel::no_sync() { return NoSyncGuard(&impl_->no_sync); }

std::vector<std::vector<std::string>> DistributedDataParallel::bucket_plan() const {
  std::vector<std::vector<std::string>> out;
  for (auto& bk : impl_->buckets) {
    out.emplace_back();
    for (size_t i : bk.params) out.back().push_back(impl_->names[i]);
  }
  return out;
}

DDPStats DistributedDataParallel::stats() const {
  impl_->collect_seconds();
  return impl_->stats;
}

void DistributedDataParallel::reset_stats() {
  auto buckets = impl_->stats.buckets;
  impl_->finished.clear();
  impl_->stats = DDPStats();
  impl_->stats.buckets = buckets;
}

std::vector<at::Tensor> DistributedDataParallel::powersgd_residuals() const { return impl_->reducer->residuals(); }

}  // namespace tandem
