// Torch-free pipeline helpers (tandem/pipeline_schedule.h): the balanced contiguous partition
// and the per-stage order of micro-batch forwards and backwards.
#include "tandem/pipeline_schedule.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace tandem {

std::vector<int64_t> balance_partition(const std::vector<double>& costs, int stages) {
  const int64_t n = static_cast<int64_t>(costs.size());
  if (stages < 1 || stages > n) {
    throw std::invalid_argument("tandem::balance_partition: cannot cut " + std::to_string(n) + " layers into " +
                                std::to_string(stages) + " non-empty stages; use between 1 and " + std::to_string(n) +
                                " stages");
  }
  std::vector<double> pre(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) pre[i + 1] = pre[i] + costs[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: smallest possible largest stage cost for the first i layers in k stages.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0.0;
  for (int k = 1; k <= stages; ++k) {
    for (int64_t i = k; i <= n; ++i) {
      for (int64_t j = k - 1; j < i; ++j) {
        double c = std::max(best[k - 1][j], pre[i] - pre[j]);
        if (c < best[k][i]) {
          best[k][i] = c;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> parts(stages);
  int64_t i = n;
  for (int k = stages; k >= 1; --k) {
    parts[k - 1] = i - cut[k][i];
    i = cut[k][i];
  }
  return parts;
}

std::vector<std::pair<bool, int64_t>> pipeline_order(bool gpipe, int stage, int stages, int64_t m) {
  std::vector<std::pair<bool, int64_t>> ops;
  if (gpipe) {
    for (int64_t i = 0; i < m; ++i) ops.emplace_back(true, i);
    for (int64_t i = 0; i < m; ++i) ops.emplace_back(false, i);
    return ops;
  }
  const int64_t warmup = std::min<int64_t>(stages - stage - 1, m);
  for (int64_t i = 0; i < warmup; ++i) ops.emplace_back(true, i);
  for (int64_t i = 0; i < m - warmup; ++i) {
    ops.emplace_back(true, warmup + i);
    ops.emplace_back(false, i);
  }
  for (int64_t i = m - warmup; i < m; ++i) ops.emplace_back(false, i);
  return ops;
}

void check_interleaved(int stages, int chunks, int64_t m) {
  const std::string opts = "--pipeline-schedule interleaved with --pp " + std::to_string(stages) +
                           " --virtual-stages " + std::to_string(chunks) + " --micro-batches " + std::to_string(m);
  if (stages < 2) throw std::invalid_argument(opts + ": the interleaved schedule needs --pp 2 or more");
  if (chunks < 1) throw std::invalid_argument(opts + ": --virtual-stages must be at least 1");
  if (m < 1 || m % stages != 0) {
    throw std::invalid_argument(opts + ": the micro-batches go through the stages in groups of --pp, so " +
                                "--micro-batches must be a multiple of --pp (e.g. " + std::to_string(2 * stages) + ")");
  }
}

std::vector<PipelineOp> interleaved_order(int stage, int stages, int chunks, int64_t m) {
  check_interleaved(stages, chunks, m);
  if (stage < 0 || stage >= stages) {
    throw std::invalid_argument("tandem::interleaved_order: stage " + std::to_string(stage) + " of " +
                                std::to_string(stages));
  }
  const int64_t p = stages, v = chunks, total = m * v;
  auto op = [&](int64_t k, bool forward) {
    const int64_t c = (k % (p * v)) / p;
    return PipelineOp{forward, static_cast<int>(forward ? c : v - 1 - c), (k / (p * v)) * p + k % p};
  };
  const int64_t warmup = m == p ? total : std::min(total, (p - stage - 1) * 2 + (v - 1) * p);
  std::vector<PipelineOp> ops;
  for (int64_t k = 0; k < warmup; ++k) ops.push_back(op(k, true));
  for (int64_t k = 0; k < total - warmup; ++k) {
    ops.push_back(op(warmup + k, true));
    ops.push_back(op(k, false));
  }
  for (int64_t k = total - warmup; k < total; ++k) ops.push_back(op(k, false));
  return ops;
}

std::vector<int64_t> parse_partition_option(const std::string& text, int pp) {
  if (text == "params" || text == "time") return {};
  const std::string use = "--pp-partition '" + text + "': use params, time, or the layers of each of the " +
                          std::to_string(pp) +
                          " stages, comma-separated (e.g. 3,7 for --pp 2; --pp x --virtual-stages of them with the "
                          "interleaved schedule)";
  std::vector<int64_t> parts;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t end = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, end - pos);
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 9)
      throw std::invalid_argument(use);
    parts.push_back(std::stoll(item));
    if (parts.back() < 1) throw std::invalid_argument(use + "; every stage needs at least one layer");
    pos = end + 1;
  }
  if (static_cast<int>(parts.size()) != pp)
    throw std::invalid_argument(use + "; it lists " + std::to_string(parts.size()) + " stage(s), not " +
                                std::to_string(pp));
  return parts;
}

}  // namespace tandem
