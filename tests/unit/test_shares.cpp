// Batch shares for heterogeneous clusters (tandem/shares.h): apportioning and its rounding,
// parsing and every rejected input, the loss weight, and DistributedSampler::share_batches
// (disjoint shards of the requested sizes whose union per step is the equal-share step).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "tandem/data.h"
#include "tandem/shares.h"
#include "tandem/trainer.h"

using tandem::BatchSharesSpec;
using tandem::data::apportion;
using tandem::data::DistributedSampler;

namespace {

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

// The error message of f(), or "" when it does not throw std::invalid_argument.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Apportion, ExactProportionsAndSum) {
  EXPECT_EQ(apportion({3, 1}, 128), (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(apportion({1, 1}, 128), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(apportion({0.5, 0.25, 0.25}, 100), (std::vector<int64_t>{50, 25, 25}));
  // Largest remainder: 2/7 of 10 = 2.857 -> 3, 5/7 = 7.14 -> 7.
  EXPECT_EQ(apportion({2, 5}, 10), (std::vector<int64_t>{3, 7}));
  // Measured rates in any units; the result always sums to the total.
  for (int64_t total : {1, 7, 128, 1000}) {
    auto a = apportion({1234.5, 987.25, 3.75, 400.0}, total);
    EXPECT_EQ(sum(a), total) << total;
  }
}

TEST(Apportion, TiesGoToTheLowerIndexAndMinimumIsRaised) {
  // 128 / 3 = 42.67 each: the two extra samples go to ranks 0 and 1.
  EXPECT_EQ(apportion({1, 1, 1}, 128), (std::vector<int64_t>{43, 43, 42}));
  EXPECT_EQ(apportion({1, 1, 1, 1}, 6), (std::vector<int64_t>{2, 2, 1, 1}));
  // 1000:1 of 128 gives rank 1 nothing; min_each 1 takes one from the largest.
  EXPECT_EQ(apportion({1000, 1}, 128), (std::vector<int64_t>{128, 0}));
  EXPECT_EQ(apportion({1000, 1}, 128, 1), (std::vector<int64_t>{127, 1}));
  EXPECT_EQ(apportion({1000, 1, 1}, 4, 1), (std::vector<int64_t>{2, 1, 1}));
  // Deterministic: the same inputs, the same answer.
  EXPECT_EQ(apportion({3.3, 1.7, 2.9}, 97, 1), apportion({3.3, 1.7, 2.9}, 97, 1));
}

TEST(Apportion, RejectsBadInput) {
  EXPECT_NE(error_of([] { apportion({}, 4); }), "");
  EXPECT_NE(error_of([] { apportion({1, 0}, 4); }).find("weight 1"), std::string::npos);
  EXPECT_NE(error_of([] { apportion({1, -2}, 4); }), "");
  EXPECT_NE(error_of([] { apportion({1, 1}, -1); }), "");
  EXPECT_NE(error_of([] { apportion({1, 1, 1}, 2, 1); }).find("at least 1"), std::string::npos);
}

TEST(BatchShares, ParsesWeightsCountsAutoAndEqual) {
  EXPECT_EQ(tandem::parse_batch_shares("").kind, BatchSharesSpec::Kind::kEqual);
  EXPECT_EQ(tandem::parse_batch_shares("auto").kind, BatchSharesSpec::Kind::kAuto);
  auto w = tandem::parse_batch_shares("3,1.5");
  EXPECT_EQ(w.kind, BatchSharesSpec::Kind::kWeights);
  EXPECT_EQ(w.values, (std::vector<double>{3, 1.5}));
  auto c = tandem::parse_batch_shares("counts:96,32");
  EXPECT_EQ(c.kind, BatchSharesSpec::Kind::kCounts);
  EXPECT_EQ(tandem::resolve_batch_shares(w, 90, 2), (std::vector<int64_t>{60, 30}));
  EXPECT_EQ(tandem::resolve_batch_shares(c, 128, 2), (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(tandem::resolve_batch_shares(tandem::parse_batch_shares("auto"), 128, 3),
            (std::vector<int64_t>{43, 43, 42}));
  EXPECT_EQ(tandem::shares_from_throughput({3000, 1000}, 128), (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(tandem::shares_from_throughput({1e6, 1}, 128), (std::vector<int64_t>{127, 1}));
}

TEST(BatchShares, RejectsZeroNegativeWrongCountAndBadSums) {
  using tandem::parse_batch_shares;
  using tandem::resolve_batch_shares;
  EXPECT_NE(error_of([] { parse_batch_shares("3,0"); }).find("rank 1's share is 0"), std::string::npos);
  EXPECT_NE(error_of([] { parse_batch_shares("-1,2"); }).find("must be positive"), std::string::npos);
  EXPECT_NE(error_of([] { parse_batch_shares("3,x"); }).find("'x' is not a number"), std::string::npos);
  EXPECT_NE(error_of([] { parse_batch_shares("3,,1"); }).find("not a number"), std::string::npos);
  EXPECT_NE(error_of([] { parse_batch_shares("3,1,"); }).find("one share per worker"), std::string::npos);
  EXPECT_NE(error_of([] { parse_batch_shares("counts:"); }).find("one share per worker"), std::string::npos);
  EXPECT_NE(error_of([] { parse_batch_shares("counts:95.5,32.5"); }).find("not a whole number"), std::string::npos);
  EXPECT_NE(error_of([] { parse_batch_shares("counts:128,0"); }).find("no samples is not allowed"), std::string::npos);
  EXPECT_NE(error_of([] {
              resolve_batch_shares(parse_batch_shares("3,1,1"), 128, 2);
            }).find("3 share(s) for 2 data-parallel worker(s)"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              resolve_batch_shares(parse_batch_shares("counts:96,30"), 128, 2);
            }).find("sum to 126 samples, not the global --batch 128"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              resolve_batch_shares(parse_batch_shares("1000,1"), 128, 2);
            }).find("rank 1's weight leaves it 0"),
            std::string::npos);
}

TEST(BatchShares, ValidatesTheConfiguration) {
  tandem::TrainConfig cfg;
  cfg.batch = 100;  // not a multiple of 3: allowed with explicit shares
  cfg.batch_shares = "counts:50,30,20";
  EXPECT_EQ(error_of([&] { tandem::validate_config(cfg, 3); }), "");
  cfg.batch_shares = "auto";
  cfg.calibration_steps = 1;
  EXPECT_NE(error_of([&] { tandem::validate_config(cfg, 3); }).find("--calibration-steps"), std::string::npos);
  cfg.calibration_steps = 8;
  cfg.parallel.strategy =
      tandem::Strategy::kZero3;  // accepted: a rank's forward is timed without its waits for gathers
  EXPECT_EQ(error_of([&] { tandem::validate_config(cfg, 3); }), "");
  cfg.parallel.strategy = tandem::Strategy::kDDP;
  cfg.batch = 128;
  cfg.batch_shares = "3,1";
  cfg.parallel.tp = 2;
  EXPECT_NE(error_of([&] { tandem::validate_config(cfg, 4); }).find("pure data parallelism"), std::string::npos);
  cfg.parallel.tp = 1;
  cfg.parallel.cp = 2;  // the cp ranks of a replica take the same rows
  EXPECT_NE(error_of([&] { tandem::validate_config(cfg, 4); }).find("pure data parallelism"), std::string::npos);
  cfg.parallel.cp = 1;
  cfg.slow_rank = "2:1";
  EXPECT_NE(error_of([&] { tandem::validate_config(cfg, 2); }).find("not one of the 2 worker(s)"), std::string::npos);
  cfg.slow_rank = "1";
  EXPECT_NE(error_of([&] { tandem::validate_config(cfg, 2); }).find("RANK:MS"), std::string::npos);
  cfg.slow_rank = "1:-3";
  EXPECT_NE(error_of([&] { tandem::validate_config(cfg, 2); }).find(">= 0 ms"), std::string::npos);
  cfg.slow_rank = "1:0.25";
  EXPECT_EQ(tandem::parse_slow_rank(cfg.slow_rank, 2).ms_per_sample, 0.25);
  EXPECT_EQ(error_of([&] { tandem::validate_config(cfg, 2); }), "");
}

TEST(BatchShares, LossWeightMakesTheAverageTheGlobalMean) {
  // Averaging w_r * mean_r over W ranks = sum_r n_r / N * mean_r: the mean over all N samples.
  const std::vector<int64_t> n = {96, 32};
  const std::vector<double> mean = {0.7, 1.9};
  double avg = 0;
  for (int r = 0; r < 2; ++r) avg += tandem::share_loss_weight(n[r], 128, 2) * mean[r] / 2;
  EXPECT_DOUBLE_EQ(avg, (96 * 0.7 + 32 * 1.9) / 128);
  EXPECT_DOUBLE_EQ(tandem::share_loss_weight(64, 128, 2), 1.0);
  EXPECT_DOUBLE_EQ(tandem::share_loss_weight(128, 128, 1), 1.0);
}

// For every step, the union of the ranks' share batches is the set of the equal-share step
// (strided indices() in batches of B / W), the shards are disjoint and have the share sizes.
void check_shares_cover_equal_steps(int64_t n, int world, int64_t batch, const std::vector<int64_t>& shares) {
  SCOPED_TRACE("n " + std::to_string(n) + ", world " + std::to_string(world) + ", batch " + std::to_string(batch));
  std::vector<std::vector<std::vector<int64_t>>> equal(world), shared(world);
  for (int r = 0; r < world; ++r) {
    DistributedSampler s(n, r, world, /*shuffle=*/true, /*seed=*/11);
    s.set_epoch(3);
    equal[r] = tandem::data::batches(s.indices(), batch / world, false);
    shared[r] = s.share_batches(shares);
    ASSERT_EQ(shared[r].size(), equal[r].size()) << "rank " << r;
    for (size_t k = 0; k < shared[r].size(); ++k) {
      EXPECT_EQ(s.share_step_samples(batch, static_cast<int64_t>(k)), static_cast<int64_t>(equal[0][k].size()) * world);
    }
    EXPECT_EQ(s.share_step_samples(batch, static_cast<int64_t>(shared[r].size())), 0);
  }
  for (size_t k = 0; k < equal[0].size(); ++k) {
    std::multiset<int64_t> want, got;
    std::set<int64_t> positions_seen;
    int64_t step_total = 0;
    for (int r = 0; r < world; ++r) {
      want.insert(equal[r][k].begin(), equal[r][k].end());
      got.insert(shared[r][k].begin(), shared[r][k].end());
      step_total += static_cast<int64_t>(shared[r][k].size());
      EXPECT_GE(shared[r][k].size(), 1u) << "rank " << r << " step " << k;
      if (static_cast<int64_t>(equal[0][k].size()) * world == batch) {
        EXPECT_EQ(static_cast<int64_t>(shared[r][k].size()), shares[r]) << "rank " << r << " step " << k;
      }
    }
    EXPECT_EQ(got, want) << "step " << k << ": the global batch differs from the equal-share run's";
    EXPECT_EQ(step_total, static_cast<int64_t>(want.size()));
  }
}

TEST(DistributedSampler, ShareBatchesCoverTheEqualShareSteps) {
  check_shares_cover_equal_steps(1000, 2, 128, {96, 32});  // last window 1000 - 7 * 128 = 104
  check_shares_cover_equal_steps(1000, 2, 128, {64, 64});
  check_shares_cover_equal_steps(1001, 3, 99, {50, 30, 19});  // padded to 1002; last window 12
  check_shares_cover_equal_steps(60000, 4, 128, {70, 30, 20, 8});
  check_shares_cover_equal_steps(7, 2, 4, {3, 1});  // tiny: last window 8 - 4 = 4, padded
}

TEST(DistributedSampler, ShareBatchesAreDisjointWithinAnEpochWithoutPadding) {
  const int world = 3;
  const std::vector<int64_t> shares = {5, 2, 1};
  std::set<int64_t> seen;
  int64_t count = 0;
  for (int r = 0; r < world; ++r) {
    DistributedSampler s(96, r, world, true, 5);
    for (auto& b : s.share_batches(shares)) {
      seen.insert(b.begin(), b.end());
      count += static_cast<int64_t>(b.size());
    }
  }
  EXPECT_EQ(count, 96);
  EXPECT_EQ(seen.size(), 96u);
}

TEST(DistributedSampler, ShareBatchesLastWindowAndErrors) {
  // 10 samples, world 2, batch 8 with shares 7:1 -> window 1: 2 samples, one each.
  DistributedSampler s0(10, 0, 2, false), s1(10, 1, 2, false);
  auto b0 = s0.share_batches({7, 1}), b1 = s1.share_batches({7, 1});
  ASSERT_EQ(b0.size(), 2u);
  EXPECT_EQ(b0[0], (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(b1[0], (std::vector<int64_t>{7}));
  EXPECT_EQ(b0[1], (std::vector<int64_t>{8}));
  EXPECT_EQ(b1[1], (std::vector<int64_t>{9}));
  // Batch 5 over 2 ranks: windows [0,5), [5,10), [10,12); the last has 2 = W samples: kept.
  DistributedSampler t(12, 0, 2, false);
  EXPECT_EQ(t.share_batches({4, 1}).size(), 3u);
  EXPECT_EQ(t.share_step_samples(5, 2), 2);
  // A last window smaller than the world (batch 8 over 3 ranks, 9 samples): dropped.
  DistributedSampler u(9, 2, 3, false);
  EXPECT_EQ(u.share_batches({4, 3, 1}).size(), 1u);
  EXPECT_EQ(u.share_step_samples(8, 1), 0);
  EXPECT_NE(error_of([&] { t.share_batches({4}); }).find("1 shares for a world of 2"), std::string::npos);
  EXPECT_NE(error_of([&] { t.share_batches({4, 0}); }).find("at least 1"), std::string::npos);
}
