// Internal: what every data-parallel strategy does at construction, kept in one place:
// check that all ranks hold the same model (names, shapes, dtypes) and broadcast rank 0's
// parameters and buffers.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "tandem/comm.h"

namespace tandem::detail {

// Collective. Throws std::invalid_argument on every rank when some rank's model differs
// from rank 0's; `who` names the strategy in the message ("DistributedDataParallel").
void check_same_model(Communicator& comm, const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                      const std::vector<std::pair<std::string, at::Tensor>>& buffers, const std::string& who);

// Collective: rank 0's values of the buffers (and of the parameters when include_params).
void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& params,
                          const std::vector<std::pair<std::string, at::Tensor>>& buffers, bool include_params);

}  // namespace tandem::detail
