// Internal to src/comm: the pieces the backends share. The backends' constructors are public
// (tandem/backends.h); the rest of Tandem uses tandem/comm.h and tandem/runtime.h.
#pragma once

#include <exception>
#include <string>

#include "tandem/backends.h"
#include "tandem/comm.h"

namespace tandem::detail {

// "rank 1: allreduce of float32[1000] (4000 bytes)": the prefix of every error message.
std::string describe(int rank, const std::string& op, const at::Tensor& t);

// A Work that is already complete (or already failed).
WorkPtr completed_work(std::exception_ptr error = nullptr);

// symmetric_empty (tandem/comm.h) on an MPI communicator; undefined when the shared-memory path
// does not apply (the communicator spans hosts, TANDEM_MPI_SHM=0) or `comm` is not an MPI one.
at::Tensor mpi_symmetric_empty(Communicator& comm, int64_t numel, const at::TensorOptions& opts);

}  // namespace tandem::detail
