// ZeRO-3 with a unit per block on the 8-block transformer (models::transformer, a Sequential:
// embedding, 8 blocks, final LayerNorm and head are the units) through the Engine: losses follow
// DDP on the same ranks, at most three units are gathered at once, and a checkpoint saved on N
// workers resumes on another count (4 -> 2, 2 -> 1) continuing the uninterrupted run. Units
// chosen by a WrapPolicy (the blocks by type, path or size) follow DDP too, with the gathered peak
// following the units chosen, and every bad policy is refused naming what is wrong.
// The model has no dropout (TransformerConfig has none), so every layout computes one function.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>

#include "checkpoint/shard_io.h"
#include "tandem/engine.h"
#include "tandem/models.h"
#include "tandem/wrap_policy.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

constexpr int64_t kRows = 8;  // sequences per global batch: splits over 1, 2 and 4 workers
constexpr int kSteps = 10;

models::TransformerConfig eight_blocks() {
  models::TransformerConfig c;
  c.vocab = 32;
  c.d_model = 16;
  c.heads = 2;
  c.layers = 8;
  c.seq = 12;
  c.mlp_ratio = 2;
  return c;
}

torch::nn::Sequential make_lm(uint64_t seed) {
  torch::manual_seed(seed);
  return models::transformer(eight_blocks());
}

ParallelConfig with(Strategy s) {
  ParallelConfig c;
  c.strategy = s;
  return c;
}

const LossFn kNextToken = [](const at::Tensor& logits, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
};

// Global-batch losses of steps [first, first + n): step s trains on ids drawn from seed s,
// targets the ids shifted by one; each worker takes its rows.
std::vector<double> train(Engine& eng, int first, int n) {
  const auto c = eight_blocks();
  const int world = eng.world_size(), rank = eng.world()->rank();
  std::vector<double> out;
  for (int s = first; s < first + n; ++s) {
    auto g = at::detail::createCPUGenerator(1000 + s);
    auto ids = torch::randint(0, c.vocab, {kRows, c.seq + 1}, g);
    auto x = ids.narrow(1, 0, c.seq), y = ids.narrow(1, 1, c.seq);
    auto loss = eng.step(slice_for_rank(x, rank, world), slice_for_rank(y, rank, world), kNextToken);
    auto l = loss.detach().reshape({1}).clone();
    eng.world()->allreduce(l, ReduceOp::kAvg);
    out.push_back(l.item<double>());
  }
  return out;
}

int64_t fp32_bytes(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel() * 4;
  return n;
}

// The ZeRO-3 run: losses follow DDP's on the same workers, and the gathered peak stays within
// three units. Forward holds the running unit and the prefetched next one; backward holds the
// unit whose gradient is being computed, the previous one prefetched, and the one after it until
// its last gradient is taken; so three units at most, never the whole model. The bound is the
// three largest units' bytes (three blocks here: a block outweighs the embedding and the head)
// plus each unit's padding to a multiple of the workers.
TEST(Zero3Transformer, FollowsDdpWithinThreeUnitsAndResumesOnOtherCounts) {
  const int N = world()->size(), rank = world()->rank();
  std::vector<double> ddp;
  {
    Engine eng(runtime(), make_lm(5), adamw(3e-3), with(Strategy::kDDP));
    ddp = train(eng, 0, kSteps);
  }
  const std::string root = shared_dir(*world(), "zero3_lm");
  std::vector<double> zero3;
  {
    auto lm = make_lm(5);
    std::vector<int64_t> units;
    for (const auto& child : lm->children()) {
      if (!child->parameters().empty()) units.push_back(fp32_bytes(*child));
    }
    ASSERT_EQ(units.size(), 11u);  // embedding, 8 blocks, final LayerNorm, head
    const int64_t whole = fp32_bytes(*lm), block = fp32_bytes(*lm->ptr(1));
    std::sort(units.rbegin(), units.rend());
    const int64_t bound = units[0] + units[1] + units[2] + 3 * 4 * N;
    EXPECT_EQ(units[0], block) << "a block is no longer the largest unit: the bound below is not three blocks";

    Engine eng(runtime(), lm, adamw(3e-3), with(Strategy::kZero3));
    zero3 = train(eng, 0, kSteps / 2);
    CheckpointMeta m;
    m.step = kSteps / 2;
    eng.save(root, m);
    const auto rest = train(eng, kSteps / 2, kSteps / 2);
    zero3.insert(zero3.end(), rest.begin(), rest.end());
    const int64_t peak = eng.stats().memory.peak_gathered_bytes;
    EXPECT_GE(peak, 2 * block) << "the next unit was not prefetched";
    EXPECT_LE(peak, bound) << "whole model " << whole << " bytes, a block " << block;
    if (rank == 0) {
      std::printf("[ zero3 lm ] %d workers: gathered peak %lld bytes, 3 blocks %lld, whole model %lld\n", N,
                  static_cast<long long>(peak), static_cast<long long>(3 * block), static_cast<long long>(whole));
    }
  }
  ASSERT_EQ(zero3.size(), ddp.size());
  for (int i = 0; i < kSteps; ++i) EXPECT_NEAR(zero3[i], ddp[i], 1e-5) << "step " << i;
  EXPECT_LT(ddp.back(), ddp.front()) << "the model does not train: a weak comparison";

  // Resume on half the workers (one when N is 2), from other initial values: everything the
  // continuation needs must come from the checkpoint.
  const int M = std::max(1, N / 2);
  if (auto part = world()->split(rank < M ? 0 : -1, rank)) {
    Runtime rt = runtime_over(part);
    Engine eng(rt, make_lm(99), adamw(3e-3), with(Strategy::kZero3));
    const auto meta = eng.load(root);
    EXPECT_EQ(meta.step, kSteps / 2);
    EXPECT_EQ(meta.world_size, N);
    const auto resumed = train(eng, kSteps / 2, kSteps / 2);
    for (int i = 0; i < kSteps / 2; ++i) {
      EXPECT_NEAR(resumed[i], zero3[kSteps / 2 + i], 1e-5) << "resumed on " << M << " of " << N << ", step " << i;
    }
  }
  world()->barrier();
  if (rank == 0) ckpt::remove_tree(root);
}

// The blocks as units by each rule; the embedding, final LayerNorm and head form the root unit,
// gathered through the step. Parameter names are the Sequential's (checkpoints keep them).
WrapPolicy blocks_by(const std::string& rule, int64_t block_params) {
  WrapPolicy p;
  if (rule == "type") p.types = {"TransformerBlock"};
  if (rule == "size") p.min_parameters = block_params;
  if (rule == "path") {
    for (int i = 1; i <= 8; ++i) p.paths.push_back(std::to_string(i));
  }
  return p;
}

std::vector<std::string> names_of(torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& kv : m.named_parameters()) out.push_back(kv.key());
  return out;
}

// The root (embedding, final LayerNorm, head) stays gathered through the step; besides it the
// running block and the prefetched one, three blocks at most as above. Blocks 1-4 alone as units
// leave blocks 5-8 in the root: a higher peak.
TEST(Zero3WrapPolicy, BlockUnitsByTypePathOrSizeFollowDdp) {
  const int N = world()->size();
  std::vector<double> ddp;
  {
    Engine eng(runtime(), make_lm(5), adamw(3e-3), with(Strategy::kDDP));
    ddp = train(eng, 0, 6);
  }
  auto plain = make_lm(5);
  const int64_t block = fp32_bytes(*plain->ptr(1)), whole = fp32_bytes(*plain);
  const int64_t root = fp32_bytes(*plain->ptr(0)) + fp32_bytes(*plain->ptr(9)) + fp32_bytes(*plain->ptr(10));
  const std::vector<std::string> blocks{"1", "2", "3", "4", "5", "6", "7", "8"};
  int64_t peak_blocks = 0;
  for (const std::string rule : {"type", "path", "size"}) {
    auto wrapped = apply_wrap_policy(make_lm(5), blocks_by(rule, block / 4));
    EXPECT_EQ(wrapped->units(), blocks) << rule;
    EXPECT_EQ(names_of(*wrapped), names_of(*plain)) << rule;
    Engine eng(runtime(), wrapped, adamw(3e-3), with(Strategy::kZero3));
    const auto got = train(eng, 0, 6);
    for (size_t i = 0; i < ddp.size(); ++i) EXPECT_NEAR(got[i], ddp[i], 1e-5) << rule << ", step " << i;
    peak_blocks = eng.stats().memory.peak_gathered_bytes;
    EXPECT_GE(peak_blocks, root + block) << rule;
    EXPECT_LE(peak_blocks, root + 3 * block + 9 * 4 * N) << rule << ": root " << root << ", a block " << block;
    EXPECT_LT(peak_blocks, whole) << rule;
  }
  WrapPolicy half;
  half.paths = {"1", "2", "3", "4"};
  Engine eng(runtime(), apply_wrap_policy(make_lm(5), half), adamw(3e-3), with(Strategy::kZero3));
  const auto got = train(eng, 0, 6);
  for (size_t i = 0; i < ddp.size(); ++i) EXPECT_NEAR(got[i], ddp[i], 1e-5) << "blocks 1-4, step " << i;
  EXPECT_GE(eng.stats().memory.peak_gathered_bytes, root + 4 * block) << "blocks 5-8 belong to the root unit";
  EXPECT_GT(eng.stats().memory.peak_gathered_bytes, peak_blocks);
}

// A user module keeping its layers in a ModuleList: its entries are not children of the Sequential.
struct ListBlockImpl : torch::nn::Module {
  ListBlockImpl() {
    body = register_module("body", torch::nn::ModuleList(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& m : *body) x = m->as<torch::nn::Linear>()->forward(x);
    return x;
  }
  torch::nn::ModuleList body{nullptr};
};
TORCH_MODULE(ListBlock);

TEST(Zero3WrapPolicy, RefusesPoliciesThatCannotWork) {
  auto refused = [](const torch::nn::Sequential& model, const WrapPolicy& p, const std::string& needle) {
    try {
      apply_wrap_policy(model, p);
      ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto lm = make_lm(5);
  refused(lm, {}, "no rule given");
  WrapPolicy p;
  p.types = {"Conv2d"};
  refused(lm, p, "type 'Conv2d' matches no module of the model; its types are: tandem::models::TokenEmbeddingImpl");
  p = {};
  p.paths = {"12"};
  refused(lm, p, "path '12' names no module of the model; the Sequential's children are: 0, 1, 2");
  p.paths = {"1", "1"};
  refused(lm, p, "path '1' is listed twice");
  p.paths = {"3.qkv"};
  refused(lm, p, "'3.qkv' (torch::nn::LinearImpl), a member of '3' (tandem::models::TransformerBlockImpl)");
  refused(lm, p, "Wrap it with tandem::ShardedUnit in the model");
  p = {};
  p.types = {"Linear"};  // the head, but also every block's layers
  refused(lm, p, "type 'Linear' matches '1.qkv'");
  p = {};
  p.min_parameters = 1 << 30;
  refused(lm, p, "min_parameters 1073741824 chooses no child: the largest holds");
  p = {};
  p.min_parameters = -1;
  refused(lm, p, "min_parameters must be >= 0");
  p = {};
  p.module_list_children = true;
  refused(lm, p, "the model holds no ModuleList");
  refused(torch::nn::Sequential(ListBlock(), torch::nn::Linear(4, 2)), p,
          "module_list_children matches '0.body.0' (torch::nn::LinearImpl), a member of '0.body'");
  p = {};
  p.types = {"Tanh"};
  refused(torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2)), p,
          "child '1' (torch::nn::TanhImpl) holds no parameters");
}

}  // namespace
}  // namespace tandem::test
