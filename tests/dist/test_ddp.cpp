// DistributedDataParallel against single-process training computed locally on every rank:
// each rank trains on its slice of a global batch with DDP, and separately computes the
// full-batch gradient of an identical model; the two must agree.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tandem/ddp.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

// Registration order differs from use order (b registered first, used last), so the
// gradient arrival order differs from reverse registration and buckets get rebuilt.
struct TwoPathImpl : torch::nn::Module {
  TwoPathImpl() {
    b = register_module("b", torch::nn::Linear(23, 5));
    a = register_module("a", torch::nn::Linear(13, 23));
    c = register_module("c", torch::nn::Linear(13, 13));
    unused = register_module("unused", torch::nn::Linear(3, 3));
  }
  torch::Tensor forward(torch::Tensor x, bool use_extra = false) {
    auto h = torch::tanh(c->forward(x));
    h = torch::relu(a->forward(h));
    auto out = b->forward(h);
    if (use_extra) out = out + unused->forward(torch::ones({x.size(0), 3})).sum(1, true);
    return out;
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr}, unused{nullptr};
};
TORCH_MODULE(TwoPath);

TwoPath make_model(uint64_t seed) {
  torch::manual_seed(seed);
  return TwoPath();
}

std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t n, uint64_t seed) {
  return test::global_batch(n, seed, 5);
}

// Reference: full batch on one process.
std::vector<torch::Tensor> reference_grads(TwoPath& m, const torch::Tensor& x, const torch::Tensor& y) {
  m->zero_grad();
  torch::nn::functional::cross_entropy(m->forward(x), y).backward();
  std::vector<torch::Tensor> g;
  for (auto& p : m->parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  return g;
}

TEST(DDP, GradientsAndTrajectoryMatchSingleProcess) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  const int64_t B = 12 * R;
  // Different seeds per rank: DDP must broadcast rank 0's weights.
  auto model = make_model(100 + me);
  auto ref = make_model(100);
  DDPOptions o;
  o.find_unused_parameters = true;
  o.bucket_cap_bytes = 600;  // several buckets
  o.first_bucket_bytes = 100;
  DistributedDataParallel ddp(model.ptr(), comm, o);
  EXPECT_GT(ddp.bucket_plan().size(), 2u);
  auto plan_before = ddp.bucket_plan();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < 5; ++step) {
    auto [x, y] = global_batch(B, 7 + step);
    auto rg = reference_grads(ref, x, y);
    ddp.prepare_forward();
    ddp.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(slice_for_rank(x, me, R)), slice_for_rank(y, me, R)).backward();
    auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (i == 6 || i == 7) continue;  // "unused" is not used here: zero on both sides
      ASSERT_TRUE(params[i].grad().defined()) << "step " << step << " param " << i;
      EXPECT_LT(rel_err(params[i].grad(), rg[i]), 1e-5) << "step " << step << " param " << i;
    }
    opt.step();
    ref_opt.step();
    auto rp = ref->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LT(rel_err(params[i], rp[i]), 1e-5) << "weights diverged at step " << step << " param " << i;
    }
  }
  // Gradients arrive c, a, b; registration was b, a, c: the plan was rebuilt from arrival.
  EXPECT_NE(ddp.bucket_plan(), plan_before);
  auto s = ddp.stats();
  EXPECT_EQ(s.steps, 5);
  EXPECT_GE(s.hidden_fraction(), 0.0);
  EXPECT_LE(s.hidden_fraction(), 1.0);
  int64_t param_bytes = 0;
  for (auto& p : model->parameters()) param_bytes += p.numel() * 4;
  EXPECT_EQ(s.bytes, 5 * param_bytes);
}

TEST(DDP, NoSyncAccumulatesThenAverages) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto model = make_model(5);
  auto ref = make_model(5);
  DDPOptions o;
  o.find_unused_parameters = true;
  DistributedDataParallel ddp(model.ptr(), comm, o);
  auto [x1, y1] = global_batch(6 * R, 1);
  auto [x2, y2] = global_batch(6 * R, 2);
  // Reference: the sum of the two micro-batches' mean-loss gradients.
  auto g1 = reference_grads(ref, x1, y1);
  auto g2 = reference_grads(ref, x2, y2);
  ddp.prepare_forward();
  {
    auto guard = ddp.no_sync();
    torch::nn::functional::cross_entropy(model->forward(slice_for_rank(x1, me, R)), slice_for_rank(y1, me, R))
        .backward();
  }
  ddp.prepare_forward();
  torch::nn::functional::cross_entropy(model->forward(slice_for_rank(x2, me, R)), slice_for_rank(y2, me, R)).backward();
  auto params = model->parameters();
  for (size_t i = 0; i < 6; ++i) EXPECT_LT(rel_err(params[i].grad(), g1[i] + g2[i]), 1e-5) << "param " << i;
}

TEST(DDP, UnusedParametersAreZeroWhenAllowedAndNamedOtherwise) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  {
    auto model = make_model(9);
    DDPOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel ddp(model.ptr(), comm, o);
    auto [x, y] = global_batch(4 * R, 3);
    ddp.prepare_forward();
    torch::nn::functional::cross_entropy(model->forward(slice_for_rank(x, me, R)), slice_for_rank(y, me, R)).backward();
    EXPECT_EQ(model->unused->weight.grad().abs().sum().item<double>(), 0.0);
    EXPECT_GT(model->a->weight.grad().abs().sum().item<double>(), 0.0);
  }
  {
    auto model = make_model(9);
    DistributedDataParallel ddp(model.ptr(), comm);
    auto [x, y] = global_batch(4 * R, 3);
    ddp.prepare_forward();
    try {
      torch::nn::functional::cross_entropy(model->forward(slice_for_rank(x, me, R)), slice_for_rank(y, me, R))
          .backward();
      ADD_FAILURE() << "backward with an unused parameter should have thrown";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("unused.weight"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("find_unused_parameters"), std::string::npos) << e.what();
    }
  }
}

TEST(DDP, Bf16CompressionStaysClose) {
  auto comm = world();
  const int R = comm->size(), me = comm->rank();
  auto model = make_model(11);
  auto ref = make_model(11);
  DDPOptions o;
  o.find_unused_parameters = true;
  o.compress_dtype = at::kBFloat16;
  DistributedDataParallel ddp(model.ptr(), comm, o);
  auto [x, y] = global_batch(8 * R, 4);
  auto rg = reference_grads(ref, x, y);
  ddp.prepare_forward();
  torch::nn::functional::cross_entropy(model->forward(slice_for_rank(x, me, R)), slice_for_rank(y, me, R)).backward();
  auto params = model->parameters();
  for (size_t i = 0; i < 6; ++i) {
    double e = rel_err(params[i].grad(), rg[i]);
    EXPECT_LT(e, 2e-2) << "param " << i;
    if (R > 1) EXPECT_GT(e, 0.0) << "bf16 on the wire should round something (param " << i << ")";
  }
  EXPECT_EQ(ddp.stats().bytes, [&] {
    int64_t n = 0;
    for (auto& p : model->parameters()) n += p.numel() * 2;
    return n;
  }());
}

TEST(DDP, BuffersFollowRankZero) {
  auto comm = world();
  const int me = comm->rank();
  torch::manual_seed(3);
  torch::nn::BatchNorm2d bnm(2);
  auto net = torch::nn::Sequential(torch::nn::Conv2d(1, 2, 3), bnm);
  DistributedDataParallel ddp(net.ptr(), comm);
  // Ranks drift apart (as local batch statistics would make them) ...
  bnm->running_mean.fill_(static_cast<double>(me + 1));
  ddp.prepare_forward();
  // ... and the next forward starts from rank 0's.
  EXPECT_EQ(bnm->running_mean.sum().item<double>(), 2.0);
}

TEST(DDP, DifferentModelsAreRejectedNamingTheParameter) {
  auto comm = world();
  const int me = comm->rank();
  if (comm->size() < 2) GTEST_SKIP();
  torch::manual_seed(1);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, me == 1 ? 6 : 5));
  try {
    DistributedDataParallel ddp(net.ptr(), comm);
    ADD_FAILURE() << "a model that differs on rank 1 should be rejected";
  } catch (const std::invalid_argument& e) {
    std::string m = e.what();
    if (me == 1) {
      EXPECT_NE(m.find("'0.weight'"), std::string::npos) << m;
      EXPECT_NE(m.find("[6, 4]"), std::string::npos) << m;
      EXPECT_NE(m.find("[5, 4]"), std::string::npos) << m;
    } else {
      EXPECT_NE(m.find("rank(s) 1"), std::string::npos) << m;
    }
  }
}

}  // namespace
}  // namespace tandem::test
