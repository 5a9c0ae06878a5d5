// The Engine on replica threads (tandem/replicas.h): 2 replicas of DDP and ZeRO 1-3 take the
// same steps as one worker on the whole batch (the replicas' mean loss against its loss).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "tandem/engine.h"
#include "tandem/replicas.h"

namespace {

torch::nn::Sequential tiny_mlp() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(12, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16),
                               torch::nn::ReLU(), torch::nn::Linear(16, 3));
}

// Per-step losses of `strategy` on `rt`: rank r of w trains rows [r * 32 / w, (r + 1) * 32 / w) of each batch.
std::vector<double> train_steps(tandem::Runtime& rt, const std::string& strategy, int steps) {
  torch::nn::Sequential net;
  {
    std::lock_guard<std::mutex> lk(tandem::default_generator_mutex());
    net = tiny_mlp();
  }
  tandem::ParallelConfig pc;
  pc.strategy = tandem::parse_strategy(strategy);
  tandem::OptimizerOptions oo;
  oo.kind = "adamw";
  oo.lr = 0.01;
  tandem::Engine eng(rt, net, oo, pc);
  const int w = rt.world_size(), r = rt.rank();
  auto g = at::make_generator<at::CPUGeneratorImpl>(11);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    auto x = at::randn({32, 12}, g);
    auto y = at::randint(0, 3, {32}, g, at::kLong);
    auto loss = eng.step(x.narrow(0, r * 32 / w, 32 / w), y.narrow(0, r * 32 / w, 32 / w),
                         [](const at::Tensor& out, const at::Tensor& t) {
                           return torch::nn::functional::cross_entropy(out, t);
                         });
    auto l = loss.detach().to(at::kDouble).reshape({1});
    rt.world()->allreduce(l, tandem::ReduceOp::kAvg);
    losses.push_back(l.item<double>());
  }
  return losses;
}

class ReplicaEngine : public ::testing::TestWithParam<std::string> {};

TEST_P(ReplicaEngine, TwoReplicasStepAsOneWorker) {
  tandem::ReplicaOptions one;
  one.replicas = 1;
  one.runtime.device = "cpu";
  std::vector<double> ref, got;
  tandem::run_replicas(one, [&](tandem::Runtime& rt) { ref = train_steps(rt, "single", 6); });
  tandem::ReplicaOptions two = one;
  two.replicas = 2;
  tandem::run_replicas(two, [&](tandem::Runtime& rt) {
    auto l = train_steps(rt, GetParam(), 6);
    if (rt.rank() == 0) got = l;
  });
  ASSERT_EQ(ref.size(), got.size());
  for (size_t s = 0; s < ref.size(); ++s) EXPECT_NEAR(got[s], ref[s], 1e-5) << "step " << s;
}

INSTANTIATE_TEST_SUITE_P(All, ReplicaEngine, ::testing::Values("ddp", "zero1", "zero2", "zero3"));

}  // namespace
