// SymmetricPool: the block of symmetric memory from which ZeroDataParallel carves its per-step
// buffers, and the byte count of a tensor that it and ZeRO's accounting share. Private to
// src/strategy/zero/.
#pragma once

#include <ATen/ATen.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>

#include "tandem/comm.h"

namespace tandem {
namespace detail {

inline int64_t nbytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

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

}  // namespace detail
}  // namespace tandem
