// Gradient accumulation without communication, shared by DistributedDataParallel and
// ZeroDataParallel (stage 1): while a NoSyncGuard lives, backward passes only accumulate local
// gradients; the first backward after it ends reduces everything accumulated. Obtained from
// their no_sync(), like PyTorch's DistributedDataParallel.no_sync() context manager.
#pragma once

namespace tandem {

class NoSyncGuard {
 public:
  // Sets *flag (owned by the wrapper, which must outlive the guard) until destruction.
  explicit NoSyncGuard(bool* flag) : flag_(flag) { *flag_ = true; }
  ~NoSyncGuard() {
    if (flag_) *flag_ = false;
  }
  NoSyncGuard(NoSyncGuard&& other) noexcept : flag_(other.flag_) { other.flag_ = nullptr; }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;

 private:
  bool* flag_;
};

}  // namespace tandem
