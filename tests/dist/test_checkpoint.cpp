// Sharded checkpoints (tandem/checkpoint.h): bitwise resume in the same configuration,
// resharding across world sizes and strategies (ZeRO-2 on N -> ZeRO-3 on 2 -> DDP on 1 ->
// ZeRO-1 on N) against an uninterrupted single-process reference, and bad input: corrupted
// and truncated shards, a damaged manifest, missing files, another model, and a save killed
// midway (fork + SIGKILL), each leaving what existed untouched. Pipeline stages (one stage per
// rank, each writing its own) resume bitwise as stages and continue in one process. A
// tensor-parallel transformer's checkpoint (gathered) equals a dense run's state and loads back
// into shards exactly.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>

#include "checkpoint/shard_io.h"
#include "tandem/backends.h"
#include "tandem/checkpoint.h"
#include "tandem/ddp.h"
#include "tandem/grid.h"
#include "tandem/models.h"
#include "tandem/optim.h"
#include "tandem/pipeline.h"
#include "tandem/tensor_parallel.h"
#include "tandem/zero.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
// The per-layout forms (pipeline stages, ZeRO, tensor parallel) the Engine calls.
using namespace ::tandem::detail;
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

OptimizerOptions adamw() {
  OptimizerOptions o;
  o.kind = "adamw";
  o.lr = 1e-2;
  o.weight_decay = 0.01;
  return o;
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

std::vector<double> train_zero(ZeroDataParallel& z, Communicator& comm, int64_t from, int64_t k) {
  std::vector<double> out;
  for (int64_t s = from; s < from + k; ++s) {
    out.push_back(step_on_slice(comm, s, [&](const torch::Tensor& x, const torch::Tensor& y) {
      z.prepare_forward();
      z.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(z.forward(x), y);
      loss.backward();
      z.step();
      return loss.item<double>();
    }));
  }
  return out;
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

CheckpointMeta meta_at(int64_t step, const std::string& strategy) {
  CheckpointMeta m;
  m.model = "seq13";
  m.model_description = "13-9-5-3 tanh MLP, float64";
  m.strategy = strategy;
  m.step = step;
  return m;
}

ZeroOptions zero_opts(int stage, const OptimizerOptions& o) {
  ZeroOptions z;
  z.stage = stage;
  z.optimizer = o;
  z.bucket_cap_bytes = 400;  // several buckets, each padded
  return z;
}

bool same_state(const ZeroShardState& a, const ZeroShardState& b) {
  if (a.buckets.size() != b.buckets.size() || a.optimizer_step != b.optimizer_step) return false;
  for (size_t i = 0; i < a.buckets.size(); ++i) {
    if (a.buckets[i].slots.size() != b.buckets[i].slots.size()) return false;
    for (auto& [k, v] : a.buckets[i].slots) {
      auto it = b.buckets[i].slots.find(k);
      if (it == b.buckets[i].slots.end() || !torch::equal(v, it->second)) return false;
    }
  }
  return true;
}

// ---- same configuration: bitwise

class CheckpointResume : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointResume, ZeroContinuesBitwise) {
  const int stage = GetParam();
  auto comm = world();
  const auto dir = shared_dir(*comm, "ckpt_bitwise");
  for (auto o : {adamw(), sgd_momentum()}) {
    ZeroDataParallel a(make_seq(7).ptr(), comm, zero_opts(stage, o));
    train_zero(a, *comm, 0, 3);
    auto path = save_checkpoint(dir, meta_at(3, "zero" + std::to_string(stage)), a, *comm);
    train_zero(a, *comm, 3, 3);

    ZeroDataParallel b(make_seq(99).ptr(), comm, zero_opts(stage, o));  // other initial values
    auto meta = load_checkpoint(path, b, comm->rank());
    EXPECT_EQ(meta.step, 3);
    EXPECT_EQ(meta.world_size, comm->size());
    train_zero(b, *comm, 3, 3);
    EXPECT_TRUE(same_state(a.shard_state(), b.shard_state())) << "stage " << stage << " " << o.kind;
  }
  comm->barrier();
  if (comm->rank() == 0) ckpt::remove_tree(dir);
}

TEST_P(CheckpointResume, DdpContinuesBitwise) {
  if (GetParam() != 1) GTEST_SKIP() << "once is enough";
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
  for (auto prec : {Precision::kBF16, Precision::kFP16}) {
    auto opts = [&](int stage) {
      auto z = zero_opts(stage, adamw());
      z.precision = prec;
      z.loss_scaler.init_scale = 1024.0;
      z.loss_scaler.growth_interval = 2;  // the scale changes within the run
      return z;
    };
    auto fp32_seq = [](uint64_t seed) {
      auto m = make_seq(seed);
      m->to(torch::kFloat);
      return m;
    };
    auto train = [&](ZeroDataParallel& z, int64_t from, int64_t k) {
      for (int64_t s = from; s < from + k; ++s) {
        step_on_slice(*comm, s, [&](const torch::Tensor& x, const torch::Tensor& y) {
          z.prepare_forward();
          z.zero_grad();
          auto loss = torch::nn::functional::cross_entropy(z.forward(x.to(compute_dtype(prec))).to(torch::kFloat), y);
          z.scale_loss(loss).backward();
          z.step();
          return loss.item<double>();
        });
      }
    };
    ZeroDataParallel a(fp32_seq(7).ptr(), comm, opts(2));
    train(a, 0, 3);
    auto meta = meta_at(3, "zero2");
    meta.precision = precision_name(prec);
    meta.loss_scale = a.loss_scaler().scale();
    meta.loss_scale_good_steps = a.loss_scaler().overflow_free_steps();
    auto path = save_checkpoint(dir, meta, a, *comm);
    train(a, 3, 3);
    for (int stage : {2, 3}) {
      ZeroDataParallel b(fp32_seq(99).ptr(), comm, opts(stage));
      load_checkpoint(path, b, comm->rank());
      EXPECT_EQ(b.loss_scaler().scale(), meta.loss_scale);
      train(b, 3, 3);
      EXPECT_EQ(a.loss_scaler().scale(), b.loss_scaler().scale()) << precision_name(prec);
      if (stage == 2) {
        EXPECT_TRUE(same_state(a.shard_state(), b.shard_state())) << precision_name(prec);
      } else {
        // Another stage has other buckets: compare the assembled masters by name.
        auto pa = read_full_checkpoint(save_checkpoint(dir + "/a", meta_at(6, "zero2"), a, *comm));
        auto pb = read_full_checkpoint(save_checkpoint(dir + "/b", meta_at(6, "zero3"), b, *comm));
        for (auto& [n, v] : pa.params)
          EXPECT_TRUE(torch::equal(v, pb.params.at(n))) << n << " " << precision_name(prec);
        for (auto& [n, st] : pa.optim)
          EXPECT_TRUE(torch::equal(st.slots.at("exp_avg"), pb.optim.at(n).slots.at("exp_avg"))) << n;
      }
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
    ZeroDataParallel z(make_seq(7).ptr(), comm, zero_opts(2, o));
    near(train_zero(z, *comm, 0, K), 0, "zero2 on N");
    save_checkpoint(dir + "/a", meta_at(K, "zero2"), z, *comm);
  }
  // B: ZeRO-3 on ranks 0 and 1, steps K..2K.
  auto two = comm->split(rank < 2 ? 0 : -1, rank);
  if (two) {
    ZeroDataParallel z(make_seq(99).ptr(), two, zero_opts(3, o));
    auto meta = load_checkpoint(latest_checkpoint(dir + "/a"), z, two->rank());
    EXPECT_EQ(meta.world_size, N);
    EXPECT_EQ(meta.step, K);
    near(train_zero(z, *two, K, K), K, "zero3 on 2");
    save_checkpoint(dir + "/b", meta_at(2 * K, "zero3"), z, *two);
  }
  comm->barrier();
  // C: DDP on rank 0 alone, steps 2K..3K.
  auto one = comm->split(rank == 0 ? 0 : -1, 0);
  if (one) {
    auto m = make_seq(99);
    auto opt = make_optimizer(m->parameters(), o);
    DistributedDataParallel ddp(m.ptr(), one);
    load_checkpoint(latest_checkpoint(dir + "/b"), *m, *opt, 0);
    near(train_ddp(m, ddp, *opt, *one, 2 * K, K), 2 * K, "ddp on 1");
    save_checkpoint(dir + "/c", meta_at(3 * K, "ddp"), *m, *opt, *one);
  }
  comm->barrier();
  // D: ZeRO-1 on all N ranks from the replicated checkpoint, steps 3K..4K.
  {
    ZeroDataParallel z(make_seq(99).ptr(), comm, zero_opts(1, o));
    load_checkpoint(latest_checkpoint(dir + "/c"), z, rank);
    near(train_zero(z, *comm, 3 * K, K), 3 * K, "zero1 on N");
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

// One pipeline stage per rank (each rank writes its stage), K steps; the stages reload their
// own parameters bit for bit, one process continues from the checkpoint as the reference does,
// and a save with a stage nobody writes is refused on every rank.
TEST(CheckpointReshard, PipelineStagesToOneProcess) {
  auto comm = world();
  const int rank = comm->rank();
  const int64_t K = 3;
  const auto o = adamw();
  const auto ref = reference_losses(o, 2 * K);
  const auto dir = shared_dir(*comm, "ckpt_pipeline");
  PipelineOptions po;
  po.micro_batches = 2;
  auto loss_fn = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  std::vector<torch::Tensor> trained;
  {
    Pipeline pipe(make_seq(7), comm, po);
    auto opt = make_optimizer(pipe.parameters(), o);
    for (int64_t s = 0; s < K; ++s) {
      auto [x, y] = batch_of_step(s);
      opt->zero_grad();
      const double l = pipe.train_step(x, y, loss_fn).item<double>();
      opt->step();
      EXPECT_NEAR(l, ref[s], 1e-9) << "pipeline step " << s;
    }
    save_checkpoint(dir, meta_at(K, "pp"), pipe, *opt, /*writer=*/true, *comm);
    for (auto& p : pipe.parameters()) trained.push_back(p.detach().clone());
    if (comm->size() > 1) {
      EXPECT_THROW(save_checkpoint(dir, meta_at(K + 1, "pp"), pipe, *opt, rank == 0, *comm), std::invalid_argument);
    }
  }
  const auto path = latest_checkpoint(dir);
  EXPECT_EQ(path, dir + "/step-00000003");
  {
    Pipeline pipe(make_seq(99), comm, po);
    auto opt = make_optimizer(pipe.parameters(), o);
    load_checkpoint(path, pipe, *opt, rank);
    auto got = pipe.parameters();
    ASSERT_EQ(got.size(), trained.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], trained[i])) << "stage parameter " << i;
  }
  comm->barrier();
  if (rank == 0) {
    EXPECT_EQ(continue_in_one_process(path, o, ref, K, "the pipeline").world_size, comm->size());
    ckpt::remove_tree(dir);
  }
  comm->barrier();
}

// Interleaved 1F1B over pp 2 x 2 virtual stages (each rank's chunks hold non-adjacent layers;
// on 4 ranks two identical replicas, one writer per stage): the checkpoint names the whole
// model's layers, so it resumes into contiguous 1F1B stages and into one process, and both
// continue as the reference does.
TEST(CheckpointReshard, InterleavedStagesResumeIntoOtherLayouts) {
  auto w = world();
  ASSERT_EQ(w->size() % 2, 0) << "run on an even number of ranks";
  ProcessGrid g(w, /*tp=*/1, /*pp=*/2);
  const int64_t K = 3;
  const auto o = adamw();
  const auto ref = reference_losses(o, 2 * K);
  const auto dir = shared_dir(*w, "interleaved");
  auto loss_fn = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  auto train = [&](Pipeline& pipe, torch::optim::Optimizer& opt, int64_t from, const char* phase) {
    for (int64_t s = from; s < from + K; ++s) {
      auto [x, y] = batch_of_step(s);
      opt.zero_grad();
      const double l = pipe.train_step(x, y, loss_fn).item<double>();
      opt.step();
      EXPECT_NEAR(l, ref[s], 1e-9) << phase << " step " << s;
    }
  };
  {
    PipelineOptions po;
    po.schedule = PipelineSchedule::kInterleaved;
    po.virtual_stages = 2;
    po.micro_batches = 4;
    Pipeline pipe(make_seq(7), g.pp(), po);
    ASSERT_EQ(pipe.layer_ranges().size(), 2u);
    auto opt = make_optimizer(pipe.parameters(), o);
    train(pipe, *opt, 0, "interleaved");
    save_checkpoint(dir, meta_at(K, "pp2 interleaved v2"), pipe, *opt, g.dp_rank() == 0, *w);
  }
  const auto path = latest_checkpoint(dir);
  {
    PipelineOptions po;
    po.micro_batches = 2;
    Pipeline pipe(make_seq(99), g.pp(), po);
    auto opt = make_optimizer(pipe.parameters(), o);
    load_checkpoint(path, pipe, *opt, w->rank());
    train(pipe, *opt, K, "1f1b after interleaved");
  }
  w->barrier();
  if (w->rank() == 0) {
    continue_in_one_process(path, o, ref, K, "interleaved");
    ckpt::remove_tree(dir);
  }
  w->barrier();
}

// A transformer split over every rank (tp = world, heads and the fused qkv cut per head): two
// AdamW steps, a checkpoint of the gathered whole; it equals a dense run's state in one process,
// and loads back into another tensor-parallel model shard for shard, optimizer state included.
TEST(CheckpointReshard, TensorParallelTransformer) {
  auto comm = world();
  const int rank = comm->rank();
  const auto c = small_lm();
  auto make = [&](uint64_t seed) {
    torch::manual_seed(seed);
    auto m = models::transformer(c);
    m->to(torch::kDouble);
    return m;
  };
  auto g = at::detail::createCPUGenerator(12);
  auto ids = torch::randint(0, c.vocab, {3, 6}, g);
  auto tgt = torch::randint(0, c.vocab, {3, 6}, g);
  auto ce = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
  };
  const auto o = adamw();
  auto train2 = [&](torch::nn::Sequential m, torch::optim::Optimizer& opt) {
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      ce(m->forward(ids), tgt).backward();
      opt.step();
    }
  };
  auto par = tp::tensor_parallel(make(5), comm);
  auto opt = make_optimizer(par->parameters(), o);
  train2(par, *opt);
  const auto dir = shared_dir(*comm, "ckpt_tp");
  auto state = [&](torch::nn::Sequential p, torch::nn::Sequential dense, torch::optim::Optimizer& o) {
    TensorParallelState s;
    s.parallel = p.ptr();
    s.dense = dense.ptr();
    s.tp = comm;
    s.opt = &o;
    return s;
  };
  const auto path = save_tensor_parallel_checkpoint(dir, meta_at(2, "tp"), state(par, make(99), *opt), *comm);
  EXPECT_EQ(path, dir + "/step-00000002");
  if (rank == 0) {  // whole, as a dense run in one process left it
    auto dense = make(5);
    auto dopt = make_optimizer(dense->parameters(), o);
    train2(dense, *dopt);
    auto loaded = make(98);
    auto lopt = make_optimizer(loaded->parameters(), o);
    load_checkpoint(path, *loaded, *lopt, 0);
    auto want = dense->named_parameters();
    for (auto& kv : loaded->named_parameters()) {
      EXPECT_LE((kv.value() - want[kv.key()]).abs().max().item<double>(), 1e-9) << kv.key();
      auto a = get_param_state(*lopt, kv.value()), b = get_param_state(*dopt, want[kv.key()]);
      EXPECT_EQ(a.step, b.step) << kv.key();
      for (auto& [k, v] : b.slots)
        EXPECT_LE((a.slots.at(k) - v).abs().max().item<double>(), 1e-9) << k << " of " << kv.key();
    }
  }
  {  // back into shards: every one as it was saved
    auto par2 = tp::tensor_parallel(make(77), comm);
    auto opt2 = make_optimizer(par2->parameters(), o);
    load_tensor_parallel_checkpoint(path, state(par2, make(98), *opt2), rank);
    auto want = par->parameters(), got = par2->parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i], want[i])) << "shard " << i;
      auto a = get_param_state(*opt2, got[i]), b = get_param_state(*opt, want[i]);
      EXPECT_EQ(a.step, b.step);
      ASSERT_EQ(a.slots.size(), b.slots.size());
      for (auto& [k, v] : b.slots) EXPECT_TRUE(torch::equal(a.slots.at(k), v)) << k << " of shard " << i;
    }
    // A scratch model of another shape is refused, naming the parameter; nothing is changed.
    auto other = c;
    other.mlp_ratio = 4;
    torch::manual_seed(1);
    auto wrong = models::transformer(other);
    wrong->to(torch::kDouble);
    try {
      load_tensor_parallel_checkpoint(path, state(par2, wrong, *opt2), rank);
      ADD_FAILURE() << "a dense model of another shape was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("fc1.weight"), std::string::npos) << e.what();
    }
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(torch::equal(got[i], want[i])) << "shard " << i << " after the refusal";
  }
  comm->barrier();
  if (rank == 0) ckpt::remove_tree(dir);
  comm->barrier();
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

}  // namespace
}  // namespace tandem::test
