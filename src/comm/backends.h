// Internal to src/comm: the pieces the backends share. The backends' constructors are public
// (tandem/backends.h); the rest of Tandem uses tandem/comm.h and tandem/runtime.h.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "tandem/backends.h"
#include "tandem/comm.h"

namespace tandem::detail {

// "rank 1: allreduce of float32[1000] (4000 bytes)": the prefix of every error message.
std::string describe(int rank, const std::string& op, const at::Tensor& t);

// A Work that is already complete (or already failed).
WorkPtr completed_work(std::exception_ptr error = nullptr);

// Checks alltoall_async's arguments (tandem/comm.h) on rank `rank` of `size`, throwing
// std::invalid_argument that names the rank, the splits and the tensors' sizes; returns the
// elements per row.
int64_t check_alltoall(int rank, int size, const at::Tensor& out, const at::Tensor& in,
                       const std::vector<int64_t>& out_splits, const std::vector<int64_t>& in_splits);
// offsets[j] = splits[0] + ... + splits[j - 1]: the first row of rank j's block.
std::vector<int64_t> split_offsets(const std::vector<int64_t>& splits);

// symmetric_empty (tandem/comm.h) on an MPI communicator; undefined when the shared-memory path
// does not apply (the communicator spans hosts, TANDEM_MPI_SHM=0) or `comm` is not an MPI one.
at::Tensor mpi_symmetric_empty(Communicator& comm, int64_t numel, const at::TensorOptions& opts);

}  // namespace tandem::detail
