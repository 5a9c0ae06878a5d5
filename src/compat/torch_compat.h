// The one place for LibTorch API that differs between versions. Everything else in Tandem
// calls these wrappers instead of the version-specific API. Keep it small.
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/version.h>

#ifdef TANDEM_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#define TANDEM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace tandem::compat {

// ---- autocast (mixed precision in forward) ----
// The device-typed API (set_autocast_enabled(kCUDA, ...)) appeared in LibTorch 2.4; before it
// there were per-device functions (set_enabled, set_autocast_gpu_dtype, ...).
inline bool autocast_enabled(at::DeviceType dev) {
#if TANDEM_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(dev);
#else
  return dev == at::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}
inline at::ScalarType autocast_dtype(at::DeviceType dev) {
#if TANDEM_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(dev);
#else
  return dev == at::kCUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
#endif
}
inline void set_autocast(at::DeviceType dev, bool enabled, at::ScalarType dtype) {
#if TANDEM_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(dev, enabled);
  at::autocast::set_autocast_dtype(dev, dtype);
#else
  if (dev == at::kCUDA) {
    at::autocast::set_enabled(enabled);
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_cpu_enabled(enabled);
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
#endif
}

// Python's `with torch.autocast(device_type, dtype):` for C++: ops in scope run in `dtype`
// where autocast's op lists say so; the cache of casted weights is dropped when the
// outermost scope ends (as Python does). Construct on the thread that runs forward.
class AutocastScope {
 public:
  AutocastScope(at::DeviceType dev, at::ScalarType dtype, bool enabled = true)
      : dev_(dev), prev_enabled_(autocast_enabled(dev)), prev_dtype_(autocast_dtype(dev)) {
    set_autocast(dev_, enabled, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    set_autocast(dev_, prev_enabled_, prev_dtype_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  at::DeviceType dev_;
  bool prev_enabled_;
  at::ScalarType prev_dtype_;
};

#ifdef TANDEM_WITH_CUDA
// Tell the caching allocator that `t`'s memory is in use by work on `stream`, so that it is
// not handed out again before that work completes (Python: tensor.record_stream(stream)).
// Harmless for memory the caching allocator does not own (e.g. from_blob).
inline void record_stream(const at::Tensor& t, const c10::cuda::CUDAStream& stream) {
  if (!t.defined() || !t.is_cuda() || !t.has_storage()) return;
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
}

// Peak bytes held by tensors on `device` since the last reset (Python:
// torch.cuda.max_memory_allocated). The stats type moved between namespaces across versions.
inline int64_t cuda_peak_allocated_bytes(c10::DeviceIndex device) {
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  return stats.allocated_bytes[0].peak;  // index 0: StatType::AGGREGATE
}
inline void reset_cuda_peak_stats(c10::DeviceIndex device) { c10::cuda::CUDACachingAllocator::resetPeakStats(device); }
// Bytes held by tensors on `device` now (Python: torch.cuda.memory_allocated).
inline int64_t cuda_allocated_bytes(c10::DeviceIndex device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device).allocated_bytes[0].current;
}
#endif

// ---- storage that outlives its memory (ZeRO-3 / FSDP's "free the unsharded parameter") ----
// Releases the memory behind `t`'s storage while every view of it (parameters, tensors that
// autograd saved) keeps pointing at the same StorageImpl; alloc_storage gives it fresh memory
// of `nbytes` again (contents undefined). Python's FSDP does the same with storage.resize_(0).
inline void free_storage(const at::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}
inline void alloc_storage(const at::Tensor& t, size_t nbytes) {
  auto* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == nbytes) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}
// Points the storage at `data` inside `owner`'s memory (a pool) and keeps `owner` alive until
// the storage lets go of it (free_storage, another placement, or its end).
inline void place_storage(const at::Tensor& t, void* data, size_t nbytes, const at::Tensor& owner) {
  auto* s = t.storage().unsafeGetStorageImpl();
  auto* keep = new at::Tensor(owner);
  s->set_data_ptr_noswap(at::DataPtr(
      data, keep, [](void* k) { delete static_cast<at::Tensor*>(k); }, t.device()));
  s->set_nbytes(nbytes);
}
inline bool storage_allocated(const at::Tensor& t) { return t.storage().nbytes() > 0; }

// ---- one block of attention with its log-sum-exp (ring attention, tandem/context_parallel.h) ----
// On the CPU the flash kernel returns the block's log-sum-exp ([B, H, L], float32, or float64
// for float64 inputs), and its backward takes the output and log-sum-exp of the whole row, so a
// block's gradients come out of the fused kernel without materialising its scores. Other
// devices: false, and the caller computes the block itself.
inline bool has_fused_block_attention(const at::Tensor& q) { return q.device().is_cpu(); }
inline std::tuple<at::Tensor, at::Tensor> block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          bool causal, double scale) {
  return at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, {}, scale);
}
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> block_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, double scale) {
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal, {}, scale);
}

}  // namespace tandem::compat
