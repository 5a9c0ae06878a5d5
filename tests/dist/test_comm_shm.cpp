// The MPI backend's shared-memory all-reduce, reduce-scatter and all-gather: tensors from symmetric_empty live in an
// MPI-3 shared-memory window when all ranks share a node, and an all-reduce of such a tensor (or
// of a contiguous range of it) sums straight from the peers' memory. Checked against the same
// all-reduce of ordinary memory (the MPI path), on every rank, bit for bit: both sum the ranks'
// values; for two ranks the order cannot matter, for more the bound is the rounding of R terms.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "tests/dist/comm_test_util.h"
#include "tests/dist/dist_env.h"

namespace tandem::test {
namespace {

// The file behind the mapping that holds `p` ("" for anonymous memory such as the heap):
// the shared-memory window is a mapped file that every rank maps.
std::string mapped_file(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  for (std::string line; std::getline(maps, line);) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) != 2 || addr < lo || addr >= hi) continue;
    auto slash = line.find('/');
    return slash == std::string::npos ? "" : line.substr(slash);
  }
  return "";
}

TEST(SharedMemoryAllreduce, MatchesTheMpiPathForSizesAndOps) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (auto dt : {at::kFloat, at::kDouble}) {
    for (int64_t n : {1, 7, 4095, 4097, 1000003}) {
      for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        auto input = rank_input(me, n, dt, n + 31 * static_cast<int64_t>(op));
        auto shm = symmetric_empty(*comm, n, at::TensorOptions().dtype(dt));
        ASSERT_EQ(shm.numel(), n);
        ASSERT_NE(mapped_file(shm.data_ptr()), "") << "float tensors on one node must be in shared memory";
        shm.copy_(input);
        auto plain = input.clone();
        comm->allreduce_async(shm, op)->wait();
        comm->allreduce_async(plain, op)->wait();
        auto ref = all_inputs(R, n, dt, n + 31 * static_cast<int64_t>(op)).sum(0);
        if (op == ReduceOp::kAvg) ref /= R;
        // Every rank must hold the same bits (one rank computes each element).
        auto gathered = at::empty({R * n}, shm.options());
        comm->allgather_async(gathered, shm)->wait();
        for (int r = 0; r < R; ++r) ASSERT_TRUE(gathered.narrow(0, r * n, n).equal(shm)) << "rank " << r << " differs";
        const double tol = R * eps_of(dt) *
                           (all_inputs(R, n, dt, n + 31 * static_cast<int64_t>(op)).abs().sum(0).max().item<double>());
        EXPECT_LE((shm.to(at::kDouble) - ref).abs().max().item<double>(), tol) << "n " << n;
        if (R == 2) EXPECT_TRUE(shm.equal(plain)) << "n " << n << ": two ranks: same bits as MPI_Allreduce";
      }
    }
  }
}

TEST(SharedMemoryAllreduce, RangeOfABufferAndReuse) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t n = 10000;
  for (int round = 0; round < 3; ++round) {
    // Released buffers are reused by later allocations of the same or smaller size.
    auto buf = symmetric_empty(*comm, n, at::TensorOptions().dtype(at::kFloat));
    buf.fill_(static_cast<float>(me + 1));
    auto mid = buf.narrow(0, 1000, 5000);  // a bucket's range: only it changes
    comm->allreduce_async(mid, ReduceOp::kSum)->wait();
    const float total = static_cast<float>(R * (R + 1) / 2);
    EXPECT_TRUE(mid.eq(total).all().item<bool>());
    EXPECT_TRUE(buf.narrow(0, 0, 1000).eq(static_cast<float>(me + 1)).all().item<bool>());
    EXPECT_TRUE(buf.narrow(0, 6000, 4000).eq(static_cast<float>(me + 1)).all().item<bool>());
  }
}

TEST(SharedMemoryAllreduce, PlainMemoryWhereItDoesNotApply) {
  auto comm = world();
  // Integer tensors and max take the MPI path (memory is plain, results still right).
  auto ints = symmetric_empty(*comm, 5, at::TensorOptions().dtype(at::kLong));
  EXPECT_EQ(mapped_file(ints.data_ptr()), "") << "integer tensors are plain memory";
  ints.fill_(comm->rank());
  comm->allreduce_async(ints, ReduceOp::kMax)->wait();
  EXPECT_TRUE(ints.eq(comm->size() - 1).all().item<bool>());
  auto f = symmetric_empty(*comm, 5, at::TensorOptions().dtype(at::kFloat));
  f.fill_(static_cast<float>(comm->rank()));
  comm->allreduce_async(f, ReduceOp::kMax)->wait();
  EXPECT_TRUE(f.eq(static_cast<float>(comm->size() - 1)).all().item<bool>());
}

// Reduce-scatter from a symmetric input (ZeRO's gradient buffer): every rank sums its chunk
// straight from the peers' buffers, into a separate output or in place into its own chunk.
TEST(SharedMemoryReduceScatter, MatchesTheMpiPathInPlaceAndNot) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (auto dt : {at::kFloat, at::kDouble}) {
    for (int64_t chunk : {1, 4097, 250001}) {
      for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        const int64_t n = R * chunk;
        const int64_t seed = n + 17 * static_cast<int64_t>(op);
        auto input = rank_input(me, n, dt, seed);
        auto ref = all_inputs(R, n, dt, seed).sum(0).narrow(0, me * chunk, chunk);
        if (op == ReduceOp::kAvg) ref /= R;
        auto plain_in = input.clone();
        auto plain_out = at::empty({chunk}, input.options());
        comm->reduce_scatter_async(plain_out, plain_in, op)->wait();
        auto shm = symmetric_empty(*comm, n, at::TensorOptions().dtype(dt));
        ASSERT_NE(mapped_file(shm.data_ptr()), "");
        shm.copy_(input);
        auto out = at::empty({chunk}, input.options());
        comm->reduce_scatter_async(out, shm, op)->wait();
        EXPECT_TRUE(shm.equal(input)) << "a separate output leaves the input as it was";
        auto own = shm.narrow(0, me * chunk, chunk);
        comm->reduce_scatter_async(own, shm, op)->wait();
        EXPECT_TRUE(own.equal(out)) << "in place and not give the same bits, chunk " << chunk;
        const double tol = R * eps_of(dt) * all_inputs(R, n, dt, seed).abs().sum(0).max().item<double>();
        EXPECT_LE((out.to(at::kDouble) - ref).abs().max().item<double>(), tol) << "chunk " << chunk;
        if (R == 2) EXPECT_TRUE(out.equal(plain_out)) << "chunk " << chunk << ": two ranks: same bits as MPI";
      }
    }
  }
}

// All-gather into a symmetric output (ZeRO's parameter buffer): in place (this rank's part
// already in its chunk) and from a separate input; other ranks' chunks arrive exactly.
TEST(SharedMemoryAllgather, InPlaceAndFromASeparateInput) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (int64_t chunk : {1, 4097, 250001}) {
    auto want = all_inputs(R, chunk, at::kFloat, chunk).to(at::kFloat).reshape({R * chunk});
    auto out = symmetric_empty(*comm, R * chunk, at::TensorOptions().dtype(at::kFloat));
    ASSERT_NE(mapped_file(out.data_ptr()), "");
    out.fill_(-1.0f);
    out.narrow(0, me * chunk, chunk).copy_(rank_input(me, chunk, at::kFloat, chunk));
    comm->allgather_async(out, out.narrow(0, me * chunk, chunk))->wait();
    EXPECT_TRUE(out.equal(want)) << "in place, chunk " << chunk;
    out.fill_(-1.0f);
    comm->allgather_async(out, rank_input(me, chunk, at::kFloat, chunk))->wait();
    EXPECT_TRUE(out.equal(want)) << "separate input, chunk " << chunk;
  }
}

TEST(SharedMemoryAllreduce, CountedAsAllreduceTraffic) {
  auto comm = world();
  auto before = comm->stats();
  auto buf = symmetric_empty(*comm, 256, at::TensorOptions().dtype(at::kFloat));
  buf.fill_(1.0f);
  comm->allreduce_async(buf, ReduceOp::kAvg)->wait();
  auto after = comm->stats();
  EXPECT_EQ(after["allreduce"].calls - before["allreduce"].calls, 1);
  EXPECT_EQ(after["allreduce"].bytes - before["allreduce"].bytes, 1024);
  EXPECT_EQ(after.count("shm_alloc"), 0u) << "allocation is bookkeeping, not traffic";
  EXPECT_TRUE(buf.eq(1.0f).all().item<bool>());
}

}  // namespace
}  // namespace tandem::test
