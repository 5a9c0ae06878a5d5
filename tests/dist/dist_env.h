// The distributed test binary's one Runtime (MPI can be initialized once per process): set up
// by a gtest global environment in main.cpp before the first test, finalized after the last.
// Every rank runs the same tests in the same order, so a test may call collectives freely;
// keep the calls identical on all ranks (use EXPECT_*, not ASSERT_*, around collectives, so
// that a failing rank does not skip a collective its peers are waiting in).
#pragma once

#include "tandem/comm.h"
#include "tandem/runtime.h"

namespace tandem::test {

// The process's Runtime; aborts the test binary when called before the environment is up.
Runtime& runtime();
// runtime().world(): the communicator over all ranks (MPI in this binary).
CommPtr world();
// A Runtime over `comm` (a part of the job's ranks, all on this host), for an Engine on fewer
// workers than the test binary runs; placement_over: what it is made from.
ReplicaPlacement placement_over(const CommPtr& comm);
Runtime runtime_over(const CommPtr& comm);
// Default timeout of the communicators in the tests: long enough for 4 ranks on 2 cores,
// short enough that a desynchronized test fails with CommTimeout instead of a ctest timeout.
inline constexpr std::chrono::milliseconds kTestTimeout{std::chrono::seconds(60)};

}  // namespace tandem::test
