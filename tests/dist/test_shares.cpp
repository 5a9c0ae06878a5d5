// Unequal batch shares (tandem/shares.h): every rank takes a different number of samples of
// a global batch, weights its mean loss by share_loss_weight(), and the strategy's gradient
// average must then equal the gradient of the full batch on one process: checked on the
// gradients themselves for DDP, and through plain SGD steps (parameter = parameter - lr *
// gradient) for ZeRO-2, whose gradients are sharded.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tandem/data.h"
#include "tandem/ddp.h"
#include "tandem/shares.h"
#include "tandem/zero.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

torch::nn::Sequential make_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(13, 17), torch::nn::Tanh(), torch::nn::Linear(17, 4));
}

// Shares 1 : 2 : 3 : ... of a global batch B, and this rank's contiguous slice of it.
struct Slice {
  std::vector<int64_t> shares;
  int64_t offset = 0, count = 0;
};
Slice unequal_slice(int64_t B, int rank, int world) {
  std::vector<double> w;
  for (int r = 0; r < world; ++r) w.push_back(r + 1.0);
  Slice s;
  s.shares = data::apportion(w, B, 1);
  for (int r = 0; r < rank; ++r) s.offset += s.shares[r];
  s.count = s.shares[rank];
  return s;
}

at::Tensor weighted_loss(const at::Tensor& out, const at::Tensor& y, const Slice& s, int64_t B, int world) {
  return torch::nn::functional::cross_entropy(out, y) * share_loss_weight(s.count, B, world);
}

TEST(Shares, DdpWeightedGradientEqualsFullBatchGradient) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t B = 10 * R + 1;  // not a multiple of the world: shares are uneven anyway
  const auto s = unequal_slice(B, me, R);
  EXPECT_NE(s.shares.front(), s.shares.back());
  auto model = make_mlp(3 + me);  // DDP broadcasts rank 0's weights
  auto ref = make_mlp(3);
  DistributedDataParallel ddp(model.ptr(), comm);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = global_batch(B, 50 + step, 4);
    ref->zero_grad();
    torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
    ddp.prepare_forward();
    ddp.zero_grad();
    weighted_loss(model->forward(x.narrow(0, s.offset, s.count)), y.narrow(0, s.offset, s.count), s, B, R).backward();
    auto p = model->parameters(), rp = ref->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      EXPECT_LT(rel_err(p[i].grad(), rp[i].grad()), 1e-5) << "step " << step << " param " << i;
    }
    // Without the weight, the average of unequal means is not the full-batch gradient: the
    // test can tell the two apart.
    if (step == 0) {
      ddp.prepare_forward();
      ddp.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(x.narrow(0, s.offset, s.count)),
                                           y.narrow(0, s.offset, s.count))
          .backward();
      EXPECT_GT(rel_err(model->parameters()[0].grad(), rp[0].grad()), 1e-3) << "unweighted average";
    }
    torch::NoGradGuard ng;
    for (size_t i = 0; i < p.size(); ++i) {
      p[i].sub_(0.1 * rp[i].grad());  // the same update on both, from the reference gradient
      rp[i].sub_(0.1 * rp[i].grad());
    }
  }
}

TEST(Shares, Zero2WeightedStepEqualsFullBatchStep) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t B = 12 * R;
  const auto s = unequal_slice(B, me, R);
  auto net = make_mlp(9 + me);
  auto ref = make_mlp(9);
  ZeroOptions zo;
  zo.stage = 2;
  zo.bucket_cap_bytes = 256;  // several buckets
  zo.optimizer.kind = "sgd";
  zo.optimizer.lr = 0.1;
  zo.optimizer.momentum = 0.0;
  ZeroDataParallel zero(net.ptr(), comm, zo);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = global_batch(B, 70 + step, 4);
    std::vector<at::Tensor> before;
    for (auto& q : ref->parameters()) before.push_back(q.detach().clone());
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
    ref_opt.step();
    zero.prepare_forward();
    zero.zero_grad();
    weighted_loss(zero.forward(x.narrow(0, s.offset, s.count)), y.narrow(0, s.offset, s.count), s, B, R).backward();
    EXPECT_TRUE(zero.step());
    auto p = net->parameters(), rp = ref->parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      // The updates (lr * gradient) agree, not only the parameters they are small against.
      EXPECT_LT(rel_err(p[i] - before[i], rp[i] - before[i]), 1e-4) << "step " << step << " param " << i;
      EXPECT_LT(rel_err(p[i], rp[i]), 1e-5) << "step " << step << " param " << i;
    }
  }
}

}  // namespace
}  // namespace tandem::test
