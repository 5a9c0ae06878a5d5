// The thread backend (tandem/backends.h: make_thread_communicators) and run_replicas
// (tandem/replicas.h), against references computed on the test's own thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "tandem/backends.h"
#include "tandem/moe.h"
#include "tandem/replicas.h"
#include "tests/dist/all_to_all_cases.h"

namespace {

using tandem::CommPtr;
using tandem::ReduceOp;
namespace a2a = tandem::test::a2a;

// Runs fn(comm, rank) on one thread per communicator; rethrows the first failure.
void on_threads(const std::vector<CommPtr>& comms, const std::function<void(tandem::Communicator&, int)>& fn) {
  std::vector<std::thread> ts;
  std::vector<std::exception_ptr> errors(comms.size());
  for (size_t r = 0; r < comms.size(); ++r) {
    ts.emplace_back([&, r] {
      try {
        fn(*comms[r], static_cast<int>(r));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

std::vector<CommPtr> group(int n, int timeout_ms = 20000) {
  tandem::CommOptions o;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  return tandem::make_thread_communicators(n, o);
}

// Rank r's input: reproducible values of `dtype`.
at::Tensor input(int rank, int64_t n, at::ScalarType dtype) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
  auto x = at::randn({n}, g, at::kDouble) * 10;
  if (!at::isFloatingType(dtype)) x = x.round();
  return x.to(dtype);
}

at::Tensor reference(const std::vector<at::Tensor>& ins, ReduceOp op) {
  auto all = at::stack(ins).to(at::kDouble);
  if (op == ReduceOp::kMax) return std::get<0>(all.max(0));
  auto s = all.sum(0);
  return op == ReduceOp::kAvg ? s / static_cast<double>(ins.size()) : s;
}

double tolerance(at::ScalarType t) {
  if (t == at::kHalf) return 0.1;
  if (t == at::kBFloat16) return 0.5;
  if (t == at::kFloat) return 1e-4;
  return 1e-9;
}

struct Case {
  at::ScalarType dtype;
  ReduceOp op;
};

class ThreadAllreduce : public ::testing::TestWithParam<Case> {};

TEST_P(ThreadAllreduce, MatchesReferenceAndIsBitwiseEqualOnEveryRank) {
  const auto [dtype, op] = GetParam();
  const int n = 3;
  const int64_t len = 1001;  // not a multiple of the ranks: uneven shares
  std::vector<at::Tensor> ins, outs(n);
  for (int r = 0; r < n; ++r) ins.push_back(input(r, len, dtype));
  auto ref = reference(ins, op);
  on_threads(group(n), [&](tandem::Communicator& c, int r) {
    auto t = ins[r].clone();
    c.allreduce(t, op);
    outs[r] = t;
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(outs[r].equal(outs[0])) << "rank " << r << " differs from rank 0";
    EXPECT_LE((outs[r].to(at::kDouble) - ref).abs().max().item<double>(), tolerance(dtype) * 30) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(All, ThreadAllreduce,
                         ::testing::Values(Case{at::kFloat, ReduceOp::kSum}, Case{at::kFloat, ReduceOp::kAvg},
                                           Case{at::kFloat, ReduceOp::kMax}, Case{at::kDouble, ReduceOp::kSum},
                                           Case{at::kDouble, ReduceOp::kAvg}, Case{at::kBFloat16, ReduceOp::kSum},
                                           Case{at::kHalf, ReduceOp::kAvg}, Case{at::kInt, ReduceOp::kSum},
                                           Case{at::kLong, ReduceOp::kMax}));

TEST(ThreadComm, AllreduceOfNonContiguousTensor) {
  std::vector<at::Tensor> outs(2);
  on_threads(group(2), [&](tandem::Communicator& c, int r) {
    auto base = at::arange(12, at::kFloat).view({3, 4}) * (r + 1);
    auto t = base.t();  // non-contiguous view: the result lands in base
    c.allreduce(t, ReduceOp::kSum);
    outs[r] = base;
  });
  auto ref = at::arange(12, at::kFloat).view({3, 4}) * 3;
  EXPECT_TRUE(outs[0].equal(ref));
  EXPECT_TRUE(outs[1].equal(ref));
}

TEST(ThreadComm, AvgOfIntegersIsRefused) {
  EXPECT_THROW(on_threads(group(2),
                          [](tandem::Communicator& c, int) { c.allreduce(at::ones({4}, at::kInt), ReduceOp::kAvg); }),
               tandem::CommError);
}

TEST(ThreadComm, ReduceScatterOutOfPlaceAndInPlace) {
  const int n = 4;
  const int64_t chunk = 5;
  std::vector<at::Tensor> ins;
  for (int r = 0; r < n; ++r) ins.push_back(input(r, n * chunk, at::kDouble));
  auto ref = reference(ins, ReduceOp::kSum);
  std::vector<at::Tensor> out(n), inplace(n);
  on_threads(group(n), [&](tandem::Communicator& c, int r) {
    out[r] = at::empty({chunk}, at::kDouble);
    c.reduce_scatter(out[r], ins[r].clone(), ReduceOp::kSum);
    auto buf = ins[r].clone();
    inplace[r] = buf.narrow(0, r * chunk, chunk);
    c.reduce_scatter(inplace[r], buf, ReduceOp::kSum);
  });
  for (int r = 0; r < n; ++r) {
    auto want = ref.narrow(0, r * chunk, chunk);
    EXPECT_TRUE(at::allclose(out[r], want, 1e-12, 1e-12)) << "rank " << r;
    EXPECT_TRUE(at::allclose(inplace[r], want, 1e-12, 1e-12)) << "rank " << r;
  }
}

TEST(ThreadComm, AllgatherOutOfPlaceAndInPlace) {
  const int n = 3;
  std::vector<at::Tensor> ins, out(n), inplace(n);
  for (int r = 0; r < n; ++r) ins.push_back(input(r, 7, at::kBFloat16));
  auto ref = at::cat(ins);
  on_threads(group(n), [&](tandem::Communicator& c, int r) {
    out[r] = at::empty({3 * 7}, at::kBFloat16);
    c.allgather(out[r], ins[r]);
    inplace[r] = at::zeros({3 * 7}, at::kBFloat16);
    inplace[r].narrow(0, r * 7, 7).copy_(ins[r]);
    c.allgather(inplace[r], inplace[r].narrow(0, r * 7, 7));
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(out[r].equal(ref)) << "rank " << r;
    EXPECT_TRUE(inplace[r].equal(ref)) << "rank " << r;
  }
}

TEST(ThreadComm, BroadcastFromEveryRoot) {
  const int n = 3;
  for (int root = 0; root < n; ++root) {
    std::vector<at::Tensor> got(n);
    on_threads(group(n), [&](tandem::Communicator& c, int r) {
      got[r] = input(r, 9, at::kLong);
      c.broadcast(got[r], root);
    });
    for (int r = 0; r < n; ++r) EXPECT_TRUE(got[r].equal(input(root, 9, at::kLong))) << "root " << root;
  }
}

TEST(ThreadComm, AsyncCollectivesCompleteInIssueOrder) {
  std::vector<std::vector<at::Tensor>> got(2);
  on_threads(group(2), [&](tandem::Communicator& c, int r) {
    std::vector<tandem::WorkPtr> works;
    for (int i = 0; i < 6; ++i) {
      got[r].push_back(at::full({100}, static_cast<float>(i + r)));
      works.push_back(c.allreduce_async(got[r].back(), ReduceOp::kSum));
    }
    for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
  });
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(got[0][i].equal(at::full({100}, 2.0f * i + 1))) << "operation " << i;
    EXPECT_TRUE(got[1][i].equal(got[0][i]));
  }
}

TEST(ThreadComm, SplitOrdersByKeyAndReducesWithinEachColor) {
  const int n = 4;
  std::vector<int> new_rank(n), new_size(n);
  std::vector<float> sums(n);
  on_threads(group(n), [&](tandem::Communicator& c, int r) {
    auto sub = c.split(r % 2, -r);  // colors {0, 2} and {1, 3}, reversed by key
    ASSERT_TRUE(sub);
    new_rank[r] = sub->rank();
    new_size[r] = sub->size();
    auto t = at::full({3}, static_cast<float>(r));
    sub->allreduce(t, ReduceOp::kSum);
    sums[r] = t[0].item<float>();
    auto none = c.split(r == 0 ? 0 : -1, 0);
    EXPECT_EQ(static_cast<bool>(none), r == 0);
  });
  EXPECT_EQ(new_rank, (std::vector<int>{1, 1, 0, 0}));
  EXPECT_EQ(new_size, (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(sums, (std::vector<float>{2, 4, 2, 4}));
}

TEST(ThreadComm, SendRecvRingAndMessageOrder) {
  const int n = 3;
  std::vector<at::Tensor> got(n), first(n), second(n);
  on_threads(group(n), [&](tandem::Communicator& c, int r) {
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    got[r] = at::empty({4}, at::kFloat);
    auto w = c.recv_async(got[r], prev, 7);  // posted before the peer sends
    c.send(at::full({4}, static_cast<float>(r)), next, 7);
    w->wait();
    // Two messages on one (peer, tag) arrive in the order they were sent.
    c.send(at::full({2}, 10.0f + r), next, 1);
    c.send(at::full({2}, 20.0f + r), next, 1);
    first[r] = at::empty({2});
    second[r] = at::empty({2});
    auto a = c.recv_async(first[r], prev, 1);
    auto b = c.recv_async(second[r], prev, 1);
    b->wait();
    a->wait();
  });
  for (int r = 0; r < n; ++r) {
    const int prev = (r + n - 1) % n;
    EXPECT_TRUE(got[r].equal(at::full({4}, static_cast<float>(prev))));
    EXPECT_EQ(first[r][0].item<float>(), 10.0f + prev);
    EXPECT_EQ(second[r][0].item<float>(), 20.0f + prev);
  }
}

TEST(ThreadComm, TimeoutNamesTheRankTheOperationAndWhoIsMissing) {
  auto comms = group(2, 200);
  std::string msg;
  try {
    comms[0]->allreduce(at::ones({10}), ReduceOp::kSum);  // rank 1 never joins
  } catch (const tandem::CommTimeout& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("rank 0: allreduce(sum)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("waiting for rank(s) 1"), std::string::npos) << msg;
  EXPECT_THROW(comms[0]->barrier(), tandem::CommError);  // the group is unusable afterwards
}

TEST(ThreadComm, RecvTimeoutNamesTheSender) {
  auto comms = group(2, 200);
  std::string msg;
  try {
    comms[1]->recv(at::empty({3}), 0, 5);
  } catch (const tandem::CommTimeout& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("rank 1: recv from rank 0"), std::string::npos) << msg;
}

TEST(ThreadComm, MismatchedCollectivesFailOnEveryRank) {
  std::vector<std::string> msgs(2);
  on_threads(group(2), [&](tandem::Communicator& c, int r) {
    try {
      if (r == 0) c.allreduce(at::ones({10}), ReduceOp::kSum);
      else c.broadcast(at::ones({10}), 0);
    } catch (const tandem::CommError& e) {
      msgs[r] = e.what();
    }
  });
  for (const auto& m : msgs) {
    EXPECT_NE(m.find("rank 0 calls allreduce(sum)"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 1 calls broadcast"), std::string::npos) << m;
  }
}

TEST(ThreadComm, AbortEndsThePeersWaitAtOnce) {
  auto comms = group(2, 60000);
  auto t0 = std::chrono::steady_clock::now();
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    tandem::abort_thread_group(*comms[1], "replica 1 failed: boom");
  });
  std::string msg;
  try {
    comms[0]->allreduce(at::ones({4}), ReduceOp::kSum);
  } catch (const tandem::CommError& e) {
    msg = e.what();
  }
  aborter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_NE(msg.find("replica 1 failed: boom"), std::string::npos) << msg;
}

// Two "processes" of two threads each; the processes' communicator is a thread group too, so
// that the hierarchical form runs without MPI: rank p * 2 + k.
std::vector<CommPtr> hierarchy(int processes, int threads) {
  auto across = group(processes);
  std::vector<CommPtr> out;
  for (int p = 0; p < processes; ++p) {
    auto local = group(threads);
    for (int k = 0; k < threads; ++k) out.push_back(tandem::make_hierarchical_communicator(local[k], across[p], {}));
  }
  return out;
}

TEST(HierarchicalComm, RanksAndCollectivesMatchTheReference) {
  const int n = 4;
  auto comms = hierarchy(2, 2);
  std::vector<at::Tensor> ins;
  for (int r = 0; r < n; ++r) ins.push_back(input(r, 12, at::kDouble));
  std::vector<at::Tensor> sum(n), avg(n), mx(n), rs(n), ag(n), bc(n);
  std::vector<int> ranks(n);
  on_threads(comms, [&](tandem::Communicator& c, int r) {
    ranks[r] = c.rank() * 10 + c.size();
    sum[r] = ins[r].clone();
    c.allreduce(sum[r], ReduceOp::kSum);
    avg[r] = ins[r].clone();
    c.allreduce(avg[r], ReduceOp::kAvg);
    mx[r] = ins[r].clone();
    c.allreduce(mx[r], ReduceOp::kMax);
    rs[r] = at::empty({3}, at::kDouble);
    c.reduce_scatter(rs[r], ins[r], ReduceOp::kSum);
    ag[r] = at::empty({4 * 12}, at::kDouble);
    c.allgather(ag[r], ins[r]);
    bc[r] = ins[r].clone();
    c.broadcast(bc[r], 3);
    c.barrier();
  });
  auto ref_sum = reference(ins, ReduceOp::kSum);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(ranks[r], r * 10 + n);
    EXPECT_TRUE(at::allclose(sum[r], ref_sum, 1e-12, 1e-12)) << "rank " << r;
    EXPECT_TRUE(at::allclose(avg[r], reference(ins, ReduceOp::kAvg), 1e-12, 1e-12)) << "rank " << r;
    EXPECT_TRUE(mx[r].equal(reference(ins, ReduceOp::kMax))) << "rank " << r;
    EXPECT_TRUE(at::allclose(rs[r], ref_sum.narrow(0, 3 * r, 3), 1e-12, 1e-12)) << "rank " << r;
    EXPECT_TRUE(ag[r].equal(at::cat(ins))) << "rank " << r;
    EXPECT_TRUE(bc[r].equal(ins[3])) << "rank " << r;
    EXPECT_TRUE(sum[r].equal(sum[0])) << "rank " << r << " differs in bits from rank 0";
  }
}

TEST(HierarchicalComm, SendRecvWithinAndAcrossProcesses) {
  const int n = 4;
  auto comms = hierarchy(2, 2);
  std::vector<at::Tensor> got(n);
  on_threads(comms, [&](tandem::Communicator& c, int r) {
    // Every rank sends to every other rank; tags repeat across pairs.
    std::vector<tandem::WorkPtr> recvs;
    std::vector<at::Tensor> bufs;
    for (int src = 0; src < n; ++src) {
      if (src == r) continue;
      bufs.push_back(at::empty({2}));
      recvs.push_back(c.recv_async(bufs.back(), src, 3));
    }
    for (int dst = 0; dst < n; ++dst)
      if (dst != r) c.send(at::full({2}, static_cast<float>(10 * r + dst)), dst, 3);
    for (auto& w : recvs) w->wait();
    got[r] = at::stack(bufs).select(1, 0);
  });
  for (int r = 0; r < n; ++r) {
    std::vector<float> want;
    for (int src = 0; src < n; ++src)
      if (src != r) want.push_back(static_cast<float>(10 * src + r));
    EXPECT_TRUE(got[r].equal(at::tensor(want))) << "rank " << r;
  }
}

TEST(HierarchicalComm, SplitIsRefusedWithAReason) {
  auto comms = hierarchy(1, 2);
  EXPECT_THROW(comms[0]->split(0, 0), tandem::CommError);
}

// All-to-all against the rows of tests/dist/all_to_all_cases.h, whose values name their sender
// and receiver: every case (uneven, zero counts, a rank without rows) with 1-D and 3-D rows.
void expect_alltoall_cases(const std::vector<CommPtr>& comms) {
  const int n = static_cast<int>(comms.size());
  for (const auto& c : a2a::cases(n)) {
    for (const std::vector<int64_t>& row : {std::vector<int64_t>{}, std::vector<int64_t>{2, 3}}) {
      std::vector<at::Tensor> got(n);
      on_threads(comms, [&](tandem::Communicator& comm, int r) {
        got[r] = at::full(a2a::received_by(r, c, row, at::kFloat).sizes(), -1.0f);
        comm.alltoall(got[r], a2a::sent_by(r, c, row, at::kFloat), c.recvs(r), c.sends(r));
      });
      for (int r = 0; r < n; ++r) {
        EXPECT_TRUE(got[r].equal(a2a::received_by(r, c, row, at::kFloat)))
            << c.name << ", rows of " << at::IntArrayRef(row) << ", rank " << r << " of " << n << ": " << got[r];
      }
    }
  }
}

TEST(ThreadComm, AllToAllOfEveryCase) { expect_alltoall_cases(group(3)); }
TEST(HierarchicalComm, AllToAllWithinAndAcrossProcesses) { expect_alltoall_cases(hierarchy(2, 2)); }
TEST(SelfComm, AllToAllKeepsItsRows) { expect_alltoall_cases({tandem::make_self_communicator({})}); }

TEST(ThreadComm, AllToAllWhoseCountsDisagreeFailsOnEveryRankNamingBoth) {
  // Rank 0 sends rank 1 two rows; rank 1 expects one.
  const std::vector<std::vector<int64_t>> sends = {{1, 2}, {1, 1}}, recvs = {{1, 1}, {1, 1}};
  std::vector<std::string> msgs(2);
  on_threads(group(2), [&](tandem::Communicator& c, int r) {
    try {
      c.alltoall(at::zeros({2, 4}), at::zeros({r == 0 ? 3 : 2, 4}), recvs[r], sends[r]);
    } catch (const tandem::CommError& e) {
      msgs[r] = e.what();
    }
  });
  for (const auto& m : msgs)
    EXPECT_NE(m.find("rank 0 sends 2 rows to rank 1, which expects 1"), std::string::npos) << m;
}

// moe::all_to_all on replicas of one process: the gradient of sum(w * all_to_all(x)) is w by
// the reverse all-to-all, and each replica's statistics count its own calls and bytes.
TEST(ThreadComm, MoeAllToAllBackwardAndEachThreadsStatistics) {
  const int n = 3;
  auto comms = group(n);
  const auto c = a2a::cases(n)[0];
  std::vector<at::Tensor> y(n), grad(n);
  std::vector<tandem::moe::MoeStats> stats(n);
  on_threads(comms, [&](tandem::Communicator&, int r) {
    tandem::moe::reset_moe_stats();
    auto x = a2a::sent_by(r, c, {2}, at::kDouble).requires_grad_(true);
    y[r] = tandem::moe::all_to_all(x, c.sends(r), c.recvs(r), comms[r]);
    (a2a::received_by(r, c, {2}, at::kDouble, a2a::weight) * y[r]).sum().backward();
    grad[r] = x.grad();
    stats[r] = tandem::moe::moe_stats();
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(y[r].equal(a2a::received_by(r, c, {2}, at::kDouble))) << "rank " << r;
    EXPECT_TRUE(grad[r].defined() && grad[r].equal(a2a::sent_by(r, c, {2}, at::kDouble, a2a::weight))) << "rank " << r;
    EXPECT_EQ(stats[r].all_to_alls, 2) << "rank " << r;
    EXPECT_EQ(stats[r].all_to_all_bytes, (a2a::rows_sent_to_others(r, c) + a2a::rows_received_from_others(r, c)) * 16)
        << "rank " << r;
  }
}

TEST(Replicas, EachReplicaHasItsRankWorldAndComputeThreads) {
  tandem::ReplicaOptions o;
  o.replicas = 3;
  o.runtime.device = "cpu";
  o.runtime.threads = 2;
  std::vector<int> ranks(3, -1), threads(3, -1);
  std::vector<float> sums(3);
  tandem::run_replicas(o, [&](tandem::Runtime& rt) {
    ranks[rt.rank()] = rt.world_size() == 3 ? rt.rank() : -2;
    threads[rt.rank()] = at::get_num_threads();
    auto t = at::full({5}, static_cast<float>(rt.rank() + 1));
    rt.world()->allreduce(t, ReduceOp::kSum);
    sums[rt.rank()] = t[4].item<float>();
  });
  EXPECT_EQ(ranks, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(threads, (std::vector<int>{2, 2, 2}));
  EXPECT_EQ(sums, (std::vector<float>{6, 6, 6}));
}

TEST(Replicas, AFailingReplicaEndsTheRunWithItsMessage) {
  tandem::ReplicaOptions o;
  o.replicas = 2;
  o.runtime.device = "cpu";
  o.runtime.comm.timeout = std::chrono::minutes(5);
  auto t0 = std::chrono::steady_clock::now();
  std::string msg;
  try {
    tandem::run_replicas(o, [](tandem::Runtime& rt) {
      if (rt.rank() == 1) throw std::invalid_argument("bad shard");
      rt.world()->barrier();  // would wait for replica 1 until the timeout
    });
  } catch (const std::runtime_error& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg, "replica 1: bad shard");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

TEST(Replicas, BadInputIsRefused) {
  tandem::ReplicaOptions o;
  o.runtime.device = "cpu";
  o.replicas = 0;
  EXPECT_THROW(tandem::validate_replicas(o), std::invalid_argument);
  o.replicas = 2;
  o.runtime.device = "tpu";
  EXPECT_THROW(tandem::validate_replicas(o), std::invalid_argument);
}

}  // namespace
