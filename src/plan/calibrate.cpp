// `tandem plan --calibrate`: this machine's compute rates (a built-in model's forward+backward at
// two batch sizes, one thread and all cores; optimizer step cost; a GEMM; memcpy) and Tandem's
// collectives at several sizes, fitted to the alpha-beta formulas of tandem/plan.h.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <limits>
#include <map>
#include <stdexcept>
#include <thread>

#include "tandem/data.h"
#include "tandem/models.h"
#include "tandem/plan.h"
#include "tandem/runtime.h"

namespace tandem::plan {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.empty() ? 0.0 : (v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]));
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A batch the model accepts, and its loss.
std::pair<at::Tensor, at::Tensor> sample_batch(const std::string& name, int64_t b) {
  if (name == "transformer_tiny") {
    auto ids = torch::randint(0, 256, {b, 64}, torch::kLong);
    return {ids, torch::randint(0, 256, {b, 64}, torch::kLong)};
  }
  // Real images where Fashion-MNIST is installed: the kernels' speed depends on the values
  // (measured in Python on the CNN, 1 thread, batch 96, 5 alternating rounds: randn 61.8 ms,
  // Fashion-MNIST 57.2 ms, zeros 51.4 ms), so the rates should be those of the data trained on.
  static const data::Dataset images = [] {
    try {
      return data::load_fashion_mnist(data::kFashionMnistDir, /*train=*/false);
    } catch (const std::exception&) {
      return data::Dataset();  // not installed: random images
    }
  }();
  if (images.size() > 0) {
    auto idx = torch::arange(b, torch::kLong).remainder(images.size());
    return {images.images.index_select(0, idx).reshape({b, 1, 28, 28}), images.labels.index_select(0, idx)};
  }
  return {torch::randn({b, 1, 28, 28}), torch::randint(0, 10, {b}, torch::kLong)};
}

at::Tensor loss_of(const at::Tensor& out, const at::Tensor& y) {
  if (out.dim() == 3) return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(2)}), y.reshape({-1}));
  return torch::nn::functional::cross_entropy(out, y);
}

// One training pass without the update, as tandem train runs it: zero_grad (kept storage),
// forward, loss, backward, and the loss read back (the step's synchronisation with the host).
void train_pass(torch::nn::Sequential& model, const at::Tensor& x, const at::Tensor& y) {
  model->zero_grad(/*set_to_none=*/false);
  auto loss = loss_of(model->forward(x), y);
  loss.backward();
  (void)loss.item<double>();
}

// A t-way tensor-parallel shard of `dense` for timing (fresh weights): each child the spec marks
// "column" keeps 1/t of its outputs, each "row" child 1/t of its inputs; the other children are
// shared with `dense`. Null when a marked child is not a Linear or its width does not divide.
torch::nn::Sequential tp_shard_model(torch::nn::Sequential& dense, const ModelSpec& spec, int t) {
  if (spec.children.size() != dense->size()) return nullptr;
  torch::nn::Sequential shard;
  bool any = false;
  for (size_t i = 0; i < dense->size(); ++i) {
    const std::string& kind = spec.children[i].tp;
    if (kind.empty()) {
      shard->push_back(*(dense->begin() + static_cast<std::ptrdiff_t>(i)));  // shares the module
      continue;
    }
    auto* lin = dense->ptr(i)->as<torch::nn::LinearImpl>();
    if (!lin) return nullptr;
    int64_t in = lin->options.in_features(), out = lin->options.out_features();
    int64_t& cut = kind == "column" ? out : in;
    if (cut % t != 0) return nullptr;
    cut /= t;
    shard->push_back(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(lin->options.bias())));
    any = true;
  }
  return any ? shard : nullptr;
}

// Every timed point of the compute calibration spans at least this long. A shared virtual
// machine's speed can wander per core with about a second's memory: on a 2-vCPU guest a
// one-thread GEMM timed back to back for 150 s on each core varied with sd 7-8 % between 0.25 s
// windows, correlated 0.48 one second apart and 0.24 two seconds apart, and not at all between
// the two cores (bench/host_speed_probe.py, docs/BENCHMARKS.md "Planning"). A point of seven MLP
// passes (about 0.1 s) samples one moment of that: two such calibrations minutes apart priced
// the same 2-worker step 12 and 17 ms.
// TANDEM_CALIBRATE_POINT_S sets another span (0 to 10 s): shorter for a quick look or a test
// of the calibration's plumbing, longer on a machine noisier still.
constexpr double kPointSeconds = 0.3;

double point_seconds() {
  static const double s = [] {
    const char* e = std::getenv("TANDEM_CALIBRATE_POINT_S");
    if (!e || !*e) return kPointSeconds;
    char* end = nullptr;
    const double v = std::strtod(e, &end);
    if (end == e || *end != '\0' || !(v >= 0.0 && v <= 10.0))
      throw std::invalid_argument("TANDEM_CALIBRATE_POINT_S='" + std::string(e) +
                                  "' is not a span in seconds from 0 to 10: it sets how long each calibration "
                                  "point is timed (unset: 0.3)");
    return v;
  }();
  return s;
}

// Timed passes for a point whose first pass took `first_s`: at least `min_iters`, and enough to
// span point_seconds(), at most 100.
int iters_to_span(double first_s, int min_iters) {
  if (!(first_s > 0)) return min_iters;
  return std::clamp(static_cast<int>(std::ceil(point_seconds() / first_s)), min_iters, std::max(min_iters, 100));
}

// Median seconds of zero_grad + forward + loss + backward at batch b, over at least `iters`
// passes after `warmup`, and at least point_seconds() of them.
double time_fwd_bwd(torch::nn::Sequential& model, const std::string& name, int64_t b, int warmup, int iters) {
  auto [x, y] = sample_batch(name, b);
  std::vector<double> t;
  for (int i = 0, total = warmup + iters; i < total; ++i) {
    auto t0 = Clock::now();
    train_pass(model, x, y);
    const double dt = seconds_since(t0);
    if (i == warmup) total = warmup + iters_to_span(dt, iters);
    if (i >= warmup) t.push_back(dt);
  }
  return median(t);
}

// Median seconds of each child's forward+backward at batch b, one after another on the real
// activations (the input requires grad where the model's does: after the first child with
// parameters), the last child with the loss; one pass of `iters` per child after `warmup`.
std::vector<double> time_layers(torch::nn::Sequential& model, const std::string& name, int64_t b, int warmup, int iters,
                                std::vector<double>* forward = nullptr) {
  auto [x, y] = sample_batch(name, b);
  std::vector<double> out;
  if (forward) forward->clear();
  bool needs_grad = false;
  const size_t n = model->size();
  for (size_t i = 0; i < n; ++i) {
    auto& child = *(model->begin() + static_cast<std::ptrdiff_t>(i));
    auto params = child.ptr()->parameters();
    at::Tensor xi = x.detach();
    if (needs_grad && at::isFloatingType(xi.scalar_type())) xi.requires_grad_(true);
    std::vector<double> t, tf;
    at::Tensor yi;
    for (int k = 0; k < warmup + iters; ++k) {
      auto t0 = Clock::now();
      for (auto& p : params)
        if (p.grad().defined()) p.mutable_grad().zero_();
      yi = child.forward(xi);
      at::Tensor loss;
      if (i + 1 == n) loss = loss_of(yi, y);
      const double f = seconds_since(t0);  // CPU kernels run synchronously
      if (i + 1 == n) {
        loss.backward();
        (void)loss.item<double>();
      } else if (yi.requires_grad()) {
        yi.backward(at::ones_like(yi));
      }
      if (xi.requires_grad()) xi.mutable_grad() = at::Tensor();
      if (k >= warmup) {
        t.push_back(seconds_since(t0));
        tf.push_back(f);
      }
    }
    out.push_back(median(t));
    if (forward) forward->push_back(median(tf));
    needs_grad = needs_grad || !params.empty();
    x = yi.detach();
  }
  return out;
}

// Fits time = overhead + flops(b) / rate from two batch sizes.
void fit_rate(double flops_per_sample, int64_t b1, double t1, int64_t b2, double t2, double& rate, double& overhead) {
  const double f1 = flops_per_sample * b1, f2 = flops_per_sample * b2;
  rate = t2 > t1 ? (f2 - f1) / (t2 - t1) : f2 / t2;
  overhead = t1 - f1 / rate;
  if (overhead < 0 || !(rate > 0)) {
    overhead = 0;
    rate = f2 / t2;
  }
}

// Alpha and bandwidth from times ys at sizes (the formula's bytes term) xs, smallest first:
// alpha = ys[0] / steps (latency-bound), bandwidth by least squares through the origin of
// ys - steps * alpha against xs over the larger sizes.
AlphaBeta fit_alpha_beta(const std::vector<double>& xs, const std::vector<double>& ys, double steps) {
  AlphaBeta ab;
  ab.alpha = ys[0] / steps;
  double sxy = 0, sxx = 0;
  for (size_t i = 1; i < xs.size(); ++i) {
    const double y = std::max(0.0, ys[i] - steps * ab.alpha);
    sxy += xs[i] * y;
    sxx += xs[i] * xs[i];
  }
  ab.bandwidth = sxy > 0 ? sxx / sxy : xs.back() / ys.back();
  return ab;
}

// One optimizer step on one thread, as training runs it: right after a forward and backward of
// `b` samples (untimed), which wrote the gradients it reads. Timed back to back instead, its
// parameters, gradients and state stay in the cache: the MLP's SGD step (1.86M parameters)
// took 0.55-0.63 ms that way, and 0.91-1.01 ms after a backward (docs/BENCHMARKS.md).
double time_optimizer(torch::nn::Sequential& model, const std::string& name, int64_t b, const std::string& which) {
  auto [x, y] = sample_batch(name, b);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (which == "adam") {
    opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  } else {
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  }
  std::vector<double> t;
  for (int i = 0; i < 13; ++i) {
    train_pass(model, x, y);
    auto t0 = Clock::now();
    opt->step();
    if (i >= 3) t.push_back(seconds_since(t0));
  }
  return median(t);
}

std::string now_utc() {
  std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", std::gmtime(&t));
  return buf;
}

}  // namespace

void calibrate_compute(Calibration& cal, const std::vector<std::string>& models, int64_t batch) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cal.cores = cores;
  cal.date = now_utc();
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  cal.host = host;
  torch::manual_seed(0);

  at::set_num_threads(1);
  {
    auto a = torch::randn({512, 512}), b = torch::randn({512, 512});
    std::vector<double> t;
    for (int i = 0; i < 13; ++i) {
      auto t0 = Clock::now();
      auto c = at::mm(a, b);
      (void)c.data_ptr<float>()[0];
      if (i >= 3) t.push_back(seconds_since(t0));
    }
    cal.gemm_flops_1t = 2.0 * 512 * 512 * 512 / median(t);
  }
  {
    const size_t bytes = 64u << 20;
    std::vector<char> a(bytes, 1), b(bytes, 2);
    std::memcpy(b.data(), a.data(), bytes);
    std::vector<double> t;
    for (int i = 0; i < 10; ++i) {
      a[i] = static_cast<char>(i);
      auto t0 = Clock::now();
      std::memcpy(b.data(), a.data(), bytes);
      t.push_back(seconds_since(t0));
      if (b[i] != static_cast<char>(i)) throw std::runtime_error("memcpy check failed");
    }
    cal.memory_bandwidth = 2.0 * bytes / median(t);
  }

  for (const auto& name : models) {
    auto model = models::make_model(name);  // throws for unknown names
    const ModelSpec spec = builtin_model(name);
    const double f = 3.0 * forward_flops_per_sample(spec);
    const int64_t b2 = std::max<int64_t>(2, batch), b1 = std::max<int64_t>(1, b2 / 4);
    ModelRates mr;
    mr.fit_batch_lo = b1;
    mr.fit_batch_hi = b2;
    // Three interleaved rounds, median of each point: a shared virtual machine can run at two
    // speeds for minutes at a time, and a calibration taken in one of them alone misleads.
    std::vector<double> a1, a2, c1, c2;
    for (int round = 0; round < 3; ++round) {
      at::set_num_threads(1);
      a1.push_back(time_fwd_bwd(model, name, b1, 2, 7));
      a2.push_back(time_fwd_bwd(model, name, b2, 2, 7));
      at::set_num_threads(cores);
      c1.push_back(time_fwd_bwd(model, name, b1, 2, 7));
      c2.push_back(time_fwd_bwd(model, name, b2, 2, 7));
    }
    fit_rate(f, b1, median(a1), b2, median(a2), mr.flops_1t, mr.overhead_s);
    fit_rate(f, b1, median(c1), b2, median(c2), mr.flops_all, mr.overhead_all_s);
    // Child by child (one thread), for pipeline stages and tensor-parallel shards: time =
    // overhead + per-sample * batch through the two batch sizes, median of three rounds.
    if (!spec.children.empty() && spec.children.size() == model->size()) {
      at::set_num_threads(1);
      std::vector<std::vector<double>> l1(model->size()), l2(model->size()), f1(model->size()), f2(model->size());
      for (int round = 0; round < 3; ++round) {
        std::vector<double> fw1, fw2;
        auto t1 = time_layers(model, name, b1, 2, 7, &fw1), t2 = time_layers(model, name, b2, 2, 7, &fw2);
        for (size_t i = 0; i < t1.size(); ++i) {
          l1[i].push_back(t1[i]);
          l2[i].push_back(t2[i]);
          f1[i].push_back(fw1[i]);
          f2[i].push_back(fw2[i]);
        }
      }
      for (size_t i = 0; i < l1.size(); ++i) {
        const double m1 = median(l1[i]), m2 = median(l2[i]);
        // The forward's share over both batches (a micro-batch lies between them).
        mr.layer_forward_share.push_back(m1 + m2 > 0 ? std::clamp((median(f1[i]) + median(f2[i])) / (m1 + m2), 0.0, 1.0)
                                                     : 0.5);
        double per = std::max(0.0, (m2 - m1) / static_cast<double>(b2 - b1));
        double fixed = m1 - per * static_cast<double>(b1);
        if (fixed < 0) {
          fixed = 0;
          per = m2 / static_cast<double>(b2);
        }
        mr.layer_overhead_s.push_back(fixed);
        mr.layer_s_per_sample.push_back(per);
      }
    }
    at::set_num_threads(1);
    const double params = static_cast<double>(models::count_parameters(*model));
    mr.sgd_s_per_param = time_optimizer(model, name, b1, "sgd") / params;
    mr.adam_s_per_param = time_optimizer(model, name, b1, "adam") / params;
    at::set_num_threads(cores);
    mr.sgd_all_s_per_param = time_optimizer(model, name, b1, "sgd") / params;
    mr.adam_all_s_per_param = time_optimizer(model, name, b1, "adam") / params;
    at::set_num_threads(1);
    cal.models[name] = mr;
  }
}

// A barrier of point-to-point messages (dissemination: log2 n rounds of a send to rank + k and a
// receive from rank - k), so that the ranks that arrive early wait in a receive, as a pipeline
// stage waits for its neighbour, and not in MPI's blocking barrier, which spins.
void barrier_in_receives(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  auto out = torch::zeros({1});
  auto in = torch::zeros({1});
  for (int k = 1, round = 0; k < n; k *= 2, ++round) {
    auto s = comm.send_async(out, (r + k) % n, 900 + round);
    comm.recv_async(in, (r - k + n) % n, 900 + round)->wait();
    s->wait();
  }
}

void calibrate_collectives(Runtime& rt, Calibration& cal, const std::vector<std::string>& models, int64_t batch) {
  auto comm = rt.cpu_world();
  const int n = comm->size();
  auto slowest = [&](double t) {
    auto v = torch::tensor({t}, torch::kDouble);
    comm->allreduce(v, ReduceOp::kMax);
    return v.item<double>();
  };
  // Every rank computing at once, one thread each: the rate of a worker among `cores` workers.
  for (const auto& name : models) {
    auto model = models::make_model(name);
    const ModelSpec spec = builtin_model(name);
    const int64_t b = std::max<int64_t>(1, batch / n);
    comm->barrier();
    double t = time_fwd_bwd(model, name, b, 2, 7);
    auto v = torch::tensor({t}, torch::kDouble);
    comm->allreduce(v, ReduceOp::kAvg);
    t = v.item<double>();
    auto it = cal.models.find(name);
    double ovh = it != cal.models.end() ? it->second.overhead_s : 0.0;
    const double f = 3.0 * forward_flops_per_sample(spec) * b;
    // The overhead comes from the one-thread fit, taken seconds earlier in another process; on a
    // machine that speeds up in between, t can come out at or under it. Then at most half of t
    // counts as overhead, so that the rate is always there.
    auto compute_part = [&](double t_all) { return std::max(t_all - ovh, 0.5 * t_all); };
    if (t > 0) cal.models[name].flops_concurrent = f / compute_part(t);
    auto [x, y] = sample_batch(name, b);
    auto train_once = [&] { train_pass(model, x, y); };
    // Plain iterations with a barrier after every forward+backward (a step's synchronisation),
    // the slowest rank's median: on more ranks than cores this includes waiting for descheduled
    // peers. Three rounds of 2 warm-ups and 7, the fastest round's median: on 4 ranks over 2
    // cores a pass now and then runs 40 % slow for seconds. The MLP's 48 samples took 15-17 ms
    // in four calibrations and 25 ms in one, while training's 4-worker DDP step held at
    // 22-24 ms with its all-reduce; the first iterations of a pass sometimes take 21-25 ms too.
    // Interleaved with them, ZeRO-3's pattern of blocking collectives within the step (4 KiB
    // each: the payload is priced by the collective curves): the extra time per collective.
    // Every one is a rendezvous of all ranks in the middle of compute; on more ranks than cores
    // that waits for descheduled peers, which the back-to-back timings below never see. The
    // MLP's ZeRO-3 step cost 2-3 ms more than ZeRO-2's on 2 ranks (7 collectives against 2),
    // the CNN's 4-7 ms on 3-4, where the curves priced 0.4-0.5 ms.
    {
      const int64_t tiny = std::max<int64_t>(n, (1024 / n) * n);
      auto full = symmetric_empty(*comm, tiny, torch::kFloat).fill_(1.0f);
      auto part = full.narrow(0, comm->rank() * (tiny / n), tiny / n);
      auto rendezvous = [&] { comm->allgather_async(full, part)->wait(); };
      int units = 0;
      for (auto it = model->begin(); it != model->end(); ++it) units += it->ptr()->parameters().empty() ? 0 : 1;
      auto patterned_once = [&] {
        model->zero_grad(/*set_to_none=*/false);
        at::Tensor h = x;
        int u = 0;
        for (auto it = model->begin(); it != model->end(); ++it) {
          if (it->ptr()->parameters().empty()) {
            h = it->forward(h);
            continue;
          }
          rendezvous();
          h = it->forward(h);
          if (++u < units && h.requires_grad()) h.register_hook([&](const at::Tensor&) { rendezvous(); });
        }
        auto loss = loss_of(h, y);
        loss.backward();
        (void)loss.item<double>();
      };
      // One round: 2 warm-ups and at least 7 timed runs of `once` (point_seconds() in all), each
      // followed by a barrier; the slowest rank's median. The count follows from the second
      // warm-up's slowest time, which every rank has, so that all run the same number.
      auto synchronized_round = [&](const std::function<void()>& once) {
        std::vector<double> ts;
        comm->barrier();
        for (int i = 0, total = 9; i < total; ++i) {
          auto t0 = Clock::now();
          once();
          comm->barrier();
          double dt = slowest(seconds_since(t0));
          if (i == 1) total = 2 + iters_to_span(dt, 7);
          if (i >= 2) ts.push_back(dt);
        }
        return median(ts);
      };
      double plain = std::numeric_limits<double>::infinity(), patterned = plain;
      for (int round = 0; round < 3; ++round) {
        plain = std::min(plain, synchronized_round(train_once));
        patterned = std::min(patterned, synchronized_round(patterned_once));
      }
      if (plain > 0) cal.models[name].flops_synchronized[n] = f / compute_part(plain);
      // The same for each tensor-parallel shard of this world size (see tp_synchronized).
      for (int t = 2; t <= n; ++t) {
        if (n % t != 0) continue;
        auto shard = tp_shard_model(model, spec, t);
        if (!shard) continue;
        const int64_t bt = std::max<int64_t>(1, batch * t / n);
        auto [xt, yt] = sample_batch(name, bt);
        auto shard_once = [&] { train_pass(shard, xt, yt); };
        double best = std::numeric_limits<double>::infinity();
        for (int round = 0; round < 3; ++round) best = std::min(best, synchronized_round(shard_once));
        cal.models[name].tp_synchronized[n][t] = {static_cast<double>(bt), best};
      }
      const int points = std::max(1, 2 * units - 1);
      cal.models[name].sync_point_s[n] = std::max(0.0, (patterned - plain) / points);
    }
    // a of n ranks computing while the others wait, as pipeline stages do: phases of one
    // micro-batch (half of b) forward+backward on a ranks, a barrier after each (of receives:
    // the idle ranks wait as a stage waits for its neighbour). The same a ranks compute for a
    // whole round, as a pipeline's stages stay on their ranks, and the set moves by one rank every
    // round; the slowest rank's median phase, median of 3 rounds. The set must not move every
    // phase: each computing rank would then start cold (its model not in the caches of the core
    // it runs on): the MLP's phase of 1 of 4 took 6.2-7.0 ms against 4.0-5.4 with the set held,
    // which priced the MLP's 4-rank pipelines 10-30 % slow (docs/BENCHMARKS.md, "Planning"). Nor
    // may a round be one long stretch of compute: 7 whole batches without a barrier, the others
    // waiting in one receive, kept one placement of the threads for the whole round, and the
    // rate came out bimodal (the MLP's 2 of 4: 32-106 GFLOP/s over five calibrations, the CNN's
    // 21-55). So every phase ends in a barrier, the waiting ranks sleep between polls as idle
    // pipeline stages do on more ranks than cores, and a round's placement is one of three whose
    // median is taken.
    // Stored as the rate that makes the one-thread time of that work (overhead + FLOPs at
    // flops_1t, from calibrate_compute) last the phase: the pipeline's stage times are scaled
    // by rate / flops_1t.
    const int64_t bm = std::max<int64_t>(1, b / 2);
    auto [xm, ym] = sample_batch(name, bm);
    const double fm = 3.0 * forward_flops_per_sample(spec) * static_cast<double>(bm);
    const double f1 = it != cal.models.end() ? it->second.flops_1t : 0.0;
    const double alone = f1 > 0 ? ovh + fm / f1 : 0.0;
    for (int a = 1; a < n; ++a) {
      std::vector<double> rounds;
      for (int round = 0; round < 3; ++round) {
        std::vector<double> tp;
        comm->barrier();
        for (int j = 0, total = 12; j < total; ++j) {
          const bool mine = ((comm->rank() - round) % n + n) % n < a;
          auto t0 = Clock::now();
          if (mine) train_pass(model, xm, ym);
          barrier_in_receives(*comm);
          const double dt = seconds_since(t0);
          // At least 10 timed phases and point_seconds(), counted from the second warm-up's
          // slowest phase (one value on every rank).
          if (j == 1) total = 2 + iters_to_span(slowest(dt), 10);
          if (j >= 2) tp.push_back(dt);
        }
        rounds.push_back(slowest(median(tp)));
      }
      const double t = median(rounds);
      if (t > 0) cal.models[name].flops_while_waiting[n][a] = alone > 0 ? f1 * alone / t : fm / t;
    }
  }
  // Collectives at 4 KiB (latency) and 256 KiB .. 16 MiB (bandwidth), float32, median of the
  // slowest rank: alpha = t(4 KiB) / steps; bandwidth by least squares through the origin of
  // t - steps*alpha against (steps/n) * S over the larger sizes.
  const std::vector<int64_t> sizes = {4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20};
  // "_shm": in place in symmetric memory, as ZeRO-1's gradients and ZeRO-1/2's parameters are
  // (shared memory on one node); the plain ones in ordinary memory (ZeRO-2/3's per-bucket scratch).
  // "allgather_copy_shm": into symmetric memory from a separate input, as ZeRO-3 gathers a unit
  // from its shard into a slot of its block (each rank copies its own part in too, then the
  // others'); "allgather_shm" is in place, as ZeRO-1/2 gather into their flat parameters.
  const std::vector<std::string> ops = {"allreduce",          "reduce_scatter", "allgather",
                                        "reduce_scatter_shm", "allgather_shm",  "allgather_copy_shm"};
  // Three interleaved rounds, the median over all of them per operation and size: on a shared
  // virtual machine inter-process copies can run at one of two speeds for a minute or two at a
  // time (a 3x swing in reduce_scatter seen between two calibrations), and one pass can land in
  // either.
  std::map<std::string, std::vector<std::vector<double>>> times;
  for (const auto& op : ops) times[op].assign(sizes.size(), {});
  // Before each timed collective every rank writes 48 MiB elsewhere (this machine's L3 holds
  // 32 MiB): in training the buffers come out of forward and backward, not out of the cache.
  // Timed warm, the shared-memory curves made ZeRO-3's two gathers of the MLP's 7.5 MB about
  // free (0.06 ms for 4 MiB on 2 ranks); its step costs 2 ms more than DDP's.
  std::vector<char> evict(48u << 20);
  for (int round = 0; round < 3; ++round) {
    for (const auto& op : ops) {
      for (size_t k = 0; k < sizes.size(); ++k) {
        const int64_t numel = std::max<int64_t>(n, (sizes[k] / 4 / n) * n);
        // All-reduce in the memory DDP's buckets use (shared memory on one node, see
        // symmetric_empty in tandem/comm.h), so that the constants are those of training.
        const bool symmetric = op == "allreduce" || is_shm_op(op);
        auto full = symmetric ? symmetric_empty(*comm, numel, torch::kFloat).fill_(1.0f) : torch::ones({numel});
        auto part = symmetric && op != "allgather_copy_shm" ? full.narrow(0, comm->rank() * (numel / n), numel / n)
                                                            : torch::ones({numel / n});
        for (int i = 0; i < 8; ++i) {
          std::memset(evict.data(), i, evict.size());
          comm->barrier();
          auto t0 = Clock::now();
          if (op == "allreduce") comm->allreduce(full, ReduceOp::kSum);
          else if (op.compare(0, 14, "reduce_scatter") == 0) comm->reduce_scatter(part, full, ReduceOp::kSum);
          else comm->allgather(full, part);
          double dt = slowest(seconds_since(t0));
          if (i >= 2) times[op][k].push_back(dt);
        }
      }
    }
  }
  // Point-to-point as a pipeline transfers (the receive posted, a send, the receiver waits):
  // ranks 2k and 2k+1 ping-pong, every pair at once; half the round trip of the slowest pair,
  // median of three interleaved rounds of 8 after 2 warm-ups. alpha = t(4 KiB), bandwidth by
  // least squares over the larger sizes.
  {
    const std::vector<int64_t> p2p_sizes = {4 << 10, 256 << 10, 1 << 20, 4 << 20};
    std::vector<std::vector<double>> pt(p2p_sizes.size());
    const int me = comm->rank(), peer = me ^ 1;
    const bool paired = peer < n;
    for (int round = 0; round < 3; ++round) {
      for (size_t k = 0; k < p2p_sizes.size(); ++k) {
        auto buf = torch::ones({p2p_sizes[k] / 4});
        for (int i = 0; i < 10; ++i) {
          comm->barrier();
          auto t0 = Clock::now();
          if (paired && me % 2 == 0) {
            comm->send(buf, peer, 7);
            comm->recv(buf, peer, 8);
          } else if (paired) {
            comm->recv(buf, peer, 7);
            comm->send(buf, peer, 8);
          }
          const double dt = slowest(paired ? seconds_since(t0) / 2 : 0.0);
          if (i >= 2) pt[k].push_back(dt);
        }
      }
    }
    std::vector<double> xs, ys;
    for (size_t k = 0; k < p2p_sizes.size(); ++k) {
      xs.push_back(static_cast<double>(p2p_sizes[k]));
      ys.push_back(median(pt[k]));
    }
    const AlphaBeta ab = fit_alpha_beta(xs, ys, 1.0);
    cal.p2p[n] = ab;
  }
  // Send delay, as in a pipeline: ranks 2k post a send to 2k+1 and go on computing for 30 ms
  // (an unpaired last rank computes too); 2k+1 waits in the receive and takes the arrival time
  // against the send's time stamp in the message (steady clock: one machine). Sizes under and
  // over the launcher's eager limit (256 KiB); the largest delay over the pairs, 3 interleaved
  // rounds of 4 after a warm-up. Capped at 30 ms, when the sender stops to wait. The delay is
  // bimodal: the sender's progress thread gets a core at once (about 0.1 ms) or after a
  // scheduler slice (2-3.5 ms on 2 ranks), the two mixed within one calibration. A step sums
  // about ten of them, so its median is near their mean: the mean of the 12 samples less the
  // highest and the lowest. Their median picked a mode: the 2-rank curve came out 0.1 or 3 ms
  // at 4 KiB between calibrations minutes apart, and the MLP's 2-stage pipeline was predicted
  // at 18-23 or 30-34 ms with it, against 22-26 ms measured (docs/BENCHMARKS.md).
  {
    const std::vector<int64_t> d_sizes = {4 << 10, 192 << 10, 1 << 20};
    std::vector<std::vector<double>> dd(d_sizes.size());
    const int me = comm->rank(), peer = me ^ 1;
    const bool paired = peer < n;
    auto a = torch::randn({192, 192});
    auto busy = [&](double secs) {
      const auto t0 = Clock::now();
      while (seconds_since(t0) < secs) (void)torch::mm(a, a);
    };
    auto now_s = [] { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); };
    for (int round = 0; round < 3; ++round) {
      for (size_t k = 0; k < d_sizes.size(); ++k) {
        auto buf = torch::zeros({d_sizes[k] / 8}, torch::kDouble);
        for (int i = 0; i < 5; ++i) {
          comm->barrier();
          double d = 0.0;
          if (paired && me % 2 == 1) {
            comm->recv(buf, peer, 11);
            d = now_s() - buf.data_ptr<double>()[0];
          } else if (paired) {
            buf.data_ptr<double>()[0] = now_s();
            auto w = comm->send_async(buf, peer, 11);
            busy(0.03);
            w->wait();
          } else {
            busy(0.03);
          }
          d = slowest(d);
          if (i >= 1) dd[k].push_back(d);
        }
      }
    }
    auto& curve = cal.send_delay[n];
    curve.clear();
    auto trimmed_mean = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      if (v.size() > 4) v = std::vector<double>(v.begin() + 1, v.end() - 1);
      double sum = 0.0;
      for (double x : v) sum += x;
      return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
    };
    for (size_t k = 0; k < d_sizes.size(); ++k)
      curve.emplace_back(static_cast<double>(d_sizes[k]), trimmed_mean(dd[k]));
  }
  for (const auto& op : ops) {
    std::vector<double> xs, ys;
    for (size_t k = 0; k < sizes.size(); ++k) {
      xs.push_back(static_cast<double>(std::max<int64_t>(n, (sizes[k] / 4 / n) * n)) * 4);
      ys.push_back(median(times[op][k]));
    }
    const double steps = op == "allreduce" ? 2.0 * (n - 1) : (n - 1);
    std::vector<double> scaled;
    for (double x : xs) scaled.push_back(steps / n * x);
    const AlphaBeta ab = fit_alpha_beta(scaled, ys, steps);
    cal.collectives[n][op] = ab;
    auto& curve = cal.collective_times[n][op];
    curve.clear();
    for (size_t i = 0; i < xs.size(); ++i) curve.emplace_back(xs[i], ys[i]);
  }
}

std::string calibration_to_json(const Calibration& cal) {
  nlohmann::json j;
  j["date"] = cal.date;
  j["host"] = cal.host;
  j["cores"] = cal.cores;
  j["gemm_flops_1t"] = cal.gemm_flops_1t;
  j["memory_bandwidth"] = cal.memory_bandwidth;
  for (const auto& [name, m] : cal.models) {
    j["models"][name] = {{"flops_1t", m.flops_1t},
                         {"flops_all", m.flops_all},
                         {"flops_concurrent", m.flops_concurrent},
                         {"overhead_s", m.overhead_s},
                         {"overhead_all_s", m.overhead_all_s},
                         {"fit_batches", {m.fit_batch_lo, m.fit_batch_hi}},
                         {"flops_synchronized",
                          [&] {
                            nlohmann::json o = nlohmann::json::object();
                            for (const auto& [n, r] : m.flops_synchronized) o[std::to_string(n)] = r;
                            return o;
                          }()},
                         {"sgd_s_per_param", m.sgd_s_per_param},
                         {"adam_s_per_param", m.adam_s_per_param},
                         {"sgd_all_s_per_param", m.sgd_all_s_per_param},
                         {"adam_all_s_per_param", m.adam_all_s_per_param},
                         {"flops_while_waiting",
                          [&] {
                            nlohmann::json o = nlohmann::json::object();
                            for (const auto& [n, by_a] : m.flops_while_waiting)
                              for (const auto& [a, r] : by_a) o[std::to_string(n)][std::to_string(a)] = r;
                            return o;
                          }()},
                         {"sync_point_s",
                          [&] {
                            nlohmann::json o = nlohmann::json::object();
                            for (const auto& [n, v] : m.sync_point_s) o[std::to_string(n)] = v;
                            return o;
                          }()},
                         {"tp_synchronized",
                          [&] {
                            nlohmann::json o = nlohmann::json::object();
                            for (const auto& [n, by_t] : m.tp_synchronized)
                              for (const auto& [t, bs] : by_t)
                                o[std::to_string(n)][std::to_string(t)] = {{"batch", bs.first}, {"seconds", bs.second}};
                            return o;
                          }()},
                         {"layer_overhead_s", m.layer_overhead_s},
                         {"layer_s_per_sample", m.layer_s_per_sample},
                         {"layer_forward_share", m.layer_forward_share}};
  }
  for (const auto& [n, ops] : cal.collectives)
    for (const auto& [op, ab] : ops)
      j["collectives"][std::to_string(n)][op] = {{"alpha", ab.alpha}, {"bandwidth", ab.bandwidth}};
  for (const auto& [n, ops] : cal.collective_times)
    for (const auto& [op, curve] : ops) j["collective_times"][std::to_string(n)][op] = curve;
  for (const auto& [n, ab] : cal.p2p) j["p2p"][std::to_string(n)] = {{"alpha", ab.alpha}, {"bandwidth", ab.bandwidth}};
  for (const auto& [n, curve] : cal.send_delay) j["send_delay"][std::to_string(n)] = curve;
  return j.dump(2);
}

Calibration calibration_from_json(const std::string& text) {
  Calibration cal;
  try {
    auto j = nlohmann::json::parse(text);
    cal.date = j.value("date", "");
    cal.host = j.value("host", "");
    cal.cores = j.value("cores", 1);
    cal.gemm_flops_1t = j.value("gemm_flops_1t", 0.0);
    cal.memory_bandwidth = j.value("memory_bandwidth", 0.0);
    if (j.contains("models")) {
      for (auto& [name, m] : j["models"].items()) {
        ModelRates r;
        r.flops_1t = m.value("flops_1t", 0.0);
        r.flops_all = m.value("flops_all", 0.0);
        r.flops_concurrent = m.value("flops_concurrent", 0.0);
        r.overhead_s = m.value("overhead_s", 0.0);
        r.overhead_all_s = m.value("overhead_all_s", -1.0);  // absent in older calibration files
        if (m.contains("fit_batches")) {                     // absent in older calibration files
          const auto fb = m["fit_batches"].get<std::vector<int64_t>>();
          if (fb.size() != 2 || fb[0] < 0 || fb[1] < fb[0])
            throw std::invalid_argument("models." + name + ": fit_batches must be [smaller, larger] batch");
          r.fit_batch_lo = fb[0];
          r.fit_batch_hi = fb[1];
        }
        r.sgd_s_per_param = m.value("sgd_s_per_param", 0.0);
        r.adam_s_per_param = m.value("adam_s_per_param", 0.0);
        r.sgd_all_s_per_param = m.value("sgd_all_s_per_param", 0.0);  // absent in older calibration files
        r.adam_all_s_per_param = m.value("adam_all_s_per_param", 0.0);
        r.layer_overhead_s = m.value("layer_overhead_s", std::vector<double>{});
        r.layer_s_per_sample = m.value("layer_s_per_sample", std::vector<double>{});
        if (r.layer_overhead_s.size() != r.layer_s_per_sample.size())
          throw std::invalid_argument("models." + name + ": layer_overhead_s and layer_s_per_sample differ in length");
        r.layer_forward_share = m.value("layer_forward_share", std::vector<double>{});  // absent in older files
        if (!r.layer_forward_share.empty() && r.layer_forward_share.size() != r.layer_s_per_sample.size())
          throw std::invalid_argument("models." + name +
                                      ": layer_forward_share and layer_s_per_sample differ in length");
        for (double v : r.layer_forward_share)
          if (!(v >= 0 && v <= 1))
            throw std::invalid_argument("models." + name + ": layer_forward_share values must lie in [0, 1]");
        if (m.contains("flops_while_waiting"))
          for (auto& [n, by_a] : m["flops_while_waiting"].items())
            for (auto& [a, v] : by_a.items()) r.flops_while_waiting[std::stoi(n)][std::stoi(a)] = v.get<double>();
        if (m.contains("sync_point_s"))
          for (auto& [n, v] : m["sync_point_s"].items()) {
            const double s = v.get<double>();
            if (!(s >= 0)) throw std::invalid_argument("models." + name + ".sync_point_s." + n + " must be >= 0");
            r.sync_point_s[std::stoi(n)] = s;
          }
        if (m.contains("flops_synchronized"))
          for (auto& [n, v] : m["flops_synchronized"].items()) r.flops_synchronized[std::stoi(n)] = v.get<double>();
        if (m.contains("tp_synchronized"))  // absent in older calibration files
          for (auto& [n, by_t] : m["tp_synchronized"].items())
            for (auto& [t, v] : by_t.items()) {
              const double b = v.at("batch").get<double>(), sec = v.at("seconds").get<double>();
              if (!(b >= 1) || !(sec > 0))
                throw std::invalid_argument("models." + name + ".tp_synchronized." + n + "." + t +
                                            ": batch must be >= 1 and seconds > 0");
              r.tp_synchronized[std::stoi(n)][std::stoi(t)] = {b, sec};
            }
        cal.models[name] = r;
      }
    }
    // (bytes, seconds) by increasing size; times positive (delays may be 0).
    auto curve_of = [](const nlohmann::json& c, const std::string& where, bool zero_ok) {
      auto v = c.get<std::vector<std::pair<double, double>>>();
      for (size_t i = 0; i < v.size(); ++i) {
        if (!(v[i].first > 0) || !(zero_ok ? v[i].second >= 0 : v[i].second > 0) ||
            (i > 0 && v[i].first <= v[i - 1].first))
          throw std::invalid_argument(where + ": sizes must increase and times be " +
                                      (zero_ok ? "non-negative" : "positive"));
      }
      return v;
    };
    if (j.contains("collective_times"))
      for (auto& [n, ops] : j["collective_times"].items())
        for (auto& [op, curve] : ops.items())
          cal.collective_times[std::stoi(n)][op] = curve_of(curve, "collective_times." + n + "." + op, false);
    if (j.contains("send_delay"))
      for (auto& [n, curve] : j["send_delay"].items())
        cal.send_delay[std::stoi(n)] = curve_of(curve, "send_delay." + n, true);
    if (j.contains("p2p"))
      for (auto& [n, ab] : j["p2p"].items())
        cal.p2p[std::stoi(n)] = AlphaBeta{ab.at("alpha").get<double>(), ab.at("bandwidth").get<double>()};
    if (j.contains("collectives")) {
      for (auto& [n, ops] : j["collectives"].items())
        for (auto& [op, ab] : ops.items())
          cal.collectives[std::stoi(n)][op] = AlphaBeta{ab.at("alpha").get<double>(), ab.at("bandwidth").get<double>()};
    }
  } catch (const std::exception& e) {
    throw std::invalid_argument(std::string("calibration file is not valid: ") + e.what() +
                                "; rerun tandem plan --calibrate");
  }
  if (cal.cores < 1) throw std::invalid_argument("calibration file: cores must be at least 1");
  return cal;
}

}  // namespace tandem::plan
