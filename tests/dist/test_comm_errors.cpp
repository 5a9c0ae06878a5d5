// Misuse of the Communicator is reported at the call, on every rank, as a CommError naming
// the rank, the operation and what is wrong; and a peer that does not show up ends a wait
// with CommTimeout within the communicator's timeout instead of hanging.
#include <gtest/gtest.h>

#include <torch/cuda.h>

#include <thread>

#include "tests/dist/comm_test_util.h"
#include "tests/dist/dist_env.h"

namespace tandem::test {
namespace {

std::string me_str() { return "rank " + std::to_string(world()->rank()) + ": "; }

TEST(CommErrors, WrongSizes) {
  auto comm = world();
  const int R = comm->size();
  auto in = at::ones({R * 5 + 1}, at::kFloat);
  auto out = at::empty({5}, at::kFloat);
  EXPECT_TRUE(throws_with([&] { comm->reduce_scatter_async(out, in, ReduceOp::kSum); },
                          {me_str() + "reduce_scatter(sum)", "input has " + std::to_string(R * 5 + 1) + " elements",
                           "world size " + std::to_string(R)}));
  auto small = at::ones({5}, at::kFloat);
  auto gathered = at::empty({R * 5 - 1}, at::kFloat);
  EXPECT_TRUE(throws_with([&] { comm->allgather(gathered, small); },
                          {me_str() + "allgather", "output has " + std::to_string(R * 5 - 1) + " elements"}));
  // input/output of different dtypes
  auto gathered_d = at::empty({R * 5}, at::kDouble);
  EXPECT_TRUE(throws_with([&] { comm->allgather(gathered_d, small); }, {me_str() + "allgather", "dtype"}));
}

TEST(CommErrors, RootsAndPeersOutOfRange) {
  auto comm = world();
  const int R = comm->size();
  auto t = at::ones({4}, at::kFloat);
  for (int bad : {-1, R, R + 7}) {
    const std::string b = std::to_string(bad);
    EXPECT_TRUE(throws_with([&] { comm->broadcast(t, bad); }, {me_str() + "broadcast(root " + b + ")",
                                                               "out of range for world size " + std::to_string(R)}));
    EXPECT_TRUE(throws_with([&] { comm->send_async(t, bad, 0); }, {me_str() + "send(to " + b, "out of range"}));
    EXPECT_TRUE(throws_with([&] { comm->recv_async(t, bad, 0); }, {me_str() + "recv(from " + b, "out of range"}));
  }
}

TEST(CommErrors, UnsupportedDtypes) {
  auto comm = world();
  auto c = at::ones({4}, at::kComplexFloat);
  EXPECT_TRUE(throws_with([&] { comm->allreduce(c, ReduceOp::kSum); },
                          {me_str() + "allreduce(sum)", "ComplexFloat", "not supported by the MPI backend"}));
  EXPECT_TRUE(throws_with([&] { comm->broadcast(c, 0); }, {me_str() + "broadcast", "not supported"}));
  auto cout_ = at::empty({4 * world()->size()}, at::kComplexFloat);
  EXPECT_TRUE(throws_with([&] { comm->allgather(cout_, c); }, {me_str() + "allgather", "not supported"}));
}

TEST(CommErrors, AvgOfIntegers) {
  auto comm = world();
  auto t = at::ones({4}, at::kLong);
  EXPECT_TRUE(
      throws_with([&] { comm->allreduce(t, ReduceOp::kAvg); }, {me_str() + "allreduce(avg)", "floating-point"}));
}

TEST(CommErrors, UndefinedTensors) {
  auto comm = world();
  at::Tensor undef;
  auto t = at::ones({comm->size()}, at::kFloat);
  auto one = at::ones({1}, at::kFloat);
  EXPECT_TRUE(throws_with([&] { comm->allreduce(undef, ReduceOp::kSum); }, {me_str() + "allreduce", "undefined"}));
  EXPECT_TRUE(throws_with([&] { comm->broadcast(undef, 0); }, {me_str() + "broadcast", "undefined"}));
  EXPECT_TRUE(throws_with([&] { comm->send_async(undef, 0, 0); }, {me_str() + "send", "undefined"}));
  EXPECT_TRUE(throws_with([&] { comm->recv_async(undef, 0, 0); }, {me_str() + "recv", "undefined"}));
  EXPECT_TRUE(throws_with([&] { comm->reduce_scatter(one, undef, ReduceOp::kSum); },
                          {me_str() + "reduce_scatter", "undefined"}));
  EXPECT_TRUE(
      throws_with([&] { comm->reduce_scatter(undef, t, ReduceOp::kSum); }, {me_str() + "reduce_scatter", "output"}));
  EXPECT_TRUE(throws_with([&] { comm->allgather(undef, one); }, {me_str() + "allgather", "output"}));
}

TEST(CommErrors, NonCpuTensors) {
  auto comm = world();
  // A real CUDA tensor where there is one; a meta tensor (no storage) stands in otherwise.
  at::Tensor t = at::empty({4}, at::TensorOptions().device(at::kMeta));
  std::string where = "meta";
  if (torch::cuda::is_available()) {
    t = at::ones({4}, at::TensorOptions().device(at::kCUDA));
    where = "cuda";
  }
  EXPECT_TRUE(
      throws_with([&] { comm->allreduce(t, ReduceOp::kSum); }, {me_str() + "allreduce", "takes CPU tensors", where}));
  EXPECT_TRUE(throws_with([&] { comm->broadcast(t, 0); }, {me_str() + "broadcast", "CPU"}));
  auto cpu_out = at::empty({4 * comm->size()});
  EXPECT_TRUE(throws_with([&] { comm->allgather(cpu_out, t); }, {me_str() + "allgather", "CPU"}));
  auto cpu_in = at::ones({4});
  auto out = at::empty({4 * comm->size()}, t.options());
  EXPECT_TRUE(throws_with([&] { comm->allgather(out, cpu_in); }, {me_str() + "allgather", "CPU"}));
}

TEST(CommErrors, SparseTensors) {
  auto comm = world();
  auto s = at::ones({4}, at::kFloat).to_sparse();
  EXPECT_TRUE(throws_with([&] { comm->allreduce(s, ReduceOp::kSum); },
                          {me_str() + "allreduce", "dense (strided)", "Sparse", "to_dense()"}));
  EXPECT_TRUE(throws_with([&] { comm->broadcast(s, 0); }, {me_str() + "broadcast", "dense"}));
  EXPECT_TRUE(throws_with([&] { comm->send_async(s, 0, 0); }, {me_str() + "send", "dense"}));
  auto out = at::zeros({4 * comm->size()}, at::kFloat).to_sparse();
  EXPECT_TRUE(throws_with([&] { comm->allgather(out, at::ones({4})); }, {me_str() + "allgather", "dense"}));
}

TEST(CommErrors, RejectedCallsAreNotCountedAndLeaveTheCommunicatorUsable) {
  auto comm = world();
  comm->reset_stats();
  at::Tensor undef;
  EXPECT_THROW(comm->allreduce(undef, ReduceOp::kSum), CommError);
  EXPECT_THROW(comm->broadcast(at::ones({1}), -1), CommError);
  EXPECT_EQ(comm->stats().count("allreduce"), 0u);
  EXPECT_EQ(comm->stats().count("broadcast"), 0u);
  auto t = at::ones({5}, at::kDouble);
  comm->allreduce(t, ReduceOp::kSum);
  EXPECT_TRUE(exactly(t, at::full({5}, static_cast<double>(comm->size()))));
}

// A rank that arrives late: the others' allreduce ends with CommTimeout after the timeout
// (naming the rank and the operation), and the late rank's arrival still completes the
// operation, so the communicator stays usable.
TEST(CommTimeouts, LateRankMakesOthersTimeOutThenCatchesUp) {
  auto w = world();
  const int R = w->size(), me = w->rank(), late = 1;
  auto comm = w->split(0, me);  // a fresh communicator, so the world keeps its ordering
  comm->set_timeout(std::chrono::milliseconds(1000));
  auto x = rank_input(me, 1000, at::kDouble, 40);
  auto ref = all_inputs(R, 1000, at::kDouble, 40).sum(0);
  auto bound = R * eps_of(at::kDouble) * all_inputs(R, 1000, at::kDouble, 40).abs().sum(0);
  if (me != late) {
    auto work = comm->allreduce_async(x, ReduceOp::kSum);
    auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(throws_with<CommTimeout>([&] { work->wait(); }, {me_str() + "allreduce(sum) of Double[1000]",
                                                                 "timed out after 1 s", "is every rank alive"}));
    double waited = seconds_since(t0);
    EXPECT_GE(waited, 0.95);
    EXPECT_LT(waited, 6.0) << "the timeout is 1 s";
    EXPECT_FALSE(work->is_completed());
    comm->set_timeout(kTestTimeout);  // for the barrier below
    w->barrier();                     // now let the late rank in
    bool done = false;
    for (int i = 0; i < 30 && !done; ++i) {
      try {
        work->wait();
        done = true;
      } catch (const CommTimeout&) {
      }
    }
    EXPECT_TRUE(done) << "the late rank's allreduce did not complete the pending one";
  } else {
    w->barrier();  // only after the others timed out
    comm->set_timeout(kTestTimeout);
    comm->allreduce(x, ReduceOp::kSum);
  }
  EXPECT_TRUE(within(x, ref, bound));
  comm->barrier();
}

// Point to point names the peer: a receive from a rank that never sends times out with
// "recv(from P, ...)".
TEST(CommTimeouts, RecvFromSilentPeerNamesThePeer) {
  auto w = world();
  const int R = w->size(), me = w->rank(), silent = R - 1;
  auto comm = w->split(0, me);
  comm->set_timeout(std::chrono::milliseconds(500));
  auto t = at::zeros({16}, at::kFloat);
  WorkPtr work;
  if (me == 0) {
    work = comm->recv_async(t, silent, 99);
    auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(
        throws_with<CommTimeout>([&] { work->wait(); }, {"rank 0: recv(from " + std::to_string(silent) + ", tag 99)",
                                                         "timed out after 0.5 s"}));
    EXPECT_LT(seconds_since(t0), 5.5);
  }
  w->barrier();
  comm->set_timeout(kTestTimeout);  // for the barrier below
  if (me == silent) {
    comm->send(at::arange(16, at::kFloat), 0, 99);  // completes rank 0's pending receive
  }
  if (me == 0) {
    bool done = false;
    for (int i = 0; i < 60 && !done; ++i) {
      try {
        work->wait();
        done = true;
      } catch (const CommTimeout&) {
      }
    }
    EXPECT_TRUE(done);
    EXPECT_TRUE(exactly(t, at::arange(16, at::kDouble)));
  }
  comm->barrier();
}

}  // namespace
}  // namespace tandem::test
