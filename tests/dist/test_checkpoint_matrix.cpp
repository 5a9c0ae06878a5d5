// Checkpoints between every pair of layouts: one process, DDP x2, ZeRO-1 x2, ZeRO-3 x3, tp2, pp2,
// tp2 x pp2 under ZeRO-3 (4 ranks) and two replica threads of one process (ZeRO-2 over the thread
// backend). Each layout trains K steps from the same initial values and saves; every layout then
// loads every checkpoint in turn (into an engine of other values at first, then into the one the
// previous checkpoint left) and holds exactly what a single process that loads the checkpoint
// holds: the parameters (fp64) and Adam's moments and step bit for bit, compared through a new
// save of it, and the data position (step, epoch, batches of the epoch). Its next steps, on the
// batches that position names, follow that process's losses within 1e-6 (float64: only the
// summation order differs). Runs on 4 ranks; a layout of fewer workers runs on ranks 0.. over a
// communicator of its own while the others wait.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/shard_io.h"
#include "tandem/backends.h"
#include "tandem/checkpoint.h"
#include "tandem/engine.h"
#include "tandem/optim.h"
#include "tandem/replicas.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

constexpr int64_t kBatch = 24;  // splits over 1, 2 and 3 replicas, and into 2 micro-batches
constexpr int64_t kSaved = 2;   // steps before the save
constexpr int64_t kNext = 3;    // steps after each load
constexpr int64_t kEpoch = 3, kStepInEpoch = 1;
const std::string kModel = "mlp13";

// float64; the Linear widths are even so that tp2 cuts every one (pairs 0|2 and 4|6 as column-
// then row-parallel), and seven children give pp2 two stages.
torch::nn::Sequential make_mlp(uint64_t seed) {
  std::lock_guard<std::mutex> lk(default_generator_mutex());  // replica threads share the generator
  torch::manual_seed(seed);
  torch::nn::Sequential s(torch::nn::Linear(13, 10), torch::nn::Tanh(), torch::nn::Linear(10, 8), torch::nn::Tanh(),
                          torch::nn::Linear(8, 6), torch::nn::Tanh(), torch::nn::Linear(6, 3));
  s->to(torch::kDouble);
  return s;
}

std::pair<torch::Tensor, torch::Tensor> batch_of_step(int64_t step) {
  auto [x, y] = global_batch(kBatch, 2000 + step, 3);
  return {x.to(torch::kDouble), y};
}

const LossFn kCrossEntropy = [](const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
};

struct Layout {
  std::string name;
  int workers = 1;
  bool threads = false;  // two replica threads of rank 0 instead of ranks [0, workers)
  ParallelConfig config;
};

std::vector<Layout> layouts() {
  auto make = [](std::string name, int workers, Strategy s, int tp = 1, int pp = 1) {
    Layout l;
    l.name = std::move(name);
    l.workers = workers;
    l.config.strategy = s;
    l.config.tp = tp;
    l.config.pp = pp;
    l.config.micro_batches = pp > 1 ? 2 : 1;
    return l;
  };
  auto replicas = make("replicas2_zero2", 2, Strategy::kZero2);
  replicas.threads = true;
  return {make("single", 1, Strategy::kSingle),
          make("ddp2", 2, Strategy::kDDP),
          make("zero1x2", 2, Strategy::kZero1),
          make("zero3x3", 3, Strategy::kZero3),
          make("tp2", 2, Strategy::kDDP, 2),
          make("pp2", 2, Strategy::kDDP, 1, 2),
          make("tp2pp2_zero3", 4, Strategy::kZero3, 2, 2),
          replicas};
}

// Runtimes over ranks [0, n) of the job, for n = 1 .. world size (collective: every rank splits).
std::map<int, std::unique_ptr<Runtime>> sub_runtimes() {
  auto w = world();
  std::map<int, std::unique_ptr<Runtime>> out;
  for (int n = 1; n < w->size(); ++n) {
    auto c = w->split(w->rank() < n ? 0 : -1, w->rank());
    if (c) out[n] = std::make_unique<Runtime>(placement_over(c));
  }
  return out;
}

// fn on every worker of `l`, on ranks [0, l.workers) or on two replica threads of rank 0 (each
// a Runtime of its own over the thread backend, as run_replicas makes them without a launcher);
// the other ranks wait at `gate`. Collective over the job.
void on_layout(const Layout& l, std::map<int, std::unique_ptr<Runtime>>& rts, Communicator& gate,
               const std::function<void(Runtime&)>& fn) {
  const int rank = gate.rank();
  if (l.threads && rank == 0) {
    CommOptions co;
    co.timeout = kTestTimeout;
    auto comms = make_thread_communicators(2, co);
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        try {
          ReplicaPlacement p;
          p.info.rank = p.info.local_rank = r;
          p.info.world_size = p.info.local_size = 2;
          p.info.launcher = "threads";
          p.threads = 1;
          p.world = p.cpu_world = comms[r];
          HostInfo host = runtime().hosts().at(0);
          host.ranks = {0, 1};
          p.hosts = {host};
          p.host_of = {0, 0};
          Runtime rt(std::move(p));
          comms[r]->barrier();
          fn(rt);
        } catch (const std::exception& e) {
          errors[r] = e.what();
          abort_thread_group(*comms[r], std::string("replica failed: ") + e.what());
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << l.name << ", replica " << r;
  } else if (!l.threads && rank < l.workers) {
    try {
      fn(l.workers == gate.size() ? runtime() : *rts.at(l.workers));
    } catch (const std::exception& e) {
      ADD_FAILURE() << l.name << ", rank " << rank << ": " << e.what();
    }
  }
  gate.barrier();
}

// Steps [from, from + k) of the global batches (each replica its slice); the global mean losses.
std::vector<double> train(Engine& eng, int64_t from, int64_t k) {
  std::vector<double> out;
  for (int64_t s = from; s < from + k; ++s) {
    auto [x, y] = batch_of_step(s);
    auto xs = slice_for_rank(x, eng.dp_rank(), eng.dp_size()), ys = slice_for_rank(y, eng.dp_rank(), eng.dp_size());
    auto l = eng.step(xs, ys, kCrossEntropy).detach().to(torch::kCPU, torch::kDouble).reshape({1}).clone();
    eng.world()->allreduce(l, ReduceOp::kAvg);
    out.push_back(l.item<double>());
  }
  return out;
}

// One process, plain LibTorch, the whole batch.
std::vector<double> train_one(torch::nn::Sequential m, torch::optim::Optimizer& opt, int64_t from, int64_t k) {
  std::vector<double> out;
  for (int64_t s = from; s < from + k; ++s) {
    auto [x, y] = batch_of_step(s);
    opt.zero_grad();
    auto loss = kCrossEntropy(m->forward(x), y);
    loss.backward();
    opt.step();
    out.push_back(loss.item<double>());
  }
  return out;
}

bool near(double got, double want, double rel) { return std::abs(got - want) <= rel * std::abs(want); }

// What a single process holds after loading one checkpoint, and its next losses.
struct Reference {
  FullCheckpoint state;                    // as read_full_checkpoint assembles it
  std::map<std::string, at::Tensor> held;  // the process's parameters after load_checkpoint
  std::map<std::string, ParamOptimizerState> moments;
  std::vector<double> next;
};

Reference reference_of(const std::string& dir) {
  Reference r;
  r.state = read_full_checkpoint(dir);
  auto m = make_mlp(99);
  auto opt = make_optimizer(m->parameters(), adamw());
  CheckpointLoadOptions lo;
  lo.expect_model = kModel;
  lo.restore_rng = false;
  const auto meta = load_checkpoint(dir, *m, *opt, 0, lo);
  for (auto& kv : m->named_parameters()) {
    r.held[kv.key()] = kv.value().detach().clone();
    auto st = get_param_state(*opt, kv.value());
    for (auto& [k, t] : st.slots) t = t.clone();  // the steps below change the optimizer's own
    r.moments[kv.key()] = st;
  }
  r.next = train_one(m, *opt, meta.step, kNext);
  return r;
}

TEST(CheckpointMatrix, EveryLayoutLoadsEveryOther) {
  auto w = world();
  if (w->size() != 4) GTEST_SKIP() << "runs on 4 ranks";
  const int rank = w->rank();
  const auto all = layouts();
  auto rts = sub_runtimes();
  auto gate = w->split(0, rank);  // the idle ranks wait here while a smaller layout works
  gate->set_timeout(std::chrono::minutes(5));
  const auto root = shared_dir(*w, "ckpt_matrix");

  // The uninterrupted run, one process.
  std::vector<double> uninterrupted;
  {
    auto m = make_mlp(7);
    auto opt = make_optimizer(m->parameters(), adamw());
    uninterrupted = train_one(m, *opt, 0, kSaved + kNext);
  }

  // 1. Every layout trains kSaved steps from the same values and saves.
  std::vector<std::string> dirs;
  for (const auto& a : all) {
    const std::string dir = root + "/" + a.name;
    on_layout(a, rts, *gate, [&](Runtime& rt) {
      EngineOptions eo;
      eo.model_name = kModel;
      Engine eng(rt, make_mlp(7), adamw(), a.config, eo);
      const auto losses = train(eng, 0, kSaved);
      for (int64_t s = 0; s < kSaved; ++s)
        EXPECT_TRUE(near(losses[s], uninterrupted[s], 1e-9)) << a.name << " step " << s << ": " << losses[s];
      CheckpointMeta meta;
      meta.step = kSaved;
      meta.epoch = kEpoch;
      meta.step_in_epoch = kStepInEpoch;
      meta.strategy = a.name;
      EXPECT_EQ(eng.save(dir, meta), dir + "/step-00000002") << a.name;
    });
    dirs.push_back(dir + "/step-00000002");
  }

  // 2. What one process holds after loading each (every rank alike, no communication).
  std::vector<Reference> refs;
  for (size_t i = 0; i < all.size(); ++i) {
    refs.push_back(reference_of(dirs[i]));
    const auto& r = refs.back();
    EXPECT_EQ(r.state.meta.world_size, all[i].workers) << all[i].name;
    for (auto& [n, v] : r.held) {
      EXPECT_EQ(v.scalar_type(), torch::kDouble) << all[i].name << ": " << n;
      EXPECT_TRUE(torch::equal(v, r.state.params.at(n))) << all[i].name << ": " << n;
    }
    for (int64_t k = 0; k < kNext; ++k) {
      EXPECT_TRUE(near(r.next[k], uninterrupted[kSaved + k], 1e-9))
          << all[i].name << ": one process from the checkpoint, step " << kSaved + k;
    }
  }

  // 3. Every layout loads every checkpoint.
  for (const auto& b : all) {
    on_layout(b, rts, *gate, [&](Runtime& rt) {
      EngineOptions eo;
      eo.model_name = kModel;
      Engine eng(rt, make_mlp(99), adamw(), b.config, eo);
      for (size_t i = 0; i < all.size(); ++i) {
        const std::string what = all[i].name + " -> " + b.name;
        const auto& ref = refs[i];
        const auto meta = eng.load(dirs[i]);
        EXPECT_EQ(meta.model, kModel) << what;
        EXPECT_EQ(meta.strategy, all[i].name) << what;
        EXPECT_EQ(meta.world_size, all[i].workers) << what;
        EXPECT_EQ(meta.step, kSaved) << what;
        EXPECT_EQ(meta.epoch, kEpoch) << what;
        EXPECT_EQ(meta.step_in_epoch, kStepInEpoch) << what;
        // The whole model's values (float64 as given, on every rank) are the reference's.
        const auto full = eng.full_parameters();
        EXPECT_EQ(full.size(), ref.held.size()) << what;
        for (auto& [n, v] : ref.held) EXPECT_TRUE(full.count(n) && torch::equal(full.at(n), v)) << what << ": " << n;
        // Saved again at once: the fp64 values and Adam's moments and step it holds, bit for bit.
        const auto again = eng.save(root + "/again/" + b.name + "/" + all[i].name, meta);
        if (rt.rank() == 0) {
          const auto st = read_full_checkpoint(again);
          EXPECT_EQ(st.params.size(), ref.held.size()) << what;
          for (auto& [n, v] : ref.held) {
            EXPECT_TRUE(st.params.count(n) && torch::equal(st.params.at(n), v)) << what << ": " << n;
            const auto& want = ref.moments.at(n);
            ASSERT_TRUE(st.optim.count(n)) << what << ": no optimizer state of " << n;
            EXPECT_EQ(st.optim.at(n).step, want.step) << what << ": " << n;
            EXPECT_EQ(st.optim.at(n).slots.size(), want.slots.size()) << what << ": " << n;
            for (auto& [k, t] : want.slots) {
              EXPECT_TRUE(st.optim.at(n).slots.count(k) && torch::equal(st.optim.at(n).slots.at(k), t))
                  << what << ": " << k << " of " << n;
            }
          }
          ckpt::remove_tree(root + "/again/" + b.name + "/" + all[i].name);
        }
        // The batches from the position it names, as the single process took them.
        const auto next = train(eng, meta.step, kNext);
        for (int64_t k = 0; k < kNext; ++k) {
          EXPECT_TRUE(near(next[k], ref.next[k], 1e-6))
              << what << ", step " << meta.step + k << ": " << next[k] << " against " << ref.next[k];
        }
      }
    });
  }
  w->barrier();
  if (rank == 0) ckpt::remove_tree(root);
}

}  // namespace
}  // namespace tandem::test
