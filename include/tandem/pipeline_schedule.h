// The torch-free parts of pipeline parallelism, shared by tandem::Pipeline and the planner
// (tandem/plan.h): how a model's layers are cut into stages and in which order a stage runs the
// forwards and backwards of its micro-batches.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tandem {

// Contiguous split of `costs` into `stages` non-empty parts minimising the largest part's cost
// (exact, dynamic programming). Throws std::invalid_argument when stages > costs.size().
std::vector<int64_t> balance_partition(const std::vector<double>& costs, int stages);

// The order stage `stage` of `stages` runs its m micro-batches in: (true, i) is micro-batch i's
// forward, (false, i) its backward. GPipe: all forwards, then all backwards. 1F1B
// (PipeDream-Flush): p - s - 1 warm-up forwards, then one forward and one backward, then the rest
// of the backwards.
std::vector<std::pair<bool, int64_t>> pipeline_order(bool gpipe, int stage, int stages, int64_t m);

// One operation of a rank's schedule: the forward (or backward) of micro-batch `micro_batch`
// through the rank's model chunk `chunk`. With `chunks` chunks per rank over `stages` ranks,
// chunk c of rank r is virtual stage c * stages + r: the model is cut into stages * chunks
// contiguous parts and rank r holds parts r, r + stages, ... (non-adjacent). GPipe and 1F1B
// have one chunk per rank.
struct PipelineOp {
  bool forward = true;
  int chunk = 0;
  int64_t micro_batch = 0;
  bool operator==(const PipelineOp& o) const {
    return forward == o.forward && chunk == o.chunk && micro_batch == o.micro_batch;
  }
};

// Throws std::invalid_argument naming --pp, --virtual-stages and --micro-batches unless the
// interleaved schedule can run them: stages >= 2, chunks >= 1, m >= 1 and a multiple of stages
// (micro-batches go through the chunks in groups of one per stage, as in Megatron-LM).
void check_interleaved(int stages, int chunks, int64_t m);

// Megatron-LM's interleaved 1F1B order for rank `stage`: the rank's k-th forward is micro-batch
// (k / (stages * chunks)) * stages + k % stages through chunk (k / stages) % chunks, and its
// k-th backward the same micro-batch through chunk chunks - 1 - (k / stages) % chunks; after
// (stages - stage - 1) * 2 + (chunks - 1) * stages warm-up forwards (all m * chunks when m ==
// stages) one forward and one backward alternate, then the remaining backwards. Every rank runs
// its forwards (and its backwards) in the same (chunk, micro-batch) order, so messages between
// two ranks arrive in the order they are received. Checks with check_interleaved().
std::vector<PipelineOp> interleaved_order(int stage, int stages, int chunks, int64_t m);

// The --pp-partition option of tandem train, pretrain and finetune: "params" and "time" give an
// empty list (the caller cuts), otherwise one positive layer count per stage, comma-separated
// ("3,7"). Throws std::invalid_argument naming the option otherwise. Whether the counts add up to
// the model's layers is tandem::Pipeline's check.
std::vector<int64_t> parse_partition_option(const std::string& text, int stages);

}  // namespace tandem
