// Torch-free pipeline helpers (tandem/pipeline_schedule.h): the balanced contiguous partition
// and the per-stage order of micro-batch forwards and backwards.
#include "tandem/pipeline_schedule.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <stdexcept>
#include <string>

namespace tandem {

const char* to_string(PipelineSchedule s) {
  switch (s) {
    case PipelineSchedule::kGPipe: return "gpipe";
    case PipelineSchedule::k1F1B: return "1f1b";
    case PipelineSchedule::kInterleaved: return "interleaved";
    case PipelineSchedule::kZBH1: return "zb-h1";
    case PipelineSchedule::kZBV: return "zb-v";
  }
  return "?";
}

PipelineSchedule parse_pipeline_schedule(const std::string& s) {
  if (s == "gpipe") return PipelineSchedule::kGPipe;
  if (s == "1f1b") return PipelineSchedule::k1F1B;
  if (s == "interleaved") return PipelineSchedule::kInterleaved;
  if (s == "zb-h1") return PipelineSchedule::kZBH1;
  if (s == "zb-v") return PipelineSchedule::kZBV;
  throw std::invalid_argument("tandem: unknown pipeline schedule '" + s +
                              "'; use gpipe, 1f1b, interleaved, zb-h1 or zb-v");
}

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
    return PipelineOp{forward ? PipelineOpKind::kForward : PipelineOpKind::kBackward,
                      static_cast<int>(forward ? c : v - 1 - c), (k / (p * v)) * p + k % p};
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

int64_t pipeline_virtual_stage(int chunk, int rank, int stages, bool v_shape) {
  if (v_shape && chunk == 1) return 2 * static_cast<int64_t>(stages) - 1 - rank;
  return static_cast<int64_t>(chunk) * stages + rank;
}

std::pair<int, int> pipeline_stage_owner(int64_t v, int stages, bool v_shape) {
  if (v_shape && v >= stages) return {static_cast<int>(2 * static_cast<int64_t>(stages) - 1 - v), 1};
  return {static_cast<int>(v % stages), static_cast<int>(v / stages)};
}

namespace {
void check_stage(const char* who, int stage, int stages, int64_t m) {
  if (stages < 1 || stage < 0 || stage >= stages || m < 1) {
    throw std::invalid_argument(std::string("tandem::") + who + ": stage " + std::to_string(stage) + " of " +
                                std::to_string(stages) + " with " + std::to_string(m) + " micro-batches");
  }
}
}  // namespace

std::vector<PipelineOp> zb_h1_order(int stage, int stages, int64_t m) {
  check_stage("zb_h1_order", stage, stages, m);
  const int p = stages;
  // Unit-time simulation of every rank: at time t a free rank runs its next F or B (1F1B's
  // order) when the input arrived by t, else its oldest pending W.
  std::vector<std::vector<std::pair<bool, int64_t>>> seq(p);
  for (int s = 0; s < p; ++s) seq[s] = pipeline_order(false, s, p, m);
  std::vector<std::vector<int64_t>> f_done(p, std::vector<int64_t>(m, -1)), b_done = f_done;
  std::vector<size_t> next(p, 0);
  std::vector<std::deque<int64_t>> pending(p);
  std::vector<int64_t> in_flight(p, 0);  // F done, W not yet
  std::vector<std::vector<PipelineOp>> out(p);
  auto arrived = [](int64_t done, int64_t t) { return done >= 0 && done <= t; };
  for (int64_t t = 0;; ++t) {
    bool busy = false;
    for (int s = 0; s < p; ++s) {
      if (next[s] == seq[s].size() && pending[s].empty()) continue;
      busy = true;
      if (next[s] < seq[s].size()) {
        auto [fwd, i] = seq[s][next[s]];
        const bool ready =
            fwd ? (s == 0 || arrived(f_done[s - 1][i], t)) : (s == p - 1 || arrived(b_done[s + 1][i], t));
        const bool room = fwd ? in_flight[s] < p : static_cast<int64_t>(pending[s].size()) <= s;
        if (ready && room) {
          ++next[s];
          (fwd ? f_done : b_done)[s][i] = t + 1;
          out[s].push_back({fwd ? PipelineOpKind::kForward : PipelineOpKind::kBackward, 0, i});
          if (fwd) {
            ++in_flight[s];
          } else {
            pending[s].push_back(i);
          }
          continue;
        }
      }
      if (!pending[s].empty()) {
        out[s].push_back({PipelineOpKind::kWeight, 0, pending[s].front()});
        pending[s].pop_front();
        --in_flight[s];
      }
    }
    if (!busy) break;
    if (t > 8 * (m + p) + 16) throw std::logic_error("tandem::zb_h1_order: the simulation does not finish");
  }
  return out[stage];
}

std::vector<PipelineOp> zb_v_order(int stage, int stages, int64_t m) {
  check_stage("zb_v_order", stage, stages, m);
  if (stages < 2) {
    throw std::invalid_argument("--pipeline-schedule zb-v with --pp " + std::to_string(stages) +
                                ": the V shape needs --pp 2 or more");
  }
  const int64_t p = stages, r = stage, n = std::max<int64_t>(m, 2 * p - 1);
  std::vector<PipelineOp> ops;
  int64_t f[2] = {0, 0}, b[2] = {0, 0}, w[2] = {0, 0};
  auto F = [&](int c) { ops.push_back({PipelineOpKind::kForward, c, f[c]++}); };
  auto B = [&](int c) { ops.push_back({PipelineOpKind::kBackward, c, b[c]++}); };
  auto W = [&](int c) { ops.push_back({PipelineOpKind::kWeight, c, w[c]++}); };
  for (int64_t k = 0; k < 2 * (p - r) - 1; ++k) F(0);
  for (int64_t k = 0; k < r; ++k) {
    F(1);
    F(0);
  }
  for (int64_t k = 0; k < p - r; ++k) {
    F(1);
    B(1);
    W(1);
  }
  while (f[1] < f[0] || f[0] < n) {
    if (f[0] < n) F(0);
    B(0);
    W(0);
    F(1);
    B(1);
    W(1);
  }
  for (int64_t k = 0; k < r; ++k) {
    B(0);
    B(1);
  }
  for (int64_t k = 0; k < p - r; ++k) {
    B(0);
    W(0);
  }
  while (w[1] < b[1]) W(1);
  while (w[0] < b[0]) W(0);
  ops.erase(std::remove_if(ops.begin(), ops.end(), [m](const PipelineOp& o) { return o.micro_batch >= m; }), ops.end());
  return ops;
}

double pipeline_bubble_theory(PipelineSchedule schedule, int stages, int64_t m, int chunks, double t_f, double t_b,
                              double t_w) {
  const double p1 = static_cast<double>(std::max(0, stages - 1)), mm = static_cast<double>(std::max<int64_t>(1, m));
  const double split = std::max(0.0, t_f + t_b - t_w) / (t_f + t_b + t_w);
  switch (schedule) {
    case PipelineSchedule::kGPipe:
    case PipelineSchedule::k1F1B: return p1 / mm;
    case PipelineSchedule::kInterleaved: return p1 / (mm * std::max(1, chunks));
    case PipelineSchedule::kZBH1: return p1 * split / mm;
    case PipelineSchedule::kZBV: return p1 * split / (2.0 * mm);
  }
  return p1 / mm;
}

std::string pipeline_bubble_formula(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kInterleaved: return "(pp-1)/(m*v)";
    case PipelineSchedule::kZBH1: return "(pp-1)/(3m)";
    case PipelineSchedule::kZBV: return "(pp-1)/(6m)";
    default: return "(pp-1)/m";
  }
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
