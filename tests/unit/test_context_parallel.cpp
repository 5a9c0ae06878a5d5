// Context parallelism's pieces (tandem/context_parallel.h) on thread communicators: ring
// attention against whole causal attention in float64 (outputs and the gradients of q, k, v), on
// odd chunk, head and width sizes with grouped key/value heads; the layout and its refusal.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>

#include "tandem/backends.h"
#include "tandem/context_parallel.h"
#include "tests/unit/thread_ranks.h"

namespace {

using tandem::CommPtr;
using tandem::test::on_threads;
namespace cp = tandem::cp;

// softmax(q k^T / sqrt(D), causal) v over the whole sequence, each key/value head serving
// H / KV consecutive query heads: the definition, not the code under test.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const auto groups = q.size(1) / k.size(1), T = q.size(2);
  auto kk = k.repeat_interleave(groups, 1), vv = v.repeat_interleave(groups, 1);
  auto s = torch::matmul(q, kk.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  s = s.masked_fill(torch::ones({T, T}, torch::kBool).triu(1), -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(s, -1), vv);
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

struct Case {
  int C;
  int64_t B, H, KV, c, D;
};

void check_ring(const Case& k) {
  SCOPED_TRACE("C " + std::to_string(k.C) + ", H " + std::to_string(k.H) + ", KV " + std::to_string(k.KV) + ", chunk " +
               std::to_string(k.c) + ", D " + std::to_string(k.D));
  torch::manual_seed(7);
  const int64_t T = 2 * k.C * k.c;
  auto opts = torch::TensorOptions().dtype(torch::kDouble);
  auto q = torch::randn({k.B, k.H, T, k.D}, opts).requires_grad_();
  auto kk = torch::randn({k.B, k.KV, T, k.D}, opts).requires_grad_();
  auto v = torch::randn({k.B, k.KV, T, k.D}, opts).requires_grad_();
  auto w = torch::randn({k.B, k.H, T, k.D}, opts);  // the loss sum(out * w) weighs every output
  auto ref = causal_attention(q, kk, v);
  (ref * w).sum().backward();
  tandem::CommOptions o;
  o.timeout = std::chrono::milliseconds(30000);
  on_threads(tandem::make_thread_communicators(k.C, o), [&](const CommPtr& comm, int r) {
    auto part = [&](const torch::Tensor& t) { return cp::split_sequence(t.detach(), 2, r, k.C); };
    auto ql = part(q).requires_grad_(), kl = part(kk).requires_grad_(), vl = part(v).requires_grad_();
    auto out = cp::ring_attention(ql, kl, vl, comm);
    EXPECT_LT(max_diff(out, part(ref)), 1e-12) << "rank " << r;
    (out * part(w)).sum().backward();
    EXPECT_LT(max_diff(ql.grad(), part(q.grad())), 1e-12) << "rank " << r << ": dq";
    EXPECT_LT(max_diff(kl.grad(), part(kk.grad())), 1e-12) << "rank " << r << ": dk";
    EXPECT_LT(max_diff(vl.grad(), part(v.grad())), 1e-12) << "rank " << r << ": dv";
  });
}

TEST(ContextParallel, RingAttentionEqualsCausalAttentionInFloat64) {
  check_ring({1, 2, 2, 1, 3, 5});
  check_ring({2, 2, 3, 1, 3, 5});  // three query heads on one key/value head
  check_ring({3, 1, 4, 2, 1, 7});  // one-token chunks
  check_ring({4, 2, 6, 3, 5, 3});
}

TEST(ContextParallel, FloatInputsKeepTheirTypeAndMatch) {
  torch::manual_seed(3);
  const int C = 2;
  auto q = torch::randn({1, 2, 12, 4}), k = torch::randn({1, 2, 12, 4}), v = torch::randn({1, 2, 12, 4});
  auto ref = causal_attention(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble));
  on_threads(tandem::make_thread_communicators(C, {}), [&](const CommPtr& comm, int r) {
    auto out = cp::ring_attention(cp::split_sequence(q, 2, r, C), cp::split_sequence(k, 2, r, C),
                                  cp::split_sequence(v, 2, r, C), comm);
    EXPECT_EQ(out.scalar_type(), torch::kFloat);
    EXPECT_LT(max_diff(out.to(torch::kDouble), cp::split_sequence(ref, 2, r, C)), 1e-5);
  });
}

TEST(ContextParallel, LayoutPositionsAndGatherCoverTheSequenceOnce) {
  const int C = 3;
  const int64_t T = 18;
  auto x = torch::arange(2 * T, torch::kDouble).view({2, T}).requires_grad_();
  on_threads(tandem::make_thread_communicators(C, {}), [&](const CommPtr& comm, int r) {
    auto mine = cp::split_sequence(x.detach(), 1, r, C);
    // Chunks r and 2C-1-r of three tokens, and their global positions.
    auto pos = cp::positions(T / C, r, C);
    EXPECT_TRUE(torch::equal(mine[0].to(torch::kLong), pos)) << "rank " << r;
    EXPECT_EQ(pos[0].item<int64_t>(), 3 * r);
    EXPECT_EQ(pos[3].item<int64_t>(), 3 * (2 * C - 1 - r));
    auto part = mine.clone().requires_grad_();
    auto whole = cp::gather_sequence(part, 1, comm, /*grad_scale=*/2.0);
    EXPECT_TRUE(torch::equal(whole, x.detach()));
    // Every rank back-propagates the same loss; each keeps its tokens' share, scaled.
    auto g = torch::arange(2 * T, torch::kDouble).view({2, T});
    (whole * g).sum().backward();
    EXPECT_TRUE(torch::equal(part.grad(), 2.0 * cp::split_sequence(g, 1, r, C)));
  });
}

TEST(ContextParallel, LengthNotAMultipleOfTwiceCpIsRefusedWithTheRule) {
  try {
    cp::split_sequence(torch::zeros({1, 10}), 1, 0, 3);
    FAIL() << "a length of 10 over cp 3 was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("multiple of 6"), std::string::npos) << m;
    EXPECT_NE(m.find("10 tokens"), std::string::npos) << m;
  }
}

}  // namespace
