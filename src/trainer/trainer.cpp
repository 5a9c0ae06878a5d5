#include "tandem/trainer.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <tuple>

#include "tandem/checkpoint.h"
#include "tandem/data.h"
#include "tandem/elastic.h"
#include "tandem/engine.h"
#include "tandem/grid.h"
#include "tandem/models.h"
#include "tandem/optim.h"
#include "tandem/pipeline.h"
#include "tandem/plan.h"
#include "tandem/precision.h"
#include "tandem/progress.h"
#include "tandem/registry.h"
#include "tandem/replicas.h"
#include "tandem/shares.h"
#include "tandem/tensorboard.h"
#include "tandem/trace.h"

namespace tandem {
namespace {

using Clock = std::chrono::steady_clock;

OptimizerOptions optimizer_options(const TrainConfig& cfg) {
  OptimizerOptions o;
  o.kind = cfg.optimizer;
  o.lr = cfg.lr;
  o.momentum = cfg.optimizer == "sgd" || cfg.optimizer == "lars" ? cfg.momentum : 0.0;
  o.weight_decay = cfg.weight_decay;
  o.trust_coefficient = cfg.trust_coefficient;
  o.adapt_vectors = cfg.adapt_vectors;
  return o;
}

std::string dataset_of(const TrainConfig& cfg) {
  return cfg.dataset.empty() ? default_dataset_for(cfg.model) : cfg.dataset;
}

void validate(const TrainConfig& cfg, int world) {
  const ParallelConfig& pc = cfg.parallel;
  if (pc.grad_accum > 1 && !cfg.batch_shares.empty()) {
    throw std::invalid_argument("--grad-accum with --batch-shares is not supported yet (every rank must run the same "
                                "number of micro-batches); drop one of them");
  }
  if (cfg.batch < 1) throw std::invalid_argument("--batch must be at least 1");
  tandem::validate(pc, world, cfg.batch);
  const int dp = data_parallel_size(pc, world);
  if (cfg.epochs < 1) throw std::invalid_argument("--epochs must be at least 1");
  if (dp == world && cfg.batch % world != 0 && cfg.batch_shares.empty()) {
    throw std::invalid_argument("--batch " + std::to_string(cfg.batch) + " (global) does not split evenly over " +
                                std::to_string(world) + " workers; use a multiple of " + std::to_string(world));
  }
  if (!(cfg.lr > 0.0) || !std::isfinite(cfg.lr)) throw std::invalid_argument("--lr must be a positive number");
  validate(optimizer_options(cfg));
  if (cfg.schedule != "cosine" && cfg.schedule != "constant") {
    throw std::invalid_argument("--schedule must be cosine or constant");
  }
  (void)model_info(cfg.model);  // throws "unknown model 'x' (known: ...)"
  // The reference transformer reads token ids; the image datasets hold pixels.
  if (cfg.model == "transformer_tiny") {
    throw std::invalid_argument("--model " + cfg.model +
                                " cannot train on an image dataset (IDX); use mlp, cnn or cnn_bn");
  }
  (void)dataset_info(dataset_of(cfg));  // throws "unknown dataset 'x' (known: ...)"
  if (pc.pp > 1) {
    const auto layers = static_cast<int64_t>(models::make_model(cfg.model)->size());
    if (pc.pp > layers) {
      throw std::invalid_argument("--pp " + std::to_string(pc.pp) + ": more pipeline stages than the " +
                                  std::to_string(layers) + " layers of --model " + cfg.model + "; use --pp " +
                                  std::to_string(layers) + " or fewer");
    }
    const int chunks = pipeline_chunks(pc.schedule, pc.virtual_stages);
    if (static_cast<int64_t>(pc.pp) * chunks > layers) {
      throw std::invalid_argument("--pp " + std::to_string(pc.pp) + " x " + std::to_string(chunks) +
                                  " chunks per rank (--virtual-stages, zb-v: 2): more virtual stages than the " +
                                  std::to_string(layers) + " layers of --model " + cfg.model +
                                  "; each needs a layer, use fewer virtual stages");
    }
  }
  validate_batch_shares(cfg, world);
  if (cfg.schedule_batch < 0) throw std::invalid_argument("--schedule-batch must be >= 0 (0: --batch)");
  if (cfg.batch_may_change && !cfg.batch_shares.empty()) {
    throw std::invalid_argument("--elastic-lr scale with --batch-shares: the shares are planned for one global batch; "
                                "drop one of them");
  }
}

void validate_checkpointing(const TrainConfig& cfg) {
  if (cfg.checkpoint_every < 0) throw std::invalid_argument("--checkpoint-every must be >= 0 (0: never)");
  if (cfg.checkpoint_keep < 0) throw std::invalid_argument("--keep must be >= 0 (0: keep all)");
  if ((cfg.checkpoint_every > 0 || cfg.resume) && cfg.checkpoint_dir.empty()) {
    throw std::invalid_argument(std::string(cfg.resume ? "--resume" : "--checkpoint-every") +
                                " needs --checkpoint-dir DIR");
  }
  if (!cfg.trace.empty()) trace::check_path(cfg.trace);
  if (!cfg.tensorboard.empty()) tensorboard::check_dir(cfg.tensorboard);
  if (cfg.checkpoint_async && cfg.checkpoint_every == 0) {
    throw std::invalid_argument("--checkpoint-async needs --checkpoint-every N (it makes those saves asynchronous)");
  }
}

// Where a run is: its steps, the epoch and how far into it, and the learning-rate schedule's
// position (TrainConfig::schedule_batch).
struct Position {
  int64_t step = 0, epoch = 0;
  int64_t in_epoch = 0;          // batches of `epoch` done (where a batch-share plan continues)
  int64_t epoch_samples = 0;     // global samples of `epoch` done (where the sampler continues)
  int64_t schedule_samples = 0;  // every step's global batch, summed
  int64_t schedule_batch = 1;    // the global batch whose steps the schedule counts
  double schedule_step() const { return static_cast<double>(schedule_samples) / static_cast<double>(schedule_batch); }
};

Position fresh_start(const TrainConfig& cfg) {
  Position p;
  p.schedule_batch = cfg.schedule_batch > 0 ? cfg.schedule_batch : cfg.batch;
  return p;
}

// Whether a checkpoint saved with `saved` (its extra_json) can continue as `cfg`: the seed, and
// the global batch and schedule unless the run may change its batch; std::invalid_argument naming
// the difference otherwise.
void check_resumable(const TrainConfig& cfg, const std::string& dir, const nlohmann::json& saved) {
  const int64_t batch = saved.value("batch", cfg.batch), sb = saved.value("schedule_batch", batch);
  const std::string was = "checkpoint '" + dir + "' was saved with --batch " + std::to_string(batch) + " --seed " +
                          saved.value("seed", nlohmann::json()).dump();
  if (saved.value("seed", cfg.seed) != cfg.seed || (batch != cfg.batch && !cfg.batch_may_change)) {
    throw std::invalid_argument(was +
                                "; resume with the same global batch and seed so that the data position holds (an "
                                "elastic run with --elastic-lr scale resumes at another batch with that flag)");
  }
  if (!cfg.batch_may_change && sb != cfg.batch) {
    throw std::invalid_argument(was + " by an elastic run with --elastic-lr scale (its schedule counts steps of " +
                                std::to_string(sb) + " samples); resume it with --elastic-lr scale");
  }
  if (cfg.schedule_batch > 0 && cfg.schedule_batch != sb) {
    throw std::invalid_argument("checkpoint '" + dir + "' counts its schedule in steps of " + std::to_string(sb) +
                                " samples, this run in steps of " + std::to_string(cfg.schedule_batch) +
                                "; resume an elastic run with the --batch it was started with");
  }
}

// Resume: parameters, optimizer state, loss scale and RNG from the newest checkpoint (any
// strategy and world size: it is resharded on load), then the step, data position and schedule.
Position resume_from_checkpoint(const TrainConfig& cfg, Engine& eng, int rank) {
  Position p = fresh_start(cfg);
  const std::string dir = latest_checkpoint(cfg.checkpoint_dir);
  if (dir.empty()) {
    if (rank == 0)
      std::cout << "no checkpoint in '" << cfg.checkpoint_dir << "' yet; starting from step 0" << std::endl;
    return p;
  }
  const auto extra = nlohmann::json::parse(read_checkpoint_meta(dir).extra_json);
  check_resumable(cfg, dir, extra);
  const int64_t batch = extra.value("batch", cfg.batch);
  auto meta = eng.load(dir);
  p.step = meta.step;
  p.epoch = meta.epoch;
  p.in_epoch = meta.step_in_epoch;
  p.epoch_samples = extra.value("epoch_samples", meta.step_in_epoch * batch);
  p.schedule_samples = extra.value("schedule_samples", meta.step * batch);
  p.schedule_batch = extra.value("schedule_batch", batch);
  if (rank == 0) {
    std::cout << "resuming from " << dir << " (step " << meta.step << ", saved by " << meta.strategy << " on "
              << meta.world_size << " worker(s)";
    if (batch != cfg.batch) {
      std::cout << " at global batch " << batch << "; this run's is " << cfg.batch << ", the epoch continues at sample "
                << p.epoch_samples;
    }
    std::cout << ")" << std::endl;
  }
  return p;
}

void save_checkpoint_now(const TrainConfig& cfg, Engine& eng, const Position& at) {
  CheckpointMeta m;
  m.model = cfg.model;
  m.step = at.step;
  m.epoch = at.epoch;
  m.step_in_epoch = at.in_epoch;
  m.seed = cfg.seed;
  m.extra_json = nlohmann::json{{"batch", cfg.batch},
                                {"seed", cfg.seed},
                                {"lr", cfg.lr},
                                {"epochs", cfg.epochs},
                                {"epoch_samples", at.epoch_samples},
                                {"schedule_samples", at.schedule_samples},
                                {"schedule_batch", at.schedule_batch}}
                     .dump();
  CheckpointSaveOptions so;
  so.keep = cfg.checkpoint_keep;
  if (cfg.checkpoint_async) so.async = std::make_shared<AsyncCheckpoint>();
  eng.save(cfg.checkpoint_dir, m, so);
}

// The learning rate over the run, in steps of schedule_batch: the epochs' steps (a run that may
// change its batch counts ceil(N / schedule_batch) per epoch, the same at every worker count), or
// --max-steps.
LrSchedule lr_schedule(const TrainConfig& cfg, int dp, int64_t steps_per_epoch, int64_t dataset,
                       int64_t schedule_batch) {
  const int64_t per_epoch = cfg.batch_may_change ? (dataset + schedule_batch - 1) / schedule_batch : steps_per_epoch;
  LrSchedule schedule;
  schedule.peak = cfg.lr * (cfg.scale_lr ? dp : 1);
  // Goyal et al.'s warmup climbs from the unscaled rate to the scaled one; without --scale-lr
  // there is nothing to climb from, so the warmup starts at 0.
  schedule.warmup_start = cfg.scale_lr ? cfg.lr : 0.0;
  schedule.warmup_steps = cfg.warmup_steps;
  schedule.total_steps = per_epoch * cfg.epochs;
  if (cfg.max_steps >= 0) schedule.total_steps = std::min(schedule.total_steps, cfg.max_steps);
  schedule.cosine = cfg.schedule == "cosine";
  return schedule;
}

// What the loop collects on this rank.
struct LoopRecord {
  std::vector<double> losses, loss_shares, step_ms;  // per step: local loss, this rank's share of the batch
  // Per step, when the loop reduced them as it went (--tensorboard plots them live): the global
  // batch's loss.
  std::vector<double> global_losses;
  std::vector<StepFigures> figures;  // per step: this rank's StepFigures
  int64_t steps = 0, samples = 0;
  bool weighted = false;  // unequal batch shares: the global loss is the sample-weighted mean
  bool stopped = false;   // ended early at a checkpoint, as cfg.stop_file asked
};

// This replica's batches of `epoch` after its first `consumed` global samples (all of them when
// 0): the batch-share plan's, or the sampler's continued by samples, so that a resume at another
// global batch trains on the samples that come next. A pipeline drops a short last batch that
// does not cut into its micro-batches.
std::vector<std::vector<int64_t>> epoch_batches(const TrainConfig& cfg, const BatchSharePlan& shares,
                                                const data::DistributedSampler& sampler, int64_t local_batch,
                                                int64_t consumed) {
  if (shares.active()) return shares.epoch_batches(sampler, local_batch, /*drop_last=*/false);
  const auto idx = sampler.indices_from(consumed);
  const auto n = static_cast<int64_t>(idx.size());
  const ParallelConfig& pc = cfg.parallel;
  return data::batches(idx, local_batch, pc.pp > 1 && (n % local_batch) % pc.micro_batches != 0);
}

// The global batch's loss of one step from every rank's: the sample-weighted sum under unequal
// shares, else the mean (report_losses's reduction, one step at a time). Collective.
double global_loss(Engine& eng, double local, double share, bool weighted, const c10::Device& dev) {
  if (eng.world_size() == 1) return local;
  auto t = torch::tensor({weighted ? local * share : local}, torch::kDouble).to(dev);
  eng.world()->allreduce(t, weighted ? ReduceOp::kSum : ReduceOp::kAvg);
  return t.cpu().item<double>();
}

// The training loop: epochs of this replica's batches, the learning rate, checkpoints, progress
// and the batch shares' calibration.
LoopRecord run_loop(const TrainConfig& cfg, Engine& eng, const data::Dataset& train_set, const Position& start,
                    const c10::Device& dev, TrainReport& rep, tensorboard::Log& tb) {
  const int rank = eng.world()->rank(), world = eng.world_size();
  const int dp = eng.dp_size();
  data::DistributedSampler sampler(train_set.size(), eng.dp_rank(), dp, /*shuffle=*/true, cfg.seed);
  const int64_t local_batch = cfg.batch / dp;
  // Batch shares (tandem/shares.h): which samples this rank takes per step, the loss weight.
  BatchSharePlan shares(cfg, rank, world, dp);
  const auto steps_per_epoch = static_cast<int64_t>(epoch_batches(cfg, shares, sampler, local_batch, 0).size());
  const LrSchedule schedule = lr_schedule(cfg, dp, steps_per_epoch, train_set.size(), start.schedule_batch);
  // The run ends when the epochs are done or the schedule is (--max-steps).
  const int64_t last_sample = schedule.total_steps * start.schedule_batch;
  const LossFn cross_entropy = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out.to(at::kFloat), y);  // the loss in fp32
  };

  const int64_t steps_left = std::max<int64_t>(0, (last_sample - start.schedule_samples + cfg.batch - 1) / cfg.batch);
  Progress progress(rank == 0 && cfg.progress, start.step + steps_left, cfg.log_every);
  LoopRecord rec;
  Position at = start;
  eng.train(true);
  eng.reset_stats();
  StepMeter meter(eng);
  const bool measure = !cfg.metrics_path.empty() || !cfg.tensorboard.empty();  // someone reads the figures
  auto t_start = Clock::now();
  for (int epoch = static_cast<int>(start.epoch);
       epoch < cfg.epochs && at.schedule_samples < last_sample && !rec.stopped; ++epoch) {
    sampler.set_epoch(epoch);
    if (epoch != start.epoch) at.in_epoch = at.epoch_samples = 0;
    at.epoch = epoch;
    auto chunks = epoch_batches(cfg, shares, sampler, local_batch, at.epoch_samples);
    // Where in `chunks` the epoch goes on: a share plan lists the whole epoch, the sampler the rest.
    auto next = static_cast<size_t>(shares.active() ? at.in_epoch : 0);
    while (next < chunks.size() && at.schedule_samples < last_sample) {
      const std::vector<int64_t> idx = chunks[next];
      const auto n = static_cast<int64_t>(idx.size());
      auto t0 = Clock::now();
      const double lr = schedule.at(at.schedule_step());
      eng.set_lr(lr);
      // Forward window (data, --slow-rank, forward, loss): what the batch-share calibration times.
      at::Tensor x, y;
      {
        trace::Span span("data", "data");
        std::tie(x, y) = data::gather_batch(train_set, idx);
      }
      shares.slow_down(n, BatchSharePlan::kForwardFraction);
      double forward_s = std::chrono::duration<double>(Clock::now() - t0).count();
      const int64_t step_global = shares.step_samples(sampler, n, at.in_epoch);
      StepOptions so;
      // Unequal shares: weight W * n_r / N, so the averaged gradient is the global-batch one.
      if (shares.active()) so.loss_weight = shares.loss_weight(n, step_global);
      eng.zero_grad();
      at::Tensor loss = eng.forward_backward(x, y, cross_entropy, so);
      forward_s += eng.last_forward_seconds();
      shares.slow_down(n, BatchSharePlan::kBackwardFraction);
      eng.optimizer_step();
      double l = loss.item<double>();
      if (!std::isfinite(l)) {
        throw std::runtime_error("rank " + std::to_string(rank) + ": loss became " + std::to_string(l) + " at step " +
                                 std::to_string(at.step) + "; lower --lr (now " + std::to_string(lr) + ")");
      }
      rec.losses.push_back(l);
      rec.loss_shares.push_back(static_cast<double>(n) / static_cast<double>(step_global));
      shares.record(n, forward_s);
      ++at.step;
      ++at.in_epoch;
      ++next;
      at.epoch_samples += step_global;
      at.schedule_samples += cfg.batch;
      rec.samples += step_global;
      rec.step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      if (measure) rec.figures.push_back(meter.next(rec.step_ms.back(), step_global));
      if (!cfg.tensorboard.empty()) {  // every rank: the loss is reduced over them
        rec.global_losses.push_back(global_loss(eng, l, rec.loss_shares.back(), shares.active(), dev));
        tb.step(at.step, rec.global_losses.back(), rec.figures.back());
      }
      progress.update(epoch + 1, cfg.epochs, at.step, l, rec.samples, Clock::now() - t_start);
      if (cfg.checkpoint_every > 0 && at.step % cfg.checkpoint_every == 0) {
        save_checkpoint_now(cfg, eng, at);
        if (elastic_stop_requested(*eng.world(), cfg.stop_file, dev)) {
          rec.stopped = true;
          break;
        }
      }
      // --batch-shares auto: after the calibration steps, re-plan the rest of the epoch.
      if (shares.calibrate_if_due(at.step - start.step, *eng.dp_group(), dev)) {
        chunks = shares.epoch_batches(sampler, local_batch, false);
      }
    }
  }
  eng.wait_checkpoint();  // the last asynchronous save is committed inside the loop's time
  if (rec.stopped) acknowledge_elastic_stop(rank, cfg.stop_file, at.step);
  rep.wall_seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  rep.checkpoint_async = cfg.checkpoint_async;
  progress.finish();
  rec.steps = at.step;
  rec.weighted = shares.active();
  if (dp == world && world > 1) shares.report(*eng.world(), dev, rep.wall_seconds, rep);
  return rec;
}

// Global per-step losses (one all-reduce of every step's local loss), the step times and the speedup.
void report_losses(Engine& eng, const LoopRecord& rec, const c10::Device& dev, TrainReport& rep) {
  record_loop(rep, rec.steps, rec.samples, rep.wall_seconds, rec.step_ms);
  rep.step_figures = rec.figures;
  if (rec.losses.empty()) return;
  if (!rec.global_losses.empty()) {  // reduced step by step already: the values plotted live
    rep.losses = rec.global_losses;
    rep.final_loss = rep.losses.back();
    return;
  }
  auto lt = torch::tensor(rec.losses, torch::kDouble).to(dev);
  if (rec.weighted) {  // the sample-weighted mean: sum over ranks of n_r / N * loss_r
    lt = lt * torch::tensor(rec.loss_shares, torch::kDouble).to(dev);
    eng.world()->allreduce(lt, ReduceOp::kSum);
  } else {
    eng.world()->allreduce(lt, ReduceOp::kAvg);
  }
  auto host = lt.cpu();
  rep.losses.assign(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
  rep.final_loss = rep.losses.back();
}

// Each replica scores its blocks of the test set (no padding), then the counts are summed.
void evaluate(const TrainConfig& cfg, Engine& eng, const data::Dataset& test_set, const c10::Device& dev,
              TrainReport& rep) {
  const int64_t n = cfg.eval_limit >= 0 ? std::min(cfg.eval_limit, test_set.size()) : test_set.size();
  int64_t correct = 0, counted = 0;
  eng.evaluate(test_set.images, n, 1000, [&](const at::Tensor& out, int64_t from, int64_t to) {
    auto y = test_set.labels.narrow(0, from, to - from).to(out.device());
    correct += out.argmax(1).eq(y).sum().item<int64_t>();
    counted += to - from;
  });
  auto t = torch::tensor({correct, counted}, torch::kLong).to(dev);
  eng.world()->allreduce(t, ReduceOp::kSum);
  auto host = t.cpu();
  rep.test_samples = host[1].item<int64_t>();
  rep.test_accuracy = rep.test_samples > 0 ? static_cast<double>(host[0].item<int64_t>()) / rep.test_samples : 0.0;
}

// What ran: the report's header, from the configuration and the engine's layout.
TrainReport describe_run(const TrainConfig& cfg, const Engine& eng) {
  TrainReport rep;
  rep.command = "train";
  rep.model = cfg.model;
  rep.global_batch = cfg.batch;
  rep.baseline_samples_per_second = cfg.baseline_samples_per_second;
  describe_engine(eng, rep);
  return rep;
}

}  // namespace

ParallelConfig default_train_parallel() {
  ParallelConfig pc;
  pc.micro_batches = 4;
  pc.bucket_mb = 25;
  return pc;
}

void validate_config(const TrainConfig& cfg_in, int world) {
  TrainConfig cfg = cfg_in;
  load_plugins_from_model_option(cfg.model);  // a library caller may name a plugin's file
  validate(cfg, world);
  validate_checkpointing(cfg);
}

// tandem plan's figures for the run (a built-in model the planner describes; none for a plugin's).
void add_planned_memory(const TrainConfig& cfg, const ParallelConfig& pc, int world,
                        const std::vector<int64_t>& partition, Report& rep) {
  plan::ModelSpec m;
  try {
    m = plan::builtin_model(cfg.model);
  } catch (const std::exception&) {
    return;  // a plugin's model, or one the planner does not describe
  }
  plan::add_planned_memory(m, pc, world, cfg.batch, cfg.optimizer, partition, rep);
}

TrainReport train(Runtime& rt, const TrainConfig& cfg_in) {
  TrainConfig cfg = cfg_in;
  load_plugins_from_model_option(cfg.model);
  const int world = rt.world_size(), rank = rt.rank();
  validate(cfg, world);
  validate_checkpointing(cfg);
  const ParallelConfig& pc = cfg.parallel;
  const int dp = data_parallel_size(pc, world);
  const auto dev = rt.device();

  // Data: every rank reads the files; each replica trains on its shard (all tp and pp ranks of
  // one replica read the same batch).
  auto splits = load_registered_dataset(dataset_of(cfg), cfg.data);
  data::Dataset train_set = splits.train, test_set;
  if (cfg.evaluate) test_set = splits.test;
  if (train_set.size() < dp) {
    throw std::invalid_argument("the training set has " + std::to_string(train_set.size()) +
                                " samples, fewer than the " + std::to_string(dp) +
                                (dp < world ? " data-parallel replicas" : " workers") + "; use fewer workers");
  }
  if (dev.is_cuda()) {
    train_set.images = train_set.images.to(dev);
    train_set.labels = train_set.labels.to(dev);
    if (test_set.size() > 0) {
      test_set.images = test_set.images.to(dev);
      test_set.labels = test_set.labels.to(dev);
    }
  }

  std::shared_ptr<torch::nn::Module> model;
  {
    std::lock_guard<std::mutex> lk(default_generator_mutex());  // replica threads share the generator
    torch::manual_seed(cfg.seed);
    model = make_registered_model(cfg.model);
  }
  EngineOptions eo;
  eo.model_name = cfg.model;
  if (pc.pp > 1 && pc.partition.method == PartitionMethod::kTime) {  // one micro-batch of training images
    const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(cfg.batch / dp / pc.micro_batches, train_set.size()));
    eo.partition_sample = train_set.images.narrow(0, 0, rows);
  }
  Engine eng(rt, model, nullptr, optimizer_options(cfg), pc, eo);
  TrainReport rep = describe_run(cfg, eng);

  Position start = fresh_start(cfg);
  if (cfg.resume) start = resume_from_checkpoint(cfg, eng, rank);
  rep.first_step = start.step;
  tensorboard::Log tb(cfg.tensorboard, rank == 0);
  if (!cfg.trace.empty()) trace::start(*rt.cpu_world());
  const LoopRecord rec = run_loop(cfg, eng, train_set, start, dev, rep, tb);
  if (!cfg.trace.empty()) {
    trace::stop();
    trace::write(cfg.trace, *rt.cpu_world());
  }
  const EngineStats loop = eng.stats();
  report_losses(eng, rec, dev, rep);
  if (cfg.evaluate && test_set.size() > 0 && !rec.stopped) evaluate(cfg, eng, test_set, dev, rep);
  collect_engine_report(eng, loop, rep);
  if (rank == 0) add_planned_memory(cfg, pc, world, pc.pp > 1 ? eng.partition() : std::vector<int64_t>{}, rep);
  if (rank == 0 && !cfg.metrics_path.empty()) write_metrics(cfg.metrics_path, rep);
  tb.finish(rep);
  return rep;
}

}  // namespace tandem
