// MpiCommunicator's definition, shared by the files of the MPI backend: mpi_communicator.cpp
// (lifetime, split, argument checks), mpi_operations.cpp, mpi_progress.cpp and mpi_shm.cpp.
// Private to src/comm/mpi/.
//
// MPI backend (CPU tensors). Each communicator owns one progress thread: OpenMPI advances
// operations only inside MPI calls, so without it a bucket "started" during backward would not
// move until wait() (docs/ARCHITECTURE.md). The thread runs collectives as OpenMPI's tuned
// blocking calls, one at a time in issue order, and point-to-point operations as non-blocking
// ones that it drives with MPI_Test (and that progress inside the blocking calls too), so that
// pipelines can post sends and receives in any order. Callers block on a condition variable
// with a timeout, never inside MPI.
#pragma once

#include <mpi.h>

#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tandem/comm.h"

namespace tandem {
namespace detail {

inline std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, len);
}

// An operation queued for the progress thread (mpi_progress.cpp).
struct PendingOp;

// An MPI-3 shared-memory window that backs one symmetric tensor (see symmetric_empty).
struct ShmWindow {
  MPI_Win win = MPI_WIN_NULL;
  char* base = nullptr;
  int64_t bytes = 0;
  std::vector<char*> peers;  // every rank's segment, mapped into this process
  std::atomic<bool> in_use{true};
};

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, const CommOptions& opts);
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  // ---- collectives and point-to-point (mpi_operations.cpp)
  WorkPtr allreduce_async(at::Tensor t, ReduceOp op) override;
  WorkPtr reduce_scatter_async(at::Tensor out, at::Tensor in, ReduceOp op) override;
  WorkPtr allgather_async(at::Tensor out, at::Tensor in) override;
  WorkPtr broadcast_async(at::Tensor t, int root) override;
  WorkPtr send_async(at::Tensor t, int dst, int tag) override;
  WorkPtr recv_async(at::Tensor t, int src, int tag) override;
  WorkPtr barrier_async() override;
  WorkPtr alltoall_async(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits,
                         std::vector<int64_t> in_splits) override;

  CommPtr split(int color, int key) override;  // mpi_communicator.cpp

  at::Tensor symmetric_empty(int64_t numel, const at::TensorOptions& o);  // mpi_shm.cpp

 private:
  // ---- collective-mismatch guard and argument checks (mpi_communicator.cpp)
  enum : int64_t { kOpAllreduce = 1, kOpReduceScatter, kOpAllgather, kOpBroadcast, kOpBarrier, kOpSplit, kOpAlltoall };
  static std::string describe_fingerprint(const int64_t* f);
  void verify(int64_t op, int64_t extra, const at::Tensor* t, const std::string& what);

  static void check(int rc, const std::string& what) {
    if (rc != MPI_SUCCESS) throw CommError(what + " failed in MPI: " + mpi_error_string(rc));
  }
  void check_cpu(const at::Tensor& t, const std::string& what) const;
  void check_pair(const at::Tensor& out, const at::Tensor& in, const std::string& what) const;
  bool is_own_chunk(const at::Tensor& chunk, const at::Tensor& whole) const;
  void check_peer(int peer, const std::string& what) const;

  // ---- the progress thread (mpi_progress.cpp)
  WorkPtr enqueue(const char* name, const std::string& what, int64_t bytes,
                  std::function<void(std::vector<MPI_Request>&)> start, std::function<void()> finish,
                  std::function<void()> blocking = nullptr);
  void complete(PendingOp& op, bool run_blocking);
  void abandon(std::vector<std::shared_ptr<PendingOp>>& inflight);
  void loop();

  // ---- shared-memory collectives (mpi_shm.cpp)
  std::shared_ptr<ShmWindow> shm_alloc(int64_t bytes, const std::string& what);
  std::shared_ptr<ShmWindow> find_window(const at::Tensor& t, ReduceOp op);
  void shm_allreduce(const ShmWindow& w, size_t off, int64_t numel, at::ScalarType st, bool avg,
                     const std::string& what);
  void shm_reduce_scatter(const ShmWindow& w, size_t off, int64_t chunk, at::ScalarType st, bool avg, void* dst,
                          const std::string& what);
  void shm_allgather(const ShmWindow& w, size_t off, int64_t bytes, const void* src, const std::string& what);

  std::atomic<int> shm_state_{0};  // 0: not yet known, 1: all ranks on one node, -1: off
  std::mutex shm_mu_;
  std::vector<std::shared_ptr<ShmWindow>> windows_;  // never freed: MPI_Win_free is collective

  MPI_Comm comm_;
  MPI_Comm check_comm_ = MPI_COMM_NULL;  // TANDEM_CHECK_COLLECTIVES=1: fingerprints go here
  int64_t check_seq_ = 0;
  int rank_ = 0, size_ = 1;
  int poll_us_ = 0;
  // While an operation has not moved for 16 polls (and poll_us_ does not apply): sleep this long
  // between polls instead of yielding (CommOptions::wait_sleep_us; 0: yield). On more ranks
  // than cores a yielding poller keeps taking slices of a core that a computing rank wants:
  // measured on 4 ranks over 2 cores (docs/BENCHMARKS.md, "Model parallelism"), the MLP's tp2pp2
  // step ran 28.9-29.4 ms with yield and 18.6-21.6 ms with 50 us sleeps. A message that lands
  // during a sleep is seen up to ~100 us late (timer slack), so it is off where cores suffice.
  int wait_sleep_us_ = 0;
  // Collectives as blocking MPI calls on the progress thread (OpenMPI's tuned algorithms)
  // instead of non-blocking ones (libnbc), which measured 0.70-0.74x their bandwidth from 1 MiB
  // up (docs/BENCHMARKS.md); TANDEM_MPI_COLLECTIVES=blocking|nonblocking.
  bool blocking_collectives_ = true;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<PendingOp>> queue_;
  bool stop_ = false;
  std::atomic<int> waiters_{0};
  std::atomic<bool> broken_{false};  // an operation failed or a wait timed out
  bool abandoned_ = false;           // the progress thread left requests pending (see loop())
};

}  // namespace detail
}  // namespace tandem
