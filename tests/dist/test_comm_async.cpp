// Work handles: several operations in flight on one communicator, waited in any order (even
// a different order on each rank); operations on two communicators interleaved; operations
// completing without wait() (the progress thread drives them); split into sub-groups; and the
// per-operation counters.
#include <gtest/gtest.h>

#include <algorithm>
#include <ctime>
#include <numeric>
#include <thread>

#include "tandem/backends.h"
#include "tests/dist/comm_test_util.h"
#include "tests/dist/dist_env.h"

namespace tandem::test {
namespace {

using std::chrono::milliseconds;

TEST(Async, OutstandingOperationsCompleteInAnyWaitOrder) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t big = 1000003;
  auto a = rank_input(me, big, at::kFloat, 50);
  auto b_in = rank_input(me, 7, at::kDouble, 51);
  auto b_out = at::zeros({R * 7}, at::kDouble);
  auto c = rank_input(me, 1000, at::kBFloat16, 52);
  auto d = rank_input(me, 13, at::kLong, 53);
  auto e_in = rank_input(me, R * 5, at::kHalf, 54);
  auto e_out = at::zeros({5}, at::kHalf);
  std::vector<WorkPtr> works = {
      comm->allreduce_async(a, ReduceOp::kSum),
      comm->allgather_async(b_out, b_in),
      comm->broadcast_async(c, R - 1),
      comm->allreduce_async(d, ReduceOp::kMax),
      comm->reduce_scatter_async(e_out, e_in, ReduceOp::kMax),
      comm->barrier_async(),
  };
  // Each rank waits in its own order: forward, backward, or a rotation.
  std::vector<size_t> order(works.size());
  std::iota(order.begin(), order.end(), 0);
  if (me % 3 == 1) std::reverse(order.begin(), order.end());
  if (me % 3 == 2) std::rotate(order.begin(), order.begin() + 2, order.end());
  for (size_t i : order) works[i]->wait();
  for (auto& w : works) {
    EXPECT_TRUE(w->is_completed());
    w->wait();  // waiting again is harmless
  }
  auto all_a = all_inputs(R, big, at::kFloat, 50);
  EXPECT_TRUE(within(a, all_a.sum(0), R * eps_of(at::kFloat) * all_a.abs().sum(0)));
  EXPECT_TRUE(exactly(b_out, all_inputs(R, 7, at::kDouble, 51).reshape({-1})));
  EXPECT_TRUE(exactly(c, rank_input(R - 1, 1000, at::kBFloat16, 52)));
  EXPECT_TRUE(exactly(d, std::get<0>(all_inputs(R, 13, at::kLong, 53).max(0))));
  std::vector<at::Tensor> e_all;
  for (int r = 0; r < R; ++r) e_all.push_back(rank_input(r, R * 5, at::kHalf, 54).narrow(0, me * 5, 5).to(at::kDouble));
  EXPECT_TRUE(exactly(e_out, std::get<0>(at::stack(e_all).max(0))));
}

TEST(Async, ManySmallOperationsWaitedBackwards) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  std::vector<at::Tensor> ts;
  std::vector<WorkPtr> ws;
  for (int i = 0; i < 40; ++i) {
    ts.push_back(at::full({i + 1}, static_cast<double>(me + i), at::kDouble));
    ws.push_back(comm->allreduce_async(ts.back(), ReduceOp::kSum));
  }
  for (int i = 39; i >= 0; --i) ws[i]->wait();
  for (int i = 0; i < 40; ++i) {
    double expect = R * (R - 1) / 2.0 + static_cast<double>(R) * i;
    EXPECT_TRUE(exactly(ts[i], at::full({i + 1}, expect))) << "operation " << i;
  }
}

TEST(Async, CompletesWithoutWaitWhileTheCallerComputes) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto t = rank_input(me, 1 << 20, at::kFloat, 55);
  auto work = comm->allreduce_async(t, ReduceOp::kSum);
  // Never call wait(): the progress thread alone has to finish the operation.
  auto t0 = std::chrono::steady_clock::now();
  while (!work->is_completed() && seconds_since(t0) < 30) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_TRUE(work->is_completed()) << "allreduce did not progress without wait() in 30 s";
  EXPECT_GT(work->seconds(), 0.0);
  work->wait();
  auto all = all_inputs(R, 1 << 20, at::kFloat, 55);
  EXPECT_TRUE(within(t, all.sum(0), R * eps_of(at::kFloat) * all.abs().sum(0)));
}

// A rank blocked in a receive whose sender is busy for 300 ms: with wait_sleep_us > 0 (the
// Runtime's choice on more threads than cores) its progress thread sleeps between polls, so the
// process uses a small part of a core while it waits; a poller that yields in a loop uses all
// of a free core (printed for comparison, not asserted: it depends on the machine's load).
TEST(Async, BlockedRankSleepsBetweenPollsWhenAsked) {
  auto base = world();
  const int R = base->size(), me = base->rank();
  for (int sleep_us : {50, 0}) {
    CommOptions o;
    o.timeout = kTestTimeout;
    o.wait_sleep_us = sleep_us;
    auto comm = make_mpi_world(o);  // collective on every rank
    auto x = at::zeros({16}, at::kFloat);
    comm->barrier();
    if (me == 0) {
      timespec c0{}, c1{};
      clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
      auto t0 = std::chrono::steady_clock::now();
      comm->recv(x, 1, 5);
      const double wall = seconds_since(t0);
      clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
      const double cpu = (c1.tv_sec - c0.tv_sec) + 1e-9 * (c1.tv_nsec - c0.tv_nsec);
      std::printf("[ wait     ] wait_sleep_us %d: %.0f ms waiting, %.0f ms of CPU (%.0f %%), %d ranks\n", sleep_us,
                  1e3 * wall, 1e3 * cpu, 100.0 * cpu / wall, R);
      EXPECT_GE(wall, 0.25);
      if (sleep_us > 0) EXPECT_LT(cpu, 0.4 * wall) << "the progress thread kept polling while its rank waited";
      EXPECT_TRUE(exactly(x, at::full({16}, 7.0)));
    } else if (me == 1) {
      std::this_thread::sleep_for(milliseconds(300));
      comm->send(at::full({16}, 7.0f), 0, 5);
    }
    comm->barrier();
  }
}

TEST(Async, SendsMatchReceivesByTagNotByOrder) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int next = (me + 1) % R, prev = (me + R - 1) % R;
  auto x1 = at::zeros({100}, at::kFloat), x2 = at::zeros({100}, at::kFloat);
  auto r2 = comm->recv_async(x2, prev, 2);  // posted first, sent second
  auto r1 = comm->recv_async(x1, prev, 1);
  auto s1 = comm->send_async(at::full({100}, 100.0f * me + 1), next, 1);
  auto s2 = comm->send_async(at::full({100}, 100.0f * me + 2), next, 2);
  r1->wait();
  r2->wait();
  s1->wait();
  s2->wait();
  EXPECT_TRUE(exactly(x1, at::full({100}, 100.0 * prev + 1)));
  EXPECT_TRUE(exactly(x2, at::full({100}, 100.0 * prev + 2)));
}

TEST(Async, TwoCommunicatorsInterleaved) {
  auto w = world();
  const int R = w->size(), me = w->rank();
  auto other = w->split(0, R - me);  // same ranks, reversed order
  ASSERT_TRUE(other);
  EXPECT_EQ(other->rank(), R - 1 - me);  // not ASSERT: every rank must go on to the collectives
  const int64_t n = 100003;
  auto a = rank_input(me, n, at::kFloat, 60);
  auto b = rank_input(me, n, at::kFloat, 61);
  auto g_in = at::full({1}, me, at::kLong);
  auto g_w = at::empty({R}, at::kLong), g_o = at::empty({R}, at::kLong);
  // Even ranks issue on the world first, odd ranks on the other communicator first: each
  // communicator sees its own operations in the same order on all ranks, which is all the
  // contract asks.
  std::vector<WorkPtr> ws;
  auto on_world = [&] {
    ws.push_back(w->allreduce_async(a, ReduceOp::kSum));
    ws.push_back(w->allgather_async(g_w, g_in));
  };
  auto on_other = [&] {
    ws.push_back(other->allreduce_async(b, ReduceOp::kMax));
    ws.push_back(other->allgather_async(g_o, g_in));
  };
  if (me % 2 == 0) {
    on_world();
    on_other();
  } else {
    on_other();
    on_world();
  }
  for (size_t i = ws.size(); i-- > 0;) ws[i]->wait();
  auto all_a = all_inputs(R, n, at::kFloat, 60);
  EXPECT_TRUE(within(a, all_a.sum(0), R * eps_of(at::kFloat) * all_a.abs().sum(0)));
  EXPECT_TRUE(exactly(b, std::get<0>(all_inputs(R, n, at::kFloat, 61).max(0))));
  EXPECT_TRUE(exactly(g_w, at::arange(R, at::kLong)));
  EXPECT_TRUE(exactly(g_o, at::arange(R - 1, -1, -1, at::kLong)));
}

// ---- split

std::vector<int64_t> gather_world_ranks(Communicator& c) {
  auto in = at::full({1}, world()->rank(), at::kLong);
  auto out = at::empty({c.size()}, at::kLong);
  c.allgather(out, in);
  return std::vector<int64_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
}

TEST(Split, EvenAndOddColors) {
  auto w = world();
  const int R = w->size(), me = w->rank();
  auto sub = w->split(me % 2, me);
  ASSERT_TRUE(sub);
  std::vector<int64_t> members;
  for (int r = me % 2; r < R; r += 2) members.push_back(r);
  EXPECT_EQ(sub->size(), static_cast<int>(members.size()));
  EXPECT_EQ(sub->rank(), me / 2);
  EXPECT_EQ(sub->backend(), "mpi");
  EXPECT_EQ(sub->timeout(), w->timeout());
  EXPECT_EQ(gather_world_ranks(*sub), members);
  // A collective inside each group sums only that group's values.
  auto t = rank_input(me, 1001, at::kDouble, 70);
  sub->allreduce(t, ReduceOp::kSum);
  auto ref = at::zeros({1001}, at::kDouble), scale = at::zeros({1001}, at::kDouble);
  for (auto r : members) {
    auto x = rank_input(static_cast<int>(r), 1001, at::kDouble, 70);
    ref += x;
    scale += x.abs();
  }
  EXPECT_TRUE(within(t, ref, R * eps_of(at::kDouble) * scale));
  // Broadcast from the group's last rank.
  auto b = at::full({3}, me, at::kLong);
  sub->broadcast(b, sub->size() - 1);
  EXPECT_TRUE(exactly(b, at::full({3}, static_cast<double>(members.back()))));
  // The groups' operations do not interfere with the world.
  auto one = at::ones({1}, at::kLong);
  w->allreduce(one, ReduceOp::kSum);
  EXPECT_EQ(one.item<int64_t>(), R);
}

// A communicator destroyed while its sends are still in flight (4 MiB each: above the eager
// limit, a send completes only once received) waits for them: the late receivers get the data.
TEST(Split, DestroyedWithSendsInFlightDeliversThem) {
  auto w = world();
  const int R = w->size(), me = w->rank();
  const int64_t n = 1 << 20;
  auto sub = w->split(0, me);
  if (me == 0) {
    std::vector<WorkPtr> sends;
    for (int r = 1; r < R; ++r)
      sends.push_back(sub->send_async(at::full({n}, static_cast<float>(r), at::kFloat), r, 7));
    std::this_thread::sleep_for(milliseconds(50));  // the progress thread has started them
    sub.reset();                                    // unwaited: the destructor drains them
    for (auto& s : sends) EXPECT_TRUE(s->is_completed());
  } else {
    std::this_thread::sleep_for(milliseconds(300));
    auto got = at::zeros({n}, at::kFloat);
    sub->recv(got, 0, 7);
    sub.reset();
    EXPECT_TRUE(at::equal(got, at::full({n}, static_cast<float>(me), at::kFloat)));
  }
  w->barrier();
}

TEST(Split, KeysOrderTheNewRanks) {
  auto w = world();
  const int R = w->size(), me = w->rank();
  auto rev = w->split(5, -me);
  ASSERT_TRUE(rev);
  EXPECT_EQ(rev->rank(), R - 1 - me);
  std::vector<int64_t> expect(R);
  for (int i = 0; i < R; ++i) expect[i] = R - 1 - i;
  EXPECT_EQ(gather_world_ranks(*rev), expect);
  // Equal keys: ordered by the current rank.
  auto same = w->split(5, 0);
  EXPECT_EQ(same->rank(), me);
  // Split of a split, with the reversed communicator as parent: keys are its ranks.
  auto nested = rev->split(0, rev->rank());
  EXPECT_EQ(nested->rank(), R - 1 - me);
  auto t = at::full({2}, me, at::kLong);
  nested->broadcast(t, 0);  // nested rank 0 is world rank R-1
  EXPECT_TRUE(exactly(t, at::full({2}, static_cast<double>(R - 1))));
}

TEST(Split, NegativeColorLeavesTheRankOut) {
  auto w = world();
  const int R = w->size(), me = w->rank();
  auto sub = w->split(me == 0 ? -1 : 3, me);
  if (me == 0) {
    EXPECT_EQ(sub, nullptr);
  } else {
    ASSERT_TRUE(sub);
    EXPECT_EQ(sub->size(), R - 1);
    EXPECT_EQ(sub->rank(), me - 1);
    auto t = at::full({4}, me, at::kFloat);
    sub->allreduce(t, ReduceOp::kSum);
    EXPECT_TRUE(exactly(t, at::full({4}, R * (R - 1) / 2.0)));  // ranks 1..R-1
  }
  w->barrier();
}

// ---- counters

TEST(Stats, CountsCallsAndPayloadBytesPerOperation) {
  auto w = world();
  const int R = w->size(), me = w->rank();
  auto comm = w->split(0, me);
  comm->reset_stats();
  EXPECT_TRUE(comm->stats().empty());
  auto f = at::ones({1000}, at::kFloat);  // 4000 bytes
  comm->allreduce(f, ReduceOp::kSum);
  comm->allreduce(f, ReduceOp::kMax);
  auto h = at::ones({R * 6}, at::kBFloat16);  // reduce_scatter input: R*12 bytes
  auto h_out = at::empty({6}, at::kBFloat16);
  comm->reduce_scatter(h_out, h, ReduceOp::kSum);
  auto d = at::ones({7}, at::kDouble);  // allgather input: 56 bytes
  auto d_out = at::empty({7 * R}, at::kDouble);
  comm->allgather(d_out, d);
  auto l = at::ones({3}, at::kLong);  // 24 bytes
  comm->broadcast(l, 0);
  const int next = (me + 1) % R, prev = (me + R - 1) % R;
  auto s = comm->send_async(at::ones({10}, at::kFloat), next, 0);  // 40 bytes
  auto r_buf = at::empty({10}, at::kFloat);
  comm->recv(r_buf, prev, 0);
  s->wait();
  comm->barrier();
  auto st = comm->stats();
  auto check = [&](const char* op, int64_t calls, int64_t bytes) {
    ASSERT_EQ(st.count(op), 1u) << op;
    EXPECT_EQ(st[op].calls, calls) << op;
    EXPECT_EQ(st[op].bytes, bytes) << op;
    EXPECT_GE(st[op].seconds, 0.0) << op;
  };
  check("allreduce", 2, 8000);
  check("reduce_scatter", 1, R * 12);
  check("allgather", 1, 56);
  check("broadcast", 1, 24);
  check("send", 1, 40);
  check("recv", 1, 40);
  check("barrier", 1, 0);
  EXPECT_GT(st["allreduce"].seconds, 0.0);
  // reset_stats clears, and the counters are per communicator.
  comm->reset_stats();
  EXPECT_TRUE(comm->stats().empty());
  w->reset_stats();
  comm->allreduce(f, ReduceOp::kSum);
  EXPECT_EQ(w->stats().count("allreduce"), 0u);
}

}  // namespace
}  // namespace tandem::test
