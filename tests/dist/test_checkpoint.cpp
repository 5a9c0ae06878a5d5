// Sharded checkpoints (tandem/checkpoint.h) through tandem::Engine and the replicated loop's
// save_checkpoint/load_checkpoint: bitwise resume in the same configuration (ZeRO stages 1-3,
// DDP, bf16 and fp16 with their loss scaler), resharding across world sizes and strategies
// (ZeRO-2 on N -> ZeRO-3 on 2 -> DDP on 1 -> ZeRO-1 on N) against an uninterrupted
// single-process reference, pipeline stages (one per rank, and interleaved chunks) resumed as
// stages, as 1F1B and in one process, a tensor-parallel transformer whose checkpoint equals a
// dense run's state and loads back into shards exactly, and saves whose pieces do not describe
// the state refused on every rank. Bad input: corrupted and truncated shards, a damaged
// manifest, pieces that leave an element out, hold one twice or lie outside their tensor,
// missing files, another model, and a save killed midway (fork + SIGKILL), each leaving what
// existed untouched. Every layout against every other: test_checkpoint_matrix.cpp.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "checkpoint/shard_io.h"
#include "tandem/backends.h"
#include "tandem/checkpoint.h"
#include "tandem/ddp.h"
#include "tandem/engine.h"
#include "tandem/models.h"
#include "tandem/optim.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

constexpr int64_t kBatch = 24;  // splits evenly over 1, 2, 3 and 4 ranks

// float64 so that the resharded runs match the reference to ~1e-12 (only summation order differs).
torch::nn::Sequential make_seq(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential s(torch::nn::Linear(13, 9), torch::nn::Tanh(), torch::nn::Linear(9, 5), torch::nn::Tanh(),
                          torch::nn::Linear(5, 3));
  s->to(torch::kDouble);
  return s;
}

OptimizerOptions sgd_momentum() {
  OptimizerOptions o;
  o.kind = "sgd";
  o.lr = 0.1;
  o.momentum = 0.9;
  return o;
}

std::pair<torch::Tensor, torch::Tensor> batch_of_step(int64_t step) {
  auto [x, y] = test::global_batch(kBatch, 1000 + step, 3);
  return {x.to(torch::kDouble), y};
}

const LossFn kCrossEntropy = [](const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
};

CheckpointMeta meta_at(int64_t step, const std::string& strategy) {
  CheckpointMeta m;
  m.model = "seq13";
  m.model_description = "13-9-5-3 tanh MLP, float64";
  m.strategy = strategy;
  m.step = step;
  return m;
}

ParallelConfig layout(Strategy s, int tp = 1, int pp = 1, int64_t micro_batches = 1) {
  ParallelConfig c;
  c.strategy = s;
  c.tp = tp;
  c.pp = pp;
  c.micro_batches = micro_batches;
  return c;
}

EngineOptions named(const std::string& model = "seq13") {
  EngineOptions o;
  o.model_name = model;
  return o;
}

// Steps [from, from + k) of the global batches through the engine (each replica its slice, every
// tp and pp rank of a replica the same); returns the global mean loss of each.
std::vector<double> train(Engine& eng, int64_t from, int64_t k,
                          const std::function<at::Tensor(const at::Tensor&)>& input = nullptr) {
  std::vector<double> out;
  for (int64_t s = from; s < from + k; ++s) {
    auto [x, y] = batch_of_step(s);
    if (input) x = input(x);
    auto xs = slice_for_rank(x, eng.dp_rank(), eng.dp_size()), ys = slice_for_rank(y, eng.dp_rank(), eng.dp_size());
    auto l = eng.step(xs, ys, kCrossEntropy).detach().to(torch::kCPU, torch::kDouble).reshape({1}).clone();
    eng.world()->allreduce(l, ReduceOp::kAvg);
    out.push_back(l.item<double>());
  }
  return out;
}

// One training step on this rank's slice of the global batch; returns the global mean loss.
template <typename StepFn>
double step_on_slice(Communicator& comm, int64_t step, StepFn fn) {
  auto [x, y] = batch_of_step(step);
  auto xs = slice_for_rank(x, comm.rank(), comm.size()), ys = slice_for_rank(y, comm.rank(), comm.size());
  const double local = fn(xs, ys);
  at::Tensor l = torch::tensor({local}, torch::kDouble);
  comm.allreduce(l, ReduceOp::kAvg);
  return l.item<double>();
}

std::vector<double> train_ddp(torch::nn::Sequential m, DistributedDataParallel& ddp, torch::optim::Optimizer& opt,
                              Communicator& comm, int64_t from, int64_t k) {
  std::vector<double> out;
  for (int64_t s = from; s < from + k; ++s) {
    out.push_back(step_on_slice(comm, s, [&](const torch::Tensor& x, const torch::Tensor& y) {
      ddp.prepare_forward();
      ddp.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(m->forward(x), y);
      loss.backward();
      opt.step();
      return loss.item<double>();
    }));
  }
  return out;
}

// The uninterrupted run: one process, the whole batch, LibTorch's optimizer.
std::vector<double> reference_losses(const OptimizerOptions& o, int64_t steps) {
  auto m = make_seq(7);
  auto opt = make_optimizer(m->parameters(), o);
  std::vector<double> out;
  for (int64_t s = 0; s < steps; ++s) {
    auto [x, y] = batch_of_step(s);
    opt->zero_grad();
    auto loss = torch::nn::functional::cross_entropy(m->forward(x), y);
    loss.backward();
    opt->step();
    out.push_back(loss.item<double>());
  }
  return out;
}

// The whole state an engine holds (fp32 masters or the parameters, every optimizer slot and
// Adam's step, buffers), as a checkpoint of it under `root` reads back. Collective.
FullCheckpoint state_of(Engine& eng, const std::string& root, int64_t step) {
  CheckpointMeta m;
  m.step = step;
  return read_full_checkpoint(eng.save(root, m));
}

// Bit for bit: every parameter, buffer and optimizer state tensor, and the step counts.
void expect_same_state(const FullCheckpoint& a, const FullCheckpoint& b, const std::string& what) {
  EXPECT_EQ(a.param_names, b.param_names) << what;
  for (auto& [n, v] : a.params) {
    auto it = b.params.find(n);
    ASSERT_NE(it, b.params.end()) << what << ": " << n;
    EXPECT_EQ(v.scalar_type(), it->second.scalar_type()) << what << ": " << n;
    EXPECT_TRUE(torch::equal(v, it->second)) << what << ": " << n;
  }
  for (auto& [n, v] : a.buffers)
    EXPECT_TRUE(b.buffers.count(n) && torch::equal(v, b.buffers.at(n))) << what << ": " << n;
  EXPECT_EQ(a.optim.size(), b.optim.size()) << what;
  for (auto& [n, st] : a.optim) {
    auto it = b.optim.find(n);
    ASSERT_NE(it, b.optim.end()) << what << ": state of " << n;
    EXPECT_EQ(st.step, it->second.step) << what << ": step of " << n;
    EXPECT_EQ(st.slots.size(), it->second.slots.size()) << what << ": slots of " << n;
    for (auto& [k, v] : st.slots) {
      EXPECT_TRUE(it->second.slots.count(k) && torch::equal(v, it->second.slots.at(k)))
          << what << ": " << k << " of " << n;
    }
  }
}

void expect_same_parameters(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                            const std::string& what) {
  EXPECT_EQ(a.size(), b.size()) << what;
  for (auto& [n, v] : a) EXPECT_TRUE(b.count(n) && torch::equal(v, b.at(n))) << what << ": " << n;
}

// ---- same configuration: bitwise

class CheckpointResume : public ::testing::TestWithParam<int> {};

// ZeRO stage 1, 2 or 3 on every rank, AdamW and SGD with momentum: the engine that loads the
// checkpoint (from other initial values) continues exactly as the one that went on, in losses,
// parameters and optimizer state.
TEST_P(CheckpointResume, ZeroContinuesBitwise) {
  const int stage = GetParam();
  const Strategy strategy = stage == 1 ? Strategy::kZero1 : stage == 2 ? Strategy::kZero2 : Strategy::kZero3;
  auto comm = world();
  const auto dir = shared_dir(*comm, "ckpt_bitwise");
  for (auto o : {adamw(), sgd_momentum()}) {
    const std::string what = "stage " + std::to_string(stage) + " " + o.kind;
    Engine a(runtime(), make_seq(7), o, layout(strategy), named());
    train(a, 0, 3);
    auto path = a.save(dir + "/" + o.kind, meta_at(3, to_string(strategy)));
    const auto went_on = train(a, 3, 3);

    Engine b(runtime(), make_seq(99), o, layout(strategy), named());  // other initial values
    auto meta = b.load(path);
    EXPECT_EQ(meta.step, 3);
    EXPECT_EQ(meta.world_size, comm->size());
    const auto resumed = train(b, 3, 3);
    EXPECT_EQ(resumed, went_on) << what;
    expect_same_parameters(a.full_parameters(), b.full_parameters(), what);
    expect_same_state(state_of(a, dir + "/a_" + o.kind, 6), state_of(b, dir + "/b_" + o.kind, 6), what);
  }
  comm->barrier();
  if (comm->rank() == 0) ckpt::remove_tree(dir);
}

// A replicated loop of its own (DDP and LibTorch's optimizer): save_checkpoint and
// load_checkpoint resume it bitwise, Adam's moments and step included.
TEST(CheckpointResumeDdp, ContinuesBitwise) {
  auto comm = world();
  const auto dir = shared_dir(*comm, "ckpt_ddp");
  auto ma = make_seq(7);
  auto oa = make_optimizer(ma->parameters(), adamw());
  DistributedDataParallel da(ma.ptr(), comm);
  train_ddp(ma, da, *oa, *comm, 0, 3);
  auto path = save_checkpoint(dir, meta_at(3, "ddp"), *ma, *oa, *comm);
  train_ddp(ma, da, *oa, *comm, 3, 3);

  auto mb = make_seq(99);
  auto ob = make_optimizer(mb->parameters(), adamw());
  DistributedDataParallel db(mb.ptr(), comm);
  load_checkpoint(path, *mb, *ob, comm->rank(), {"seq13", true});
  train_ddp(mb, db, *ob, *comm, 3, 3);
  auto pa = ma->parameters(), pb = mb->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(torch::equal(pa[i], pb[i])) << i;
    auto sa = get_param_state(*oa, pa[i]), sb = get_param_state(*ob, pb[i]);
    EXPECT_EQ(sa.step, sb.step);
    EXPECT_TRUE(torch::equal(sa.slots.at("exp_avg"), sb.slots.at("exp_avg")));
    EXPECT_TRUE(torch::equal(sa.slots.at("exp_avg_sq"), sb.slots.at("exp_avg_sq")));
  }
  comm->barrier();
  if (comm->rank() == 0) ckpt::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(Stages, CheckpointResume, ::testing::Values(1, 2, 3));

// Mixed precision: the fp32 masters and (fp16) the loss scaler are saved and restored, so a
// resumed bf16/fp16 ZeRO run continues bitwise too, also when resumed as another stage.
TEST(CheckpointMixed, ZeroBf16AndFp16ContinueBitwise) {
  auto comm = world();
  const auto dir = shared_dir(*comm, "ckpt_mixed");
  auto fp32_seq = [](uint64_t seed) {
    auto m = make_seq(seed);
    m->to(torch::kFloat);
    return m;
  };
  auto as_float = [](const at::Tensor& x) { return x.to(torch::kFloat); };
  for (auto prec : {Precision::kBF16, Precision::kFP16}) {
    const std::string name = precision_name(prec);
    auto config = [&](Strategy s) {
      auto c = layout(s);
      c.precision = prec;
      c.loss_scaler.init_scale = 1024.0;
      c.loss_scaler.growth_interval = 2;  // the scale changes within the run
      return c;
    };
    Engine a(runtime(), fp32_seq(7), adamw(), config(Strategy::kZero2), named());
    train(a, 0, 3, as_float);
    const double scale = a.loss_scaler().scale();
    auto path = a.save(dir + "/" + name, meta_at(3, "zero2"));
    const auto saved = read_checkpoint_meta(path);
    EXPECT_EQ(saved.precision, name);
    EXPECT_EQ(saved.loss_scale, scale);
    EXPECT_EQ(saved.loss_scale_good_steps, a.loss_scaler().overflow_free_steps());
    const auto went_on = train(a, 3, 3, as_float);
    const auto state_a = state_of(a, dir + "/a_" + name, 6);
    for (Strategy s : {Strategy::kZero2, Strategy::kZero3}) {
      const std::string what = name + " resumed as " + to_string(s);
      Engine b(runtime(), fp32_seq(99), adamw(), config(s), named());
      b.load(path);
      EXPECT_EQ(b.loss_scaler().scale(), scale) << what;
      const auto resumed = train(b, 3, 3, as_float);
      EXPECT_EQ(a.loss_scaler().scale(), b.loss_scaler().scale()) << what;
      EXPECT_EQ(resumed, went_on) << what;
      expect_same_parameters(a.full_parameters(), b.full_parameters(), what);
      expect_same_state(state_a, state_of(b, dir + "/b_" + name + "_" + to_string(s), 6), what);
    }
  }
  comm->barrier();
  if (comm->rank() == 0) ckpt::remove_tree(dir);
}

// ---- resharding: ZeRO-2 on N -> ZeRO-3 on 2 -> DDP on 1 -> ZeRO-1 on N, each K steps, against the
// uninterrupted single-process run (float64: only the summation order differs)

TEST(CheckpointReshard, AcrossWorldSizesAndStrategies) {
  auto comm = world();
  const int N = comm->size(), rank = comm->rank();
  const int64_t K = 3;
  const auto o = adamw();
  const auto ref = reference_losses(o, 4 * K);
  const auto dir = shared_dir(*comm, "ckpt_reshard");
  auto near = [&](const std::vector<double>& got, int64_t from, const char* phase) {
    ASSERT_EQ(got.size(), static_cast<size_t>(K));
    for (int64_t i = 0; i < K; ++i) EXPECT_NEAR(got[i], ref[from + i], 1e-9) << phase << " step " << from + i;
  };

  // A: ZeRO-2 on all N ranks, steps 0..K.
  {
    Engine eng(runtime(), make_seq(7), o, layout(Strategy::kZero2), named());
    near(train(eng, 0, K), 0, "zero2 on N");
    eng.save(dir + "/a", meta_at(K, "zero2"));
  }
  // B: ZeRO-3 on ranks 0 and 1, steps K..2K.
  auto two = comm->split(rank < 2 ? 0 : -1, rank);
  if (two) {
    Runtime rt = runtime_over(two);
    Engine eng(rt, make_seq(99), o, layout(Strategy::kZero3), named());
    auto meta = eng.load(dir + "/a");  // the root: its newest checkpoint
    EXPECT_EQ(meta.world_size, N);
    EXPECT_EQ(meta.step, K);
    near(train(eng, K, K), K, "zero3 on 2");
    eng.save(dir + "/b", meta_at(2 * K, "zero3"));
  }
  comm->barrier();
  // C: DDP on rank 0 alone, steps 2K..3K.
  auto one = comm->split(rank == 0 ? 0 : -1, 0);
  if (one) {
    Runtime rt = runtime_over(one);
    Engine eng(rt, make_seq(99), o, layout(Strategy::kDDP), named());
    EXPECT_EQ(eng.load(latest_checkpoint(dir + "/b")).world_size, 2);
    near(train(eng, 2 * K, K), 2 * K, "ddp on 1");
    eng.save(dir + "/c", meta_at(3 * K, "ddp"));
  }
  comm->barrier();
  // D: ZeRO-1 on all N ranks from the one-rank checkpoint, steps 3K..4K.
  {
    Engine eng(runtime(), make_seq(99), o, layout(Strategy::kZero1), named());
    EXPECT_EQ(eng.load(latest_checkpoint(dir + "/c")).world_size, 1);
    near(train(eng, 3 * K, K), 3 * K, "zero1 on N");
  }
  comm->barrier();
  if (rank == 0) ckpt::remove_tree(dir);
}

// One process loads the checkpoint at `path` (step k) into a fresh model and trains steps k to
// 2k - 1 as the reference did (ref: its losses); returns the checkpoint's meta.
CheckpointMeta continue_in_one_process(const std::string& path, const OptimizerOptions& o,
                                       const std::vector<double>& ref, int64_t k, const std::string& after) {
  auto m = make_seq(99);
  auto opt = make_optimizer(m->parameters(), o);
  auto meta = load_checkpoint(path, *m, *opt, 0);
  for (int64_t s = k; s < 2 * k; ++s) {
    auto [x, y] = batch_of_step(s);
    opt->zero_grad();
    auto loss = torch::nn::functional::cross_entropy(m->forward(x), y);
    loss.backward();
    opt->step();
    EXPECT_NEAR(loss.item<double>(), ref[s], 1e-9) << "one process after " << after << ", step " << s;
  }
  return meta;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

// One pipeline stage per rank (each rank writes its stage), K steps; the stages reload their
// own parameters bit for bit, and one process continues from the checkpoint as the reference
// does.
TEST(CheckpointReshard, PipelineStagesToOneProcess) {
  auto comm = world();
  const int rank = comm->rank(), N = comm->size();
  const int64_t K = 3;
  const auto o = adamw();
  const auto ref = reference_losses(o, 2 * K);
  const auto dir = shared_dir(*comm, "ckpt_pipeline");
  const auto pp = layout(Strategy::kDDP, /*tp=*/1, /*pp=*/N, /*micro_batches=*/2);
  std::vector<at::Tensor> trained;
  std::map<std::string, at::Tensor> whole;
  {
    Engine eng(runtime(), make_seq(7), o, pp, named());
    const auto got = train(eng, 0, K);
    for (int64_t s = 0; s < K; ++s) EXPECT_NEAR(got[s], ref[s], 1e-9) << "pipeline step " << s;
    EXPECT_EQ(eng.save(dir, meta_at(K, "pp")), dir + "/step-00000003");
    trained = clones(eng.trained_parameters());
    whole = eng.full_parameters();
  }
  const auto path = latest_checkpoint(dir);
  EXPECT_EQ(path, dir + "/step-00000003");
  {
    Engine eng(runtime(), make_seq(99), o, pp, named());
    eng.load(path);
    auto got = eng.trained_parameters();
    ASSERT_EQ(got.size(), trained.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], trained[i])) << "stage parameter " << i;
    expect_same_parameters(eng.full_parameters(), whole, "the whole model after loading the stages");
  }
  comm->barrier();
  if (rank == 0) {
    EXPECT_EQ(continue_in_one_process(path, o, ref, K, "the pipeline").world_size, N);
    ckpt::remove_tree(dir);
  }
  comm->barrier();
}

// Interleaved 1F1B over pp 2 x 2 virtual stages (each rank's chunks hold non-adjacent layers;
// on 4 ranks two replicas, one writer per stage): the checkpoint names the whole model's
// layers, so it resumes into contiguous 1F1B stages and into one process, and both continue as
// the reference does.
TEST(CheckpointReshard, InterleavedStagesResumeIntoOtherLayouts) {
  auto w = world();
  ASSERT_EQ(w->size() % 2, 0) << "run on an even number of ranks";
  const int64_t K = 3;
  const auto o = adamw();
  const auto ref = reference_losses(o, 2 * K);
  const auto dir = shared_dir(*w, "interleaved");
  auto near = [&](const std::vector<double>& got, int64_t from, const char* phase) {
    for (int64_t i = 0; i < K; ++i) EXPECT_NEAR(got[i], ref[from + i], 1e-9) << phase << " step " << from + i;
  };
  {
    auto c = layout(Strategy::kDDP, /*tp=*/1, /*pp=*/2, /*micro_batches=*/4);
    c.schedule = PipelineSchedule::kInterleaved;
    c.virtual_stages = 2;
    Engine eng(runtime(), make_seq(7), o, c, named());
    ASSERT_NE(eng.pipeline(), nullptr);
    ASSERT_EQ(eng.pipeline()->layer_ranges().size(), 2u);
    near(train(eng, 0, K), 0, "interleaved");
    eng.save(dir, meta_at(K, "pp2 interleaved v2"));
  }
  const auto path = latest_checkpoint(dir);
  {
    Engine eng(runtime(), make_seq(99), o, layout(Strategy::kDDP, 1, 2, 2), named());
    eng.load(path);
    near(train(eng, K, K), K, "1f1b after interleaved");
  }
  w->barrier();
  if (w->rank() == 0) {
    continue_in_one_process(path, o, ref, K, "interleaved");
    ckpt::remove_tree(dir);
  }
  w->barrier();
}

// A transformer split over every rank (tp = world, heads and the fused qkv cut per head): two
// AdamW steps and a checkpoint of its pieces; it equals a dense run's state in one process, and
// loads back into another tensor-parallel engine exactly, optimizer state included. A model of
// another shape is refused, naming the parameter, and keeps its values.
TEST(CheckpointReshard, TensorParallelTransformer) {
  auto comm = world();
  const int rank = comm->rank(), N = comm->size();
  const auto c = small_lm();
  auto make = [](const models::TransformerConfig& cfg, uint64_t seed) {
    torch::manual_seed(seed);
    auto m = models::transformer(cfg);
    m->to(torch::kDouble);
    return m;
  };
  auto g = at::detail::createCPUGenerator(12);
  auto ids = torch::randint(0, c.vocab, {3, 6}, g);
  auto tgt = torch::randint(0, c.vocab, {3, 6}, g);
  const LossFn ce = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
  };
  const auto o = adamw();
  const auto tp = layout(Strategy::kDDP, /*tp=*/N);
  Engine par(runtime(), make(c, 5), o, tp, named("lm"));
  for (int s = 0; s < 2; ++s) par.step(ids, tgt, ce);
  const auto dir = shared_dir(*comm, "ckpt_tp");
  auto meta = meta_at(2, "tp");
  meta.model = "lm";
  meta.model_description = "small_lm, float64";
  const auto path = par.save(dir, meta);
  EXPECT_EQ(path, dir + "/step-00000002");
  if (rank == 0) {  // whole, as a dense run in one process left it
    try {
      auto dense = make(c, 5);
      auto dopt = make_optimizer(dense->parameters(), o);
      for (int s = 0; s < 2; ++s) {
        dopt->zero_grad();
        ce(dense->forward(ids), tgt).backward();
        dopt->step();
      }
      auto loaded = make(c, 98);
      auto lopt = make_optimizer(loaded->parameters(), o);
      load_checkpoint(path, *loaded, *lopt, 0, {"lm", true});
      auto want = dense->named_parameters();
      for (auto& kv : loaded->named_parameters()) {
        EXPECT_LE((kv.value() - want[kv.key()]).abs().max().item<double>(), 1e-9) << kv.key();
        auto a = get_param_state(*lopt, kv.value()), b = get_param_state(*dopt, want[kv.key()]);
        EXPECT_EQ(a.step, b.step) << kv.key();
        for (auto& [k, v] : b.slots)
          EXPECT_LE((a.slots.at(k) - v).abs().max().item<double>(), 1e-9) << k << " of " << kv.key();
      }
    } catch (const std::exception& e) {  // not thrown past the collectives below
      ADD_FAILURE() << "loading the tensor-parallel checkpoint in one process: " << e.what();
    }
  }
  {  // back into shards: every one as it was saved
    Engine par2(runtime(), make(c, 77), o, tp, named("lm"));
    par2.load(path);
    auto want = par.trained_parameters(), got = par2.trained_parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], want[i])) << "shard " << i;
    expect_same_parameters(par2.full_parameters(), par.full_parameters(), "tp -> tp");
    expect_same_state(state_of(par, dir + "/a", 2), state_of(par2, dir + "/b", 2), "tp -> tp");
  }
  {  // a model of another shape: refused naming the parameter; nothing is changed
    auto other = c;
    other.mlp_ratio = 4;
    Engine wrong(runtime(), make(other, 1), o, tp, named("lm"));
    const auto before = wrong.full_parameters();
    try {
      wrong.load(path);
      ADD_FAILURE() << "a model of another shape was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("fc1.weight"), std::string::npos) << e.what();
    }
    expect_same_parameters(wrong.full_parameters(), before, "after the refusal");
  }
  comm->barrier();
  if (rank == 0) ckpt::remove_tree(dir);
  comm->barrier();
}

// ---- saves whose pieces do not describe the state: a strategy's bug, refused on every rank
// before anything is written

// Every rank reports the parameters of make_seq as a replicated loop does (whole, replica id =
// its rank), except `broken`, which `piece_of(rank, numel)` describes instead.
void expect_save_refused(const std::string& broken, const std::function<Placement(int rank, int64_t numel)>& piece_of,
                         const std::string& what) {
  auto comm = world();
  const auto root = shared_dir(*comm, "ckpt_pieces");
  auto m = make_seq(7);
  std::vector<StatePiece> pieces;
  for (auto& kv : m->named_parameters()) {
    auto p = Placement::whole(kv.value().sizes().vec());
    p.replica = comm->rank();
    if (kv.key() == broken) p = piece_of(comm->rank(), kv.value().numel());
    auto flat = kv.value().detach().reshape({-1});
    pieces.push_back({"param/" + kv.key(), p, flat.narrow(0, p.held_begin(), p.held_numel())});
  }
  try {
    save_state(root, meta_at(1, "broken"), pieces, 0, *comm);
    ADD_FAILURE() << what << ": the save was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'param/" + broken + "'"), std::string::npos) << what << ": " << e.what();
  }
  EXPECT_EQ(latest_checkpoint(root), "") << what << ": something was written";
  comm->barrier();
  if (comm->rank() == 0) ckpt::remove_tree(root);
}

TEST(CheckpointPieces, SaveRefusesPiecesThatDoNotCoverATensor) {
  const int N = world()->size();
  // ZeRO-like flat ranges of equal chunks, the last one short by an element: a hole.
  expect_save_refused(
      "2.weight",
      [N](int r, int64_t n) {
        const int64_t chunk = (n + N - 1) / N;
        const int64_t lo = std::min(n, r * chunk), hi = std::min(n, (r + 1) * chunk);
        return Placement::whole({5, 9}).flat_range(lo, r == N - 1 ? hi - 1 : hi);
      },
      "a hole");
  // Nobody writes it (a pipeline stage without a writer): every rank holds it as a replica.
  expect_save_refused(
      "4.bias",
      [](int r, int64_t) {
        auto p = Placement::whole({3});
        p.replica = r + 1;
        return p;
      },
      "no writer");
  if (N == 1) return;
  // Equal flat chunks, each one element longer: every boundary element twice.
  expect_save_refused(
      "2.weight",
      [N](int r, int64_t n) {
        const int64_t chunk = (n + N - 1) / N;
        const int64_t lo = std::min(n, r * chunk), hi = std::min(n, (r + 1) * chunk + 1);
        return Placement::whole({5, 9}).flat_range(lo, hi);
      },
      "an overlap");
  // The ranks (each writing its flat chunk) disagree on the tensor's shape.
  expect_save_refused(
      "0.bias",
      [N](int r, int64_t n) {
        const int64_t chunk = (n + N - 1) / N;
        const int64_t lo = std::min(n, r * chunk), hi = std::min(n, (r + 1) * chunk);
        return (r == 0 ? Placement::whole({9}) : Placement::whole({3, 3})).flat_range(lo, hi);
      },
      "another shape");
}

// ---- bad input (each rank on its own, in its own directory)

class CheckpointErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    comm_ = tandem::make_self_communicator(CommOptions{});
    root_ = shared_dir(*comm_, "ckpt_errors");
    model_ = make_seq(7);
    opt_ = make_optimizer(model_->parameters(), adamw());
    DistributedDataParallel ddp(model_.ptr(), comm_);
    train_ddp(model_, ddp, *opt_, *comm_, 0, 2);
    path_ = save_checkpoint(root_, meta_at(2, "single"), *model_, *opt_, *comm_);
    shard_ = path_ + "/shard-00000-of-00001.bin";
  }
  void TearDown() override { ckpt::remove_tree(root_); }

  // Loading must fail with a message containing all of `parts`, and change nothing.
  void expect_load_fails(const std::string& dir, std::vector<std::string> parts,
                         torch::nn::Sequential target = nullptr) {
    auto m = target ? target : make_seq(99);
    auto opt = make_optimizer(m->parameters(), adamw());
    std::vector<torch::Tensor> before;
    for (auto& p : m->parameters()) before.push_back(p.detach().clone());
    try {
      load_checkpoint(dir, *m, *opt, 0, {"seq13", true});
      ADD_FAILURE() << "loading " << dir << " did not fail";
    } catch (const std::runtime_error& e) {
      std::string msg = e.what();
      for (auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    }
    auto after = m->parameters();
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(torch::equal(before[i], after[i])) << "parameter " << i << " changed";
    EXPECT_TRUE(opt->state().empty()) << "optimizer state changed";
  }
  void rewrite(const std::string& path, const std::function<void(std::string&)>& f) {
    auto s = ckpt::read_all(path);
    f(s);
    ckpt::write_synced(path, s);
  }

  CommPtr comm_;
  std::string root_, path_, shard_;
  torch::nn::Sequential model_{nullptr};
  std::unique_ptr<torch::optim::Optimizer> opt_;
};

TEST_F(CheckpointErrors, IntactLoads) {
  auto m = make_seq(99);
  auto opt = make_optimizer(m->parameters(), adamw());
  load_checkpoint(path_, *m, *opt, 0, {"seq13", true});
  auto a = model_->parameters(), b = m->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i]));
}

TEST_F(CheckpointErrors, CorruptedShard) {
  rewrite(shard_, [](std::string& s) { s[s.size() / 2] ^= 0x40; });
  expect_load_fails(path_, {shard_, "corrupted", "checksum"});
}

TEST_F(CheckpointErrors, TruncatedShard) {
  rewrite(shard_, [](std::string& s) { s.resize(s.size() - 100); });
  expect_load_fails(path_, {shard_, "truncated"});
}

TEST_F(CheckpointErrors, DamagedManifest) {
  rewrite(path_ + "/manifest.json", [](std::string& s) { s.resize(s.size() / 2); });
  expect_load_fails(path_, {path_ + "/manifest.json", "not valid JSON"});
}

TEST_F(CheckpointErrors, ManifestFieldMissing) {
  rewrite(path_ + "/manifest.json", [](std::string& s) {
    auto p = s.find("\"world_size\"");
    s.replace(p, 12, "\"wurld_size\"");
  });
  expect_load_fails(path_, {path_ + "/manifest.json", "world_size"});
}

TEST_F(CheckpointErrors, MissingShard) {
  ASSERT_EQ(::unlink(shard_.c_str()), 0);
  expect_load_fails(path_, {shard_, "cannot open"});
}

TEST_F(CheckpointErrors, MissingManifest) {
  ASSERT_EQ(::unlink((path_ + "/manifest.json").c_str()), 0);
  expect_load_fails(path_, {path_, "manifest.json", "missing"});
  EXPECT_EQ(latest_checkpoint(root_), "");  // an incomplete checkpoint is never picked
}

TEST_F(CheckpointErrors, AnotherModel) {
  torch::manual_seed(1);
  torch::nn::Sequential other(torch::nn::Linear(13, 8), torch::nn::Tanh(), torch::nn::Linear(8, 5), torch::nn::Tanh(),
                              torch::nn::Linear(5, 3));
  other->to(torch::kDouble);
  expect_load_fails(path_, {path_, "does not fit", "'0.weight'", "[8, 13]"}, other);
  // The right shapes under another model name.
  auto m = make_seq(99);
  auto opt = make_optimizer(m->parameters(), adamw());
  EXPECT_THROW(load_checkpoint(path_, *m, *opt, 0, {"cnn", true}), std::runtime_error);
}

TEST_F(CheckpointErrors, KeepsTheNewestK) {
  CheckpointSaveOptions so;
  so.keep = 2;
  for (int64_t s : {3, 4, 5}) save_checkpoint(root_, meta_at(s, "single"), *model_, *opt_, *comm_, so);
  int n = 0;
  for (auto& e : ckpt::list_dir(root_)) n += e.rfind("step-", 0) == 0;
  EXPECT_EQ(n, 2);
  EXPECT_EQ(latest_checkpoint(root_), root_ + "/step-00000005");
  EXPECT_FALSE(ckpt::exists(root_ + "/step-00000003"));
}

// A save killed (SIGKILL, in a forked child) after its shard or its manifest was written:
// the previous checkpoint stays the latest and loads; the next save cleans up and succeeds.
TEST_F(CheckpointErrors, KillDuringSaveKeepsThePrevious) {
  for (std::string stage : {"shard-written", "manifest-written"}) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      CheckpointSaveOptions so;
      so.on_stage = [stage](const std::string& s) {
        if (s == stage) ::raise(SIGKILL);
      };
      try {
        save_checkpoint(root_, meta_at(7, "single"), *model_, *opt_, *tandem::make_self_communicator(CommOptions{}),
                        so);
      } catch (...) {
      }
      ::_exit(0);  // not reached when the hook killed it
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << stage;
    EXPECT_TRUE(ckpt::exists(root_ + "/.tmp-step-00000007")) << "the killed save left no partial directory";
    EXPECT_EQ(latest_checkpoint(root_), path_) << stage;
    auto m = make_seq(99);
    auto opt = make_optimizer(m->parameters(), adamw());
    EXPECT_EQ(load_checkpoint(latest_checkpoint(root_), *m, *opt, 0).step, 2);
  }
  save_checkpoint(root_, meta_at(7, "single"), *model_, *opt_, *comm_);
  EXPECT_EQ(latest_checkpoint(root_), root_ + "/step-00000007");
  EXPECT_FALSE(ckpt::exists(root_ + "/.tmp-step-00000007"));
}

// An asynchronous save is a snapshot: changing the model after save() returns does not change
// what finish() commits, which is byte for byte what a synchronous save writes. Until finish()
// the previous checkpoint stays the newest, and the handle takes no second save.
TEST_F(CheckpointErrors, AsyncSaveIsASnapshot) {
  const std::string sync_root = root_ + "/sync", async_root = root_ + "/async";
  const auto sync_dir = save_checkpoint(sync_root, meta_at(5, "single"), *model_, *opt_, *comm_);
  save_checkpoint(async_root, meta_at(2, "single"), *model_, *opt_, *comm_);
  CheckpointSaveOptions so;
  so.async = std::make_shared<AsyncCheckpoint>();
  const auto dir = save_checkpoint(async_root, meta_at(5, "single"), *model_, *opt_, *comm_, so);
  EXPECT_TRUE(so.async->pending());
  EXPECT_EQ(latest_checkpoint(async_root), async_root + "/step-00000002");
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model_->parameters()) p.add_(1.0);
  }
  EXPECT_THROW(save_checkpoint(async_root, meta_at(6, "single"), *model_, *opt_, *comm_, so), std::invalid_argument);
  EXPECT_TRUE(so.async->all_written(*comm_) || !so.async->written());
  EXPECT_EQ(so.async->finish(*comm_), dir);
  EXPECT_FALSE(so.async->pending());
  EXPECT_EQ(latest_checkpoint(async_root), dir);
  for (const char* f : {"manifest.json", "shard-00000-of-00001.bin"}) {
    EXPECT_EQ(ckpt::read_all(sync_dir + "/" + f), ckpt::read_all(dir + "/" + f)) << f;
  }
  EXPECT_THROW(so.async->finish(*comm_), std::logic_error);
}

// A process killed while its asynchronous save writes, or after save() returned and before
// finish(): the previous checkpoint stays the newest and loads; the next save succeeds.
TEST_F(CheckpointErrors, KillDuringAsyncSaveKeepsThePrevious) {
  for (bool in_writer : {true, false}) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      CheckpointSaveOptions so;
      so.async = std::make_shared<AsyncCheckpoint>();
      if (in_writer) {
        so.on_stage = [](const std::string& s) {
          if (s == "shard-written") ::raise(SIGKILL);
        };
      }
      try {
        auto self = tandem::make_self_communicator(CommOptions{});
        save_checkpoint(root_, meta_at(7, "single"), *model_, *opt_, *self, so);
        if (!in_writer) ::raise(SIGKILL);
        so.async->finish(*self);
      } catch (...) {
      }
      ::_exit(0);  // not reached when it was killed
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << in_writer;
    EXPECT_EQ(latest_checkpoint(root_), path_) << in_writer;
    auto m = make_seq(99);
    auto opt = make_optimizer(m->parameters(), adamw());
    EXPECT_EQ(load_checkpoint(latest_checkpoint(root_), *m, *opt, 0).step, 2);
  }
  CheckpointSaveOptions so;
  so.async = std::make_shared<AsyncCheckpoint>();
  save_checkpoint(root_, meta_at(7, "single"), *model_, *opt_, *comm_, so);
  EXPECT_EQ(so.async->finish(*comm_), root_ + "/step-00000007");
  EXPECT_EQ(latest_checkpoint(root_), root_ + "/step-00000007");
  EXPECT_FALSE(ckpt::exists(root_ + "/.tmp-step-00000007"));
}

// The manifest's pieces of a tensor edited (the one whole piece of a replicated save split into
// two flat ranges first, which loads as it is): pieces that leave an element out, hold one twice
// or lie outside the tensor are refused naming the tensor and the shard file, before anything
// changes.
class CheckpointPieceErrors : public CheckpointErrors {
 protected:
  static constexpr const char* kKey = "param/0.weight";  // [9, 13]: 117 elements
  void edit_pieces(const std::function<void(nlohmann::json& pieces)>& f) {
    const auto path = path_ + "/manifest.json";
    auto j = nlohmann::json::parse(ckpt::read_all(path));
    int found = 0;
    for (auto& t : j.at("layout").at("tensors")) {
      if (t.at("key") != kKey) continue;
      auto& pieces = t.at("pieces");
      ASSERT_EQ(pieces.size(), 1u) << pieces.dump();
      f(pieces);
      ++found;
    }
    ASSERT_EQ(found, 1) << kKey << " in " << j.at("layout").dump();
    ckpt::write_synced(path, j.dump(1));
  }
  // Elements [begin, end) of the tensor, from the same entry of the same shard.
  static nlohmann::json range(const nlohmann::json& whole, int64_t begin, int64_t end) {
    auto p = whole;
    p["offset"] = whole.at("offset").get<int64_t>() + begin;
    p["flat"] = {begin, end};
    return p;
  }
  void expect_refused(const std::string& what) {
    const std::string shard_name = shard_.substr(shard_.rfind('/') + 1);
    expect_load_fails(path_, {kKey, shard_name});
    SCOPED_TRACE(what);
    try {
      read_full_checkpoint(path_);
      ADD_FAILURE() << "read_full_checkpoint accepted it";
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(kKey), std::string::npos) << msg;
      EXPECT_NE(msg.find(shard_name), std::string::npos) << msg;
    }
  }
};

TEST_F(CheckpointPieceErrors, TwoRangesLoad) {
  edit_pieces([](nlohmann::json& ps) { ps = {range(ps[0], 0, 50), range(ps[0], 50, 117)}; });
  auto m = make_seq(99);
  auto opt = make_optimizer(m->parameters(), adamw());
  load_checkpoint(path_, *m, *opt, 0, {"seq13", true});
  auto a = model_->parameters(), b = m->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
}

TEST_F(CheckpointPieceErrors, PieceDropped) {
  edit_pieces([](nlohmann::json& ps) { ps = {range(ps[0], 0, 50)}; });
  expect_refused("elements 50-116 in no piece");
}

TEST_F(CheckpointPieceErrors, PiecesOverlap) {
  edit_pieces([](nlohmann::json& ps) { ps = {range(ps[0], 0, 50), range(ps[0], 50, 117), range(ps[0], 40, 60)}; });
  expect_refused("elements 40-59 in two pieces");
}

TEST_F(CheckpointPieceErrors, PieceOutsideTheTensor) {
  // The whole local [9, 13] said to lie at global row 1: its last row falls outside the tensor's
  // 9 rows (the piece's box disagrees with the tensor's global shape).
  edit_pieces([](nlohmann::json& ps) {
    ps[0]["blocks"] = {{{"local", {0, 0}}, {"global", {1, 0}}, {"shape", {9, 13}}}};
  });
  expect_refused("a box outside the global shape");
}

TEST_F(CheckpointPieceErrors, PieceOfAnotherShape) {
  // The piece's local tensor [13, 9] (same elements) against the tensor's [9, 13].
  edit_pieces([](nlohmann::json& ps) {
    ps[0]["local_shape"] = {13, 9};
    ps[0]["blocks"] = {{{"local", {0, 0}}, {"global", {0, 0}}, {"shape", {13, 9}}}};
  });
  expect_refused("a piece of another shape");
}

}  // namespace
}  // namespace tandem::test
