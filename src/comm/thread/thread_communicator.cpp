// The thread backend: the ranks are threads of one process (tandem/backends.h,
// make_thread_communicators). A collective is a rendezvous of the group's ranks on their
// communicators' worker threads: each posts its call, all check that the calls agree, each
// rank reduces or copies its own share of the elements directly from and into the peers'
// tensors, and a second rendezvous keeps every tensor alive and unchanged until all shares
// are done. Sums run in rank order on one rank per element range and are copied to all, so
// every rank gets the same bits (as the MPI backend's shared-memory path). The hierarchical
// form (make_hierarchical_communicator) composes a thread group with a communicator over the
// processes.
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>

#include "comm/backends.h"
#include "tandem/backends.h"
#include "tandem/comm.h"

namespace tandem {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

std::string seconds_text(std::chrono::milliseconds t) {
  std::ostringstream os;
  os << std::chrono::duration<double>(t).count() << " s";
  return os.str();
}

// Shared by a group and every group split from it: a failed rank ends them all.
struct Family {
  std::atomic<bool> aborted{false};
  std::mutex mu;
  std::string why;
  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lk(mu);
    if (!aborted) why = reason;
    aborted = true;
  }
  std::string reason() {
    std::lock_guard<std::mutex> lk(mu);
    return why;
  }
};

struct Group;

// One rank's side of a collective, alive on its worker's stack until the second rendezvous.
struct Call {
  std::string op;  // "allreduce(sum)", ...
  at::Tensor in, out;
  int root = 0;
  int color = 0, key = 0;
  std::shared_ptr<Group>* split_result = nullptr;
  // alltoall: the ranks' row counts differ, so their calls agree on the rows' type and shape.
  bool rows = false;
  std::vector<int64_t> in_splits, out_splits;
};

// A message in flight: the sender's copy, taken in post order by the receiver's recvs.
struct Mailbox {
  int64_t sent = 0, taken = 0;
  std::map<int64_t, at::Tensor> messages;  // by send sequence number
};

struct Group {
  Group(int n, std::shared_ptr<Family> f) : size(n), family(std::move(f)), calls(n), arrived(n, false) {}
  const int size;
  std::shared_ptr<Family> family;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<const Call*> calls;
  std::vector<bool> arrived;
  int count = 0;
  uint64_t generation = 0;
  std::string broken;  // a rank timed out in a rendezvous: later operations fail at once
  std::map<std::tuple<int, int, int>, Mailbox> boxes;  // (src, dst, tag)
  std::condition_variable mail_cv;

  // Waits on `cv` under `lk` until `done`, failing on abort, a broken group or the deadline.
  template <class Done>
  void wait(std::unique_lock<std::mutex>& lk, std::condition_variable& c, Done done, Clock::time_point deadline,
            const std::string& what, const std::function<std::string()>& timed_out) {
    while (!done()) {
      if (family->aborted) throw CommError(what + ": " + family->reason());
      if (!broken.empty()) throw CommError(what + ": " + broken);
      if (Clock::now() >= deadline) throw CommTimeout(timed_out());
      c.wait_for(lk, std::chrono::milliseconds(20));
    }
  }

  // All ranks meet; `call` (may be null) is visible to the others until the next rendezvous.
  void rendezvous(int rank, const Call* call, const std::string& what, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lk(mu);
    if (family->aborted) throw CommError(what + ": " + family->reason());
    if (!broken.empty()) throw CommError(what + ": " + broken);
    calls[rank] = call;
    arrived[rank] = true;
    const uint64_t gen = generation;
    if (++count == size) {
      count = 0;
      std::fill(arrived.begin(), arrived.end(), false);
      ++generation;
      cv.notify_all();
      return;
    }
    try {
      wait(
          lk, cv, [&] { return generation != gen; }, Clock::now() + timeout, what,
          [&] {
            std::string missing;
            for (int r = 0; r < size; ++r)
              if (!arrived[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
            return what + ": timed out after " + seconds_text(timeout) + " waiting for rank(s) " + missing +
                   " of this process's thread group to reach the same operation; did a replica fail or issue "
                   "different collectives?";
          });
    } catch (const CommTimeout& e) {
      broken = std::string("the thread group is unusable after an earlier timeout (") + e.what() + ")";
      cv.notify_all();
      throw;
    }
  }
};

void describe_call(std::ostream& os, const Call& c) {
  os << c.op;
  if (!c.in.defined()) return;
  os << " of " << c10::toString(c.in.scalar_type());
  if (c.rows) {
    os << " rows of shape " << c.in.sizes().slice(1);
  } else {
    os << " x " << c.in.numel();
  }
}

// Every rank's alltoall sends each peer the rows that peer expects from it.
void check_alltoall_splits(const Group& g, const std::string& what) {
  for (int src = 0; src < g.size; ++src) {
    for (int dst = 0; dst < g.size; ++dst) {
      const int64_t sent = g.calls[src]->in_splits[dst], expected = g.calls[dst]->out_splits[src];
      if (sent != expected) {
        throw CommError(what + ": rank " + std::to_string(src) + " sends " + std::to_string(sent) + " rows to rank " +
                        std::to_string(dst) + ", which expects " + std::to_string(expected) +
                        " from it; exchange the counts first");
      }
    }
  }
}

// The ranks' calls must agree, else every rank throws the same description.
void check_calls(const Group& g, int rank, const std::string& what) {
  const Call& a = *g.calls[0];
  for (int r = 1; r < g.size; ++r) {
    const Call& b = *g.calls[r];
    bool same = a.op == b.op && a.root == b.root && a.rows == b.rows && a.in.defined() == b.in.defined();
    if (same && a.in.defined()) {
      same = a.in.scalar_type() == b.in.scalar_type() &&
             (a.rows ? a.in.sizes().slice(1) == b.in.sizes().slice(1) : a.in.numel() == b.in.numel());
    }
    if (!same) {
      std::ostringstream os;
      os << what << ": the ranks' collectives differ: rank 0 calls ";
      describe_call(os, a);
      os << ", rank " << r << " calls ";
      describe_call(os, b);
      throw CommError(os.str());
    }
  }
  if (a.rows) check_alltoall_splits(g, what);
}

// Elements [lo, hi) of n owned by `rank` of `size`.
std::pair<int64_t, int64_t> share(int64_t n, int rank, int size) { return {n * rank / size, n * (rank + 1) / size}; }

at::Tensor flat(const at::Tensor& t) { return t.view({-1}); }

// Rank-order reduction of the same range of every rank's tensor (picked by `part`).
at::Tensor reduce_range(const Group& g, ReduceOp op, const std::function<at::Tensor(const Call&)>& part) {
  at::Tensor acc = part(*g.calls[0]).clone();
  for (int r = 1; r < g.size; ++r) {
    if (op == ReduceOp::kMax) {
      at::maximum_out(acc, acc, part(*g.calls[r]));
    } else {
      acc.add_(part(*g.calls[r]));
    }
  }
  if (op == ReduceOp::kAvg) acc.div_(g.size);
  return acc;
}

class TaskWork : public Work {
 public:
  TaskWork(std::string what, std::chrono::milliseconds timeout) : what_(std::move(what)), timeout_(timeout) {}
  void wait() override {
    std::unique_lock<std::mutex> lk(mu_);
    // The worker's own rendezvous is bounded by the timeout; the margin covers the ranks'
    // share of the work itself.
    if (!cv_.wait_for(lk, 2 * timeout_ + std::chrono::seconds(1), [&] { return done_; })) {
      throw CommTimeout(what_ + ": not completed after " + seconds_text(2 * timeout_) +
                        "; the operations queued before it on this rank did not finish");
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lk(mu_);
    return done_;
  }
  double seconds() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return seconds_;
  }
  void finish(std::exception_ptr e, double s) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ = true;
      error_ = std::move(e);
      seconds_ = s;
    }
    cv_.notify_all();
  }

 private:
  std::string what_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  double seconds_ = 0.0;
};

// Runs a rank's operations in issue order on a thread of its own, so that the caller's compute
// goes on while they wait for the peers. Destruction drains the queue: each operation ends
// within the timeout.
class Worker {
 public:
  // ATen's first parallel operation on a thread calls at::set_num_threads, which also resets
  // process-wide state (the shared pthreadpool's size, oneDNN's primitive cache): the worker
  // runs one before the constructor returns, so that it never happens while a replica computes.
  Worker()
      : thread_([this] {
          at::ones({1 << 16}, at::kFloat).add_(1);
          {
            std::lock_guard<std::mutex> lk(mu_);
            started_ = true;
          }
          cv_.notify_all();
          run();
        }) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return started_; });
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Queues `body`; the Work completes when it returns (with its exception, if any), and
  // `on_seconds` gets its duration when it succeeded.
  WorkPtr submit(const std::string& what, std::chrono::milliseconds timeout, std::function<void()> body,
                 std::function<void(double)> on_seconds) {
    auto work = std::make_shared<TaskWork>(what, timeout);
    auto task = [body = std::move(body), on_seconds = std::move(on_seconds), work] {
      auto t0 = Clock::now();
      std::exception_ptr err;
      try {
        body();
      } catch (...) {
        err = std::current_exception();
      }
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!err && on_seconds) on_seconds(s);
      work->finish(err, s);
    };
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
    return work;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false, started_ = false;
  std::thread thread_;  // last: started once the rest is built
};

class RecvWork : public Work {
 public:
  RecvWork(std::shared_ptr<Group> g, std::tuple<int, int, int> key, int64_t seq, at::Tensor dst, std::string what,
           std::chrono::milliseconds timeout)
      : g_(std::move(g)), key_(key), seq_(seq), dst_(std::move(dst)), what_(std::move(what)), timeout_(timeout) {}
  void wait() override {
    if (done_) return;
    std::unique_lock<std::mutex> lk(g_->mu);
    auto& box = g_->boxes[key_];
    g_->wait(
        lk, g_->mail_cv, [&] { return box.messages.count(seq_) > 0; }, Clock::now() + timeout_, what_,
        [&] {
          return what_ + ": timed out after " + seconds_text(timeout_) + " waiting for rank " +
                 std::to_string(std::get<0>(key_)) + " to send";
        });
    take(box);
  }
  bool is_completed() override {
    if (done_) return true;
    std::lock_guard<std::mutex> lk(g_->mu);
    auto& box = g_->boxes[key_];
    if (box.messages.count(seq_) == 0) return false;
    take(box);
    return true;
  }

 private:
  void take(Mailbox& box) {
    at::Tensor m = std::move(box.messages[seq_]);
    box.messages.erase(seq_);
    if (m.numel() != dst_.numel() || m.scalar_type() != dst_.scalar_type()) {
      done_ = true;
      throw CommError(what_ + ": the matching send carries " + c10::toString(m.scalar_type()) + " x " +
                      std::to_string(m.numel()));
    }
    dst_.copy_(m.view(dst_.sizes()));
    done_ = true;
  }
  std::shared_ptr<Group> g_;
  std::tuple<int, int, int> key_;
  int64_t seq_;
  at::Tensor dst_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  bool done_ = false;
};

class ThreadCommunicator : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<Group> g, int rank, const CommOptions& o)
      : Communicator(o), g_(std::move(g)), rank_(rank), worker_(std::make_unique<Worker>()) {}

  ~ThreadCommunicator() override { worker_.reset(); }  // before the members its operations use

  int rank() const override { return rank_; }
  int size() const override { return g_->size; }
  std::string backend() const override { return "thread"; }

  WorkPtr allreduce_async(at::Tensor t, ReduceOp op) override {
    const std::string name = std::string("allreduce(") + to_string(op) + ")";
    auto what = describe(rank_, name, t);
    check_tensor(t, what);
    check_op(op, t, what);
    return collective("allreduce", name, what, t, t, 0, [this, op, what, t](Call& c) mutable {
      c.in = c.in.contiguous();  // the peers read and write this rank's contiguous buffer
      exchange(c, what, [&] {
        auto [lo, hi] = share(c.in.numel(), rank_, g_->size);
        if (hi == lo) return;
        auto sum = reduce_range(*g_, op, [&](const Call& p) { return flat(p.in).narrow(0, lo, hi - lo); });
        for (const Call* p : g_->calls) flat(p->in).narrow(0, lo, hi - lo).copy_(sum);
      });
      if (!c.in.is_same(t)) t.copy_(c.in.view(t.sizes()));
    });
  }

  WorkPtr reduce_scatter_async(at::Tensor out, at::Tensor in, ReduceOp op) override {
    const std::string name = std::string("reduce_scatter(") + to_string(op) + ")";
    auto what = describe(rank_, name, in);
    check_tensor(in, what);
    check_pair(out, in, what);
    check_op(op, in, what);
    if (in.numel() != out.numel() * size()) {
      throw CommError(what + ": input has " + std::to_string(in.numel()) + " elements, expected world size " +
                      std::to_string(size()) + " x output's " + std::to_string(out.numel()));
    }
    return collective("reduce_scatter", name, what, in, out, 0, [this, op, what](Call& c) {
      c.in = c.in.contiguous();
      const int64_t n = c.out.numel();
      exchange(c, what, [&] {
        // Rank r's chunk is read by rank r only, so writing it in place is safe.
        auto sum = reduce_range(*g_, op, [&](const Call& p) { return flat(p.in).narrow(0, rank_ * n, n); });
        c.out.copy_(sum.view(c.out.sizes()));
      });
    });
  }

  WorkPtr allgather_async(at::Tensor out, at::Tensor in) override {
    auto what = describe(rank_, "allgather", in);
    check_tensor(in, what);
    check_pair(out, in, what);
    if (out.numel() != in.numel() * size()) {
      throw CommError(what + ": output has " + std::to_string(out.numel()) + " elements, expected world size " +
                      std::to_string(size()) + " x input's " + std::to_string(in.numel()));
    }
    return collective("allgather", "allgather", what, in, out, 0, [this, what](Call& c) {
      c.in = c.in.contiguous();
      at::Tensor dst = c.out.is_contiguous() ? c.out : at::empty(c.out.sizes(), c.out.options());
      const int64_t n = c.in.numel();
      exchange(c, what, [&] {
        // Each rank writes only its own output; an in-place input is its own chunk, not rewritten.
        for (int r = 0; r < g_->size; ++r) {
          auto src = flat(g_->calls[r]->in);
          auto chunk = flat(dst).narrow(0, r * n, n);
          if (src.data_ptr() != chunk.data_ptr()) chunk.copy_(src);
        }
      });
      if (!dst.is_same(c.out)) c.out.copy_(dst);
    });
  }

  WorkPtr broadcast_async(at::Tensor t, int root) override {
    auto what = describe(rank_, "broadcast(root " + std::to_string(root) + ")", t);
    check_tensor(t, what);
    if (root < 0 || root >= size()) {
      throw CommError(what + ": root " + std::to_string(root) + " out of range for world size " +
                      std::to_string(size()));
    }
    return collective("broadcast", "broadcast", what, t, t, root, [this, root, what](Call& c) {
      c.in = c.in.contiguous();
      exchange(c, what, [&] {
        if (rank_ != root) c.out.copy_(g_->calls[root]->in.view(c.out.sizes()));
      });
    });
  }

  WorkPtr barrier_async() override {
    auto what = describe(rank_, "barrier", at::Tensor());
    return collective("barrier", "barrier", what, at::Tensor(), at::Tensor(), 0,
                      [this, what](Call& c) { exchange(c, what, [] {}); });
  }

  WorkPtr alltoall_async(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits,
                         std::vector<int64_t> in_splits) override {
    auto what = describe(rank_, "alltoall", in);
    check_tensor(in, what);
    check_alltoall(rank_, size(), out, in, out_splits, in_splits);
    return collective("alltoall", "alltoall", what, in, out, 0, [this, what, out_splits, in_splits](Call& c) {
      c.rows = true;
      c.in_splits = in_splits;
      c.out_splits = out_splits;
      exchange(c, what, [&] {
        // Each rank writes only its own output, reading its rows from the peers' inputs.
        const auto roff = split_offsets(c.out_splits);
        for (int j = 0; j < g_->size; ++j) {
          const Call& peer = *g_->calls[j];
          const int64_t from = split_offsets(peer.in_splits)[rank_];
          c.out.narrow(0, roff[j], c.out_splits[j]).copy_(peer.in.narrow(0, from, c.out_splits[j]));
        }
      });
    });
  }

  WorkPtr send_async(at::Tensor t, int dst, int tag) override {
    auto what = describe(rank_, "send to rank " + std::to_string(dst) + " (tag " + std::to_string(tag) + ")", t);
    check_tensor(t, what);
    check_peer(dst, what);
    record("send", t.numel() * t.element_size());
    at::Tensor copy = t.contiguous().clone();
    {
      std::lock_guard<std::mutex> lk(g_->mu);
      auto& box = g_->boxes[{rank_, dst, tag}];
      box.messages[box.sent++] = std::move(copy);
    }
    g_->mail_cv.notify_all();
    return completed_work();
  }

  WorkPtr recv_async(at::Tensor t, int src, int tag) override {
    auto what = describe(rank_, "recv from rank " + std::to_string(src) + " (tag " + std::to_string(tag) + ")", t);
    check_tensor(t, what);
    check_peer(src, what);
    record("recv", t.numel() * t.element_size());
    std::tuple<int, int, int> key{src, rank_, tag};
    int64_t seq = 0;
    {
      std::lock_guard<std::mutex> lk(g_->mu);
      seq = g_->boxes[key].taken++;
    }
    return std::make_shared<RecvWork>(g_, key, seq, t, what, timeout());
  }

  CommPtr split(int color, int key) override {
    auto what = describe(rank_, "split(color " + std::to_string(color) + ")", at::Tensor());
    std::shared_ptr<Group> mine;
    auto w = collective("", "split", what, at::Tensor(), at::Tensor(), 0, [this, color, key, &mine, what](Call& c) {
      c.color = color;
      c.key = key;
      c.split_result = &mine;
      exchange(c, what, [&] { make_split_groups(); });
    });
    w->wait();
    if (color < 0) return nullptr;
    return std::make_shared<ThreadCommunicator>(mine, split_rank_, CommOptions{timeout()});
  }

  // Fails this group's and its splits' pending and later operations with `why`.
  void abort(const std::string& why) {
    g_->family->abort(why);
    g_->cv.notify_all();
    g_->mail_cv.notify_all();
  }

 private:
  // Run on the worker: the lowest rank of each color builds its group and hands it, with the
  // members' new ranks, to every member.
  void make_split_groups() {
    const auto& calls = g_->calls;
    const int me_color = calls[rank_]->color;
    if (me_color < 0) return;
    std::vector<int> members;
    for (int r = 0; r < g_->size; ++r)
      if (calls[r]->color == me_color) members.push_back(r);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return calls[a]->key < calls[b]->key; });
    split_rank_ = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    int lowest = *std::min_element(members.begin(), members.end());
    if (rank_ != lowest) return;
    auto group = std::make_shared<Group>(static_cast<int>(members.size()), g_->family);
    for (int r : members) *calls[r]->split_result = group;
  }

  void check_tensor(const at::Tensor& t, const std::string& what) const {
    if (!t.defined()) throw CommError(what + ": undefined tensor");
    if (!t.device().is_cpu()) {
      throw CommError(what + ": the thread backend moves CPU tensors; this one is on " + t.device().str() +
                      " (replicas on CUDA devices use NCCL)");
    }
  }
  void check_peer(int peer, const std::string& what) const {
    if (peer < 0 || peer >= size() || peer == rank_) {
      throw CommError(what + ": peer " + std::to_string(peer) + " is not another rank of world size " +
                      std::to_string(size()));
    }
  }
  static void check_pair(const at::Tensor& out, const at::Tensor& in, const std::string& what) {
    if (!out.defined() || out.device() != in.device() || out.scalar_type() != in.scalar_type()) {
      throw CommError(what + ": input and output differ in device or dtype");
    }
  }
  static void check_op(ReduceOp op, const at::Tensor& t, const std::string& what) {
    if (op == ReduceOp::kAvg && !at::isFloatingType(t.scalar_type())) {
      throw CommError(what + ": avg needs a floating-point tensor; use sum on " + c10::toString(t.scalar_type()));
    }
  }

  // Phase one (all calls posted and checked), this rank's share, phase two (all shares done).
  void exchange(Call& c, const std::string& what, const std::function<void()>& mine) {
    g_->rendezvous(rank_, &c, what, timeout());
    // A failure still meets the peers: they read this rank's call until then (every rank finds
    // the same mismatch, and a failed share would otherwise leave them waiting).
    std::exception_ptr failed;
    try {
      check_calls(*g_, rank_, what);
      mine();
    } catch (...) {
      failed = std::current_exception();
    }
    g_->rendezvous(rank_, &c, what, timeout());
    if (failed) std::rethrow_exception(failed);
  }

  WorkPtr collective(const std::string& stat, const std::string& op, const std::string& what, at::Tensor in,
                     at::Tensor out, int root, std::function<void(Call&)> body) {
    if (!stat.empty()) record(stat, in.defined() ? in.numel() * in.element_size() : 0);
    auto run = [op, in, out, root, body = std::move(body)] {
      Call c;
      c.op = op;
      c.in = in;
      c.out = out;
      c.root = root;
      body(c);
    };
    std::function<void(double)> seconds;
    if (!stat.empty()) seconds = [this, stat](double s) { record_seconds(stat, s); };
    return worker_->submit(what, timeout(), std::move(run), std::move(seconds));
  }

  std::shared_ptr<Group> g_;
  const int rank_;
  int split_rank_ = 0;  // written by the worker during split, read after its wait
  std::unique_ptr<Worker> worker_;
};

// Rank p * K + k: thread k of process p. A collective reduces (or gathers) inside the process
// on the thread group, the processes' thread 0s combine the results over `procs`, and thread 0
// shares it inside the process again: every rank gets thread 0's bits. Reduce-scatter reduces
// the whole input this way and keeps its chunk (a faster form would reduce-scatter inside the
// process first and send only 1/K across); correctness first.
class HierarchicalCommunicator : public Communicator {
 public:
  HierarchicalCommunicator(CommPtr local, CommPtr procs, const CommOptions& o)
      : Communicator(o), local_(std::move(local)), procs_(std::move(procs)), k_(local_->rank()), kk_(local_->size()),
        p_(procs_->rank()), pp_(procs_->size()), worker_(std::make_unique<Worker>()) {}
  ~HierarchicalCommunicator() override { worker_.reset(); }

  int rank() const override { return p_ * kk_ + k_; }
  int size() const override { return pp_ * kk_; }
  std::string backend() const override { return "thread+" + procs_->backend(); }

  WorkPtr allreduce_async(at::Tensor t, ReduceOp op) override {
    auto what = describe(rank(), std::string("allreduce(") + to_string(op) + ")", t);
    return submit("allreduce", what, t, [this, t, op]() mutable {
      at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
      reduce_everywhere(buf, op);
      if (!buf.is_same(t)) t.copy_(buf);
    });
  }

  WorkPtr reduce_scatter_async(at::Tensor out, at::Tensor in, ReduceOp op) override {
    auto what = describe(rank(), std::string("reduce_scatter(") + to_string(op) + ")", in);
    if (in.numel() != out.numel() * size()) {
      throw CommError(what + ": input has " + std::to_string(in.numel()) + " elements, expected world size " +
                      std::to_string(size()) + " x output's " + std::to_string(out.numel()));
    }
    return submit("reduce_scatter", what, in, [this, out, in, op]() mutable {
      at::Tensor buf = in.contiguous().clone();
      reduce_everywhere(buf, op);
      out.copy_(buf.view({-1}).narrow(0, rank() * out.numel(), out.numel()).view(out.sizes()));
    });
  }

  WorkPtr allgather_async(at::Tensor out, at::Tensor in) override {
    auto what = describe(rank(), "allgather", in);
    if (out.numel() != in.numel() * size()) {
      throw CommError(what + ": output has " + std::to_string(out.numel()) + " elements, expected world size " +
                      std::to_string(size()) + " x input's " + std::to_string(in.numel()));
    }
    return submit("allgather", what, in, [this, out, in]() mutable {
      auto mine = in.contiguous().clone().view({-1});  // the input may be a chunk of the output
      auto process = at::empty({kk_ * mine.numel()}, mine.options());
      local_->allgather(process, mine);
      auto all = at::empty({out.numel()}, out.options());
      if (k_ == 0) procs_->allgather(all, process);  // process p's block is ranks p * K ...
      local_->broadcast(all, 0);
      out.copy_(all.view(out.sizes()));
    });
  }

  WorkPtr broadcast_async(at::Tensor t, int root) override {
    auto what = describe(rank(), "broadcast(root " + std::to_string(root) + ")", t);
    if (root < 0 || root >= size()) {
      throw CommError(what + ": root " + std::to_string(root) + " out of range for world size " +
                      std::to_string(size()));
    }
    return submit("broadcast", what, t, [this, t, root]() mutable {
      at::Tensor buf = t.contiguous();
      if (p_ == root / kk_) local_->broadcast(buf, root % kk_);  // to thread 0 of the root's process
      if (k_ == 0) procs_->broadcast(buf, root / kk_);
      local_->broadcast(buf, 0);
      if (!buf.is_same(t)) t.copy_(buf);
    });
  }

  WorkPtr barrier_async() override {
    return submit("", describe(rank(), "barrier", at::Tensor()), at::Tensor(), [this] {
      local_->barrier();
      if (k_ == 0) procs_->barrier();
      local_->barrier();
    });
  }

  // Between processes through `procs`, the thread pair encoded in the tag.
  WorkPtr send_async(at::Tensor t, int dst, int tag) override {
    check_peer(dst, "send", t);
    record("send", t.numel() * t.element_size());
    return routed_send(t, dst, tag);
  }
  WorkPtr recv_async(at::Tensor t, int src, int tag) override {
    check_peer(src, "recv", t);
    record("recv", t.numel() * t.element_size());
    return routed_recv(t, src, tag);
  }

  // A send and a receive per peer with rows to move, on a tag of its own; the worker runs one
  // collective at a time, so successive all-to-alls between two ranks match in order.
  WorkPtr alltoall_async(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits,
                         std::vector<int64_t> in_splits) override {
    auto what = describe(rank(), "alltoall", in);
    check_alltoall(rank(), size(), out, in, out_splits, in_splits);
    return submit("alltoall", what, in, [this, out, in, out_splits, in_splits]() mutable {
      const auto soff = split_offsets(in_splits), roff = split_offsets(out_splits);
      const int me = rank();
      std::vector<WorkPtr> works;
      for (int j = 0; j < size(); ++j) {
        if (j != me && out_splits[j] > 0)
          works.push_back(routed_recv(out.narrow(0, roff[j], out_splits[j]), j, kAlltoallTag));
      }
      for (int j = 0; j < size(); ++j) {
        if (j != me && in_splits[j] > 0)
          works.push_back(routed_send(in.narrow(0, soff[j], in_splits[j]), j, kAlltoallTag));
      }
      if (out_splits[me] != in_splits[me]) {
        throw CommError(describe(me, "alltoall", in) + ": sends " + std::to_string(in_splits[me]) +
                        " rows to itself but expects " + std::to_string(out_splits[me]));
      }
      out.narrow(0, roff[me], out_splits[me]).copy_(in.narrow(0, soff[me], in_splits[me]));
      for (auto& w : works) w->wait();
    });
  }

  CommPtr split(int, int) override {
    throw CommError(describe(rank(), "split", at::Tensor()) +
                    ": splitting replicas of several processes is not supported (it is what --tp and --pp do); use "
                    "--replicas with one process, or -n alone");
  }

 private:
  // In place on a contiguous tensor: the group's reduction on every rank.
  void reduce_everywhere(at::Tensor& buf, ReduceOp op) {
    const ReduceOp sum = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    // fp16 averages divide first, as the MPI backend's: the sum may overflow where the mean does not.
    const bool pre = op == ReduceOp::kAvg && buf.scalar_type() == at::kHalf;
    if (op == ReduceOp::kAvg && !at::isFloatingType(buf.scalar_type())) {
      throw CommError(describe(rank(), "allreduce(avg)", buf) + ": avg needs a floating-point tensor");
    }
    if (pre) buf.div_(size());
    local_->allreduce(buf, sum);
    if (k_ == 0) procs_->allreduce(buf, sum);
    local_->broadcast(buf, 0);
    if (op == ReduceOp::kAvg && !pre) buf.div_(size());
  }

  int pair_tag(int tag, int from, int to) const { return (tag * kk_ + from) * kk_ + to; }

  // All-to-all's messages: a tag above those of the pipelines' point-to-point traffic.
  static constexpr int kAlltoallTag = 1 << 20;
  WorkPtr routed_send(const at::Tensor& t, int dst, int tag) {
    if (dst / kk_ == p_) return local_->send_async(t, dst % kk_, tag);
    return procs_->send_async(t, dst / kk_, pair_tag(tag, k_, dst % kk_));
  }
  WorkPtr routed_recv(const at::Tensor& t, int src, int tag) {
    if (src / kk_ == p_) return local_->recv_async(t, src % kk_, tag);
    return procs_->recv_async(t, src / kk_, pair_tag(tag, src % kk_, k_));
  }

  void check_peer(int peer, const char* op, const at::Tensor& t) const {
    if (peer < 0 || peer >= size() || peer == rank()) {
      throw CommError(describe(rank(), op, t) + ": peer " + std::to_string(peer) +
                      " is not another rank of world size " + std::to_string(size()));
    }
  }

  WorkPtr submit(const std::string& stat, const std::string& what, const at::Tensor& t, std::function<void()> body) {
    if (!stat.empty()) record(stat, t.defined() ? t.numel() * t.element_size() : 0);
    std::function<void(double)> seconds;
    if (!stat.empty()) seconds = [this, stat](double s) { record_seconds(stat, s); };
    return worker_->submit(what, timeout(), std::move(body), std::move(seconds));
  }

  CommPtr local_, procs_;
  const int k_, kk_, p_, pp_;
  std::unique_ptr<Worker> worker_;
};

}  // namespace
}  // namespace detail

std::vector<CommPtr> make_thread_communicators(int size, const CommOptions& opts) {
  if (size < 1) throw CommError("a thread group needs at least 1 rank, got " + std::to_string(size));
  auto group = std::make_shared<detail::Group>(size, std::make_shared<detail::Family>());
  std::vector<CommPtr> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_shared<detail::ThreadCommunicator>(group, r, opts));
  return out;
}

void abort_thread_group(Communicator& comm, const std::string& why) {
  auto* t = dynamic_cast<detail::ThreadCommunicator*>(&comm);
  if (!t) throw std::invalid_argument("abort_thread_group: communicator is a '" + comm.backend() + "' one");
  t->abort(why);
}

}  // namespace tandem

namespace tandem {

CommPtr make_hierarchical_communicator(CommPtr local, CommPtr processes, const CommOptions& opts) {
  if (!local || !processes || local->backend() != "thread") {
    throw CommError("make_hierarchical_communicator needs a thread group's communicator and one over the processes");
  }
  return std::make_shared<detail::HierarchicalCommunicator>(std::move(local), std::move(processes), opts);
}

}  // namespace tandem
