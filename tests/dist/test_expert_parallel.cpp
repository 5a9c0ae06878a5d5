// Expert parallelism through the Engine: a model with two MoE layers trained for 5 steps with
// --ep 2 alone, with dp (ep 2 x dp 2), under ZeRO-1, ZeRO-3, hsdp and hsdp2, with a pipeline
// (ep 2 x pp 2), with tensor-parallel experts (tp 2; tp 2 x ep 2 on 4 ranks), with every layer
// recomputed in backward, clipped by the whole model's gradient norm, and in fp16 with skipped
// steps, follows one worker that runs the same micro-batches (the auxiliary losses are per
// micro-batch and rank, as transformers computes them per forward): losses and parameters. A
// checkpoint saved under ep 2 (and tp 2 x ep 2) loads whole on one worker; under ZeRO the experts'
// optimizer state is sharded over the ranks holding them, and resumes; initial values from a
// source are read by the experts' owners only; experts not divisible by ep, --ep on a model
// without MoE layers and --ep with --cp are refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tandem/activation_checkpoint.h"
#include "tandem/checkpoint.h"
#include "tandem/engine.h"
#include "tandem/moe.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

// kClasses even: under tp the last Linear is cut over its outputs (tp::tensor_parallel's head).
constexpr int64_t kHidden = 8, kClasses = 6, kTokens = 3, kRows = 16;

moe::MoeConfig moe_config(moe::AuxLossForm form, int64_t experts = 4) {
  moe::MoeConfig c;
  c.hidden_size = kHidden;
  c.intermediate_size = 12;
  c.num_experts = experts;
  c.top_k = 2;
  c.aux_loss_coef = 0.05;
  c.z_loss_coef = 0.01;
  c.aux_form = form;
  return c;
}

// Linear, MoE, Linear, MoE, Linear on [B, T, hidden]: the same values on every rank.
torch::nn::Sequential make_model(moe::AuxLossForm form, int64_t experts = 4) {
  torch::manual_seed(11);
  auto log = moe::make_router_log(2);
  return torch::nn::Sequential(torch::nn::Linear(kHidden, kHidden),
                               moe::SparseMoeBlock(moe_config(form, experts), log, 0),
                               torch::nn::Linear(kHidden, kHidden),
                               moe::SparseMoeBlock(moe_config(form, experts), log, 1),
                               torch::nn::Linear(kHidden, kClasses));
}

const LossFn kTokenCrossEntropy = [](const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.reshape({-1, kClasses}), y.reshape({-1}));
};

std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto g = at::detail::createCPUGenerator(900 + step);
  return {torch::randn({kRows, kTokens, kHidden}, g), torch::randint(0, kClasses, {kRows, kTokens}, g)};
}

struct Run {
  std::vector<double> losses;
  std::vector<double> norms;  // Engine::last_grad_norm() after each step
  std::map<std::string, at::Tensor> params;
};

// 5 steps of the global batch, each data-parallel replica its contiguous slice; the loss of
// the global batch from the replicas' output ranks.
Run train(Engine& eng, int steps = 5) {
  Run r;
  const int dp = eng.dp_size(), rank = eng.dp_rank();
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s);
    auto loss = eng.step(slice_for_rank(x, rank, dp), slice_for_rank(y, rank, dp), kTokenCrossEntropy);
    const bool out = eng.is_output_rank();
    auto sum = torch::tensor({out ? loss.item<double>() : 0.0, out ? 1.0 : 0.0}, torch::kDouble);
    eng.world()->allreduce(sum);
    r.losses.push_back(sum[0].item<double>() / sum[1].item<double>());
    r.norms.push_back(eng.last_grad_norm());
  }
  r.params = eng.full_parameters();
  return r;
}

// Rank 0's figures on every rank.
std::vector<double> from_rank0(const std::vector<double>& v) {
  auto n = torch::tensor({static_cast<int64_t>(v.size())});
  world()->broadcast(n, 0);
  auto t = world()->rank() == 0 ? torch::tensor(v, torch::kDouble) : torch::zeros({n.item<int64_t>()}, torch::kDouble);
  world()->broadcast(t, 0);
  return {t.data_ptr<double>(), t.data_ptr<double>() + t.numel()};
}

// One worker running the global batch as `micro_batches` micro-batches: the slices the
// data-parallel replicas (and their pipeline micro-batches) run, in order; otherwise as `base`
// (precision, clipping) with `optimizer`.
Run reference(moe::AuxLossForm form, int64_t micro_batches, ParallelConfig base = {},
              const OptimizerOptions& optimizer = adamw()) {
  Run r;
  if (auto one = world()->split(world()->rank() == 0 ? 0 : -1, world()->rank())) {
    Runtime rt = runtime_over(one);
    ParallelConfig c = base;
    c.strategy = Strategy::kSingle;
    c.grad_accum = micro_batches;
    Engine eng(rt, make_model(form), optimizer, c);
    r = train(eng);
  }
  r.losses = from_rank0(r.losses);
  r.norms = from_rank0(r.norms);
  auto shapes = make_model(form)->named_parameters();
  std::map<std::string, at::Tensor> params;
  for (auto& p : shapes) {
    auto t = world()->rank() == 0 ? r.params.at(p.key()).clone() : torch::zeros_like(p.value());
    world()->broadcast(t, 0);
    params[p.key()] = t;
  }
  r.params = params;
  return r;
}

void expect_same(const Run& got, const Run& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < want.losses.size(); ++i)
    EXPECT_LE(std::abs(got.losses[i] - want.losses[i]), 1e-5 * std::abs(want.losses[i])) << what << " step " << i;
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  for (const auto& [name, t] : want.params) {
    ASSERT_TRUE(got.params.count(name)) << what << " misses " << name;
    EXPECT_LE(rel_err(got.params.at(name), t), 1e-5) << what << " " << name;
  }
}

ParallelConfig ep_config(Strategy s, int ep, int pp = 1) {
  ParallelConfig c;
  c.strategy = s;
  c.ep = ep;
  c.pp = pp;
  if (pp > 1) {
    c.micro_batches = 2;
    c.partition.method = PartitionMethod::kLayers;
    c.partition.layers = {2, 3};
  }
  return c;
}

// ep 2 on the first two ranks, and on all four (ep 2 x dp 2).
TEST(ExpertParallelLayouts, FollowsOneWorkerWithDdp) {
  const int world_size = world()->size();
  auto want = reference(moe::AuxLossForm::kPooled, world_size);
  Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), ep_config(Strategy::kDDP, 2));
  ASSERT_TRUE(eng.ep_group());
  EXPECT_EQ(eng.ep_group()->size(), 2);
  auto got = train(eng);
  expect_same(got, want, "ep 2 x dp " + std::to_string(world_size / 2));
  // The experts left the module the strategy wraps (each rank keeps two of each layer's four
  // apart, in the Engine's expert bank).
  int64_t experts_held = 0;
  for (auto& p : eng.module().named_parameters())
    if (p.key().find("experts") != std::string::npos) ++experts_held;
  EXPECT_EQ(experts_held, 0) << "the experts leave the module the strategy wraps";
  // The dense weights (3 Linear x 2, 2 routers) and the kept experts (2 layers x 2 x w1, w2, w3).
  EXPECT_EQ(eng.trained_parameters().size(), 8u + 12u) << "trained_parameters() lists the kept experts";
  const auto s = eng.stats();
  EXPECT_GT(s.moe.all_to_alls, 0);
  EXPECT_GT(s.moe.all_to_all_bytes, 0);
  EXPECT_EQ(s.moe.tokens_per_expert.size(), 4u);
  EXPECT_GT(s.moe.aux_loss(), 0.0);
}

TEST(ExpertParallelLayouts, FollowsOneWorkerUnderZero3) {
  auto want = reference(moe::AuxLossForm::kPooled, world()->size());
  Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), ep_config(Strategy::kZero3, 2));
  expect_same(train(eng), want, "ep 2 x zero3");
}

TEST(ExpertParallelLayouts, FollowsOneWorkerWithZero1) {
  auto want = reference(moe::AuxLossForm::kPooled, world()->size());
  Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), ep_config(Strategy::kZero1, 2));
  expect_same(train(eng), want, "ep 2 x zero1");
}

// ep 2 x pp 2 on four ranks: per-layer auxiliary losses (pooling needs every layer in one
// process); one worker runs the 2 replicas x 2 micro-batches as 4 micro-batches.
TEST(ExpertParallelLayouts, FollowsOneWorkerWithPipeline) {
  ASSERT_EQ(world()->size(), 4) << "ep 2 x pp 2 runs on 4 ranks (registered there only)";
  auto want = reference(moe::AuxLossForm::kPerLayer, 4);
  Engine eng(runtime(), make_model(moe::AuxLossForm::kPerLayer), adamw(), ep_config(Strategy::kDDP, 2, /*pp=*/2));
  expect_same(train(eng), want, "ep 2 x pp 2");
}

// --max-grad-norm clips by the whole model's norm, the experts' included: ep 2 under DDP and
// ZeRO-1 (and on 4 ranks tp 2 x ep 2) against one worker clipping at the same norm, below the
// gradients' (every step clips): the norms, losses and parameters.
TEST(ExpertParallelLayouts, ClipsByTheWholeModelsNorm) {
  const int world_size = world()->size();
  const double clip = 0.02;
  for (auto [strategy, tp] :
       {std::pair{Strategy::kDDP, 1}, std::pair{Strategy::kZero1, 1}, std::pair{Strategy::kDDP, 2}}) {
    const int ep = world_size / tp;
    if (ep < 2) continue;  // tp 2 x ep 2 needs 4 ranks
    const std::string what =
        std::string(to_string(strategy)) + " ep " + std::to_string(ep) + " tp " + std::to_string(tp);
    ParallelConfig clipped;
    clipped.max_grad_norm = clip;
    auto want = reference(moe::AuxLossForm::kPooled, ep, clipped);  // ep = dp: each replica's rows a micro-batch
    for (double n : want.norms) ASSERT_GT(n, 1.5 * clip) << what << ": every step must clip";
    auto c = ep_config(strategy, ep);
    c.tp = tp;
    c.max_grad_norm = clip;
    Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), c);
    const auto got = train(eng);
    expect_same(got, want, what);
    for (size_t i = 0; i < want.norms.size(); ++i)
      EXPECT_LE(std::abs(got.norms.at(i) - want.norms[i]), 1e-5 * want.norms[i]) << what << " step " << i;
  }
}

// Hybrid sharding of the dense weights (hsdp and hsdp2: shard groups of 2, replicated over the
// 2 groups on 4 ranks; one group of both ranks on 2) beside ep 2.
TEST(ExpertParallelLayouts, FollowsOneWorkerWithHybridSharding) {
  const int world_size = world()->size();
  auto want = reference(moe::AuxLossForm::kPooled, world_size);
  for (auto s : {Strategy::kHsdp, Strategy::kHsdp2}) {
    auto c = ep_config(s, 2);
    c.shard_group = 2;
    Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), c);
    expect_same(train(eng), want, std::string(to_string(s)) + " x ep 2");
  }
}

// fp16: one loss scale for the whole model. A first scale of 2^20 overflows fp16's gradients, so
// the first steps are skipped (the experts with the dense weights: their own scaler backs off
// with the dense one's) until the scale fits; then ep 2 trains as one worker in fp16. SGD, whose
// step (unlike Adam's) is proportional to the unscaled gradient, so that a wrong scale shows.
TEST(ExpertParallelLayouts, Fp16SkipsOverflowedStepsForTheWholeModel) {
  const int world_size = world()->size();
  ParallelConfig fp16;
  fp16.precision = Precision::kFP16;
  fp16.loss_scaler.init_scale = 1048576.0;  // 2^20, then 2^17, 2^14, ... on each overflow
  fp16.loss_scaler.backoff_factor = 0.125;
  OptimizerOptions sgd;
  sgd.kind = "sgd";
  sgd.lr = 0.5;
  sgd.momentum = 0.9;
  auto want = reference(moe::AuxLossForm::kPooled, world_size, fp16, sgd);
  auto c = ep_config(Strategy::kDDP, 2);
  c.precision = fp16.precision;
  c.loss_scaler = fp16.loss_scaler;
  Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), sgd, c);
  const auto got = train(eng);
  const auto skipped = eng.loss_scaler().skipped_steps();
  EXPECT_GT(skipped, 0) << "the first scale must overflow";
  EXPECT_LT(skipped, 5) << "and some steps must train";
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i)
    EXPECT_LE(std::abs(got.losses[i] - want.losses[i]), 2e-3 * std::abs(want.losses[i])) << "step " << i;
  for (const auto& [name, t] : want.params) {
    ASSERT_TRUE(got.params.count(name)) << name;
    EXPECT_TRUE(torch::isfinite(got.params.at(name)).all().item<bool>()) << name;
    EXPECT_LE(rel_err(got.params.at(name), t), 1e-2) << name;
  }
}

// Whole-layer activation checkpointing: every layer recomputed in backward, the MoE layers with
// the experts they keep (inputs of the recomputation though the Engine banks them apart).
TEST(ExpertParallelLayouts, FollowsOneWorkerWithWholeLayerCheckpointing) {
  const int world_size = world()->size();
  auto want = reference(moe::AuxLossForm::kPooled, world_size);
  auto c = ep_config(Strategy::kDDP, 2);
  c.activation_checkpointing = parse_activation_checkpointing("every");
  Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), c);
  for (auto& p : eng.module().named_parameters())
    EXPECT_EQ(p.key().find("experts"), std::string::npos) << p.key() << ": the wrappers adopt no released expert";
  expect_same(train(eng), want, "ep 2 on " + std::to_string(world_size) + " ranks, every layer recomputed");
}

// Tensor-parallel experts: tp 2 on 2 ranks; tp 2 x ep 2 (dp 2) on 4, each tp rank's ep group
// holding its parts of half the experts.
TEST(ExpertParallelLayouts, FollowsOneWorkerWithTensorParallelExperts) {
  const int ep = world()->size() / 2;
  auto want = reference(moe::AuxLossForm::kPooled, ep);
  auto c = ep_config(Strategy::kDDP, ep);
  c.tp = 2;
  Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), c);
  int64_t parts = 0;
  for (auto& p : eng.module().named_parameters())
    if (p.key().find("experts.") != std::string::npos) ++parts;
  EXPECT_EQ(parts, ep > 1 ? 0 : 2 * 4 * 3) << "experts in the wrapped module";
  auto got = train(eng);
  expect_same(got, want, "tp 2 x ep " + std::to_string(ep));
  const auto s = eng.stats();
  EXPECT_EQ(s.moe.tokens_per_expert.size(), 4u);
  EXPECT_GT(s.moe.aux_loss(), 0.0);
}

// A checkpoint saved under ep 2 (on 4 ranks, tp 2 x ep 2: the experts' parts) loads whole on one
// worker.
TEST(ExpertParallelLayouts, CheckpointLoadsWholeOnOneWorker) {
  auto c = ep_config(Strategy::kDDP, 2);
  if (world()->size() == 4) c.tp = 2;
  Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), c);
  auto trained = train(eng, 2);
  const auto dir = shared_dir(*world(), "ep_ckpt");
  eng.save(dir);
  eng.wait_checkpoint();
  world()->barrier();
  if (auto one = world()->split(world()->rank() == 0 ? 0 : -1, world()->rank())) {
    Runtime rt = runtime_over(one);
    ParallelConfig c;
    c.strategy = Strategy::kSingle;
    Engine whole(rt, make_model(moe::AuxLossForm::kPooled), adamw(), c);
    whole.load(dir);
    auto got = whole.full_parameters();
    for (const auto& [name, t] : trained.params) EXPECT_LE(rel_err(got.at(name), t), 1e-7) << name;
  }
  world()->barrier();
}

// Under ZeRO the experts' fp32 optimizer state is sharded over the edp ranks holding the same
// experts (ZeRO-1 for experts whatever the stage): on 4 ranks (dp 4 / ep 2 = 2 hold each) a rank
// keeps less than its experts' whole AdamW moments, on 2 (1 holds each) all of them. A checkpoint
// of the shards resumes: one more step after loading equals one more step of the original.
TEST(ExpertParallelLayouts, ZeroShardsTheExpertsOptimizerStateAndResumes) {
  for (auto s : {Strategy::kZero1, Strategy::kZero3}) {
    const std::string what = to_string(s);
    Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), ep_config(s, 2));
    train(eng, 2);
    // 2 layers x 2 kept experts x 3 weights of 8 x 12: 1152 parameters, two fp32 moments each.
    const int64_t whole = 1152 * 2 * 4, held = eng.stats().memory.optimizer_state_bytes;
    if (world()->size() == 4) EXPECT_LT(held, whole) << what << ": sharded over the 2 edp ranks";
    if (world()->size() == 2) EXPECT_GE(held, whole) << what << ": one edp rank holds it all";
    const auto dir = shared_dir(*world(), "ep_zero_ckpt_" + what);
    eng.save(dir);
    eng.wait_checkpoint();
    world()->barrier();
    Engine back(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), ep_config(s, 2));
    back.load(dir);
    auto [x, y] = batch(7);
    const int dp = eng.dp_size(), r = eng.dp_rank();
    const auto a = eng.step(slice_for_rank(x, r, dp), slice_for_rank(y, r, dp), kTokenCrossEntropy).item<double>();
    const auto b = back.step(slice_for_rank(x, r, dp), slice_for_rank(y, r, dp), kTokenCrossEntropy).item<double>();
    EXPECT_DOUBLE_EQ(a, b) << what;
    const auto pa = eng.full_parameters(), pb = back.full_parameters();
    for (const auto& [name, t] : pa) EXPECT_LE(rel_err(pb.at(name), t), 1e-7) << what << " " << name;
  }
}

// Initial values from a source (EngineOptions::init_from, as `finetune --init-from` reads a
// Hugging Face directory): a rank asks for the experts it keeps only, every expert is asked for
// by some rank, and the model then holds the source's values.
class RecordingSource : public ParameterSource {
 public:
  std::map<std::string, at::Tensor> values;
  mutable std::set<std::string> asked;
  bool find(const std::string& name, std::vector<int64_t>* shape) const override {
    if (!values.count(name)) return false;
    if (shape) *shape = values.at(name).sizes().vec();
    return true;
  }
  void read(const std::string& name, int64_t first, at::Tensor dest) const override {
    asked.insert(name);
    dest.copy_(values.at(name).reshape({-1}).narrow(0, first, dest.numel()));
  }
};

TEST(ExpertParallelLayouts, InitFromReadsOnlyThisRanksExperts) {
  auto source = std::make_shared<RecordingSource>();
  {
    torch::NoGradGuard ng;
    for (auto& p : make_model(moe::AuxLossForm::kPooled)->named_parameters())
      source->values[p.key()] = torch::randn_like(p.value());
  }
  EngineOptions eo;
  eo.init_from = source;
  Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), ep_config(Strategy::kDDP, 2), eo);
  const int64_t mine = eng.ep_group()->rank(), per_rank = 4 / 2;
  std::vector<std::string> names;
  for (auto& [name, v] : source->values) names.push_back(name);
  auto asked = torch::zeros({static_cast<int64_t>(names.size())}, torch::kLong);
  for (size_t i = 0; i < names.size(); ++i) {
    const auto at = names[i].find("experts.");
    if (!source->asked.count(names[i])) continue;
    asked[static_cast<int64_t>(i)] = 1;
    if (at == std::string::npos) continue;
    const int64_t expert = std::stoll(names[i].substr(at + 8));
    EXPECT_EQ(expert / per_rank, mine) << "ep rank " << mine << " read " << names[i];
  }
  world()->allreduce(asked);
  for (size_t i = 0; i < names.size(); ++i) EXPECT_GT(asked[static_cast<int64_t>(i)].item<int64_t>(), 0) << names[i];
  const auto full = eng.full_parameters();
  for (auto& [name, v] : source->values) EXPECT_TRUE(torch::equal(full.at(name), v)) << name;
}

TEST(ExpertParallelLayouts, RefusesWhatItCannotSplit) {
  expect_invalid_argument(
      [&] { Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled, 3), adamw(), ep_config(Strategy::kDDP, 2)); },
      "num_local_experts 3 is not divisible by --ep 2");
  torch::manual_seed(1);
  expect_invalid_argument(
      [&] {
        Engine eng(runtime(), torch::nn::Sequential(torch::nn::Linear(4, 4)), adamw(), ep_config(Strategy::kDDP, 2));
      },
      "has none");
  expect_invalid_argument(
      [&] { Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), ep_config(Strategy::kDDP, 3)); },
      "--ep 3 does not divide");
  if (world()->size() == 4) {
    auto c = ep_config(Strategy::kDDP, 2);
    c.cp = 2;
    expect_invalid_argument([&] { Engine eng(runtime(), make_model(moe::AuxLossForm::kPooled), adamw(), c); },
                            "does not compose with --cp 2");
  }
}

}  // namespace
}  // namespace tandem::test
