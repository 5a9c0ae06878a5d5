// A layer split in a way no strategy knows, added by a test alone: InterleavedLinear's
// tensor-parallel form holds the output rows r, r + tp, r + 2 tp, ... of rank r and says so
// through tandem::PlacedModule. Checkpoints (save under tp 2, load under DDP and back), the
// whole model's values, a checkpoint read in full (what `export --to hf` reads) and
// initialisation from a ParameterSource then work for it with no code of their own: the values
// equal the dense run's, and each rank reads exactly its rows.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>

#include "tandem/checkpoint.h"
#include "tandem/engine.h"
#include "tandem/placement.h"
#include "tandem/tensor_parallel.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

// Rows r, r + tp, ... of a dense Linear's weight on tp rank r (one block per row); the bias
// replicated.
class InterleavedRowsImpl : public torch::nn::Module, public PlacedModule {
 public:
  InterleavedRowsImpl(const torch::nn::Linear& dense, CommPtr tp_) : tp(std::move(tp_)) {
    const int64_t n = tp->size(), r = tp->rank();
    out = dense->options.out_features();
    weight = register_parameter("weight", dense->weight.detach().narrow(0, r, out - r).slice(0, 0, out - r, n).clone());
    bias = register_parameter("bias", dense->bias.detach().clone());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto local = at::linear(tp::copy_to_tp(x, tp), weight);  // [..., out/tp]: rows r, r + tp, ...
    auto all = tp::gather_from_tp(local, tp);                // [..., tp * out/tp], rank after rank
    auto sizes = all.sizes().vec();
    sizes.back() = tp->size();
    sizes.push_back(out / tp->size());
    return all.view(sizes).transpose(-1, -2).reshape(all.sizes()) + bias;  // row k*tp + r at k*tp + r
  }
  std::vector<ParameterPlacement> parameter_placements() const override {
    const int64_t n = tp->size(), r = tp->rank(), in = weight.size(1);
    Placement p;
    p.global_shape = {out, in};
    p.local_shape = weight.sizes().vec();
    for (int64_t k = 0; k < out / n; ++k) p.blocks.push_back({{k, 0}, {k * n + r, 0}, {1, in}});
    auto b = Placement::whole({out});
    b.replica = r;
    return {{"weight", "lin.weight", p}, {"bias", "lin.bias", b}};
  }
  torch::Tensor weight, bias;
  CommPtr tp;
  int64_t out = 0;
};
TORCH_MODULE(InterleavedRows);

// The dense layer: a Linear under the name "lin" (the split form's "weight" is its "lin.weight").
class InterleavedLinearImpl : public torch::nn::Module, public tp::Parallelizable {
 public:
  InterleavedLinearImpl(int64_t in, int64_t out) { lin = register_module("lin", torch::nn::Linear(in, out)); }
  torch::Tensor forward(const torch::Tensor& x) { return lin->forward(x); }
  void check_tensor_parallel(int tp_size) const override {
    tp::shard_size(lin->options.out_features(), tp_size, "rows");
  }
  torch::nn::AnyModule to_tensor_parallel(const CommPtr& tp) const override {
    return torch::nn::AnyModule(InterleavedRows(lin, tp));
  }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(InterleavedLinear);

torch::nn::Sequential toy(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential s(InterleavedLinear(6, 8), torch::nn::Tanh(), InterleavedLinear(8, 4));
  s->to(torch::kDouble);
  return s;
}

std::unique_ptr<Engine> engine(int tp, uint64_t seed, std::shared_ptr<const ParameterSource> init = nullptr) {
  ParallelConfig c;
  c.strategy = Strategy::kDDP;
  c.tp = tp;
  EngineOptions eo;
  eo.model_name = "toy";
  eo.init_from = std::move(init);
  return std::make_unique<Engine>(runtime(), toy(seed), adamw(0.05), c, eo);
}

// Steps [from, from + k) on fixed batches (every replica the whole batch: one data-parallel
// replica under tp 2, two identical ones under DDP); the losses.
std::vector<double> train(Engine& e, int64_t from, int64_t k) {
  std::vector<double> out;
  for (int64_t s = from; s < from + k; ++s) {
    torch::manual_seed(100 + s);
    auto x = torch::randn({5, 6}, torch::kDouble), y = torch::randn({5, 4}, torch::kDouble);
    out.push_back(
        e.step(x, y, [](const at::Tensor& o, const at::Tensor& t) { return (o - t).pow(2).mean(); }).item<double>());
  }
  return out;
}

void expect_equal(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [n, t] : a) {
    ASSERT_TRUE(b.count(n)) << n;
    const double d = (t.to(torch::kDouble) - b.at(n).to(torch::kDouble)).abs().max().item<double>();
    EXPECT_LE(d, tol) << n;
  }
}

TEST(ToyPlacement, CheckpointsAndInitialValuesNeedNoCodeOfTheirOwn) {
  if (world()->size() != 2) GTEST_SKIP() << "runs on 2 ranks (tp 2)";
  const auto root = shared_dir(*world(), "toy_placement");
  auto split = engine(2, 1), dense = engine(1, 1);
  const auto ls = train(*split, 0, 3), ld = train(*dense, 0, 3);
  for (size_t i = 0; i < ls.size(); ++i) EXPECT_NEAR(ls[i], ld[i], 1e-12 * std::abs(ld[i]));
  const auto want = dense->full_parameters();
  expect_equal(split->full_parameters(), want, 1e-12);
  // Each rank wrote its interleaved rows; the checkpoint read whole is the model.
  const auto dir = split->save(root + "/tp");
  const auto full = read_full_checkpoint(dir);
  expect_equal(full.params, split->full_parameters(), 0.0);
  // tp 2 -> DDP and DDP -> tp 2: the values bitwise, the next steps the same.
  auto ddp = engine(1, 9);
  ddp->load(dir);
  expect_equal(ddp->full_parameters(), split->full_parameters(), 0.0);
  const auto ddp_dir = ddp->save(root + "/ddp");
  auto back = engine(2, 17);
  back->load(ddp_dir);
  expect_equal(back->full_parameters(), split->full_parameters(), 0.0);
  const auto next = train(*split, 3, 3), next_ddp = train(*ddp, 3, 3), next_back = train(*back, 3, 3);
  for (size_t i = 0; i < next.size(); ++i) {
    EXPECT_NEAR(next_ddp[i], next[i], 1e-12 * std::abs(next[i]));
    EXPECT_EQ(next_back[i], next[i]);
  }

  // Initial values: each rank is asked for exactly the elements of its rows (and the bias whole).
  struct MapSource : ParameterSource {
    std::map<std::string, at::Tensor> values;
    mutable std::atomic<int64_t> asked{0};
    bool find(const std::string& name, std::vector<int64_t>* shape) const override {
      *shape = values.at(name).sizes().vec();
      return true;
    }
    void read(const std::string& name, int64_t first, at::Tensor dest) const override {
      asked += dest.numel();
      dest.copy_(values.at(name).reshape({-1}).narrow(0, first, dest.numel()));
    }
  };
  auto source = std::make_shared<MapSource>();
  source->values = want;
  auto init = engine(2, 23, source);
  expect_equal(init->full_parameters(), want, 0.0);
  EXPECT_EQ(source->asked.load(), 6 * 8 / 2 + 8 + 8 * 4 / 2 + 4) << "this rank's rows and the replicated biases";
}

}  // namespace
}  // namespace tandem::test
