// Elastic runs (tandem/elastic.h): the -n MIN:MAX grammar, the hostfile reader, and the restart
// loop on this machine (mpirun with a shell command that fails once).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

#include "tandem/elastic.h"
#include "temp_dir.h"

namespace tandem {
namespace {

TEST(Elastic, WorkerRangeFixedAndElastic) {
  auto fixed = parse_worker_range("4", 4096);
  EXPECT_EQ(fixed.min, 4);
  EXPECT_EQ(fixed.max, 4);
  EXPECT_FALSE(fixed.elastic());
  auto r = parse_worker_range("2:5", 4096);
  EXPECT_EQ(r.min, 2);
  EXPECT_EQ(r.max, 5);
  EXPECT_TRUE(r.elastic());
}

TEST(Elastic, WorkerRangeRejectsWhatCannotWork) {
  auto message = [](const std::string& text) {
    try {
      (void)parse_worker_range(text, 8);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message("3:2").find("MIN (3) is above MAX (2)"), std::string::npos) << message("3:2");
  EXPECT_NE(message("0:2").find("at least 1 worker"), std::string::npos);
  EXPECT_NE(message("1:x").find("MAX 'x' is not a whole number"), std::string::npos);
  EXPECT_NE(message(":2").find("MIN '' is not a whole number"), std::string::npos);
  EXPECT_NE(message("2:9").find("at most 8 workers"), std::string::npos);
  EXPECT_NE(message("1:2:3").find("not a whole number"), std::string::npos);
}

TEST(Elastic, HostfileSlotsCommentsAndErrors) {
  test::TempDir dir;
  const std::string path = dir.path + "/hosts";
  std::ofstream(path) << "# the cluster\nnodeA slots=4\n\n  nodeB   # one slot by default\nnodeC max_slots=8 slots=2\n";
  auto hosts = read_hostfile(path);
  ASSERT_EQ(hosts.size(), 3u);
  EXPECT_EQ(hosts[0].name, "nodeA");
  EXPECT_EQ(hosts[0].slots, 4);
  EXPECT_EQ(hosts[1].name, "nodeB");
  EXPECT_EQ(hosts[1].slots, 1);
  EXPECT_EQ(hosts[2].slots, 2);
  std::ofstream(path) << "nodeA slots=zero\n";
  EXPECT_THROW(read_hostfile(path), std::invalid_argument);
  std::ofstream(path) << "# nothing\n";
  EXPECT_THROW(read_hostfile(path), std::invalid_argument);
  EXPECT_THROW(read_hostfile(dir.path + "/missing"), std::invalid_argument);
}

// Options for a run on this machine with checkpoints in `dir`.
ElasticOptions options_in(const std::string& dir, int min, int max) {
  ElasticOptions o;
  o.workers = {min, max};
  o.checkpoint_dir = dir;
  o.stop_file = dir + "/elastic-stop";
  return o;
}

// The loop on this machine: the first launch fails, the relaunch (with resume) succeeds; the
// worker count is the largest in range that `fits` accepts.
TEST(Elastic, RelaunchesAfterAFailureWithTheLargestFittingCount) {
  test::TempDir dir;
  ElasticOptions o = options_in(dir.path, 1, 3);
  LaunchOptions lo;
  lo.prefix_output = false;
  std::vector<std::pair<int, bool>> calls;
  const std::string mark = dir.path + "/failed-once";
  auto command = [&](int workers, bool resume) {
    calls.emplace_back(workers, resume);
    return std::vector<std::string>{"sh", "-c", "test -f " + mark + " || { touch " + mark + "; exit 3; }"};
  };
  auto r = run_elastic(lo, o, command, [](int w) { return w % 2 == 0; });  // only 2 fits in 1..3
  EXPECT_EQ(r.exit_code, 0);
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0], std::make_pair(2, false));
  EXPECT_EQ(calls[1], std::make_pair(2, true));
  ASSERT_EQ(r.changes.size(), 1u);
  EXPECT_EQ(r.changes[0].reason, "failure");
  EXPECT_EQ(r.changes[0].resume_step, 0);  // no checkpoint yet
  auto j = nlohmann::json::parse(membership_json_lines(r.changes));
  EXPECT_EQ(j["membership"]["old_workers"], 2);
  EXPECT_EQ(j["membership"]["new_workers"], 2);
}

TEST(Elastic, GivesUpAfterMaxFailuresAndNeedsCheckpoints) {
  test::TempDir dir;
  ElasticOptions o = options_in(dir.path, 1, 2);
  o.max_failures = 1;
  LaunchOptions lo;
  int launches = 0;
  auto failing = [&](int, bool) {
    ++launches;
    return std::vector<std::string>{"sh", "-c", "exit 5"};
  };
  auto r = run_elastic(lo, o, failing, [](int) { return true; });
  EXPECT_EQ(r.exit_code, 5);
  EXPECT_EQ(launches, 2);
  o.checkpoint_dir.clear();
  EXPECT_THROW(run_elastic(lo, o, failing, [](int) { return true; }), std::invalid_argument);
}

}  // namespace
}  // namespace tandem
