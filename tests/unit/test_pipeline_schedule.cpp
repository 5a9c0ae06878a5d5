// The interleaved 1F1B order (tandem/pipeline_schedule.h): Megatron-LM's order for one case
// written out by hand, the properties every (stages, chunks, micro-batches) must have (each
// forward once, before its backward; messages between two ranks sent in the order they are
// received), and a simulation of all ranks running their orders with blocking receives, which
// must finish (no deadlock) and whose idle time matches (p - 1) / (m v) for equal stages; the
// same for the zero-bubble schedules zb-h1 and zb-v, whose backward is split into B and W.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/pipeline_schedule.h"

namespace tandem {
namespace {

std::vector<PipelineOp> ops(std::initializer_list<std::tuple<char, int, int64_t>> list) {
  std::vector<PipelineOp> out;
  for (auto [k, c, i] : list)
    out.push_back({k == 'F'   ? PipelineOpKind::kForward
                   : k == 'B' ? PipelineOpKind::kBackward
                              : PipelineOpKind::kWeight,
                   c, i});
  return out;
}

// Megatron-LM's schedule for p = 2, v = 2, m = 4: rank 0 warms up with (2 - 0 - 1) * 2 + 2 = 4
// forwards, rank 1 with 2; micro-batches go through the chunks in groups of p = 2.
TEST(PipelineSchedule, InterleavedMatchesMegatronByHand) {
  EXPECT_EQ(interleaved_order(0, 2, 2, 4), ops({{'F', 0, 0},
                                                {'F', 0, 1},
                                                {'F', 1, 0},
                                                {'F', 1, 1},
                                                {'F', 0, 2},
                                                {'B', 1, 0},
                                                {'F', 0, 3},
                                                {'B', 1, 1},
                                                {'F', 1, 2},
                                                {'B', 0, 0},
                                                {'F', 1, 3},
                                                {'B', 0, 1},
                                                {'B', 1, 2},
                                                {'B', 1, 3},
                                                {'B', 0, 2},
                                                {'B', 0, 3}}));
  EXPECT_EQ(interleaved_order(1, 2, 2, 4), ops({{'F', 0, 0},
                                                {'F', 0, 1},
                                                {'F', 1, 0},
                                                {'B', 1, 0},
                                                {'F', 1, 1},
                                                {'B', 1, 1},
                                                {'F', 0, 2},
                                                {'B', 0, 0},
                                                {'F', 0, 3},
                                                {'B', 0, 1},
                                                {'F', 1, 2},
                                                {'B', 1, 2},
                                                {'F', 1, 3},
                                                {'B', 1, 3},
                                                {'B', 0, 2},
                                                {'B', 0, 3}}));
}

struct SimRun {
  std::vector<double> end;  // each rank's finishing time
  // Per (from rank, to rank, forward?): what was sent and what was received, (virtual stage, micro-batch).
  std::map<std::tuple<int, int, bool>, std::vector<std::pair<int64_t, int64_t>>> sent, received;
};

// Runs every rank's order, one operation at a time per rank, on its own clock: F takes 1, B
// `backward` (2 for a whole backward, 1 for the input gradients of a split one), W 1. An
// operation starts when the rank is free and its input has arrived: F needs the previous
// virtual stage's F, B the next one's B (and its own F), W its own B; virtual stages lie on the
// ranks as pipeline_virtual_stage says (the loop wraps from rank p - 1 to rank 0 between
// chunks, the V turns on rank p - 1). Sends never block (Tandem's are asynchronous). Throws when
// no rank can move (a deadlock) or an operation comes out of place.
SimRun run_orders(const std::vector<std::vector<PipelineOp>>& order, int chunks, bool v_shape, int64_t m,
                  double backward) {
  const int p = static_cast<int>(order.size());
  const int64_t V = static_cast<int64_t>(p) * chunks;
  std::vector<std::vector<double>> f(V, std::vector<double>(m, -1)), b = f, w = f;
  std::vector<size_t> next(p, 0);
  SimRun run;
  run.end.assign(p, 0.0);
  for (;;) {
    bool moved = false, done = true;
    for (int r = 0; r < p; ++r) {
      if (next[r] == order[r].size()) continue;
      done = false;
      const PipelineOp& op = order[r][next[r]];
      const int64_t s = pipeline_virtual_stage(op.chunk, r, p, v_shape), i = op.micro_batch;
      double ready = 0.0;
      if (op.kind == PipelineOpKind::kForward) {
        if (s > 0) ready = f[s - 1][i];
      } else if (op.kind == PipelineOpKind::kBackward) {
        if (f[s][i] < 0) throw std::logic_error("backward before its forward");
        if (s < V - 1) ready = b[s + 1][i];
      } else if (b[s][i] < 0) {
        throw std::logic_error("W before its B");
      }
      if (ready < 0) continue;  // blocked in a receive
      const bool fwd = op.forward();
      run.end[r] = std::max(run.end[r], ready) + (op.kind == PipelineOpKind::kBackward ? backward : 1.0);
      auto& table = fwd ? f : op.kind == PipelineOpKind::kBackward ? b : w;
      if (table[s][i] >= 0) throw std::logic_error("an operation runs twice");
      table[s][i] = run.end[r];
      if (op.kind != PipelineOpKind::kWeight) {
        const int64_t to = fwd ? s + 1 : s - 1, from = fwd ? s - 1 : s + 1;
        if (to >= 0 && to < V) run.sent[{r, pipeline_stage_owner(to, p, v_shape).first, fwd}].push_back({to, i});
        if (from >= 0 && from < V)
          run.received[{pipeline_stage_owner(from, p, v_shape).first, r, fwd}].push_back({s, i});
      }
      ++next[r];
      moved = true;
    }
    if (done) return run;
    if (!moved) throw std::runtime_error("deadlock with p " + std::to_string(p) + " m " + std::to_string(m));
  }
}

// The interleaved order (or another with the same signature) of every rank, run by run_orders
// with whole backwards: each rank's finishing time.
using OrderFn = std::function<std::vector<PipelineOp>(int stage, int stages, int chunks, int64_t m)>;

std::vector<double> simulate(int p, int v, int64_t m, const OrderFn& order_of = interleaved_order) {
  std::vector<std::vector<PipelineOp>> order(p);
  for (int r = 0; r < p; ++r) order[r] = order_of(r, p, v, m);
  return run_orders(order, v, false, m, 2.0).end;
}

TEST(PipelineSchedule, InterleavedRunsEveryOperationOnceAndForwardFirst) {
  for (int p : {2, 3, 4}) {
    for (int v : {1, 2, 3}) {
      for (int64_t m : {p, 2 * p, 3 * p, 8 * p}) {
        SCOPED_TRACE("p " + std::to_string(p) + " v " + std::to_string(v) + " m " + std::to_string(m));
        for (int r = 0; r < p; ++r) {
          auto o = interleaved_order(r, p, v, m);
          ASSERT_EQ(static_cast<int64_t>(o.size()), 2 * m * v);
          std::map<std::pair<int, int64_t>, int> state;
          int64_t live = 0, peak = 0;
          for (const auto& op : o) {
            ASSERT_TRUE(op.chunk >= 0 && op.chunk < v && op.micro_batch >= 0 && op.micro_batch < m);
            int& st = state[{op.chunk, op.micro_batch}];
            EXPECT_EQ(st++, op.forward() ? 0 : 1);  // forward once, then backward once
            live += op.forward() ? 1 : -1;
            peak = std::max(peak, live);
          }
          EXPECT_EQ(static_cast<int64_t>(state.size()), m * v);
          // Megatron's bound on the activations held: the warm-up forwards and one more.
          const int64_t warmup = m == p ? m * v : std::min<int64_t>(m * v, (p - r - 1) * 2 + (v - 1) * p);
          EXPECT_EQ(peak, std::min<int64_t>(m * v, warmup + 1));
        }
      }
    }
  }
}

// Messages between two ranks are matched in order: what a rank sends to a neighbour (forwards:
// to the next virtual stage, backwards: to the previous one) comes in the order the neighbour
// receives it.
TEST(PipelineSchedule, InterleavedMessagesArriveInTheOrderReceived) {
  for (int p : {2, 3, 4}) {
    for (int v : {1, 2, 4}) {
      for (int64_t m : {p, 2 * p, 4 * p}) {
        SCOPED_TRACE("p " + std::to_string(p) + " v " + std::to_string(v) + " m " + std::to_string(m));
        const int64_t V = static_cast<int64_t>(p) * v;
        // sent[{from, to, forward}] / received[...]: (virtual stage received into, micro-batch).
        std::map<std::tuple<int, int, bool>, std::vector<std::pair<int64_t, int64_t>>> sent, received;
        for (int r = 0; r < p; ++r) {
          for (const auto& op : interleaved_order(r, p, v, m)) {
            const int64_t s = static_cast<int64_t>(op.chunk) * p + r;
            const int64_t to = op.forward() ? s + 1 : s - 1, from = op.forward() ? s - 1 : s + 1;
            if (to >= 0 && to < V) sent[{r, static_cast<int>(to % p), op.forward()}].push_back({to, op.micro_batch});
            if (from >= 0 && from < V) {
              received[{static_cast<int>(from % p), r, op.forward()}].push_back({s, op.micro_batch});
            }
          }
        }
        EXPECT_EQ(sent, received);
      }
    }
  }
}

TEST(PipelineSchedule, InterleavedNeverDeadlocksAndShrinksTheBubble) {
  for (int p : {2, 3, 4, 8}) {
    for (int v : {1, 2, 3, 4}) {
      for (int64_t m : {p, 2 * p, 4 * p}) {
        SCOPED_TRACE("p " + std::to_string(p) + " v " + std::to_string(v) + " m " + std::to_string(m));
        std::vector<double> end;
        ASSERT_NO_THROW(end = simulate(p, v, m));
        // Each rank computes m v forwards of 1 and backwards of 2 (chunks of 1/v of a stage's
        // layers cost 1/v: here every chunk costs 1 + 2, so the work is 3 m v chunk units).
        const double work = 3.0 * m * v;
        const double step = *std::max_element(end.begin(), end.end());
        const double bubble = (step - work) / work;
        // Megatron's figure for equal stages: (p - 1) / (m v).
        EXPECT_NEAR(bubble, static_cast<double>(p - 1) / (m * v), 1e-9);
      }
    }
  }
}

// The simulation catches a wrong order: the same operations with 1F1B's p - r - 1 warm-up
// forwards reach a chunk's backward before its forward (rank 1) or wait forever.
TEST(PipelineSchedule, SimulationRejectsAWarmUpTooShortForTheChunks) {
  auto short_warmup = [](int stage, int stages, int chunks, int64_t m) {
    std::vector<PipelineOp> f, b, ops;
    for (const auto& op : interleaved_order(stage, stages, chunks, m)) (op.forward() ? f : b).push_back(op);
    const size_t warmup = static_cast<size_t>(stages - stage - 1);
    ops.assign(f.begin(), f.begin() + static_cast<long>(warmup));
    for (size_t k = warmup; k < f.size(); ++k) {
      ops.push_back(f[k]);
      ops.push_back(b[k - warmup]);
    }
    ops.insert(ops.end(), b.end() - static_cast<long>(warmup), b.end());
    return ops;
  };
  EXPECT_NO_THROW(simulate(2, 1, 4, short_warmup));  // one chunk: that is 1F1B, which runs
  EXPECT_ANY_THROW(simulate(2, 2, 4, short_warmup));
  EXPECT_ANY_THROW(simulate(4, 2, 8, short_warmup));
}

TEST(PipelineSchedule, InterleavedRefusesWhatItCannotRun) {
  auto fails = [](int p, int v, int64_t m, const std::string& says) {
    try {
      interleaved_order(0, p, v, m);
      ADD_FAILURE() << "p " << p << " v " << v << " m " << m << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  fails(2, 2, 3, "--micro-batches must be a multiple of --pp");
  fails(4, 2, 6, "--micro-batches must be a multiple of --pp");
  fails(1, 2, 4, "needs --pp 2 or more");
  fails(2, 0, 4, "--virtual-stages must be at least 1");
  EXPECT_NO_THROW(check_interleaved(2, 2, 8));
}

// ---- zero-bubble schedules: F, B and W operations ----

using SplitOrderFn = std::function<std::vector<PipelineOp>(int stage, int stages, int64_t m)>;

// Every rank's split order run by run_orders: F, B and W of a chunk each take one unit (the
// paper's T_F = T_B = T_W).
SimRun simulate_split(int p, int chunks, bool v_shape, int64_t m, const SplitOrderFn& order_of) {
  std::vector<std::vector<PipelineOp>> order(p);
  for (int r = 0; r < p; ++r) order[r] = order_of(r, p, m);
  return run_orders(order, chunks, v_shape, m, 1.0);
}

// Each (chunk, micro-batch) gets F, B and W once, in that order; F and B of a chunk go in
// micro-batch order (the order its messages are received in). Returns the peak live
// micro-batches (F done, B not yet) and the peak between F and W.
std::pair<int64_t, int64_t> check_split_order(const std::vector<PipelineOp>& ops, int chunks, int64_t m) {
  EXPECT_EQ(static_cast<int64_t>(ops.size()), 3 * m * chunks);
  std::map<std::pair<int, int64_t>, int> state;
  std::vector<int64_t> next_f(chunks, 0), next_b(chunks, 0);
  int64_t live = 0, held = 0, peak = 0, peak_held = 0;
  for (const auto& op : ops) {
    EXPECT_TRUE(op.chunk >= 0 && op.chunk < chunks && op.micro_batch >= 0 && op.micro_batch < m);
    int& st = state[{op.chunk, op.micro_batch}];
    EXPECT_EQ(st++, static_cast<int>(op.kind));  // F, then B, then W
    if (op.kind == PipelineOpKind::kForward) {
      EXPECT_EQ(op.micro_batch, next_f[op.chunk]++);
      peak = std::max(peak, ++live);
      peak_held = std::max(peak_held, ++held);
    } else if (op.kind == PipelineOpKind::kBackward) {
      EXPECT_EQ(op.micro_batch, next_b[op.chunk]++);
      --live;
    } else {
      --held;
    }
  }
  EXPECT_EQ(static_cast<int64_t>(state.size()), m * chunks);
  return {peak, peak_held};
}

TEST(PipelineSchedule, ZbH1KeepsOneFOneBsMemoryAndAThirdOfItsBubble) {
  for (int p : {2, 3, 4}) {
    for (int64_t m : {1, 2, 3, 4, 5, 8, 12}) {
      SCOPED_TRACE("p " + std::to_string(p) + " m " + std::to_string(m));
      for (int r = 0; r < p; ++r) {
        auto [peak, held] = check_split_order(zb_h1_order(r, p, m), 1, m);
        EXPECT_EQ(peak, std::min<int64_t>(p - r, m));  // 1F1B's
        EXPECT_LE(held, p);                            // 1F1B's stage 0
      }
      SimRun run;
      ASSERT_NO_THROW(run = simulate_split(p, 1, false, m, zb_h1_order));
      EXPECT_EQ(run.sent, run.received);
      const double idle = *std::max_element(run.end.begin(), run.end.end()) - 3.0 * m;
      // (p - 1) (T_F + T_B - T_W), against 1F1B's (p - 1) (T_F + T_B + T_W) (simulated below).
      if (m >= p) {
        EXPECT_DOUBLE_EQ(idle, p - 1.0);
        // The figure the report and tandem plan use: idle over the 3m units of compute.
        EXPECT_DOUBLE_EQ(pipeline_bubble_theory(PipelineSchedule::kZBH1, p, m), idle / (3.0 * m));
        EXPECT_DOUBLE_EQ(pipeline_bubble_theory(PipelineSchedule::kZBH1, p, m),
                         pipeline_bubble_theory(PipelineSchedule::k1F1B, p, m) / 3.0);
      }
      const std::vector<double> f1b = simulate(p, 1, m, [](int s, int stages, int, int64_t mm) {
        std::vector<PipelineOp> o;
        for (auto [fwd, i] : pipeline_order(false, s, stages, mm))
          o.push_back({fwd ? PipelineOpKind::kForward : PipelineOpKind::kBackward, 0, i});
        return o;
      });
      EXPECT_DOUBLE_EQ(*std::max_element(f1b.begin(), f1b.end()) - 3.0 * m, 3.0 * (p - 1));
      EXPECT_DOUBLE_EQ(pipeline_bubble_theory(PipelineSchedule::k1F1B, p, m), (p - 1.0) / m);
    }
  }
}

TEST(PipelineSchedule, ZbVRunsAVWithNearZeroBubbleAtOneFOneBsMemory) {
  for (int p : {2, 3, 4}) {
    for (int64_t m : {1, 2, 3, 4, 5, 8, 12}) {
      SCOPED_TRACE("p " + std::to_string(p) + " m " + std::to_string(m));
      for (int r = 0; r < p; ++r) {
        auto [peak, held] = check_split_order(zb_v_order(r, p, m), 2, m);
        // Chunk micro-batches of half a stage each: 1F1B stage 0's p whole micro-batches.
        EXPECT_LE(peak, 2 * p);
        EXPECT_LE(held, 2 * p);
        if (m >= 2 * p) EXPECT_EQ(peak, 2 * p);
      }
      SimRun run;
      ASSERT_NO_THROW(run = simulate_split(p, 2, true, m, zb_v_order));
      EXPECT_EQ(run.sent, run.received);
      // Work: 6 m chunk operations per rank; idle (p - 1) units, a sixth of 1F1B's 6 (p - 1).
      const double idle = *std::max_element(run.end.begin(), run.end.end()) - 6.0 * m;
      if (m >= 2 * p) {
        EXPECT_DOUBLE_EQ(idle, p - 1.0);
        EXPECT_DOUBLE_EQ(pipeline_bubble_theory(PipelineSchedule::kZBV, p, m), idle / (6.0 * m));
      }
      EXPECT_LE(idle, 6.0 * (p - 1));
    }
  }
}

TEST(PipelineSchedule, VLayoutTurnsOnTheLastRank) {
  EXPECT_EQ(pipeline_virtual_stage(0, 1, 4, true), 1);
  EXPECT_EQ(pipeline_virtual_stage(1, 1, 4, true), 6);
  EXPECT_EQ(pipeline_virtual_stage(1, 0, 4, true), 7);  // the loss on rank 0
  EXPECT_EQ(pipeline_virtual_stage(1, 1, 4, false), 5);
  for (bool v : {false, true}) {
    for (int64_t s = 0; s < 8; ++s) {
      auto [r, c] = pipeline_stage_owner(s, 4, v);
      EXPECT_EQ(pipeline_virtual_stage(c, r, 4, v), s);
    }
  }
  // The simulation catches a V order run on the loop layout: rank 0's chunk 1 is virtual stage
  // 2 there, whose input comes from rank 1's chunk 0 - a different order of messages.
  EXPECT_ANY_THROW({
    auto run = simulate_split(2, 2, false, 4, zb_v_order);
    if (run.sent != run.received) throw std::runtime_error("messages do not match");
  });
  EXPECT_THROW(zb_v_order(0, 1, 4), std::invalid_argument);
  EXPECT_THROW(zb_h1_order(2, 2, 4), std::invalid_argument);
  EXPECT_THROW(parse_pipeline_schedule("zb-h2"), std::invalid_argument);
  // Unequal times: zb-h1's idle is (p - 1)(T_F + T_B - T_W) over m (T_F + T_B + T_W).
  EXPECT_DOUBLE_EQ(pipeline_bubble_theory(PipelineSchedule::kZBH1, 4, 8, 1, 1.0, 2.0, 1.0), 3.0 * 2.0 / (8 * 4.0));
}

}  // namespace
}  // namespace tandem
