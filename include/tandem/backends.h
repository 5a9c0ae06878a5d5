// The communication backends, constructed one at a time: what tandem::Runtime does for every
// process (runtime.h), for programs that manage MPI or the NCCL bootstrap themselves (an
// existing MPI application, a custom launcher) or need another world communicator. Each
// constructor is collective over the ranks it connects and throws CommError naming the rank.
// Only the backends of this build are declared (TANDEM_WITH_MPI, TANDEM_WITH_NCCL).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "tandem/comm.h"

namespace tandem {

// World size 1, any device: every operation is a local copy.
CommPtr make_self_communicator(const CommOptions& opts);

#ifdef TANDEM_WITH_MPI
// Initializes MPI with MPI_THREAD_MULTIPLE (the backend's progress threads need it) unless it
// is initialized already; returns true when this call initialized it: the caller then calls
// mpi_finalize() once every communicator is destroyed.
bool mpi_init_if_needed();
void mpi_finalize();
// MPI_Abort on MPI_COMM_WORLD when MPI is running, then exits with `code`: every rank ends.
[[noreturn]] void mpi_abort(int code);
// A communicator over a duplicate of MPI_COMM_WORLD (CPU tensors). MPI must be initialized.
CommPtr make_mpi_world(const CommOptions& opts);
#endif

#ifdef TANDEM_WITH_NCCL
// How ranks exchange the NCCL unique id before NCCL can connect them.
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank returns root's `bytes`.
  virtual std::string broadcast(const std::string& bytes, int root) = 0;
};
// Over an existing CPU communicator (MPI) spanning the same ranks.
std::unique_ptr<Bootstrap> make_comm_bootstrap(CommPtr cpu_comm);
// Through files in a directory that every rank can read and rank 0 can write (no MPI needed).
std::unique_ptr<Bootstrap> make_file_bootstrap(const std::string& dir, int rank, int size,
                                               std::chrono::milliseconds timeout);
// A communicator for CUDA tensors on device `device_index`, over the bootstrap's ranks.
CommPtr make_nccl_communicator(int device_index, Bootstrap& bootstrap, const CommOptions& opts);
#endif

}  // namespace tandem
