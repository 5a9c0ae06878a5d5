// The MPI backend's shared-memory path (all ranks on one node): symmetric tensors in MPI-3
// shared windows, and the all-reduce, reduce-scatter and all-gather that read the peers' memory.
#include <mpi.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/backends.h"
#include "comm/mpi/mpi_communicator.h"
#include "tandem/comm.h"

namespace tandem {
namespace detail {

namespace {

// The reduction of one rank's segment of a shared-memory all-reduce: sums the segment
// [lo, hi) of every rank's buffer (in rank order, so every rank of the job would get the same
// bits) and writes the result into every rank's buffer, or only to `dst` (element lo there)
// for a reduce-scatter. Blocks of 4096 elements stay in L1.
template <typename T>
void shm_reduce_segment(const std::vector<char*>& peers, size_t off, int64_t lo, int64_t hi, bool avg,
                        T* dst = nullptr) {
  constexpr int64_t kBlock = 4096;
  const int n = static_cast<int>(peers.size());
  alignas(64) T acc[kBlock];
  for (int64_t s = lo; s < hi; s += kBlock) {
    const int64_t m = std::min(kBlock, hi - s);
    std::memcpy(acc, reinterpret_cast<const T*>(peers[0] + off) + s, static_cast<size_t>(m) * sizeof(T));
    for (int q = 1; q < n; ++q) {
      const T* __restrict src = reinterpret_cast<const T*>(peers[q] + off) + s;
      for (int64_t i = 0; i < m; ++i) acc[i] += src[i];
    }
    if (avg) {
      const T div = static_cast<T>(n);
      for (int64_t i = 0; i < m; ++i) acc[i] /= div;
    }
    if (dst) {
      std::memcpy(dst + (s - lo), acc, static_cast<size_t>(m) * sizeof(T));
      continue;
    }
    for (int q = 0; q < n; ++q) {
      std::memcpy(reinterpret_cast<T*>(peers[q] + off) + s, acc, static_cast<size_t>(m) * sizeof(T));
    }
  }
}

}  // namespace

// See detail::symmetric_empty. An undefined tensor when the fast path does not apply.
at::Tensor MpiCommunicator::symmetric_empty(int64_t numel, const at::TensorOptions& o) {
  const auto st = o.dtype().toScalarType();
  if (numel <= 0 || !o.device().is_cpu() || (st != at::kFloat && st != at::kDouble) || size_ < 2 ||
      shm_state_.load() < 0) {
    return {};
  }
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(st));
  auto what = "rank " + std::to_string(rank_) + ": shared-memory allocation of " + std::to_string(bytes) + " bytes";
  auto got = std::make_shared<std::shared_ptr<ShmWindow>>();
  auto w = enqueue(
      "shm_alloc", what, 0,
      [=](std::vector<MPI_Request>& r) {
        r.clear();
        *got = shm_alloc(bytes, what);
      },
      [] {});
  w->wait();
  std::shared_ptr<ShmWindow> win = *got;
  if (!win) return {};
  return at::from_blob(
      win->base, {numel}, [win](void*) { win->in_use.store(false); }, o);
}

// ---- shared-memory all-reduce (all ranks on one node; TANDEM_MPI_SHM=0 turns it off)
// Tensors from symmetric_empty live in MPI-3 shared-memory windows that every rank maps. An
// all-reduce of such a tensor is: barrier (every rank's data is in place), each rank sums its
// 1/n of the elements straight from the n buffers and writes the result into all n, barrier.
// Each byte is read and written about twice instead of being copied in and out of MPI's
// shared-memory fifos at every step of the algorithm (no CMA single-copy in containers).
std::shared_ptr<ShmWindow> MpiCommunicator::shm_alloc(int64_t bytes, const std::string& what) {
  if (shm_state_.load() == 0) {
    MPI_Comm node = MPI_COMM_NULL;
    check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node), what);
    int node_size = 0;
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    shm_state_.store(node_size == size_ ? 1 : -1);  // the same answer on every rank
  }
  if (shm_state_.load() < 0) return nullptr;
  // A released window of the job's choosing, if every rank picks the same one.
  int64_t cand = -1;
  {
    std::lock_guard<std::mutex> lk(shm_mu_);
    for (size_t i = 0; i < windows_.size(); ++i) {
      const auto& w = windows_[i];
      if (!w->in_use.load() && w->bytes >= bytes && (cand < 0 || w->bytes < windows_[cand]->bytes)) {
        cand = static_cast<int64_t>(i);
      }
    }
  }
  int64_t mine[4] = {bytes, -bytes, cand, -cand}, all[4];
  check(MPI_Allreduce(mine, all, 4, MPI_INT64_T, MPI_MAX, comm_), what);
  if (all[0] != -all[1]) {
    throw CommError(what + ": the ranks asked for different sizes (" + std::to_string(-all[1]) + " to " +
                    std::to_string(all[0]) +
                    " bytes); symmetric allocations must be made by every rank in the "
                    "same order with the same size");
  }
  if (cand >= 0 && all[2] == -all[3]) {
    std::lock_guard<std::mutex> lk(shm_mu_);
    windows_[cand]->in_use.store(true);
    return windows_[cand];
  }
  auto w = std::make_shared<ShmWindow>();
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* base = nullptr;
  const int64_t padded = (bytes + 63) / 64 * 64;
  int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(padded), 1, info, comm_, &base, &w->win);
  MPI_Info_free(&info);
  check(rc, what);
  check(MPI_Win_lock_all(MPI_MODE_NOCHECK, w->win), what);
  w->base = static_cast<char*>(base);
  w->bytes = bytes;
  w->peers.resize(static_cast<size_t>(size_));
  for (int q = 0; q < size_; ++q) {
    MPI_Aint size = 0;
    int disp = 0;
    void* p = nullptr;
    check(MPI_Win_shared_query(w->win, q, &size, &disp, &p), what);
    w->peers[static_cast<size_t>(q)] = static_cast<char*>(p);
  }
  std::lock_guard<std::mutex> lk(shm_mu_);
  windows_.push_back(w);
  return w;
}

// The window holding all of `t` when the shared-memory all-reduce applies to it.
std::shared_ptr<ShmWindow> MpiCommunicator::find_window(const at::Tensor& t, ReduceOp op) {
  if (shm_state_.load() <= 0 || op == ReduceOp::kMax || !t.is_contiguous() ||
      (t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble) || t.numel() == 0) {
    return nullptr;
  }
  const char* p = static_cast<const char*>(t.data_ptr());
  const int64_t n = t.numel() * t.element_size();
  std::lock_guard<std::mutex> lk(shm_mu_);
  for (auto& w : windows_) {
    if (w->in_use.load() && p >= w->base && p + n <= w->base + w->bytes) return w;
  }
  return nullptr;
}

void MpiCommunicator::shm_allreduce(const ShmWindow& w, size_t off, int64_t numel, at::ScalarType st, bool avg,
                                    const std::string& what) {
  check(MPI_Win_sync(w.win), what);
  check(MPI_Barrier(comm_), what);  // every rank's contribution is in its window
  const int64_t per = (numel + size_ - 1) / size_;
  const int64_t lo = std::min<int64_t>(numel, per * rank_), hi = std::min<int64_t>(numel, lo + per);
  if (st == at::kFloat) {
    shm_reduce_segment<float>(w.peers, off, lo, hi, avg);
  } else {
    shm_reduce_segment<double>(w.peers, off, lo, hi, avg);
  }
  check(MPI_Win_sync(w.win), what);
  check(MPI_Barrier(comm_), what);  // every segment is written everywhere
}

// Reduce-scatter of `chunk` elements per rank from the symmetric buffers at `off` into dst.
// dst may be this rank's own chunk of its input: nobody else reads that chunk of this rank.
void MpiCommunicator::shm_reduce_scatter(const ShmWindow& w, size_t off, int64_t chunk, at::ScalarType st, bool avg,
                                         void* dst, const std::string& what) {
  check(MPI_Win_sync(w.win), what);
  check(MPI_Barrier(comm_), what);  // every rank's input is in its window
  const int64_t lo = chunk * rank_, hi = lo + chunk;
  if (st == at::kFloat) {
    shm_reduce_segment<float>(w.peers, off, lo, hi, avg, static_cast<float*>(dst));
  } else {
    shm_reduce_segment<double>(w.peers, off, lo, hi, avg, static_cast<double*>(dst));
  }
  check(MPI_Win_sync(w.win), what);
  check(MPI_Barrier(comm_), what);  // nobody changes its input before everyone has read it
}

// All-gather of `bytes` per rank into the symmetric buffers at `off`; src: this rank's part
// when it is not already in place.
void MpiCommunicator::shm_allgather(const ShmWindow& w, size_t off, int64_t bytes, const void* src,
                                    const std::string& what) {
  char* mine = w.peers[static_cast<size_t>(rank_)] + off;
  if (src) std::memcpy(mine + rank_ * bytes, src, static_cast<size_t>(bytes));
  check(MPI_Win_sync(w.win), what);
  check(MPI_Barrier(comm_), what);  // every rank's part is in place
  for (int q = 0; q < size_; ++q) {
    if (q != rank_)
      std::memcpy(mine + q * bytes, w.peers[static_cast<size_t>(q)] + off + q * bytes, static_cast<size_t>(bytes));
  }
  check(MPI_Win_sync(w.win), what);
  check(MPI_Barrier(comm_), what);  // nobody overwrites its part before everyone has copied it
}

at::Tensor mpi_symmetric_empty(Communicator& comm, int64_t numel, const at::TensorOptions& opts) {
  auto* mpi = dynamic_cast<MpiCommunicator*>(&comm);
  return mpi ? mpi->symmetric_empty(numel, opts) : at::Tensor();
}

}  // namespace detail
}  // namespace tandem
