// Tandem's communication layer: one backend-neutral interface over at::Tensor.
// Backends: MPI (CPU tensors, OpenMPI) and NCCL (CUDA tensors). Every operation has an
// async form returning a Work handle; Work::wait() rethrows failures with rank, operation
// and size, and every blocking wait is bounded by the communicator's timeout (default 5 min).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem {

enum class ReduceOp { kSum, kAvg, kMax };
const char* to_string(ReduceOp op);

// A failure of a communication operation. The message names the rank, the operation,
// the tensor and what to do next.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A blocking wait ran past the communicator's timeout.
class CommTimeout : public CommError {
 public:
  using CommError::CommError;
};

// Handle on an operation in flight.
//  - wait(): CPU backends block until done (bounded by the timeout). CUDA backends make the
//    caller's current stream wait for the operation (no host blocking), after which the
//    result may be used by kernels on that stream.
//  - synchronize(): block the host until the operation has completed, bounded by the timeout.
// Both rethrow a failure of the operation, with rank, operation and tensor size in the message.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual void synchronize() { wait(); }
  virtual bool is_completed() = 0;
  // Seconds the backend spent executing the operation (from its start on the engine to its
  // end); 0 until completed. Used for communication accounting.
  virtual double seconds() const { return 0.0; }
};
using WorkPtr = std::shared_ptr<Work>;

// Per-operation counters: calls, payload bytes this rank handed to the operation, and
// seconds spent on the engine.
struct OpStats {
  int64_t calls = 0;
  int64_t bytes = 0;
  double seconds = 0.0;
};

struct CommOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // MPI backend: how a rank's progress thread waits while the rank is blocked on an operation
  // that has not moved for a while. 0: it yields and polls again (lowest latency, but on more
  // threads than cores it competes with the ranks that compute); > 0: it sleeps that many
  // microseconds between polls; -1: decided by the Runtime (sleeps where this node's ranks
  // times compute threads exceed its cores). TANDEM_MPI_WAIT_SLEEP_US overrides it.
  int wait_sleep_us = -1;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "mpi" or "nccl"

  // In place on `tensor`.
  virtual WorkPtr allreduce_async(at::Tensor tensor, ReduceOp op = ReduceOp::kSum) = 0;
  // input.numel() == size() * output.numel(); rank r receives the reduction of chunk r.
  // In place (NCCL's convention) when output is chunk r of a contiguous input: the rest of
  // the input is clobbered. Otherwise output must not overlap input.
  virtual WorkPtr reduce_scatter_async(at::Tensor output, at::Tensor input, ReduceOp op = ReduceOp::kSum) = 0;
  // output.numel() == size() * input.numel(); chunk r of output is rank r's input. In place
  // when input is chunk r of a contiguous output; otherwise they must not overlap.
  virtual WorkPtr allgather_async(at::Tensor output, at::Tensor input) = 0;
  virtual WorkPtr broadcast_async(at::Tensor tensor, int root) = 0;
  virtual WorkPtr send_async(at::Tensor tensor, int dst, int tag = 0) = 0;
  virtual WorkPtr recv_async(at::Tensor tensor, int src, int tag = 0) = 0;
  virtual WorkPtr barrier_async() = 0;
  // All-to-all of rows (dim 0): input holds sum(input_splits) rows in rank order, the
  // input_splits[j] of them sent to rank j; output receives output_splits[j] rows from rank j,
  // in rank order. Any split may be 0 (a rank may send or receive nothing, and still takes
  // part). Rank j's input_splits[r] must equal rank r's output_splits[j] (exchange the counts
  // first: moe::exchange_counts). Both tensors contiguous, of one dtype and device, with equal
  // trailing dimensions, not overlapping; one split per rank, sum(input_splits) ==
  // input.size(0), sum(output_splits) == output.size(0): else std::invalid_argument naming the
  // rank and the sizes.
  virtual WorkPtr alltoall_async(at::Tensor output, at::Tensor input, std::vector<int64_t> output_splits,
                                 std::vector<int64_t> input_splits) = 0;

  // Collective over this communicator: ranks with the same color form a new communicator,
  // ordered by key (ties by current rank). A negative color returns nullptr for that rank.
  virtual std::shared_ptr<Communicator> split(int color, int key) = 0;

  // Blocking forms.
  void allreduce(const at::Tensor& t, ReduceOp op = ReduceOp::kSum) { allreduce_async(t, op)->wait(); }
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op = ReduceOp::kSum) {
    reduce_scatter_async(out, in, op)->wait();
  }
  void allgather(const at::Tensor& out, const at::Tensor& in) { allgather_async(out, in)->wait(); }
  void broadcast(const at::Tensor& t, int root) { broadcast_async(t, root)->wait(); }
  void send(const at::Tensor& t, int dst, int tag = 0) { send_async(t, dst, tag)->wait(); }
  void recv(const at::Tensor& t, int src, int tag = 0) { recv_async(t, src, tag)->wait(); }
  void barrier() { barrier_async()->wait(); }
  void alltoall(const at::Tensor& out, const at::Tensor& in, std::vector<int64_t> out_splits,
                std::vector<int64_t> in_splits) {
    alltoall_async(out, in, std::move(out_splits), std::move(in_splits))->wait();
  }

  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  // Snapshot of the counters, keyed by operation name ("allreduce", ...).
  std::map<std::string, OpStats> stats() const;
  void reset_stats();

 protected:
  explicit Communicator(const CommOptions& opts) : timeout_(opts.timeout) {}
  void record(const std::string& op, int64_t bytes);
  void record_seconds(const std::string& op, double seconds);

 private:
  std::chrono::milliseconds timeout_;
  mutable std::mutex stats_mu_;
  std::map<std::string, OpStats> stats_;
};
using CommPtr = std::shared_ptr<Communicator>;

// True when this build has the backend.
bool has_mpi_backend();
bool has_nccl_backend();

// Memory for a 1-D tensor that every rank of `comm` allocates at the same point of the program
// with the same size (a collective call, like the communicator's operations). On the MPI
// backend, when all ranks share a node, it lives in an MPI-3 shared-memory window, and an
// all-reduce (sum or average) of a contiguous range of it, a reduce-scatter whose input and an
// all-gather whose output is such a range read and write the peers' memory directly instead of
// copying through MPI (DDP's buckets and ZeRO's flat buffers use it). Otherwise plain memory.
// TANDEM_MPI_SHM=0 turns the shared-memory path off.
at::Tensor symmetric_empty(Communicator& comm, int64_t numel, const at::TensorOptions& opts);

// Collective over a CPU communicator: every rank's string, in rank order, on every rank.
std::vector<std::string> allgather_strings(Communicator& comm, const std::string& mine);

}  // namespace tandem
