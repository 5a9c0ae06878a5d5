// The memory and time model behind `tandem plan`: ZeRO model-state memory, activation memory,
// alpha-beta collectives, bucketed overlap with backward, pipeline bubble and tensor-parallel
// all-reduces, and the search over layouts. Plain C++17; formulas in docs/drafts/plan.md.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "tandem/launcher.h"
#include "tandem/optim.h"
#include "tandem/pipeline_schedule.h"
#include "tandem/plan.h"

namespace tandem::plan {
namespace {

// Gradients and optimizer state of the trained share only (frozen parameters hold neither).
void frozen_share(const ModelSpec& m, MemoryBreakdown& b) {
  if (!(m.trainable_parameters > 0) || !(m.parameters > 0)) return;
  const double share = std::min(1.0, m.trainable_parameters / m.parameters);
  b.gradients *= share;
  b.optimizer *= share;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}
std::string gb(double bytes) { return fmt("%.1f GB", bytes / 1e9); }

// The optimizer's parameter-sized state tensors, counted as the strategies count them
// (tandem/optim.h); sgd and lars with momentum.
int state_slots(const std::string& optimizer) {
  if (optimizer != "adam" && optimizer != "adamw" && optimizer != "sgd" && optimizer != "sgd-plain" &&
      optimizer != "lars" && optimizer != "lamb") {
    throw std::invalid_argument("unknown optimizer '" + optimizer + "' (adam, adamw, sgd, sgd-plain, lars, lamb)");
  }
  OptimizerOptions o;
  o.kind = optimizer == "sgd-plain" ? "sgd" : optimizer;
  o.momentum = optimizer == "sgd" || optimizer == "lars" ? 0.9 : 0.0;
  return optimizer_state_slots(o);
}

bool is_16bit(const std::string& precision) { return precision == "mixed" || precision == "bf16"; }

double device_rate(const DeviceSpec& d, const std::string& precision) {
  return (is_16bit(precision) ? d.flops : d.flops_fp32) * d.mfu;
}

// activation_bytes_per_sample() gives float32 bytes for descriptions that carry their own
// figure (the dense built-ins) and 16-bit bytes for the transformer formula; scale to the precision.
double activation_scale(const ModelSpec& m, const std::string& precision) {
  if (m.activation_bytes_per_sample > 0) return is_16bit(precision) ? 0.5 : 1.0;
  return is_16bit(precision) ? 1.0 : 2.0;
}

struct Rates {
  double flops = 0;                // FLOP/s of forward+backward per worker
  double overhead = 0;             // s per step (--overhead-ms), or per forward+backward pass (calibrated)
  bool overhead_per_pass = false;  // the calibration's intercept: paid by every micro-batch
  double opt_per_param = 0;        // s per parameter updated (CPU calibration); 0: from bandwidth
  double slice = 1;                // time-sharing factor (CPU workers beyond the cores)
};

Rates worker_rates(const ModelSpec& m, const ClusterSpec& c, const PlanOptions& o, int workers_on_node) {
  Rates r;
  DeviceSpec d = slowest_device(c);
  r.flops = device_rate(d, o.precision);
  r.overhead = c.framework_overhead_s;
  if (!c.cpu || !o.calibration) return r;
  const Calibration& cal = *o.calibration;
  auto it = cal.models.find(m.name);
  const int cores = std::max(1, cal.cores);
  const int n = std::max(1, workers_on_node);
  const int threads = std::max(1, cores / n);  // what tandem's Runtime picks
  r.slice = std::max(1.0, static_cast<double>(n * threads) / cores);
  if (it == cal.models.end()) {
    if (cal.gemm_flops_1t > 0) r.flops = cal.gemm_flops_1t * threads / r.slice;
    return r;
  }
  const ModelRates& mr = it->second;
  const double one = mr.flops_1t > 0 ? mr.flops_1t : r.flops;
  const double all = mr.flops_all > 0 ? mr.flops_all : one * cores;
  const double conc = mr.flops_concurrent > 0 ? mr.flops_concurrent : one;
  if (n == 1) {
    r.flops = threads >= cores ? all : one * threads * all / (cores * one);
  } else if (auto s = mr.flops_synchronized.find(n); s != mr.flops_synchronized.end() && s->second > 0) {
    r.flops = s->second;  // measured at this world size, time-sharing and synchronisation included
  } else {
    // Several processes at once: the concurrent one-thread rate, times threads at the
    // single-process thread efficiency, shared in time beyond the cores.
    double thread_eff = all / (cores * one);
    r.flops = (threads == 1 ? conc : conc * threads * thread_eff) / r.slice;
  }
  r.overhead = mr.overhead_s * r.slice;
  r.overhead_per_pass = true;
  // One worker on all cores: the intercept fitted with flops_all, so that the two reproduce the
  // all-core times they were fitted to (with the one-thread intercept they did not).
  if (n == 1 && threads >= cores && mr.flops_all > 0 && mr.overhead_all_s >= 0) r.overhead = mr.overhead_all_s;
  // Two moments (adam, adamw, lamb) cost as Adam's step, the rest as SGD's.
  const bool adam = state_slots(o.optimizer) == 2;
  r.opt_per_param = adam ? mr.adam_s_per_param : mr.sgd_s_per_param;
  r.opt_per_param *= r.slice;
  if (n == 1 && threads > 1) {
    // One worker on several threads: the optimizer's element-wise kernels split over them too.
    // Timed with all threads (adam_all_s_per_param) where the calibration has it, else scaled
    // as forward and backward scale. Priced at one thread's time, the MLP's single worker came
    // out 15-39 % slow (Adam over 1.86 M parameters takes 5.7-9.2 ms on one thread, 3.4-3.7 on
    // two).
    const double all_threads = adam ? mr.adam_all_s_per_param : mr.sgd_all_s_per_param;
    if (all_threads > 0 && threads >= cores) r.opt_per_param = all_threads;
    else if (one > 0) r.opt_per_param /= std::max(1.0, r.flops / one);
  }
  return r;
}

// Gradients become ready evenly over `window` seconds of backward, in k buckets; each bucket's
// collective starts when it is ready and the previous one is done. Returns the time communication
// runs past the end of backward.
double bucket_exposed(const std::vector<double>& bucket_seconds, double window) {
  const size_t k = bucket_seconds.size();
  if (k == 0) return 0.0;
  double end = 0.0;
  for (size_t i = 0; i < k; ++i) {
    double ready = window * static_cast<double>(i + 1) / static_cast<double>(k);
    end = std::max(end, ready) + bucket_seconds[i];
  }
  return std::max(0.0, end - window);
}

std::vector<double> split_buckets(double bytes, double cap) {
  std::vector<double> b;
  if (bytes <= 0) return b;
  if (cap <= 0) cap = bytes;
  double left = bytes;
  while (left > 0) {
    b.push_back(std::min(cap, left));
    left -= cap;
  }
  return b;
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// The entry measured at world size n, or at the nearest larger (else the largest) one measured.
template <typename V>
const V* nearest_world(const std::map<int, V>& by_n, int n) {
  if (by_n.empty()) return nullptr;
  auto it = by_n.lower_bound(n);
  if (it == by_n.end()) it = std::prev(by_n.end());
  return &it->second;
}

// ---- layer by layer (models with ModelSpec::children)

// Whether autograd computes this child's input gradient: some earlier child has parameters. On
// a pipeline too: a stage's received activation requires grad only then.
std::vector<bool> input_grad_needed(const ModelSpec& m) {
  std::vector<bool> need(m.children.size(), false);
  bool any = false;
  for (size_t i = 0; i < m.children.size(); ++i) {
    need[i] = any;
    any = any || m.children[i].parameters > 0;
  }
  return need;
}

// Forward+backward FLOPs per sample of child i: forward, the weight gradient (with parameters),
// the input gradient (when needed): 1x each for FLOP-counted layers.
double layer_train_flops(const LayerSpec& l, bool input_grad) {
  return l.forward_flops * (1.0 + (l.parameters > 0 ? 1.0 : 0.0) + (input_grad ? 1.0 : 0.0));
}

// The split of a child over tp ranks: column- and row-parallel Linears compute 1/tp of it.
double tp_share(const LayerSpec& l, int tp) { return (tp > 1 && !l.tp.empty()) ? 1.0 / tp : 1.0; }

struct StageTimes {
  double fwd = 0, bwd = 0;        // compute per micro-batch
  double tp_fwd = 0, tp_bwd = 0;  // tensor-parallel all-reduces per micro-batch
  double out_bytes = 0;           // activation sent to the next stage per micro-batch
};

// Makespan of one pipelined step: every stage runs pipeline_order() (as tandem::Pipeline does);
// a forward waits for the previous stage's forward of that micro-batch plus a transfer, a
// backward for the next stage's backward plus a transfer. Stage times are at full speed;
// speed(k) is the rate at which each of k stages computing at once progresses (1 on devices of
// their own; on shared CPU cores the calibrated rate of k * tp * dp workers against one thread).
// A fluid simulation: between events every running operation advances at speed(running).
//
// hold[s] (empty: none): a message of stage s leaves when the stage next stops computing (its
// next operation ends, or it waits) or hold[s] after it was produced, whichever comes first.
// grad_back[s] (empty: all true): whether a gradient goes back from stage s+1 to stage s. None
// does where nothing up to stage s has parameters (tandem::Pipeline then sends none), and stage
// s's backward does not wait.
//
// On shared CPU cores Tandem's MPI sends are posted and progressed by the rank's progress
// thread, which gets a core when the compute thread blocks or the scheduler gives it a slice
// (a one-step timeline of the MLP's 2-stage pipeline showed the first activation arrive after
// stage 0's second forward); the calibration measures that delay. On a GPU the send is queued
// on a stream and leaves at once.
// The bubble of the zero-bubble schedules relative to 1F1B's (pipeline_bubble_theory, with the
// paper's T_F = T_B = T_W: the weight gradients are half a linear layer's backward): zb-h1 a
// third, zb-v a sixth; 1 for gpipe and 1f1b. The simulation below runs 1F1B's order and the
// bubble it finds (transfers, calibrated send delays included) is scaled by this.
double zero_bubble_scale(const PlanOptions& o, int pp, int64_t m) {
  if (pp < 2) return 1.0;
  return pipeline_bubble_theory(o.pipeline_schedule, pp, m) / pipeline_bubble_theory(PipelineSchedule::k1F1B, pp, m);
}

double simulate_pipeline(const std::vector<StageTimes>& st, int64_t m, bool gpipe, const std::vector<double>& xfer,
                         const std::function<double(int)>& speed, const std::vector<double>& hold,
                         const std::vector<bool>& grad_back = {}) {
  const int p = static_cast<int>(st.size());
  auto grad_to = [&](int s) { return grad_back.empty() || grad_back[s]; };  // from s+1 to s
  std::vector<std::vector<std::pair<bool, int64_t>>> order(p);
  for (int s = 0; s < p; ++s) order[s] = pipeline_order(gpipe, s, p, m);
  const double unset = -1.0, inf = std::numeric_limits<double>::infinity();
  // f_sent[s][i]: when stage s's activation of micro-batch i leaves for s+1; b_sent[s][i]: when
  // its input gradient of micro-batch i leaves for s-1 (unset: not yet).
  std::vector<std::vector<double>> f_sent(p, std::vector<double>(m, unset)), b_sent = f_sent;
  struct Held {
    bool fwd;
    int64_t i;
    double deadline;
  };
  std::vector<std::vector<Held>> held(p);  // produced, not yet sent
  std::vector<size_t> next(p, 0);
  std::vector<double> left(p, -1.0);  // work left of the running operation; < 0: not started
  double now = 0.0;
  auto ready_at = [&](int s) {  // when stage s's next operation may start (inf: not known yet)
    auto [fwd, i] = order[s][next[s]];
    if (fwd) return s == 0 ? 0.0 : (f_sent[s - 1][i] < 0 ? inf : f_sent[s - 1][i] + xfer[s - 1]);
    if (s == p - 1 || !grad_to(s)) return 0.0;
    return b_sent[s + 1][i] < 0 ? inf : b_sent[s + 1][i] + xfer[s];
  };
  auto release = [&](int s, bool all) {  // all: the stage blocks; else only what is due
    auto& h = held[s];
    auto sent = [&](const Held& x) {
      if (!all && x.deadline > now + 1e-15) return false;
      (x.fwd ? f_sent : b_sent)[s][x.i] = now;
      return true;
    };
    h.erase(std::remove_if(h.begin(), h.end(), sent), h.end());
  };
  for (;;) {
    int running = 0;
    double next_start = inf;
    bool all_done = true;
    // A stage that is done or waits sends what it holds (its progress thread gets the core).
    for (int s = 0; s < p; ++s) release(s, next[s] >= order[s].size() || (left[s] < 0 && ready_at(s) > now + 1e-15));
    for (int s = 0; s < p; ++s) {
      if (next[s] >= order[s].size()) continue;
      all_done = false;
      if (left[s] < 0) {
        const double r = ready_at(s);
        if (r <= now + 1e-15) {
          auto [fwd, i] = order[s][next[s]];
          left[s] = fwd ? st[s].fwd + st[s].tp_fwd : st[s].bwd + st[s].tp_bwd;
        } else {
          next_start = std::min(next_start, r);
        }
      }
      if (left[s] >= 0) ++running;
    }
    if (all_done) break;
    const double v = running > 0 ? std::max(1e-9, speed(running)) : 1.0;
    double dt = next_start - now;
    for (int s = 0; s < p; ++s) {
      if (next[s] < order[s].size() && left[s] >= 0) dt = std::min(dt, left[s] / v);
      for (const auto& x : held[s]) dt = std::min(dt, x.deadline - now);
    }
    if (!std::isfinite(dt)) throw std::logic_error("pipeline simulation deadlocked");
    now += dt;
    for (int s = 0; s < p; ++s) {
      if (next[s] >= order[s].size() || left[s] < 0) continue;
      left[s] -= dt * v;
      if (left[s] <= 1e-12) {
        auto [fwd, i] = order[s][next[s]];
        release(s, true);  // what the previous operation produced leaves now at the latest
        const bool sends = fwd ? s + 1 < p : s > 0 && grad_to(s - 1);
        const double h = hold.empty() ? 0.0 : hold[fwd ? s : s - 1];
        if (sends && h > 0) {
          held[s].push_back({fwd, i, now + h});
        } else if (sends) {
          (fwd ? f_sent : b_sent)[s][i] = now;
        }
        left[s] = -1.0;
        ++next[s];
      }
    }
  }
  return now;
}

// A pipelined (or tensor-parallel) step of a model that lists its children, stage by stage.
struct PipelineTimes {
  double step = 0;     // makespan of the micro-batches
  double slot = 0;     // slowest stage's micro-batch, every stage busy
  double compute = 0;  // that stage's compute over the step
  double bubble = 0;
  double tp_comm = 0, p2p_comm = 0;
  bool fitted = false;  // from the calibration's per-child fits
};

// The calibration's per-child fits of model m on a CPU cluster, or null (not calibrated, or not
// child by child).
const ModelRates* layer_fits(const ModelSpec& m, const ClusterSpec& c, const PlanOptions& o) {
  if (!c.cpu || !o.calibration) return nullptr;
  auto it = o.calibration->models.find(m.name);
  if (it == o.calibration->models.end() || it->second.layer_s_per_sample.size() != m.children.size() ||
      it->second.layer_overhead_s.size() != m.children.size() || !(it->second.flops_1t > 0))
    return nullptr;
  return &it->second;
}

PipelineTimes layered_times(const ModelSpec& m, const ClusterSpec& c, const PlanOptions& o, const Rates& r,
                            const std::vector<int64_t>& partition, int dp, int tp, int64_t mb, int64_t mcount,
                            double act_elem) {
  const int pp = static_cast<int>(partition.size());
  const int used = dp * tp * pp;
  // Per child: forward+backward seconds per micro-batch on one worker of this layout. With a
  // per-layer calibration: its fixed + per-sample fit (one thread); otherwise FLOPs at the worker rate.
  const std::vector<bool> need = input_grad_needed(m);
  const ModelRates* mr = layer_fits(m, c, o);
  // With the per-layer fits, stage times are one thread's alone; speed(k) scales them to k
  // stages (k * tp * dp workers) computing at once on the shared cores.
  const int cores = c.cpu && o.calibration ? std::max(1, o.calibration->cores) : 1;
  const int threads = std::max(1, cores / used);
  double tp_speed = 0.0;  // a tensor-parallel layout's own measured rate (see below), 0: none
  auto speed = [&](int active_stages) {
    if (!mr) return 1.0;
    const int n = active_stages * tp * dp;
    if (n >= used && tp_speed > 0) return tp_speed;
    if (n >= used || threads > 1) return r.flops / mr->flops_1t;  // everyone at once: the world's rate
    // Measured: n of `used` workers computing while the others wait in a receive.
    if (auto w = mr->flops_while_waiting.find(used); w != mr->flops_while_waiting.end()) {
      auto a = w->second.find(n);
      if (a != w->second.end() && a->second > 0) return a->second / mr->flops_1t;
    }
    if (n == 1) return 1.0;
    auto it = mr->flops_synchronized.find(n);
    if (it != mr->flops_synchronized.end() && it->second > 0) return it->second / mr->flops_1t;
    const double conc = mr->flops_concurrent > 0 ? mr->flops_concurrent : mr->flops_1t;
    return conc * std::min(1.0, static_cast<double>(cores) / n) / mr->flops_1t;
  };
  PipelineTimes out;
  out.fitted = mr != nullptr;
  // A child's one-thread seconds at batch b: its fit (fixed + per-sample * b), scaled so that the
  // children add up to the whole model's fit at that batch. Timed one by one, in a loop of their
  // own, the children vary between calibrations (the CNN's first convolution at 42-155 us per
  // sample in four calibrations of one evening, their sum 18-23 % above the whole model's; the
  // MLP's fixed parts 0.54-3.6 times the whole model's intercept in 30 calibrations), while the
  // whole model's rate holds within about 15 %. So the children give the split of a step between
  // stages and shards, the whole model its total, the fixed parts included: at the MLP's
  // 48-sample micro-batches the fixed parts are a third of a stage's time, and scaling only the
  // per-sample parts priced its 2-stage pipeline 13-36 % slow (docs/BENCHMARKS.md, "Planning").
  double fixed_sum = 0.0, per_sum = 0.0;
  if (mr) {
    for (double v : mr->layer_overhead_s) fixed_sum += v;
    for (double v : mr->layer_s_per_sample) per_sum += v;
  }
  auto child_seconds = [&](size_t i, double b) {
    const double parts = fixed_sum + per_sum * b;
    const double whole = mr->overhead_s + 3.0 * forward_flops_per_sample(m) * b / mr->flops_1t;
    const double own = mr->layer_overhead_s[i] + mr->layer_s_per_sample[i] * b;
    return parts > 0 ? own * whole / parts : whole / static_cast<double>(mr->layer_s_per_sample.size());
  };
  // Tensor parallelism alone (one thread per worker): the shard's one-thread time at the batch
  // the calibration trained it at, over the time it took there with every rank at once
  // (ModelRates::tp_synchronized). Scaled by the whole model's synchronized rate instead, the
  // MLP's tp4 steps were priced 17-44 % slow: a quarter of each weight matrix per rank runs
  // faster four to two cores than the whole one does at a quarter of the batch (4 processes at
  // once, one thread each, Python: 11.5-14.2 ms against 16.1-16.9 ms, the same FLOPs).
  // Only where tensor parallelism is the whole layout (dp 1): with replicas, their gradient
  // all-reduce runs in sub-groups of an oversubscribed world, which the calibration's curves
  // (taken with the group alone) price 5-15 times low (the MLP's tp 2 x dp 2: 0.44 ms priced,
  // 6.7 ms exposed measured); the whole model's slower rate offsets that there, and taking the
  // shard's own rate alone moved those rows from -7..+16 % to -33..-36 %.
  if (mr && pp == 1 && tp > 1 && dp == 1 && threads == 1) {
    auto w = mr->tp_synchronized.find(used);
    if (w != mr->tp_synchronized.end()) {
      auto t = w->second.find(tp);
      if (t != w->second.end() && t->second.second > 0) {
        double alone = 0.0;
        for (size_t i = 0; i < m.children.size(); ++i)
          alone += child_seconds(i, t->second.first) * tp_share(m.children[i], tp);
        if (alone > 0) tp_speed = alone / t->second.second;
      }
    }
  }
  std::vector<StageTimes> st;
  size_t i = 0;
  for (int64_t count : partition) {
    StageTimes t;
    for (int64_t j = 0; j < count; ++j, ++i) {
      const LayerSpec& ly = m.children[i];
      // A later stage's input requires grad only if something before it has parameters
      // (tandem::Pipeline tracks it only then).
      const bool in_grad = need[i];
      const double share = tp_share(ly, tp);
      const double train = layer_train_flops(ly, in_grad);
      // A split child does 1/tp of all of its work: the fixed part of a Linear's time (reading
      // its weights, writing their gradient) is proportional to its weights too.
      const double secs =
          mr ? child_seconds(i, static_cast<double>(mb)) * share : train * static_cast<double>(mb) * share / r.flops;
      // The forward's part: calibrated, the measured share (a max-pool's forward is 82 % of its
      // time, the FLOP split says half); otherwise its FLOP share of the layer's training work
      // (a third with both gradients).
      const double fshare = mr && mr->layer_forward_share.size() == m.children.size() ? mr->layer_forward_share[i]
                            : train > 0                                               ? ly.forward_flops / train
                                                                                      : 0.5;
      t.fwd += secs * fshare;
      t.bwd += secs * (1.0 - fshare);
      if (tp > 1 && ly.tp == "row")
        t.tp_fwd += collective_seconds(c, o, "allreduce", tp, static_cast<double>(mb) * ly.output_elems * act_elem, 1);
      if (tp > 1 && ly.tp == "column" && in_grad)
        t.tp_bwd += collective_seconds(c, o, "allreduce", tp, static_cast<double>(mb) * ly.input_elems * act_elem, 1);
      t.out_bytes = static_cast<double>(mb) * ly.output_elems * act_elem * (ly.tp == "column" ? 1.0 / tp : 1.0);
    }
    out.tp_comm += (t.tp_fwd + t.tp_bwd) * mcount;
    // The simulation divides work by the compute speed; the all-reduces run at their
    // calibrated pace (taken with every stage busy).
    t.tp_fwd *= speed(pp);
    t.tp_bwd *= speed(pp);
    st.push_back(t);
  }
  std::vector<double> xfer;
  AlphaBeta ab{c.intra.latency, c.intra.bandwidth};
  if (!c.cpu && tp * pp > devices_per_node(c)) ab = AlphaBeta{c.inter.latency, c.inter.bandwidth};
  if (const AlphaBeta* cal = c.cpu && o.calibration ? nearest_world(o.calibration->p2p, used) : nullptr;
      cal && cal->bandwidth > 0)
    ab = *cal;
  std::vector<bool> grad_back;
  for (size_t s = 0, first = 0; s + 1 < st.size(); ++s) {
    first += static_cast<size_t>(partition[s]);
    grad_back.push_back(need[first]);
    xfer.push_back(ab.alpha + st[s].out_bytes / ab.bandwidth);
    out.p2p_comm += (grad_back.back() ? 2.0 : 1.0) * xfer.back() * mcount;
  }
  // On CPU, how long a send waits for the sender's progress thread while the sender computes:
  // for messages under the launcher's eager limit, the calibrated delay (linear in the size
  // between the measured sizes under it), less the transfer counted above. Over the limit, none:
  // the calibrated rendezvous delay (6.5 ms on 2 ranks, 22-30 ms on 3-4, for 1 MiB behind a
  // sender computing 30 ms without a break) put the CNN's pipelines (602 KB activations) 23 to
  // 103 % slow, where sending at once had them within 11 % (docs/BENCHMARKS.md).
  constexpr double kEagerLimit = kLocalEagerLimitBytes;
  std::vector<double> hold;
  if (const auto* delays = c.cpu && o.calibration ? nearest_world(o.calibration->send_delay, used) : nullptr;
      delays && !delays->empty()) {
    std::vector<std::pair<double, double>> v;
    for (const auto& d : *delays)
      if (d.first <= kEagerLimit) v.push_back(d);
    for (size_t s = 0; s + 1 < st.size(); ++s) {
      const double b = st[s].out_bytes;
      double d = 0.0;
      if (!v.empty() && b <= kEagerLimit) {
        d = b <= v.front().first ? v.front().second : v.back().second;
        for (size_t k = 1; k < v.size(); ++k) {
          if (b > v[k - 1].first && b <= v[k].first)
            d = v[k - 1].second +
                (b - v[k - 1].first) / (v[k].first - v[k - 1].first) * (v[k].second - v[k - 1].second);
        }
      }
      hold.push_back(std::max(0.0, d - xfer[s]));
    }
  }
  const double all_busy = speed(pp);
  for (const auto& t : st) {
    out.slot = std::max(out.slot, (t.fwd + t.bwd + t.tp_fwd + t.tp_bwd) / all_busy);
    out.compute = std::max(out.compute, (t.fwd + t.bwd) / all_busy * mcount);
  }
  out.step =
      simulate_pipeline(st, mcount, o.pipeline_schedule == PipelineSchedule::kGPipe, xfer, speed, hold, grad_back);
  const double bubble_1f1b = std::max(0.0, out.step - out.slot * mcount);
  out.bubble = bubble_1f1b * zero_bubble_scale(o, pp, mcount);
  out.step += out.bubble - bubble_1f1b;
  return out;
}

// Ring attention's transfers (tandem/context_parallel.h) per layer and micro-batch on one rank
// of a cp > 1 layout, transformers described by shape.
//
// A send carries this rank's k and v block (forward and backward) or a block's accumulated dk
// and dv (backward): 2 * (T/cp) * kv_width/tp * micro_batch values (kv_width = hidden *
// kv_heads / heads; tensor parallelism splits the heads); k and v in the training precision
// (2 bytes in 16-bit, 4 in fp32), the gradients in float32, in which the ring accumulates them.
// Forward: cp - 1 sends; backward: cp - 1 k/v sends and cp gradient sends (a block's gradient
// visits every rank and comes home): 3cp - 2 per layer and micro-batch.
//
// Each transfer runs while a block is computed (the next block arrives during this one), so it
// is hidden when it takes less than the block and exposed by the difference otherwise. In the
// load-balanced causal layout every block is 1/cp^2 of the causal attention's forward FLOPs,
// 2*T^2*hidden per sample (q k^T and the product with v over T^2/2 pairs), over tp; backward's
// are twice that. Backward's steps 1 to cp - 2 each carry two transfers (the k/v block for the
// next step and the previous step's gradient), its first step the k/v block and its last the
// previous gradient, and its last gradient send follows the last block: exposed whole. The window uses the training
// precision's rate; the ring computes its blocks in float32, which takes longer on tensor-core devices, so the exposed
// time is an upper bound.
struct RingTimes {
  double bytes = 0, seconds = 0, exposed = 0;  // per layer and micro-batch
};
RingTimes ring_attention_times(const ModelSpec& m, const ClusterSpec& c, const PlanOptions& o, const Layout& l,
                               double rate) {
  RingTimes r;
  const int cp = l.cp, tp = l.tp;
  if (cp <= 1) return r;
  const double kv_heads = static_cast<double>(m.kv_heads > 0 ? m.kv_heads : m.heads);
  const double kv_width = static_cast<double>(m.hidden) * kv_heads / static_cast<double>(m.heads) / tp;
  const double mb = static_cast<double>(std::max<int64_t>(1, l.micro_batch));
  const double values = 2.0 * static_cast<double>(m.seq) / cp * kv_width * mb;
  const double kv_bytes = values * (is_16bit(o.precision) ? 2.0 : 4.0), grad_bytes = values * 4.0;
  // The ring's cp ranks lie tp apart (tandem/grid.h): within a node while cp * tp fits; across
  // nodes each of the tp rings of a node sends over the node's link at once.
  const int dpn = devices_per_node(c);
  AlphaBeta ab{c.intra.latency, c.intra.bandwidth};
  if (!c.cpu && cp * tp > dpn) ab = AlphaBeta{c.inter.latency, c.inter.bandwidth / std::min(tp, dpn)};
  if (const AlphaBeta* cal = c.cpu && o.calibration ? nearest_world(o.calibration->p2p, l.devices()) : nullptr;
      cal && cal->bandwidth > 0)
    ab = *cal;
  const double t_kv = ab.alpha + kv_bytes / ab.bandwidth, t_grad = ab.alpha + grad_bytes / ab.bandwidth;
  const double s = static_cast<double>(m.seq);
  const double block_fwd = 2.0 * s * s * static_cast<double>(m.hidden) * mb / (double(cp) * cp * tp) / rate;
  const double block_bwd = 2.0 * block_fwd;
  auto beyond = [](double transfer, double block) { return std::max(0.0, transfer - block); };
  const double fwd = (cp - 1) * beyond(t_kv, block_fwd);
  const double bwd =
      beyond(t_kv, block_bwd) + (cp - 2) * beyond(t_kv + t_grad, block_bwd) + beyond(t_grad, block_bwd) + t_grad;
  r.bytes = (2.0 * cp - 2.0) * kv_bytes + cp * grad_bytes;
  r.seconds = (2.0 * cp - 2.0) * t_kv + cp * t_grad;
  r.exposed = fwd + bwd;
  return r;
}

// Estimate::stage_memory: each stage's own model state, and the even-spread activation figure
// of `e` rescaled to the stage's share of the children's inputs (what a child keeps for its
// backward scales with them) and to the micro-batches alive on it.
void fill_stage_memory(const ModelSpec& m, const std::vector<double>& stage_params, const Layout& l, StateBytes sb,
                       const PlanOptions& o, Estimate& e) {
  if (stage_params.empty() || e.partition.size() != stage_params.size()) return;
  const int pp = static_cast<int>(stage_params.size());
  const double mcount = static_cast<double>(std::max<int64_t>(1, l.micro_batches));
  const double even_share = std::ceil(static_cast<double>(m.layers) / pp) / static_cast<double>(m.layers);
  const double even_flight = std::min<double>(pp, mcount);
  double all_inputs = 0;
  for (const auto& c : m.children) all_inputs += c.input_elems;
  size_t i = 0;
  for (int s = 0; s < pp; ++s) {
    double inputs = 0;
    for (int64_t k = 0; k < e.partition[s]; ++k, ++i) inputs += m.children[i].input_elems;
    MemoryBreakdown b = zero_model_states(stage_params[s], l.zero, l.dp * l.cp, sb);
    frozen_share(m, b);
    // zb-h1 holds 1F1B's; zb-v holds 2pp half-stage chunks on every stage, 1F1B stage 0's.
    const double flight = o.pipeline_schedule == PipelineSchedule::kGPipe ? mcount
                          : o.pipeline_schedule == PipelineSchedule::kZBV ? std::min<double>(pp, mcount)
                                                                          : std::min<double>(pp - s, mcount);
    const double share = all_inputs > 0 ? inputs / all_inputs : 1.0 / pp;
    b.activations = e.memory.activations * (share / even_share) * (flight / even_flight);
    e.stage_memory.push_back(b);
  }
}

// One rank's model state: `dense` parameters sharded by ZeRO over the dp * cp ranks, `experts`
// (the rank's experts / ep of the model's) the same without expert parallelism; with it, over
// the dp * cp / ep ranks that hold the same experts by ZeRO-1 whatever the stage (the Engine's
// expert bank: weights and gradients whole, masters and optimizer state sharded).
MemoryBreakdown rank_model_states(const ModelSpec& m, const Layout& l, double dense, double experts, StateBytes sb) {
  const int group = l.dp * l.cp;
  MemoryBreakdown b = zero_model_states(dense, l.zero, group, sb);
  frozen_share(m, b);
  if (experts > 0) {
    MemoryBreakdown x = zero_model_states(experts, l.ep > 1 ? std::min(l.zero, 1) : l.zero, group / l.ep, sb);
    frozen_share(m, x);
    b.parameters += x.parameters;
    b.gradients += x.gradients;
    b.optimizer += x.optimizer;
    b.expert_states = x.parameters + x.gradients + x.optimizer;
  }
  return b;
}

// Refuses an ep the model cannot take (std::invalid_argument): ep > 1 on a dense model, an ep
// that does not divide the experts or the data-parallel ranks its groups are made of.
void check_expert_parallel(const ModelSpec& m, int ep, int dp) {
  if (ep < 1) throw std::invalid_argument("expert-parallel degree must be at least 1, got " + std::to_string(ep));
  if (ep == 1) return;
  if (!is_moe(m))
    throw std::invalid_argument("expert parallelism (ep " + std::to_string(ep) + ") needs a MoE model; '" + m.name +
                                "' has no experts (--experts, or --model mixtral-8x7b)");
  if (m.moe.experts % ep != 0)
    throw std::invalid_argument("expert-parallel degree " + std::to_string(ep) + " does not divide the " +
                                std::to_string(m.moe.experts) + " experts: each ep rank holds experts / ep of them");
  if (dp % ep != 0)
    throw std::invalid_argument("expert-parallel degree " + std::to_string(ep) + " does not divide the " +
                                std::to_string(dp) + " data-parallel replicas its groups are made of");
}
}  // namespace

double all_to_all_seconds(const ClusterSpec& c, const PlanOptions& o, int ep, int stride, int world, double bytes) {
  if (ep <= 1 || bytes <= 0) return 0.0;
  // On this machine: the calibrated point-to-point exchange (every pair of ranks at once).
  if (const AlphaBeta* cal = c.cpu && o.calibration ? nearest_world(o.calibration->p2p, world) : nullptr;
      cal && cal->bandwidth > 0)
    return (ep - 1) * cal->alpha + bytes / cal->bandwidth;
  const int dpn = devices_per_node(c);
  if (c.cpu || ep * stride <= dpn) return (ep - 1) * c.intra.latency + bytes / c.intra.bandwidth;
  // Across nodes: d of the group's ranks per node; the (ep - d) / (ep - 1) of the bytes bound
  // for other nodes share the node's link with every device of the node (all exchange at once),
  // the rest go over the intra-node link beside them.
  const int d = std::max(1, std::min(ep, dpn / std::max(1, stride)));
  const double remote = bytes * (ep - d) / (ep - 1), local = bytes - remote;
  return (ep - 1) * c.inter.latency + std::max(local / c.intra.bandwidth, remote / (c.inter.bandwidth / dpn));
}

// ---------------------------------------------------------------- model helpers

bool is_moe(const ModelSpec& m) { return m.moe.experts > 0; }

int64_t moe_layers(const ModelSpec& m) { return is_moe(m) ? m.layers / std::max<int64_t>(1, m.moe.every) : 0; }

double expert_parameters(const ModelSpec& m) {
  return static_cast<double>(moe_layers(m)) * static_cast<double>(m.moe.experts) * 3.0 * static_cast<double>(m.hidden) *
         static_cast<double>(m.moe.intermediate);
}

double moe_slots_per_token(const ModelSpec& m) {
  const double k = static_cast<double>(m.moe.top_k), c = m.moe.capacity_factor;
  return c > 0 ? k * std::min(1.0, c) : k;
}

double moe_slots_held_per_token(const ModelSpec& m) {
  const double k = static_cast<double>(m.moe.top_k), c = m.moe.capacity_factor;
  return c > 0 ? k * c : k;
}

double all_to_all_bytes(const ModelSpec& m, int ep, double tokens, double elem_bytes) {
  if (ep <= 1 || !is_moe(m)) return 0.0;
  return static_cast<double>(ep - 1) / ep * moe_slots_per_token(m) * tokens * static_cast<double>(m.hidden) *
         elem_bytes;
}

double forward_flops_per_sample(const ModelSpec& m) {
  if (m.forward_flops_per_sample > 0) return m.forward_flops_per_sample;
  // 2 FLOPs per parameter per token, plus attention scores and values: 4 * seq^2 * hidden per layer.
  // A MoE block's experts: 2 * 3 * hidden * intermediate per token slot computed.
  const double s = static_cast<double>(m.seq);
  const double active_experts = static_cast<double>(moe_layers(m)) * moe_slots_per_token(m) * 3.0 *
                                static_cast<double>(m.hidden) * static_cast<double>(m.moe.intermediate);
  const double per_token = m.parameters - expert_parameters(m) + active_experts;
  return 2.0 * per_token * s + 4.0 * m.layers * s * s * m.hidden;
}

namespace {
// In the units of the description: float32 bytes where it carries its own figure, else 16-bit.
double moe_activation_bytes_per_sample(const ModelSpec& m, int tp) {
  if (!is_moe(m)) return 0.0;
  const double h = static_cast<double>(m.hidden), i = static_cast<double>(m.moe.intermediate);
  const double per_token = moe_slots_held_per_token(m) * (2.0 * h + 4.0 * i) + 2.0 * static_cast<double>(m.moe.experts);
  const double elem = m.activation_bytes_per_sample > 0 ? 4.0 : 2.0;
  return static_cast<double>(moe_layers(m)) * static_cast<double>(m.seq) * per_token * elem / std::max(1, tp);
}

double dense_activation_bytes_per_sample(const ModelSpec& m, int tp, bool sequence_parallel) {
  if (m.activation_bytes_per_sample > 0) return m.activation_bytes_per_sample / std::max(1, tp);
  // Korthikanti et al. 2022, eq. 1-2 (16-bit, no recomputation), per layer and sample:
  // s*h*(10 + 24/t + 5*a*s/(h*t)), with sequence parallelism (eq. 4) s*h*(10/t + 24/t + ...): the
  // norms, residual and dropout kept on sequence shards. Of the 10, 2 are the two dropout masks;
  // of the 5*a*s, 2 are the softmax's output (the scores backward needs), 1 the attention
  // dropout's mask and 2 its output. Fused attention keeps no scores, only its output, which
  // is the projection's input (counted in the 24).
  const double s = static_cast<double>(m.seq), h = static_cast<double>(m.hidden), a = static_cast<double>(m.heads);
  const double t = std::max(1, tp);
  const double scores = m.attention_scores ? (m.dropout ? 5.0 : 2.0) * a * s / (h * t) : 0.0;
  const double outside = (m.dropout ? 10.0 : 8.0) / (sequence_parallel ? t : 1.0);
  return m.layers * s * h * (outside + 24.0 / t + scores);
}
}  // namespace

double activation_bytes_per_sample(const ModelSpec& m, int tp, bool sequence_parallel) {
  return dense_activation_bytes_per_sample(m, tp, sequence_parallel) + moe_activation_bytes_per_sample(m, tp);
}

namespace {
void validate_moe(const ModelSpec& m) {
  auto bad = [&](const std::string& what) { throw std::invalid_argument("model '" + m.name + "': " + what); };
  const MoeSpec& x = m.moe;
  if (x.experts < 0) bad("experts must be >= 0 (0: no MoE blocks), got " + std::to_string(x.experts));
  if (!is_moe(m)) return;
  if (m.kind != "transformer" || !m.children.empty())
    bad("MoE blocks need a transformer described by its shape (--hidden, --heads, --experts)");
  if (x.top_k < 1 || x.top_k > x.experts)
    bad("top-k must be between 1 and the " + std::to_string(x.experts) + " experts, got " + std::to_string(x.top_k));
  if (x.intermediate < 1) bad("expert intermediate size must be at least 1, got " + std::to_string(x.intermediate));
  if (x.every < 1 || x.every > m.layers)
    bad("every " + std::to_string(x.every) + "-th block a MoE block: must be between 1 and the " +
        std::to_string(m.layers) + " layers");
  if (x.capacity_factor < 0 || !std::isfinite(x.capacity_factor))
    bad("capacity factor must be >= 0 (0: dropless), got " + fmt("%g", x.capacity_factor));
  if (expert_parameters(m) >= m.parameters)
    bad("the experts alone hold " + fmt("%.4g", expert_parameters(m)) + " parameters, more than the model's " +
        fmt("%.4g", m.parameters) + "; check --params, --experts and --expert-intermediate");
}
}  // namespace

void validate(const ModelSpec& m) {
  auto bad = [&](const std::string& what) { throw std::invalid_argument("model '" + m.name + "': " + what); };
  if (!(m.parameters > 0) || !std::isfinite(m.parameters))
    bad("parameters must be a positive number, got " + fmt("%g", m.parameters));
  if (m.layers < 1) bad("layers must be at least 1, got " + std::to_string(m.layers));
  if (m.seq < 1) bad("sequence length must be at least 1, got " + std::to_string(m.seq));
  validate_moe(m);  // before the shape's checks: a MoE block's width decides its parameters
  if (m.kind == "transformer") {
    if (m.hidden < 1) bad("hidden size must be at least 1, got " + std::to_string(m.hidden));
    if (m.heads < 1) bad("attention heads must be at least 1, got " + std::to_string(m.heads));
    if (m.hidden % m.heads != 0)
      bad("hidden size " + std::to_string(m.hidden) + " is not divisible by " + std::to_string(m.heads) + " heads");
    if (m.kv_heads < 0 || (m.kv_heads > 0 && m.heads % m.kv_heads != 0))
      bad("key/value heads must divide the " + std::to_string(m.heads) + " attention heads, got " +
          std::to_string(m.kv_heads));
    // The shape alone holds 12*L*h^2 weights in its blocks; far fewer parameters is impossible.
    double implied = 12.0 * m.layers * static_cast<double>(m.hidden) * m.hidden;
    if (m.parameters < 0.5 * implied)
      bad("parameters " + fmt("%.4g", m.parameters) + " are far fewer than the " + fmt("%.4g", implied) + " that " +
          std::to_string(m.layers) + " layers of hidden size " + std::to_string(m.hidden) +
          " hold (12*layers*hidden^2); check --params, --layers and --hidden");
  } else if (m.kind != "dense") {
    bad("kind must be transformer or dense, got '" + m.kind + "'");
  }
  if (m.forward_flops_per_sample < 0 || m.activation_bytes_per_sample < 0)
    bad("FLOPs and activation bytes must be >= 0");
}

// ---------------------------------------------------------------- cluster helpers

int total_devices(const ClusterSpec& c) {
  int n = 0;
  for (const auto& g : c.groups) n += g.nodes * g.devices_per_node;
  return n;
}

int devices_per_node(const ClusterSpec& c) {
  int d = std::numeric_limits<int>::max();
  for (const auto& g : c.groups) d = std::min(d, g.devices_per_node);
  return c.groups.empty() ? 1 : d;
}

DeviceSpec slowest_device(const ClusterSpec& c) {
  if (c.groups.empty()) throw std::invalid_argument("cluster '" + c.name + "' has no nodes");
  DeviceSpec d = c.groups[0].device;
  for (const auto& g : c.groups) {
    const DeviceSpec& x = g.device;
    if (x.flops * x.mfu < d.flops * d.mfu) {
      d.flops = x.flops;
      d.mfu = x.mfu;
      d.name = x.name;
    }
    if (x.flops_fp32 < d.flops_fp32) d.flops_fp32 = x.flops_fp32;
    d.memory_bytes = std::min(d.memory_bytes, x.memory_bytes);
    d.memory_bandwidth = std::min(d.memory_bandwidth, x.memory_bandwidth);
  }
  return d;
}

void validate(const ClusterSpec& c) {
  auto bad = [&](const std::string& what) { throw std::invalid_argument("cluster '" + c.name + "': " + what); };
  if (c.groups.empty()) bad("no nodes given");
  int nodes = 0;
  for (const auto& g : c.groups) {
    const auto& d = g.device;
    if (g.nodes < 1) bad("nodes must be at least 1, got " + std::to_string(g.nodes));
    if (g.devices_per_node < 1) bad("devices per node must be at least 1, got " + std::to_string(g.devices_per_node));
    if (!(d.memory_bytes > 0)) bad("device '" + d.name + "' memory must be positive, got " + fmt("%g", d.memory_bytes));
    if (!(d.flops > 0) || !(d.flops_fp32 > 0)) bad("device '" + d.name + "' compute rate must be positive");
    if (!(d.mfu > 0) || d.mfu > 1)
      bad("device '" + d.name + "' achieved fraction of peak (mfu) must be in (0, 1], got " + fmt("%g", d.mfu));
    if (!(d.memory_bandwidth > 0)) bad("device '" + d.name + "' memory bandwidth must be positive");
    nodes += g.nodes;
  }
  if (devices_per_node(c) > 1 || c.cpu) {
    if (!(c.intra.bandwidth > 0)) bad("intra-node bandwidth must be positive, got " + fmt("%g", c.intra.bandwidth));
    if (c.intra.latency < 0) bad("intra-node latency must be >= 0");
  }
  if (nodes > 1) {
    if (!(c.inter.bandwidth > 0)) bad("inter-node bandwidth must be positive, got " + fmt("%g", c.inter.bandwidth));
    if (c.inter.latency < 0) bad("inter-node latency must be >= 0");
  }
  if (c.overlap < 0 || c.overlap > 1) bad("overlap must be in [0, 1], got " + fmt("%g", c.overlap));
  if (c.framework_overhead_s < 0) bad("framework overhead must be >= 0");
}

// ---------------------------------------------------------------- collectives

double ring_allreduce_seconds(int n, double bytes, AlphaBeta ab) {
  if (n <= 1 || bytes <= 0) return 0.0;
  return 2.0 * (n - 1) * ab.alpha + 2.0 * (n - 1) / n * bytes / ab.bandwidth;
}
double ring_reduce_scatter_seconds(int n, double bytes, AlphaBeta ab) {
  if (n <= 1 || bytes <= 0) return 0.0;
  return (n - 1) * ab.alpha + static_cast<double>(n - 1) / n * bytes / ab.bandwidth;
}
double ring_allgather_seconds(int n, double bytes, AlphaBeta ab) { return ring_reduce_scatter_seconds(n, bytes, ab); }

double collective_seconds(const ClusterSpec& c, const PlanOptions& o, const std::string& op_asked, int n, double bytes,
                          int stride) {
  if (n <= 1 || bytes <= 0) return 0.0;
  // "X_shm": X in place in symmetric memory (the MPI backend's shared-memory path on one node),
  // as calibrated; otherwise the same model as X.
  std::string op = op_asked;
  auto measured = [&](const std::string& x) {
    return c.cpu && o.calibration && o.calibration->collective_times.count(n) &&
           o.calibration->collective_times.at(n).count(x);
  };
  // ZeRO-3's gather from a separate shard: as calibrated, else as the in-place one.
  if (op == "allgather_copy_shm" && !measured(op)) op = "allgather_shm";
  if (is_shm_op(op) && !measured(op)) op.erase(op.size() - 4);
  auto ring = [&](int k, double s, AlphaBeta ab) {
    if (op == "allreduce") return ring_allreduce_seconds(k, s, ab);
    if (op == "reduce_scatter") return ring_reduce_scatter_seconds(k, s, ab);
    if (op == "allgather") return ring_allgather_seconds(k, s, ab);
    throw std::invalid_argument("unknown collective '" + op + "'");
  };
  if (c.cpu && o.calibration) {
    // Timed at this world size: interpolate the measured sizes (log-log); past the largest,
    // that point's bandwidth; below the smallest, its time (latency-bound).
    auto n_it = o.calibration->collective_times.find(n);
    if (n_it != o.calibration->collective_times.end()) {
      auto op_it = n_it->second.find(op);
      if (op_it != n_it->second.end() && op_it->second.size() >= 2) {
        const auto& v = op_it->second;
        if (bytes <= v.front().first) return v.front().second;
        if (bytes >= v.back().first) return v.back().second * bytes / v.back().first;
        size_t i = 1;
        while (v[i].first < bytes) ++i;
        const double f = std::log(bytes / v[i - 1].first) / std::log(v[i].first / v[i - 1].first);
        return std::exp(std::log(v[i - 1].second) + f * std::log(v[i].second / v[i - 1].second));
      }
    }
  }
  if (c.cpu && o.calibration && !o.calibration->collectives.empty()) {
    // Measured at this world size (or the nearest one measured).
    const auto* ops = nearest_world(o.calibration->collectives, n);
    auto op_it = ops->find(op);
    if (op_it != ops->end() && op_it->second.bandwidth > 0) return ring(n, bytes, op_it->second);
  }
  const int dpn = devices_per_node(c);
  const int span = n * std::max(1, stride);
  const AlphaBeta intra{c.intra.latency, c.intra.bandwidth};
  if (span <= dpn || c.cpu) return ring(n, bytes, intra);
  // Hierarchical: d ranks of the group per node, m nodes; each of the d ranks runs the
  // inter-node ring on its 1/d shard, sharing the node's link.
  const int per_node = std::max(1, dpn / std::max(1, stride));
  const int d = std::min(n, per_node);
  const int m = (n + d - 1) / d;
  const AlphaBeta inter{c.inter.latency, c.inter.bandwidth / d};
  if (op == "allreduce") {
    return ring_reduce_scatter_seconds(d, bytes, intra) + ring_allreduce_seconds(m, bytes / d, inter) +
           ring_allgather_seconds(d, bytes, intra);
  }
  return ring(d, bytes, intra) + ring(m, bytes / d, inter);
}

// ---------------------------------------------------------------- memory

StateBytes state_bytes(const std::string& precision, const std::string& optimizer) {
  StateBytes b;
  const double moments = state_slots(optimizer);
  if (precision == "mixed") {
    // 16-bit parameters and gradients; fp32 master parameters + fp32 moments (ZeRO paper: K = 12 for Adam).
    b.param = 2;
    b.grad = 2;
    b.optimizer = 4 + 4 * moments;
  } else if (precision == "fp32") {
    b.param = 4;
    b.grad = 4;
    b.optimizer = 4 * moments;
  } else if (precision == "bf16") {
    b.param = 2;
    b.grad = 2;
    b.optimizer = 2 * moments;
  } else {
    throw std::invalid_argument("unknown precision '" + precision + "' (mixed, fp32, bf16)");
  }
  return b;
}

MemoryBreakdown zero_model_states(double psi, int stage, int dp, StateBytes b) {
  if (stage < 0 || stage > 3) throw std::invalid_argument("ZeRO stage must be 0-3, got " + std::to_string(stage));
  const double nd = std::max(1, dp);
  MemoryBreakdown m;
  m.parameters = b.param * psi / (stage >= 3 ? nd : 1.0);
  m.gradients = b.grad * psi / (stage >= 2 ? nd : 1.0);
  m.optimizer = b.optimizer * psi / (stage >= 1 ? nd : 1.0);
  return m;
}

// ---------------------------------------------------------------- layouts

std::string Layout::strategy_name() const {
  if (tp == 1 && pp == 1 && cp == 1 && ep == 1) {
    if (zero == 0) return dp == 1 ? "single" : "ddp";
    return "zero" + std::to_string(zero);
  }
  std::string s = "dp" + std::to_string(dp) + (ep > 1 ? " ep" + std::to_string(ep) : std::string()) +
                  (cp > 1 ? " cp" + std::to_string(cp) : std::string()) + " tp" + std::to_string(tp) + " pp" +
                  std::to_string(pp);
  if (zero > 0) s += " zero" + std::to_string(zero);
  return s;
}

Estimate estimate(const ModelSpec& m, const ClusterSpec& c, const Layout& l, const PlanOptions& o) {
  Estimate e;
  e.layout = l;
  auto infeasible = [&](const std::string& why) {
    e.feasible = false;
    e.why = why;
    return e;
  };
  const int dp = l.dp, tp = l.tp, pp = l.pp, cp = l.cp;
  if (dp < 1 || tp < 1 || pp < 1 || cp < 1) throw std::invalid_argument("dp, cp, tp and pp must be at least 1");
  check_expert_parallel(m, l.ep, dp);
  if (o.pipeline_partition == "auto") {  // both cuts, the faster (parameters on a tie)
    PlanOptions by = o;
    by.pipeline_partition = "params";
    Estimate a = estimate(m, c, l, by);
    if (pp == 1 || m.children.empty()) return a;
    by.pipeline_partition = "time";
    Estimate b = estimate(m, c, l, by);
    return b.feasible && (!a.feasible || b.step_s < a.step_s * 0.999) ? b : a;
  }
  const int used = l.devices();
  // The cp ranks of a replica hold the same parameters: the data-parallel strategies (DDP's
  // all-reduce, ZeRO's sharding) run over dp * cp ranks (ProcessGrid::dp_cp()).
  const int dp_group = dp * cp;
  const int dpn = devices_per_node(c);
  const StateBytes sb = state_bytes(o.precision, o.optimizer);
  const DeviceSpec dev = slowest_device(c);
  const int64_t batch = o.global_batch > 0 ? o.global_batch : (m.kind == "transformer" ? 1024 : 256);

  // Layer by layer for models that list their children (pipeline cut as o.pipeline_partition
  // says, as tandem train does; tensor parallelism splitting the Linear pairs).
  const bool layered = !m.children.empty() && (tp > 1 || pp > 1);
  const int64_t n_layers = m.children.empty() ? m.layers : static_cast<int64_t>(m.children.size());
  std::vector<int64_t> partition;
  std::vector<double> stage_params;
  if (layered && pp <= n_layers) {  // else infeasible below
    if (o.pipeline_partition == "params" || o.pipeline_partition == "time") {
      std::vector<double> costs;
      const ModelRates* mr = layer_fits(m, c, o);
      const std::vector<bool> need = input_grad_needed(m);
      const double mb = static_cast<double>(std::max<int64_t>(1, l.micro_batch));
      for (size_t i = 0; i < m.children.size(); ++i) {
        const LayerSpec& ly = m.children[i];
        if (o.pipeline_partition == "params") {
          costs.push_back(std::max(1.0, ly.parameters));
        } else if (mr) {  // the dense child's time, as tandem train measures it before the tp split
          costs.push_back(mr->layer_overhead_s[i] + mr->layer_s_per_sample[i] * mb);
        } else {
          costs.push_back(layer_train_flops(ly, need[i]) * mb);
        }
      }
      partition = balance_partition(costs, pp);
    } else {
      // Malformed (or an empty stage): thrown, as tandem train refuses it.
      const auto stages = 1 + std::count(o.pipeline_partition.begin(), o.pipeline_partition.end(), ',');
      partition = parse_partition_option(o.pipeline_partition, static_cast<int>(stages));
      int64_t sum = 0;
      for (int64_t k : partition) sum += k;
      if (static_cast<int>(partition.size()) != pp || sum != n_layers) {
        return infeasible("the pipeline partition " + o.pipeline_partition + " does not cut the " +
                          std::to_string(n_layers) + " layers into " + std::to_string(pp) + " non-empty stages");
      }
    }
    e.partition = partition;
    size_t i = 0;
    for (int64_t k : partition) {
      double ps = 0;
      for (int64_t j = 0; j < k; ++j, ++i) ps += m.children[i].parameters * tp_share(m.children[i], tp);
      stage_params.push_back(ps);
    }
  }

  // Memory first: it is meaningful even for layouts that are infeasible for other reasons.
  const double psi_dev = stage_params.empty() ? m.parameters / (static_cast<double>(tp) * pp)
                                              : *std::max_element(stage_params.begin(), stage_params.end());
  // Of them, this rank's experts (MoE models: described by shape, so no stage_params) and the rest.
  const double experts_dev = expert_parameters(m) / (static_cast<double>(tp) * pp * l.ep);
  const double dense_dev = psi_dev - experts_dev * l.ep;
  e.memory = rank_model_states(m, l, dense_dev, experts_dev, sb);
  const int64_t per_replica = batch / dp;
  const int64_t mb = std::max<int64_t>(1, l.micro_batch);
  const int64_t mcount = std::max<int64_t>(1, l.micro_batches);
  const double act_scale = activation_scale(m, o.precision);
  // Everything kept per token divides by cp: each cp rank holds T/cp tokens of every sample, and
  // the ring keeps nothing beyond k and v of those (its transfers are transient).
  const double act_sample = activation_bytes_per_sample(m, tp, o.sequence_parallel) * act_scale / cp;  // all layers
  const double layers_here = std::ceil(static_cast<double>(m.layers) / pp);
  const double act_layer = act_sample / m.layers;
  const double in_flight = pp > 1 ? std::min<double>(pp, mcount) : 1.0;  // 1F1B: at most p on stage 1
  if (o.activation_checkpointing) {
    const double ckpt = 2.0 * m.seq * m.hidden * (is_16bit(o.precision) ? 1.0 : 2.0) / std::max(1, tp) / cp;
    e.memory.activations = (ckpt * layers_here * in_flight + act_layer) * mb;
  } else {
    e.memory.activations = act_layer * layers_here * in_flight * mb;
  }
  e.memory.gradients_after_forward = l.zero >= 2 && mcount == 1;
  e.memory.layer_activations = act_layer * mb;
  if (is_moe(m)) {
    e.memory.expert_activations = e.memory.activations * moe_activation_bytes_per_sample(m, tp) /
                                  activation_bytes_per_sample(m, tp, o.sequence_parallel);
  }

  fill_stage_memory(m, stage_params, l, sb, o, e);

  if (used > total_devices(c) && !c.cpu)
    return infeasible("needs " + std::to_string(used) + " devices, the cluster has " +
                      std::to_string(total_devices(c)));
  if (batch % dp != 0)
    return infeasible("global batch " + std::to_string(batch) + " does not split over " + std::to_string(dp) +
                      " data-parallel replicas");
  if (per_replica % mb != 0 || per_replica / mb != mcount)
    return infeasible("micro-batch " + std::to_string(mb) + " x " + std::to_string(mcount) + " does not make the " +
                      std::to_string(per_replica) + " samples per replica");
  if (pp > n_layers)
    return infeasible("too few layers: " + std::to_string(n_layers) + " layers for " + std::to_string(pp) +
                      " pipeline stages");
  if (cp > 1 && (m.kind != "transformer" || !m.children.empty() || m.heads < 1))
    return infeasible("context parallelism splits sequences for ring attention: it needs a transformer "
                      "described by its shape (--hidden, --heads, --seq)");
  if (cp > 1 && m.seq % (2 * cp) != 0)
    return infeasible("sequence length " + std::to_string(m.seq) + " is not a multiple of 2 * cp = " +
                      std::to_string(2 * cp) + " (each cp rank holds 2 of 2 * cp chunks)");
  if (tp > 1 && !m.children.empty()) {
    bool pairs = false;
    for (const auto& l : m.children) {
      if (l.tp != "column") continue;
      pairs = true;
      if (static_cast<int64_t>(l.output_elems) % tp != 0)
        return infeasible("hidden width " + fmt("%.0f", l.output_elems) +
                          " of a Linear pair does not split over tensor-parallel " + std::to_string(tp));
    }
    if (!pairs) return infeasible("tensor parallelism needs Linear pairs (or attention heads) to split");
  } else if (tp > 1) {
    if (m.kind != "transformer" || m.heads < 1)
      return infeasible("tensor parallelism needs attention heads to split (a transformer description)");
    if (m.heads % tp != 0)
      return infeasible("indivisible heads: " + std::to_string(m.heads) + " heads over tensor-parallel " +
                        std::to_string(tp));
    if (m.hidden % tp != 0)
      return infeasible("hidden size " + std::to_string(m.hidden) + " does not split over tensor-parallel " +
                        std::to_string(tp));
    if (is_moe(m) && m.moe.intermediate % tp != 0)
      return infeasible("expert width " + std::to_string(m.moe.intermediate) + " does not split over tensor-parallel " +
                        std::to_string(tp));
  }
  if (tp > 1 && !c.cpu) {
    if (tp > dpn)
      return infeasible("tensor-parallel group of " + std::to_string(tp) + " spans nodes (" + std::to_string(dpn) +
                        " devices per node): its per-layer all-reduces need the intra-node link");
  }
  const double limit = o.memory_headroom * dev.memory_bytes;
  if (e.memory.total() > limit) {
    return infeasible("out of memory: " + gb(e.memory.total()) + " per device (parameters " + gb(e.memory.parameters) +
                      ", gradients " + gb(e.memory.gradients) + ", optimizer " + gb(e.memory.optimizer) +
                      ", activations " + gb(e.memory.activations) + ") > " + gb(limit) + " usable of " +
                      gb(dev.memory_bytes));
  }

  // Compute.
  const int workers_on_node = c.cpu ? used : std::min(used, dpn);
  const Rates r = worker_rates(m, c, o, workers_on_node);
  const double train_factor = o.activation_checkpointing ? 4.0 : 3.0;  // forward + 2x backward (+ recompute)
  const double act_elem = is_16bit(o.precision) ? 2.0 : 4.0;
  double slot = 0, pipeline_s = 0;
  bool fitted = false;  // per-layer fits include the fixed cost of every forward+backward
  if (layered) {
    const PipelineTimes pt = layered_times(m, c, o, r, partition, dp, tp, mb, mcount, act_elem);
    slot = pt.slot;
    pipeline_s = pt.step;
    e.compute_s = pt.compute;
    e.bubble_s = pt.bubble;
    fitted = pt.fitted;
    if (tp > 1) e.comm_parts["tp allreduce"] = pt.tp_comm;
    if (pp > 1) e.comm_parts["pp send/recv"] = pt.p2p_comm;
  } else {
    // Each cp rank computes 1/cp of every sample (the load-balanced causal layout evens out
    // the attention's share too).
    const double t_mb = train_factor * forward_flops_per_sample(m) * mb / (static_cast<double>(tp) * pp * cp) / r.flops;
    // Tensor parallel: 2 all-reduces of [mb, seq/cp, hidden] in forward and 2 in backward per layer (Megatron).
    double tp_mb = 0.0;
    if (tp > 1) {
      const double bytes = static_cast<double>(mb) * m.seq / cp * m.hidden * act_elem;
      tp_mb = 4.0 * layers_here * collective_seconds(c, o, "allreduce", tp, bytes, 1);
      e.comm_parts["tp allreduce"] = tp_mb * mcount;
    }
    // Pipeline: one activation forward and one gradient backward per micro-batch and stage boundary.
    double p2p_mb = 0.0;
    if (pp > 1) {
      const double bytes = static_cast<double>(mb) * m.seq / cp * m.hidden * act_elem / tp;
      const LinkSpec& link = tp * cp * pp <= dpn ? c.intra : c.inter;
      p2p_mb = 2.0 * (link.latency + bytes / link.bandwidth);
      e.comm_parts["pp send/recv"] = p2p_mb * (mcount + pp - 1);
    }
    // Ring attention: the part of its transfers not hidden behind the attention blocks delays
    // every micro-batch's forward and backward.
    double ring_mb = 0.0;
    if (cp > 1) {
      const RingTimes ring = ring_attention_times(m, c, o, l, r.flops);
      ring_mb = layers_here * ring.exposed;
      e.ring_bytes = layers_here * ring.bytes * mcount;
      e.ring_s = layers_here * ring.seconds * mcount;
      e.ring_exposed_s = ring_mb * mcount;
      e.comm_parts["cp ring"] = e.ring_s;
    }
    // Expert parallelism: the MoE layers' all-to-alls, on the critical path.
    double a2a_mb = 0.0;
    if (l.ep > 1) {
      const double moe_here = std::ceil(static_cast<double>(moe_layers(m)) / pp);
      const double bytes = all_to_all_bytes(m, l.ep, static_cast<double>(mb) * m.seq / cp, act_elem);
      a2a_mb = 4.0 * moe_here * all_to_all_seconds(c, o, l.ep, cp * tp * pp, used, bytes);
      e.all_to_all_bytes = 4.0 * moe_here * bytes * mcount;
      e.all_to_all_s = a2a_mb * mcount;
      e.comm_parts["ep all-to-all"] = e.all_to_all_s;
    }
    slot = t_mb + tp_mb + p2p_mb + ring_mb + a2a_mb;
    e.compute_s = t_mb * mcount;
    e.bubble_s = (pp - 1) * slot * zero_bubble_scale(o, pp, mcount);
    pipeline_s = mcount * slot + e.bubble_s;
  }

  // Data-parallel gradient and parameter collectives, overlapped with the last backward.
  double exposed = 0.0;
  if (dp_group > 1) {
    const int stride = tp * pp;
    const double grad_elem = is_16bit(o.precision) ? 2.0 : 4.0;
    // Backward of the last micro-batch; with a pipeline, Tandem averages the stage's gradients
    // after the whole step (nothing to hide behind).
    const double window = pp > 1 ? 0.0 : slot * 2.0 / 3.0;
    // The buckets of what every rank holds over the dp * cp ranks, then under expert parallelism
    // the experts' over the dp * cp / ep ranks holding the same experts (ep apart in the
    // data-parallel order). Without it the experts are buckets like the rest.
    const double everyone = l.ep > 1 ? dense_dev : psi_dev, experts_apart = l.ep > 1 ? experts_dev : 0.0;
    auto per_bucket = [&](const std::string& op, double elem) {
      std::vector<double> t;
      for (double b : split_buckets(everyone * elem, l.bucket_bytes))
        t.push_back(collective_seconds(c, o, op, dp_group, b, stride));
      for (double b : split_buckets(experts_apart * elem, l.bucket_bytes))
        t.push_back(collective_seconds(c, o, op, dp_group / l.ep, b, stride * l.ep));
      return t;
    };
    auto sum = [](const std::vector<double>& v) {
      double s = 0;
      for (double x : v) s += x;
      return s;
    };
    const double ov = c.overlap;
    auto overlapped = [&](const std::vector<double>& t, double w) {
      return ov * bucket_exposed(t, w) + (1.0 - ov) * sum(t);
    };
    // ZeRO (every stage, as Tandem does it) reduce-scatters: each rank needs only its shard's sum.
    // All in symmetric memory on a CPU node: stage 1 from its flat gradient buffer, stages 1-2
    // into their flat parameters, stages 2-3 from per-bucket scratch and stage 3 into gathered
    // units carved from a block allocated up front. Elsewhere the "_shm" curves fall back to
    // the plain ones.
    const char* grad_op = l.zero >= 1 ? "reduce_scatter_shm" : "allreduce";
    // ZeRO-1/2 gather in place into their flat parameters; ZeRO-3 from each unit's shard into a
    // slot of its block, which copies this rank's part too.
    const char* gather_op = l.zero == 3 ? "allgather_copy_shm" : "allgather_shm";
    std::vector<double> grads = per_bucket(grad_op, grad_elem);
    // ZeRO-2 and 3 reduce-scatter in their backward hooks after every micro-batch's backward
    // (gradient accumulation, or a pipeline's micro-batches), as DeepSpeed's do; so does ZeRO-1
    // in a pipeline. DDP, and ZeRO-1 accumulating without a pipeline, communicate once per
    // step (no_sync before the last micro-batch; a pipeline's averager after the step).
    const bool per_micro_batch = l.zero >= 2 || (l.zero == 1 && pp > 1);
    const double grad_rounds = per_micro_batch ? static_cast<double>(mcount) : 1.0;
    e.comm_parts[l.zero >= 1 ? "dp reduce_scatter" : "dp allreduce"] = sum(grads) * grad_rounds;
    exposed += grad_rounds * overlapped(grads, window);
    if (l.zero == 1 || l.zero == 2) {
      // After the step every rank gathers the updated parameters (not overlapped).
      std::vector<double> ag = per_bucket(gather_op, sb.param);
      e.comm_parts["dp allgather"] = sum(ag);
      exposed += sum(ag);
    } else if (l.zero == 3) {
      // Parameters gathered just in time in forward and again in backward, prefetched beside compute.
      std::vector<double> ag = per_bucket(gather_op, sb.param);
      const double fwd = slot / 3.0;
      e.comm_parts["dp allgather (fwd+bwd)"] = 2.0 * sum(ag) * mcount;
      exposed += mcount * (overlapped(ag, fwd) + overlapped(ag, window));
      // Tandem waits for every unit's gather before its forward and before its backward (the
      // last unit's excepted): each is a rendezvous of the ranks inside compute. On a calibrated
      // CPU node, its measured cost beyond the 4 KiB collective's own time.
      if (c.cpu && o.calibration) {
        auto it = o.calibration->models.find(m.name);
        if (it != o.calibration->models.end() && !it->second.sync_point_s.empty()) {
          const auto& sp = it->second.sync_point_s;
          auto near = sp.lower_bound(used);
          if (near == sp.end()) near = std::prev(near);
          int units = 0;
          for (const auto& ly : m.children) units += ly.parameters > 0 ? 1 : 0;
          if (units == 0) units = static_cast<int>(m.layers);
          const double per_point =
              std::max(0.0, near->second - collective_seconds(c, o, gather_op, dp_group, 4096.0, stride));
          e.comm_parts["dp zero3 rendezvous"] = (2.0 * units - 1.0) * per_point * mcount;
          exposed += e.comm_parts["dp zero3 rendezvous"];
        }
      }
    }
  }
  for (const auto& [k, v] : e.comm_parts) e.comm_s += v;
  e.exposed_comm_s = exposed;

  // Optimizer step on what this device owns.
  const double params_updated =
      l.zero >= 1 ? dense_dev / dp_group + experts_dev / (dp_group / l.ep) : dense_dev + experts_dev;
  if (r.opt_per_param > 0) {
    e.optimizer_s = params_updated * r.opt_per_param;
  } else {
    const double bytes_per_param = sb.param + sb.grad + 2.0 * sb.optimizer;  // read/write state, read grad, write param
    e.optimizer_s = params_updated * bytes_per_param / dev.memory_bandwidth;
  }
  // The calibrated intercept is that of one forward+backward pass (it holds zeroing and adding
  // into the gradients, a pass over the parameters each): once per micro-batch. Counted once per
  // step, --grad-accum 4 on the MLP would be priced 21-44 % fast. Per-layer fits (pipelines,
  // tensor parallelism) hold it per micro-batch already; a cluster's --overhead-ms is per step.
  const double overhead = r.overhead * (r.overhead_per_pass ? static_cast<double>(mcount) : 1.0);
  e.step_s = pipeline_s + exposed + e.optimizer_s + (fitted ? 0.0 : overhead);
  e.samples_per_s = batch / e.step_s;

  // Efficiency: one device running the whole batch with no communication (memory permitting
  // or not), divided by (devices x this step).
  const Rates r1 = worker_rates(m, c, o, 1);
  double t1 = train_factor * forward_flops_per_sample(m) * batch / r1.flops + r1.overhead;
  t1 += r1.opt_per_param > 0 ? m.parameters * r1.opt_per_param
                             : m.parameters * (sb.param + sb.grad + 2.0 * sb.optimizer) / dev.memory_bandwidth;
  e.efficiency = t1 / (used * e.step_s);

  // A pass far outside the calibrated batches: the linear fits extrapolate. The CNN's tp2 at 96
  // micro-batches of 2 (fits at 32 and 128) was priced 110 ms and measured 297-352 ms
  // (docs/BENCHMARKS.md, "Planning").
  if (c.cpu && o.calibration) {
    auto it = o.calibration->models.find(m.name);
    if (it != o.calibration->models.end() && it->second.fit_batch_lo > 0) {
      const int64_t lo = it->second.fit_batch_lo, hi = it->second.fit_batch_hi;
      if (2 * mb < lo || mb > 2 * hi) {
        e.caveat = "passes of " + std::to_string(mb) + " samples, far from the " + std::to_string(lo) + " and " +
                   std::to_string(hi) + " its compute was calibrated at: extrapolated (a calibration at batch " +
                   std::to_string(2 * mb) + " covers it: tandem plan --calibrate --calibrate-batch " +
                   std::to_string(2 * mb) + ")";
      }
    }
  }
  return e;
}

namespace {
// The (dp, cp, tp, pp) shapes plan() prices: for every cp of o.cp, the data-parallel listing's
// worker counts that cp divides (dp = workers / cp), or every tp x pp of the n devices over cp
// (dp = n / (cp * tp * pp)). A replica spans cp * tp * pp devices, so a cp that divides none of
// them has no layout: refused.
std::vector<std::tuple<int, int, int, int>> layout_shapes(const PlanOptions& o, int n_total) {
  std::vector<std::tuple<int, int, int, int>> shapes;
  for (int n : o.dp_only_workers)
    if (n < 1) throw std::invalid_argument("worker counts must be at least 1, got " + std::to_string(n));
  if (o.cp.empty()) throw std::invalid_argument("no context-parallel degree given (cp: at least {1})");
  for (int cp : o.cp) {
    if (cp < 1) throw std::invalid_argument("context-parallel degree must be at least 1, got " + std::to_string(cp));
    const size_t before = shapes.size();
    if (!o.dp_only_workers.empty()) {
      for (int n : o.dp_only_workers)
        if (n % cp == 0) shapes.emplace_back(n / cp, cp, 1, 1);
    } else if (n_total % cp == 0) {
      for (int64_t tp : divisors(n_total / cp)) {
        if (tp > o.max_tp) continue;
        for (int64_t pp : divisors(n_total / cp / tp)) {
          if (pp > o.max_pp) continue;
          shapes.emplace_back(static_cast<int>(n_total / cp / tp / pp), cp, static_cast<int>(tp), static_cast<int>(pp));
        }
      }
    }
    if (shapes.size() == before && (!o.dp_only_workers.empty() || n_total % cp != 0)) {
      throw std::invalid_argument("context-parallel degree " + std::to_string(cp) +
                                  (o.dp_only_workers.empty()
                                       ? " does not divide the " + std::to_string(n_total) + " devices"
                                       : std::string(" divides none of the worker counts")) +
                                  ": a replica spans cp x tp x pp devices");
    }
  }
  return shapes;
}

// The expert-parallel degrees plan() prices with `dp` replicas: o.ep where it divides dp, else
// every power of two up to o.max_ep dividing dp and the experts (1 for dense models). With tp
// each tp rank has its ep groups, of its parts of the experts.
std::vector<int> expert_degrees(const ModelSpec& m, const PlanOptions& o, int dp) {
  if (o.ep > 0) return dp % o.ep == 0 ? std::vector<int>{o.ep} : std::vector<int>{};
  std::vector<int> eps = {1};
  if (!is_moe(m)) return eps;
  for (int ep = 2; ep <= std::min(o.max_ep, dp); ep *= 2)
    if (dp % ep == 0 && m.moe.experts % ep == 0) eps.push_back(ep);
  return eps;
}

// The micro-batch sizes plan() tries for a layout with `dp` replicas and `pp` stages: the
// power-of-two divisors of a replica's samples and the whole of them, largest first.
std::vector<int64_t> micro_batch_sizes(const ClusterSpec& c, const PlanOptions& o, int64_t batch, int dp, int pp) {
  const int64_t per_replica = batch / dp;
  std::vector<int64_t> mbs;
  if (batch % dp != 0 || per_replica < 1) {
    mbs.push_back(1);
  } else if (pp == 1 && (!o.dp_only_workers.empty() || c.cpu)) {
    // No gradient accumulation searched on the local CPU cluster or in the data-parallel
    // listing: memory does not ask for it there, and the calibration's fits (batches B/4
    // and B) do not reach tiny micro-batches. Searched, the CNN's tp2 came out best at 96
    // micro-batches of 2 (priced 110 ms against 118 for one batch of 192), which tandem
    // train --grad-accum 96 measured at 297-352 ms against 144-159 (docs/BENCHMARKS.md,
    // "Planning"). tandem bench --grad-accum K prices a chosen K.
    mbs.push_back(per_replica);
  } else {
    for (int64_t d : divisors(per_replica))
      if ((d & (d - 1)) == 0 || d == per_replica) mbs.push_back(d);
    std::reverse(mbs.begin(), mbs.end());  // largest first: it wins ties
  }
  return mbs;
}

// Layout `l` (its shape and ZeRO stage) at each micro-batch size and bucket size into `best`:
// the fastest feasible one (on a tie within 0.1 % the larger micro-batch), else the infeasible
// one of the smallest memory need (the most informative "why"). False when none was priced.
bool best_of(const ModelSpec& m, const ClusterSpec& c, const PlanOptions& o, Layout l, int64_t batch, Estimate& best) {
  bool have = false, have_feasible = false;
  const int64_t per_replica = batch / l.dp;
  for (int64_t mb : micro_batch_sizes(c, o, batch, l.dp, l.pp)) {
    for (double bucket : o.bucket_bytes) {
      l.micro_batch = mb;
      l.micro_batches = std::max<int64_t>(1, per_replica / mb);
      l.bucket_bytes = bucket;
      Estimate e = estimate(m, c, l, o);
      if (e.feasible) {
        if (!have_feasible || e.step_s < best.step_s * 0.999) {
          best = e;
          have_feasible = have = true;
        }
      } else if (!have_feasible) {
        if (!have || e.memory.total() < best.memory.total()) best = e;
        have = true;
      }
    }
  }
  return have;
}
}  // namespace

std::vector<Estimate> plan(const ModelSpec& m, const ClusterSpec& c, const PlanOptions& o) {
  validate(m);
  validate(c);
  const int64_t batch = o.global_batch > 0 ? o.global_batch : (m.kind == "transformer" ? 1024 : 256);
  if (batch < 1) throw std::invalid_argument("global batch must be at least 1");
  for (int z : o.zero_stages)
    if (z < 0 || z > 3) throw std::invalid_argument("ZeRO stages must be 0-3, got " + std::to_string(z));
  for (double b : o.bucket_bytes)
    if (!(b > 0)) throw std::invalid_argument("bucket sizes must be positive");
  const int n_total = o.devices > 0 ? o.devices : total_devices(c);
  if (o.devices > total_devices(c) && !c.cpu)
    throw std::invalid_argument("--devices " + std::to_string(o.devices) + " is more than the cluster's " +
                                std::to_string(total_devices(c)));

  const std::vector<std::tuple<int, int, int, int>> shapes = layout_shapes(o, n_total);
  if (o.ep < 0) throw std::invalid_argument("expert-parallel degree must be at least 1, got " + std::to_string(o.ep));
  if (o.ep > 0) {
    bool any = false;
    for (auto [dp, cp, tp, pp] : shapes) any = any || dp % o.ep == 0;
    check_expert_parallel(m, o.ep, o.ep);  // a dense model, or an ep that does not divide the experts
    if (!any)
      throw std::invalid_argument("expert-parallel degree " + std::to_string(o.ep) +
                                  " divides no layout's data-parallel replicas (its groups "
                                  "are made of them): use more devices or a smaller ep");
  }
  std::vector<Estimate> best_feasible, best_infeasible;
  for (auto [dp, cp, tp, pp] : shapes) {
    for (int ep : expert_degrees(m, o, dp)) {
      for (int z : o.zero_stages) {
        if (z > 0 && dp * cp == 1) continue;  // nothing to shard
        Layout l;
        l.dp = dp;
        l.cp = cp;
        l.tp = tp;
        l.pp = pp;
        l.ep = ep;
        l.zero = z;
        Estimate best;
        if (!best_of(m, c, o, l, batch, best)) continue;
        (best.feasible ? best_feasible : best_infeasible).push_back(best);
      }
    }
  }
  std::stable_sort(best_feasible.begin(), best_feasible.end(),
                   [](const Estimate& a, const Estimate& b) { return a.step_s < b.step_s; });
  std::stable_sort(best_infeasible.begin(), best_infeasible.end(),
                   [](const Estimate& a, const Estimate& b) { return a.memory.total() < b.memory.total(); });
  if (!o.dp_only_workers.empty()) {
    // Keep the requested order of worker counts for tables.
    std::stable_sort(best_feasible.begin(), best_feasible.end(), [](const Estimate& a, const Estimate& b) {
      return std::make_tuple(a.layout.devices(), a.layout.cp, a.layout.ep, a.layout.zero) <
             std::make_tuple(b.layout.devices(), b.layout.cp, b.layout.ep, b.layout.zero);
    });
  }
  best_feasible.insert(best_feasible.end(), best_infeasible.begin(), best_infeasible.end());
  return best_feasible;
}

}  // namespace tandem::plan
