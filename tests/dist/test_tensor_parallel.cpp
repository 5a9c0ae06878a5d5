// Tensor parallelism (tandem/tensor_parallel.h) against the dense layers, every rank of the world
// one tensor-parallel rank (run with 2 and 4): column/row-parallel linears, the transformer block
// (heads split), vocabulary-parallel embedding and cross-entropy, whole converted models; outputs
// and every gradient (this rank's shard of the dense gradient) in float64; bad sizes.
#include <cstring>
#include <gtest/gtest.h>
#include <set>
#include <torch/torch.h>

#include <algorithm>

#include "tandem/models.h"
#include "tandem/placement.h"
#include "tandem/tensor_parallel.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

constexpr double kTol = 1e-10;  // float64; the bar is 1e-5

at::Tensor rows(const at::Tensor& t, int64_t dim, int parts, int r) {
  const int64_t n = t.size(dim) / parts;
  return t.narrow(dim, r * n, n);
}

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  return torch::randn(shape, g, torch::kDouble);
}

TEST(TensorParallel, ColumnAndRowParallelLinearMatchDense) {
  auto tp = world();
  const int T = tp->size(), r = tp->rank();
  torch::manual_seed(1);
  torch::nn::Linear d1(12, 8), d2(8, 12);
  d1->to(torch::kDouble);
  d2->to(torch::kDouble);
  auto x0 = randn({5, 3, 12}, 2);
  auto gy = randn({5, 3, 12}, 3);

  // Dense reference: x -> d1 -> relu -> d2, upstream gradient gy.
  auto xd = x0.clone().requires_grad_(true);
  (d2->forward(torch::relu(d1->forward(xd))) * gy).sum().backward();

  // Column-parallel (split output) -> relu -> row-parallel (parallel input).
  tp::ColumnParallelLinear c1(d1, tp);
  tp::RowParallelLinear r2(d2, tp);
  auto xt = x0.clone().requires_grad_(true);
  auto yt = r2->forward(torch::relu(c1->forward(xt)));
  auto yd = d2->forward(torch::relu(d1->forward(x0)));
  EXPECT_LE(rel_err(yt, yd), kTol);
  (yt * gy).sum().backward();
  EXPECT_LE(rel_err(xt.grad(), xd.grad()), kTol) << "input gradient (all-reduced by copy_to_tp)";
  EXPECT_LE(rel_err(c1->weight.grad(), rows(d1->weight.grad(), 0, T, r)), kTol);
  EXPECT_LE(rel_err(c1->bias.grad(), rows(d1->bias.grad(), 0, T, r)), kTol);
  EXPECT_LE(rel_err(r2->weight.grad(), rows(d2->weight.grad(), 1, T, r)), kTol);
  EXPECT_LE(rel_err(r2->bias.grad(), d2->bias.grad()), kTol);

  // Gathered column output, and a row-parallel layer taking a replicated input.
  tp::ColumnParallelLinear cg(d1, tp, /*gather_output=*/true);
  EXPECT_LE(rel_err(cg->forward(x0), d1->forward(x0)), kTol);
  tp::RowParallelLinear rr(d2, tp, /*input_is_parallel=*/false);
  auto xr = randn({4, 8}, 4).requires_grad_(true);
  auto xr_d = xr.detach().clone().requires_grad_(true);
  auto w = randn({4, 12}, 5);
  (rr->forward(xr) * w).sum().backward();
  (d2->forward(xr_d) * w).sum().backward();
  EXPECT_LE(rel_err(xr.grad(), xr_d.grad()), kTol) << "scatter_to_tp backward (all-gather)";
}

TEST(TensorParallel, TransformerBlockMatchesDense) {
  auto tp = world();
  const int T = tp->size(), r = tp->rank();
  const int64_t D = 16, H = 4, B = 3, S = 5;
  torch::manual_seed(7);
  models::TransformerBlock dense(D, H, /*mlp_ratio=*/3);
  dense->to(torch::kDouble);
  torch::manual_seed(7);
  models::TransformerBlock copy(D, H, 3);
  copy->to(torch::kDouble);
  tp::ParallelTransformerBlock par(*copy, tp);
  EXPECT_EQ(par->attn->local_heads, H / T);

  auto x0 = randn({B, S, D}, 8);
  auto gy = randn({B, S, D}, 9);
  auto xd = x0.clone().requires_grad_(true);
  auto xp = x0.clone().requires_grad_(true);
  auto yd = dense->forward(xd);
  auto yp = par->forward(xp);
  EXPECT_LE(rel_err(yp, yd), kTol) << "block output";
  (yd * gy).sum().backward();
  (yp * gy).sum().backward();
  EXPECT_LE(rel_err(xp.grad(), xd.grad()), kTol) << "input gradient";
  // Replicated layer norms.
  EXPECT_LE(rel_err(par->ln1->weight.grad(), dense->ln1->weight.grad()), kTol);
  EXPECT_LE(rel_err(par->ln2->bias.grad(), dense->ln2->bias.grad()), kTol);
  // qkv: this rank's heads of q, k and v.
  const int64_t hd = D / H;
  const int64_t hl = H / T;
  auto qkv_w = dense->qkv->weight.grad().view({3, H, hd, D}).narrow(1, r * hl, hl).reshape({-1, D});
  auto qkv_b = dense->qkv->bias.grad().view({3, H, hd}).narrow(1, r * hl, hl).reshape({-1});
  EXPECT_LE(rel_err(par->attn->qkv->weight.grad(), qkv_w), kTol);
  EXPECT_LE(rel_err(par->attn->qkv->bias.grad(), qkv_b), kTol);
  EXPECT_LE(rel_err(par->attn->proj->weight.grad(), rows(dense->proj->weight.grad(), 1, T, r)), kTol);
  EXPECT_LE(rel_err(par->attn->proj->bias.grad(), dense->proj->bias.grad()), kTol);
  EXPECT_LE(rel_err(par->mlp->fc1->weight.grad(), rows(dense->fc1->weight.grad(), 0, T, r)), kTol);
  EXPECT_LE(rel_err(par->mlp->fc1->bias.grad(), rows(dense->fc1->bias.grad(), 0, T, r)), kTol);
  EXPECT_LE(rel_err(par->mlp->fc2->weight.grad(), rows(dense->fc2->weight.grad(), 1, T, r)), kTol);
  EXPECT_LE(rel_err(par->mlp->fc2->bias.grad(), dense->fc2->bias.grad()), kTol);
}

TEST(TensorParallel, VocabParallelEmbeddingAndCrossEntropyMatchDense) {
  auto tp = world();
  const int T = tp->size(), r = tp->rank();
  const int64_t V = 12, D = 6;
  torch::manual_seed(3);
  torch::nn::Embedding emb(V, D);
  emb->to(torch::kDouble);
  tp::VocabParallelEmbedding pemb(emb, tp);
  auto g = at::detail::createCPUGenerator(4);
  auto ids = torch::randint(0, V, {4, 7}, g);
  auto gy = randn({4, 7, D}, 5);
  (emb->forward(ids) * gy).sum().backward();
  auto out = pemb->forward(ids);
  EXPECT_LE(rel_err(out, emb->forward(ids).detach()), kTol);
  (out * gy).sum().backward();
  EXPECT_LE(rel_err(pemb->weight.grad(), rows(emb->weight.grad(), 0, T, r)), kTol);

  // Cross-entropy over vocabulary-split logits: loss and the logits' gradient shard.
  auto logits = randn({4, 7, V}, 6) * 3;
  auto tgt = torch::randint(0, V, {4, 7}, g);
  auto ld = logits.clone().requires_grad_(true);
  auto want =
      torch::nn::functional::cross_entropy(ld.reshape({-1, V}), tgt.reshape({-1}),
                                           torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  auto lp = rows(logits, 2, T, r).clone().requires_grad_(true);
  auto got = tp::vocab_parallel_cross_entropy(lp, tgt, tp);
  EXPECT_EQ(got.sizes(), tgt.sizes());
  EXPECT_LE(rel_err(got.reshape({-1}), want.detach()), kTol);
  want.mean().backward();
  got.mean().backward();
  EXPECT_LE(rel_err(lp.grad(), rows(ld.grad(), 2, T, r)), kTol);
}

at::Tensor ce(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
}

// models::transformer(c) in float64, initialised from `seed`.
torch::nn::Sequential double_transformer(const models::TransformerConfig& c, uint64_t seed) {
  torch::manual_seed(seed);
  auto m = models::transformer(c);
  m->to(torch::kDouble);
  return m;
}

TEST(TensorParallel, ConvertedTransformerMatchesDense) {
  auto tp = world();
  const auto c = small_lm();
  auto make = [&](uint64_t seed) { return double_transformer(c, seed); };
  auto g = at::detail::createCPUGenerator(12);
  auto ids = torch::randint(0, c.vocab, {3, 6}, g);
  auto tgt = torch::randint(0, c.vocab, {3, 6}, g);
  auto dense = make(5);
  auto want = ce(dense->forward(ids), tgt);
  want.backward();
  for (bool vocab_parallel : {false, true}) {
    SCOPED_TRACE(vocab_parallel ? "vocabulary-parallel head" : "gathered head");
    // Rank-dependent seeds: sync_dense makes every rank shard rank 0's weights.
    auto src = make(tp->rank() == 0 ? 5 : 100 + tp->rank());
    tp::TensorParallelOptions o;
    o.vocab_parallel_output = vocab_parallel;
    auto par = tp::tensor_parallel(src, tp, o);
    EXPECT_EQ(par->size(), dense->size());
    auto out = par->forward(ids);
    auto loss = vocab_parallel ? tp::vocab_parallel_cross_entropy(out, tgt, tp).mean() : ce(out, tgt);
    EXPECT_EQ(out.size(-1), vocab_parallel ? c.vocab / tp->size() : c.vocab);
    EXPECT_LE(std::abs(loss.item<double>() - want.item<double>()), kTol * want.item<double>());
    loss.backward();
    // Replicated parameters' gradients equal the dense ones; the sharded ones sum to the dense
    // gradient's norm over the ranks.
    auto dn = dense->named_parameters();
    EXPECT_LE(rel_err(par->named_parameters()["0.pos.weight"].grad(), dn["0.pos.weight"].grad()), kTol);
    EXPECT_LE(rel_err(par->named_parameters()["3.weight"].grad(), dn["3.weight"].grad()), kTol);
    double sq = 0, dense_sq = 0;
    for (auto& p : par->parameters()) sq += p.grad().pow(2).sum().item<double>();
    for (auto& p : dense->parameters()) dense_sq += p.grad().pow(2).sum().item<double>();
    // Replicated parameters count T times in the sum over ranks; correct for them.
    double rep = 0;
    for (auto& np : par->named_parameters()) {
      const auto& k = np.key();
      if (k.find("ln") != std::string::npos || k.find("pos") != std::string::npos || k.rfind("3.", 0) == 0 ||
          k.find("proj.bias") != std::string::npos || k.find("fc2.bias") != std::string::npos) {
        rep += np.value().grad().pow(2).sum().item<double>();
      }
    }
    auto t = at::tensor({sq - rep}, at::kDouble);
    tp->allreduce(t);
    EXPECT_LE(std::abs(t.item<double>() + rep - dense_sq), 1e-9 * dense_sq) << "sum of squared gradients";
  }
}

// Which parameters are shards (for a global gradient norm): by name, over the whole transformer
// and over a range of its children.
TEST(TensorParallel, PlacementsByKind) {
  auto tp = world();
  auto dense = double_transformer(small_lm(), 5);
  auto par = tp::tensor_parallel(double_transformer(small_lm(), 5), tp);
  auto placed = parameter_placements(*par, tp->rank());
  auto named = par->named_parameters();
  ASSERT_EQ(placed.size(), named.size());
  auto expect_shard = [](const std::string& n) {
    for (const char* k :
         {"tok.weight", "qkv.weight", "qkv.bias", "proj.weight", "fc1.weight", "fc1.bias", "fc2.weight"})
      if (n.size() >= std::strlen(k) && n.compare(n.size() - std::strlen(k), std::strlen(k), k) == 0) return true;
    return n.rfind("4.", 0) == 0;  // the LM head (after the final LayerNorm, 3), column-parallel
  };
  int shards = 0;
  std::set<std::string> dense_names;
  auto dn = dense->named_parameters();
  for (const auto& p : placed) {
    const bool shard = p.placement.local_shape != p.placement.global_shape;
    EXPECT_EQ(shard, expect_shard(p.name)) << p.name;
    EXPECT_EQ(p.placement.local_shape, named[p.name].sizes().vec()) << p.name;
    ASSERT_NE(dn.find(p.dense_name), nullptr) << p.name << " -> " << p.dense_name;
    EXPECT_EQ(p.placement.global_shape, dn[p.dense_name].sizes().vec()) << p.name;
    EXPECT_EQ(p.placement.replica, shard ? 0 : tp->rank()) << p.name;
    dense_names.insert(p.dense_name);
    shards += shard;
  }
  EXPECT_GT(shards, 0);
  EXPECT_EQ(dense_names.size(), dn.size()) << "every dense parameter is placed once";
}

// The whole values of `par`'s parameters, by dense name, from every tp rank's blocks (replica 0
// writes, the sum over tp assembles).
std::map<std::string, torch::Tensor> assembled(torch::nn::Module& par, const CommPtr& tp) {
  std::map<std::string, torch::Tensor> out;
  auto named = par.named_parameters();
  for (const auto& p : parameter_placements(par, tp->rank())) {
    auto whole = torch::zeros(p.placement.global_shape, named[p.name].options());
    if (p.placement.replica == 0) {
      auto flat = whole.view({-1});
      auto local = named[p.name].detach().reshape({-1});
      for (const auto& r : placement_runs(p.placement))
        flat.narrow(0, r.global, r.length).copy_(local.narrow(0, r.held, r.length));
    }
    tp->allreduce(whole, ReduceOp::kSum);
    out[p.dense_name] = whole;
  }
  return out;
}

// The padded transformer of `tandem pretrain/finetune` (mask channel, pooled classifier head)
// and the packed one of `tandem pretrain --data DIR` (position channel, attention within each
// document): the converted model computes the dense one's outputs, keeps a classification head
// replicated, and its placements give back the dense weights (what a checkpoint saves).
TEST(TensorParallel, PaddedTransformerMatchesDenseAndGathersBack) {
  auto tp = world();
  for (int64_t variant : {0, 3, -1}) {
    const int64_t classes = std::max<int64_t>(variant, 0);
    SCOPED_TRACE(variant > 0 ? "classifier" : variant == 0 ? "language model" : "packed language model");
    auto c = small_lm();
    if (variant >= 0) c.pad_id = 0;
    if (variant < 0) c.eos_id = 0;
    c.num_classes = classes;
    auto make = [&](uint64_t seed) { return double_transformer(c, seed); };
    auto g = at::detail::createCPUGenerator(21);
    auto ids = torch::randint(1, c.vocab, {3, 6}, g);
    // Right padding in two rows, or (packed) documents ending at positions 1 and 3, 4.
    ids.narrow(1, 4, 2).narrow(0, 0, 2).fill_(0);
    if (variant < 0) ids.select(1, 1).fill_(0);
    auto dense = make(5);
    auto want = dense->forward(ids);
    auto par = tp::tensor_parallel(make(tp->rank() == 0 ? 5 : 100 + tp->rank()), tp);
    auto head = par->ptr(par->size() - 1);
    EXPECT_EQ(head->as<torch::nn::LinearImpl>() != nullptr, classes > 0) << "a classification head stays replicated";
    EXPECT_LE(rel_err(par->forward(ids), want), kTol);
    auto bn = assembled(*par, tp);
    ASSERT_EQ(bn.size(), dense->named_parameters().size());
    for (auto& p : dense->named_parameters()) EXPECT_TRUE(torch::equal(bn.at(p.key()), p.value())) << p.key();
  }
}

TEST(TensorParallel, ConvertedMlpMatchesDense) {
  auto tp = world();
  auto make = [] {
    torch::manual_seed(9);
    auto m = models::mlp(13, {16, 8}, 5);  // Linear(13,16) relu Linear(16,8) relu Linear(8,5)
    m->to(torch::kDouble);
    return m;
  };
  auto dense = make();
  auto par = tp::tensor_parallel(make(), tp);
  EXPECT_TRUE(par->ptr(1)->as<tp::ColumnParallelLinearImpl>() != nullptr);
  EXPECT_TRUE(par->ptr(3)->as<tp::RowParallelLinearImpl>() != nullptr);
  EXPECT_TRUE(par->ptr(5)->as<torch::nn::LinearImpl>() != nullptr) << "odd last Linear stays replicated";
  auto [x, y] = global_batch(9, 3, 5);
  x = x.to(torch::kDouble);
  auto want = ce(dense->forward(x), y);
  auto got = ce(par->forward(x), y);
  EXPECT_LE(std::abs(got.item<double>() - want.item<double>()), kTol * want.item<double>());
  want.backward();
  got.backward();
  EXPECT_LE(rel_err(par->ptr(5)->as<torch::nn::LinearImpl>()->weight.grad(),
                    dense->ptr(5)->as<torch::nn::LinearImpl>()->weight.grad()),
            kTol);
  EXPECT_LE(rel_err(par->ptr(1)->as<tp::ColumnParallelLinearImpl>()->weight.grad(),
                    rows(dense->ptr(1)->as<torch::nn::LinearImpl>()->weight.grad(), 0, tp->size(), tp->rank())),
            kTol);
}

template <typename F>
void expect_invalid(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "did not throw std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    std::string msg = e.what();
    for (auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message \"" << msg << "\" lacks \"" << p << "\"";
  }
}

TEST(TensorParallel, SizesNotDivisibleByTpFailAtOnce) {
  auto tp = world();
  const std::string T = std::to_string(tp->size());
  auto c = small_lm();
  c.heads = 1;
  c.d_model = 15;  // 1 head: not divisible by 2 or 4
  expect_invalid([&] { tp::tensor_parallel(models::transformer(c), tp); },
                 {"number of attention heads (1)", "not divisible by the tensor-parallel size " + T});
  c = small_lm();
  c.vocab = 21;
  expect_invalid([&] { tp::tensor_parallel(models::transformer(c), tp); }, {"vocabulary (21)", "size " + T});
  expect_invalid([&] { tp::ParallelSelfAttention(torch::nn::Linear(6, 18), torch::nn::Linear(6, 6), 3, tp); },
                 {"attention heads (3)"});
  tp->barrier();  // nothing above communicated: everyone is still in step
}

}  // namespace
}  // namespace tandem::test
