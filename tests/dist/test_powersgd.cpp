// PowerSGD as DDP's bucket reduction (tandem/ddp.h): at full rank it is DDP's exact average,
// error feedback keeps what a low rank leaves out, the tensors not worth compressing are averaged
// exactly in the same step, the bytes counted are those sent, and bad options are refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tandem/ddp.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

// A convolution (kernel [3, 2, 3, 3], compressed as 3 x 18) and linear layers with wide and tall
// weights: [6, 27] and [27, 6] (where P spans only part of each rank's column space), [5, 27].
torch::nn::Sequential conv_net(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Conv2d(2, 3, 3), torch::nn::Flatten(), torch::nn::Linear(27, 6),
                               torch::nn::Tanh(), torch::nn::Linear(6, 27), torch::nn::Tanh(),
                               torch::nn::Linear(27, 5));
}

std::pair<torch::Tensor, torch::Tensor> image_batch(int64_t n, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return {torch::randn({n, 2, 5, 5}, g), torch::randint(0, 5, {n}, g)};
}

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> g;
  for (auto& p : m.parameters()) g.push_back(p.grad().clone());
  return g;
}

// One step's gradients: DDP's from this rank's slice of (x, y), and one process's from all of it.
std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> step_grads(DistributedDataParallel& ddp,
                                                                             torch::nn::Sequential& model,
                                                                             torch::nn::Sequential& ref,
                                                                             const torch::Tensor& x,
                                                                             const torch::Tensor& y, int me, int R) {
  ref->zero_grad();
  torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
  ddp.prepare_forward();
  ddp.zero_grad();
  torch::nn::functional::cross_entropy(model->forward(slice_for_rank(x, me, R)), slice_for_rank(y, me, R)).backward();
  return {grads_of(*model), grads_of(*ref)};
}

// Bytes of one compressed step: the uncompressed tensors, plus (n + m) r per compressed matrix.
int64_t compressed_bytes(torch::nn::Module& m, int64_t rank, double rate) {
  int64_t n = 0;
  for (auto& p : m.parameters()) {
    if (p.dim() < 2) {
      n += p.numel();
      continue;
    }
    const int64_t rows = p.size(0), cols = p.numel() / rows, r = std::min({rank, rows, cols});
    n += (rows + cols) * r * rate < rows * cols ? (rows + cols) * r : p.numel();
  }
  return n * 4;
}

// With the rank of every matrix (r = min(n, m)) the projection P P^T is onto the whole column
// space of the average, so PowerSGD must give DDP's average gradient, step after step (warm start
// and residuals included). 1e-5 relative: what DDP's own test allows against one process (fp32
// sums in another order, ~1e-7), with room for the QR and the products, whose rounding is of the
// same order; a wrong scale, a missing rank's share or a stale Q is off by far more.
TEST(PowerSGD, FullRankEqualsTheAverageGradient) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto model = conv_net(20 + me);  // DDP broadcasts rank 0's weights
  auto ref = conv_net(20);
  DDPOptions o;
  o.powersgd = PowerSGDOptions{};
  o.powersgd->rank = 64;  // clipped to each matrix's min(n, m)
  o.powersgd->start_step = 0;
  o.powersgd->min_compression_rate = 0;  // compress every matrix, though full rank saves nothing
  o.bucket_cap_bytes = 1000;             // several buckets
  DistributedDataParallel ddp(model.ptr(), comm, o);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = image_batch(6 * R, 40 + step);
    auto [got, want] = step_grads(ddp, model, ref, x, y, me, R);
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_LT(rel_err(got[i], want[i]), 1e-5) << "step " << step << " param " << i;
    opt.step();
    ref_opt.step();
  }
  EXPECT_EQ(ddp.stats().bytes, 4 * compressed_bytes(*model, 64, 0));
}

// One weight whose gradient is a given random matrix per rank and step (loss = sum(W * G)):
// at rank 1 most of it is left out each step, and error feedback must carry it, so that the
// updates applied so far plus the ranks' mean residual are exactly the sum of the averages.
TEST(PowerSGD, ErrorFeedbackCarriesWhatRankOneLeavesOut) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto W = torch::nn::Linear(torch::nn::LinearOptions(12, 8).bias(false));
  DDPOptions o;
  o.powersgd = PowerSGDOptions{};
  o.powersgd->start_step = 0;
  DistributedDataParallel ddp(W.ptr(), comm, o);
  auto applied = torch::zeros({8, 12}, torch::kDouble), truth = torch::zeros({8, 12}, torch::kDouble);
  for (int step = 0; step < 6; ++step) {
    auto g = at::detail::createCPUGenerator(100 + step);
    auto all = torch::randn({R, 8, 12}, g);  // every rank's gradient, known to all
    truth += all.mean(0).to(torch::kDouble);
    ddp.prepare_forward();
    ddp.zero_grad();
    (W->weight * all[me]).sum().backward();
    applied += W->weight.grad().to(torch::kDouble);
  }
  auto res = ddp.powersgd_residuals();
  ASSERT_EQ(res.size(), 1u);
  ASSERT_TRUE(res[0].defined());
  auto mean_res = res[0].clone();
  comm->allreduce(mean_res, ReduceOp::kAvg);
  EXPECT_GT(rel_err(applied, truth), 0.1) << "rank 1 should leave much of a random 8 x 12 gradient out";
  EXPECT_GT(mean_res.norm().item<double>(), 0.1 * truth.norm().item<double>());
  EXPECT_LT(rel_err(applied + mean_res.to(torch::kDouble), truth), 1e-5);
  // P and Q of rank 1 per step, nothing else.
  EXPECT_EQ(ddp.stats().bytes, 6 * (8 + 12) * 4);
}

// Biases and a matrix too small to gain (2 x 16 at rank 1: 18 numbers against 32, under the
// default rate 2) are averaged exactly in the P all-reduce; the first start_step steps average
// everything as plain DDP does.
TEST(PowerSGD, SmallTensorsAndWarmupStepsAreExact) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto make = [](uint64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 2));
  };
  auto model = make(5), ref = make(5);
  DDPOptions o;
  o.powersgd = PowerSGDOptions{};
  o.powersgd->start_step = 2;
  DistributedDataParallel ddp(model.ptr(), comm, o);
  const int64_t dense_bytes = (16 * 16 + 16 + 2 * 16 + 2) * 4;
  for (int step = 0; step < 4; ++step) {
    auto g = at::detail::createCPUGenerator(70 + step);
    auto x = torch::randn({4 * R, 16}, g);
    auto y = torch::randint(0, 2, {4 * R}, g);
    ddp.reset_stats();
    auto [got, want] = step_grads(ddp, model, ref, x, y, me, R);
    for (size_t i = 1; i < got.size(); ++i)
      EXPECT_LT(rel_err(got[i], want[i]), 1e-5) << "step " << step << " param " << i;
    if (step < 2) {
      EXPECT_LT(rel_err(got[0], want[0]), 1e-5) << "warm-up step " << step;
      EXPECT_EQ(ddp.stats().bytes, dense_bytes);
    } else {
      if (R > 1) EXPECT_GT(rel_err(got[0], want[0]), 1e-3) << "the 16 x 16 weight at rank 1, step " << step;
      EXPECT_EQ(ddp.stats().bytes, dense_bytes - 16 * 16 * 4 + (16 + 16) * 4);
    }
  }
}

TEST(PowerSGD, BadOptionsAreRefused) {
  auto comm = world();
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 4));
  for (int64_t rank : {0, -2}) {
    DDPOptions o;
    o.powersgd = PowerSGDOptions{};
    o.powersgd->rank = rank;
    try {
      DistributedDataParallel ddp(net.ptr(), comm, o);
      ADD_FAILURE() << "rank " << rank << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("PowerSGD rank must be at least 1 (got " + std::to_string(rank)),
                std::string::npos)
          << e.what();
    }
  }
  DDPOptions both;
  both.powersgd = PowerSGDOptions{};
  both.compress_dtype = at::kBFloat16;
  EXPECT_THROW(DistributedDataParallel(net.ptr(), comm, both), std::invalid_argument);
}

}  // namespace
}  // namespace tandem::test
