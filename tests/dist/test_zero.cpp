// ZeroDataParallel (ZeRO stages 1, 2 and 3) against DistributedDataParallel with LibTorch's
// optimizer over the full model, run side by side on the same data: per-step losses,
// gradients (stage 1), parameters, clipping by the global norm, gradient accumulation, mixed
// precision and loss scaling, and the memory each rank holds against the ZeRO paper's model.
// Parameter counts are odd so that padding is exercised.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "tandem/ddp.h"
#include "tandem/engine.h"
#include "tandem/pipeline.h"
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

// The same network as a Sequential: three stage-3 units (the Linear children).
torch::nn::Sequential make_seq(uint64_t seed) {
  torch::manual_seed(seed);
  SmallNet n;  // the same initial values as make_net(seed)
  torch::nn::Sequential s(torch::nn::Linear(13, 9), torch::nn::Tanh(), torch::nn::Linear(9, 5), torch::nn::Tanh(),
                          torch::nn::Linear(5, 3));
  torch::NoGradGuard ng;
  auto src = n->parameters(), dst = s->parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  return s;
}

std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t n, uint64_t seed) {
  return test::global_batch(n, seed, 3);
}

std::unique_ptr<torch::optim::Optimizer> plain_optimizer(const ZeroOptimizerOptions& o,
                                                         std::vector<at::Tensor> params) {
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

// DDP (+ clip_grad_norm_ on the full gradients) and ZeRO side by side for `steps` steps.
void compare_with_ddp(int stage, const ZeroOptimizerOptions& oo, int64_t bucket_cap, double max_norm, int steps,
                      bool sequential = false) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t B = 6 * R;
  SCOPED_TRACE("stage " + std::to_string(stage) + ", " + oo.kind + ", bucket cap " + std::to_string(bucket_cap) +
               ", max_norm " + std::to_string(max_norm) + (sequential ? ", Sequential" : ", custom module"));
  // Different seeds per rank: both wrappers must start from rank 0's weights.
  auto ref = make_net(40 + me);
  std::shared_ptr<torch::nn::Module> net = sequential
                                               ? std::static_pointer_cast<torch::nn::Module>(make_seq(40 + me).ptr())
                                               : std::static_pointer_cast<torch::nn::Module>(make_net(40 + me).ptr());
  DistributedDataParallel ddp(ref.ptr(), comm);
  auto ref_opt = plain_optimizer(oo, ref->parameters());
  ZeroOptions zo;
  zo.stage = stage;
  zo.bucket_cap_bytes = bucket_cap;
  zo.max_grad_norm = max_norm;
  zo.optimizer = oo;
  ZeroDataParallel zero(net, comm, zo);
  if (stage == 3) EXPECT_EQ(zero.units(), sequential ? 3 : 1);
  auto run = [&](const torch::Tensor& x) {
    if (sequential) return zero.forward(x);
    zero.prepare_forward();  // stage 3: gathers the single unit
    return std::dynamic_pointer_cast<SmallNetImpl>(net)->forward(x);
  };
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
    auto loss = torch::nn::functional::cross_entropy(run(xs), ys);
    loss.backward();
    auto rp = ref->parameters(), zp = net->parameters();
    for (size_t i = 0; i < zp.size(); ++i) {
      if (stage == 1) {
        // Stage 1 keeps full-size gradients (reduced only in the chunk this rank owns).
        EXPECT_TRUE(zp[i].grad().defined()) << "param " << i;
      } else {
        EXPECT_FALSE(zp[i].grad().defined()) << "stage 2 keeps no full-size gradient (param " << i << ")";
      }
    }
    EXPECT_TRUE(zero.step());
    ref_opt->step();
    double a = loss.item<double>(), b = ref_loss.item<double>();
    EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(b)) << "loss at step " << step;
    if (max_norm > 0) EXPECT_NEAR(zero.last_grad_norm(), ref_norm, 1e-5 * ref_norm) << "step " << step;
  }
  if (stage == 3) {
    // Parameters are not resident between steps: one more forward gathers them; compare the
    // outputs (all ranks on the same input) with DDP's.
    auto [x, y] = global_batch(B, 4242);
    torch::NoGradGuard ng;
    EXPECT_LT(rel_err(run(x), ref->forward(x)), 1e-5) << "outputs after the steps";
    return;
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
  compare_with_ddp(1, sgd_momentum(), 100, 0.0, 20);      // one bucket per tensor
  compare_with_ddp(1, sgd_momentum(), 1 << 20, 0.0, 20);  // one bucket
}

TEST(Zero, Stage2MatchesDDPWithSgdMomentum) {
  compare_with_ddp(2, sgd_momentum(), 100, 0.0, 20);
  compare_with_ddp(2, sgd_momentum(), 1 << 20, 0.0, 20);
}

TEST(Zero, Stage1MatchesDDPWithAdamW) {
  compare_with_ddp(1, adamw(1e-2, 0.05), 100, 0.0, 20);
  compare_with_ddp(1, adamw(1e-2, 0.05), 1 << 20, 0.0, 20);
}

TEST(Zero, Stage2MatchesDDPWithAdamW) {
  compare_with_ddp(2, adamw(1e-2, 0.05), 100, 0.0, 20);
  compare_with_ddp(2, adamw(1e-2, 0.05), 1 << 20, 0.0, 20);
}

TEST(Zero, Stage3MatchesDDPWithSgdMomentum) {
  compare_with_ddp(3, sgd_momentum(), 100, 0.0, 20, /*sequential=*/true);   // three units
  compare_with_ddp(3, sgd_momentum(), 100, 0.0, 20, /*sequential=*/false);  // one unit
}

TEST(Zero, Stage3MatchesDDPWithAdamW) {
  compare_with_ddp(3, adamw(1e-2, 0.05), 100, 0.0, 20, /*sequential=*/true);
  compare_with_ddp(3, adamw(1e-2, 0.05), 100, 0.0, 20, /*sequential=*/false);
}

TEST(Zero, Stage1And2ThroughForwardOfASequential) {
  compare_with_ddp(1, adamw(1e-2, 0.05), 100, 0.0, 5, /*sequential=*/true);
  compare_with_ddp(2, adamw(1e-2, 0.05), 100, 0.0, 5, /*sequential=*/true);
}

TEST(Zero, ClippingMatchesDDPWithClipGradNorm) {
  compare_with_ddp(1, sgd_momentum(), 300, 0.05, 8);
  compare_with_ddp(2, sgd_momentum(), 300, 0.05, 8);
  compare_with_ddp(2, adamw(1e-2, 0.05), 1 << 20, 0.05, 8);
  compare_with_ddp(3, adamw(1e-2, 0.05), 1 << 20, 0.05, 8, /*sequential=*/true);
}

// Two backward passes on the halves of each rank's batch, then one step: the same update as
// one backward on the whole (the gradient is the mean of the two half-batch means).
TEST(Zero, GradientAccumulationMatchesOneBigBatch) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto big = make_seq(7), acc = make_seq(7);
    ZeroOptions zo;
    zo.stage = stage;
    zo.bucket_cap_bytes = 200;
    zo.optimizer = adamw(1e-2, 0.05);
    ZeroDataParallel zbig(big.ptr(), comm, zo), zacc(acc.ptr(), comm, zo);
    for (int step = 0; step < 6; ++step) {
      auto [x, y] = global_batch(8 * R, 300 + step);
      auto xs = slice_for_rank(x, me, R), ys = slice_for_rank(y, me, R);
      zbig.zero_grad();
      torch::nn::functional::cross_entropy(zbig.forward(xs), ys).backward();
      zbig.step();
      zacc.zero_grad();
      for (int h = 0; h < 2; ++h) {
        auto xh = xs.narrow(0, 4 * h, 4), yh = ys.narrow(0, 4 * h, 4);
        (torch::nn::functional::cross_entropy(zacc.forward(xh), yh) / 2).backward();
      }
      zacc.step();
    }
    auto [x, y] = global_batch(4, 99);
    torch::NoGradGuard ng;
    EXPECT_LT(rel_err(zacc.forward(x), zbig.forward(x)), 1e-5);
  }
}

// Stage 1 under no_sync(): the first half-batch's backward only accumulates (no
// reduce-scatter), the second reduce-scatters both; the same model as one batch, half the
// collectives. Stages 2 and 3 cannot defer and say so.
TEST(Zero, StageOneNoSyncReducesOnceAndMatchesOneBigBatch) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto big = make_seq(7), acc = make_seq(7);
  ZeroOptions zo;
  zo.stage = 1;
  zo.bucket_cap_bytes = 200;
  zo.optimizer = adamw(1e-2, 0.05);
  ZeroDataParallel zbig(big.ptr(), comm, zo), zacc(acc.ptr(), comm, zo);
  auto calls = [&] {
    auto st = comm->stats();
    auto it = st.find("reduce_scatter");
    return it == st.end() ? int64_t{0} : it->second.calls;
  };
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = global_batch(8 * R, 400 + step);
    auto xs = slice_for_rank(x, me, R), ys = slice_for_rank(y, me, R);
    zbig.zero_grad();
    const int64_t c0 = calls();
    torch::nn::functional::cross_entropy(zbig.forward(xs), ys).backward();
    const int64_t per_backward = calls() - c0;
    zbig.step();
    zacc.zero_grad();
    const int64_t c1 = calls();
    {
      auto quiet = zacc.no_sync();
      (torch::nn::functional::cross_entropy(zacc.forward(xs.narrow(0, 0, 4)), ys.narrow(0, 0, 4)) / 2).backward();
    }
    EXPECT_EQ(calls(), c1) << "a backward under no_sync() communicated";
    (torch::nn::functional::cross_entropy(zacc.forward(xs.narrow(0, 4, 4)), ys.narrow(0, 4, 4)) / 2).backward();
    EXPECT_EQ(calls() - c1, per_backward);
    zacc.step();
  }
  auto [x, y] = global_batch(4, 98);
  torch::NoGradGuard ng;
  EXPECT_LT(rel_err(zacc.forward(x), zbig.forward(x)), 1e-5);
  for (int stage : {2, 3}) {
    auto m = make_seq(7);
    ZeroOptions o2 = zo;
    o2.stage = stage;
    ZeroDataParallel z(m.ptr(), comm, o2);
    EXPECT_THROW(z.no_sync(), std::invalid_argument) << "stage " << stage;
  }
}

// Eight Linear(31, 31)-Tanh layers: eight stage-3 units, or eight buckets of kLayer elements.
constexpr int64_t kLayer = 31 * 31 + 31;
torch::nn::Sequential eight_layers() {
  torch::manual_seed(8);
  torch::nn::Sequential net;
  for (int l = 0; l < 8; ++l) {
    net->push_back(torch::nn::Linear(31, 31));
    net->push_back(torch::nn::Tanh());
  }
  return net;
}

// Stage 3 holds 1/N of the parameters between steps, and during forward and backward never
// more than a few units gathered at once (eight units; prefetch 1).
TEST(Zero, Stage3GathersAFewUnitsAtATime) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto net = eight_layers();
  const int64_t layer = kLayer, psi = 8 * layer;
  const int64_t unit_bytes = 4 * ((layer + R - 1) / R * R);
  ZeroOptions zo;
  zo.stage = 3;
  zo.prefetch = 1;
  zo.optimizer.kind = "sgd";
  zo.optimizer.lr = 0.01;
  ZeroDataParallel zero(net.ptr(), comm, zo);
  EXPECT_EQ(zero.units(), 8);
  auto x = torch::randn({2 * R, 31}, at::detail::createCPUGenerator(3));
  for (int s = 0; s < 2; ++s) {
    zero.zero_grad();
    zero.forward(slice_for_rank(x, me, R)).pow(2).mean().backward();
    zero.step();
  }
  auto m = zero.memory();
  EXPECT_EQ(m.parameter_bytes, 4 * zero.shard_numel()) << "only the shard is resident after a step";
  EXPECT_EQ(m.model_parameter_bytes, 4 * psi / R);
  EXPECT_GE(m.peak_gathered_bytes, 2 * unit_bytes) << "prefetch should overlap the next unit's gather";
  EXPECT_LE(m.peak_gathered_bytes, 3 * unit_bytes) << "a unit in use, one prefetched, one being freed at most";
  // Gathered units and gradient scratch come from one block allocated up front (symmetric
  // memory, so that the collectives on them run through shared memory), every one of them.
  EXPECT_GT(m.pool_bytes, 0);
  EXPECT_LE(m.pool_bytes, 2 * 8 * unit_bytes);
  EXPECT_EQ(m.pool_misses, 0);
  for (auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  // Evaluation without autograd gathers and frees as it goes, too.
  {
    torch::NoGradGuard ng;
    auto y = zero.forward(x);
    EXPECT_EQ(y.size(0), 2 * R);
  }
  EXPECT_EQ(zero.memory().parameter_bytes, 4 * zero.shard_numel());
}

// Mixed precision: the model computes in bf16 and the fp32 masters are sharded. The losses
// follow fp32 DDP's to bf16 accuracy, and the masters (not the bf16 copies) carry the updates:
// a learning rate too small to change a bf16 weight still moves the master.
TEST(Zero, Bf16FollowsFp32WithShardedMasters) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto ref = make_seq(11), net = make_seq(11);
    DistributedDataParallel ddp(ref.ptr(), comm);
    auto oo = adamw(1e-2, 0.05);
    auto ref_opt = plain_optimizer(oo, ref->parameters());
    ZeroOptions zo;
    zo.stage = stage;
    zo.bucket_cap_bytes = 300;
    zo.optimizer = oo;
    zo.precision = Precision::kBF16;
    ZeroDataParallel zero(net.ptr(), comm, zo);
    for (auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16);
    double worst = 0;
    for (int step = 0; step < 20; ++step) {
      auto [x, y] = global_batch(6 * R, 500 + step);
      auto xs = slice_for_rank(x, me, R), ys = slice_for_rank(y, me, R);
      ddp.zero_grad();
      auto rl = torch::nn::functional::cross_entropy(ref->forward(xs), ys);
      rl.backward();
      ref_opt->step();
      zero.zero_grad();
      auto zl = torch::nn::functional::cross_entropy(zero.forward(xs.to(at::kBFloat16)).to(at::kFloat), ys);
      zero.scale_loss(zl).backward();
      EXPECT_TRUE(zero.step());
      double a = zl.item<double>(), b = rl.item<double>();
      worst = std::max(worst, std::abs(a - b) / std::abs(b));
    }
    EXPECT_LT(worst, 0.03) << "bf16 losses drift from fp32's";
    auto m = zero.memory();
    EXPECT_EQ(m.master_bytes, 4 * zero.shard_numel());
    const int64_t psi = m.parameters;
    const double params = stage < 3 ? 2.0 * psi : 2.0 * psi / R;
    EXPECT_NEAR(m.parameter_bytes, params, 0.1 * params + 2 * R * 4);
    // AdamW in mixed precision: 12 bytes per parameter (master + 2 moments), sharded.
    EXPECT_EQ(m.model_optimizer_state_bytes, 12 * psi / R);
    EXPECT_NEAR(m.optimizer_state_bytes, 12.0 * psi / R, 0.1 * 12.0 * psi / R + 12 * 3 * R);

    // Tiny updates accumulate in the fp32 masters, below what a bf16 weight (8 bits of
    // mantissa) can register: the masters move, the model's outputs do not.
    for (auto& p : zero.optimizer().param_groups()[0].params()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    std::vector<torch::Tensor> before;
    for (auto& p : zero.optimizer().param_groups()[0].params()) before.push_back(p.detach().clone());
    auto [x, y] = global_batch(6 * R, 900);
    auto probe = [&] {
      torch::NoGradGuard ng;
      return zero.forward(x.to(at::kBFloat16)).to(at::kFloat);
    };
    auto out_before = probe();
    zero.set_lr(1e-7);
    for (int s = 0; s < 3; ++s) {
      zero.zero_grad();
      torch::nn::functional::cross_entropy(zero.forward(slice_for_rank(x, me, R).to(at::kBFloat16)).to(at::kFloat),
                                           slice_for_rank(y, me, R))
          .backward();
      zero.step();
    }
    double moved = 0;
    auto after = zero.optimizer().param_groups()[0].params();
    for (size_t i = 0; i < after.size(); ++i) moved += (after[i].detach() - before[i]).abs().sum().item<double>();
    EXPECT_GT(moved, 0.0) << "the fp32 masters must take the small updates";
    EXPECT_TRUE(torch::equal(probe(), out_before)) << "updates of ~1e-7 are below bf16's resolution";
  }
}

// fp16 dynamic loss scaling: an overflowing step is skipped on every rank (parameters
// unchanged) and the scale backs off; growth_interval good steps grow it again.
TEST(Zero, Fp16LossScalingSkipsOverflowAndRecovers) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto net = make_seq(12);
    ZeroOptions zo;
    zo.stage = stage;
    zo.optimizer = sgd_momentum();
    zo.precision = Precision::kFP16;
    zo.loss_scaler.init_scale = 1024.0;
    zo.loss_scaler.growth_interval = 3;
    ZeroDataParallel zero(net.ptr(), comm, zo);
    auto snapshot = [&] {
      torch::NoGradGuard ng;
      auto [x, y] = global_batch(4, 1);
      return zero.forward(x.to(at::kHalf)).to(at::kFloat);
    };
    auto [x, y] = global_batch(4 * R, 21);
    auto xs = slice_for_rank(x, me, R).to(at::kHalf), ys = slice_for_rank(y, me, R);
    // One rank's loss becomes inf: every rank must skip.
    auto out0 = snapshot();
    zero.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(zero.forward(xs).to(at::kFloat), ys);
    if (me == R - 1) loss = loss * std::numeric_limits<float>::infinity();
    zero.scale_loss(loss).backward();
    EXPECT_FALSE(zero.step());
    EXPECT_EQ(zero.loss_scaler().scale(), 512.0);
    EXPECT_EQ(zero.loss_scaler().skipped_steps(), 1);
    EXPECT_TRUE(torch::equal(snapshot(), out0)) << "a skipped step must not change the parameters";
    for (int s = 0; s < 3; ++s) {
      zero.zero_grad();
      zero.scale_loss(torch::nn::functional::cross_entropy(zero.forward(xs).to(at::kFloat), ys)).backward();
      EXPECT_TRUE(zero.step());
    }
    EXPECT_EQ(zero.loss_scaler().scale(), 1024.0) << "three good steps grow the scale back";
    EXPECT_FALSE(torch::equal(snapshot(), out0)) << "good steps change the parameters";
  }
}

// 64 -> 63 -> 10 (4735 parameters) with Adam: per-rank bytes against the paper's model and
// against plain Adam's state over the whole model.
TEST(Zero, MemoryFollowsTheModel) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  for (int stage : {1, 2, 3}) {
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
      torch::nn::functional::cross_entropy(zero.forward(slice_for_rank(x, me, R)), slice_for_rank(y, me, R)).backward();
      zero.step();
      plain_opt.zero_grad();
      torch::nn::functional::cross_entropy(plain->forward(x), y).backward();
      plain_opt.step();
    }
    auto m = zero.memory();
    EXPECT_EQ(m.parameters, psi);
    EXPECT_EQ(m.model_parameter_bytes, stage < 3 ? 4 * psi : 4 * psi / R);
    EXPECT_EQ(m.model_gradient_bytes, stage == 1 ? 4 * psi : 4 * psi / R);
    EXPECT_EQ(m.model_optimizer_state_bytes, 8 * psi / R);
    auto within = [](int64_t measured, double expected) { return std::abs(measured - expected) <= 0.1 * expected; };
    EXPECT_TRUE(within(m.parameter_bytes, stage < 3 ? 4.0 * psi : 4.0 * psi / R)) << m.parameter_bytes;
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
    if (stage >= 2) {
      for (auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
    }
    if (stage == 3) EXPECT_EQ(mine[0].item<int64_t>() / 2, 4 * zero.padded_numel());
  }
}

void scratch_within_buckets(int inflight) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto net = eight_layers();
  const int64_t layer = kLayer, psi = 8 * layer;
  ZeroOptions zo;
  zo.stage = 2;
  zo.bucket_cap_bytes = 4 * layer;  // one layer per bucket (bias and weight together)
  zo.max_inflight_buckets = inflight;
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
  EXPECT_LE(m.peak_scratch_bytes, (inflight + 1) * bucket_bytes);
  EXPECT_LT(m.peak_scratch_bytes, 4 * psi / 2);
  EXPECT_EQ(m.gradient_bytes, 4 * zero.shard_numel());  // the scratch is gone after backward
  EXPECT_GT(m.pool_bytes, 0);
  EXPECT_LE(m.pool_bytes, 4 * psi);
  EXPECT_EQ(m.pool_misses, 0) << "every bucket's scratch should come from the pool";
}

// Stage 2 keeps no full-size gradient buffer during backward either: eight layers of one
// bucket each, at most max_inflight_buckets reduce-scatters in flight plus the bucket filling
// (with 0, one bucket: each reduce-scatter finishes before the next bucket fills).
TEST(Zero, Stage2ScratchStaysWithinAFewBuckets) {
  for (int inflight : {2, 0}) {
    SCOPED_TRACE("max_inflight_buckets " + std::to_string(inflight));
    scratch_within_buckets(inflight);
  }
}

// The resident pages of every shared mapping of this process (MPI's segments and the symmetric
// blocks of every rank, which every rank maps), divided by the ranks: the node's shared memory
// per rank, whoever touched it.
int64_t shared_resident_per_rank(int ranks) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const int64_t page = sysconf(_SC_PAGESIZE);
  int64_t pages = 0;
  while (std::getline(maps, line)) {
    unsigned long lo = 0, hi = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %7s", &lo, &hi, perms) != 3 || perms[3] != 's') continue;
    std::vector<unsigned char> vec((hi - lo) / page);
    if (mincore(reinterpret_cast<void*>(lo), hi - lo, vec.data()) != 0) continue;
    for (auto v : vec) pages += v & 1;
  }
  return pages * page / ranks;
}

// Stages 2 and 3 hold no gradient from zero_grad() to the next backward (PyTorch's
// set_to_none), so forward's activations do not come on top of them. The pages of the shared
// block that backward's scratch touched go back after every backward: between steps only the
// part forward gathers units into stays resident (none for stage 2).
TEST(Zero, GradientsAndScratchPagesGoBetweenSteps) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  if (R < 2) GTEST_SKIP() << "the shared block needs 2 or more ranks";
  MemoryMeter::install();
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    torch::manual_seed(9);
    torch::nn::Sequential net;  // a bucket (stage 2) or a unit (stage 3) of 257 KiB per layer
    for (int l = 0; l < 6; ++l) {
      net->push_back(torch::nn::Linear(256, 256));
      net->push_back(torch::nn::Tanh());
    }
    ZeroOptions zo;
    zo.stage = stage;
    zo.bucket_cap_bytes = 4 * (256 * 256 + 256);
    zo.optimizer.kind = "sgd";
    zo.optimizer.lr = 0.01;
    ZeroDataParallel zero(net.ptr(), comm, zo);
    auto x = torch::randn({2 * R, 256}, at::detail::createCPUGenerator(4));
    const int64_t shared_before = shared_resident_per_rank(R);
    for (int s = 0; s < 2; ++s) {
      zero.prepare_forward();
      zero.zero_grad();
      zero.forward(slice_for_rank(x, me, R)).pow(2).mean().backward();
      zero.step();
    }
    comm->barrier();  // every rank's backward is over
    const auto m = zero.memory();
    EXPECT_EQ(m.pool_misses, 0);
    ASSERT_GT(m.peak_scratch_bytes, 0);
    const int64_t kept = shared_resident_per_rank(R) - shared_before;
    EXPECT_LE(kept, (stage == 3 ? m.peak_gathered_bytes : 0) + 64 * 1024)
        << "backward's scratch (" << m.peak_scratch_bytes << " bytes at its peak) stays resident";
    EXPECT_EQ(m.gradient_bytes, 4 * zero.shard_numel());
    const int64_t held = MemoryMeter::current_bytes();
    zero.zero_grad();
    EXPECT_GE(held - MemoryMeter::current_bytes(), 4 * zero.shard_numel()) << "zero_grad() keeps the gradient";
    EXPECT_EQ(zero.memory().gradient_bytes, 0);
  }
}

// set_model_parallel: ZeRO over the replicas of a split model clips by the whole model's norm.
// The world as a grid: replicas (dp) of 2 ranks on 4 ranks (1 on 2), and the other axis (the
// rest of the model) across them. As pipeline stages, each rank's dp-averaged squares are summed
// over that axis; as tensor-parallel ranks, only the parameters flagged sharded are (here l1's
// weight, its 117 elements spread over the chunks of two buckets of 64 bytes each at most), the
// rest counted once. Stages 1, 2 and 3.
TEST(Zero, ModelParallelNormSpansTheOtherAxes) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  if (R != 2 && R != 4) GTEST_SKIP() << "needs 2 or 4 ranks";
  const int dp_color = R == 4 ? me / 2 : me, mp_color = R == 4 ? me % 2 : 0;
  auto dp = comm->split(dp_color, me), mp = comm->split(mp_color, me);
  for (int stage : {1, 2, 3}) {
    for (bool as_tp : {false, true}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + (as_tp ? ", tp" : ", pp"));
      auto ref = make_net(60 + dp_color), net = make_net(60 + dp_color);
      auto [x, y] = global_batch(6, 300 + me);
      auto loss = torch::nn::functional::cross_entropy(ref->forward(x), y);
      loss.backward();
      // The reference: the replicas' average gradient, its squares split as the flags say.
      double other = 0, sharded = 0;
      auto rp = ref->parameters();
      for (size_t i = 0; i < rp.size(); ++i) {
        auto g = rp[i].grad().to(at::kDouble).contiguous();
        dp->allreduce(g, ReduceOp::kAvg);
        (as_tp && i == 0 ? sharded : other) += g.pow(2).sum().item<double>();
      }
      auto t = torch::tensor({sharded, other}, torch::kDouble);
      mp->allreduce(t, ReduceOp::kSum);
      const double want =
          as_tp ? std::sqrt(t[0].item<double>() + other) : std::sqrt(t[0].item<double>() + t[1].item<double>());
      ZeroOptions zo;
      zo.stage = stage;
      zo.bucket_cap_bytes = 64;  // several buckets, l1's weight alone in one
      zo.max_grad_norm = 1e-3;   // clips: the norm is computed every step
      zo.optimizer = sgd_momentum();
      ZeroDataParallel zero(net.ptr(), dp, zo);
      std::vector<bool> flags(net->parameters().size(), false);
      if (as_tp) flags[0] = true;
      EXPECT_THROW(zero.set_model_parallel(std::vector<bool>(flags.size() + 1, false), nullptr, nullptr),
                   std::invalid_argument);
      zero.set_model_parallel(flags, as_tp ? mp : nullptr, as_tp ? nullptr : mp);
      zero.prepare_forward();
      zero.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(x), y).backward();
      EXPECT_TRUE(zero.step());
      EXPECT_NEAR(zero.last_grad_norm(), want, 1e-6 * want);  // float32 gradients
    }
  }
}

// Initial values from a source under ZeRO-3 (EngineOptions::init_from): each rank is asked only
// for the flat ranges of its own shard, which together cover every parameter element exactly
// once over the ranks; the model then computes with the source's values (in bf16 too, whose fp32
// masters hold them exactly), and a parameter the source lacks keeps rank 0's values.
class CountingSource : public ParameterSource {
 public:
  std::map<std::string, at::Tensor> values;
  std::string lacks;                                // find() says it has no such parameter
  mutable std::map<std::string, at::Tensor> asked;  // per element: how often read() took it
  bool find(const std::string& name, std::vector<int64_t>* shape) const override {
    if (name == lacks || !values.count(name)) return false;
    if (shape) *shape = values.at(name).sizes().vec();
    return true;
  }
  void read(const std::string& name, int64_t first, at::Tensor dest) const override {
    EXPECT_EQ(dest.dim(), 1) << name;
    asked.at(name).narrow(0, first, dest.numel()).add_(1.0);
    dest.copy_(values.at(name).reshape({-1}).narrow(0, first, dest.numel()));
  }
};

TEST(Zero, Stage3InitFromReadsEachElementOnItsOwner) {
  auto comm = world();
  const int me = comm->rank();
  for (auto precision : {Precision::kFP32, Precision::kBF16}) {
    SCOPED_TRACE(precision_name(precision));
    auto net = make_seq(5), want = make_seq(5);
    auto source = std::make_shared<CountingSource>();
    source->lacks = "4.bias";
    {
      torch::NoGradGuard ng;
      for (auto& p : want->named_parameters()) {
        source->values[p.key()] = torch::randn_like(p.value()).to(at::kBFloat16).to(at::kFloat);  // exact in bf16
        source->asked[p.key()] = torch::zeros({p.value().numel()});
        if (p.key() != source->lacks) p.value().copy_(source->values[p.key()]);
      }
      if (me != 0) net[4]->as<torch::nn::Linear>()->bias.add_(1.0);  // rank 0's values win
    }
    ParallelConfig pc;
    pc.strategy = Strategy::kZero3;
    pc.precision = precision;
    EngineOptions eo;
    eo.init_from = source;
    Engine eng(runtime(), net, adamw(1e-2, 0.05), pc, eo);
    for (auto& [name, count] : source->asked) {
      comm->allreduce(count, ReduceOp::kSum);
      const double expect = name == source->lacks ? 0.0 : 1.0;
      EXPECT_TRUE(count.eq(expect).all().item<bool>()) << name << " asked " << count;
    }
    // The masters (fp32) hold the source's values exactly; the one it lacks, rank 0's.
    const auto full = eng.full_parameters();
    for (auto& p : want->named_parameters()) EXPECT_TRUE(torch::equal(full.at(p.key()), p.value())) << p.key();
    torch::NoGradGuard ng;
    const auto x = torch::randn({4, 13}, at::TensorOptions().dtype(at::kFloat));
    const auto got = eng.predict(x).to(at::kFloat), expected = want->forward(x);
    EXPECT_LT((got - expected).abs().max().item<double>(), precision == Precision::kBF16 ? 5e-2 : 1e-6);
  }
}

TEST(Zero, RejectsBadOptions) {
  auto comm = world();
  auto expect_invalid = [&](ZeroOptions zo, const std::string& what) {
    auto net = make_net(1);
    try {
      ZeroDataParallel z(net.ptr(), comm, zo);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_FALSE(std::string(e.what()).empty()) << what;
    }
  };
  ZeroOptions zo;
  zo.stage = 4;
  expect_invalid(zo, "stage 4");
  zo.stage = 0;
  expect_invalid(zo, "stage 0");
  zo = ZeroOptions();
  zo.optimizer.kind = "lion";
  expect_invalid(zo, "optimizer lion");
  zo = ZeroOptions();
  zo.optimizer.lr = -1;
  expect_invalid(zo, "negative lr");
  zo = ZeroOptions();
  zo.precision = Precision::kFP16;
  zo.loss_scaler.growth_factor = 0.5;
  expect_invalid(zo, "loss scale growth factor below 1");
  zo = ZeroOptions();
  zo.stage = 3;
  zo.prefetch = -1;
  expect_invalid(zo, "negative prefetch");
  zo = ZeroOptions();
  zo.stage = 2;
  zo.max_inflight_buckets = -2;
  expect_invalid(zo, "max_inflight_buckets below -1");
  // A double-precision model cannot train in bf16 with fp32 masters.
  zo = ZeroOptions();
  zo.precision = Precision::kBF16;
  auto dbl = make_net(1);
  dbl->to(at::kDouble);
  EXPECT_THROW(ZeroDataParallel(dbl.ptr(), comm, zo), std::invalid_argument);
  // forward() needs a Sequential.
  auto net = make_net(1);
  ZeroDataParallel z(net.ptr(), comm, ZeroOptions{});
  EXPECT_THROW(z.forward(torch::zeros({2, 13})), std::invalid_argument);
}

}  // namespace
}  // namespace tandem::test
