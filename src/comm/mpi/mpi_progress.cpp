// The MPI backend's progress thread: the queue of pending operations, the Work handles callers
// wait on (with a timeout), and the loop that issues and completes the MPI calls.
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi/mpi_communicator.h"
#include "tandem/comm.h"
#include "tandem/trace.h"

namespace tandem {
namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

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

WorkPtr MpiCommunicator::enqueue(const char* name, const std::string& what, int64_t bytes,
                                 std::function<void(std::vector<MPI_Request>&)> start, std::function<void()> finish,
                                 std::function<void()> blocking) {
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
void MpiCommunicator::complete(PendingOp& op, bool run_blocking) {
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
void MpiCommunicator::abandon(std::vector<std::shared_ptr<PendingOp>>& inflight) {
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

void MpiCommunicator::loop() {
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

}  // namespace detail
}  // namespace tandem
