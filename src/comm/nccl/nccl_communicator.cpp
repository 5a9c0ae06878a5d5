// NCCL backend (CUDA tensors) and the two ways ranks exchange NCCL's unique id: over a CPU
// communicator (MPI) or through files in a shared directory (no MPI needed).
//
// Streams: every communicator owns a CUDA stream. An operation records an event on the
// caller's current stream, makes the communicator's stream wait for it, runs the NCCL call
// there and records a completion event. Work::wait() makes the caller's current stream wait
// for that event (the host never blocks); Work::synchronize() polls the event and NCCL's
// asynchronous error state from the host until done or the timeout, then aborts the
// communicator. Tensors used on the communicator's stream are recorded with the caching
// allocator (record_stream), so freeing them early is safe.
//
// Point-to-point: NCCL has no tags, and a send issued on a stream blocks that stream until
// the peer's receive runs, so "send, then receive" on both sides of a pair would deadlock if
// each call went to the GPU at once. send_async/recv_async are therefore posted and launched
// together in one ncclGroupStart/ncclGroupEnd when one of their Works is waited on, tested
// or synchronized, or when the next collective is issued. Sends and receives between two
// ranks match in the order they were posted; the tag only appears in error messages.
#include <nccl.h>

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <sstream>
#include <thread>

#include "comm/backends.h"
#include "compat/torch_compat.h"
#include "tandem/comm.h"
#include "tandem/trace.h"

namespace tandem {

bool has_nccl_backend() { return true; }

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string seconds_str(milliseconds ms) {
  std::ostringstream os;
  os << std::chrono::duration<double>(ms).count() << " s";
  return os.str();
}

// NCCL's name for the result plus its last warning, e.g. "invalid usage (run with
// NCCL_DEBUG=WARN for details): Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ...".
std::string nccl_message(ncclResult_t rc) {
  std::string s = ncclGetErrorString(rc);
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) {
    s += ": ";
    s += last;
  }
  return s;
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0 && std::strcmp(v, "false") != 0;
}

// Polls cheaply at first, then backs off to at most 1 ms between looks.
class Backoff {
 public:
  void pause() {
    if (++n_ < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 10 * (n_ - 63))));
    }
  }

 private:
  int n_ = 0;
};

// A CUDA event, created on first record on the device of that record.
class CudaEvent {
 public:
  explicit CudaEvent(bool timing) : timing_(timing) {}
  ~CudaEvent() {
    if (ev_) cudaEventDestroy(ev_);  // fine while pending: released once it completes
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  // The caller holds a device guard for the stream's device.
  void record(cudaStream_t stream, const std::string& what) {
    if (!ev_) check(cudaEventCreateWithFlags(&ev_, timing_ ? cudaEventDefault : cudaEventDisableTiming), what);
    check(cudaEventRecord(ev_, stream), what);
  }
  void block(cudaStream_t stream, const std::string& what) const {
    if (ev_) check(cudaStreamWaitEvent(stream, ev_, 0), what);
  }
  // True when complete (or never recorded).
  bool query(const std::string& what) const {
    if (!ev_) return true;
    cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    check(e, what);
    return false;
  }
  void synchronize(const std::string& what) const {
    if (ev_) check(cudaEventSynchronize(ev_), what);
  }
  // Milliseconds from `from` to this event; both complete.
  float elapsed_ms_since(const CudaEvent& from) const {
    float ms = 0.f;
    if (!ev_ || !from.ev_ || cudaEventElapsedTime(&ms, from.ev_, ev_) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0.f;
    }
    return ms;
  }

  static void check(cudaError_t e, const std::string& what) {
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw CommError(what + ": CUDA error " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
    }
  }

 private:
  bool timing_;
  cudaEvent_t ev_ = nullptr;
};

// Start and end of one operation on the communicator's stream.
struct OpTiming {
  explicit OpTiming(std::string op_name) : name(std::move(op_name)) {}
  const std::string name;
  CudaEvent start{true};
  CudaEvent end{true};
  std::atomic<bool> launched{false};
  std::exception_ptr launch_error;  // set (under the engine's lock) when launching failed
  int64_t bytes = 0;                // the payload, for the trace
  uint64_t trace_generation = 0;    // trace::generation() at launch while tracing, else 0

  bool done(const std::string& what) const { return launched.load() && end.query(what); }
  // Seconds on the engine once complete, else 0.
  double seconds() {
    std::lock_guard<std::mutex> lk(mu_);
    if (seconds_ < 0 && launched.load()) {
      bool complete = false;
      try {
        complete = end.query(name);
      } catch (...) {
      }
      if (complete) seconds_ = end.elapsed_ms_since(start) / 1000.0;
    }
    return seconds_ < 0 ? 0.0 : seconds_;
  }

 private:
  std::mutex mu_;
  double seconds_ = -1;
};
using TimingPtr = std::shared_ptr<OpTiming>;

// A send or receive waiting to be launched with the others posted before it.
struct PendingP2P {
  bool is_send = false;
  int peer = 0;
  at::Tensor buf;     // contiguous, what NCCL reads or writes
  at::Tensor target;  // recv into a non-contiguous tensor: copied from buf after the receive
  ncclDataType_t type = ncclFloat32;
  size_t count = 0;
  std::unique_ptr<CudaEvent> ready;  // recorded on the poster's current stream
  TimingPtr timing;
  std::string what;
  int64_t bytes = 0;
};

ncclConfig_t make_config(bool blocking) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = blocking ? 1 : 0;
  return cfg;
}

// Waits out ncclInProgress on `comm` (non-blocking communicators), bounded by `timeout`.
// Returns the final state: ncclSuccess, an error, or ncclInProgress on timeout.
ncclResult_t settle(ncclComm_t comm, ncclResult_t rc, milliseconds timeout) {
  if (rc != ncclInProgress || !comm) return rc;
  auto deadline = Clock::now() + timeout;
  Backoff b;
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(comm, &st);
    if (q != ncclSuccess) return q;
    if (st != ncclInProgress) return st;
    if (Clock::now() > deadline) return ncclInProgress;
    b.pause();
  }
}

// The NCCL communicator, its stream and everything in flight on it. Shared by the
// Communicator and its Works, so that a Work outliving its Communicator stays valid.
class Engine {
 public:
  Engine(ncclComm_t comm, int rank, int size, c10::DeviceIndex device, bool blocking, milliseconds timeout)
      : rank_(rank), size_(size), device_(device), blocking_(blocking), destroy_timeout_(timeout),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)), comm_(comm) {}

  ~Engine() {
    if (trace_stream_) cudaStreamDestroy(trace_stream_);  // idle: its one event was waited for
    std::lock_guard<std::mutex> lk(mu_);
    on_seconds_ = nullptr;
    if (!comm_) return;
    try {
      flush_locked(destroy_timeout_);
    } catch (...) {
    }
    // Wait (bounded) for what is in flight, then free NCCL's resources; a communicator that
    // failed or still has work running is aborted instead, which never waits for peers.
    bool clean = true;
    try {
      c10::cuda::CUDAGuard g(device_);
      auto deadline = Clock::now() + destroy_timeout_;
      Backoff b;
      while (last_ && !last_->done("destroying the NCCL communicator")) {
        ncclResult_t st = ncclSuccess;
        if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess || (st != ncclSuccess && st != ncclInProgress) ||
            Clock::now() > deadline) {
          clean = false;
          break;
        }
        b.pause();
      }
      ncclResult_t st = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess || (st != ncclSuccess && st != ncclInProgress))
        clean = false;
      // After ncclCommDestroy the handle is gone whatever it returned: never abort it then.
      if (clean) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    } catch (...) {
      // CUDA already shut down (process exit): nothing left to free.
    }
    comm_ = nullptr;
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  c10::DeviceIndex device() const { return device_; }
  bool blocking() const { return blocking_; }
  const c10::cuda::CUDAStream& stream() const { return stream_; }

  void set_on_seconds(std::function<void(const std::string&, double)> f) {
    std::lock_guard<std::mutex> lk(mu_);
    on_seconds_ = std::move(f);
  }

  // Launches a collective: `call` is invoked with the communicator and the stream to use.
  // `touched` are all tensors the stream reads or writes; `copy_back` runs on the stream
  // after the call (staging copies into non-contiguous outputs).
  TimingPtr launch(const char* op, const std::string& what, int64_t bytes, milliseconds timeout,
                   const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& call,
                   const std::vector<at::Tensor>& touched, const std::function<void()>& copy_back) {
    std::lock_guard<std::mutex> lk(mu_);
    usable_locked(what);
    flush_locked(timeout);
    c10::cuda::CUDAGuard g(device_);
    cudaStream_t s = stream_.stream();
    ready_.record(c10::cuda::getCurrentCUDAStream(device_).stream(), what);
    ready_.block(s, what);
    auto timing = std::make_shared<OpTiming>(op);
    trace_begin_locked(*timing, bytes);
    timing->start.record(s, what);
    ncclResult_t rc = call(comm_, s);
    check_locked(rc, what, timeout);
    if (copy_back) {
      c10::cuda::CUDAStreamGuard sg(stream_);
      copy_back();
    }
    timing->end.record(s, what);
    for (const auto& t : touched) compat::record_stream(t, stream_);
    timing->launched.store(true);
    track_locked(timing);
    return timing;
  }

  // Queues a send or receive for the next group launch (see the file comment).
  TimingPtr post(PendingP2P p) {
    std::lock_guard<std::mutex> lk(mu_);
    usable_locked(p.what);
    c10::cuda::CUDAGuard g(device_);
    p.ready = std::make_unique<CudaEvent>(false);
    p.ready->record(c10::cuda::getCurrentCUDAStream(device_).stream(), p.what);
    p.timing = std::make_shared<OpTiming>(p.is_send ? "send" : "recv");
    auto timing = p.timing;
    pending_.push_back(std::move(p));
    return timing;
  }

  // Launches the pending group that holds `t`, if it is still pending; rethrows its failure.
  void ensure_launched(const TimingPtr& t, const std::string& what, milliseconds timeout) {
    if (t->launched.load()) return;
    std::lock_guard<std::mutex> lk(mu_);
    if (!t->launched.load() && !t->launch_error) {
      usable_locked(what);
      flush_locked(timeout);
    }
    if (t->launch_error) std::rethrow_exception(t->launch_error);
    if (!t->launched.load()) throw CommError(what + ": internal error: operation neither launched nor pending");
  }

  // Throws if the communicator was aborted or NCCL reports an asynchronous error (which
  // aborts it: an NCCL communicator that failed cannot be used again).
  void check_health(const std::string& what) {
    std::lock_guard<std::mutex> lk(mu_);
    usable_locked(what);
    ncclResult_t st = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(comm_, &st);
    if (q != ncclSuccess) st = q;
    if (st != ncclSuccess && st != ncclInProgress) {
      std::string msg = nccl_message(st);
      abort_locked("asynchronous NCCL error: " + msg);
      throw CommError(what + " failed in NCCL: " + msg +
                      "; the communicator was aborted. A peer may have failed: check every rank's log (NCCL_DEBUG=WARN "
                      "shows NCCL's view) and restart the job");
    }
  }

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lk(mu_);
    abort_locked(reason);
  }

  // Accounts the seconds of every completed operation, in launch order.
  void sweep() {
    std::lock_guard<std::mutex> lk(mu_);
    sweep_locked();
  }

  // ncclCommSplit; returns nullptr for a rank that is in no group.
  ncclComm_t split(int color, int key, const std::string& what, milliseconds timeout) {
    std::lock_guard<std::mutex> lk(mu_);
    usable_locked(what);
    flush_locked(timeout);
    c10::cuda::CUDAGuard g(device_);
    ncclConfig_t cfg = make_config(blocking_);
    ncclComm_t child = nullptr;
    ncclResult_t rc = ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &cfg);
    if (rc == ncclInProgress) {
      auto deadline = Clock::now() + timeout;
      Backoff b;
      for (;;) {
        ncclResult_t sp = ncclSuccess, sc = ncclSuccess;
        ncclCommGetAsyncError(comm_, &sp);
        if (child) ncclCommGetAsyncError(child, &sc);
        if (sp != ncclInProgress && sc != ncclInProgress) {
          rc = sp != ncclSuccess ? sp : sc;
          break;
        }
        if (Clock::now() > deadline) {
          if (child) ncclCommAbort(child);
          abort_locked("split timed out");
          throw CommTimeout(what + " timed out after " + seconds_str(timeout) +
                            "; ncclCommSplit is collective: does every rank of the communicator call split?");
        }
        b.pause();
      }
    }
    if (rc != ncclSuccess) {
      std::string msg = nccl_message(rc);
      if (child) ncclCommAbort(child);
      throw CommError(what + " failed in NCCL: " + msg);
    }
    return child;
  }

 private:
  void usable_locked(const std::string& what) const {
    if (!comm_) {
      throw CommError(what + ": the NCCL communicator was aborted earlier (" + abort_reason_ +
                      "); it cannot be used again: restart the job or create a new Runtime");
    }
  }

  // After an NCCL call returned `rc`: waits out ncclInProgress, throws on failure (aborting
  // the communicator unless NCCL merely rejected the arguments).
  void check_locked(ncclResult_t rc, const std::string& what, milliseconds timeout) {
    rc = settle(comm_, rc, timeout);
    if (rc == ncclSuccess) return;
    if (rc == ncclInProgress) {
      abort_locked("an operation did not get going within the timeout");
      throw CommTimeout(what + ": NCCL did not accept the operation within " + seconds_str(timeout) +
                        " (still connecting to peers); the communicator was aborted. Is every rank alive and calling "
                        "the same operations in the same order?");
    }
    std::string msg = nccl_message(rc);
    if (rc == ncclInvalidArgument || rc == ncclInvalidUsage) {
      throw CommError(what + " rejected by NCCL: " + msg);
    }
    abort_locked("NCCL error: " + msg);
    throw CommError(what + " failed in NCCL: " + msg +
                    "; the communicator was aborted (set NCCL_DEBUG=WARN for details)");
  }

  void abort_locked(const std::string& reason) {
    if (!comm_) return;
    abort_reason_ = reason;
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  void flush_locked(milliseconds timeout) {
    if (pending_.empty()) return;
    std::vector<PendingP2P> ops;
    ops.swap(pending_);
    try {
      c10::cuda::CUDAGuard g(device_);
      cudaStream_t s = stream_.stream();
      for (auto& p : ops) p.ready->block(s, p.what);
      for (auto& p : ops) {
        trace_begin_locked(*p.timing, p.bytes);
        p.timing->start.record(s, p.what);
      }
      ncclResult_t rc = ncclGroupStart();
      if (rc == ncclSuccess) {
        for (auto& p : ops) {
          rc = p.is_send ? ncclSend(p.buf.data_ptr(), p.count, p.type, p.peer, comm_, s)
                         : ncclRecv(p.buf.data_ptr(), p.count, p.type, p.peer, comm_, s);
          if (rc != ncclSuccess && rc != ncclInProgress) break;
        }
        ncclResult_t end = ncclGroupEnd();
        if (rc == ncclSuccess || rc == ncclInProgress) rc = end;
      }
      check_locked(rc,
                   ops.front().what + (ops.size() > 1 ? " (launched with " + std::to_string(ops.size() - 1) +
                                                            " other posted send/recv)"
                                                      : std::string()),
                   timeout);
      {
        c10::cuda::CUDAStreamGuard sg(stream_);
        for (auto& p : ops) {
          if (p.target.defined()) p.target.copy_(p.buf);
          p.timing->end.record(s, p.what);
        }
      }
      for (auto& p : ops) {
        compat::record_stream(p.buf, stream_);
        compat::record_stream(p.target, stream_);
        p.timing->launched.store(true);
        track_locked(p.timing);
      }
    } catch (...) {
      auto err = std::current_exception();
      for (auto& p : ops) {
        if (!p.timing->launched.load()) p.timing->launch_error = err;
      }
      throw;
    }
  }

  void track_locked(const TimingPtr& t) {
    sweep_locked();
    in_flight_.push_back(t);
    last_ = t;
  }

  void sweep_locked() {
    while (!in_flight_.empty()) {
      auto& t = in_flight_.front();
      bool complete = false;
      try {
        complete = t->done(t->name);
      } catch (...) {
        complete = true;  // a CUDA error: surfaced by wait/synchronize, not here
      }
      if (!complete) break;
      if (on_seconds_) on_seconds_(t->name, t->seconds());
      trace_end_locked(*t);
      in_flight_.pop_front();
    }
  }

  // The trace (tandem/trace.h) of this stream's operations: their CUDA events are placed on the
  // trace's clock through a reference event. That event is recorded on a stream of its own that
  // nothing else uses, so it completes at once and its host time is its GPU time; this stream is
  // never waited on for it (it may hold receives whose peers wait for this rank).
  void trace_begin_locked(OpTiming& t, int64_t bytes) {
    t.bytes = bytes;
    t.trace_generation = 0;
    if (!trace::enabled()) return;
    const uint64_t gen = trace::generation();
    if (gen != trace_generation_) {
      const std::string what = "rank " + std::to_string(rank_) + ": the trace's reference event";
      if (!trace_stream_) CudaEvent::check(cudaStreamCreateWithFlags(&trace_stream_, cudaStreamNonBlocking), what);
      trace_ref_.record(trace_stream_, what);
      trace_ref_.synchronize(what);
      trace_ref_us_ = trace::now_us();
      trace_generation_ = gen;
      if (trace_track_ < 0) trace_track_ = trace::named_track("NCCL stream (a group of " + std::to_string(size_) + ")");
    }
    t.trace_generation = gen;
  }

  void trace_end_locked(OpTiming& t) {
    if (t.trace_generation == 0 || t.trace_generation != trace_generation_ || !trace::enabled()) return;
    auto us = [&](const CudaEvent& e) {
      return trace_ref_us_ + static_cast<int64_t>(e.elapsed_ms_since(trace_ref_) * 1000.0);
    };
    trace::record_on(trace_track_, t.name.c_str(), "communication", us(t.start), us(t.end),
                     "\"bytes\":" + std::to_string(t.bytes));
  }

  const int rank_, size_;
  const c10::DeviceIndex device_;
  const bool blocking_;
  const milliseconds destroy_timeout_;
  const c10::cuda::CUDAStream stream_;

  std::mutex mu_;  // guards what follows and every NCCL call on comm_
  ncclComm_t comm_;
  std::string abort_reason_;
  CudaEvent ready_{false};
  std::vector<PendingP2P> pending_;
  std::deque<TimingPtr> in_flight_;  // launched, seconds not yet accounted
  TimingPtr last_;
  std::function<void(const std::string&, double)> on_seconds_;
  cudaStream_t trace_stream_ = nullptr;
  CudaEvent trace_ref_{true};
  int64_t trace_ref_us_ = 0;
  uint64_t trace_generation_ = 0;
  int trace_track_ = -1;
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<Engine> engine, TimingPtr timing, std::string what, milliseconds timeout, bool host_wait)
      : engine_(std::move(engine)), timing_(std::move(timing)), what_(std::move(what)), timeout_(timeout),
        host_wait_(host_wait) {}

  void wait() override {
    if (host_wait_) {
      synchronize();
      return;
    }
    engine_->ensure_launched(timing_, what_, timeout_);
    engine_->check_health(what_);
    c10::cuda::CUDAGuard g(engine_->device());
    timing_->end.block(c10::cuda::getCurrentCUDAStream(engine_->device()).stream(), what_);
  }

  void synchronize() override {
    engine_->ensure_launched(timing_, what_, timeout_);
    auto deadline = Clock::now() + timeout_;
    Backoff b;
    while (!timing_->end.query(what_)) {
      engine_->check_health(what_);
      if (Clock::now() > deadline) {
        engine_->abort(what_ + " timed out");
        throw CommTimeout(what_ + " timed out after " + seconds_str(timeout_) +
                          " on the GPU; the NCCL communicator was aborted. Is every rank alive and calling the same "
                          "operations in the same order? (NCCL_DEBUG=WARN shows NCCL's view)");
      }
      b.pause();
    }
    engine_->check_health(what_);
    engine_->sweep();
  }

  bool is_completed() override {
    engine_->ensure_launched(timing_, what_, timeout_);
    bool done = timing_->end.query(what_);
    if (done) engine_->sweep();
    return done;
  }

  double seconds() const override { return timing_->seconds(); }

 private:
  std::shared_ptr<Engine> engine_;
  TimingPtr timing_;
  std::string what_;
  milliseconds timeout_;
  bool host_wait_;
};

ncclDataType_t nccl_type(at::ScalarType t, const std::string& what) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    case at::kBool: return ncclUint8;
    default:
      throw CommError(what + ": dtype " + c10::toString(t) +
                      " is not supported by the NCCL backend (use float32, float64, bfloat16, float16, int64, int32, "
                      "int8 or uint8)");
  }
}

ncclRedOp_t nccl_op(ReduceOp op, at::ScalarType t, const std::string& what) {
  if (t == at::kBool) {
    if (op == ReduceOp::kAvg) throw CommError(what + ": avg of a bool tensor is undefined");
    return ncclMax;  // logical or, as the MPI backend does
  }
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kAvg:
      if (!at::isFloatingType(t)) {
        throw CommError(what + ": avg needs a floating-point tensor; use sum on " + std::string(c10::toString(t)));
      }
      return ncclAvg;
  }
  throw CommError(what + ": unknown reduction");
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, c10::DeviceIndex device, bool blocking, const CommOptions& opts)
      : Communicator(opts) {
    int rank = 0, size = 0;
    ncclCommUserRank(comm, &rank);
    ncclCommCount(comm, &size);
    engine_ = std::make_shared<Engine>(comm, rank, size, device, blocking, opts.timeout);
    engine_->set_on_seconds([this](const std::string& op, double s) { record_seconds(op, s); });
    c10::cuda::CUDAGuard g(device);
    barrier_buf_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device));
  }

  ~NcclCommunicator() override { engine_->set_on_seconds(nullptr); }

  int rank() const override { return engine_->rank(); }
  int size() const override { return engine_->size(); }
  std::string backend() const override { return "nccl"; }

  WorkPtr allreduce_async(at::Tensor t, ReduceOp op) override {
    auto what = describe(rank(), std::string("allreduce(") + to_string(op) + ")", t);
    check_tensor(t, what);
    auto type = nccl_type(t.scalar_type(), what);
    auto rop = nccl_op(op, t.scalar_type(), what);
    size_t n = static_cast<size_t>(t.numel());
    at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
    std::function<void()> back;
    if (!buf.is_same(t)) back = [t, buf]() mutable { t.copy_(buf); };
    return launch(
        "allreduce", what, t.numel() * t.element_size(),
        [=](ncclComm_t c, cudaStream_t s) { return ncclAllReduce(buf.data_ptr(), buf.data_ptr(), n, type, rop, c, s); },
        {t, buf}, back);
  }

  WorkPtr reduce_scatter_async(at::Tensor out, at::Tensor in, ReduceOp op) override {
    auto what = describe(rank(), std::string("reduce_scatter(") + to_string(op) + ")", in);
    check_tensor(in, what);
    check_pair(out, in, what);
    if (in.numel() != out.numel() * size()) {
      throw CommError(what + ": input has " + std::to_string(in.numel()) + " elements, expected world size " +
                      std::to_string(size()) + " x output's " + std::to_string(out.numel()));
    }
    auto type = nccl_type(in.scalar_type(), what);
    auto rop = nccl_op(op, in.scalar_type(), what);
    size_t n = static_cast<size_t>(out.numel());
    at::Tensor src = in.contiguous();
    at::Tensor dst = out.is_contiguous() ? out : at::empty(out.sizes(), out.options());
    std::function<void()> back;
    if (!dst.is_same(out)) back = [out, dst]() mutable { out.copy_(dst); };
    return launch(
        "reduce_scatter", what, in.numel() * in.element_size(),
        [=](ncclComm_t c, cudaStream_t s) {
          return ncclReduceScatter(src.data_ptr(), dst.data_ptr(), n, type, rop, c, s);
        },
        {in, src, out, dst}, back);
  }

  WorkPtr allgather_async(at::Tensor out, at::Tensor in) override {
    auto what = describe(rank(), "allgather", in);
    check_tensor(in, what);
    check_pair(out, in, what);
    if (out.numel() != in.numel() * size()) {
      throw CommError(what + ": output has " + std::to_string(out.numel()) + " elements, expected world size " +
                      std::to_string(size()) + " x input's " + std::to_string(in.numel()));
    }
    auto type = nccl_type(in.scalar_type(), what);
    size_t n = static_cast<size_t>(in.numel());
    at::Tensor src = in.contiguous();
    at::Tensor dst = out.is_contiguous() ? out : at::empty(out.sizes(), out.options());
    std::function<void()> back;
    if (!dst.is_same(out)) back = [out, dst]() mutable { out.copy_(dst); };
    return launch(
        "allgather", what, in.numel() * in.element_size(),
        [=](ncclComm_t c, cudaStream_t s) { return ncclAllGather(src.data_ptr(), dst.data_ptr(), n, type, c, s); },
        {in, src, out, dst}, back);
  }

  WorkPtr broadcast_async(at::Tensor t, int root) override {
    auto what = describe(rank(), "broadcast(root " + std::to_string(root) + ")", t);
    check_tensor(t, what);
    check_peer(root, what);
    auto type = nccl_type(t.scalar_type(), what);
    size_t n = static_cast<size_t>(t.numel());
    at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
    std::function<void()> back;
    if (!buf.is_same(t)) back = [t, buf]() mutable { t.copy_(buf); };
    return launch(
        "broadcast", what, t.numel() * t.element_size(),
        [=](ncclComm_t c, cudaStream_t s) {
          return ncclBroadcast(buf.data_ptr(), buf.data_ptr(), n, type, root, c, s);
        },
        {t, buf}, back);
  }

  WorkPtr send_async(at::Tensor t, int dst, int tag) override {
    auto what = describe(rank(), "send(to " + std::to_string(dst) + ", tag " + std::to_string(tag) + ")", t);
    check_tensor(t, what);
    check_peer(dst, what);
    PendingP2P p;
    p.is_send = true;
    p.peer = dst;
    p.type = nccl_type(t.scalar_type(), what);
    p.count = static_cast<size_t>(t.numel());
    p.buf = t.contiguous();
    p.what = what;
    return post(std::move(p), t.numel() * t.element_size());
  }

  WorkPtr recv_async(at::Tensor t, int src, int tag) override {
    auto what = describe(rank(), "recv(from " + std::to_string(src) + ", tag " + std::to_string(tag) + ")", t);
    check_tensor(t, what);
    check_peer(src, what);
    PendingP2P p;
    p.is_send = false;
    p.peer = src;
    p.type = nccl_type(t.scalar_type(), what);
    p.count = static_cast<size_t>(t.numel());
    if (t.is_contiguous()) {
      p.buf = t;
    } else {
      p.buf = at::empty(t.sizes(), t.options());
      p.target = t;
    }
    p.what = what;
    return post(std::move(p), t.numel() * t.element_size());
  }

  // wait() on a barrier's Work blocks the host (bounded by the timeout), as a barrier that
  // only ordered streams would be of no use to callers synchronizing processes.
  WorkPtr barrier_async() override {
    std::string what = "rank " + std::to_string(rank()) + ": barrier";
    at::Tensor buf = barrier_buf_;
    return launch(
        "barrier", what, 0,
        [=](ncclComm_t c, cudaStream_t s) {
          return ncclAllReduce(buf.data_ptr(), buf.data_ptr(), 1, ncclFloat32, ncclSum, c, s);
        },
        {buf}, nullptr, /*host_wait=*/true);
  }

  // One group of a send and a receive per peer with rows to move (NCCL has no all-to-all-v);
  // a send to this rank itself pairs with its own receive inside the group.
  WorkPtr alltoall_async(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits,
                         std::vector<int64_t> in_splits) override {
    auto what = describe(rank(), "alltoall", in);
    check_tensor(in, what);
    check_tensor(out, what);
    const int64_t row = check_alltoall(rank(), size(), out, in, out_splits, in_splits);
    auto type = nccl_type(in.scalar_type(), what);
    const int64_t row_bytes = row * static_cast<int64_t>(in.element_size());
    const auto soff = split_offsets(in_splits), roff = split_offsets(out_splits);
    const int n = size();
    return launch(
        "alltoall", what, in.numel() * in.element_size(),
        [=](ncclComm_t c, cudaStream_t s) {
          auto* src = static_cast<char*>(in.data_ptr());
          auto* dst = static_cast<char*>(out.data_ptr());
          ncclResult_t rc = ncclGroupStart();
          if (rc != ncclSuccess) return rc;
          for (int j = 0; j < n && (rc == ncclSuccess || rc == ncclInProgress); ++j) {
            if (in_splits[j] > 0) {
              rc = ncclSend(src + soff[j] * row_bytes, static_cast<size_t>(in_splits[j] * row), type, j, c, s);
            }
            if (out_splits[j] > 0 && (rc == ncclSuccess || rc == ncclInProgress)) {
              rc = ncclRecv(dst + roff[j] * row_bytes, static_cast<size_t>(out_splits[j] * row), type, j, c, s);
            }
          }
          ncclResult_t end = ncclGroupEnd();
          return rc == ncclSuccess || rc == ncclInProgress ? end : rc;
        },
        {in, out}, nullptr);
  }

  CommPtr split(int color, int key) override {
    std::string what = "rank " + std::to_string(rank()) + ": split(color " + std::to_string(color) + ", key " +
                       std::to_string(key) + ")";
    ncclComm_t child = engine_->split(color, key, what, timeout());
    if (!child) return nullptr;
    return std::make_shared<NcclCommunicator>(child, engine_->device(), engine_->blocking(), CommOptions{timeout()});
  }

 private:
  WorkPtr launch(const char* op, const std::string& what, int64_t bytes,
                 const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& call,
                 const std::vector<at::Tensor>& touched, const std::function<void()>& copy_back,
                 bool host_wait = false) {
    record(op, bytes);
    auto timing = engine_->launch(op, what, bytes, timeout(), call, touched, copy_back);
    return std::make_shared<NcclWork>(engine_, std::move(timing), what, timeout(), host_wait);
  }

  WorkPtr post(PendingP2P p, int64_t bytes) {
    record(p.is_send ? "send" : "recv", bytes);
    p.bytes = bytes;
    std::string what = p.what;
    auto timing = engine_->post(std::move(p));
    return std::make_shared<NcclWork>(engine_, std::move(timing), what, timeout(), false);
  }

  void check_tensor(const at::Tensor& t, const std::string& what) const {
    if (!t.defined()) throw CommError(what + ": tensor is undefined");
    if (!t.is_cuda()) {
      throw CommError(what + ": the NCCL backend takes CUDA tensors, this one is on " + t.device().str() +
                      "; move it with .to(device) or use the CPU communicator (Runtime::cpu_world())");
    }
    if (t.device().index() != engine_->device()) {
      throw CommError(what + ": tensor is on " + t.device().str() +
                      " but this communicator runs on cuda:" + std::to_string(engine_->device()));
    }
  }
  void check_pair(const at::Tensor& out, const at::Tensor& in, const std::string& what) const {
    if (!out.defined() || !out.is_cuda() || out.device() != in.device() || out.scalar_type() != in.scalar_type()) {
      throw CommError(what + ": output must be a tensor of the input's dtype on the input's device (got " +
                      (out.defined() ? std::string(c10::toString(out.scalar_type())) + " on " + out.device().str()
                                     : std::string("undefined")) +
                      ")");
    }
  }
  void check_peer(int peer, const std::string& what) const {
    if (peer < 0 || peer >= size()) {
      throw CommError(what + ": peer rank " + std::to_string(peer) + " out of range for world size " +
                      std::to_string(size()));
    }
  }

  std::shared_ptr<Engine> engine_;
  at::Tensor barrier_buf_;
};

// ---- bootstraps

class CommBootstrap : public Bootstrap {
 public:
  explicit CommBootstrap(CommPtr comm) : comm_(std::move(comm)) {
    if (!comm_) throw CommError("NCCL bootstrap: no CPU communicator given");
  }
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  std::string broadcast(const std::string& bytes, int root) override {
    auto len = at::empty({1}, at::TensorOptions().dtype(at::kLong));
    len.data_ptr<int64_t>()[0] = comm_->rank() == root ? static_cast<int64_t>(bytes.size()) : 0;
    comm_->broadcast(len, root);
    int64_t n = len.data_ptr<int64_t>()[0];
    auto buf = at::empty({n}, at::TensorOptions().dtype(at::kByte));
    if (comm_->rank() == root && n > 0) std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
    comm_->broadcast(buf, root);
    return std::string(reinterpret_cast<const char*>(buf.data_ptr()), static_cast<size_t>(n));
  }

 private:
  CommPtr comm_;
};

// Rank `root` writes the bytes to DIR/tandem-JOB-SEQ.bcast (temp file + rename, so readers
// never see a partial file); the others poll for it, check it, and leave an ack file.
// `root` waits for every ack and removes the file, and each reader returns only once the
// file is gone, so a later broadcast (or a later job with the same id) never reads a stale
// one. Files older than this process's bootstrap minus the timeout are ignored as leftovers
// of a crashed job.
class FileBootstrap : public Bootstrap {
 public:
  FileBootstrap(std::string dir, int rank, int size, milliseconds timeout)
      : dir_(std::move(dir)), rank_(rank), size_(size), timeout_(timeout), created_(std::chrono::system_clock::now()) {
    if (size_ < 1 || rank_ < 0 || rank_ >= size_) {
      throw CommError("NCCL file bootstrap: rank " + std::to_string(rank_) + " out of range for world size " +
                      std::to_string(size_));
    }
    job_ = job_id();
    if (size_ > 1) {
      struct stat st {};
      if (dir_.empty() || ::stat(dir_.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        throw CommError("rank " + std::to_string(rank_) + ": NCCL file bootstrap: '" + dir_ +
                        "' is not a directory; set TANDEM_STORE_DIR to a directory that every rank can read and "
                        "rank 0 can write");
      }
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::string broadcast(const std::string& bytes, int root) override {
    if (root < 0 || root >= size_) {
      throw CommError("rank " + std::to_string(rank_) + ": bootstrap broadcast from root " + std::to_string(root) +
                      " out of range for world size " + std::to_string(size_));
    }
    int seq = seq_++;
    if (size_ == 1) return bytes;
    std::string path = dir_ + "/tandem-" + job_ + "-" + std::to_string(seq) + ".bcast";
    return rank_ == root ? write_side(path, bytes) : read_side(path, root);
  }

 private:
  static std::string job_id() {
    std::string id;
    if (const char* v = std::getenv("TANDEM_JOB_ID"); v && *v) {
      id = v;
    } else if (const char* s = std::getenv("SLURM_JOB_ID"); s && *s) {
      id = std::string("slurm") + s;
      if (const char* st = std::getenv("SLURM_STEP_ID"); st && *st) id += std::string(".") + st;
    } else if (const char* t = std::getenv("TORCHELASTIC_RUN_ID"); t && *t) {
      id = t;
    } else {
      id = "default";
    }
    for (char& c : id) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
    }
    return id;
  }

  std::string where() const {
    return "rank " + std::to_string(rank_) + ": NCCL file bootstrap in " + dir_ + " (job id '" + job_ +
           "', from TANDEM_JOB_ID)";
  }

  std::string ack_path(const std::string& path, int r) const { return path + ".ack" + std::to_string(r); }

  void write_atomic(const std::string& path, const std::string& data) const {
    std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(rank_);
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) throw CommError(where() + ": cannot create " + tmp + ": " + std::strerror(errno));
    size_t off = 0;
    while (off < data.size()) {
      ssize_t w = ::write(fd, data.data() + off, data.size() - off);
      if (w < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        throw CommError(where() + ": cannot write " + tmp + ": " + std::strerror(e));
      }
      off += static_cast<size_t>(w);
    }
    ::fsync(fd);
    ::close(fd);
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      int e = errno;
      ::unlink(tmp.c_str());
      throw CommError(where() + ": cannot rename " + tmp + " to " + path + ": " + std::strerror(e));
    }
  }

  std::string header(size_t len, int root) const {
    return "TANDEM-BOOTSTRAP 1 " + std::to_string(size_) + " " + std::to_string(root) + " " + std::to_string(len) +
           "\n";
  }

  std::string write_side(const std::string& path, const std::string& bytes) {
    for (int r = 0; r < size_; ++r) ::unlink(ack_path(path, r).c_str());  // leftovers of a crashed job
    write_atomic(path, header(bytes.size(), rank_) + bytes);
    auto deadline = Clock::now() + timeout_;
    Backoff b;
    std::vector<bool> acked(size_, false);
    acked[rank_] = true;
    for (;;) {
      std::string missing;
      for (int r = 0; r < size_; ++r) {
        if (!acked[r] && ::access(ack_path(path, r).c_str(), F_OK) == 0) acked[r] = true;
        if (!acked[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      if (missing.empty()) break;
      if (Clock::now() > deadline) {
        ::unlink(path.c_str());
        for (int r = 0; r < size_; ++r) ::unlink(ack_path(path, r).c_str());
        throw CommTimeout(where() + ": rank(s) " + missing + " did not pick up " + path + " within " +
                          seconds_str(timeout_) +
                          "; did they start, with the same TANDEM_STORE_DIR, TANDEM_JOB_ID and WORLD_SIZE?");
      }
      b.pause();
    }
    ::unlink(path.c_str());
    for (int r = 0; r < size_; ++r) ::unlink(ack_path(path, r).c_str());
    return bytes;
  }

  std::string read_side(const std::string& path, int root) {
    auto deadline = Clock::now() + timeout_;
    auto oldest = created_ - timeout_ - std::chrono::seconds(5);
    Backoff b;
    std::string payload;
    struct stat seen {};
    for (;;) {
      struct stat st {};
      if (::stat(path.c_str(), &st) == 0) {
        auto mtime =
            std::chrono::system_clock::time_point(std::chrono::duration_cast<std::chrono::system_clock::duration>(
                std::chrono::seconds(st.st_mtim.tv_sec) + std::chrono::nanoseconds(st.st_mtim.tv_nsec)));
        std::string data;
        if (mtime >= oldest && read_file(path, &data)) {
          size_t nl = data.find('\n');
          std::istringstream hs(data.substr(0, nl == std::string::npos ? 0 : nl));
          std::string magic;
          int version = 0, size = 0, from = -1;
          size_t len = 0;
          hs >> magic >> version >> size >> from >> len;
          if (magic == "TANDEM-BOOTSTRAP" && version == 1 && nl != std::string::npos && data.size() - nl - 1 == len) {
            if (size != size_ || from != root) {
              throw CommError(where() + ": " + path + " was written for world size " + std::to_string(size) +
                              " by rank " + std::to_string(from) + ", but this rank expects world size " +
                              std::to_string(size_) + " and root " + std::to_string(root) +
                              "; give each job its own TANDEM_JOB_ID or TANDEM_STORE_DIR");
            }
            payload = data.substr(nl + 1);
            seen = st;
            break;
          }
        }
      }
      if (Clock::now() > deadline) {
        throw CommTimeout(where() + ": rank " + std::to_string(root) + " did not write " + path + " within " +
                          seconds_str(timeout_) + "; is it running with TANDEM_STORE_DIR=" + dir_ +
                          " and TANDEM_JOB_ID=" + job_ + "?");
      }
      b.pause();
    }
    write_atomic(ack_path(path, rank_), "");
    // Return once the root has removed the file (it has every ack then), so that the next
    // broadcast cannot find this one's file.
    Backoff b2;
    auto gone_deadline = Clock::now() + timeout_;
    for (;;) {
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0 || st.st_ino != seen.st_ino) break;
      if (Clock::now() > gone_deadline) {
        throw CommTimeout(where() + ": rank " + std::to_string(root) + " did not collect the other ranks' acks for " +
                          path + " within " + seconds_str(timeout_) + "; did every rank start?");
      }
      b2.pause();
    }
    return payload;
  }

  static bool read_file(const std::string& path, std::string* out) {
    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) return false;
    std::string data;
    char buf[4096];
    for (;;) {
      ssize_t r = ::read(fd, buf, sizeof(buf));
      if (r < 0) {
        if (errno == EINTR) continue;
        ::close(fd);
        return false;
      }
      if (r == 0) break;
      data.append(buf, static_cast<size_t>(r));
    }
    ::close(fd);
    *out = std::move(data);
    return true;
  }

  std::string dir_;
  int rank_, size_;
  milliseconds timeout_;
  std::chrono::system_clock::time_point created_;
  std::string job_;
  int seq_ = 0;
};

}  // namespace
}  // namespace detail

std::unique_ptr<Bootstrap> make_comm_bootstrap(CommPtr cpu_comm) {
  return std::make_unique<detail::CommBootstrap>(std::move(cpu_comm));
}

std::unique_ptr<Bootstrap> make_file_bootstrap(const std::string& dir, int rank, int size,
                                               std::chrono::milliseconds timeout) {
  return std::make_unique<detail::FileBootstrap>(dir, rank, size, timeout);
}

CommPtr make_nccl_communicator(int device_index, Bootstrap& bootstrap, const CommOptions& opts) {
  using namespace detail;
  const int rank = bootstrap.rank(), size = bootstrap.size();
  const std::string where = "rank " + std::to_string(rank) + ": NCCL initialization (world size " +
                            std::to_string(size) + ", cuda:" + std::to_string(device_index) + ")";
  int version = 0;
  ncclGetVersion(&version);
  if (version < 21800) {
    throw CommError(where + ": NCCL " + std::to_string(version) +
                    " is too old; Tandem needs NCCL >= 2.18 (ncclCommSplit, non-blocking init). Install the "
                    "nvidia-nccl wheel that matches torch");
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || device_index < 0 || device_index >= ndev) {
    (void)cudaGetLastError();
    throw CommError(where + ": no CUDA device " + std::to_string(device_index) + " (this process sees " +
                    std::to_string(ndev) + ")");
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));

  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  std::string bytes;
  if (rank == 0) {
    ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess) throw CommError(where + ": ncclGetUniqueId failed: " + nccl_message(rc));
    bytes.assign(reinterpret_cast<const char*>(&id), sizeof(id));
  }
  bytes = bootstrap.broadcast(bytes, 0);
  if (bytes.size() != sizeof(id)) {
    throw CommError(where + ": the bootstrap delivered " + std::to_string(bytes.size()) +
                    " bytes of NCCL id, expected " + std::to_string(sizeof(id)) +
                    "; do all ranks run the same Tandem build?");
  }
  std::memcpy(&id, bytes.data(), sizeof(id));

  // Non-blocking NCCL by default so that initialization, too, is bounded by the timeout;
  // TANDEM_NCCL_BLOCKING=1 selects NCCL's blocking mode.
  const bool blocking = env_flag("TANDEM_NCCL_BLOCKING");
  ncclConfig_t cfg = make_config(blocking);
  ncclComm_t comm = nullptr;
  ncclResult_t rc = ncclCommInitRankConfig(&comm, size, id, rank, &cfg);
  rc = settle(comm, rc, opts.timeout);
  if (rc == ncclInProgress) {
    ncclCommAbort(comm);
    throw CommTimeout(where + " timed out after " + seconds_str(opts.timeout) +
                      "; did every rank start and reach initialization? (NCCL_DEBUG=WARN shows NCCL's view)");
  }
  if (rc != ncclSuccess) {
    std::string msg = nccl_message(rc);
    if (comm) ncclCommAbort(comm);
    throw CommError(where + " failed: " + msg +
                    ". Every rank needs its own GPU (LOCAL_RANK picks it; check CUDA_VISIBLE_DEVICES), and NCCL must "
                    "reach the other ranks (NCCL_SOCKET_IFNAME); set NCCL_DEBUG=WARN for details");
  }
  return std::make_shared<NcclCommunicator>(comm, static_cast<c10::DeviceIndex>(device_index), blocking, opts);
}

std::vector<CommPtr> make_nccl_device_communicators(const std::vector<int>& devices, const CommOptions& opts) {
  using namespace detail;
  const std::string where = "NCCL initialization of " + std::to_string(devices.size()) + " devices in one process";
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess) {
    (void)cudaGetLastError();
    ndev = 0;
  }
  for (int d : devices) {
    if (d < 0 || d >= ndev) {
      throw CommError(where + ": no CUDA device " + std::to_string(d) + " (this process sees " + std::to_string(ndev) +
                      "); use at most " + std::to_string(ndev) + " replicas");
    }
  }
  // ncclCommInitAll initializes every device's communicator in one blocking call (there is no
  // configurable form); the collectives afterwards are issued by one thread per device.
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  ncclResult_t rc = ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data());
  if (rc != ncclSuccess) throw CommError(where + " failed: " + nccl_message(rc) + "; set NCCL_DEBUG=WARN for details");
  std::vector<CommPtr> out;
  for (size_t r = 0; r < devices.size(); ++r) {
    out.push_back(std::make_shared<NcclCommunicator>(comms[r], static_cast<c10::DeviceIndex>(devices[r]),
                                                     /*blocking=*/true, opts));
  }
  return out;
}

}  // namespace tandem
