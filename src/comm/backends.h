// Internal: factories of the communication backends and the pieces they share.
// Not a public header: strategies and tools use tandem/comm.h and tandem/runtime.h.
#pragma once

#include <memory>
#include <string>

#include "tandem/comm.h"

namespace tandem::detail {

// "rank 1: allreduce of float32[1000] (4000 bytes)": the prefix of every error message.
std::string describe(int rank, const std::string& op, const at::Tensor& t);

// A Work that is already complete (or already failed).
WorkPtr completed_work(std::exception_ptr error = nullptr);

// World size 1, any device: every operation is a local copy. Used when no MPI is built
// or when a single process runs without a launcher.
CommPtr make_self_communicator(const CommOptions& opts);

// Memory for a 1-D tensor that every rank of `comm` allocates at the same point of the program
// with the same size (a collective call, like the communicator's operations). On the MPI backend,
// when all ranks share a node, it lives in an MPI-3 shared-memory window and an all-reduce (sum or
// average) of a contiguous range of it reads and writes the peers' memory directly instead of
// copying through MPI's fifos (DDP's gradient buckets use it); so do a reduce-scatter whose input
// and an all-gather whose output is such a range (ZeRO-1/2's flat buffers). Otherwise plain memory.
// TANDEM_MPI_SHM=0 turns the shared-memory path off.
at::Tensor symmetric_empty(Communicator& comm, int64_t numel, const at::TensorOptions& opts);

// ---- MPI (built when TANDEM_WITH_MPI) ----
// Initializes MPI with MPI_THREAD_MULTIPLE unless already initialized; returns true if this
// call initialized it (the caller then finalizes).
bool mpi_init_if_needed();
void mpi_finalize();
[[noreturn]] void mpi_abort(int code);
CommPtr make_mpi_world(const CommOptions& opts);
// symmetric_empty on an MPI communicator; undefined when the shared-memory path does not apply.
at::Tensor mpi_symmetric_empty(Communicator& comm, int64_t numel, const at::TensorOptions& opts);

// ---- NCCL (built when TANDEM_WITH_NCCL) ----
// How ranks exchange the NCCL unique id: over an existing CPU communicator (MPI) or through
// files in a directory that every rank can read (no MPI needed).
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank returns root's `bytes`.
  virtual std::string broadcast(const std::string& bytes, int root) = 0;
};
std::unique_ptr<Bootstrap> make_comm_bootstrap(CommPtr cpu_comm);
std::unique_ptr<Bootstrap> make_file_bootstrap(const std::string& dir, int rank, int size,
                                               std::chrono::milliseconds timeout);
CommPtr make_nccl_communicator(int device_index, Bootstrap& bootstrap, const CommOptions& opts);

}  // namespace tandem::detail
