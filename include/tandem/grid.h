// The dp x cp x tp x pp process grid: every rank of the world gets a coordinate (dp, cp, pp, tp)
// and sub-communicators made with Communicator::split: tp (ranks that share one layer's
// matrices), pp (the stages of one pipeline, ordered by stage), cp (the ranks that share each
// sequence, tandem/context_parallel.h) and dp (replicas of the same shard that take different
// samples). Layout as Megatron-core: tp varies fastest, then cp, then dp, then pp, so that
// world rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)) and tensor-parallel peers
// are neighbours. The ranks of one cp group hold the same parameters and see different tokens of
// the same samples, so their gradients are reduced together with dp's: dp_cp() is the group the
// data-parallel strategies (DDP, ZeRO) run over.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "tandem/comm.h"

namespace tandem {

class ProcessGrid {
 public:
  // Collective over `world` (the same splits in the same order on every rank). dp = world size /
  // (tp * pp * cp). Throws std::invalid_argument when tp, pp or cp < 1 or their product does not
  // divide the world size.
  ProcessGrid(CommPtr world, int tp, int pp, int cp = 1);

  int world_size() const { return world_->size(); }
  int world_rank() const { return world_->rank(); }
  int dp_size() const { return dp_; }
  int tp_size() const { return tp_; }
  int pp_size() const { return pp_; }
  int cp_size() const { return cp_; }
  int cp_rank() const { return cp_rank_; }
  int dp_rank() const { return dp_rank_; }
  int tp_rank() const { return tp_rank_; }
  int pp_rank() const { return pp_rank_; }

  CommPtr world() const { return world_; }
  CommPtr tp() const { return tp_comm_; }  // size tp_size(), rank tp_rank()
  CommPtr pp() const { return pp_comm_; }  // size pp_size(), rank pp_rank() (= pipeline stage)
  CommPtr dp() const { return dp_comm_; }  // size dp_size(), rank dp_rank()
  CommPtr cp() const { return cp_comm_; }  // size cp_size(), rank cp_rank(); null when cp_size() == 1
  // dp x cp ranks of one (tp, pp) coordinate, rank dp_rank * cp + cp_rank; dp() when cp is 1.
  CommPtr dp_cp() const { return dp_cp_comm_; }

  // World rank of a coordinate.
  int world_rank_of(int dp_rank, int pp_rank, int tp_rank, int cp_rank = 0) const;
  // "dp 1/2, pp 0/2, tp 1/1" (for logs and errors).
  std::string describe() const;

 private:
  CommPtr world_, tp_comm_, pp_comm_, dp_comm_, cp_comm_, dp_cp_comm_;
  int dp_ = 1, tp_ = 1, pp_ = 1, cp_ = 1;
  int dp_rank_ = 0, tp_rank_ = 0, pp_rank_ = 0, cp_rank_ = 0;
};

// Averages the gradients of `params` over `comm` in one flat all-reduce (ranks must pass the same
// parameters, same shapes, same order). A parameter without a gradient counts as zero and gets one.
// The simple data-parallel step for pipeline stages and tensor-parallel shards, whose gradients
// are complete only after the whole (micro-batched) backward; DDP/ZeRO over grid.dp() also work.
void average_gradients(const std::vector<at::Tensor>& params, Communicator& comm);

// average_gradients for every step of a training loop: the same result, through one flat buffer
// per dtype and device group allocated at the first call in symmetric memory
// (detail::symmetric_empty: on one node an MPI-3 shared window that the all-reduce reduces in
// place, as DDP's buckets do) and kept. average_gradients' fresh buffer goes through MPI's fifos:
// the MLP's dp 2 x pp 2 step on 4 ranks over 2 cores spent 4-7 ms in that all-reduce of 3-4 MiB;
// through the kept buffer its median step went from 31.5 to 26.7 ms (docs/BENCHMARKS.md). The
// first average() is collective over `comm` (every rank, same parameters); so is every later one.
class GradientAverager {
 public:
  GradientAverager(std::vector<at::Tensor> params, CommPtr comm);
  void average();

 private:
  std::vector<at::Tensor> params_;
  CommPtr comm_;
  std::vector<std::vector<size_t>> groups_;  // by dtype and device, found by the first average()
  std::vector<at::Tensor> buffers_;          // one per group, allocated by the first average()
};

// Broadcasts the values of `params` from `root` of `comm` in place (e.g. the same initial replica
// on every dp rank of a grid, or the same dense weights on every tp rank before sharding).
void broadcast_parameters(const std::vector<at::Tensor>& params, Communicator& comm, int root = 0);

}  // namespace tandem
