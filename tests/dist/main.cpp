// Entry point of tandem_dist_tests, run under mpirun with 2-4 ranks (tests/dist/tests.cmake).
// One Runtime for the whole process, owned by a gtest global environment. Rank 0 prints the
// usual gtest report; other ranks print only their failures, prefixed with their rank. At the
// end the ranks agree on the verdict: if any rank failed, the job is aborted (MPI_Abort) so
// that no rank hangs in MPI_Finalize behind a collective that a failed test left pending.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "tests/dist/dist_env.h"

namespace tandem::test {
namespace {

std::unique_ptr<Runtime> g_runtime;

// Ranks other than 0: failures only, with the rank in front.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?", r.line_number(),
                 r.message());
    std::fflush(stderr);
  }
  void OnTestEnd(const ::testing::TestInfo& t) override {
    if (t.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] [  FAILED  ] %s.%s\n", rank_, t.test_suite_name(), t.name());
      std::fflush(stderr);
    }
  }

 private:
  int rank_;
};

class DistEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    RuntimeOptions o;
    o.threads = 1;  // ranks are oversubscribed on small machines
    o.device = "cpu";
    o.backend = "mpi";
    o.comm.timeout = kTestTimeout;
    g_runtime = std::make_unique<Runtime>(o);
  }

  void TearDown() override {
    if (!g_runtime) return;
    const int me = g_runtime->rank();
    const int failed = ::testing::UnitTest::GetInstance()->Failed() ? 1 : 0;
    int any = failed;
    try {
      auto comm = g_runtime->world();
      comm->set_timeout(std::chrono::seconds(30));
      auto flag = at::full({1}, failed, at::kLong);
      comm->allreduce(flag, ReduceOp::kMax);
      any = static_cast<int>(flag.item<int64_t>());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %d] the ranks could not agree on the verdict: %s\n", me, e.what());
      any = 1;
    }
    if (any) {
      std::fprintf(stderr, "[rank %d] %s; aborting the job\n", me,
                   failed ? "tests failed on this rank" : "tests failed on another rank");
      g_runtime->abort(1);
    }
    g_runtime.reset();  // joins the progress threads, finalizes MPI
  }
};

}  // namespace

Runtime& runtime() {
  if (!g_runtime) {
    std::fprintf(stderr, "tandem::test::runtime() called before the test environment was set up\n");
    std::abort();
  }
  return *g_runtime;
}

CommPtr world() { return runtime().world(); }

ReplicaPlacement placement_over(const CommPtr& comm) {
  ReplicaPlacement p;
  p.info.rank = p.info.local_rank = comm->rank();
  p.info.world_size = p.info.local_size = comm->size();
  p.info.launcher = "mpirun";
  p.world = p.cpu_world = comm;
  HostInfo host = runtime().hosts().at(0);
  host.ranks.resize(comm->size());
  for (int r = 0; r < comm->size(); ++r) host.ranks[r] = r;
  p.hosts = {host};
  p.host_of.assign(comm->size(), 0);
  return p;
}

Runtime runtime_over(const CommPtr& comm) { return Runtime(placement_over(comm)); }

}  // namespace tandem::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = tandem::detect_process_info().rank;
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new tandem::test::FailurePrinter(rank));
  }
  ::testing::AddGlobalTestEnvironment(new tandem::test::DistEnvironment);
  return RUN_ALL_TESTS();
}
