// ZeroDataParallel: ZeRO stages 1, 2 and 3 as one class whose stage is a switch (llm.c's
// zero.cuh), not a hierarchy.
//
// Layout: parameters are packed into buckets, each padded to a multiple of the world size N;
// rank r owns chunk r of every bucket, so a bucket's reduce-scatter delivers exactly the
// gradient chunk rank r steps. Stages 1 and 2 cut buckets by size (reverse registration order,
// the order backward produces gradients) and lay them one after another in one flat buffer of
// which the model's parameters become views. Stage 3 makes one bucket per unit (a child of a
// Sequential), each with its own storage that is freed whenever the unit is not in use; the
// rank keeps only its chunk (`shard`).
//
// Per step: post-accumulate hooks copy each finished gradient into its bucket; a full bucket
// (in bucket order, identical on every rank) is reduce-scattered. Stage 1 does it in place in
// a full-size gradient buffer the parameters' .grad() are views of (summing; the rest of the
// bucket is zeroed afterwards so that a further backward accumulates correctly, and step()
// divides by N). Stages 2 and 3 reduce-scatter from a per-bucket scratch (freed once the
// collective finished; the parameters' .grad() are released) into the rank's gradient shard.
// So every stage moves what DDP's all-reduce moves (reduce-scatter + all-gather), stage 3
// one more all-gather. An autograd final callback waits for the collectives.
// step() unscales and checks (fp16), clips by the global norm (sum of squares of the shards,
// all-reduced), steps the shard's masters and (stages 1, 2) all-gathers every bucket.
//
// Stage 3 gathering: forward() all-gathers unit u (unless prefetched), starts the gather of
// the next unit(s), runs the unit, frees it, and hooks the unit's output so that when its
// gradient arrives (just before the unit's backward) the unit is gathered again and the one
// before it prefetched. When the unit's last gradient has been accumulated its parameters are
// freed again. Freeing releases the memory of the unit's storage but keeps the StorageImpl, so
// the views that autograd saved stay valid and see the re-gathered values.
#include "tandem/zero.h"

#include <ATen/ATen.h>
#include <sys/mman.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <iterator>
#include <map>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "compat/torch_compat.h"
#include "strategy/autograd_hooks.h"
#include "strategy/model_sync.h"
#include "strategy/module_wrapper.h"

namespace tandem {
namespace {

enum class Gather { kFree, kInFlight, kReady };

struct Bucket {
  std::vector<size_t> params;  // indices into Impl::params, in flat order
  int64_t offset = 0;          // stages 1, 2: first element in the flat buffers
  int64_t numel = 0;           // elements of its parameters
  int64_t padded = 0;          // numel rounded up to a multiple of N
  int64_t chunk = 0;           // padded / N: what each rank owns
  size_t pending = 0;          // parameters still waiting for their gradient this step
  at::Tensor full;             // all its parameters (stage 3: memory only while gathered)
  at::Tensor shard;            // this rank's chunk, compute dtype (stages 1, 2: a view of full)
  at::Tensor master;           // what the optimizer steps: the shard itself in fp32, else an fp32 copy
  at::Tensor grad;             // stages 2, 3: the averaged gradient of the chunk, from its first
                               // reduce-scatter after zero_grad() to the next zero_grad()
  at::Tensor scratch;          // stages 2, 3: the bucket's local gradients while reduce-scattered
  at::Tensor accum;            // stages 2, 3, second and later backward: the reduced chunk to add
  WorkPtr work;
  // stage 3
  int unit = -1;
  Gather state = Gather::kReady;
  WorkPtr gather;
};

bool same_view(const at::Tensor& g, const at::Tensor& v) {
  return g.defined() && g.data_ptr() == v.data_ptr() && g.sizes() == v.sizes() && g.strides() == v.strides();
}

int64_t nbytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

// A fixed block of symmetric memory (symmetric_empty: an MPI-3 shared window on one
// node) from which the buffers that ZeRO allocates during a step are carved: stage 2-3 gradient
// scratch and stage 3 gathered units. The MPI backend reduce-scatters and all-gathers buffers
// that lie in a window through shared memory (one copy) instead of MPI's fifos. Carving is
// first fit with coalescing, so every rank, making the same requests in the same order, gets
// the same offsets (the shared-memory collectives require it); the block itself is allocated
// once, before any backward, because its allocation is collective. A request that does not fit
// returns an undefined tensor (the caller allocates ordinary memory, on every rank alike).
class SymmetricPool {
 public:
  SymmetricPool() = default;
  SymmetricPool(Communicator& comm, int64_t numel, const at::TensorOptions& opts)
      : base_(symmetric_empty(comm, std::max<int64_t>(numel, 1), opts)) {
    free_[0] = base_.numel();
  }
  at::Tensor take(int64_t numel) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < numel) continue;
      const int64_t off = it->first, len = it->second;
      free_.erase(it);
      if (len > numel) free_[off + numel] = len - numel;
      used_[off] = numel;
      high_ = std::max(high_, off + numel);
      return base_.narrow(0, off, numel);
    }
    misses_ += base_.defined();
    return at::Tensor();
  }
  // Gives back what take() returned (by its data pointer); false for memory not from here.
  bool give_back(const void* p) {
    if (!base_.defined()) return false;
    const auto* b = static_cast<const char*>(base_.data_ptr());
    const auto delta = static_cast<const char*>(p) - b;
    if (delta < 0 || delta >= nbytes(base_)) return false;
    const int64_t off = delta / static_cast<int64_t>(base_.element_size());
    auto u = used_.find(off);
    if (u == used_.end()) return false;
    int64_t start = off, len = u->second;
    used_.erase(u);
    auto next = free_.find(start + len);
    if (next != free_.end()) {
      len += next->second;
      free_.erase(next);
    }
    auto after = free_.lower_bound(start);
    if (after != free_.begin()) {
      auto before = std::prev(after);
      if (before->first + before->second == start) {
        start = before->first;
        len += before->second;
        free_.erase(before);
      }
    }
    free_[start] = len;
    return true;
  }
  // Marks what has been carved so far (the first time since release_pages()) as the part to
  // keep: called before backward's first scratch, it covers what forward gathers, which the next
  // forward, making the same requests in the same order, carves again at the same offsets.
  void mark_keep() {
    if (keep_ < 0) keep_ = high_;
  }
  // Hands the pages carved since the last call, beyond the kept part, back to the system while
  // nothing is carved: backward's scratch would otherwise stay resident through the next forward
  // and add to its peak, the moment its activations are all alive. Touching them again maps
  // zeroed pages, a page fault each (about 2.5 us a page here: 1-2 % of a step). Only when no
  // peer reads this block: after a collective's closing barrier. Where the system cannot punch
  // pages (not shared memory), they stay.
  void release_pages() {
    if (!base_.defined() || !used_.empty()) return;
    const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto at = [&](int64_t elements) {
      return reinterpret_cast<uintptr_t>(base_.data_ptr()) + static_cast<uintptr_t>(elements * base_.element_size());
    };
    const auto from = (at(std::max<int64_t>(keep_, 0)) + page - 1) / page * page, to = at(high_) / page * page;
    if (to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_REMOVE);
    high_ = 0;
    keep_ = -1;
  }
  int64_t bytes() const { return nbytes(base_); }
  int64_t misses() const { return misses_; }  // requests that did not fit

 private:
  at::Tensor base_;
  std::map<int64_t, int64_t> free_;  // offset -> elements
  std::map<int64_t, int64_t> used_;
  int64_t high_ = 0;   // the end of the highest carving since release_pages()
  int64_t keep_ = -1;  // mark_keep()'s high_, or -1
  int64_t misses_ = 0;
};

}  // namespace

struct ZeroDataParallel::Impl {
  CommPtr comm;
  ZeroOptions opts;
  int world = 1, rank = 0;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  std::vector<std::shared_ptr<void>> accumulators;
  std::shared_ptr<Impl*> self;                      // hooks hold a weak_ptr to this
  torch::nn::SequentialImpl* sequential = nullptr;  // stage 3 per-unit forward
  torch::nn::Module* module = nullptr;
  // Stage 3, not a Sequential: units from ShardedUnit wrappers; the root unit's bucket (the
  // parameters outside them, gathered for the whole step), or -1.
  bool wrapped_units = false;
  int root_bucket = -1;

  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;
  std::vector<int64_t> offset_of;  // element offset of each parameter within its bucket
  int64_t psi = 0;
  at::Tensor flat;       // stages 1, 2: every parameter
  at::Tensor grad_flat;  // stage 1: every gradient, averaged after backward
  std::unique_ptr<torch::optim::Optimizer> optim;
  bool mixed = false;  // fp32 masters separate from the low-precision shard
  LossScaler scaler{false};

  // stage 3
  std::vector<size_t> unit_bucket;  // unit (forward order) -> bucket
  std::vector<int> child_unit;      // Sequential child -> unit, or -1

  std::vector<char> ready;
  size_t next_bucket = 0;
  bool callback_queued = false;
  bool no_sync = false;         // stage 1 under no_sync(): backward only accumulates locally
  bool owned_summed = false;    // stage 1: the owned chunks hold sums over ranks, not means
  std::deque<size_t> inflight;  // stages 2, 3: launched, scratch still held
  double last_norm = -1.0;
  // set_model_parallel: per bucket, the ranges of this rank's chunk (chunk-local) that hold
  // tensor-parallel shards; the groups over which the norm's parts are summed.
  bool model_parallel = false;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> sharded_ranges;
  CommPtr mp_tp, mp_pp;
  int64_t scratch_live = 0, scratch_peak = 0;    // bytes of bucket scratch alive
  int64_t gathered_live = 0, gathered_peak = 0;  // stage 3: bytes of gathered units
  double gather_wait_s = 0.0;                    // stage 3: seconds the caller blocked on parameter all-gathers
  SymmetricPool pool;                            // stages 2, 3 on CPU: scratch and gathered units

  std::string where() const { return "rank " + std::to_string(rank) + ": ZeRO-" + std::to_string(opts.stage); }

  at::Tensor param_view(const at::Tensor& bucket_buf, size_t i) const {
    return bucket_buf.narrow(0, offset_of[i], params[i].numel()).view(params[i].sizes());
  }
  at::Tensor grad_view(size_t i) const {
    const auto& bk = buckets[bucket_of[i]];
    return param_view(grad_flat.narrow(0, bk.offset, bk.padded), i);
  }
  // Stages 2, 3: zeros when no backward reached the bucket since zero_grad() (a step without one).
  at::Tensor grad_chunk(Bucket& bk) const {
    if (opts.stage == 1) return grad_flat.narrow(0, bk.offset + rank * bk.chunk, bk.chunk);
    if (!bk.grad.defined()) bk.grad = at::zeros({bk.chunk}, bk.shard.options());
    return bk.grad;
  }

  // Uninitialised but for the padding: take_gradient() writes every parameter's slice (its
  // gradient, or zeros), which saves a memset of the bucket every step.
  at::Tensor new_scratch(const Bucket& bk) {
    pool.mark_keep();
    auto t = pool.take(bk.padded);
    if (!t.defined()) t = at::empty({bk.padded}, bk.shard.options());
    t.narrow(0, bk.numel, bk.padded - bk.numel).zero_();
    scratch_live += nbytes(t);
    scratch_peak = std::max(scratch_peak, scratch_live);
    return t;
  }
  void free_scratch(Bucket& bk) {
    scratch_live -= nbytes(bk.scratch);
    if (bk.scratch.defined()) pool.give_back(bk.scratch.data_ptr());
    bk.scratch = at::Tensor();
  }

  // ---- layout

  // Stages 1, 2: buckets by size. Stage 3: one bucket per unit, units in reverse forward order.
  void plan_buckets() {
    const int64_t esize = params.empty() ? 4 : params[0].element_size();
    if (opts.stage < 3) {
      Bucket cur;
      int64_t cur_bytes = 0;
      for (size_t k = 0; k < params.size(); ++k) {
        size_t i = params.size() - 1 - k;  // reverse registration order
        int64_t bytes = params[i].numel() * esize;
        if (!cur.params.empty() && cur_bytes + bytes > opts.bucket_cap_bytes) {
          buckets.push_back(std::move(cur));
          cur = Bucket();
          cur_bytes = 0;
        }
        cur.params.push_back(i);
        cur_bytes += bytes;
      }
      if (!cur.params.empty()) buckets.push_back(std::move(cur));
      return;
    }
    std::unordered_map<const void*, size_t> index;
    for (size_t i = 0; i < params.size(); ++i) index[params[i].unsafeGetTensorImpl()] = i;
    std::vector<std::vector<size_t>> units;
    bool has_root = false;
    if (sequential) {
      std::vector<char> taken(params.size(), 0);
      for (auto& child : sequential->children()) {
        std::vector<size_t> u;
        for (auto& p : child->parameters(/*recurse=*/true)) {
          auto it = index.find(p.unsafeGetTensorImpl());
          if (it == index.end() || taken[it->second]) continue;  // frozen, or shared with an earlier unit
          taken[it->second] = 1;
          u.push_back(it->second);
        }
        child_unit.push_back(u.empty() ? -1 : static_cast<int>(units.size()));
        if (!u.empty()) units.push_back(std::move(u));
      }
      for (size_t i = 0; i < params.size(); ++i) {
        if (!taken[i]) {
          throw std::invalid_argument(where() + ": parameter '" + names[i] +
                                      "' belongs to no child of the Sequential; register it in a child module");
        }
      }
    } else {
      units = wrapped_unit_params(index, &has_root);
    }
    unit_bucket.assign(units.size(), 0);
    for (size_t k = 0; k < units.size(); ++k) {
      size_t u = units.size() - 1 - k;
      Bucket bk;
      bk.unit = static_cast<int>(u);
      bk.params.assign(units[u].rbegin(), units[u].rend());
      unit_bucket[u] = buckets.size();
      buckets.push_back(std::move(bk));
    }
    if (wrapped_units && has_root) root_bucket = static_cast<int>(unit_bucket[0]);
  }

  // The units of a module that is not a Sequential: unit 0 the parameters outside every
  // ShardedUnit (the root; absent when empty, the whole module when there is no ShardedUnit),
  // then one per ShardedUnit in pre-order (forward order as models are usually written), each
  // holding its parameters outside the units nested in it. Each wrapper's runner is set here.
  std::vector<std::vector<size_t>> wrapped_unit_params(const std::unordered_map<const void*, size_t>& index,
                                                       bool* has_root) {
    std::vector<std::shared_ptr<ShardedUnitImpl>> found;
    for (const auto& m : module->modules(/*include_self=*/true))
      if (auto w = std::dynamic_pointer_cast<ShardedUnitImpl>(m)) found.push_back(w);
    std::vector<char> taken(params.size(), 0);
    std::vector<std::vector<size_t>> own(found.size());
    for (size_t k = found.size(); k-- > 0;) {  // inner units first: they keep their parameters
      for (auto& p : found[k]->parameters(/*recurse=*/true)) {
        auto it = index.find(p.unsafeGetTensorImpl());
        if (it == index.end() || taken[it->second]) continue;  // frozen, or in a nested unit
        taken[it->second] = 1;
        own[k].push_back(it->second);
      }
      std::sort(own[k].begin(), own[k].end());
    }
    std::vector<std::vector<size_t>> units;
    std::vector<size_t> root;
    for (size_t i = 0; i < params.size(); ++i)
      if (!taken[i]) root.push_back(i);
    *has_root = !root.empty();
    if (*has_root) units.push_back(std::move(root));
    wrapped_units = !found.empty();
    std::weak_ptr<Impl*> weak = self;
    for (size_t k = 0; k < found.size(); ++k) {
      if (own[k].empty()) continue;  // nothing of its own to gather
      const int u = static_cast<int>(units.size());
      units.push_back(std::move(own[k]));
      found[k]->set_runner([weak, u](torch::nn::AnyModule& inner, const at::Tensor& x) {
        if (auto s = weak.lock()) return (*s)->run_unit(u, inner, x);
        return inner.forward<at::Tensor>(x);
      });
    }
    return units;
  }

  // A ShardedUnit's forward: gathered (the next unit prefetched), run, freed; its output's
  // gradient gathers it again for backward.
  at::Tensor run_unit(int u, torch::nn::AnyModule& inner, const at::Tensor& x) {
    auto& bk = buckets[unit_bucket[u]];
    ensure_gathered(bk);
    const int U = static_cast<int>(unit_bucket.size());
    for (int d = 1; d <= opts.prefetch && u + d < U; ++d) start_gather(buckets[unit_bucket[u + d]]);
    at::Tensor y = inner.forward<at::Tensor>(x);
    if (at::GradMode::is_enabled() && y.requires_grad()) {
      std::weak_ptr<Impl*> weak = self;
      const int lo = root_bucket >= 0 ? 1 : 0;  // the root stays gathered through the step
      y.register_hook([weak, u, lo](const at::TensorBase&) {
        if (auto s = weak.lock()) (*s)->pre_backward(u, lo);
      });
    }
    release(bk);
    return y;
  }

  // The bucket's flat values, padding zero.
  at::Tensor initial_values(const Bucket& bk, const at::TensorOptions& o) const {
    auto values = at::zeros({bk.padded}, o);
    for (size_t i : bk.params) param_view(values, i).copy_(params[i].detach());
    return values;
  }

  void build_layout() {
    plan_buckets();
    bucket_of.assign(params.size(), 0);
    offset_of.assign(params.size(), 0);
    int64_t off = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      auto& bk = buckets[b];
      for (size_t i : bk.params) {
        bucket_of[i] = b;
        offset_of[i] = bk.numel;
        bk.numel += params[i].numel();
      }
      bk.padded = std::max<int64_t>((bk.numel + world - 1) / world * world, world);
      bk.chunk = bk.padded / world;
      bk.offset = off;
      bk.pending = bk.params.size();
      off += bk.padded;
    }
    torch::NoGradGuard ng;
    const auto dtype = params.empty() ? at::kFloat : params[0].scalar_type();
    const auto device = params.empty() ? at::Device(at::kCPU) : params[0].device();
    // Masters keep the parameters' values before any conversion to the compute dtype.
    const auto compute = mixed ? compute_dtype(opts.precision) : dtype;
    const auto copts = at::TensorOptions().dtype(compute).device(device);
    // Symmetric memory (on one node, float32/64 on CPU: MPI-3 shared windows): the MPI backend
    // reduce-scatters and all-gathers buckets of it in place through shared memory.
    if (opts.stage < 3) flat = symmetric_empty(*comm, std::max<int64_t>(off, 1), copts).zero_();
    for (auto& bk : buckets) {
      auto values = initial_values(bk, at::TensorOptions().dtype(dtype).device(device));
      auto mine = values.narrow(0, rank * bk.chunk, bk.chunk);
      if (mixed) bk.master = mine.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      bk.full = opts.stage < 3 ? flat.narrow(0, bk.offset, bk.padded) : at::empty({bk.padded}, copts);
      bk.full.copy_(values);
      bk.shard = opts.stage < 3 ? bk.full.narrow(0, rank * bk.chunk, bk.chunk)
                                : bk.full.narrow(0, rank * bk.chunk, bk.chunk).clone();
      if (!mixed) bk.master = bk.shard;
      for (size_t i : bk.params) params[i].set_data(param_view(bk.full, i));
    }
    if (mixed) {
      for (auto& b : buffers) {
        if (at::isFloatingType(b.second.scalar_type())) b.second.set_data(b.second.to(compute));
      }
    }
    if (opts.stage == 1) grad_flat = symmetric_empty(*comm, flat.numel(), copts).zero_();
    const char* no_pool = std::getenv("TANDEM_ZERO_POOL");  // "0": ordinary memory, as before
    if (opts.stage >= 2 && device.is_cpu() && world > 1 && !(no_pool && std::string(no_pool) == "0")) {
      // Room for the scratch of the buckets in flight and the one filling, and (stage 3) for
      // the gathered units: the running one, its prefetched neighbours and the last unit, which
      // forward keeps for backward. Collective: every rank sizes it alike.
      int64_t largest = 0, total = 0;
      for (const auto& bk : buckets) {
        largest = std::max(largest, bk.padded);
        total += bk.padded;
      }
      int64_t slots = std::max(1, opts.max_inflight_buckets) + 2;
      if (opts.stage == 3) slots += 2 * std::max(0, opts.prefetch) + 3;
      pool = SymmetricPool(*comm, std::min(slots * largest, (opts.stage == 3 ? 2 : 1) * total), copts);
    }
    if (opts.stage == 3) {
      for (auto& bk : buckets) {
        gathered_live += nbytes(bk.full);
        release(bk);
      }
      gathered_peak = 0;
    }
    ready.assign(params.size(), 0);
  }

  void build_optimizer() {
    std::vector<at::Tensor> masters;
    for (auto& bk : buckets) masters.push_back(bk.master);
    optim = make_optimizer(masters, opts.optimizer);
    if (is_layerwise(opts.optimizer)) set_layerwise_layout(*optim, layerwise_layout(nullptr, {}));
  }

  // LARS, LAMB: the pieces of parameters in each owned chunk (a parameter may straddle the
  // chunks of several ranks, and a chunk holds several parameters), their norms summed over the
  // data-parallel ranks and, for tensor-parallel shards, over `tp`.
  LayerwiseLayout layerwise_layout(CommPtr tp, std::vector<bool> tp_sharded) const {
    LayerwiseLayout L;
    for (const auto& bk : buckets) {
      std::vector<LayerwiseLayout::Segment> segs;
      for (const auto& [i, from, to] : owned_pieces(bk)) segs.push_back({from, to - from, static_cast<int64_t>(i)});
      L.segments.push_back(std::move(segs));
    }
    for (const auto& p : params) L.dims.push_back(p.dim());
    L.reduce = shard_norm_reducer(comm, std::move(tp), std::move(tp_sharded));
    return L;
  }

  // The parameters with elements in this rank's chunk of `bk`: (parameter, [from, to) within
  // the chunk).
  std::vector<std::tuple<size_t, int64_t, int64_t>> owned_pieces(const Bucket& bk) const {
    std::vector<std::tuple<size_t, int64_t, int64_t>> out;
    const int64_t lo = static_cast<int64_t>(rank) * bk.chunk, hi = lo + bk.chunk;
    for (size_t i : bk.params) {
      const int64_t from = std::max(lo, offset_of[i]), to = std::min(hi, offset_of[i] + params[i].numel());
      if (from < to) out.emplace_back(i, from - lo, to - lo);
    }
    return out;
  }

  // ---- stage 3: gathering units

  void start_gather(Bucket& bk) {
    if (bk.state != Gather::kFree) return;
    if (auto slot = pool.take(bk.padded); slot.defined()) {
      compat::place_storage(bk.full, slot.data_ptr(), static_cast<size_t>(nbytes(bk.full)), slot);
    } else {
      compat::alloc_storage(bk.full, static_cast<size_t>(nbytes(bk.full)));
    }
    gathered_live += nbytes(bk.full);
    gathered_peak = std::max(gathered_peak, gathered_live);
    bk.state = Gather::kInFlight;
    bk.gather = comm->allgather_async(bk.full, bk.shard);
  }
  void ensure_gathered(Bucket& bk) {
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
  void release(Bucket& bk) {
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
    gathered_live -= nbytes(bk.full);
    bk.state = Gather::kFree;
  }
  void release_all() {
    for (auto& bk : buckets) release(bk);
  }

  // Children [first, end) of the Sequential; prefetching stays inside the range (a pipeline
  // stage runs its chunks at other times).
  at::Tensor forward(const at::Tensor& input, int64_t first, int64_t end) {
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
      auto& bk = buckets[unit_bucket[u]];
      ensure_gathered(bk);
      for (int d = 1; d <= opts.prefetch && u + d <= hi; ++d) start_gather(buckets[unit_bucket[u + d]]);
      x = child.forward(x);
      const bool backward_comes = grad && x.requires_grad();
      if (backward_comes) {
        std::weak_ptr<Impl*> weak = self;
        x.register_hook([weak, u, lo](const at::TensorBase&) {
          if (auto s = weak.lock()) (*s)->pre_backward(u, lo);
        });
      }
      // The range's last unit's backward runs first: keep it.
      if (!(backward_comes && u == hi)) release(bk);
    }
    return x;
  }

  void pre_backward(int u, int lo) {
    arm_final_callback();
    ensure_gathered(buckets[unit_bucket[u]]);
    for (int d = 1; d <= opts.prefetch && u - d >= lo; ++d) {
      auto& prev = buckets[unit_bucket[u - d]];
      if (prev.pending > 0) start_gather(prev);
    }
  }

  // ---- per step, from the autograd hooks

  void arm_final_callback() {
    if (callback_queued) return;
    callback_queued = true;
    std::weak_ptr<Impl*> weak = self;
    detail::queue_backward_callback([weak] {
      if (auto s = weak.lock()) (*s)->finalize();
    });
  }

  void on_grad_ready(size_t i) {
    // Autograd adds into the parameter's .grad (a view of the flat buffer after the first
    // synced backward; before it, a tensor of its own that take_gradient() copies in).
    if (no_sync) return;
    arm_final_callback();
    if (ready[i]) return;
    ready[i] = 1;
    take_gradient(i);
    auto& bk = buckets[bucket_of[i]];
    if (--bk.pending == 0) {
      release(bk);  // stage 3: the unit's backward is done
      launch_ready();
    }
  }

  // Moves parameter i's gradient where its bucket's collective will find it.
  void take_gradient(size_t i) {
    torch::NoGradGuard ng;
    auto& g = params[i].mutable_grad();
    if (opts.stage == 1) {
      auto v = grad_view(i);
      if (same_view(g, v)) return;  // accumulated in place
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

  void launch_ready() {
    // In bucket order on every rank, so that the collectives match.
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) launch(next_bucket++);
  }

  void wait_oldest() {
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

  void launch(size_t b) {
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

  void finalize() {
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
    next_bucket = 0;
    if (err) std::rethrow_exception(err);
  }

  // The optimizer's gradients: views of the averaged chunks (fp32), or fp32 copies of them
  // (mixed precision; they live only inside step()).
  void link_master_grads() {
    if (owned_summed) {
      for (auto& bk : buckets) grad_chunk(bk).div_(world);
      owned_summed = false;
    }
    for (auto& bk : buckets) {
      auto v = grad_chunk(bk);
      if (mixed) {
        bk.master.mutable_grad() = v.to(at::kFloat);
      } else if (!same_view(bk.master.grad(), v)) {
        bk.master.mutable_grad() = v;
      }
    }
  }
  void drop_master_grads() {
    if (!mixed) return;
    for (auto& bk : buckets) bk.master.mutable_grad() = at::Tensor();
  }

  bool step() {
    torch::NoGradGuard ng;
    release_all();  // stage 3: gathered values are about to be stale
    link_master_grads();
    if (scaler.dynamic()) {
      for (auto& bk : buckets) bk.master.mutable_grad().mul_(1.0 / scaler.scale());
    }
    const bool clipping = opts.max_grad_norm > 0;
    last_norm = -1.0;
    if (clipping || scaler.dynamic()) {
      // [all of this rank's chunk, its tensor-parallel shards' part]: summed over the
      // data-parallel ranks, the shards' part then over tp (the rest is the same on every tp
      // rank), and the whole over the pipeline's stages.
      auto sq = at::zeros({2}, buckets.empty() ? at::TensorOptions(at::kDouble)
                                               : buckets[0].master.options().dtype(at::kDouble));
      for (size_t b = 0; b < buckets.size(); ++b) {
        const auto g = buckets[b].master.grad();
        sq[0] += g.to(at::kDouble).pow(2).sum();
        if (model_parallel)
          for (const auto& [from, to] : sharded_ranges[b])
            sq[1] += g.narrow(0, from, to - from).to(at::kDouble).pow(2).sum();
      }
      comm->allreduce(sq, ReduceOp::kSum);
      double total = 0.0;
      if (model_parallel) {
        auto sh = sq.narrow(0, 1, 1).clone();
        if (mp_tp && mp_tp->size() > 1) mp_tp->allreduce(sh, ReduceOp::kSum);
        auto t = sq.narrow(0, 0, 1) - sq.narrow(0, 1, 1) + sh;
        if (mp_pp && mp_pp->size() > 1) mp_pp->allreduce(t, ReduceOp::kSum);
        total = t.cpu().item<double>();
      } else {
        total = sq[0].cpu().item<double>();
      }
      double norm = std::sqrt(total);
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
  void publish_shards() {
    if (mixed)
      for (auto& bk : buckets) bk.shard.copy_(bk.master);
    if (opts.stage == 3) return;
    std::vector<WorkPtr> works;
    // In place: the owned chunk is where the all-gather receives this rank's part.
    for (auto& bk : buckets) works.push_back(comm->allgather_async(bk.full, bk.shard));
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
};

ZeroDataParallel::ZeroDataParallel(std::shared_ptr<torch::nn::Module> module, CommPtr comm, ZeroOptions opts)
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
  I.opts = opts;
  I.world = I.comm->size();
  I.rank = I.comm->rank();
  I.self = std::make_shared<Impl*>(impl_.get());
  I.scaler = LossScaler(opts.precision == Precision::kFP16, opts.loss_scaler);
  if (opts.stage == 3) I.sequential = dynamic_cast<torch::nn::SequentialImpl*>(module_.get());
  I.module = module_.get();
  for (auto& kv : module_->named_parameters(/*recurse=*/true)) {
    if (!kv.value().requires_grad()) continue;
    I.names.push_back(kv.key());
    I.params.push_back(kv.value());
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
  detail::check_same_model(*I.comm, I.names, I.params, I.buffers, "ZeroDataParallel");
  detail::broadcast_from_rank0(*I.comm, I.params, I.buffers, /*include_params=*/true);
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
    detail::broadcast_from_rank0(*I.comm, I.params, I.buffers, /*include_params=*/false);
  }
  if (I.opts.stage == 3 && !I.sequential) {
    if (!I.wrapped_units) {
      for (auto& bk : I.buckets) I.ensure_gathered(bk);
    } else if (I.root_bucket >= 0) {
      I.ensure_gathered(I.buckets[static_cast<size_t>(I.root_bucket)]);
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
      if (g.defined() && !same_view(g, I.grad_view(i))) g.zero_();
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

bool ZeroDataParallel::step() { return impl_->step(); }

void ZeroDataParallel::set_lr(double lr) {
  for (auto& g : impl_->optim->param_groups()) g.options().set_lr(lr);
}

double ZeroDataParallel::lr() const { return impl_->optim->param_groups().at(0).options().get_lr(); }

double ZeroDataParallel::last_grad_norm() const { return impl_->last_norm; }

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
  return out;
}

int64_t ZeroDataParallel::optimizer_step() const {
  int64_t step = 0;
  for (auto& bk : impl_->buckets) step = std::max(step, get_param_state(*impl_->optim, bk.master).step);
  return step;
}

void ZeroDataParallel::reset_optimizer_state(const std::vector<std::string>& slots, int64_t step) {
  auto& I = *impl_;
  for (auto& bk : I.buckets) {
    ParamOptimizerState ps;
    ps.step = step;
    for (const auto& k : slots) ps.slots[k] = at::zeros_like(bk.master);
    set_param_state(*I.optim, bk.master, ps);
  }
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
  const auto& I = *impl_;
  ZeroMemory m;
  m.stage = I.opts.stage;
  m.world_size = I.world;
  m.parameters = I.psi;
  if (I.opts.stage < 3) {
    m.parameter_bytes = nbytes(I.flat);  // the parameters are views of it
  } else {
    for (auto& bk : I.buckets)
      m.parameter_bytes += nbytes(bk.shard) + (bk.state == Gather::kFree ? 0 : nbytes(bk.full));
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
