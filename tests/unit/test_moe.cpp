// The sparse MoE block (tandem/moe.h) in one process, float64: outputs and every gradient against
// a naive per-token reference written from the formulas (router softmax, top-k, renormalised
// scores, SwiGLU experts), capacity drops on hand-checked routings, the injected auxiliary-loss
// gradients against autograd of the explicit losses (pooled, per-layer, z-loss, scaled), the
// statistics, and bad configurations.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "tandem/activation_checkpoint.h"
#include "tandem/moe.h"
#include "tests/unit/moe_test_util.h"

namespace tandem::test {
namespace {

using moe::MoeConfig;
using moe::SparseMoeBlock;

constexpr double kTol = 1e-10;

double rel(const at::Tensor& a, const at::Tensor& b) { return moe_rel(a, b); }

MoeConfig config(int64_t experts, int64_t k, int64_t hidden = 6, int64_t inter = 5) {
  return MoeConfig{hidden, inter, experts, k};
}

SparseMoeBlock block(const MoeConfig& c, const std::shared_ptr<moe::RouterLog>& log, int64_t layer, uint64_t seed) {
  return moe_block(c, log, layer, seed);
}

// A copy of `from`'s parameters in a block of config `c` (fresh, so its gradients are its own).
SparseMoeBlock copy_of(SparseMoeBlock from, const MoeConfig& c, const std::shared_ptr<moe::RouterLog>& log,
                       int64_t layer) {
  auto b = block(c, log, layer, 0);
  copy_moe_weights(from, b);
  return b;
}

at::Tensor swish(const at::Tensor& v) { return v / (1 + torch::exp(-v)); }

// The k largest of p (a 1-D tensor), by a sort on the host.
std::vector<int64_t> top_k(const at::Tensor& p, int64_t k) {
  std::vector<int64_t> idx(static_cast<size_t>(p.size(0)));
  std::iota(idx.begin(), idx.end(), 0);
  const auto v = p.detach();
  std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[a].item<double>() > v[b].item<double>(); });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

// Token by token: p = softmax(W_g x), the top k renormalised, y = sum_j s_j W2_j(silu(W1_j x) * W3_j x).
at::Tensor naive_block(SparseMoeBlock b, const at::Tensor& x) {
  const auto x2 = x.reshape({-1, b->config.hidden_size});
  std::vector<at::Tensor> ys;
  for (int64_t n = 0; n < x2.size(0); ++n) {
    const auto xn = x2[n];
    const auto z = torch::mv(b->gate->weight, xn);
    const auto e = torch::exp(z - z.max().detach());
    const auto p = e / e.sum();
    const auto sel = top_k(p, b->config.top_k);
    at::Tensor norm = torch::zeros({}, x.options());
    for (auto i : sel) norm = norm + p[i];
    at::Tensor y = torch::zeros_like(xn);
    for (auto i : sel) {
      const auto& ex = b->experts[static_cast<size_t>(i)]->as<moe::ExpertImpl>();
      const auto h = swish(torch::mv(ex->w1->weight, xn)) * torch::mv(ex->w3->weight, xn);
      y = y + (p[i] / norm) * torch::mv(ex->w2->weight, h);
    }
    ys.push_back(y);
  }
  return torch::stack(ys).reshape(x.sizes());
}

void expect_same_grads(SparseMoeBlock got, SparseMoeBlock want, double tol = kTol) {
  auto w = want->named_parameters();
  for (const auto& p : got->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    ASSERT_TRUE(w[p.key()].grad().defined()) << p.key();
    EXPECT_LE(rel(p.value().grad(), w[p.key()].grad()), tol) << p.key();
  }
}

TEST(MoeBlock, ParameterNamesAreMixtrals) {
  SparseMoeBlock b(config(3, 2), moe::make_router_log(1), 0);
  auto names = b->named_parameters().keys();
  std::sort(names.begin(), names.end());
  std::vector<std::string> want{"gate.weight"};
  for (int e = 0; e < 3; ++e)
    for (auto w : {"w1", "w2", "w3"}) want.push_back("experts." + std::to_string(e) + "." + w + ".weight");
  std::sort(want.begin(), want.end());
  EXPECT_EQ(names, want);
  EXPECT_EQ(b->gate->weight.sizes(), (std::vector<int64_t>{3, 6}));
  EXPECT_EQ(b->experts[0]->as<moe::ExpertImpl>()->w1->weight.sizes(), (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(b->experts[0]->as<moe::ExpertImpl>()->w2->weight.sizes(), (std::vector<int64_t>{6, 5}));
}

TEST(MoeBlock, OutputAndGradientsMatchNaiveReference) {
  for (auto [e, k] : std::vector<std::pair<int64_t, int64_t>>{{4, 2}, {3, 1}, {5, 3}}) {
    SCOPED_TRACE("experts " + std::to_string(e) + " top_k " + std::to_string(k));
    const auto c = config(e, k);
    auto b = block(c, moe::make_router_log(1), 0, 10 + e);
    auto ref = copy_of(b, c, moe::make_router_log(1), 0);
    const auto x0 = torch::randn({3, 5, 6}, torch::kDouble);
    const auto gy = torch::randn({3, 5, 6}, torch::kDouble);
    auto x = x0.clone().requires_grad_(true), xr = x0.clone().requires_grad_(true);
    const auto y = b->forward(x);
    const auto yr = naive_block(ref, xr);
    EXPECT_LE(rel(y, yr), kTol);
    (y * gy).sum().backward();
    (yr * gy).sum().backward();
    EXPECT_LE(rel(x.grad(), xr.grad()), kTol);
    expect_same_grads(b, ref);
  }
}

TEST(MoeBlock, ExpertThatGetsNoTokenHasZeroGradient) {
  const auto c = config(4, 2);
  auto b = block(c, moe::make_router_log(1), 0, 3);
  {
    torch::NoGradGuard no_grad;
    b->gate->weight[3].fill_(-10.0);  // x > 0 below: expert 3's logit is far below the others'
  }
  auto ref = copy_of(b, c, moe::make_router_log(1), 0);
  const auto x0 = torch::rand({7, 6}, torch::kDouble) + 0.5;
  auto x = x0.clone().requires_grad_(true), xr = x0.clone().requires_grad_(true);
  moe::reset_moe_stats();
  const auto y = b->forward(x);
  EXPECT_EQ(moe::moe_stats().tokens_per_expert[3], 0);
  EXPECT_LE(rel(y, naive_block(ref, xr)), kTol);
  y.sum().backward();
  naive_block(ref, xr).sum().backward();
  EXPECT_LE(rel(x.grad(), xr.grad()), kTol);
  const auto& idle = b->experts[3]->as<moe::ExpertImpl>();
  ASSERT_TRUE(idle->w1->weight.grad().defined()) << "an expert without tokens still gets a (zero) gradient";
  EXPECT_EQ(idle->w1->weight.grad().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(idle->w2->weight.grad().abs().sum().item<double>(), 0.0);
  EXPECT_LE(rel(b->gate->weight.grad(), ref->gate->weight.grad()), kTol);
}

TEST(MoeBlock, EmptyInputGivesEmptyOutput) {
  auto b = block(config(4, 2), moe::make_router_log(1), 0, 1);
  auto x = torch::zeros({0, 6}, torch::kDouble).requires_grad_(true);
  const auto y = b->forward(x);
  EXPECT_EQ(y.sizes(), x.sizes());
  y.sum().backward();
  EXPECT_EQ(x.grad().numel(), 0);
}

// A block with 2-dimensional hidden states whose gate picks experts by hand: logits = W x.
SparseMoeBlock hand_block(const MoeConfig& c, const std::vector<std::vector<double>>& gate) {
  auto b = block(c, moe::make_router_log(1), 0, 5);
  torch::NoGradGuard no_grad;
  for (size_t e = 0; e < gate.size(); ++e)
    for (size_t j = 0; j < gate[e].size(); ++j) b->gate->weight[e][j] = gate[e][j];
  return b;
}

at::Tensor expert_out(SparseMoeBlock b, int64_t e, const at::Tensor& x) {
  auto ex = b->experts[static_cast<size_t>(e)]->as<moe::ExpertImpl>();
  return ex->w2->forward(torch::silu(ex->w1->forward(x)) * ex->w3->forward(x));
}

TEST(MoeBlock, CapacityKeepsTheFirstTokensOfEachExpert) {
  // top-1 over 2 experts; expert = the larger coordinate. Tokens 0, 1, 2, 4 -> expert 0, 3, 5 ->
  // expert 1. Capacity ceil(1.0 * 6 * 1 / 2) = 3: token 4 (expert 0's fourth) is dropped.
  auto c = config(2, 1, 2, 3);
  c.capacity_factor = 1.0;
  auto b = hand_block(c, {{1, 0}, {0, 1}});
  const auto x = torch::tensor({{2., 1.}, {3., 1.}, {1., .5}, {1., 2.}, {4., 3.}, {.5, 1.}}, torch::kDouble);
  moe::reset_moe_stats();
  const auto y = b->forward(x);
  const auto s = moe::moe_stats();
  EXPECT_EQ(s.tokens_per_expert, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(s.routed, 6);
  EXPECT_EQ(s.dropped, 1);
  EXPECT_EQ(y[4].abs().sum().item<double>(), 0.0) << "the dropped token adds nothing";
  for (int64_t t : {0, 1, 2}) EXPECT_LE(rel(y[t], expert_out(b, 0, x[t])), kTol) << "token " << t;
  for (int64_t t : {3, 5}) EXPECT_LE(rel(y[t], expert_out(b, 1, x[t])), kTol) << "token " << t;

  // Capacity 2.0 -> 6 slots each: nothing dropped.
  c.capacity_factor = 2.0;
  auto roomy = copy_of(b, c, moe::make_router_log(1), 0);
  moe::reset_moe_stats();
  const auto y2 = roomy->forward(x);
  EXPECT_EQ(moe::moe_stats().dropped, 0);
  EXPECT_LE(rel(y2[4], expert_out(b, 0, x[4])), kTol);
}

TEST(MoeBlock, CapacityDropsEachSlotOnItsOwn) {
  // top-2 over 3 experts, every token picks experts 0 and 1 (logits x0, 0.9 x0, -x0), scores
  // softmax-renormalised. Capacity ceil(1.0 * 3 * 2 / 3) = 2: token 2 loses both slots.
  auto c = config(3, 2, 2, 3);
  c.capacity_factor = 1.0;
  auto b = hand_block(c, {{1, 0}, {0.9, 0}, {-1, 0}});
  const auto x = torch::tensor({{1., 0.3}, {2., -1.}, {3., 0.2}}, torch::kDouble);
  moe::reset_moe_stats();
  const auto y = b->forward(x);
  const auto s = moe::moe_stats();
  EXPECT_EQ(s.tokens_per_expert, (std::vector<int64_t>{3, 3, 0}));
  EXPECT_EQ(s.routed, 6);
  EXPECT_EQ(s.dropped, 2);
  EXPECT_EQ(y[2].abs().sum().item<double>(), 0.0);
  for (int64_t t : {0, 1}) {
    const double x0 = x[t][0].item<double>();
    const double s0 = 1.0 / (1.0 + std::exp(-0.1 * x0));  // e^{x0} / (e^{x0} + e^{0.9 x0})
    const auto want = s0 * expert_out(b, 0, x[t]) + (1 - s0) * expert_out(b, 1, x[t]);
    EXPECT_LE(rel(y[t], want), kTol) << "token " << t;
  }
}

TEST(MoeBlock, StatisticsCountTrainingForwardsOnceAlsoWhenRecomputed) {
  const auto c = config(4, 2);
  auto b = block(c, moe::make_router_log(1), 0, 2);
  const auto x = torch::randn({5, 6}, torch::kDouble);
  moe::reset_moe_stats();
  b->eval();
  b->forward(x);
  EXPECT_EQ(moe::moe_stats().routed, 0) << "evaluation is not counted";
  EXPECT_TRUE(moe::moe_stats().tokens_per_expert.empty());
  b->train();
  b->forward(x);
  EXPECT_EQ(moe::moe_stats().routed, 10);
  const auto once = moe::moe_stats().tokens_per_expert;
  EXPECT_EQ(std::accumulate(once.begin(), once.end(), int64_t{0}), 10);

  // Checkpointed: the first forward (without grad) counts, the recomputation in backward not.
  moe::reset_moe_stats();
  auto xc = x.clone().requires_grad_(true);
  auto y = checkpoint([&](const at::Tensor& in) { return b->forward(in); }, xc, b->parameters());
  y.sum().backward();
  EXPECT_EQ(moe::moe_stats().routed, 10);
  EXPECT_EQ(moe::moe_stats().tokens_per_expert, once);
}

// ---- auxiliary losses ------------------------------------------------------------------------

// What the test computes the losses from: the router logits of both layers, as transformers
// collects them (output_router_logits).
struct TwoLayers {
  at::Tensor y, logits0, logits1;
};

TwoLayers run_two(SparseMoeBlock b0, SparseMoeBlock b1, const at::Tensor& x) {
  const auto h = x + b0->forward(x);
  TwoLayers t;
  t.y = h + b1->forward(h);
  t.logits0 = torch::mm(x.reshape({-1, 6}), b0->gate->weight.t());
  t.logits1 = torch::mm(h.reshape({-1, 6}), b1->gate->weight.t());
  return t;
}

// Share of tokens that route one of their k slots to each expert, counted per layer.
at::Tensor routed_counts(const at::Tensor& logits, int64_t k, int64_t experts) {
  auto c = torch::zeros({experts}, logits.options());
  const auto p = torch::softmax(logits.detach(), -1);
  for (int64_t n = 0; n < p.size(0); ++n)
    for (auto e : top_k(p[n], k)) c[e] += 1;
  return c;
}

// transformers' load_balancing_loss_func over the given layers' logits.
at::Tensor pooled_aux(const std::vector<at::Tensor>& logits, int64_t k, int64_t experts) {
  at::Tensor counts = torch::zeros({experts}, logits[0].options()), probs = torch::zeros_like(counts);
  double rows = 0;
  for (const auto& l : logits) {
    counts = counts + routed_counts(l, k, experts);
    probs = probs + torch::softmax(l, -1).sum(0);
    rows += static_cast<double>(l.size(0));
  }
  return experts * (counts / rows * (probs / rows)).sum();
}

at::Tensor z_term(const at::Tensor& logits) { return torch::logsumexp(logits, -1).square().mean(); }

struct AuxCase {
  moe::AuxLossForm form;
  double aux_coef, z_coef, scale;
};

// Blocks with the auxiliary losses (injected) against copies without them whose test loss adds
// the explicit losses; every gradient and the recorded values.
void check_aux(const AuxCase& a) {
  auto c = config(4, 2);
  c.aux_form = a.form;
  c.aux_loss_coef = a.aux_coef;
  c.z_loss_coef = a.z_coef;
  auto log = moe::make_router_log(2);
  auto b0 = block(c, log, 0, 21), b1 = block(c, log, 1, 22);
  const auto plain = config(4, 2);
  auto r0 = copy_of(b0, plain, moe::make_router_log(2), 0);
  auto r1 = copy_of(b1, plain, r0->log, 1);
  const auto x0 = torch::randn({2, 5, 6}, torch::kDouble);
  const auto gy = torch::randn({2, 5, 6}, torch::kDouble);
  auto x = x0.clone().requires_grad_(true), xr = x0.clone().requires_grad_(true);

  moe::reset_moe_stats();
  moe::set_aux_grad_scale(a.scale);
  (run_two(b0, b1, x).y * gy).sum().backward();
  moe::set_aux_grad_scale(1.0);
  const auto stats = moe::moe_stats();

  const auto t = run_two(r0, r1, xr);
  const auto aux = a.form == moe::AuxLossForm::kPooled
                       ? pooled_aux({t.logits0, t.logits1}, 2, 4)
                       : (pooled_aux({t.logits0}, 2, 4) + pooled_aux({t.logits1}, 2, 4)) / 2;
  const auto z = (z_term(t.logits0) + z_term(t.logits1)) / 2;
  ((t.y * gy).sum() + a.scale * (a.aux_coef * aux + a.z_coef * z)).backward();

  EXPECT_LE(rel(x.grad(), xr.grad()), kTol);
  expect_same_grads(b0, r0);
  expect_same_grads(b1, r1);

  EXPECT_DOUBLE_EQ(stats.aux_loss_coef, a.aux_coef);
  EXPECT_DOUBLE_EQ(stats.z_loss_coef, a.z_coef);
  if (a.aux_coef > 0) {
    EXPECT_EQ(stats.aux_loss_terms, a.form == moe::AuxLossForm::kPooled ? 1 : 2);
    EXPECT_NEAR(stats.aux_loss_sum / static_cast<double>(stats.aux_loss_terms), aux.item<double>(), 1e-12);
  }
  if (a.z_coef > 0) {
    EXPECT_EQ(stats.z_loss_terms, 2);
    EXPECT_NEAR(stats.z_loss_sum / 2, z.item<double>(), 1e-12);
  }
}

TEST(MoeAuxLoss, PooledGradientIsThatOfTransformersLoss) { check_aux({moe::AuxLossForm::kPooled, 0.3, 0, 1}); }
TEST(MoeAuxLoss, PerLayerGradientIsTheLayersMean) { check_aux({moe::AuxLossForm::kPerLayer, 0.3, 0, 1}); }
TEST(MoeAuxLoss, ZLossGradient) { check_aux({moe::AuxLossForm::kPooled, 0, 0.2, 1}); }
TEST(MoeAuxLoss, BothScaledByTheMicroBatchWeight) {
  check_aux({moe::AuxLossForm::kPooled, 0.3, 0.2, 2.5});
  check_aux({moe::AuxLossForm::kPerLayer, 0.3, 0.2, 0.25});
}

TEST(MoeAuxLoss, InjectionChangesTheRouterGradient) {
  // Guards the comparison above: the same blocks without the losses give another gate gradient.
  auto c = config(4, 2);
  c.aux_loss_coef = 0.5;
  auto log = moe::make_router_log(1);
  auto b = block(c, log, 0, 4);
  auto plain = copy_of(b, config(4, 2), moe::make_router_log(1), 0);
  const auto x = torch::randn({6, 6}, torch::kDouble);
  b->forward(x).sum().backward();
  plain->forward(x).sum().backward();
  EXPECT_GT(rel(b->gate->weight.grad(), plain->gate->weight.grad()), 1e-3);
  EXPECT_LE(rel(b->experts[0]->as<moe::ExpertImpl>()->w1->weight.grad(),
                plain->experts[0]->as<moe::ExpertImpl>()->w1->weight.grad()),
            kTol);
}

TEST(MoeAuxLoss, CheckpointedLayersInjectTheSameGradient) {
  auto c = config(4, 2);
  c.aux_loss_coef = 0.3;
  c.z_loss_coef = 0.1;
  auto log = moe::make_router_log(2), log2 = moe::make_router_log(2);
  auto b0 = block(c, log, 0, 31), b1 = block(c, log, 1, 32);
  auto k0 = copy_of(b0, c, log2, 0), k1 = copy_of(b1, c, log2, 1);
  const auto x = torch::randn({7, 6}, torch::kDouble);
  moe::set_aux_grad_scale(2.0);
  const auto h = x + b0->forward(x);
  (h + b1->forward(h)).sum().backward();
  moe::reset_moe_stats();
  const auto hk = x + checkpoint([&](const at::Tensor& in) { return k0->forward(in); }, x, k0->parameters());
  const auto yk = hk + checkpoint([&](const at::Tensor& in) { return k1->forward(in); }, hk, k1->parameters());
  moe::set_aux_grad_scale(1.0);  // backward uses the scale of the forward
  yk.sum().backward();
  expect_same_grads(k0, b0);
  expect_same_grads(k1, b1);
  EXPECT_EQ(moe::moe_stats().aux_loss_terms, 1);
  EXPECT_EQ(moe::moe_stats().z_loss_terms, 2);
}

TEST(MoeAuxLoss, PooledNeedsEveryLayer) {
  auto c = config(4, 2);
  c.aux_loss_coef = 0.1;
  auto log = moe::make_router_log(3);
  auto last = block(c, log, 2, 1);
  try {
    last->forward(torch::randn({3, 6}, torch::kDouble));
    FAIL() << "expected an error";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("MoE layer 0 of 3"), std::string::npos) << e.what();
  }
}

TEST(MoeBlock, RefusesBadConstruction) {
  EXPECT_THROW(SparseMoeBlock(config(4, 2), nullptr, 0), std::invalid_argument);
  EXPECT_THROW(SparseMoeBlock(config(4, 2), moe::make_router_log(2), 2), std::invalid_argument);
  EXPECT_THROW(SparseMoeBlock(config(4, 5), moe::make_router_log(1), 0), std::invalid_argument);
  EXPECT_THROW(moe::make_router_log(0), std::invalid_argument);
  SparseMoeBlock b(config(4, 2), moe::make_router_log(1), 0);
  EXPECT_THROW(b->forward(torch::randn({3, 5})), std::invalid_argument);
}

}  // namespace
}  // namespace tandem::test
