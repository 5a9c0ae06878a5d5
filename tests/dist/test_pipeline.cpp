// Pipeline parallelism (tandem/pipeline.h) against single-process training of the same model:
// every stage's gradients after one micro-batched step (GPipe and 1F1B, several micro-batch
// counts, uneven partitions, an MLP and a causal transformer LM), losses over several SGD steps,
// forward-only output, partitions, bad input, and 1F1B's bounded activation memory on stage 0
// measured by MemoryMeter against GPipe's. Run with 2 and 4 ranks: one stage per rank. The
// interleaved schedule (PipelineInterleaved.*): several chunks per rank, the same gradients, and
// through the Engine the same losses as one worker, with data parallelism on 4 ranks. The
// zero-bubble schedules (PipelineZeroBubble.*): zb-h1 and zb-v give the same gradients and
// losses as one process (so as 1F1B), defer the linear layers' weight gradients to W, and
// compose with ZeRO and data parallelism through the Engine.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>

#include "tandem/engine.h"
#include "tandem/grid.h"
#include "tandem/models.h"
#include "tandem/pipeline.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

// 8 children: Linear-Tanh x3, Linear-Identity-ish (odd widths), float64.
torch::nn::Sequential make_mlp(uint64_t seed, int64_t width = 11) {
  torch::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(13, width), torch::nn::Tanh(), torch::nn::Linear(width, width),
                            torch::nn::Tanh(), torch::nn::Linear(width, width), torch::nn::Tanh(),
                            torch::nn::Linear(width, 7), torch::nn::Linear(7, 5));
  net->to(torch::kDouble);
  return net;
}

at::Tensor ce(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
}

// Gradients of the reference (whole model, whole batch, one process) by parameter name.
std::map<std::string, at::Tensor> reference_grads(torch::nn::Sequential ref, const at::Tensor& x, const at::Tensor& y) {
  for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
  ce(ref->forward(x), y).backward();
  std::map<std::string, at::Tensor> g;
  for (auto& np : ref->named_parameters()) g[np.key()] = np.value().grad().clone();
  return g;
}

void expect_stage_grads(Pipeline& pipe, const std::map<std::string, at::Tensor>& ref, double tol) {
  for (auto& np : pipe.stage_module()->named_parameters()) {
    auto it = ref.find(np.key());
    EXPECT_TRUE(it != ref.end()) << np.key();
    if (it == ref.end()) continue;
    EXPECT_TRUE(np.value().grad().defined()) << np.key();
    if (!np.value().grad().defined()) continue;
    EXPECT_LE(rel_err(np.value().grad(), it->second), tol) << "parameter " << np.key() << " on stage " << pipe.stage();
  }
}

// One process on a batch of 24: the batch, the MLP (seed 3), its gradients and loss.
struct MlpReference {
  at::Tensor x, y;
  torch::nn::Sequential net;
  std::map<std::string, at::Tensor> want;
  double want_loss;
};

MlpReference mlp_reference() {
  auto [x, y] = global_batch(24, 5, 5);
  x = x.to(torch::kDouble);
  auto ref = make_mlp(3);
  auto want = reference_grads(ref, x, y);
  const double loss = ce(ref->forward(x), y).item<double>();
  return {x, y, ref, want, loss};
}

TEST(Pipeline, MlpGradientsMatchSingleProcess) {
  auto comm = world();
  const int P = comm->size();
  auto [x, y, ref, want, want_loss] = mlp_reference();
  std::vector<std::vector<int64_t>> partitions = {{}};  // balanced by parameters
  // Uneven explicit partitions.
  if (P == 2) partitions.push_back({5, 3});
  if (P == 4) partitions.push_back({1, 4, 2, 1});
  for (auto sched : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
    for (int64_t m : {1, 3, 4, 8}) {
      for (auto& part : partitions) {
        SCOPED_TRACE(std::string(to_string(sched)) + ", " + std::to_string(m) + " micro-batches, partition " +
                     (part.empty() ? std::string("by parameters") : c10::str(c10::IntArrayRef(part))));
        PipelineOptions o;
        o.schedule = sched;
        o.micro_batches = m;
        o.partition = part;
        Pipeline pipe(make_mlp(3), comm, o);
        auto loss = pipe.train_step(x, y, ce);
        EXPECT_NEAR(loss.item<double>(), want_loss, 1e-12 * std::abs(want_loss));
        expect_stage_grads(pipe, want, 1e-10);
        // Exactly as many micro-batches alive at once as the schedule promises.
        const int64_t bound = sched == PipelineSchedule::kGPipe ? m : std::min<int64_t>(P - pipe.stage(), m);
        EXPECT_EQ(pipe.stats().peak_live_micro_batches, bound);
      }
    }
  }
}

TEST(Pipeline, TransformerGradientsMatchSingleProcess) {
  auto comm = world();
  models::TransformerConfig c;
  c.vocab = 17;
  c.d_model = 12;
  c.heads = 3;
  c.layers = 3;  // 6 children: embedding, 3 blocks, layer norm, LM head
  c.seq = 6;
  c.mlp_ratio = 2;
  auto make = [&] {
    torch::manual_seed(11);
    auto m = models::transformer(c);
    m->to(torch::kDouble);
    return m;
  };
  auto g = at::detail::createCPUGenerator(21);
  auto ids = torch::randint(0, c.vocab, {8, 6}, g);
  auto tgt = torch::randint(0, c.vocab, {8, 6}, g);
  auto ref = make();
  const auto want = reference_grads(ref, ids, tgt);
  for (auto sched :
       {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B, PipelineSchedule::kZBH1, PipelineSchedule::kZBV}) {
    // zb-v cuts the 6 children into 2 chunks per rank.
    if (sched == PipelineSchedule::kZBV && 2 * comm->size() > 6) continue;
    SCOPED_TRACE(to_string(sched));
    PipelineOptions o;
    o.schedule = sched;
    o.micro_batches = 4;
    Pipeline pipe(make(), comm, o);
    pipe.train_step(ids, tgt, ce);
    expect_stage_grads(pipe, want, 1e-10);
    if (sched != PipelineSchedule::kZBH1 && sched != PipelineSchedule::kZBV) continue;
    // The blocks' projections and the LM head defer their weight gradients to W: one W pass per
    // micro-batch for every chunk that holds one.
    int64_t with_linear = 0;
    for (auto [first, end] : pipe.layer_ranges()) {
      for (int64_t i = first; i < end; ++i) {
        if (ref->ptr(i)->as<models::TransformerBlockImpl>() || ref->ptr(i)->as<torch::nn::LinearImpl>()) {
          ++with_linear;
          break;
        }
      }
    }
    EXPECT_EQ(pipe.stats().weight_passes, 4 * with_linear);
  }
}

// Stages before the first parameter (a Flatten and a Tanh on stages of their own): no gradient
// goes back to them, and the first stage with parameters does not compute its input's. The
// gradients still match the reference, under both schedules.
TEST(Pipeline, NoGradientGoesBackToStagesWithoutParameters) {
  auto comm = world();
  const int P = comm->size();
  constexpr int64_t kWidth = 9, kIn = 13, kBatch = 24, kHeaderBytes = 11 * 8;  // header: 11 int64
  auto make = [&] {
    torch::manual_seed(17);
    torch::nn::Sequential net(torch::nn::Flatten(), torch::nn::Tanh(), torch::nn::Linear(kIn, kWidth),
                              torch::nn::Tanh(), torch::nn::Linear(kWidth, kWidth), torch::nn::Linear(kWidth, 5));
    net->to(torch::kDouble);
    return net;
  };
  auto [x, y] = global_batch(kBatch, 23, 5);
  x = x.to(torch::kDouble);
  auto ref = make();
  const auto want = reference_grads(ref, x, y);
  const double want_loss = ce(ref->forward(x), y).item<double>();
  // The first stage with parameters: 1 of 2 ({2, 4}), 2 of 4 ({1, 1, 2, 2}).
  const std::vector<int64_t> part = P == 2 ? std::vector<int64_t>{2, 4} : std::vector<int64_t>{1, 1, 2, 2};
  const int first_with_params = P == 2 ? 1 : 2;
  for (auto sched : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
    SCOPED_TRACE(to_string(sched));
    PipelineOptions o;
    o.schedule = sched;
    o.micro_batches = 4;
    o.partition = part;
    Pipeline pipe(make(), comm, o);
    auto loss = pipe.train_step(x, y, ce);
    EXPECT_NEAR(loss.item<double>(), want_loss, 1e-12 * std::abs(want_loss));
    expect_stage_grads(pipe, want, 1e-10);
    const auto& st = pipe.stats();
    if (pipe.stage() < first_with_params) {
      // Only the activations come in (none on stage 0): no gradient.
      const int64_t in = pipe.stage() == 0 ? 0 : kHeaderBytes + kBatch * kIn * 8;
      EXPECT_EQ(st.bytes_received, in) << "stage " << pipe.stage();
    } else if (pipe.stage() == first_with_params) {
      // Only its activations go out (none from the last stage): no input gradient.
      const int64_t out = pipe.is_last() ? 0 : kHeaderBytes + kBatch * kWidth * 8;
      EXPECT_EQ(st.bytes_sent, out) << "stage " << pipe.stage();
    }
  }
}

TEST(Pipeline, TrainingMatchesSingleProcessOverSteps) {
  auto comm = world();
  auto ref = make_mlp(8);
  auto net = make_mlp(8);
  PipelineOptions o;
  o.micro_batches = 4;
  Pipeline pipe(net, comm, o);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
  torch::optim::SGD opt(pipe.parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
  for (int step = 0; step < 6; ++step) {
    auto [x, y] = global_batch(16, 100 + step, 5);
    x = x.to(torch::kDouble);
    ref_opt.zero_grad();
    auto want = ce(ref->forward(x), y);
    want.backward();
    ref_opt.step();
    opt.zero_grad();
    auto got = pipe.train_step(x, y, ce);
    opt.step();
    EXPECT_LE(std::abs(got.item<double>() - want.item<double>()), 1e-10 * std::abs(want.item<double>()))
        << "step " << step;
  }
  // Forward-only output on the last stage equals the reference model's.
  auto [x, y] = global_batch(8, 999, 5);
  x = x.to(torch::kDouble);
  auto out = pipe.forward(x);
  EXPECT_EQ(out.defined(), pipe.is_last());
  if (pipe.is_last()) EXPECT_LE(rel_err(out, ref->forward(x).detach()), 1e-10);
}

TEST(Pipeline, PartitionsAndSchedules) {
  EXPECT_EQ(balance_partition({1, 1, 1, 1}, 2), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(balance_partition({10, 1, 1, 1, 1, 10}, 3), (std::vector<int64_t>{1, 4, 1}));
  EXPECT_EQ(balance_partition({5, 0, 0, 5}, 2), (std::vector<int64_t>{1, 3}));
  auto net = make_mlp(1, 40);  // 13*40+40 = 560, 1640, 1640, 287, 40
  EXPECT_EQ(partition_by_parameters(net, 2), (std::vector<int64_t>{3, 5}));
  // Every schedule runs each forward before its backward, and 1F1B never holds more than p - s.
  for (auto sched : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
    for (int p : {1, 2, 4}) {
      for (int s = 0; s < p; ++s) {
        for (int64_t m : {1, 2, 5, 8}) {
          auto ops = Pipeline::schedule_for(sched, s, p, m);
          EXPECT_EQ(static_cast<int64_t>(ops.size()), 2 * m);
          std::vector<int> state(m, 0);
          int64_t live = 0, peak = 0, next_f = 0, next_b = 0;
          for (const auto& op : ops) {
            const int64_t i = op.micro_batch;
            EXPECT_EQ(op.chunk, 0);
            if (op.forward()) {
              EXPECT_EQ(i, next_f++);
              EXPECT_EQ(state[i]++, 0);
              peak = std::max(peak, ++live);
            } else {
              EXPECT_EQ(i, next_b++);
              EXPECT_EQ(state[i]++, 1);
              --live;
            }
          }
          EXPECT_EQ(peak, sched == PipelineSchedule::kGPipe ? m : std::min<int64_t>(p - s, m));
        }
      }
    }
  }
  EXPECT_EQ(parse_pipeline_schedule("gpipe"), PipelineSchedule::kGPipe);
  EXPECT_THROW(parse_pipeline_schedule("zigzag"), std::invalid_argument);
}

TEST(Pipeline, PartitionByTimeIsTheSameOnEveryRank) {
  auto comm = world();
  auto net = make_mlp(2, 64);
  auto [x, y] = global_batch(16, 1, 5);
  auto parts = partition_by_time(net, x.to(torch::kDouble), comm->size(), *comm);
  EXPECT_NO_THROW(validate_partition(parts, static_cast<int64_t>(net->size()), comm->size()));
  auto mine = at::tensor(parts, at::kLong);
  auto all = at::empty({comm->size(), comm->size()}, at::kLong);
  comm->allgather(all, mine);
  for (int r = 0; r < comm->size(); ++r) EXPECT_TRUE(all[r].equal(mine)) << "rank " << r << " disagrees";
  for (auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());

  // Timing runs the layers in training mode; batch norm's running statistics must come out as
  // they went in (rank 0 times, the others do not: they would start from other buffers).
  torch::manual_seed(3);
  torch::nn::Sequential bn_net(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::ReLU(),
                               torch::nn::Linear(8, 2));
  std::vector<at::Tensor> before;
  for (auto& b : bn_net->buffers()) before.push_back(b.clone());
  auto bn_parts = partition_by_time(bn_net, torch::randn({16, 8}) * 3 + 1, 2, *comm);
  EXPECT_NO_THROW(validate_partition(bn_parts, 4, 2));
  auto after = bn_net->buffers();
  ASSERT_EQ(after.size(), before.size());
  for (size_t k = 0; k < after.size(); ++k) EXPECT_TRUE(after[k].equal(before[k])) << "buffer " << k << " changed";
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

TEST(Pipeline, BadInputFailsAtOnceWithAClearMessage) {
  auto comm = world();
  const int P = comm->size();
  // More stages than layers.
  expect_invalid([&] { Pipeline(torch::nn::Sequential(torch::nn::Linear(3, 3)), comm); },
                 {std::to_string(P) + " pipeline stages", "model of 1 layers", "use at most 1"});
  // A partition that does not cover the model (8 children).
  expect_invalid(
      [&] {
        PipelineOptions o;
        o.partition = std::vector<int64_t>(P, 1);
        Pipeline(make_mlp(1), comm, o);
      },
      {"covers " + std::to_string(P) + " layers", "model has 8", "add up to 8"});
  expect_invalid(
      [&] {
        PipelineOptions o;
        o.partition = {8};
        Pipeline(make_mlp(1), comm, o);
      },
      {"1 entries for " + std::to_string(P) + " stages"});
  expect_invalid(
      [&] {
        PipelineOptions o;
        o.partition = std::vector<int64_t>(P, 1);
        o.partition[0] = 0;
        o.partition[1] = 8 - (P - 2);
        Pipeline(make_mlp(1), comm, o);
      },
      {"stage 0 0 layers", "at least one layer"});
  // A batch not divisible into micro-batches: every stage that is given the batch says so.
  PipelineOptions o;
  o.micro_batches = 4;
  Pipeline pipe(make_mlp(1), comm, o);
  auto [x, y] = global_batch(10, 1, 5);
  expect_invalid([&] { pipe.train_step(x.to(torch::kDouble), y, ce); },
                 {"batch of 10", "not divisible into 4 micro-batches", "multiple of micro_batches"});
  o.micro_batches = 0;
  expect_invalid([&] { Pipeline(make_mlp(1), comm, o); }, {"micro_batches must be >= 1"});
}

// 1F1B keeps at most p micro-batches of activations on stage 0, GPipe all m: measured bytes.
TEST(Pipeline, OneFOneBBoundsStageZeroActivationMemory) {
  auto comm = world();
  const int P = comm->size();
  MemoryMeter::install();
  // Wide, shallow: activations (micro-batch 32 x 256 doubles = 64 KiB per tensor) dominate.
  auto make = [&] {
    torch::manual_seed(4);
    torch::nn::Sequential net;
    for (int s = 0; s < P; ++s) {
      net->push_back(torch::nn::Linear(s == 0 ? 13 : 256, 256));
      net->push_back(torch::nn::Tanh());
    }
    net->push_back(torch::nn::Linear(256, 5));
    net->to(torch::kDouble);
    return net;
  };
  std::map<std::pair<int, int64_t>, int64_t> bytes;  // (schedule, m) -> stage's peak bytes
  for (int64_t m : {4, 8}) {
    auto [x, y] = global_batch(32 * m, 9, 5);
    x = x.to(torch::kDouble);
    for (auto sched : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
      PipelineOptions o;
      o.schedule = sched;
      o.micro_batches = m;
      o.partition = std::vector<int64_t>(P, 2);
      o.partition.back() = 3;
      Pipeline pipe(make(), comm, o);
      pipe.train_step(x, y, ce);  // gradients allocated: the measured step allocates none
      for (auto& p : pipe.parameters()) p.grad().zero_();
      comm->barrier();
      pipe.train_step(x, y, ce);
      bytes[{static_cast<int>(sched), m}] = pipe.stats().peak_activation_bytes;
      EXPECT_GT(pipe.stats().peak_activation_bytes, 0);
      if (comm->rank() == 0) {
        std::printf("[ stage 0 ] %s, p=%d, m=%ld: peak %.1f KiB above the step's start, %ld micro-batches live\n",
                    to_string(sched), P, static_cast<long>(m), pipe.stats().peak_activation_bytes / 1024.0,
                    static_cast<long>(pipe.stats().peak_live_micro_batches));
      }
    }
  }
  if (comm->rank() == 0) {
    const double g4 = bytes[{0, 4}], g8 = bytes[{0, 8}], f4 = bytes[{1, 4}], f8 = bytes[{1, 8}];
    // GPipe's slope: bytes per extra micro-batch, at least the stage output kept for backward.
    const double slope = (g8 - g4) / 4, out_bytes = 32.0 * 256 * sizeof(double);
    EXPECT_GE(slope, 0.9 * out_bytes) << "GPipe m=4 " << g4 << " B, m=8 " << g8 << " B";
    // 1F1B does not grow with m (it holds min(p, m) micro-batches either way)...
    EXPECT_LT(std::abs(f8 - f4), 0.25 * slope) << "1F1B m=4 " << f4 << " B, m=8 " << f8 << " B";
    // ...and at m=8 holds p micro-batches where GPipe holds 8: it saves (8 - p) slopes.
    EXPECT_LE(f8, g8 - 0.9 * (8 - P) * slope) << "1F1B " << f8 << " B vs GPipe " << g8 << " B";
    std::printf("[ stage 0 ] %.1f KiB per micro-batch; at m=8 1F1B holds %.2f micro-batches fewer than GPipe "
                "(theory: 8 - p = %d)\n",
                slope / 1024, (g8 - f8) / slope, 8 - P);
  }
}

// Interleaved 1F1B: each rank's chunks (virtual stages r, r + p, ...) hold non-adjacent layers;
// after one step every chunk's gradients equal single-process ones, for several micro-batch
// counts, chunks per rank and partitions, and each rank holds as many micro-batches as
// Megatron-LM's schedule says: its warm-up forwards and one more.
TEST(PipelineInterleaved, GradientsMatchSingleProcess) {
  auto comm = world();
  const int P = comm->size();
  auto [x, y, ref, want, want_loss] = mlp_reference();
  std::vector<std::pair<int, std::vector<int64_t>>> cases = {{1, {}}, {2, {}}};  // (chunks, partition)
  if (P == 2) cases.insert(cases.end(), {{2, {1, 3, 2, 2}}, {4, {}}});
  for (auto& [v, part] : cases) {
    for (int64_t m : {P, 2 * P, 3 * P}) {
      SCOPED_TRACE(std::to_string(v) + " chunks per rank, " + std::to_string(m) + " micro-batches, partition " +
                   (part.empty() ? std::string("by parameters") : c10::str(c10::IntArrayRef(part))));
      PipelineOptions o;
      o.schedule = PipelineSchedule::kInterleaved;
      o.virtual_stages = v;
      o.micro_batches = m;
      o.partition = part;
      Pipeline pipe(make_mlp(3), comm, o);
      ASSERT_EQ(static_cast<int>(pipe.layer_ranges().size()), v);
      ASSERT_EQ(static_cast<int>(pipe.partition().size()), P * v);
      // Chunk c holds virtual stage c * P + rank: the layers after P - 1 other virtual stages.
      for (int c = 1; c < v; ++c) EXPECT_GT(pipe.layer_ranges()[c].first, pipe.layer_ranges()[c - 1].second);
      auto loss = pipe.train_step(x, y, ce);
      EXPECT_NEAR(loss.item<double>(), want_loss, 1e-12 * std::abs(want_loss));
      expect_stage_grads(pipe, want, 1e-10);
      const int64_t warmup = m == P ? m * v : std::min<int64_t>(m * v, (P - pipe.stage() - 1) * 2 + (v - 1) * P);
      EXPECT_EQ(pipe.stats().peak_live_micro_batches, std::min<int64_t>(m * v, warmup + 1));
      // Forward only goes through the chunks in the same order: the reference's output.
      auto out = pipe.forward(x);
      if (pipe.is_last()) {
        torch::NoGradGuard ng;
        EXPECT_LE(rel_err(out, ref->forward(x)), 1e-12);
      }
    }
  }
}

TEST(PipelineInterleaved, RefusesWhatItCannotRun) {
  auto comm = world();
  const int P = comm->size();
  PipelineOptions o;
  o.schedule = PipelineSchedule::kInterleaved;
  o.virtual_stages = 8;  // P * 8 virtual stages, the MLP has 8 layers
  o.micro_batches = P;
  expect_invalid([&] { Pipeline(make_mlp(1), comm, o); },
                 {"--virtual-stages 8", std::to_string(8 * P) + " virtual stages", "model of 8 layers"});
  o.virtual_stages = 2;
  o.schedule = PipelineSchedule::k1F1B;
  expect_invalid([&] { Pipeline(make_mlp(1), comm, o); }, {"interleaved schedule, not 1f1b", "--virtual-stages 1"});
  o.schedule = PipelineSchedule::kInterleaved;
  o.micro_batches = P + 1;
  Pipeline pipe(make_mlp(1), comm, o);
  auto [x, y] = global_batch(4 * (P + 1), 1, 5);
  expect_invalid([&] { pipe.train_step(x.to(torch::kDouble), y, ce); }, {"--micro-batches must be a multiple of --pp"});
  o.virtual_stages = 0;
  expect_invalid([&] { Pipeline(make_mlp(1), comm, o); }, {"virtual_stages (--virtual-stages) must be at least 1"});
}

// Trains the MLP through the Engine with `pc` (pp 2, dp = the rest) as one worker does: Adam
// over `steps` steps, losses within 1e-5 (float64: they differ by summation order only), then
// the trained model's output and values. The bubble is measured on every stage.
void expect_engine_trains_as_one_worker(const ParallelConfig& pc, int steps) {
  constexpr int64_t kBatch = 24;
  OptimizerOptions oo;
  oo.kind = "adam";
  oo.lr = 1e-2;
  auto ref = make_mlp(3);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
  Engine eng(runtime(), make_mlp(3), oo, pc);
  ASSERT_EQ(eng.dp_size(), world()->size() / pc.pp);
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(kBatch, 40 + s, 5);
    x = x.to(torch::kDouble);
    ref_opt.zero_grad();
    auto want = ce(ref->forward(x), y);
    want.backward();
    ref_opt.step();
    auto got =
        eng.step(slice_for_rank(x, eng.dp_rank(), eng.dp_size()), slice_for_rank(y, eng.dp_rank(), eng.dp_size()), ce);
    auto l = got.reshape({1}).to(torch::kDouble).clone();
    eng.dp_group()->allreduce(l, ReduceOp::kAvg);
    EXPECT_NEAR(l.item<double>(), want.item<double>(), 1e-5) << "step " << s;
  }
  auto full = eng.full_parameters();  // fp32 values, gathered from the ranks owning each layer
  for (auto& np : ref->named_parameters()) EXPECT_LE(rel_err(full.at(np.key()), np.value()), 1e-6) << np.key();
  auto [x, y] = global_batch(8, 99, 5);
  auto out = eng.predict(x.to(torch::kDouble));
  if (eng.is_output_rank()) {
    torch::NoGradGuard ng;
    EXPECT_LE(rel_err(out, ref->forward(x.to(torch::kDouble))), 1e-9);
  }
  const auto st = eng.stats();
  EXPECT_GE(st.pipeline.bubble, 0.0);
  EXPECT_GT(st.pipeline.compute_ms, 0.0);
}

// The Engine with pp 2 x 2 virtual stages (and dp 2 on 4 ranks) trains as one worker does.
TEST(PipelineInterleaved, EngineLossesEqualOneWorker) {
  if (world()->size() % 2 != 0) GTEST_SKIP() << "pp 2 needs an even number of ranks, not " << world()->size();
  ParallelConfig pc;
  pc.strategy = Strategy::kDDP;
  pc.pp = 2;
  pc.schedule = PipelineSchedule::kInterleaved;
  pc.virtual_stages = 2;
  pc.micro_batches = 4;
  expect_engine_trains_as_one_worker(pc, 15);
}

// ---- zero-bubble schedules ----

// tandem::linear under a Recording and a Capture leaves the weight and bias gradients to
// flush(), which accumulates them through autograd (a tensor hook on the weight sees them),
// equal to at::linear's; outside a Capture its backward computes them at once.
TEST(PipelineZeroBubble, LinearDefersItsWeightGradientToFlush) {
  torch::manual_seed(5);
  torch::nn::Linear lin(torch::nn::LinearOptions(6, 4));
  lin->to(torch::kDouble);
  auto x = torch::randn({3, 2, 6}, torch::kDouble).requires_grad_(true);
  auto g = torch::randn({3, 2, 4}, torch::kDouble);
  at::linear(x, lin->weight, lin->bias).backward(g);
  const auto want_w = lin->weight.grad().clone(), want_b = lin->bias.grad().clone(), want_x = x.grad().clone();
  lin->zero_grad();
  x.mutable_grad() = at::Tensor();
  // Autograd may call the hook with no gradient (B's undefined one); count the gradients it sees.
  int hooked = 0;
  lin->weight.register_hook([&](const at::Tensor& g) {
    if (!g.defined()) return;
    ++hooked;
    EXPECT_LE(rel_err(g, want_w), 1e-12);
  });
  WeightGradStore store;
  at::Tensor y;
  {
    WeightGradStore::Recording rec;
    y = tandem::linear(x, lin->weight, lin->bias);
  }
  {
    WeightGradStore::Capture cap(store);
    y.backward(g);
  }
  EXPECT_LE(rel_err(x.grad(), want_x), 1e-12);
  EXPECT_FALSE(lin->weight.grad().defined() && lin->weight.grad().abs().sum().item<double>() > 0);
  EXPECT_FALSE(store.empty());
  EXPECT_EQ(hooked, 0);
  EXPECT_TRUE(store.flush());
  EXPECT_TRUE(store.empty());
  EXPECT_EQ(hooked, 1);
  EXPECT_LE(rel_err(lin->weight.grad(), want_w), 1e-12);
  EXPECT_LE(rel_err(lin->bias.grad(), want_b), 1e-12);
  // Recorded, but backward outside a Capture: an ordinary linear.
  lin->zero_grad();
  {
    WeightGradStore::Recording rec;
    y = tandem::linear(x, lin->weight, lin->bias);
  }
  y.backward(g);
  EXPECT_LE(rel_err(lin->weight.grad(), want_w), 1e-12);
  EXPECT_FALSE(store.flush());
  // Without a bias (a row-parallel layer's), deferred the same way.
  lin->zero_grad();
  {
    WeightGradStore::Recording rec;
    y = tandem::linear(x, lin->weight);
  }
  {
    WeightGradStore::Capture cap(store);
    y.backward(g);
  }
  EXPECT_FALSE(lin->weight.grad().defined());
  EXPECT_TRUE(store.flush());
  EXPECT_LE(rel_err(lin->weight.grad(), want_w), 1e-12);
}

// zb-h1 and zb-v after one step: every chunk's gradients and the loss as one process (1F1B's,
// which MlpGradientsMatchSingleProcess checks the same way), the live micro-batches their
// orders promise, and the forward-only output; zb-v's loss is on rank 0.
TEST(PipelineZeroBubble, GradientsMatchSingleProcess) {
  auto comm = world();
  const int P = comm->size();
  auto [x, y, ref, want, want_loss] = mlp_reference();
  for (auto sched : {PipelineSchedule::kZBH1, PipelineSchedule::kZBV}) {
    for (int64_t m : {int64_t{1}, int64_t{3}, int64_t{P}, int64_t{2 * P}, int64_t{3 * P}}) {
      if (m == 3 && P == 3) continue;  // already run
      SCOPED_TRACE(std::string(to_string(sched)) + ", " + std::to_string(m) + " micro-batches");
      PipelineOptions o;
      o.schedule = sched;
      o.micro_batches = m;
      Pipeline pipe(make_mlp(3), comm, o);
      const bool v = sched == PipelineSchedule::kZBV;
      ASSERT_EQ(static_cast<int>(pipe.layer_ranges().size()), v ? 2 : 1);
      EXPECT_EQ(pipe.is_last(), pipe.stage() == (v ? 0 : P - 1));
      for (auto& p : pipe.parameters()) p.mutable_grad() = at::Tensor();
      auto loss = pipe.train_step(x, y, ce);
      EXPECT_NEAR(loss.item<double>(), want_loss, 1e-12 * std::abs(want_loss));
      expect_stage_grads(pipe, want, 1e-10);
      // Each (chunk, micro-batch) of a chunk holding a Linear left its weight gradients to its W.
      int64_t with_linear = 0;
      for (auto [first, end] : pipe.layer_ranges()) {
        for (int64_t i = first; i < end; ++i) {
          if (ref->ptr(i)->as<torch::nn::LinearImpl>()) {
            ++with_linear;
            break;
          }
        }
      }
      EXPECT_EQ(pipe.stats().weight_passes, m * with_linear);
      if (v) {
        EXPECT_LE(pipe.stats().peak_live_micro_batches, 2 * P);
      } else {
        EXPECT_EQ(pipe.stats().peak_live_micro_batches, std::min<int64_t>(P - pipe.stage(), m));
      }
      auto out = pipe.forward(x);
      EXPECT_EQ(out.defined(), pipe.is_last());
      if (pipe.is_last()) {
        torch::NoGradGuard ng;
        EXPECT_LE(rel_err(out, ref->forward(x)), 1e-12);
      }
    }
  }
}

// zb-v holds two chunks per rank in a V; it refuses more, and one stage.
TEST(PipelineZeroBubble, ZbVRefusesOtherChunkCounts) {
  auto comm = world();
  PipelineOptions o;
  o.schedule = PipelineSchedule::kZBV;
  o.virtual_stages = 3;
  expect_invalid([&] { Pipeline(make_mlp(1), comm, o); }, {"zb-v runs two chunks per rank", "--virtual-stages 2"});
  o.schedule = PipelineSchedule::kZBH1;
  o.virtual_stages = 2;
  expect_invalid([&] { Pipeline(make_mlp(1), comm, o); }, {"interleaved schedule, not zb-h1"});
}

// Through the Engine with pp 2: zb-h1 with ZeRO-2 and zb-v with ZeRO-1 (dp 2 on 4 ranks: the
// W pass's gradients reach ZeRO's reduce-scatter hooks), zb-h1 with ZeRO-3 (its per-layer
// gather runs the layers, which then get all their gradients in B) and zb-v with DDP train as
// one worker.
TEST(PipelineZeroBubble, ComposesWithZeroAndDataParallel) {
  if (world()->size() % 2 != 0) GTEST_SKIP() << "pp 2 needs an even number of ranks, not " << world()->size();
  for (auto [strategy, sched] :
       {std::pair{Strategy::kZero2, PipelineSchedule::kZBH1}, std::pair{Strategy::kZero1, PipelineSchedule::kZBV},
        std::pair{Strategy::kDDP, PipelineSchedule::kZBV}}) {
    SCOPED_TRACE(std::string(to_string(sched)) + " with strategy " + std::to_string(static_cast<int>(strategy)));
    ParallelConfig pc;
    pc.strategy = strategy;
    pc.pp = 2;
    pc.schedule = sched;
    pc.micro_batches = 4;
    expect_engine_trains_as_one_worker(pc, 6);
  }
}

}  // namespace
}  // namespace tandem::test
