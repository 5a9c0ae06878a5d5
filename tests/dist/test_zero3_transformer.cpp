// ZeRO-3 with a unit per block on the 8-block transformer (models::transformer, a Sequential:
// embedding, 8 blocks, final LayerNorm and head are the units) through the Engine: losses follow
// DDP on the same ranks, at most three units are gathered at once, and a checkpoint saved on N
// workers resumes on another count (4 -> 2, 2 -> 1) continuing the uninterrupted run.
// The model has no dropout (TransformerConfig has none), so every layout computes one function.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>

#include "checkpoint/shard_io.h"
#include "tandem/engine.h"
#include "tandem/models.h"
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

OptimizerOptions adamw() {
  OptimizerOptions o;
  o.kind = "adamw";
  o.lr = 3e-3;
  o.weight_decay = 0.01;
  return o;
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

// A Runtime over `comm` (a part of the job's ranks, all on this host), for an Engine on fewer
// workers than the test binary runs.
Runtime runtime_over(const CommPtr& comm) {
  ReplicaPlacement p;
  p.info.rank = p.info.local_rank = comm->rank();
  p.info.world_size = p.info.local_size = comm->size();
  p.info.launcher = "mpirun";
  p.world = p.cpu_world = comm;
  HostInfo host = runtime().hosts().at(0);
  host.ranks.resize(comm->size());
  for (int r = 0; r < comm->size(); ++r) host.ranks[r] = r;
  p.hosts = {host};
  p.host_of.assign(comm->size(), 0);
  return Runtime(std::move(p));
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
    Engine eng(runtime(), make_lm(5), adamw(), with(Strategy::kDDP));
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

    Engine eng(runtime(), lm, adamw(), with(Strategy::kZero3));
    zero3 = train(eng, 0, kSteps / 2);
    CheckpointMeta m;
    m.step = kSteps / 2;
    eng.save(root, m);
    const auto rest = train(eng, kSteps / 2, kSteps / 2);
    zero3.insert(zero3.end(), rest.begin(), rest.end());
    const int64_t peak = eng.stats().peak_gathered_bytes;
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
    Engine eng(rt, make_lm(99), adamw(), with(Strategy::kZero3));
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

}  // namespace
}  // namespace tandem::test
