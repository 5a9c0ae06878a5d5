// Communicator::alltoall (rows along dim 0, uneven and zero counts, 1-D to 3-D rows, float and
// int64, async), moe::exchange_counts, and moe::all_to_all's autograd and statistics, against
// rows whose values name their sender and receiver (tests/dist/all_to_all_cases.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/moe.h"
#include "tests/dist/all_to_all_cases.h"
#include "tests/dist/dist_env.h"

namespace tandem::test {
namespace {

const std::vector<std::vector<int64_t>> kRowShapes = {{}, {3}, {2, 3}};

std::string shape_text(const std::vector<int64_t>& row) { return "rows of " + c10::str(at::IntArrayRef(row)); }

TEST(AllToAll, EveryCaseRowShapeAndDtypeArrivesInRankOrder) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (const auto& c : a2a::cases(R)) {
    for (const auto& row : kRowShapes) {
      for (auto dtype : {at::kFloat, at::kLong}) {
        auto in = a2a::sent_by(me, c, row, dtype);
        auto want = a2a::received_by(me, c, row, dtype);
        auto out = at::full(want.sizes(), -1, want.options());
        EXPECT_NO_THROW(comm->alltoall(out, in, c.recvs(me), c.sends(me)));
        EXPECT_TRUE(out.equal(want)) << c.name << ", " << shape_text(row) << ", " << dtype << " on rank " << me
                                     << ": got " << out << " want " << want;
      }
    }
  }
}

TEST(AllToAll, AsyncOperationsInFlightTogetherAndCounted) {
  auto w = world();
  const int R = w->size(), me = w->rank();
  auto comm = w->split(0, me);
  comm->reset_stats();
  const auto cs = a2a::cases(R);
  const auto& a = cs[0];
  const auto& b = cs[1];
  auto in_a = a2a::sent_by(me, a, {3}, at::kFloat), want_a = a2a::received_by(me, a, {3}, at::kFloat);
  auto in_b = a2a::sent_by(me, b, {2, 3}, at::kLong), want_b = a2a::received_by(me, b, {2, 3}, at::kLong);
  auto out_a = at::empty_like(want_a), out_b = at::empty_like(want_b);
  auto wa = comm->alltoall_async(out_a, in_a, a.recvs(me), a.sends(me));
  auto wb = comm->alltoall_async(out_b, in_b, b.recvs(me), b.sends(me));
  wb->wait();
  wa->wait();
  EXPECT_TRUE(out_a.equal(want_a)) << "rank " << me;
  EXPECT_TRUE(out_b.equal(want_b)) << "rank " << me;
  EXPECT_TRUE(wa->is_completed() && wb->is_completed());
  auto st = comm->stats();
  ASSERT_EQ(st.count("alltoall"), 1u);
  EXPECT_EQ(st["alltoall"].calls, 2);
  EXPECT_EQ(st["alltoall"].bytes, in_a.numel() * 4 + in_b.numel() * 8);
  EXPECT_GE(st["alltoall"].seconds, 0.0);
}

TEST(AllToAll, ExchangeCountsReturnsWhatEveryRankSendsHere) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (const auto& c : a2a::cases(R)) {
    std::vector<int64_t> got;
    EXPECT_NO_THROW(got = moe::exchange_counts(*comm, c.sends(me)));
    EXPECT_EQ(got, c.recvs(me)) << c.name << " on rank " << me;
  }
  // Refused before any communication, on the rank that calls it wrongly.
  EXPECT_THROW(moe::exchange_counts(*comm, std::vector<int64_t>(R + 1, 0)), std::invalid_argument);
  std::vector<int64_t> negative(R, 1);
  negative[0] = -1;
  try {
    moe::exchange_counts(*comm, negative);
    ADD_FAILURE() << "a negative count was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("send_counts [-1"), std::string::npos) << e.what();
  }
}

// The gradient of sum(w * all_to_all(x)) with respect to x is w sent back by the reverse
// all-to-all: the weight of the row that rank s sent rank d arrives back at rank s, in place.
TEST(AllToAll, BackwardIsTheReverseAllToAllAndStatsCountBoth) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (const auto& c : a2a::cases(R)) {
    for (const auto& row : kRowShapes) {
      auto x = a2a::sent_by(me, c, row, at::kDouble).requires_grad_(true);
      auto w = a2a::received_by(me, c, row, at::kDouble, a2a::weight);
      moe::reset_moe_stats();
      at::Tensor y;
      EXPECT_NO_THROW(y = moe::all_to_all(x, c.sends(me), c.recvs(me), comm));
      EXPECT_TRUE(y.equal(a2a::received_by(me, c, row, at::kDouble))) << c.name << " on rank " << me;
      EXPECT_NO_THROW((w * y).sum().backward());
      const auto where = c.name + ", " + shape_text(row) + " on rank " + std::to_string(me);
      ASSERT_TRUE(x.grad().defined()) << where;
      EXPECT_TRUE(x.grad().equal(a2a::sent_by(me, c, row, at::kDouble, a2a::weight))) << where << ": got " << x.grad();
      const auto st = moe::moe_stats();
      int64_t row_bytes = 8;
      for (auto n : row) row_bytes *= n;
      EXPECT_EQ(st.all_to_alls, 2) << where;
      EXPECT_EQ(st.all_to_all_bytes,
                (a2a::rows_sent_to_others(me, c) + a2a::rows_received_from_others(me, c)) * row_bytes)
          << where;
      EXPECT_GT(st.all_to_all_seconds, 0.0) << where;
    }
  }
}

// Every rank makes the same wrong call, which fails on each before any communication; the
// communicator is usable afterwards.
TEST(AllToAll, BadSplitsAreRejectedNamingTheSizes) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const std::string rank = "rank " + std::to_string(me);
  auto expect_refused = [&](const std::function<void()>& call, const std::vector<std::string>& phrases) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected an error with " << phrases.front();
    } catch (const std::invalid_argument& e) {
      for (const auto& p : phrases) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  };
  auto in = at::zeros({R + 1, 3});
  auto out = at::zeros({R + 1, 3});
  std::vector<int64_t> ones(R, 1);
  auto plus_one = ones;
  plus_one[0] += 1;  // R + 1 rows
  expect_refused([&] { comm->alltoall(out, in, plus_one, ones); },
                 {rank, "input_splits " + c10::str(at::IntArrayRef(ones)), "sum to " + std::to_string(R) + " rows",
                  "input has " + std::to_string(R + 1)});
  expect_refused([&] { comm->alltoall(out, in, std::vector<int64_t>(R + 1, 0), plus_one); },
                 {rank, "output_splits", "has " + std::to_string(R + 1) + " entries",
                  "one per rank (" + std::to_string(R)});
  auto negative = plus_one;
  negative[R - 1] = -1;
  negative[0] += 3;  // still R + 1 rows in all
  expect_refused([&] { comm->alltoall(out, in, plus_one, negative); }, {rank, "negative"});
  expect_refused(
      [&] {
        comm->alltoall(at::zeros({R + 1, 4}), in, plus_one, plus_one);
      },
      {rank, "[" + std::to_string(R + 1) + ", 3]", "[" + std::to_string(R + 1) + ", 4]"});
  expect_refused([&] { comm->alltoall(out.to(at::kDouble), in, plus_one, plus_one); }, {rank, "dtype", "Double"});
  expect_refused([&] { comm->alltoall(at::zeros({3, R + 1}).t(), in, plus_one, plus_one); }, {rank, "contiguous"});
  expect_refused([&] { comm->alltoall(in, in, plus_one, plus_one); }, {rank, "shares memory"});
  auto self_in = ones, self_out = ones;  // two rows to itself, one expected from itself
  self_in[me] += 1;
  self_out[(me + 1) % R] += 1;
  const auto m = std::to_string(me);
  expect_refused([&] { comm->alltoall(out, in, self_out, self_in); },
                 {rank, "input_splits[" + m + "] = 2 rows to itself", "output_splits[" + m + "] = 1"});
  expect_refused([&] { moe::all_to_all(in, ones, ones, comm); },
                 {"rank " + std::to_string(me), "send_counts " + c10::str(at::IntArrayRef(ones)),
                  "[" + std::to_string(R + 1) + ", 3]"});
  // Still in step: one good call.
  const auto c = a2a::cases(R)[0];
  auto good = at::empty_like(a2a::received_by(me, c, {}, at::kFloat));
  EXPECT_NO_THROW(comm->alltoall(good, a2a::sent_by(me, c, {}, at::kFloat), c.recvs(me), c.sends(me)));
  EXPECT_TRUE(good.equal(a2a::received_by(me, c, {}, at::kFloat)));
}

// MPI's counts and displacements are ints: a side of 2^31 elements is refused, naming its size.
TEST(AllToAll, MoreElementsThanMpiCountsHoldAreRefused) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t big = int64_t{1} << 31;
  auto in = at::empty({big}, at::kByte);  // never written or read: its pages stay untouched
  std::vector<int64_t> in_splits(R, 0), out_splits(R, 0);
  in_splits[(me + 1) % R] = big;
  try {
    comm->alltoall(at::empty({0}, at::kByte), in, out_splits, in_splits);
    ADD_FAILURE() << "2^31 elements were accepted";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("2147483648 elements"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tandem::test
