// The Engine's typed configuration without running anything: names parsed in one place (and the
// planner's names are the same vocabulary), the checks of a layout against a world size and a
// global batch, and the one learning-rate schedule.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "tandem/engine.h"
#include "tandem/plan.h"

namespace tandem {
namespace {

std::string refusal(const ParallelConfig& c, int world, int64_t batch = 0) {
  try {
    validate(c, world, batch);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(EngineConfig, NamesRoundTrip) {
  for (Strategy s : {Strategy::kSingle, Strategy::kDDP, Strategy::kZero1, Strategy::kZero2, Strategy::kZero3}) {
    EXPECT_EQ(parse_strategy(to_string(s)), s);
  }
  for (Compression c : {Compression::kNone, Compression::kBF16, Compression::kFP16, Compression::kPowerSGD}) {
    EXPECT_EQ(parse_compression(to_string(c)), c);
  }
  EXPECT_EQ(to_string(parse_partition("2,3,1", 3)), "2,3,1");
  EXPECT_EQ(to_string(parse_partition("params", 3)), "params");
  try {
    parse_strategy("zero4");
    ADD_FAILURE() << "zero4 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("single, ddp, zero1, zero2, zero3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_partition("2,0", 2), std::invalid_argument);
  EXPECT_THROW(parse_partition("2", 2), std::invalid_argument);
}

// What `tandem plan` calls a layout without model parallelism is a strategy `tandem train` reads.
TEST(EngineConfig, PlanAndTrainShareTheVocabulary) {
  for (int zero = 0; zero <= 3; ++zero) {
    for (int dp : {1, 4}) {
      if (zero > 0 && dp == 1) continue;
      plan::Layout l;
      l.dp = dp;
      l.zero = zero;
      const Strategy s = parse_strategy(l.strategy_name());
      EXPECT_EQ(zero_stage(s), zero) << l.strategy_name();
    }
  }
}

TEST(EngineConfig, RefusesConflictsNamingThem) {
  ParallelConfig c;
  EXPECT_EQ(refusal(c, 4, 64), "");
  c.tp = 3;
  EXPECT_NE(refusal(c, 4).find("--tp 3 x --pp 1 = 3 ranks per replica does not divide the 4 workers"),
            std::string::npos);
  c = ParallelConfig{};
  c.pp = 2;
  for (Strategy s : {Strategy::kZero1, Strategy::kZero2, Strategy::kZero3}) {
    c.strategy = s;
    EXPECT_EQ(refusal(c, 4, 64), "") << to_string(s);
  }
  c.micro_batches = 3;  // 64 / 2 replicas = 32 rows, not in 3 micro-batches
  EXPECT_NE(refusal(c, 4, 64).find("not divisible into 3 micro-batches"), std::string::npos);
  c = ParallelConfig{};
  c.precision = Precision::kBF16;
  c.compress = Compression::kFP16;
  EXPECT_NE(refusal(c, 2).find("--compress fp16 compresses fp32 gradients"), std::string::npos);
  c = ParallelConfig{};
  c.compress = Compression::kPowerSGD;
  c.powersgd.rank = 4;
  EXPECT_EQ(refusal(c, 2), "");
  for (int64_t bad : {0, -3}) {
    c.powersgd.rank = bad;
    EXPECT_NE(refusal(c, 2).find("--powersgd-rank must be at least 1 (got " + std::to_string(bad)), std::string::npos);
  }
  c.powersgd.rank = 4;
  c.powersgd.start_step = -1;
  EXPECT_NE(refusal(c, 2).find("--powersgd-start-step must be >= 0"), std::string::npos);
  c = ParallelConfig{};
  c.compress = Compression::kPowerSGD;
  c.strategy = Strategy::kZero2;
  EXPECT_NE(refusal(c, 2).find("--compress applies to --strategy ddp only"), std::string::npos);
  c = ParallelConfig{};
  c.strategy = Strategy::kSingle;
  EXPECT_NE(refusal(c, 2).find("strategy single runs one worker"), std::string::npos);
  c = ParallelConfig{};
  c.grad_accum = 8;
  EXPECT_NE(refusal(c, 2, 8).find("fewer than --grad-accum 8"), std::string::npos);
  c.pp = 2;
  EXPECT_NE(refusal(c, 2).find("--grad-accum with --pp"), std::string::npos);
  c = ParallelConfig{};
  c.max_grad_norm = -1;
  EXPECT_NE(refusal(c, 1).find("--max-grad-norm must be >= 0"), std::string::npos);
  EXPECT_EQ(data_parallel_size(
                [] {
                  ParallelConfig p;
                  p.tp = 2;
                  p.pp = 2;
                  return p;
                }(),
                8),
            2);
}

// --pipeline-schedule interleaved --virtual-stages V: each bad combination is named.
TEST(EngineConfig, InterleavedScheduleRefusesBadCombinations) {
  ParallelConfig c;
  c.pp = 2;
  c.schedule = PipelineSchedule::kInterleaved;
  c.virtual_stages = 2;
  c.micro_batches = 4;
  EXPECT_EQ(refusal(c, 2, 8), "");
  EXPECT_EQ(refusal(c, 4, 16), "");  // dp 2 x pp 2
  ParallelConfig with_tp = c;
  with_tp.tp = 2;
  EXPECT_EQ(refusal(with_tp, 4, 16), "");  // tp 2 x pp 2: every rank writes its pieces of its chunks
  EXPECT_EQ(parse_pipeline_schedule("interleaved"), PipelineSchedule::kInterleaved);
  EXPECT_STREQ(to_string(PipelineSchedule::kInterleaved), "interleaved");
  // Each change of the valid configuration c, and what its refusal must say.
  const std::vector<std::pair<std::function<void(ParallelConfig&)>, std::string>> cases = {
      {[](ParallelConfig& b) { b.micro_batches = 3; }, "--micro-batches must be a multiple of --pp"},
      {[](ParallelConfig& b) { b.virtual_stages = 0; }, "--virtual-stages 0: give 1 or more"},
      {[](ParallelConfig& b) { b.schedule = PipelineSchedule::kGPipe; },
       "--virtual-stages 2 needs --pipeline-schedule interleaved (gpipe"},
      {[](ParallelConfig& b) { b.pp = 1; }, "needs --pp 2 or more"},
      {[](ParallelConfig& b) { b.partition = parse_partition("1,2,3", 3); },
       "lists 3 stage(s) for --pp 2 x --virtual-stages 2; give 4 layer counts"},
  };
  for (const auto& [change, says] : cases) {
    ParallelConfig bad = c;
    change(bad);
    const std::string msg = refusal(bad, 4);
    EXPECT_NE(msg.find(says), std::string::npos) << "\"" << msg << "\" lacks \"" << says << "\"";
  }
  ParallelConfig bad = c;
  bad.partition = parse_partition("1,2,3,1", 4);
  EXPECT_EQ(refusal(bad, 2), "");
}

TEST(EngineConfig, OneLearningRateSchedule) {
  LrSchedule s;
  s.peak = 1.0;
  s.warmup_steps = 4;
  s.total_steps = 104;
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);  // warmup from 0: (step + 1) / warmup
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(1.5), 0.625);  // a step of half the schedule's batch advances it by half
  EXPECT_DOUBLE_EQ(s.at(3.5), 1.0);    // the last warmup half-step reaches the peak, not above
  EXPECT_NEAR(s.at(54.5), 0.5 * (1 + std::cos(M_PI * 50.5 / 100.0)), 1e-15);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);     // the cosine starts at the peak
  EXPECT_NEAR(s.at(54), 0.5, 1e-12);  // half way: half the peak
  EXPECT_NEAR(s.at(103), 0.5 * (1 + std::cos(M_PI * 99.0 / 100.0)), 1e-15);
  s.min_ratio = 0.1;  // the text loops decay to 10 %
  EXPECT_NEAR(s.at(54), 0.1 + 0.9 * 0.5, 1e-12);
  EXPECT_GE(s.at(1000), 0.1 - 1e-12);  // past the end: held at the floor
  s.warmup_start = 0.5;                // Goyal et al.'s warmup: from the unscaled rate
  EXPECT_DOUBLE_EQ(s.at(0), 0.5 + 0.5 * 0.25);
  s.cosine = false;
  EXPECT_DOUBLE_EQ(s.at(50), 1.0);
}

}  // namespace
}  // namespace tandem
