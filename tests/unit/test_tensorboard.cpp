// TensorBoard event files (tandem/tensorboard.h): CRC-32C and TFRecord's mask against known
// values, a record's framing byte by byte, a written file read back through its CRCs and the
// protobuf codec, corruption and truncation refused, an unusable directory refused, and the
// --metrics lines carrying the same step figures.
#include "tandem/tensorboard.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include "tests/unit/temp_dir.h"

namespace tb = tandem::tensorboard;

namespace {

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d))
      if (e->d_name[0] != '.') out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

uint64_t le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}

}  // namespace

TEST(TensorBoard, Crc32cOfKnownVectors) {
  EXPECT_EQ(tb::crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value
  EXPECT_EQ(tb::crc32c("", 0), 0u);
  const std::string zeros(32, '\0');  // RFC 3720, B.4: 32 bytes of zeros
  EXPECT_EQ(tb::crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(tb::masked_crc32c("", 0), 0xa282ead8u);  // mask of 0: the delta alone
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(tb::masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoard, RecordFraming) {
  const std::string payload = "hello, tensorboard";
  const std::string rec = tb::frame_record(payload);
  ASSERT_EQ(rec.size(), 8 + 4 + payload.size() + 4);
  EXPECT_EQ(le(rec, 0, 8), payload.size());
  EXPECT_EQ(le(rec, 8, 4), tb::masked_crc32c(rec.data(), 8));
  EXPECT_EQ(rec.substr(12, payload.size()), payload);
  EXPECT_EQ(le(rec, 12 + payload.size(), 4), tb::masked_crc32c(payload.data(), payload.size()));
}

TEST(TensorBoard, WrittenEventsReadBack) {
  tandem::test::TempDir tmp;
  const std::string dir = tmp.file("run/a");  // parents are created
  std::string path;
  {
    tb::Writer w(dir);
    path = w.path();
    w.scalar("train/loss", 2.5, 1);
    w.scalar("train/lr", 0.1, 2);
    w.flush();
  }
  const auto names = files_in(dir);
  ASSERT_EQ(names.size(), 1u);
  EXPECT_TRUE(std::regex_match(names[0], std::regex(R"(events\.out\.tfevents\.\d+\..+)"))) << names[0];
  const auto ev = tb::read_events(path);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0].file_version, "brain.Event:2");
  EXPECT_GT(ev[0].wall_time, 1.6e9);
  const std::vector<std::tuple<std::string, int64_t, float>> want{{"train/loss", 1, 2.5f}, {"train/lr", 2, 0.1f}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(std::make_tuple(ev[i + 1].tag, ev[i + 1].step, ev[i + 1].value), want[i]) << "event " << i + 1;
  }
}

TEST(TensorBoard, CorruptAndTruncatedRecordsAreRefused) {
  tandem::test::TempDir tmp;
  std::string path;
  {
    tb::Writer w(tmp.path);
    path = w.path();
    w.scalar("x", 1.0, 1);
    w.flush();
  }
  const std::string good = slurp(path);
  std::string bad = good;
  bad[bad.size() - 6] ^= 0x01;  // a byte of the last record's payload
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
  try {
    tb::read_events(path);
    FAIL() << "a flipped byte was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("bad CRC"), std::string::npos) << e.what();
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc) << good.substr(0, good.size() - 1);
  try {
    tb::read_events(path);
    FAIL() << "a truncated file was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cut short"), std::string::npos) << e.what();
  }
}

TEST(TensorBoard, UnusableDirectoryIsRefused) {
  tandem::test::TempDir tmp;
  std::ofstream(tmp.file("file")) << "x";
  const std::string dir = tmp.file("file/tb");
  try {
    tb::Log log(dir, true);
    FAIL() << "a directory under a file was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--tensorboard " + dir + ": cannot create the directory"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(tb::Log(dir, false));  // ranks other than 0 write nothing
  tb::Log off(tmp.file("off"), false);
  EXPECT_FALSE(off.active());
  EXPECT_TRUE(files_in(tmp.path).size() == 1u);  // only "file": nothing was created for "off"
}

TEST(TensorBoard, LogWritesTheMetricsFiguresOfEachStep) {
  tandem::test::TempDir tmp;
  tandem::Report rep;
  rep.first_step = 10;
  rep.losses = {1.5, 1.25};
  rep.step_ms = {20.0, 10.0};
  tandem::StepFigures a, b;
  a.lr = 0.01;
  a.samples_per_second = 3200;
  a.grad_norm = 0.75;
  a.loss_scale = 65536;
  a.peak_rss_bytes = 1 << 20;
  a.comm_share = 0.25;
  b = a;
  b.grad_norm = -1.0;  // not computed: no curve point, no field
  rep.step_figures = {a, b};
  rep.samples_per_second = 1234.5;
  rep.test_accuracy = 0.875;
  {
    tb::Log log(tmp.file("tb"), true);
    for (size_t i = 0; i < rep.losses.size(); ++i)
      log.step(rep.first_step + static_cast<int64_t>(i) + 1, rep.losses[i], rep.step_figures[i]);
    log.finish(rep);
  }
  tandem::write_metrics(tmp.file("m.jsonl"), rep);
  std::ifstream m(tmp.file("m.jsonl"));
  std::string line;
  std::vector<nlohmann::json> lines;
  while (std::getline(m, line)) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["step"], 11);
  EXPECT_EQ(lines[0]["grad_norm"], 0.75);
  EXPECT_FALSE(lines[1].contains("grad_norm"));
  EXPECT_EQ(lines[1]["loss_scale"], 65536.0);

  const auto ev = tb::read_events(tmp.file("tb/" + files_in(tmp.file("tb"))[0]));
  auto value = [&](const std::string& tag, int64_t step) -> double {
    for (const auto& e : ev)
      if (e.tag == tag && e.step == step) return e.value;
    return -12345.0;
  };
  for (int i = 0; i < 2; ++i) {
    const auto& j = lines[i];
    const int64_t step = j["step"];
    for (const char* k : {"loss", "lr", "samples_per_second", "loss_scale", "peak_rss_bytes", "comm_share"})
      EXPECT_EQ(value(std::string("train/") + k, step), static_cast<float>(j[k].get<double>())) << k << " " << step;
  }
  EXPECT_EQ(value("train/grad_norm", 11), 0.75f);
  EXPECT_EQ(value("train/grad_norm", 12), -12345.0);
  EXPECT_EQ(value("final/samples_per_second", 12), 1234.5f);
  EXPECT_EQ(value("final/test_accuracy", 12), 0.875f);
  EXPECT_EQ(value("final/eval_loss", 12), -12345.0);  // not evaluated
}
