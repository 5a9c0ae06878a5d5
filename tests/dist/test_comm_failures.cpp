// Failure scenarios that end the whole job, so they are DISABLED_ in the normal run and each
// is started on its own by tests/dist/tests.cmake (--gtest_also_run_disabled_tests) or by the
// launcher tests in tests/e2e, which check the job's output:
//  - Stall: rank 1 stops calling collectives. Every other rank's allreduce must end with
//    CommTimeout within the 2 s timeout, naming the rank and the operation; the live ranks
//    then agree on the verdict, rank 0 prints "STALL TEST PASSED" (or "STALL TEST FAILED")
//    and aborts the job, which is the clean way out while rank 1 is still silent.
//  - Stall, second form: rank 1 waits in a barrier while the others wait in an allreduce;
//    every rank must get CommTimeout.
//  - Abandon: a send that timed out is abandoned when its communicator is destroyed.
//  - EarlyExit: rank 1 leaves in the middle of a run of collectives (_exit(3) or SIGKILL);
//    mpirun must stop the other ranks, blocked in an allreduce with a 120 s timeout (so a
//    launcher that does not stop them fails the e2e test's time limit).
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <iostream>
#include <thread>

#include "tests/dist/comm_test_util.h"
#include "tests/dist/dist_env.h"

namespace tandem::test {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// Runs `call`, which must end with CommTimeout after the 2 s timeout, naming `expect_op`.
// Prints this rank's verdict and returns it.
bool times_out_naming(int me, const std::string& expect_op, const std::function<void()>& call) {
  std::string msg = "(no exception)";
  bool timed_out = false;
  auto t0 = std::chrono::steady_clock::now();
  try {
    call();
  } catch (const CommTimeout& e) {
    timed_out = true;
    msg = e.what();
  } catch (const std::exception& e) {
    msg = std::string("unexpected exception: ") + e.what();
  }
  const double waited = seconds_since(t0);
  const bool ok = timed_out && msg.find(expect_op) != std::string::npos &&
                  msg.find("timed out after 2 s") != std::string::npos && waited >= 1.9 && waited < 7.0;
  std::cout << "rank " << me << ": " << (ok ? "as expected" : "NOT as expected") << ", waited " << waited
            << " s: " << msg << std::endl;
  return ok;
}

// The ranks of `verdict` agree on their verdicts; rank 0 prints STALL TEST PASSED/FAILED with
// `what` and aborts the job (the clean way out while a peer is still stuck).
[[noreturn]] void vote_and_abort(int me, bool ok, const CommPtr& verdict, const std::string& what) {
  auto votes = at::full({1}, ok ? 1 : 0, at::kLong);
  verdict->set_timeout(seconds(20));
  verdict->allreduce(votes, ReduceOp::kSum);
  if (me == 0) {
    const bool all_ok = votes.item<int64_t>() == verdict->size();
    std::cout << (all_ok ? "STALL TEST PASSED" : "STALL TEST FAILED") << ": " << votes.item<int64_t>() << " of "
              << verdict->size() << " " << what << std::endl;
    std::this_thread::sleep_for(milliseconds(300));  // let mpirun forward the output
    runtime().abort(all_ok ? 3 : 4);
  }
  std::this_thread::sleep_for(seconds(120));  // rank 0's abort ends us
  std::_Exit(4);
}

TEST(Stall, DISABLED_SilentRankMakesTheOthersTimeOut) {
  auto w = world();
  const int me = w->rank(), stalled = 1;
  auto live = w->split(me == stalled ? -1 : 0, me);  // collective: before the stall
  w->barrier();
  if (me == stalled) {
    std::cout << "rank " << me << ": stalling (no further collectives)" << std::endl;
    std::this_thread::sleep_for(seconds(120));  // longer than the ctest timeout
    std::cout << "STALL TEST FAILED: rank " << me << " was not stopped within 120 s" << std::endl;
    runtime().abort(4);
  }
  w->set_timeout(milliseconds(2000));
  auto x = at::ones({1000}, at::kFloat);
  const bool ok = times_out_naming(me, "rank " + std::to_string(me) + ": allreduce(sum) of Float[1000]",
                                   [&] { w->allreduce(x, ReduceOp::kSum); });
  vote_and_abort(me, ok, live,
                 "live ranks got CommTimeout naming their rank and the allreduce within 2 s + 5 s while rank " +
                     std::to_string(stalled) + " was silent");
}

// Rank 1 skips the allreduce and goes on to a barrier: the collectives no longer match. Every
// rank, rank 1 included, must end its wait with CommTimeout naming itself and its operation
// (MPI may not complete mismatched collectives, and Tandem must not hang on them).
TEST(Stall, DISABLED_RankInAnotherCollectiveMakesAllTimeOut) {
  auto w = world();
  const int me = w->rank(), skipper = 1;
  auto verdict = w->split(0, me);  // separate communicator for the verdict
  w->barrier();
  w->set_timeout(milliseconds(2000));
  auto x = at::ones({1000}, at::kFloat);
  const bool ok =
      times_out_naming(me, "rank " + std::to_string(me) + (me == skipper ? ": barrier" : ": allreduce(sum)"),
                       [&] { me == skipper ? w->barrier() : w->allreduce(x, ReduceOp::kSum); });
  vote_and_abort(me, ok, verdict,
                 "ranks got CommTimeout naming their rank and operation within 2 s + 5 s while rank " +
                     std::to_string(skipper) + " waited in a barrier instead of the allreduce");
}

// Rank 0 sends 4 MiB (above the eager limit: the send stays in flight until received) that
// rank 1 never receives. Its wait times out; destroying the communicator must then abandon the
// send at once (the wait already failed) instead of waiting again or leaving its progress thread
// running over a freed object, and the abandoned operation's Work reports why.
TEST(Stall, DISABLED_DestroyedCommunicatorAbandonsWhatCannotComplete) {
  auto w = world();
  const int me = w->rank();
  auto verdict = w->split(0, me);
  auto sub = w->split(0, me);
  w->barrier();
  bool ok = true;
  if (me == 0) {
    sub->set_timeout(milliseconds(2000));
    auto work = sub->send_async(at::ones({1 << 20}, at::kFloat), 1, 7);
    ok = times_out_naming(me, "rank 0: send(to 1, tag 7)", [&] { work->wait(); });
    const auto t0 = std::chrono::steady_clock::now();
    sub.reset();
    const double took = seconds_since(t0);
    std::string why = "(no exception)";
    try {
      work->wait();
    } catch (const CommError& e) {
      why = e.what();
    }
    const bool abandoned = took < 1.0 && why.find("abandoned") != std::string::npos;
    std::cout << "rank 0: destroying the communicator took " << took << " s; the send's wait: " << why << std::endl;
    ok = ok && abandoned;
  }
  vote_and_abort(me, ok, verdict,
                 "ranks saw a send that timed out abandoned within 1 s when its communicator was destroyed");
}

void leave_midway(bool kill_self) {
  auto w = world();
  const int me = w->rank();
  w->set_timeout(seconds(120));  // mpirun, not the timeout, has to end the others
  auto t = at::ones({4096}, at::kFloat);
  for (int i = 0; i < 1000; ++i) {
    if (me == 1 && i == 5) {
      std::cout << "rank 1: leaving in the middle of the job" << std::endl;
      if (kill_self) raise(SIGKILL);
      _exit(3);
    }
    w->allreduce(t, ReduceOp::kMax);
  }
  std::cout << "NOT STOPPED: rank " << me << " finished its collectives without rank 1" << std::endl;
  std::_Exit(0);
}

TEST(EarlyExit, DISABLED_RankExitsWithCode3) { leave_midway(false); }
TEST(EarlyExit, DISABLED_RankIsKilled) { leave_midway(true); }

}  // namespace
}  // namespace tandem::test
