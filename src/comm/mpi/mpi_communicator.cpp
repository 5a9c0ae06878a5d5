// The MPI backend's communicator: its construction and destruction, split(), the checks made
// before an operation is queued (arguments, TANDEM_CHECK_COLLECTIVES), and MPI's own init and exit.
#include "comm/mpi/mpi_communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/backends.h"
#include "tandem/comm.h"

namespace tandem {

bool has_mpi_backend() { return true; }

namespace detail {

MpiCommunicator::MpiCommunicator(MPI_Comm comm, const CommOptions& opts) : Communicator(opts), comm_(comm) {
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
MpiCommunicator::~MpiCommunicator() {
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

CommPtr MpiCommunicator::split(int color, int key) {
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

// ---- collective-mismatch guard (TANDEM_CHECK_COLLECTIVES=1, a debug option)
// Before each collective, the ranks all-gather a fingerprint (sequence number, operation,
// dtype, element count, shape, reduce op or root) on a duplicate of the communicator and
// compare: a program whose ranks disagree gets a CommError naming the ranks and their
// operations instead of a hang or a wrong result. Costs one small all-gather per collective.
std::string MpiCommunicator::describe_fingerprint(const int64_t* f) {
  static const char* names[] = {"?",         "allreduce", "reduce_scatter", "allgather",
                                "broadcast", "barrier",   "split",          "alltoall"};
  std::string s = names[(f[1] >= 1 && f[1] <= kOpAlltoall) ? f[1] : 0];
  if (f[1] == kOpAllreduce || f[1] == kOpReduceScatter)
    s += std::string("(") + to_string(static_cast<ReduceOp>(f[5])) + ")";
  if (f[1] == kOpBroadcast) s += "(root " + std::to_string(f[5]) + ")";
  if (f[1] == kOpAlltoall) {  // the ranks' row counts differ; the row's type and shape may not
    return s + " of " + c10::toString(static_cast<at::ScalarType>(f[2])) + " rows of " + std::to_string(f[5]) +
           " elements (collective #" + std::to_string(f[0]) + ")";
  }
  if (f[2] >= 0)
    s += std::string(" of ") + c10::toString(static_cast<at::ScalarType>(f[2])) + " x " + std::to_string(f[3]);
  return s + " (collective #" + std::to_string(f[0]) + ")";
}

void MpiCommunicator::verify(int64_t op, int64_t extra, const at::Tensor* t, const std::string& what) {
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

void MpiCommunicator::check_cpu(const at::Tensor& t, const std::string& what) const {
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

void MpiCommunicator::check_pair(const at::Tensor& out, const at::Tensor& in, const std::string& what) const {
  if (!out.defined() || !out.device().is_cpu() || out.layout() != at::kStrided ||
      out.scalar_type() != in.scalar_type()) {
    throw CommError(what + ": output must be a dense (strided) CPU tensor of the input's dtype");
  }
}

// `chunk` is chunk rank_ of the contiguous `whole` (NCCL's in-place convention).
bool MpiCommunicator::is_own_chunk(const at::Tensor& chunk, const at::Tensor& whole) const {
  if (!chunk.is_contiguous() || !whole.is_contiguous() || !chunk.is_alias_of(whole)) return false;
  auto* base = static_cast<const char*>(whole.data_ptr());
  return static_cast<const char*>(chunk.data_ptr()) == base + rank_ * chunk.numel() * chunk.element_size();
}

void MpiCommunicator::check_peer(int peer, const std::string& what) const {
  if (peer < 0 || peer >= size_) {
    throw CommError(what + ": peer rank " + std::to_string(peer) + " out of range for world size " +
                    std::to_string(size_));
  }
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
