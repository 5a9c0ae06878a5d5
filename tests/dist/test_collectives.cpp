// Every collective of the Communicator on every rank, for each dtype and for 1, 7 and 1000003
// elements (reduce_scatter: an input of about that size, R chunks of ceil(n / R)), against a
// reference each rank computes locally in float64 from all ranks' inputs (seeded by rank).
// Sums may differ from the reference by rounding only: the bound is R * eps(dtype) * sum|x_r|
// elementwise (about twice the worst case of R-1 roundings to the dtype); max, gather,
// broadcast and point-to-point must be exact.
#include <gtest/gtest.h>

#include <thread>

#include "tests/dist/comm_test_util.h"
#include "tests/dist/dist_env.h"

namespace tandem::test {
namespace {

struct Case {
  at::ScalarType dtype;
  int64_t n;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string d;
  switch (info.param.dtype) {
    case at::kFloat: d = "float32"; break;
    case at::kDouble: d = "float64"; break;
    case at::kBFloat16: d = "bfloat16"; break;
    case at::kHalf: d = "float16"; break;
    case at::kLong: d = "int64"; break;
    default: d = "other";
  }
  return d + "_n" + std::to_string(info.param.n);
}

class Collectives : public ::testing::TestWithParam<Case> {
 protected:
  CommPtr comm = world();
  const int R = comm->size();
  const int me = comm->rank();
  const at::ScalarType dt = GetParam().dtype;
  const int64_t n = GetParam().n;
  const double eps = eps_of(dt);
  bool floating() const { return at::isFloatingType(dt); }
  // [R, n] float64 inputs of all ranks for `salt`, and this rank's own input in its dtype
  // (taken from that tensor: exact, since the values were rounded to the dtype).
  at::Tensor all(int64_t salt) { return all_inputs(R, n, dt, salt); }
  // A copy: for float64, .to() would return a view of all_in, and the collective would
  // overwrite the reference's inputs.
  at::Tensor own(const at::Tensor& all_in) const { return all_in[me].to(dt, /*non_blocking=*/false, /*copy=*/true); }
};

TEST_P(Collectives, AllreduceSum) {
  auto all = this->all(1);
  auto t = own(all);
  comm->allreduce(t, ReduceOp::kSum);
  EXPECT_EQ(t.scalar_type(), dt);
  EXPECT_TRUE(within(t, all.sum(0), R * eps * all.abs().sum(0)));
}

TEST_P(Collectives, AllreduceAvg) {
  if (!floating()) {  // no integer average: refused at the call
    auto t = rank_input(me, n, dt, 2);
    EXPECT_THROW(comm->allreduce(t, ReduceOp::kAvg), CommError);
    return;
  }
  auto all = this->all(2);
  auto t = own(all);
  comm->allreduce(t, ReduceOp::kAvg);
  auto ref = all.mean(0);
  // Sum's bound divided by R, plus the rounding of the division.
  EXPECT_TRUE(within(t, ref, eps * (all.abs().sum(0) + ref.abs())));
}

TEST_P(Collectives, AllreduceMax) {
  auto all = this->all(3);
  auto t = own(all);
  comm->allreduce(t, ReduceOp::kMax);
  EXPECT_TRUE(exactly(t, std::get<0>(all.max(0))));
}

// reduce_scatter: the input holds about n elements (R chunks of ceil(n / R)). Rank r's input
// is its chunks side by side, chunk c seeded by (r, salt + c), so the reference for this
// rank's chunk needs only chunk `me` of every rank.
at::Tensor scatter_input(int rank, int R, int64_t chunk, at::ScalarType dt, int64_t salt) {
  std::vector<at::Tensor> chunks;
  for (int c = 0; c < R; ++c) chunks.push_back(rank_input(rank, chunk, dt, salt + c));
  return at::cat(chunks);
}

TEST_P(Collectives, ReduceScatter) {
  const int64_t chunk = (n + R - 1) / R;
  auto mine = all_inputs(R, chunk, dt, 10 + me);  // chunk `me` of every rank
  struct {
    ReduceOp op;
    at::Tensor ref, bound;
  } cases[] = {
      {ReduceOp::kSum, mine.sum(0), R * eps * mine.abs().sum(0)},
      {ReduceOp::kMax, std::get<0>(mine.max(0)), at::zeros({1}, at::kDouble)},
      {ReduceOp::kAvg, mine.mean(0), eps * (mine.abs().sum(0) + mine.mean(0).abs())},
  };
  auto in = scatter_input(me, R, chunk, dt, 10);
  auto in_copy = in.clone();
  for (auto& c : cases) {
    if (c.op == ReduceOp::kAvg && !floating()) continue;
    auto out = at::full({chunk}, 77, in.options());
    comm->reduce_scatter(out, in, c.op);
    EXPECT_TRUE(within(out, c.ref, c.bound)) << "reduce_scatter " << to_string(c.op);
    EXPECT_TRUE(exactly(in, in_copy)) << "reduce_scatter must not modify its input";
  }
}

TEST_P(Collectives, Allgather) {
  auto all = this->all(4);
  auto in = own(all);
  auto out = at::full({R * n}, 77, in.options());
  comm->allgather(out, in);
  EXPECT_TRUE(exactly(out, all.reshape({-1})));
  if (n < 1000) {  // 2-D output [R, n]: row r is rank r's input
    auto out2 = at::zeros({R, n}, in.options());
    comm->allgather(out2, in);
    EXPECT_TRUE(exactly(out2, all));
  }
}

TEST_P(Collectives, BroadcastFromEveryRoot) {
  for (int root = 0; root < R; ++root) {
    auto expect = rank_input(root, n, dt, 100 + root);
    auto t = me == root ? expect.clone() : at::full({n}, 77, expect.options());
    comm->broadcast(t, root);
    EXPECT_TRUE(exactly(t, expect)) << "root " << root;
  }
}

TEST_P(Collectives, SendRecvRing) {
  // Two rings at once, in opposite directions and with different tags (with 2 ranks both go
  // to the same peer, so only the tags keep them apart).
  const int next = (me + 1) % R, prev = (me + R - 1) % R;
  auto fwd = rank_input(me, n, dt, 5);
  auto bwd = rank_input(me, n, dt, 6);
  auto from_prev = at::full({n}, 77, fwd.options());
  auto from_next = at::full({n}, 77, fwd.options());
  auto r1 = comm->recv_async(from_prev, prev, 11);
  auto r2 = comm->recv_async(from_next, next, 12);
  auto s1 = comm->send_async(fwd, next, 11);
  auto s2 = comm->send_async(bwd, prev, 12);
  s2->wait();
  r1->wait();
  s1->wait();
  r2->wait();
  EXPECT_TRUE(exactly(from_prev, rank_input(prev, n, dt, 5)));
  EXPECT_TRUE(exactly(from_next, rank_input(next, n, dt, 6)));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Collectives,
                         ::testing::Values(Case{at::kFloat, 1}, Case{at::kFloat, 7}, Case{at::kFloat, 1000003},
                                           Case{at::kDouble, 1}, Case{at::kDouble, 7}, Case{at::kDouble, 1000003},
                                           Case{at::kBFloat16, 1}, Case{at::kBFloat16, 7}, Case{at::kBFloat16, 1000003},
                                           Case{at::kHalf, 1}, Case{at::kHalf, 7}, Case{at::kHalf, 1000003},
                                           Case{at::kLong, 1}, Case{at::kLong, 7}, Case{at::kLong, 1000003}),
                         case_name);

// The bf16 tolerance is not vacuous: summing in bf16 one rank at a time, with a rounding
// after every addition, stays within it, while dropping one rank's contribution does not.
TEST(CollectiveTolerance, Bf16BoundSeparatesRoundingFromWrongResults) {
  const int R = world()->size();
  const int64_t n = 4096;
  auto all = all_inputs(R, n, at::kBFloat16, 1);
  auto acc = all[0].to(at::kBFloat16);
  for (int r = 1; r < R; ++r) acc = (acc.to(at::kFloat) + all[r].to(at::kFloat)).to(at::kBFloat16);
  auto bound = R * eps_of(at::kBFloat16) * all.abs().sum(0);
  EXPECT_TRUE(within(acc, all.sum(0), bound));
  EXPECT_FALSE(within(all.narrow(0, 0, R - 1).sum(0), all.sum(0), bound));
  EXPECT_FALSE(within(all.sum(0) * (1 + 4 * eps_of(at::kBFloat16) * R), all.sum(0), bound));
}

// ---- non-contiguous tensors: results land in the view, the rest of the base is untouched

TEST(NonContiguous, AllreduceIntoTransposedView) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto base = rank_input(me, 37 * 29, at::kFloat, 20).reshape({37, 29});
  auto view = base.t();
  ASSERT_FALSE(view.is_contiguous());
  comm->allreduce(view, ReduceOp::kSum);
  auto all = all_inputs(R, 37 * 29, at::kFloat, 20);
  EXPECT_TRUE(within(base.reshape({-1}), all.sum(0), R * eps_of(at::kFloat) * all.abs().sum(0)));
}

TEST(NonContiguous, AllreduceIntoStridedSliceLeavesGapsAlone) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t m = 1001;
  auto base = rank_input(me, 2 * m + 1, at::kDouble, 21);
  auto before = base.clone();
  auto odd = base.slice(0, 1, 2 * m + 1, 2);
  ASSERT_FALSE(odd.is_contiguous());
  comm->allreduce(odd, ReduceOp::kMax);
  auto all = all_inputs(R, 2 * m + 1, at::kDouble, 21);
  EXPECT_TRUE(exactly(odd, std::get<0>(all.max(0)).slice(0, 1, 2 * m + 1, 2)));
  EXPECT_TRUE(exactly(base.slice(0, 0, 2 * m + 1, 2), before.slice(0, 0, 2 * m + 1, 2)));
}

TEST(NonContiguous, BroadcastIntoViews) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int root = R - 1;
  auto base = rank_input(me, 2 * 300, at::kBFloat16, 22);
  auto before = base.clone();
  auto even = base.slice(0, 0, 600, 2);
  comm->broadcast(even, root);
  auto src = rank_input(root, 600, at::kBFloat16, 22);
  EXPECT_TRUE(exactly(even, src.slice(0, 0, 600, 2)));
  EXPECT_TRUE(exactly(base.slice(0, 1, 600, 2), before.slice(0, 1, 600, 2)));

  auto m = rank_input(me, 12 * 5, at::kLong, 23).reshape({12, 5});
  auto mt = m.t();
  comm->broadcast(mt, 0);
  EXPECT_TRUE(exactly(m, rank_input(0, 60, at::kLong, 23).reshape({12, 5})));
}

TEST(NonContiguous, SendFromAndRecvIntoViews) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int next = (me + 1) % R, prev = (me + R - 1) % R;
  // Send a transposed view (logical order of the view, not of its storage).
  auto src = rank_input(me, 8 * 9, at::kFloat, 24).reshape({8, 9}).t();
  auto dst_base = at::full({2 * 72}, -1.0f);
  auto dst = dst_base.slice(0, 0, 144, 2).reshape({9, 8});  // a strided view: reshape keeps it a view
  ASSERT_FALSE(dst.is_contiguous());
  auto r = comm->recv_async(dst, prev, 3);
  auto s = comm->send_async(src, next, 3);
  s->wait();
  r->wait();
  auto expect = rank_input(prev, 72, at::kFloat, 24).reshape({8, 9}).t();
  EXPECT_TRUE(exactly(dst, expect));
  EXPECT_TRUE(exactly(dst_base.slice(0, 1, 144, 2), at::full({72}, -1.0)));
}

TEST(NonContiguous, AllgatherIntoTransposedOutputFromStridedInput) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto in = rank_input(me, 12, at::kHalf, 25).slice(0, 0, 12, 2);  // 6 elements, stride 2
  auto out_base = at::full({6, R}, 5.0, at::kHalf);
  auto out = out_base.t();  // [R, 6], row r = rank r's input
  ASSERT_FALSE(out.is_contiguous());
  comm->allgather(out, in);
  auto all = all_inputs(R, 12, at::kHalf, 25).slice(1, 0, 12, 2);
  EXPECT_TRUE(exactly(out, all));
  EXPECT_TRUE(exactly(out_base, all.t()));
}

TEST(NonContiguous, ReduceScatterIntoStridedOutput) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t n = 9;
  auto in = rank_input(me, 2 * R * n, at::kDouble, 26).reshape({R * n, 2}).select(1, 1);  // stride 2
  auto out_base = at::full({2 * n}, -3.0, at::kDouble);
  auto out = out_base.slice(0, 1, 2 * n, 2);
  comm->reduce_scatter(out, in, ReduceOp::kSum);
  auto all = all_inputs(R, 2 * R * n, at::kDouble, 26).reshape({R, R * n, 2}).select(2, 1);
  auto ref = all.sum(0).narrow(0, me * n, n);
  EXPECT_TRUE(within(out, ref, R * eps_of(at::kDouble) * all.abs().sum(0).narrow(0, me * n, n)));
  EXPECT_TRUE(exactly(out_base.slice(0, 0, 2 * n, 2), at::full({n}, -3.0)));
}

// ---- in place (NCCL's convention: the chunk this rank owns inside the full buffer)

TEST(EdgeCases, ReduceScatterInPlaceIntoOwnChunk) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    const int64_t n = 1001;
    auto buf = rank_input(me, R * n, at::kFloat, 31);
    auto all = all_inputs(R, R * n, at::kFloat, 31).to(at::kDouble);
    comm->reduce_scatter(buf.narrow(0, me * n, n), buf, op);
    auto ref = all.sum(0).narrow(0, me * n, n);
    if (op == ReduceOp::kAvg) ref = ref / R;
    EXPECT_TRUE(within(buf.narrow(0, me * n, n), ref, R * eps_of(at::kFloat) * all.abs().sum(0).narrow(0, me * n, n)))
        << (op == ReduceOp::kSum ? "sum" : "avg");
  }
}

// fp16 averages of values near fp16's largest (65504): their sum overflows, their mean does not.
// Every path must give the mean: allreduce, reduce-scatter in place and into another tensor.
TEST(EdgeCases, Fp16AverageOfLargeValuesDoesNotOverflow) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  if (R < 2) GTEST_SKIP() << "needs 2 ranks";
  const int64_t n = 64;
  auto expect_mean = [&](const at::Tensor& got, const char* what) {
    ASSERT_TRUE(at::isfinite(got).all().item<bool>()) << what << ": " << got.max().item<float>();
    EXPECT_NEAR(got.to(at::kFloat).mean().item<float>(), 40000.0f, 64.0f) << what;
  };
  auto big = [&](int64_t k) { return at::full({k}, 40000.0 + 8.0 * me, at::kHalf) - 4.0 * (R - 1); };
  auto a = big(n);
  comm->allreduce(a, ReduceOp::kAvg);
  expect_mean(a, "allreduce");
  auto in = big(R * n), out = at::empty({n}, at::kHalf);
  comm->reduce_scatter(out, in, ReduceOp::kAvg);
  expect_mean(out, "reduce_scatter");
  auto own = big(R * n);
  comm->reduce_scatter(own.narrow(0, me * n, n), own, ReduceOp::kAvg);
  expect_mean(own.narrow(0, me * n, n), "reduce_scatter in place");
}

TEST(EdgeCases, AllgatherInPlaceFromOwnChunk) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t n = 777;
  auto buf = at::full({R * n}, -1.0, at::kDouble);
  buf.narrow(0, me * n, n).copy_(rank_input(me, n, at::kDouble, 32));
  comm->allgather(buf, buf.narrow(0, me * n, n));
  for (int r = 0; r < R; ++r) EXPECT_TRUE(exactly(buf.narrow(0, r * n, n), rank_input(r, n, at::kDouble, 32))) << r;
}

// ---- zero elements and barrier

TEST(EdgeCases, EmptyTensorsAreNoOps) {
  auto comm = world();
  const int R = comm->size();
  auto e = at::empty({0}, at::kFloat);
  comm->allreduce(e, ReduceOp::kSum);
  comm->broadcast(e, R - 1);
  auto out = at::empty({0}, at::kFloat);
  comm->allgather(out, e);
  comm->reduce_scatter(out, e, ReduceOp::kSum);
  EXPECT_EQ(e.numel(), 0);
  // The communicator still works afterwards.
  auto one = at::ones({3}, at::kFloat);
  comm->allreduce(one, ReduceOp::kSum);
  EXPECT_TRUE(exactly(one, at::full({3}, static_cast<double>(R))));
}

TEST(EdgeCases, BarrierWaitsForTheLastRank) {
  auto comm = world();
  comm->barrier();
  auto t0 = std::chrono::steady_clock::now();
  if (comm->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(600));
  comm->barrier();
  double waited = seconds_since(t0);
  // Nobody leaves the barrier before rank 0 enters it, 0.6 s after it left the first barrier
  // (other ranks may have left that one a little later than rank 0: allow 0.3 s for that).
  EXPECT_GE(waited, 0.3) << "rank " << comm->rank() << " left the barrier before rank 0 entered it";
}

}  // namespace
}  // namespace tandem::test
