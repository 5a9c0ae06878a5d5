// ZeroDataParallel (ZeRO stages 1 and 2) against DistributedDataParallel with LibTorch's
// optimizer over the full model, run side by side on the same data: per-step losses,
// gradients (stage 1), parameters, clipping by the global norm, and the memory each rank
// holds against the ZeRO paper's model. Parameter counts are odd so that padding is exercised.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "tandem/ddp.h"
#include "tandem/zero.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

// 13 -> 9 -> 5 -> 3: 194 parameters (odd per tensor, not a multiple of 4 overall).
struct SmallNetImpl : torch::nn::Module {
  SmallNetImpl() {
    l1 = register_module("l1", torch::nn::Linear(13, 9));
    l2 = register_module("l2", torch::nn::Linear(9, 5));
    l3 = register_module("l3", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return l3->forward(torch::tanh(l2->forward(torch::tanh(l1->forward(x))))); }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
};
TORCH_MODULE(SmallNet);

SmallNet make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return SmallNet();
}

std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t n, uint64_t seed) {
  return test::global_batch(n, seed, 3);
}

std::unique_ptr<torch::optim::Optimizer> plain_optimizer(const ZeroOptimizerOptions& o, std::vector<at::Tensor> params) {
  if (o.kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
  }
  if (o.kind == "adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay));
  }
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
}

ZeroOptimizerOptions sgd_momentum() {
  ZeroOptimizerOptions o;
  o.kind = "sgd";
  o.lr = 0.1;
  o.momentum = 0.9;
  o.weight_decay = 1e-3;
  return o;
}

ZeroOptimizerOptions adamw() {
  ZeroOptimizerOptions o;
  o.kind = "adamw";
  o.lr = 1e-2;
  o.weight_decay = 0.05;
  return o;
}

// DDP (+ clip_grad_norm_ on the full gradients) and ZeRO side by side for `steps` steps.
void compare_with_ddp(int stage, const ZeroOptimizerOptions& oo, int64_t bucket_cap, double max_norm, int steps) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t B = 6 * R;
  SCOPED_TRACE("stage " + std::to_string(stage) + ", " + oo.kind + ", bucket cap " + std::to_string(bucket_cap) +
               ", max_norm " + std::to_string(max_norm));
  // Different seeds per rank: both wrappers must start from rank 0's weights.
  auto ref = make_net(40 + me);
  auto net = make_net(40 + me);
  DistributedDataParallel ddp(ref.ptr(), comm);
  auto ref_opt = plain_optimizer(oo, ref->parameters());
  ZeroOptions zo;
  zo.stage = stage;
  zo.bucket_cap_bytes = bucket_cap;
  zo.max_grad_norm = max_norm;
  zo.optimizer = oo;
  ZeroDataParallel zero(net.ptr(), comm, zo);
  EXPECT_EQ(zero.padded_numel() % R, 0);
  EXPECT_EQ(zero.shard_numel() * R, zero.padded_numel());
  EXPECT_GE(zero.padded_numel(), 194);
  bool clipped = false;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = global_batch(B, 1000 + step);
    auto xs = slice_for_rank(x, me, R), ys = slice_for_rank(y, me, R);
    ddp.prepare_forward();
    ddp.zero_grad();
    auto ref_loss = torch::nn::functional::cross_entropy(ref->forward(xs), ys);
    ref_loss.backward();
    double ref_norm = -1;
    if (max_norm > 0) ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm);
    if (ref_norm > max_norm) clipped = true;

    zero.prepare_forward();
    zero.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(xs), ys);
    loss.backward();
    auto rp = ref->parameters(), zp = net->parameters();
    for (size_t i = 0; i < zp.size(); ++i) {
      if (stage == 1) {
        // Stage 1 all-reduces: every rank holds the full averaged gradient (before clipping).
        if (max_norm <= 0) EXPECT_LT(rel_err(zp[i].grad(), rp[i].grad()), 1e-5) << "step " << step << " param " << i;
      } else {
        EXPECT_FALSE(zp[i].grad().defined()) << "stage 2 keeps no full-size gradient (param " << i << ")";
      }
    }
    zero.step();
    ref_opt->step();
    double a = loss.item<double>(), b = ref_loss.item<double>();
    EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(b)) << "loss at step " << step;
    if (max_norm > 0) EXPECT_NEAR(zero.last_grad_norm(), ref_norm, 1e-5 * ref_norm) << "step " << step;
  }
  auto rp = ref->parameters(), zp = net->parameters();
  for (size_t i = 0; i < zp.size(); ++i) EXPECT_LT(rel_err(zp[i], rp[i]), 1e-5) << "param " << i << " after the steps";
  // The ranks' replicas agree (the all-gather reached everyone): compare with rank 0's.
  for (auto& p : zp) {
    auto root = p.detach().clone();
    comm->broadcast(root, 0);
    EXPECT_TRUE(torch::equal(root, p.detach()));
  }
  if (max_norm > 0) EXPECT_TRUE(clipped) << "the test should make clipping active";
}

TEST(Zero, Stage1MatchesDDPWithSgdMomentum) {
  compare_with_ddp(1, sgd_momentum(), 100, 0.0, 20);        // one bucket per tensor
  compare_with_ddp(1, sgd_momentum(), 1 << 20, 0.0, 20);    // one bucket
}

TEST(Zero, Stage2MatchesDDPWithSgdMomentum) {
  compare_with_ddp(2, sgd_momentum(), 100, 0.0, 20);
  compare_with_ddp(2, sgd_momentum(), 1 << 20, 0.0, 20);
}

TEST(Zero, Stage1MatchesDDPWithAdamW) {
  compare_with_ddp(1, adamw(), 100, 0.0, 20);
  compare_with_ddp(1, adamw(), 1 << 20, 0.0, 20);
}

TEST(Zero, Stage2MatchesDDPWithAdamW) {
  compare_with_ddp(2, adamw(), 100, 0.0, 20);
  compare_with_ddp(2, adamw(), 1 << 20, 0.0, 20);
}

TEST(Zero, ClippingMatchesDDPWithClipGradNorm) {
  compare_with_ddp(1, sgd_momentum(), 300, 0.05, 8);
  compare_with_ddp(2, sgd_momentum(), 300, 0.05, 8);
  compare_with_ddp(2, adamw(), 1 << 20, 0.05, 8);
}

// 64 -> 63 -> 10 (4735 parameters) with Adam: per-rank bytes against the paper's model and
// against plain Adam's state over the whole model.
TEST(Zero, MemoryFollowsTheModel) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    torch::manual_seed(5);
    auto net = torch::nn::Sequential(torch::nn::Linear(64, 63), torch::nn::Tanh(), torch::nn::Linear(63, 10));
    torch::manual_seed(5);
    auto plain = torch::nn::Sequential(torch::nn::Linear(64, 63), torch::nn::Tanh(), torch::nn::Linear(63, 10));
    const int64_t psi = 64 * 63 + 63 + 63 * 10 + 10;
    ZeroOptions zo;
    zo.stage = stage;
    zo.bucket_cap_bytes = 4096;  // several buckets
    zo.optimizer.kind = "adam";
    ZeroDataParallel zero(net.ptr(), comm, zo);
    torch::optim::Adam plain_opt(plain->parameters(), torch::optim::AdamOptions(1e-3));
    auto [x, y] = global_batch(4 * R, 77);
    x = torch::randn({4 * R, 64}, at::detail::createCPUGenerator(78));
    for (int s = 0; s < 2; ++s) {
      zero.prepare_forward();
      zero.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(slice_for_rank(x, me, R)), slice_for_rank(y, me, R)).backward();
      zero.step();
      plain_opt.zero_grad();
      torch::nn::functional::cross_entropy(plain->forward(x), y).backward();
      plain_opt.step();
    }
    auto m = zero.memory();
    EXPECT_EQ(m.parameters, psi);
    EXPECT_EQ(m.model_parameter_bytes, 4 * psi);
    EXPECT_EQ(m.model_gradient_bytes, stage == 1 ? 4 * psi : 4 * psi / R);
    EXPECT_EQ(m.model_optimizer_state_bytes, 8 * psi / R);
    auto within = [](int64_t measured, double expected) { return std::abs(measured - expected) <= 0.1 * expected; };
    EXPECT_TRUE(within(m.parameter_bytes, 4.0 * psi)) << m.parameter_bytes;
    EXPECT_TRUE(within(m.gradient_bytes, stage == 1 ? 4.0 * psi : 4.0 * psi / R)) << m.gradient_bytes;
    EXPECT_TRUE(within(m.optimizer_state_bytes, 8.0 * psi / R)) << m.optimizer_state_bytes;
    // Independently: plain Adam over the whole model holds N times this rank's share.
    int64_t full_state = optimizer_state_bytes(plain_opt);
    EXPECT_EQ(full_state, 8 * psi);
    EXPECT_TRUE(within(m.optimizer_state_bytes * R, static_cast<double>(full_state))) << m.optimizer_state_bytes;
    // Every rank holds its share; together exactly the padded whole.
    auto mine = torch::tensor({m.optimizer_state_bytes, m.gradient_bytes}, torch::kLong);
    comm->allreduce(mine, ReduceOp::kSum);
    EXPECT_EQ(mine[0].item<int64_t>(), 8 * zero.padded_numel());
    EXPECT_EQ(mine[1].item<int64_t>(), (stage == 1 ? R : 1) * 4 * zero.padded_numel());
    if (stage == 2) {
      for (auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
    }
  }
}

// Stage 2 keeps no full-size gradient buffer during backward either: eight layers of one
// bucket each, at most max_inflight_buckets reduce-scatters in flight plus the bucket filling.
TEST(Zero, Stage2ScratchStaysWithinAFewBuckets) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  torch::manual_seed(8);
  torch::nn::Sequential net;
  for (int l = 0; l < 8; ++l) {
    net->push_back(torch::nn::Linear(31, 31));
    net->push_back(torch::nn::Tanh());
  }
  const int64_t layer = 31 * 31 + 31, psi = 8 * layer;
  ZeroOptions zo;
  zo.stage = 2;
  zo.bucket_cap_bytes = 4 * layer;  // one layer per bucket (bias and weight together)
  zo.max_inflight_buckets = 2;
  zo.optimizer.kind = "sgd";
  zo.optimizer.lr = 0.01;
  ZeroDataParallel zero(net.ptr(), comm, zo);
  auto x = torch::randn({2 * R, 31}, at::detail::createCPUGenerator(3));
  for (int s = 0; s < 2; ++s) {
    zero.prepare_forward();
    zero.zero_grad();
    net->forward(slice_for_rank(x, me, R)).pow(2).mean().backward();
    zero.step();
  }
  auto m = zero.memory();
  const int64_t bucket_bytes = 4 * ((layer + R - 1) / R * R);
  EXPECT_GT(m.peak_scratch_bytes, 0);
  EXPECT_LE(m.peak_scratch_bytes, 3 * bucket_bytes);
  EXPECT_LT(m.peak_scratch_bytes, 4 * psi / 2);
  EXPECT_EQ(m.gradient_bytes, 4 * zero.shard_numel());  // the scratch is gone after backward
}

TEST(Zero, RejectsBadOptions) {
  auto comm = world();
  auto net = make_net(1);
  ZeroOptions zo;
  zo.stage = 3;
  EXPECT_THROW(ZeroDataParallel(net.ptr(), comm, zo), std::invalid_argument);
  zo.stage = 1;
  zo.optimizer.kind = "lamb";
  EXPECT_THROW(ZeroDataParallel(net.ptr(), comm, zo), std::invalid_argument);
}

}  // namespace
}  // namespace tandem::test
