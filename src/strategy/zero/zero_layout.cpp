// ZeroDataParallel's layout: parameters packed into buckets (by size, or one per stage-3 unit),
// the flat buffers and shards they live in, and the optimizer over the owned chunks.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <tuple>
#include <unordered_map>

#include "strategy/zero/zero_impl.h"

namespace tandem {

// Stages 1, 2: buckets by size. Stage 3: one bucket per unit, units in reverse forward order.
void ZeroDataParallel::Impl::plan_buckets() {
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
  // One index space: trained parameters 0..P-1, then the frozen ones.
  const size_t P = params.size(), all = P + frozen.size();
  std::unordered_map<const void*, size_t> index;
  for (size_t i = 0; i < P; ++i) index[params[i].unsafeGetTensorImpl()] = i;
  for (size_t j = 0; j < frozen.size(); ++j) index[frozen[j].unsafeGetTensorImpl()] = P + j;
  std::vector<std::vector<size_t>> units;
  bool has_root = false;
  if (sequential) {
    std::vector<char> taken(all, 0);
    for (auto& child : sequential->children()) {
      std::vector<size_t> u;
      for (auto& p : child->parameters(/*recurse=*/true)) {
        auto it = index.find(p.unsafeGetTensorImpl());
        if (it == index.end() || taken[it->second]) continue;  // shared with an earlier unit
        taken[it->second] = 1;
        u.push_back(it->second);
      }
      child_unit.push_back(u.empty() ? -1 : static_cast<int>(units.size()));
      if (!u.empty()) units.push_back(std::move(u));
    }
    for (size_t i = 0; i < all; ++i) {
      if (!taken[i]) {
        throw std::invalid_argument(where() + ": parameter '" + (i < P ? names[i] : frozen_names[i - P]) +
                                    "' belongs to no child of the Sequential; register it in a child module");
      }
    }
  } else {
    units = wrapped_unit_params(index, &has_root);
  }
  plan_units(units);
  if (wrapped_units && has_root) root_bucket = 0;  // unit 0, gathered for the whole step
}

// Stage 3: each unit's trained parameters (indices below P) into a bucket, buckets in reverse
// unit order (backward's); its frozen ones into a frozen bucket.
void ZeroDataParallel::Impl::plan_units(const std::vector<std::vector<size_t>>& units) {
  const size_t P = params.size();
  unit_bucket.assign(units.size(), -1);
  unit_frozen.assign(units.size(), -1);
  unit_backward.assign(units.size(), 0);
  for (size_t u = 0; u < units.size(); ++u) {
    Bucket fb;
    fb.unit = static_cast<int>(u);
    for (size_t k : units[u])
      if (k >= P) fb.params.push_back(k - P);
    if (fb.params.empty()) continue;
    unit_frozen[u] = static_cast<int>(frozen_buckets.size());
    frozen_buckets.push_back(std::move(fb));
  }
  for (size_t k = 0; k < units.size(); ++k) {
    size_t u = units.size() - 1 - k;
    Bucket bk;
    bk.unit = static_cast<int>(u);
    for (auto it = units[u].rbegin(); it != units[u].rend(); ++it)
      if (*it < P) bk.params.push_back(*it);
    if (bk.params.empty()) continue;
    unit_bucket[u] = static_cast<int>(buckets.size());
    buckets.push_back(std::move(bk));
  }
}

// The tensors ts[i], i in bk.params, one after another: their offsets in the bucket, its elements,
// and its size padded to a multiple of the world size (one element per rank at least).
void ZeroDataParallel::Impl::size_bucket(Bucket& bk, const std::vector<at::Tensor>& ts,
                                         std::vector<int64_t>& offsets) const {
  for (size_t i : bk.params) {
    offsets[i] = bk.numel;
    bk.numel += ts[i].numel();
  }
  bk.padded = std::max<int64_t>((bk.numel + world - 1) / world * world, world);
  bk.chunk = bk.padded / world;
}

// Stage 3: the frozen buckets' storage and shards; the frozen parameters become views of it.
void ZeroDataParallel::Impl::layout_frozen(const at::TensorOptions& o) {
  frozen_offset.assign(frozen.size(), 0);
  for (auto& bk : frozen_buckets) {
    size_bucket(bk, frozen, frozen_offset);
    auto values = at::zeros({bk.padded}, o);
    auto view = [&](const at::Tensor& buf, size_t j) {
      return buf.narrow(0, frozen_offset[j], frozen[j].numel()).view(frozen[j].sizes());
    };
    for (size_t j : bk.params) view(values, j).copy_(frozen[j].detach());
    bk.full = values;
    bk.shard = values.narrow(0, rank * bk.chunk, bk.chunk).clone();
    for (size_t j : bk.params) frozen[j].set_data(view(bk.full, j));
  }
}

// The units of a module that is not a Sequential: unit 0 the parameters outside every
// ShardedUnit (the root; absent when empty, the whole module when there is no ShardedUnit),
// then one per ShardedUnit in pre-order (forward order as models are usually written), each
// holding its parameters outside the units nested in it. Each wrapper's runner is set here.
std::vector<std::vector<size_t>> ZeroDataParallel::Impl::wrapped_unit_params(
    const std::unordered_map<const void*, size_t>& index, bool* has_root) {
  std::vector<std::shared_ptr<ShardedUnitImpl>> found;
  for (const auto& m : module->modules(/*include_self=*/true))
    if (auto w = std::dynamic_pointer_cast<ShardedUnitImpl>(m)) found.push_back(w);
  const size_t all = params.size() + frozen.size();
  std::vector<char> taken(all, 0);
  std::vector<std::vector<size_t>> own(found.size());
  for (size_t k = found.size(); k-- > 0;) {  // inner units first: they keep their parameters
    for (auto& p : found[k]->parameters(/*recurse=*/true)) {
      auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end() || taken[it->second]) continue;  // in a nested unit
      taken[it->second] = 1;
      own[k].push_back(it->second);
    }
    std::sort(own[k].begin(), own[k].end());
  }
  std::vector<std::vector<size_t>> units;
  std::vector<size_t> root;
  for (size_t i = 0; i < all; ++i)
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

// The bucket's flat values, padding zero.
at::Tensor ZeroDataParallel::Impl::initial_values(const Bucket& bk, const at::TensorOptions& o) const {
  auto values = at::zeros({bk.padded}, o);
  for (size_t i : bk.params) param_view(values, i).copy_(params[i].detach());
  return values;
}

void ZeroDataParallel::Impl::build_layout() {
  plan_buckets();
  bucket_of.assign(params.size(), 0);
  offset_of.assign(params.size(), 0);
  int64_t off = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bk = buckets[b];
    for (size_t i : bk.params) bucket_of[i] = b;
    size_bucket(bk, params, offset_of);
    bk.offset = off;
    bk.pending = bk.params.size();
    off += bk.padded;
  }
  torch::NoGradGuard ng;
  // With no trained parameter (all frozen), the frozen ones give the dtype and device.
  const auto& first = !params.empty() ? params[0] : !frozen.empty() ? frozen[0] : at::Tensor();
  const auto dtype = first.defined() ? first.scalar_type() : at::kFloat;
  const auto device = first.defined() ? first.device() : at::Device(at::kCPU);
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
  if (opts.stage == 3) layout_frozen(copts);
  const char* no_pool = std::getenv("TANDEM_ZERO_POOL");  // "0": ordinary memory, as before
  if (opts.stage >= 2 && device.is_cpu() && world > 1 && !(no_pool && std::string(no_pool) == "0")) {
    // Room for the scratch of the buckets in flight and the one filling, and (stage 3) for
    // the gathered units: the running one, its prefetched neighbours and the last unit, which
    // forward keeps for backward. Collective: every rank sizes it alike.
    int64_t largest = 0, total = 0;
    for (const auto* group : {&buckets, &frozen_buckets}) {
      for (const auto& bk : *group) {
        largest = std::max(largest, bk.padded);
        total += bk.padded;
      }
    }
    int64_t slots = std::max(1, opts.max_inflight_buckets) + 2;
    if (opts.stage == 3) slots += 2 * std::max(0, opts.prefetch) + 3;
    pool = detail::SymmetricPool(*comm, std::min(slots * largest, (opts.stage == 3 ? 2 : 1) * total), copts);
  }
  if (opts.stage == 3) {
    for (auto* group : {&buckets, &frozen_buckets}) {
      for (auto& bk : *group) {
        gathered_live += detail::nbytes(bk.full);
        release(bk);
      }
    }
    gathered_peak = 0;
  }
  ready.assign(params.size(), 0);
}

void ZeroDataParallel::Impl::build_optimizer() {
  std::vector<at::Tensor> masters;
  for (auto& bk : buckets) masters.push_back(bk.master);
  optim = make_optimizer(masters, opts.optimizer);
  if (is_layerwise(opts.optimizer)) set_layerwise_layout(*optim, layerwise_layout(nullptr, {}));
}

// LARS, LAMB: the pieces of parameters in each owned chunk (a parameter may straddle the
// chunks of several ranks, and a chunk holds several parameters), their norms summed over the
// data-parallel ranks and, for tensor-parallel shards, over `tp`.
LayerwiseLayout ZeroDataParallel::Impl::layerwise_layout(CommPtr tp, std::vector<bool> tp_sharded) const {
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
std::vector<std::tuple<size_t, int64_t, int64_t>> ZeroDataParallel::Impl::owned_pieces(const Bucket& bk) const {
  std::vector<std::tuple<size_t, int64_t, int64_t>> out;
  const int64_t lo = static_cast<int64_t>(rank) * bk.chunk, hi = lo + bk.chunk;
  for (size_t i : bk.params) {
    const int64_t from = std::max(lo, offset_of[i]), to = std::min(hi, offset_of[i] + params[i].numel());
    if (from < to) out.emplace_back(i, from - lo, to - lo);
  }
  return out;
}

}  // namespace tandem
