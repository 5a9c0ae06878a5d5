// The dp x tp x pp grid (tandem/grid.h) and the strategies composed on it, against
// single-process training in float64: tp=2 x dp=2 (DistributedDataParallel over the dp groups),
// pp=2 x dp=2 (Pipeline + average_gradients), tp=2 x pp=2 (tensor-parallel blocks inside
// pipeline stages); 10 SGD steps each on a global batch that every rank draws the same way.
// GradientAverager against the mean and against average_gradients.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tandem/ddp.h"
#include "tandem/grid.h"
#include "tandem/models.h"
#include "tandem/pipeline.h"
#include "tandem/tensor_parallel.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

TEST(Grid, LayoutAndGroups) {
  auto w = world();
  const int N = w->size();
  for (int tp = 1; tp <= N; ++tp) {
    for (int pp = 1; pp * tp <= N; ++pp) {
      if (N % (tp * pp) != 0) continue;
      SCOPED_TRACE("tp " + std::to_string(tp) + ", pp " + std::to_string(pp));
      ProcessGrid g(w, tp, pp);
      EXPECT_EQ(g.dp_size() * g.tp_size() * g.pp_size(), N);
      EXPECT_EQ(g.world_rank_of(g.dp_rank(), g.pp_rank(), g.tp_rank()), w->rank());
      // Each group holds exactly the ranks that differ only in its own coordinate, in order.
      auto check = [&](const CommPtr& c, int size, const std::function<int(int)>& member) {
        auto mine = at::full({1}, w->rank(), at::kLong);
        auto all = at::empty({size}, at::kLong);
        c->allgather(all, mine);
        for (int i = 0; i < size; ++i) EXPECT_EQ(all[i].item<int64_t>(), member(i)) << g.describe();
      };
      check(g.tp(), tp, [&](int i) { return g.world_rank_of(g.dp_rank(), g.pp_rank(), i); });
      check(g.pp(), pp, [&](int i) { return g.world_rank_of(g.dp_rank(), i, g.tp_rank()); });
      check(g.dp(), g.dp_size(), [&](int i) { return g.world_rank_of(i, g.pp_rank(), g.tp_rank()); });
    }
  }
  try {
    ProcessGrid g(w, N + 1, 1);
    ADD_FAILURE() << "tp larger than the world did not throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("does not divide the " + std::to_string(N) + " ranks"), std::string::npos)
        << e.what();
  }
}

models::TransformerConfig small_lm() {
  models::TransformerConfig c;
  c.vocab = 24;
  c.d_model = 16;
  c.heads = 4;
  c.layers = 2;
  c.seq = 6;
  c.mlp_ratio = 2;
  return c;
}

torch::nn::Sequential make_lm(uint64_t seed) {
  torch::manual_seed(seed);
  auto m = models::transformer(small_lm());
  m->to(torch::kDouble);
  return m;
}

at::Tensor ce(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
}

std::pair<at::Tensor, at::Tensor> lm_batch(int64_t n, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return {torch::randint(0, small_lm().vocab, {n, 6}, g), torch::randint(0, small_lm().vocab, {n, 6}, g)};
}

// Reference losses: the dense model, whole global batch, one process.
std::vector<double> reference_losses(torch::nn::Sequential ref, int steps, int64_t batch,
                                     std::pair<at::Tensor, at::Tensor> (*data)(int64_t, uint64_t)) {
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(0.5));
  std::vector<double> out;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = data(batch, 50 + s);
    opt.zero_grad();
    auto loss = ce(ref->forward(x), y);
    loss.backward();
    opt.step();
    out.push_back(loss.item<double>());
  }
  return out;
}

constexpr int kSteps = 10;
constexpr double kTol = 1e-9;  // float64; the bar is 1e-5

TEST(Grid, TensorParallelTimesDataParallelMatchesSingleProcess) {
  auto w = world();
  ASSERT_EQ(w->size(), 4) << "run on 4 ranks";
  ProcessGrid g(w, /*tp=*/2, /*pp=*/1);
  const int64_t B = 8;
  const auto want = reference_losses(make_lm(21), kSteps, B, lm_batch);
  tp::TensorParallelOptions o;
  o.vocab_parallel_output = true;
  auto net = tp::tensor_parallel(make_lm(21), g.tp(), o);
  DistributedDataParallel ddp(net.ptr(), g.dp());
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.5));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = lm_batch(B, 50 + s);
    x = slice_for_rank(x, g.dp_rank(), g.dp_size());
    y = slice_for_rank(y, g.dp_rank(), g.dp_size());
    ddp.prepare_forward();
    ddp.zero_grad();
    auto loss = tp::vocab_parallel_cross_entropy(net->forward(x), y, g.tp()).mean();
    loss.backward();
    opt.step();
    auto l = loss.detach().reshape({1}).clone();
    g.dp()->allreduce(l, ReduceOp::kAvg);
    EXPECT_LE(std::abs(l.item<double>() - want[s]), kTol * want[s]) << "step " << s << " (" << g.describe() << ")";
  }
}

std::pair<at::Tensor, at::Tensor> mlp_batch(int64_t n, uint64_t seed) {
  auto [x, y] = global_batch(n, seed, 5);
  return {x.to(torch::kDouble), y};
}

torch::nn::Sequential make_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(13, 17), torch::nn::Tanh(), torch::nn::Linear(17, 17), torch::nn::Tanh(),
                            torch::nn::Linear(17, 5));
  net->to(torch::kDouble);
  return net;
}

TEST(Grid, PipelineTimesDataParallelMatchesSingleProcess) {
  auto w = world();
  ASSERT_EQ(w->size(), 4) << "run on 4 ranks";
  ProcessGrid g(w, /*tp=*/1, /*pp=*/2);
  const int64_t B = 16;
  const auto want = reference_losses(make_mlp(5), kSteps, B, mlp_batch);
  PipelineOptions o;
  o.micro_batches = 4;
  o.schedule = PipelineSchedule::k1F1B;
  Pipeline pipe(make_mlp(5), g.pp(), o);
  torch::optim::SGD opt(pipe.parameters(), torch::optim::SGDOptions(0.5));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = mlp_batch(B, 50 + s);
    opt.zero_grad();
    auto loss =
        pipe.train_step(slice_for_rank(x, g.dp_rank(), g.dp_size()), slice_for_rank(y, g.dp_rank(), g.dp_size()), ce);
    average_gradients(pipe.parameters(), *g.dp());
    opt.step();
    auto l = loss.reshape({1}).clone();
    g.dp()->allreduce(l, ReduceOp::kAvg);
    EXPECT_LE(std::abs(l.item<double>() - want[s]), kTol * want[s]) << "step " << s << " (" << g.describe() << ")";
  }
}

// GradientAverager against the mean: over each dp group of a pp=2 grid and over the world, a
// float and a double group and a parameter without a gradient, three calls with different
// gradients (its buffers are kept between calls), all equal to average_gradients'.
TEST(Grid, GradientAveragerKeepsBuffersAndAverages) {
  auto w = world();
  ASSERT_EQ(w->size(), 4) << "run on 4 ranks";
  ProcessGrid g(w, /*tp=*/1, /*pp=*/2);
  for (const CommPtr& c : {g.dp(), w}) {
    SCOPED_TRACE("group of " + std::to_string(c->size()));
    std::vector<at::Tensor> params = {torch::zeros({3, 5}), torch::zeros({7}, torch::kDouble), torch::zeros({2, 2}),
                                      torch::zeros({4})};
    std::vector<at::Tensor> copies;
    for (auto& p : params) copies.push_back(p.clone());
    GradientAverager avg(params, c);
    // Gradient of parameter k on the rank of group rank r at call s; the last parameter has none.
    auto grad = [](const at::Tensor& p, int k, int r, int s) {
      return torch::arange(p.numel(), p.options()).reshape(p.sizes()) * (r + 1) + 10.0 * k + 100.0 * s;
    };
    for (int s = 0; s < 3; ++s) {
      for (size_t k = 0; k + 1 < params.size(); ++k) {
        params[k].mutable_grad() = grad(params[k], static_cast<int>(k), c->rank(), s);
        copies[k].mutable_grad() = params[k].grad().clone();
      }
      params.back().mutable_grad() = at::Tensor();
      copies.back().mutable_grad() = at::Tensor();
      avg.average();
      average_gradients(copies, *c);
      for (size_t k = 0; k < params.size(); ++k) {
        ASSERT_TRUE(params[k].grad().defined()) << "parameter " << k;
        at::Tensor want = torch::zeros_like(params[k]);
        if (k + 1 < params.size()) {
          for (int r = 0; r < c->size(); ++r) want += grad(params[k], static_cast<int>(k), r, s);
          want /= c->size();
        }
        EXPECT_TRUE(torch::allclose(params[k].grad(), want)) << "call " << s << ", parameter " << k;
        EXPECT_TRUE(torch::equal(params[k].grad(), copies[k].grad())) << "call " << s << ", parameter " << k;
      }
    }
  }
}

TEST(Grid, TensorParallelInsidePipelineStagesMatchesSingleProcess) {
  auto w = world();
  ASSERT_EQ(w->size(), 4) << "run on 4 ranks";
  ProcessGrid g(w, /*tp=*/2, /*pp=*/2);
  const int64_t B = 8;
  const auto want = reference_losses(make_lm(33), kSteps, B, lm_batch);
  auto net = tp::tensor_parallel(make_lm(33), g.tp());  // gathered logits: the usual loss
  PipelineOptions o;
  o.micro_batches = 2;
  o.partition = {2, 3};  // embedding + block | block, layer norm, head
  Pipeline pipe(net, g.pp(), o);
  torch::optim::SGD opt(pipe.parameters(), torch::optim::SGDOptions(0.5));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = lm_batch(B, 50 + s);
    opt.zero_grad();
    auto loss = pipe.train_step(x, y, ce);
    opt.step();
    EXPECT_LE(std::abs(loss.item<double>() - want[s]), kTol * want[s]) << "step " << s << " (" << g.describe() << ")";
  }
}

}  // namespace
}  // namespace tandem::test
