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

// The --pp-partition option of tandem train, pretrain and finetune: "params" and "time" give an
// empty list (the caller cuts), otherwise one positive layer count per stage, comma-separated
// ("3,7"). Throws std::invalid_argument naming the option otherwise. Whether the counts add up to
// the model's layers is tandem::Pipeline's check.
std::vector<int64_t> parse_partition_option(const std::string& text, int stages);

}  // namespace tandem
