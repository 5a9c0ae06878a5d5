// MPI backend (CPU tensors). Each communicator owns one progress thread: OpenMPI advances
// operations only inside MPI calls, so without it a bucket "started" during backward would not
// move until wait() (docs/ARCHITECTURE.md). The thread runs collectives as OpenMPI's tuned
// blocking calls, one at a time in issue order, and point-to-point operations as non-blocking
// ones that it drives with MPI_Test (and that progress inside the blocking calls too), so that
// pipelines can post sends and receives in any order. Callers block on a condition variable
// with a timeout, never inside MPI.
#include <mpi.h>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "comm/backends.h"
#include "tandem/comm.h"
#include "tandem/trace.h"

namespace tandem {

bool has_mpi_backend() { return true; }

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, len);
}

// ---- reductions MPI lacks: bfloat16 and float16, carried as 16-bit words
template <typename T>
void sum_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}
template <typename T>
void max_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    if (x > y || x != x) b[i] = a[i];
  }
}

struct HalfOps {
  MPI_Op bf16_sum, bf16_max, f16_sum, f16_max;
};
const HalfOps& half_ops() {
  static HalfOps ops = [] {
    HalfOps o{};
    MPI_Op_create(&sum_fn<c10::BFloat16>, 1, &o.bf16_sum);
    MPI_Op_create(&max_fn<c10::BFloat16>, 1, &o.bf16_max);
    MPI_Op_create(&sum_fn<c10::Half>, 1, &o.f16_sum);
    MPI_Op_create(&max_fn<c10::Half>, 1, &o.f16_max);
    return o;
  }();
  return ops;
}

MPI_Datatype mpi_type(at::ScalarType t, const std::string& where) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kChar: return MPI_INT8_T;
    case at::kBool: return MPI_C_BOOL;
    case at::kBFloat16:
    case at::kHalf: return MPI_UINT16_T;
    default:
      throw CommError(where + ": dtype " + c10::toString(t) +
                      " is not supported by the MPI backend (use float32, float64, bfloat16, float16, "
                      "int64, int32, int8 or uint8)");
  }
}

MPI_Op mpi_op(ReduceOp op, at::ScalarType t, const std::string& where) {
  if (t == at::kBFloat16) return op == ReduceOp::kMax ? half_ops().bf16_max : half_ops().bf16_sum;
  if (t == at::kHalf) return op == ReduceOp::kMax ? half_ops().f16_max : half_ops().f16_sum;
  if (t == at::kBool) {
    if (op == ReduceOp::kAvg) throw CommError(where + ": avg of a bool tensor is undefined");
    return op == ReduceOp::kMax ? MPI_LOR : MPI_LOR;
  }
  if (op == ReduceOp::kAvg && !at::isFloatingType(t)) {
    throw CommError(where + ": avg needs a floating-point tensor; use sum on " + c10::toString(t));
  }
  return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
}

int checked_count(int64_t n, const std::string& where) {
  if (n > INT_MAX) {
    throw CommError(where + ": " + std::to_string(n) + " elements exceed MPI's int count; split the tensor");
  }
  return static_cast<int>(n);
}

class MpiWork : public Work {
 public:
  MpiWork(std::string what, std::chrono::milliseconds timeout) : what_(std::move(what)), timeout_(timeout) {}

  void wait() override {
    std::unique_lock<std::mutex> lk(mu_);
    if (!done_) {
      trace::Span span("wait", "wait");
      waiters_->fetch_add(1);
      bool ok = cv_.wait_for(lk, timeout_, [&] { return done_; });
      waiters_->fetch_sub(1);
      if (!ok) {
        broken_->store(true);
        std::ostringstream os;
        os << what_ << " timed out after " << std::chrono::duration<double>(timeout_).count()
           << " s; is every rank alive and calling the same operations in the same order?";
        throw CommTimeout(os.str());
      }
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lk(mu_);
    return done_;
  }
  double seconds() const override { return seconds_; }

  void finish(double secs, std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      seconds_ = secs;
      error_ = std::move(e);
      done_ = true;
    }
    cv_.notify_all();
  }

  std::atomic<int>* waiters_ = nullptr;  // the owner's count of blocked callers
  std::atomic<bool>* broken_ = nullptr;  // the owner's flag: an operation failed or timed out
  const std::string what_;

 private:
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  double seconds_ = 0.0;
  std::exception_ptr error_;
};

struct PendingOp {
  std::string name;
  std::shared_ptr<MpiWork> work;
  std::function<void(std::vector<MPI_Request>&)> start;  // issues the non-blocking calls
  std::function<void()> finish;                          // after completion: copy back, scale
  std::function<void()> blocking;                        // the same as one blocking MPI call (collectives)
  std::vector<MPI_Request> reqs;
  Clock::time_point started;
  int64_t bytes = 0;
};

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
  MpiCommunicator(MPI_Comm comm, const CommOptions& opts) : Communicator(opts), comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    if (const char* p = std::getenv("TANDEM_MPI_POLL_US")) poll_us_ = std::atoi(p);
    wait_sleep_us_ = std::max(0, opts.wait_sleep_us);
    if (const char* p = std::getenv("TANDEM_MPI_WAIT_SLEEP_US")) wait_sleep_us_ = std::max(0, std::atoi(p));
    if (const char* m = std::getenv("TANDEM_MPI_COLLECTIVES")) blocking_collectives_ = std::string(m) != "nonblocking";
    if (const char* m = std::getenv("TANDEM_MPI_SHM"); m && std::string(m) == "0") shm_state_ = -1;
    if (const char* c = std::getenv("TANDEM_CHECK_COLLECTIVES"); c && std::string(c) == "1") {
      MPI_Comm_dup(comm_, &check_comm_);  // collective: every rank constructs it together
    }
    thread_ = std::thread([this] { loop(); });
  }

  // Waits for the operations still in flight (an isend whose peer has not received yet is
  // normal at the end of a schedule): the progress thread drains them and ends, bounded by the
  // timeout, at once where an operation already failed (see loop()). Requests it abandoned keep
  // the communicator from being freed.
  ~MpiCommunicator() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || abandoned_) return;
    if (comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    if (check_comm_ != MPI_COMM_NULL) MPI_Comm_free(&check_comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  WorkPtr allreduce_async(at::Tensor t, ReduceOp op) override {
    auto what = describe(rank_, std::string("allreduce(") + to_string(op) + ")", t);
    check_cpu(t, what);
    verify(kOpAllreduce, static_cast<int64_t>(op), &t, what);
    auto type = mpi_type(t.scalar_type(), what);
    auto mop = mpi_op(op, t.scalar_type(), what);
    int count = checked_count(t.numel(), what);
    at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
    int n = size_;
    if (auto shm = find_window(buf, op)) {
      const size_t off = static_cast<size_t>(static_cast<char*>(buf.data_ptr()) - shm->base);
      const auto st = buf.scalar_type();
      const int64_t numel = buf.numel();
      auto run = [=] { shm_allreduce(*shm, off, numel, st, op == ReduceOp::kAvg, what); };
      return enqueue(
          "allreduce", what, t.numel() * t.element_size(),
          [=](std::vector<MPI_Request>& r) {
            r.clear();
            run();
          },
          [] {}, run);
    }
    // fp16 averages divide first: the sum of n gradients near fp16's largest value (a loss
    // scale just under overflow) would overflow where their mean does not, and skip a step that
    // one process takes.
    const bool pre = op == ReduceOp::kAvg && t.scalar_type() == at::kHalf;
    return enqueue(
        "allreduce", what, t.numel() * t.element_size(),
        [=](std::vector<MPI_Request>& r) {
          r.resize(1);
          if (pre) buf.div_(n);
          check(MPI_Iallreduce(MPI_IN_PLACE, buf.data_ptr(), count, type, mop, comm_, &r[0]), what);
        },
        [=]() mutable {
          if (op == ReduceOp::kAvg && !pre) buf.div_(n);
          if (!buf.is_same(t)) t.copy_(buf);
        },
        [=] {
          if (pre) buf.div_(n);
          check(MPI_Allreduce(MPI_IN_PLACE, buf.data_ptr(), count, type, mop, comm_), what);
        });
  }

  WorkPtr reduce_scatter_async(at::Tensor out, at::Tensor in, ReduceOp op) override {
    auto what = describe(rank_, std::string("reduce_scatter(") + to_string(op) + ")", in);
    check_cpu(in, what);
    verify(kOpReduceScatter, static_cast<int64_t>(op), &in, what);
    check_pair(out, in, what);
    if (in.numel() != out.numel() * size_) {
      throw CommError(what + ": input has " + std::to_string(in.numel()) + " elements, expected world size " +
                      std::to_string(size_) + " x output's " + std::to_string(out.numel()));
    }
    auto type = mpi_type(in.scalar_type(), what);
    auto mop = mpi_op(op, in.scalar_type(), what);
    int count = checked_count(out.numel(), what);
    checked_count(in.numel(), what);
    int n = size_;
    if (auto shm = find_window(in, op)) {
      // Shared memory: each rank sums its chunk straight from the n input buffers.
      const size_t off = static_cast<size_t>(static_cast<char*>(in.data_ptr()) - shm->base);
      const auto st = in.scalar_type();
      const int64_t chunk = out.numel();
      at::Tensor dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
      auto run = [=] { shm_reduce_scatter(*shm, off, chunk, st, op == ReduceOp::kAvg, dst.data_ptr(), what); };
      return enqueue(
          "reduce_scatter", what, in.numel() * in.element_size(),
          [=](std::vector<MPI_Request>& r) {
            r.clear();
            run();
          },
          [=]() mutable {
            if (!dst.is_same(out)) out.copy_(dst);
          },
          run);
    }
    const bool pre = op == ReduceOp::kAvg && in.scalar_type() == at::kHalf;  // as allreduce
    if (is_own_chunk(out, in)) {
      // In place: MPI_IN_PLACE takes the input from the receive buffer and leaves the result
      // at its start; move it to this rank's chunk.
      const int64_t bytes = out.numel() * out.element_size();
      const int me = rank_;
      return enqueue(
          "reduce_scatter", what, in.numel() * in.element_size(),
          [=](std::vector<MPI_Request>& r) {
            r.resize(1);
            if (pre) in.div_(n);
            check(MPI_Ireduce_scatter_block(MPI_IN_PLACE, in.data_ptr(), count, type, mop, comm_, &r[0]), what);
          },
          [=]() mutable {
            if (me != 0) std::memcpy(out.data_ptr(), in.data_ptr(), bytes);
            if (op == ReduceOp::kAvg && !pre) out.div_(n);
          },
          [=] {
            if (pre) in.div_(n);
            check(MPI_Reduce_scatter_block(MPI_IN_PLACE, in.data_ptr(), count, type, mop, comm_), what);
          });
    }
    // Not in place: the input is the caller's, so a divided fp16 input is a copy.
    at::Tensor src = pre ? in.div(n).contiguous() : in.contiguous();
    at::Tensor dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
    return enqueue(
        "reduce_scatter", what, in.numel() * in.element_size(),
        [=](std::vector<MPI_Request>& r) {
          r.resize(1);
          check(MPI_Ireduce_scatter_block(src.data_ptr(), dst.data_ptr(), count, type, mop, comm_, &r[0]), what);
        },
        [=]() mutable {
          if (op == ReduceOp::kAvg && !pre) dst.div_(n);
          if (!dst.is_same(out)) out.copy_(dst);
        },
        [=] { check(MPI_Reduce_scatter_block(src.data_ptr(), dst.data_ptr(), count, type, mop, comm_), what); });
  }

  WorkPtr allgather_async(at::Tensor out, at::Tensor in) override {
    auto what = describe(rank_, "allgather", in);
    check_cpu(in, what);
    verify(kOpAllgather, 0, &in, what);
    check_pair(out, in, what);
    if (out.numel() != in.numel() * size_) {
      throw CommError(what + ": output has " + std::to_string(out.numel()) + " elements, expected world size " +
                      std::to_string(size_) + " x input's " + std::to_string(in.numel()));
    }
    auto type = mpi_type(in.scalar_type(), what);
    int count = checked_count(in.numel(), what);
    checked_count(out.numel(), what);
    if (auto shm = find_window(out, ReduceOp::kSum)) {
      // Shared memory: each rank copies the others' chunks straight from their output buffers.
      const size_t off = static_cast<size_t>(static_cast<char*>(out.data_ptr()) - shm->base);
      const int64_t bytes = in.numel() * in.element_size();
      at::Tensor src = is_own_chunk(in, out) ? at::Tensor() : in.contiguous();
      auto run = [=] { shm_allgather(*shm, off, bytes, src.defined() ? src.data_ptr() : nullptr, what); };
      return enqueue(
          "allgather", what, bytes,
          [=](std::vector<MPI_Request>& r) {
            r.clear();
            run();
          },
          [] {}, run);
    }
    if (is_own_chunk(in, out)) {
      // In place: this rank's contribution already sits where it will be received.
      return enqueue(
          "allgather", what, in.numel() * in.element_size(),
          [=](std::vector<MPI_Request>& r) {
            r.resize(1);
            check(MPI_Iallgather(MPI_IN_PLACE, 0, type, out.data_ptr(), count, type, comm_, &r[0]), what);
          },
          [] {}, [=] { check(MPI_Allgather(MPI_IN_PLACE, 0, type, out.data_ptr(), count, type, comm_), what); });
    }
    at::Tensor src = in.contiguous();
    at::Tensor dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
    return enqueue(
        "allgather", what, in.numel() * in.element_size(),
        [=](std::vector<MPI_Request>& r) {
          r.resize(1);
          check(MPI_Iallgather(src.data_ptr(), count, type, dst.data_ptr(), count, type, comm_, &r[0]), what);
        },
        [=]() mutable {
          if (!dst.is_same(out)) out.copy_(dst);
        },
        [=] { check(MPI_Allgather(src.data_ptr(), count, type, dst.data_ptr(), count, type, comm_), what); });
  }

  WorkPtr broadcast_async(at::Tensor t, int root) override {
    auto what = describe(rank_, "broadcast(root " + std::to_string(root) + ")", t);
    check_cpu(t, what);
    check_peer(root, what);
    verify(kOpBroadcast, root, &t, what);
    auto type = mpi_type(t.scalar_type(), what);
    int count = checked_count(t.numel(), what);
    at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
    return enqueue(
        "broadcast", what, t.numel() * t.element_size(),
        [=](std::vector<MPI_Request>& r) {
          r.resize(1);
          check(MPI_Ibcast(buf.data_ptr(), count, type, root, comm_, &r[0]), what);
        },
        [=]() mutable {
          if (!buf.is_same(t)) t.copy_(buf);
        },
        [=] { check(MPI_Bcast(buf.data_ptr(), count, type, root, comm_), what); });
  }

  WorkPtr send_async(at::Tensor t, int dst, int tag) override {
    auto what = describe(rank_, "send(to " + std::to_string(dst) + ", tag " + std::to_string(tag) + ")", t);
    check_cpu(t, what);
    check_peer(dst, what);
    auto type = mpi_type(t.scalar_type(), what);
    int count = checked_count(t.numel(), what);
    at::Tensor buf = t.contiguous();
    return enqueue(
        "send", what, t.numel() * t.element_size(),
        [=](std::vector<MPI_Request>& r) {
          r.resize(1);
          check(MPI_Isend(buf.data_ptr(), count, type, dst, tag, comm_, &r[0]), what);
        },
        [] {});
  }

  WorkPtr recv_async(at::Tensor t, int src, int tag) override {
    auto what = describe(rank_, "recv(from " + std::to_string(src) + ", tag " + std::to_string(tag) + ")", t);
    check_cpu(t, what);
    check_peer(src, what);
    auto type = mpi_type(t.scalar_type(), what);
    int count = checked_count(t.numel(), what);
    at::Tensor buf = t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous);
    return enqueue(
        "recv", what, t.numel() * t.element_size(),
        [=](std::vector<MPI_Request>& r) {
          r.resize(1);
          check(MPI_Irecv(buf.data_ptr(), count, type, src, tag, comm_, &r[0]), what);
        },
        [=]() mutable {
          if (!buf.is_same(t)) t.copy_(buf);
        });
  }

  WorkPtr barrier_async() override {
    auto what = "rank " + std::to_string(rank_) + ": barrier";
    verify(kOpBarrier, 0, nullptr, what);
    return enqueue(
        "barrier", what, 0,
        [=](std::vector<MPI_Request>& r) {
          r.resize(1);
          check(MPI_Ibarrier(comm_, &r[0]), what);
        },
        [] {}, [=] { check(MPI_Barrier(comm_), what); });
  }

  CommPtr split(int color, int key) override {
    // MPI_Comm_split is blocking; run it on the progress thread so that it is ordered with the
    // operations already queued here.
    auto what = "rank " + std::to_string(rank_) + ": split(color " + std::to_string(color) + ")";
    verify(kOpSplit, 0, nullptr, what);
    auto newcomm = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
    auto w = enqueue(
        "split", what, 0,
        [=](std::vector<MPI_Request>& r) {
          r.clear();
          check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, newcomm.get()), what);
        },
        [] {});
    w->wait();
    if (*newcomm == MPI_COMM_NULL) return nullptr;
    CommOptions o;
    o.timeout = timeout();
    o.wait_sleep_us = wait_sleep_us_;
    return std::make_shared<MpiCommunicator>(*newcomm, o);
  }

  // See detail::symmetric_empty. An undefined tensor when the fast path does not apply.
  at::Tensor symmetric_empty(int64_t numel, const at::TensorOptions& o) {
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

 private:
  // ---- collective-mismatch guard (TANDEM_CHECK_COLLECTIVES=1, a debug option)
  // Before each collective, the ranks all-gather a fingerprint (sequence number, operation,
  // dtype, element count, shape, reduce op or root) on a duplicate of the communicator and
  // compare: a program whose ranks disagree gets a CommError naming the ranks and their
  // operations instead of a hang or a wrong result. Costs one small all-gather per collective.
  enum : int64_t { kOpAllreduce = 1, kOpReduceScatter, kOpAllgather, kOpBroadcast, kOpBarrier, kOpSplit };
  static std::string describe_fingerprint(const int64_t* f) {
    static const char* names[] = {"?", "allreduce", "reduce_scatter", "allgather", "broadcast", "barrier", "split"};
    std::string s = names[(f[1] >= 1 && f[1] <= 6) ? f[1] : 0];
    if (f[1] == kOpAllreduce || f[1] == kOpReduceScatter)
      s += std::string("(") + to_string(static_cast<ReduceOp>(f[5])) + ")";
    if (f[1] == kOpBroadcast) s += "(root " + std::to_string(f[5]) + ")";
    if (f[2] >= 0)
      s += std::string(" of ") + c10::toString(static_cast<at::ScalarType>(f[2])) + " x " + std::to_string(f[3]);
    return s + " (collective #" + std::to_string(f[0]) + ")";
  }
  void verify(int64_t op, int64_t extra, const at::Tensor* t, const std::string& what) {
    if (check_comm_ == MPI_COMM_NULL) return;
    int64_t shape = 1469598103934665603LL;
    if (t)
      for (auto d : t->sizes()) shape = (shape ^ d) * 1099511628211LL;
    int64_t fp[6] = {check_seq_++,  op,   t ? static_cast<int64_t>(t->scalar_type()) : -1, t ? t->numel() : 0,
                     t ? shape : 0, extra};
    std::vector<int64_t> all(6 * static_cast<size_t>(size_));
    MPI_Request req;
    check(MPI_Iallgather(fp, 6, MPI_INT64_T, all.data(), 6, MPI_INT64_T, check_comm_, &req), what);
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    for (int done = 0;;) {
      check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), what);
      if (done) break;
      if (std::chrono::steady_clock::now() > deadline) {
        throw CommTimeout(what + ": collective check: not every rank reached a collective within " +
                          std::to_string(timeout().count()) + " ms (a rank is stuck or no longer issues collectives)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    std::string diff;
    for (int r = 0; r < size_; ++r) {
      if (std::equal(fp, fp + 6, all.data() + 6 * r)) continue;
      diff += "; rank " + std::to_string(r) + " calls " + describe_fingerprint(all.data() + 6 * r);
    }
    if (!diff.empty()) {
      throw CommError(what + ": collective mismatch: rank " + std::to_string(rank_) + " calls " +
                      describe_fingerprint(fp) + diff +
                      ". Every rank must issue the same collectives, with the same shapes, in the same order.");
    }
  }

  static void check(int rc, const std::string& what) {
    if (rc != MPI_SUCCESS) throw CommError(what + " failed in MPI: " + mpi_error_string(rc));
  }
  void check_cpu(const at::Tensor& t, const std::string& what) const {
    if (!t.defined()) throw CommError(what + ": tensor is undefined");
    if (!t.device().is_cpu()) {
      throw CommError(what + ": the MPI backend takes CPU tensors, this one is on " + t.device().str() +
                      "; use the NCCL backend for CUDA tensors");
    }
    if (t.layout() != at::kStrided) {
      std::ostringstream os;
      os << what << ": the MPI backend takes dense (strided) tensors, this one's layout is " << t.layout()
         << "; convert it with to_dense()";
      throw CommError(os.str());
    }
  }
  void check_pair(const at::Tensor& out, const at::Tensor& in, const std::string& what) const {
    if (!out.defined() || !out.device().is_cpu() || out.layout() != at::kStrided ||
        out.scalar_type() != in.scalar_type()) {
      throw CommError(what + ": output must be a dense (strided) CPU tensor of the input's dtype");
    }
  }
  // `chunk` is chunk rank_ of the contiguous `whole` (NCCL's in-place convention).
  bool is_own_chunk(const at::Tensor& chunk, const at::Tensor& whole) const {
    if (!chunk.is_contiguous() || !whole.is_contiguous() || !chunk.is_alias_of(whole)) return false;
    auto* base = static_cast<const char*>(whole.data_ptr());
    return static_cast<const char*>(chunk.data_ptr()) == base + rank_ * chunk.numel() * chunk.element_size();
  }
  void check_peer(int peer, const std::string& what) const {
    if (peer < 0 || peer >= size_) {
      throw CommError(what + ": peer rank " + std::to_string(peer) + " out of range for world size " +
                      std::to_string(size_));
    }
  }

  WorkPtr enqueue(const char* name, const std::string& what, int64_t bytes,
                  std::function<void(std::vector<MPI_Request>&)> start, std::function<void()> finish,
                  std::function<void()> blocking = nullptr) {
    const bool internal = std::strncmp(name, "shm_", 4) == 0;  // bookkeeping, not traffic
    if (!internal) record(name, bytes);
    auto op = std::make_shared<PendingOp>();
    op->name = name;
    op->bytes = bytes;
    op->work = std::make_shared<MpiWork>(what, timeout());
    op->work->waiters_ = &waiters_;
    op->work->broken_ = &broken_;
    op->start = std::move(start);
    op->finish = std::move(finish);
    op->blocking = std::move(blocking);
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(op);
    }
    cv_.notify_one();
    return op->work;
  }

  // Runs the operation's blocking call (if asked) and its finishing step, then completes its
  // Work with the time since it started and any error either raised.
  void complete(PendingOp& op, bool run_blocking) {
    std::exception_ptr err;
    try {
      if (run_blocking) op.blocking();
      op.finish();
    } catch (...) {
      err = std::current_exception();
      broken_.store(true);
    }
    double secs = std::chrono::duration<double>(Clock::now() - op.started).count();
    if (op.name.compare(0, 4, "shm_") != 0) {
      record_seconds(op.name, secs);
      if (trace::enabled()) {
        const int64_t end = trace::now_us();
        trace::record(op.name.c_str(), "communication", end - static_cast<int64_t>(secs * 1e6), end,
                      "\"bytes\":" + std::to_string(op.bytes));
      }
    }
    op.work->finish(secs, err);
  }

  // The communicator is being destroyed and `inflight` cannot complete in time (a peer is gone,
  // or an operation already failed): fail their Works and keep their buffers for good, since MPI
  // may still write into them; the communicator is then not freed either.
  void abandon(std::vector<std::shared_ptr<PendingOp>>& inflight) {
    std::cerr << "tandem: a communicator of " << size_ << " ranks was destroyed with " << inflight.size()
              << " operation(s) still in flight (the first: " << inflight.front()->work->what_
              << "); they were abandoned\n";
    for (auto& op : inflight) {
      op->work->finish(0.0, std::make_exception_ptr(CommError(
                                op->work->what_ + ": abandoned, the communicator was destroyed before it completed")));
    }
    new std::vector<std::shared_ptr<PendingOp>>(std::move(inflight));  // NOLINT: deliberately never freed
    abandoned_ = true;
  }

  void loop() {
    trace::name_thread("communication (a group of " + std::to_string(size_) + ")");
    std::vector<std::shared_ptr<PendingOp>> inflight;
    std::deque<std::shared_ptr<PendingOp>> fresh;
    int idle_rounds = 0;
    bool draining = false;
    Clock::time_point drain_until;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (inflight.empty()) cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty() && inflight.empty()) return;
        if (stop_ && !draining) {
          draining = true;
          drain_until = Clock::now() + (broken_.load() ? std::chrono::milliseconds(0) : timeout());
        }
        fresh.swap(queue_);
      }
      if (draining && !inflight.empty() && Clock::now() >= drain_until) {
        abandon(inflight);
        return;
      }
      for (auto& op : fresh) {
        op->started = Clock::now();
        if (blocking_collectives_ && op->blocking) {
          // The tuned blocking algorithm; earlier non-blocking operations (p2p) still progress
          // inside it.
          complete(*op, true);
          continue;
        }
        try {
          op->start(op->reqs);
          inflight.push_back(op);
        } catch (...) {
          op->work->finish(0.0, std::current_exception());
        }
      }
      fresh.clear();
      bool progressed = false;
      // Complete in issue order where possible; test every op so all of them advance.
      for (size_t i = 0; i < inflight.size();) {
        auto& op = inflight[i];
        int flag = 1;
        int rc = MPI_SUCCESS;
        if (!op->reqs.empty())
          rc = MPI_Testall(static_cast<int>(op->reqs.size()), op->reqs.data(), &flag, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) {
          broken_.store(true);
          op->work->finish(0.0, std::make_exception_ptr(
                                    CommError(op->work->what_ + " failed in MPI: " + mpi_error_string(rc))));
        } else if (flag) {
          complete(*op, false);
        } else {
          ++i;
          continue;
        }
        progressed = true;
        inflight.erase(inflight.begin() + static_cast<long>(i));
      }
      if (!inflight.empty() && !progressed) {
        // After 16 polls without progress: nobody blocked on us and poll_us_ set: poll every
        // poll_us_ (the cores go to compute); otherwise every wait_sleep_us_ where it is set
        // (oversubscribed nodes: the peer is computing and may want this core). Else yield and
        // poll again at once.
        ++idle_rounds;
        const int sleep_us = waiters_.load() == 0 && poll_us_ > 0 ? poll_us_ : wait_sleep_us_;
        if (sleep_us > 0 && idle_rounds > 16) {
          std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
        } else {
          std::this_thread::yield();
        }
      } else {
        idle_rounds = 0;
      }
    }
  }

  // ---- shared-memory all-reduce (all ranks on one node; TANDEM_MPI_SHM=0 turns it off)
  // Tensors from symmetric_empty live in MPI-3 shared-memory windows that every rank maps. An
  // all-reduce of such a tensor is: barrier (every rank's data is in place), each rank sums its
  // 1/n of the elements straight from the n buffers and writes the result into all n, barrier.
  // Each byte is read and written about twice instead of being copied in and out of MPI's
  // shared-memory fifos at every step of the algorithm (no CMA single-copy in containers).
  std::shared_ptr<ShmWindow> shm_alloc(int64_t bytes, const std::string& what) {
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
  std::shared_ptr<ShmWindow> find_window(const at::Tensor& t, ReduceOp op) {
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

  void shm_allreduce(const ShmWindow& w, size_t off, int64_t numel, at::ScalarType st, bool avg,
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
  void shm_reduce_scatter(const ShmWindow& w, size_t off, int64_t chunk, at::ScalarType st, bool avg, void* dst,
                          const std::string& what) {
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
  void shm_allgather(const ShmWindow& w, size_t off, int64_t bytes, const void* src, const std::string& what) {
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

}  // namespace

at::Tensor mpi_symmetric_empty(Communicator& comm, int64_t numel, const at::TensorOptions& opts) {
  auto* mpi = dynamic_cast<MpiCommunicator*>(&comm);
  return mpi ? mpi->symmetric_empty(numel, opts) : at::Tensor();
}

}  // namespace detail

bool mpi_init_if_needed() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return false;
  int provided = 0;
  int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  if (rc != MPI_SUCCESS) throw CommError("MPI_Init_thread failed: " + detail::mpi_error_string(rc));
  if (provided < MPI_THREAD_MULTIPLE) {
    throw CommError("this MPI library does not provide MPI_THREAD_MULTIPLE (got level " + std::to_string(provided) +
                    "); Tandem's MPI backend needs it for its progress threads");
  }
  return true;
}

void mpi_finalize() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void mpi_abort(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

CommPtr make_mpi_world(const CommOptions& opts) {
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  return std::make_shared<detail::MpiCommunicator>(dup, opts);
}

}  // namespace tandem
