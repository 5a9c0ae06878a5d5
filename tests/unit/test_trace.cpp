// tandem/trace.h on one rank: named tracks (a device stream's) beside the threads' tracks, and
// the generation count that recorders mapping another clock onto the trace's follow.
#include "tandem/trace.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <string>

#include "tandem/backends.h"

namespace {

TEST(Trace, NamedTracksAndGenerations) {
  namespace trace = tandem::trace;
  auto comm = tandem::make_thread_communicators(1, tandem::CommOptions{}).at(0);
  const uint64_t before = trace::generation();
  trace::start(*comm);
  EXPECT_EQ(trace::generation(), before + 1);
  const int track = trace::named_track("NCCL stream (a group of 1)");
  trace::record_on(track, "allreduce", "communication", 10, 30, "\"bytes\":4096");
  trace::record("forward", "compute", 5, 40);
  trace::stop();
  trace::record_on(track, "late", "communication", 50, 60);  // off: dropped
  const std::string path = ::testing::TempDir() + "trace_named_tracks.json";
  trace::write(path, *comm);
  const auto j = nlohmann::json::parse(std::ifstream(path));
  std::remove(path.c_str());
  int stream_tid = -1, main_tid = -1;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") {
      if (e["args"]["name"] == "NCCL stream (a group of 1)") stream_tid = e["tid"];
      if (e["args"]["name"] == "main") main_tid = e["tid"];
    }
  }
  ASSERT_GE(stream_tid, 0);
  ASSERT_GE(main_tid, 0);
  EXPECT_NE(stream_tid, main_tid);
  int seen = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    ++seen;
    EXPECT_NE(e["name"], "late");
    if (e["name"] == "allreduce") {
      EXPECT_EQ(e["tid"], stream_tid);
      EXPECT_EQ(e["ts"], 10);
      EXPECT_EQ(e["dur"], 20);
      EXPECT_EQ(e["args"]["bytes"], 4096);
    } else {
      EXPECT_EQ(e["name"], "forward");
      EXPECT_EQ(e["tid"], main_tid);
    }
  }
  EXPECT_EQ(seen, 2);
  trace::start(*comm);  // a new trace: a recorder sees the generation move and takes a new reference
  EXPECT_EQ(trace::generation(), before + 2);
  trace::stop();
}

}  // namespace
