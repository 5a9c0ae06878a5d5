// Loss scaling and fp32 master weights (MixedPrecisionOptimizer) in one process: bf16 training
// follows fp32 training, small updates survive in the masters, fp16 overflows skip the step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "tandem/precision.h"

namespace tandem {
namespace {

TEST(Precision, ParsesNamesAndRejectsOthers) {
  EXPECT_EQ(parse_precision("fp32"), Precision::kFP32);
  EXPECT_EQ(parse_precision("bf16"), Precision::kBF16);
  EXPECT_EQ(parse_precision("fp16"), Precision::kFP16);
  EXPECT_EQ(compute_dtype(Precision::kBF16), at::kBFloat16);
  EXPECT_EQ(compute_dtype(Precision::kFP16), at::kHalf);
  try {
    parse_precision("fp8");
    ADD_FAILURE() << "fp8 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fp32, bf16 or fp16"), std::string::npos) << e.what();
  }
}

TEST(LossScaler, BacksOffOnOverflowAndGrowsAfterAnInterval) {
  LossScalerOptions o;
  o.init_scale = 256;
  o.growth_interval = 2;
  o.min_scale = 64;
  LossScaler s(true, o);
  EXPECT_EQ(s.scale(), 256);
  s.update(true);
  EXPECT_EQ(s.scale(), 128);
  s.update(true);
  s.update(true);
  EXPECT_EQ(s.scale(), 64) << "never below min_scale";
  EXPECT_EQ(s.skipped_steps(), 3);
  s.update(false);
  EXPECT_EQ(s.scale(), 64);
  s.update(false);
  EXPECT_EQ(s.scale(), 128);
  s.update(false);
  s.update(true);  // an overflow restarts the interval
  s.update(false);
  EXPECT_EQ(s.scale(), 64);
  s.update(false);
  EXPECT_EQ(s.scale(), 128);
  LossScaler off(false, o);
  off.update(true);
  EXPECT_EQ(off.scale(), 1.0);
  o.backoff_factor = 1.5;
  EXPECT_THROW(LossScaler(true, o), std::invalid_argument);
}

torch::nn::Sequential net(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::Tanh(), torch::nn::Linear(32, 4));
}

TEST(MixedPrecisionOptimizer, Bf16FollowsFp32AndKeepsSmallUpdatesInTheMasters) {
  auto ref = net(1), low = net(1);
  OptimizerOptions oo;
  oo.kind = "adamw";
  oo.lr = 1e-2;
  MixedPrecisionOptimizer ref_opt(ref->parameters(), Precision::kFP32, oo);
  MixedPrecisionOptimizer opt(low->parameters(), Precision::kBF16, oo);
  low->to(at::kBFloat16);
  EXPECT_EQ(opt.master_bytes(), 4 * (20 * 32 + 32 + 32 * 4 + 4));
  auto g = at::detail::createCPUGenerator(5);
  auto x = torch::randn({64, 20}, g);
  auto y = torch::randint(0, 4, {64}, g);
  double first = 0, last_ref = 0, last_low = 0;
  for (int s = 0; s < 40; ++s) {
    ref_opt.zero_grad();
    auto lr_ = torch::nn::functional::cross_entropy(ref->forward(x), y);
    lr_.backward();
    ref_opt.step();
    opt.zero_grad();
    auto ll = torch::nn::functional::cross_entropy(low->forward(x.to(at::kBFloat16)).to(at::kFloat), y);
    opt.scale_loss(ll).backward();
    EXPECT_TRUE(opt.step());
    if (s == 0) first = lr_.item<double>();
    last_ref = lr_.item<double>();
    last_low = ll.item<double>();
  }
  EXPECT_LT(last_ref, 0.5 * first) << "the task should be learnable";
  EXPECT_NEAR(last_low, last_ref, 0.05 * first) << "bf16 with fp32 masters should follow fp32";
  for (auto& p : low->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16);
  for (auto& p : opt.optimizer().param_groups()[0].params()) EXPECT_EQ(p.scalar_type(), at::kFloat);
}

TEST(MixedPrecisionOptimizer, Fp16SkipsOverflowingSteps) {
  auto m = net(2);
  OptimizerOptions oo;
  oo.kind = "sgd";
  oo.lr = 0.1;
  LossScalerOptions so;
  so.init_scale = 4096;
  MixedPrecisionOptimizer opt(m->parameters(), Precision::kFP16, oo, so);
  m->to(at::kHalf);
  auto x = torch::randn({8, 20}).to(at::kHalf);
  auto y = torch::randint(0, 4, {8});
  auto w0 = m->parameters()[0].detach().clone();
  opt.zero_grad();
  auto loss = torch::nn::functional::cross_entropy(m->forward(x).to(at::kFloat), y);
  opt.scale_loss(loss * std::numeric_limits<float>::infinity()).backward();
  EXPECT_FALSE(opt.step());
  EXPECT_TRUE(torch::equal(m->parameters()[0].detach(), w0));
  EXPECT_EQ(opt.scaler().scale(), 2048);
  opt.zero_grad();
  opt.scale_loss(torch::nn::functional::cross_entropy(m->forward(x).to(at::kFloat), y)).backward();
  EXPECT_TRUE(opt.step());
  EXPECT_FALSE(torch::equal(m->parameters()[0].detach(), w0));
}

}  // namespace
}  // namespace tandem
