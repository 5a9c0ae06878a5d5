// ZeroDataParallel's state (Impl, with its Bucket) and the declarations of its parts, which
// zero_layout.cpp, zero_gather.cpp, zero_reduce.cpp and zero_step.cpp define. Private to
// src/strategy/zero/.
//
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
#pragma once

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "strategy/zero/symmetric_pool.h"
#include "tandem/zero.h"

namespace tandem {
namespace detail {

inline bool same_view(const at::Tensor& g, const at::Tensor& v) {
  return g.defined() && g.data_ptr() == v.data_ptr() && g.sizes() == v.sizes() && g.strides() == v.strides();
}

}  // namespace detail

struct ZeroDataParallel::Impl {
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

  CommPtr comm;
  CommPtr replicate;  // hybrid sharding: the other groups' ranks with this shard index, or null
  ZeroOptions opts;
  int world = 1, rank = 0;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  std::vector<std::shared_ptr<void>> accumulators;
  std::shared_ptr<Impl*> self;                      // hooks hold a weak_ptr to this
  torch::nn::SequentialImpl* sequential = nullptr;  // stage 3 per-unit forward
  torch::nn::Module* module = nullptr;
  // Stage 3, not a Sequential: units from ShardedUnit wrappers; 0 when there is a root unit (the
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
  std::vector<int> unit_bucket;  // unit (forward order) -> bucket of its trained parameters, or -1
  std::vector<int> child_unit;   // Sequential child -> unit, or -1
  // Stage 3's frozen parameters (requires_grad false): sharded and gathered with their unit as
  // the others, in buckets of their own that are never reduced or stepped. A unit's frozen
  // bucket stays gathered until the gradient of its input arrives (pre_backward of the unit
  // before it), since ops of its backward other than gradient accumulation may still read it.
  std::vector<std::string> frozen_names;
  std::vector<at::Tensor> frozen;
  std::vector<int64_t> frozen_offset;  // element offset of each within its bucket
  std::vector<Bucket> frozen_buckets;
  std::vector<int> unit_frozen;     // unit -> its frozen bucket, or -1
  std::vector<char> unit_backward;  // the unit's output needs a gradient in this step's forwards

  std::vector<char> ready;
  size_t next_bucket = 0;
  bool callback_queued = false;
  bool no_sync = false;         // stage 1 under no_sync(): backward only accumulates locally
  bool owned_summed = false;    // stage 1: the owned chunks hold sums over ranks, not means
  std::deque<size_t> inflight;  // stages 2, 3: launched, scratch still held
  double last_norm = -1.0;
  double extra_sq = 0.0;  // add_squared_norm's, for the next step
  // set_model_parallel: per bucket, the ranges of this rank's chunk (chunk-local) that hold
  // tensor-parallel shards; the groups over which the norm's parts are summed.
  bool model_parallel = false;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> sharded_ranges;
  CommPtr mp_tp, mp_pp;
  int64_t scratch_live = 0, scratch_peak = 0;    // bytes of bucket scratch alive
  int64_t gathered_live = 0, gathered_peak = 0;  // stage 3: bytes of gathered units
  double gather_wait_s = 0.0;                    // stage 3: seconds the caller blocked on parameter all-gathers
  detail::SymmetricPool pool;                    // stages 2, 3 on CPU: scratch and gathered units

  // The groups parameters and buffers are synchronised over: the shard group, then (hybrid
  // sharding) the replicas.
  std::vector<Communicator*> groups() const {
    std::vector<Communicator*> out{comm.get()};
    if (replicate) out.push_back(replicate.get());
    return out;
  }
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

  // ---- buffers of the reduce-scatter (zero_reduce.cpp)
  at::Tensor new_scratch(const Bucket& bk);
  void free_scratch(Bucket& bk);

  // ---- layout (zero_layout.cpp)
  void plan_buckets();
  std::vector<std::vector<size_t>> wrapped_unit_params(const std::unordered_map<const void*, size_t>& index,
                                                       bool* has_root);
  void plan_units(const std::vector<std::vector<size_t>>& units);
  void size_bucket(Bucket& bk, const std::vector<at::Tensor>& ts, std::vector<int64_t>& offsets) const;
  void layout_frozen(const at::TensorOptions& o);
  at::Tensor initial_values(const Bucket& bk, const at::TensorOptions& o) const;
  void build_layout();
  void build_optimizer();
  LayerwiseLayout layerwise_layout(CommPtr tp, std::vector<bool> tp_sharded) const;
  std::vector<std::tuple<size_t, int64_t, int64_t>> owned_pieces(const Bucket& bk) const;

  // ---- stage 3: gathering units (zero_gather.cpp)
  Bucket* trained_bucket(int u) { return unit_bucket[u] < 0 ? nullptr : &buckets[unit_bucket[u]]; }
  Bucket* frozen_bucket(int u) { return unit_frozen[u] < 0 ? nullptr : &frozen_buckets[unit_frozen[u]]; }
  void gather_unit(int u);
  void prefetch_unit(int u);
  void release_unit(int u);
  at::Tensor run_unit(int u, torch::nn::AnyModule& inner, const at::Tensor& x);
  void start_gather(Bucket& bk);
  void ensure_gathered(Bucket& bk);
  void release(Bucket& bk);
  void release_all();
  at::Tensor forward(const at::Tensor& input, int64_t first, int64_t end);
  void pre_backward(int u, int lo);

  // ---- per step, from the autograd hooks (zero_reduce.cpp)
  void arm_final_callback();
  void on_grad_ready(size_t i);
  void take_gradient(size_t i);
  void launch_ready();
  void wait_oldest();
  void launch(size_t b);
  void finalize();

  // ---- the optimizer step (zero_step.cpp)
  void link_master_grads();
  void average_over_replicas();  // hybrid sharding: each owned gradient chunk over the groups
  static void wait_all(std::vector<WorkPtr>& works);
  void drop_master_grads();
  bool step(double given_norm);
  double global_squares();
  void publish_shards();
};

}  // namespace tandem
