// The training loop the text commands share (pretrain, finetune, and fine-tuning a Hugging Face
// model): the layout from the command's configuration, the Engine with AdamW, the seeded global
// batches, and the steps with progress, per-step losses, trace and checkpoint cadence. Private
// to src/text.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tandem/engine.h"
#include "tandem/moe.h"
#include "tandem/progress.h"
#include "tandem/tensorboard.h"
#include "tandem/text.h"
#include "tandem/trace.h"

namespace tandem::text {

// Where a loop starts and what runs after each step: a resumed run starts at first_step with
// the sampler at first_sample (global samples drawn before), so the batches and the learning
// rate continue where the saved run stopped. after_step(steps, samples) runs after each step
// with the steps done (1-based, from the start of training) and the sampler's position after it,
// e.g. to save a checkpoint; returning true ends the loop there. Collective when it is.
// `tensorboard` (null: none) gets each step's loss and figures as they come.
struct LoopHooks {
  int64_t first_step = 0;
  int64_t first_sample = -1;  // -1: first_step whole global batches
  std::function<bool(int64_t steps_done, int64_t samples_done)> after_step;
  tensorboard::Log* tensorboard = nullptr;
  // A mixture-of-experts model (tandem/moe.h): after each step the loop reads the layers'
  // auxiliary losses (moe_step_losses: one more all-reduce) and reports lm + moe_aux_coef x aux +
  // moe_z_coef x z as the step's loss (transformers' with the z-loss off), each also alone.
  bool moe = false;
  double moe_aux_coef = 0.0, moe_z_coef = 0.0;
};

// The auxiliary losses of the step that just ran (moe::moe_stats of this thread less `before`,
// taken before the step, so that the Engine's figures of the whole run stay whole): each the
// mean of its terms over every rank of `world` (collective), so averaged over the data-parallel
// replicas and the stages' layers.
struct MoeStepLosses {
  double aux = 0.0, z = 0.0;
};
MoeStepLosses moe_step_losses(Communicator& world, const c10::Device& device, const moe::MoeStats& before);
// "(aux 2.0385)" or, with the z-loss, "(aux 2.0385, z 0.1234)": the progress line's note.
std::string moe_note(const MoeStepLosses& m, bool with_z);

// The checkpoints of a text loop (TextTrainConfig::checkpoints) on `eng`. Each records `run`
// under `key` in its metadata, with the sampler position; a resumed checkpoint's entries
// `must_match` must equal this run's (else std::runtime_error naming the entry and both values),
// and so must `run`'s "batch" unless checkpoints.batch_may_change.
class LoopCheckpoints {
 public:
  LoopCheckpoints(Engine& eng, const TextTrainConfig& cfg, std::string key, nlohmann::json run,
                  std::vector<std::string> must_match);
  // Where the loop starts (resume: the newest checkpoint loaded into the engine, else step 0) and
  // the hooks that save every `every` steps and end the loop at a checkpoint when the stop file
  // asks. Resume with no complete checkpoint yet starts at step 0 (an elastic relaunch before the
  // first save). Collective.
  LoopHooks start();
  // After the loop: saves the last step when the cadence did not; with the stop file acted on,
  // deletes it (the launcher's sign that the checkpoint is committed). Collective.
  void finish();
  bool stopped() const { return stopped_; }
  // The samples of an epoch: checkpoints then also record the data loader's place as "data":
  // {"epoch", "index" (samples of that epoch drawn), "samples_per_epoch"}; a resumed run continues
  // at epoch * samples_per_epoch + index, whatever its worker count.
  void set_epoch_size(int64_t n) { epoch_size_ = n; }

 private:
  LoopHooks start_hooks(LoopHooks hooks);
  bool save_and_check_stop(int64_t steps, int64_t samples);
  void save(int64_t steps, int64_t samples, bool async);
  Engine& eng_;
  const TextTrainConfig& cfg_;
  std::string key_;
  nlohmann::json run_;
  std::vector<std::string> must_match_;
  int64_t steps_ = 0, samples_ = 0, saved_at_ = -1, epoch_size_ = 0;
  bool stopped_ = false;
};

// The model under the configured layout, trained with AdamW. `ids`: the training documents'
// token ids; with --pp-partition time their first micro-batch is timed layer by layer.
template <typename M>
std::unique_ptr<Engine> make_engine(Runtime& rt, const TextTrainConfig& cfg, torch::nn::ModuleHolder<M> net,
                                    const at::Tensor& ids, EngineOptions eo = {}) {
  const ParallelConfig& pc = cfg.parallel;
  OptimizerOptions oo;
  oo.kind = "adamw";
  oo.lr = cfg.lr;
  oo.weight_decay = cfg.weight_decay;
  if (pc.pp > 1 && pc.partition.method == PartitionMethod::kTime) {
    const int64_t micro = cfg.batch / data_parallel_size(pc, rt.world_size()) / pc.micro_batches;
    eo.partition_sample = ids.narrow(0, 0, std::max<int64_t>(1, std::min<int64_t>(micro, ids.size(0))));
  }
  return std::make_unique<Engine>(rt, net, oo, pc, eo);
}

inline LrSchedule lr_schedule(const TextTrainConfig& cfg) {  // warmup from 0, cosine decay to 10%
  LrSchedule s;
  s.peak = cfg.lr;
  s.warmup_steps = cfg.warmup_steps;
  s.total_steps = cfg.steps;
  s.min_ratio = 0.1;
  return s;
}

inline std::vector<std::string> texts_of(const std::vector<Document>& docs) {
  std::vector<std::string> v;
  v.reserve(docs.size());
  for (const auto& d : docs) v.push_back(d.text);
  return v;
}

// The global batches: a seeded permutation per epoch, the same on every rank.
class Batches {
 public:
  Batches(int64_t n, uint64_t seed) : n_(n), rng_(seed) { reshuffle(); }
  std::vector<int64_t> next(int64_t b) {
    std::vector<int64_t> out;
    while (static_cast<int64_t>(out.size()) < b) {
      if (pos_ >= n_) reshuffle();
      out.push_back(perm_[pos_++]);
    }
    return out;
  }
  // Draws k without keeping them (a resumed run's position: memory stays one permutation).
  void skip(int64_t k) {
    while (k > 0) {
      if (pos_ >= n_) reshuffle();
      const int64_t d = std::min(k, n_ - pos_);
      pos_ += d;
      k -= d;
    }
  }

 private:
  void reshuffle() {
    perm_.resize(n_);
    for (int64_t i = 0; i < n_; ++i) perm_[i] = i;
    std::shuffle(perm_.begin(), perm_.end(), rng_);
    pos_ = 0;
  }
  int64_t n_, pos_ = 0;
  std::mt19937_64 rng_;
  std::vector<int64_t> perm_;
};

inline torch::Tensor rows(const torch::Tensor& t, const std::vector<int64_t>& idx, int64_t from, int64_t to) {
  std::vector<int64_t> sub(idx.begin() + from, idx.begin() + to);
  return t.index_select(0, torch::tensor(sub, torch::kLong));
}

// The common loop: `batch_of(global_indices, from, to)` gives the inputs and targets of this
// replica's slice [from, to) of the global batch; `loss_sum_fn(outputs, targets)` their summed
// loss; `terms_of(global_indices, from, to)` how many loss terms a slice holds (its real tokens,
// its samples). Every rank counts the whole global batch's itself: no communication. Returns
// the engine's statistics of the loop.
template <typename BatchFn, typename TermsFn>
EngineStats train_loop(Runtime& rt, const TextTrainConfig& cfg, Engine& eng, int64_t n, BatchFn batch_of,
                       const LossFn& loss_sum_fn, TermsFn terms_of, TextReport& rep, const LoopHooks& hooks = {}) {
  using Clock = std::chrono::steady_clock;
  const int rank = eng.world()->rank(), world = eng.world_size();
  const int dp = eng.dp_size(), dp_rank = eng.dp_rank();
  const int64_t per = cfg.batch / dp;
  const LrSchedule schedule = lr_schedule(cfg);
  Batches batches(n, cfg.seed + 1);
  // The samples already drawn: the sampler's position, so that a resumed run (at any global
  // batch) continues the same sequence of documents.
  const int64_t first_sample = hooks.first_sample >= 0 ? hooks.first_sample : hooks.first_step * cfg.batch;
  batches.skip(first_sample);
  Progress progress(rank == 0 && cfg.progress, cfg.steps - hooks.first_step, cfg.log_every);
  std::vector<double> step_ms;
  if (!cfg.trace.empty()) trace::start(*rt.cpu_world());
  StepMeter meter(eng);
  const bool measure = !cfg.metrics_path.empty() || !cfg.tensorboard.empty();  // someone reads the figures
  auto t_start = Clock::now();
  double last = 0.0;
  rep.first_step = hooks.first_step;
  for (int64_t step = hooks.first_step; step < cfg.steps; ++step) {
    auto t0 = Clock::now();
    auto idx = batches.next(cfg.batch);
    eng.set_lr(schedule.at(step));
    torch::Tensor x, y;
    {
      trace::Span span("data", "data");
      std::tie(x, y) = batch_of(idx, dp_rank * per, (dp_rank + 1) * per);
    }
    StepOptions so;
    so.reduction = LossReduction::kSum;
    so.terms = terms_of(idx, 0, dp * per);
    const auto moe_before = hooks.moe ? moe::moe_stats() : moe::MoeStats{};
    torch::Tensor loss = eng.step(x, y, loss_sum_fn, so);
    torch::Tensor l = loss.detach().reshape({1}).to(torch::kFloat).clone();
    if (world > 1) eng.world()->allreduce(l, ReduceOp::kAvg);
    last = l.item<double>();
    std::string note;
    MoeStepLosses m;
    if (hooks.moe) {
      m = moe_step_losses(*eng.world(), l.device(), moe_before);
      last += hooks.moe_aux_coef * m.aux + hooks.moe_z_coef * m.z;
      note = moe_note(m, hooks.moe_z_coef > 0);
    }
    rep.losses.push_back(last);
    if (!std::isfinite(last)) {
      throw std::runtime_error("loss is " + std::to_string(last) + " at step " + std::to_string(step) + "; lower --lr");
    }
    step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    if (measure) {
      rep.step_figures.push_back(meter.next(step_ms.back(), cfg.batch));
      if (hooks.moe) rep.step_figures.back().aux_loss = m.aux;
      if (hooks.moe && hooks.moe_z_coef > 0) rep.step_figures.back().z_loss = m.z;
    }
    if (hooks.tensorboard && hooks.tensorboard->active()) {
      hooks.tensorboard->step(step + 1, last, rep.step_figures.back());
    }
    const int64_t done = step + 1 - hooks.first_step;
    progress.update(1, 1, done, last, done * cfg.batch, Clock::now() - t_start, note);
    if (hooks.after_step && hooks.after_step(step + 1, first_sample + done * cfg.batch)) {
      rep.stopped = true;
      break;
    }
  }
  eng.wait_checkpoint();  // an asynchronous save still in flight is committed inside the loop's time
  progress.finish();
  const double wall = std::chrono::duration<double>(Clock::now() - t_start).count();
  if (!cfg.trace.empty()) {
    trace::stop();
    trace::write(cfg.trace, *rt.cpu_world());
  }
  rep.final_loss = last;
  const int64_t ran = static_cast<int64_t>(rep.losses.size());
  record_loop(rep, ran, ran * cfg.batch, wall, step_ms);
  return eng.stats();
}

}  // namespace tandem::text
