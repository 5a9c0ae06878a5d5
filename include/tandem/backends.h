// The communication backends, constructed one at a time: what tandem::Runtime does for every
// process (runtime.h), for programs that manage MPI or the NCCL bootstrap themselves (an
// existing MPI application, a custom launcher) or need another world communicator. Each
// constructor is collective over the ranks it connects and throws CommError naming the rank.
// Only the backends of this build are declared (TANDEM_WITH_MPI, TANDEM_WITH_NCCL).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm.h"

namespace tandem {

// World size 1, any device: every operation is a local copy.
CommPtr make_self_communicator(const CommOptions& opts);

// `size` ranks that are threads of this process (CPU tensors, no MPI): communicator r is rank r,
// used by one thread. Each runs its collectives in issue order on a worker thread of its own
// (so they overlap the caller's compute); a collective meets the peers' calls and each rank
// reduces its share of the elements in rank order straight from the peers' tensors, so every
// rank gets the same bits. send copies into the receiver's mailbox and completes at once.
std::vector<CommPtr> make_thread_communicators(int size, const CommOptions& opts);
// Fails the pending and later operations of the thread group `comm` belongs to, and of every
// group split from it, with CommError saying `why`: a thread that gives up calls it so that its
// peers stop waiting for it. `comm` must come from make_thread_communicators (or its splits).
void abort_thread_group(Communicator& comm, const std::string& why);
// Thread k of process p as rank p * K + k of P * K: `local` is the thread's communicator in its
// process's group of K (make_thread_communicators), `processes` spans the P processes (one per
// process, shared by its threads: thread 0 runs the collectives on it, every thread its
// point-to-point messages to other processes, so MPI needs MPI_THREAD_MULTIPLE). Collectives
// reduce inside the process, then across processes, then share inside the process again.
// split is not supported.
CommPtr make_hierarchical_communicator(CommPtr local, CommPtr processes, const CommOptions& opts);

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
// One process driving several devices (ncclCommInitAll): communicator r is rank r on
// devices[r]. Each is then used by its own thread, which NCCL allows without group calls.
std::vector<CommPtr> make_nccl_device_communicators(const std::vector<int>& devices, const CommOptions& opts);
#endif

}  // namespace tandem
