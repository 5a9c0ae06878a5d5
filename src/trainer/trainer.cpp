#include "tandem/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "tandem/accumulate.h"
#include "tandem/checkpoint.h"
#include "tandem/data.h"
#include "tandem/ddp.h"
#include "tandem/grid.h"
#include "tandem/models.h"
#include "tandem/optim.h"
#include "tandem/pipeline.h"
#include "tandem/precision.h"
#include "tandem/shares.h"
#include "tandem/tensor_parallel.h"
#include "tandem/zero.h"
#include "trainer/progress.h"

namespace tandem {
namespace {

using Clock = std::chrono::steady_clock;

int64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream is(line.substr(6));
      int64_t kb = 0;
      is >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

OptimizerOptions optimizer_options(const TrainConfig& cfg) {
  OptimizerOptions o;
  o.kind = cfg.optimizer;
  o.lr = cfg.lr;
  o.momentum = cfg.optimizer == "sgd" ? cfg.momentum : 0.0;
  o.weight_decay = cfg.weight_decay;
  return o;
}

// The bytes a ring algorithm puts on the wire per rank for the payloads the Communicator
// counted: all-reduce 2(N-1)/N S; reduce-scatter (N-1)/N S (S: its full-size input);
// all-gather (N-1) s (s: its per-rank input); broadcast S (a pipelined chain).
double wire_bytes(const std::map<std::string, OpStats>& st, int n) {
  auto get = [&](const char* k) {
    auto it = st.find(k);
    return it == st.end() ? 0.0 : static_cast<double>(it->second.bytes);
  };
  const double f = n > 1 ? static_cast<double>(n - 1) / n : 0.0;
  return 2 * f * get("allreduce") + f * get("reduce_scatter") + (n - 1) * get("allgather") +
         (n > 1 ? get("broadcast") : 0.0) + get("send");  // send: pipeline activations and gradients
}

// Model-parallel flags: --tp, --pp, --micro-batches, --pipeline-schedule. Returns the number of
// data-parallel replicas, world / (tp * pp).
int validate_model_parallel(const TrainConfig& cfg, int world) {
  if (cfg.tp < 1 || cfg.pp < 1) {
    throw std::invalid_argument("--tp and --pp must be at least 1, got --tp " + std::to_string(cfg.tp) + " --pp " +
                                std::to_string(cfg.pp));
  }
  parse_pipeline_schedule(cfg.pipeline_schedule);  // names gpipe and 1f1b
  if (cfg.micro_batches < 1) throw std::invalid_argument("--micro-batches must be at least 1");
  const int tp = cfg.tp, pp = cfg.pp;
  if (pp > 1) (void)parse_partition_option(cfg.pp_partition, pp);
  if (cfg.grad_accum > 1 && !cfg.batch_shares.empty()) {
    throw std::invalid_argument("--grad-accum with --batch-shares is not supported yet (every rank must run the same "
                                "number of micro-batches); drop one of them");
  }
  if (tp * pp == 1) return world;
  const std::string layout = "--tp " + std::to_string(tp) + " x --pp " + std::to_string(pp);
  if (world % (tp * pp) != 0) {
    throw std::invalid_argument(layout + " = " + std::to_string(tp * pp) + " ranks per replica does not divide the " +
                                std::to_string(world) + " workers; use -n a multiple of " + std::to_string(tp * pp));
  }
  // ZeRO-2 and 3 reduce-scatter gradients in backward hooks: a pipeline's backward runs once per
  // micro-batch, so they compose with tensor parallelism only (as in DeepSpeed).
  const bool zero = cfg.strategy.rfind("zero", 0) == 0;
  if (cfg.strategy != "ddp" && !(zero && (pp == 1 || cfg.strategy == "zero1"))) {
    throw std::invalid_argument(layout + " composes with --strategy ddp or zero1 over the data-parallel ranks" +
                                std::string(pp == 1 ? " (zero2 and zero3 too)" : "") + ", not " + cfg.strategy +
                                (cfg.strategy == "single" ? " (one worker)" : " (not supported yet)"));
  }
  if (pp > 1 && cfg.compress != "none") {
    throw std::invalid_argument("--pp " + std::to_string(pp) +
                                ": pipeline gradients are averaged in one uncompressed all-reduce; drop --compress");
  }
  const int dp = world / (tp * pp);
  if (cfg.batch % dp != 0) {
    throw std::invalid_argument("--batch " + std::to_string(cfg.batch) + " (global) does not split evenly over " +
                                std::to_string(dp) + " data-parallel replicas (" + std::to_string(world) +
                                " workers / (" + layout + ")); use a multiple of " + std::to_string(dp));
  }
  if (pp > 1) {
    if ((cfg.batch / dp) % cfg.micro_batches != 0) {
      throw std::invalid_argument("--batch " + std::to_string(cfg.batch) + " gives each of the " + std::to_string(dp) +
                                  " data-parallel replicas " + std::to_string(cfg.batch / dp) +
                                  " samples, not divisible into " + std::to_string(cfg.micro_batches) +
                                  " micro-batches; use a --batch multiple of " + std::to_string(dp * cfg.micro_batches));
    }
  }
  return dp;
}

void validate(const TrainConfig& cfg, int world) {
  const int dp = validate_model_parallel(cfg, world);
  if (cfg.strategy != "single" && cfg.strategy != "ddp" && cfg.strategy != "zero1" && cfg.strategy != "zero2" &&
      cfg.strategy != "zero3") {
    throw std::invalid_argument("unknown strategy '" + cfg.strategy +
                                "' (this build supports: single, ddp, zero1, zero2, zero3)");
  }
  const auto prec = parse_precision(cfg.precision);
  if (cfg.max_grad_norm < 0) throw std::invalid_argument("--max-grad-norm must be >= 0 (0: no clipping)");
  if (cfg.compress != "none" && prec != Precision::kFP32) {
    throw std::invalid_argument("--compress " + cfg.compress + " compresses fp32 gradients; with --precision " +
                                cfg.precision + " they already travel in " + cfg.precision + " (drop --compress)");
  }
  if (cfg.strategy != "ddp" && cfg.compress != "none") {
    throw std::invalid_argument("--compress applies to --strategy ddp only");
  }
  if (cfg.strategy == "single" && world != 1) {
    throw std::invalid_argument("--strategy single runs one worker, but " + std::to_string(world) +
                                " were launched; use -n 1 or --strategy ddp");
  }
  if (cfg.epochs < 1) throw std::invalid_argument("--epochs must be at least 1");
  if (cfg.batch < 1) throw std::invalid_argument("--batch must be at least 1");
  validate_grad_accum(cfg.grad_accum, cfg.pp, cfg.micro_batches, cfg.batch, dp);
  if (dp == world && cfg.batch % world != 0 && cfg.batch_shares.empty()) {
    throw std::invalid_argument("--batch " + std::to_string(cfg.batch) + " (global) does not split evenly over " +
                                std::to_string(world) + " workers; use a multiple of " + std::to_string(world));
  }
  if (!(cfg.lr > 0.0) || !std::isfinite(cfg.lr)) throw std::invalid_argument("--lr must be a positive number");
  validate(optimizer_options(cfg));
  if (cfg.compress != "none" && cfg.compress != "bf16" && cfg.compress != "fp16") {
    throw std::invalid_argument("--compress must be none, bf16 or fp16");
  }
  if (cfg.schedule != "cosine" && cfg.schedule != "constant") {
    throw std::invalid_argument("--schedule must be cosine or constant");
  }
  if (cfg.bucket_mb < 1) throw std::invalid_argument("--bucket-mb must be at least 1");
  auto known = models::model_names();
  if (std::find(known.begin(), known.end(), cfg.model) == known.end()) {
    std::string list;
    for (auto& k : known) list += (list.empty() ? "" : ", ") + k;
    throw std::invalid_argument("unknown model '" + cfg.model + "' (known: " + list + ")");
  }
  if (cfg.model != "mlp" && cfg.model != "cnn" && cfg.model != "cnn_bn") {
    throw std::invalid_argument("--model " + cfg.model +
                                " cannot train on an image dataset (IDX); use mlp, cnn or cnn_bn");
  }
  if (cfg.pp > 1) {
    const auto layers = static_cast<int64_t>(models::make_model(cfg.model)->size());
    if (cfg.pp > layers) {
      throw std::invalid_argument("--pp " + std::to_string(cfg.pp) + ": more pipeline stages than the " +
                                  std::to_string(layers) + " layers of --model " + cfg.model + "; use --pp " +
                                  std::to_string(layers) + " or fewer");
    }
  }
  validate_batch_shares(cfg, world);
}

}  // namespace

namespace {

LossScalerOptions scaler_options(const TrainConfig& cfg) {
  LossScalerOptions o;
  o.init_scale = cfg.initial_loss_scale;
  return o;
}

void validate_checkpointing(const TrainConfig& cfg) {
  if (cfg.checkpoint_every < 0) throw std::invalid_argument("--checkpoint-every must be >= 0 (0: never)");
  if (cfg.checkpoint_keep < 0) throw std::invalid_argument("--keep must be >= 0 (0: keep all)");
  if ((cfg.checkpoint_every > 0 || cfg.resume) && cfg.checkpoint_dir.empty()) {
    throw std::invalid_argument(std::string(cfg.resume ? "--resume" : "--checkpoint-every") +
                                " needs --checkpoint-dir DIR");
  }
}

}  // namespace

void validate_config(const TrainConfig& cfg, int world) {
  validate(cfg, world);
  validate_checkpointing(cfg);
}

TrainReport train(Runtime& rt, const TrainConfig& cfg) {
  auto comm = rt.world();
  const int world = comm->size(), rank = comm->rank();
  validate(cfg, world);
  validate_checkpointing(cfg);
  const auto dev = rt.device();
  // Small host-side agreements (losses, accuracy, memory) go through the device communicator.
  auto small = [&](at::Tensor t) { return t.to(dev); };

  // The dp x tp x pp grid when the model is split; otherwise every rank is a replica.
  std::unique_ptr<ProcessGrid> grid;
  if (cfg.tp * cfg.pp > 1) grid = std::make_unique<ProcessGrid>(comm, cfg.tp, cfg.pp);
  const int dp = grid ? grid->dp_size() : world, dp_rank = grid ? grid->dp_rank() : rank;
  CommPtr dp_comm = grid ? grid->dp() : comm;

  // Data: every rank reads the files; each replica trains on its shard (all tp and pp ranks of
  // one replica read the same batch).
  auto train_set = data::load_fashion_mnist(cfg.data, /*train=*/true);
  data::Dataset test_set;
  if (cfg.evaluate) test_set = data::load_fashion_mnist(cfg.data, /*train=*/false);
  if (train_set.size() < dp) {
    throw std::invalid_argument("the training set has " + std::to_string(train_set.size()) + " samples, fewer than the " +
                                std::to_string(dp) + (grid ? " data-parallel replicas" : " workers") + "; use fewer workers");
  }
  if (dev.is_cuda()) {
    train_set.images = train_set.images.to(dev);
    train_set.labels = train_set.labels.to(dev);
    if (test_set.size() > 0) {
      test_set.images = test_set.images.to(dev);
      test_set.labels = test_set.labels.to(dev);
    }
  }

  const auto prec = parse_precision(cfg.precision);
  const auto dtype = compute_dtype(prec);
  torch::manual_seed(cfg.seed);
  auto model = models::make_model(cfg.model);
  model->to(dev);
  TrainReport rep;
  rep.world_size = world;
  rep.parameters = models::count_parameters(*model);
  rep.precision = precision_name(prec);
  rep.dp = dp;
  rep.tp = cfg.tp;
  rep.pp = cfg.pp;

  // Tensor parallelism: Linear pairs become column/row-parallel over grid.tp() (the head keeps
  // gathering the logits, so the loss below is unchanged). Pipeline: this rank keeps its stage.
  // A cut by time is measured on the dense model (the tensor-parallel one would run its
  // collectives on rank 0 alone), on one micro-batch of training images, before any step.
  const std::vector<int64_t> cut =
      cfg.pp > 1 ? partition_for_option(cfg.pp_partition, model, train_set.images, cfg.batch / dp / cfg.micro_batches,
                                        dev, cfg.pp, *comm)
                 : std::vector<int64_t>{};
  if (cfg.tp > 1) model = tp::tensor_parallel(model, grid->tp());
  std::unique_ptr<Pipeline> pipe;
  if (cfg.pp > 1) {
    PipelineOptions po;
    po.partition = cut;
    po.micro_batches = cfg.micro_batches;
    po.schedule = parse_pipeline_schedule(cfg.pipeline_schedule);
    po.device = dev;
    pipe = std::make_unique<Pipeline>(model, grid->pp(), po);
    rep.partition = pipe->partition();
  }
  // What this rank trains: its stage (pp > 1), else the whole (possibly tensor-parallel) model.
  const std::vector<at::Tensor> trained = pipe ? pipe->parameters() : model->parameters();
  GradientAverager averager(trained, dp_comm);  // a pipeline's replicas, after the whole step
  const std::shared_ptr<torch::nn::Module> trained_module =
      pipe ? pipe->stage_module().ptr() : std::shared_ptr<torch::nn::Module>(model.ptr());

  // ZeRO owns its optimizer (over this rank's shard), its masters and the step; otherwise the
  // optimizer (with fp32 masters in bf16/fp16) is built over the fp32 model, which is then
  // converted to the compute dtype.
  const bool is_zero = cfg.strategy.rfind("zero", 0) == 0;
  // A split model clips, and in fp16 checks overflow, by the norm of the whole model's gradient:
  // the tensor-parallel shards' squares summed over tp (tp::sharded_parameters: all false
  // without tp), each stage's total over pp (groups of one rank are skipped), so that every
  // stage and shard clips by one coefficient and skips a step together.
  const bool whole_model_norm = grid && (cfg.max_grad_norm > 0 || prec == Precision::kFP16);
  auto shard_flags = [&] {
    return tp::sharded_parameters(model, pipe ? pipe->first_layer() : 0, pipe ? pipe->end_layer() : -1);
  };
  std::unique_ptr<MixedPrecisionOptimizer> optimizer;
  if (!is_zero) {
    optimizer = std::make_unique<MixedPrecisionOptimizer>(trained, prec, optimizer_options(cfg), scaler_options(cfg),
                                                          dp > 1 ? dp_comm : nullptr);
    if (prec != Precision::kFP32) model->to(dtype);
    if (whole_model_norm) optimizer->set_model_parallel(shard_flags(), grid->tp(), grid->pp());
  }

  std::unique_ptr<DistributedDataParallel> ddp;
  // DDP over the replicas (none to average with when a grid has one replica); with a pipeline,
  // the stage's gradients are complete only after the whole micro-batched step and are averaged
  // in one all-reduce over grid.dp() instead.
  if (cfg.strategy == "ddp" && !pipe && (!grid || dp > 1)) {
    DDPOptions o;
    o.bucket_cap_bytes = cfg.bucket_mb * 1024 * 1024;
    o.find_unused_parameters = cfg.find_unused;
    if (cfg.compress == "bf16") o.compress_dtype = at::kBFloat16;
    if (cfg.compress == "fp16") o.compress_dtype = at::kHalf;
    o.overlap = cfg.overlap;
    o.communicate = cfg.communicate;
    ddp = std::make_unique<DistributedDataParallel>(model.ptr(), dp_comm, o);
  }
  std::unique_ptr<ZeroDataParallel> zero;
  if (is_zero) {
    ZeroOptions o;
    o.stage = cfg.strategy.back() - '0';
    o.bucket_cap_bytes = cfg.bucket_mb * 1024 * 1024;
    o.optimizer = optimizer_options(cfg);
    o.precision = prec;
    o.loss_scaler = scaler_options(cfg);
    o.max_grad_norm = cfg.max_grad_norm;
    zero = std::make_unique<ZeroDataParallel>(trained_module, dp_comm, o);
    if (whole_model_norm) zero->set_model_parallel(shard_flags(), grid->tp(), grid->pp());
  }
  auto forward = [&](const at::Tensor& x) {
    auto in = prec == Precision::kFP32 ? x : x.to(dtype);
    auto out = zero ? zero->forward(in) : model->forward(in);
    return out.to(at::kFloat);  // the loss and the argmax in fp32
  };
  const double target_lr = cfg.lr * (cfg.scale_lr ? dp : 1);

  data::DistributedSampler sampler(train_set.size(), dp_rank, dp, /*shuffle=*/true, cfg.seed);
  const int64_t local_batch = cfg.batch / dp;
  // A pipeline cuts every batch into micro-batches: a short last batch that does not divide is dropped.
  const bool drop_last = pipe && (sampler.num_samples() % local_batch) % cfg.micro_batches != 0;
  int64_t steps_per_epoch =
      drop_last ? sampler.num_samples() / local_batch : (sampler.num_samples() + local_batch - 1) / local_batch;
  // Batch shares (tandem/shares.h): which samples this rank takes per step, the loss weight.
  BatchSharePlan shares(cfg, rank, world, dp);
  if (shares.active()) steps_per_epoch = static_cast<int64_t>(shares.epoch_batches(sampler, local_batch, false).size());
  int64_t total_steps = steps_per_epoch * cfg.epochs;
  if (cfg.max_steps >= 0) total_steps = std::min(total_steps, cfg.max_steps);

  // Checkpoints of a tensor-parallel model go through a dense model of its shape (scratch, fp32
  // as the optimizer's values): gathered into it to save, cut from it to load.
  torch::nn::Sequential tp_dense{nullptr};
  if (cfg.tp > 1 && (cfg.checkpoint_every > 0 || cfg.resume)) {
    // Its initialisation draws from the generator: keep the run's random stream as without checkpoints.
    auto gen = at::detail::getDefaultCPUGenerator();
    const auto state = gen.get_state();
    tp_dense = models::make_model(cfg.model);
    gen.set_state(state);
    tp_dense->to(dev);
  }
  auto tp_state = [&] {
    TensorParallelState s;
    s.parallel = model.ptr();
    s.dense = tp_dense.ptr();
    s.tp = grid->tp();
    s.pipe = pipe.get();
    s.opt = optimizer ? &optimizer->optimizer() : nullptr;
    s.zero = zero.get();
    s.dp = dp_comm;
    return s;
  };
  // Resume: parameters, optimizer state, loss scale and RNG from the newest checkpoint (any
  // strategy and world size: it is resharded on load), then the step and data position.
  int64_t start_step = 0, start_epoch = 0, skip_in_epoch = 0;
  if (cfg.resume) {
    const std::string dir = latest_checkpoint(cfg.checkpoint_dir);
    if (dir.empty()) {
      if (rank == 0) std::cout << "no checkpoint in '" << cfg.checkpoint_dir << "' yet; starting from step 0" << std::endl;
    } else {
      auto saved = read_checkpoint_meta(dir);
      const auto extra = nlohmann::json::parse(saved.extra_json);
      if (extra.value("batch", cfg.batch) != cfg.batch || extra.value("seed", cfg.seed) != cfg.seed) {
        throw std::invalid_argument("checkpoint '" + dir + "' was saved with --batch " + extra.value("batch", nlohmann::json()).dump() +
                                    " --seed " + extra.value("seed", nlohmann::json()).dump() +
                                    "; resume with the same global batch and seed so that the data position holds");
      }
      CheckpointLoadOptions lo;
      lo.expect_model = cfg.model;
      auto meta = tp_dense ? load_tensor_parallel_checkpoint(dir, tp_state(), rank, lo)
                  : zero   ? (pipe ? load_checkpoint(dir, *pipe, *zero, rank, lo) : load_checkpoint(dir, *zero, rank, lo))
                  : pipe ? load_checkpoint(dir, *pipe, optimizer->optimizer(), rank, lo)
                         : load_checkpoint(dir, *model, optimizer->optimizer(), rank, lo);
      if (optimizer) optimizer->restore_loss_scaler(meta.loss_scale, meta.loss_scale_good_steps, meta.skipped_steps);
      start_step = meta.step;
      start_epoch = meta.epoch;
      skip_in_epoch = meta.step_in_epoch;
      if (rank == 0) {
        std::cout << "resuming from " << dir << " (step " << meta.step << ", saved by " << meta.strategy << " on "
                  << meta.world_size << " worker(s))" << std::endl;
      }
    }
  }
  rep.first_step = start_step;
  auto save_checkpoint_now = [&](int64_t epoch, int64_t in_epoch, int64_t done) {
    CheckpointMeta m;
    m.model = cfg.model;
    m.model_description = cfg.model + " (" + std::to_string(rep.parameters) + " parameters)";
    m.strategy = cfg.pp > 1 ? cfg.strategy + " x pp" + std::to_string(cfg.pp) : cfg.strategy;
    m.precision = rep.precision;
    m.step = done;
    m.epoch = epoch;
    m.step_in_epoch = in_epoch;
    m.seed = cfg.seed;
    const LossScaler& sc = zero ? zero->loss_scaler() : optimizer->scaler();
    m.loss_scale = sc.scale();
    m.loss_scale_good_steps = sc.overflow_free_steps();
    m.skipped_steps = sc.skipped_steps();
    m.extra_json = nlohmann::json{{"batch", cfg.batch}, {"seed", cfg.seed}, {"lr", cfg.lr}, {"epochs", cfg.epochs}}.dump();
    CheckpointSaveOptions so;
    so.keep = cfg.checkpoint_keep;
    auto cpu = rt.cpu_world();
    if (tp_dense) {  // the shards gathered over grid.tp(); rank 0 writes the whole model
      save_tensor_parallel_checkpoint(cfg.checkpoint_dir, m, tp_state(), *cpu, so);
    } else if (zero && pipe) {  // each stage's chunks gathered over its replicas; the first replica writes
      save_checkpoint(cfg.checkpoint_dir, m, *pipe, *zero, dp_comm, *cpu, so);
    } else if (zero) {
      save_checkpoint(cfg.checkpoint_dir, m, *zero, *cpu, so);
    } else if (pipe) {  // one writer per stage: the first replica's
      save_checkpoint(cfg.checkpoint_dir, m, *pipe, optimizer->optimizer(), grid->dp_rank() == 0, *cpu, so);
    } else {
      save_checkpoint(cfg.checkpoint_dir, m, *model, optimizer->optimizer(), *cpu, so);
    }
  };

  Progress progress(rank == 0 && cfg.progress, total_steps, cfg.log_every);
  std::vector<double> local_losses;
  std::vector<double> local_loss_shares;  // this rank's samples over the step's global samples
  std::vector<double> step_ms;
  int64_t step = start_step, samples = 0;
  double pipe_step_s = 0.0, pipe_compute_s = 0.0;  // pipeline steps after the first
  int64_t pipe_steps = 0;
  int64_t peak_live = 0;
  // fp16: the last stage back-propagates the scaled loss (the pipeline reports what this returns,
  // so the step's loss is unscaled below).
  auto pipe_loss = [&](const at::Tensor& out, const at::Tensor& target) {
    auto l = torch::nn::functional::cross_entropy(out.to(at::kFloat), target);
    return zero ? zero->scale_loss(l) : optimizer->scale_loss(l);
  };
  model->train();
  // Every communicator the step uses (the grid's groups count their own traffic).
  std::vector<CommPtr> comms = {comm};
  if (grid) comms.insert(comms.end(), {grid->tp(), grid->pp(), grid->dp()});
  std::vector<std::map<std::string, OpStats>> stats_before;
  for (auto& c : comms) stats_before.push_back(c->stats());
  auto t_start = Clock::now();
  for (int epoch = static_cast<int>(start_epoch); epoch < cfg.epochs && step < total_steps; ++epoch) {
    sampler.set_epoch(epoch);
    auto chunks = shares.epoch_batches(sampler, local_batch, drop_last);
    int64_t in_epoch = 0;  // batches of this epoch consumed (a resumed epoch skips those done before)
    if (epoch == start_epoch && skip_in_epoch > 0) {
      in_epoch = std::min<int64_t>(skip_in_epoch, static_cast<int64_t>(chunks.size()));
    }
    while (in_epoch < static_cast<int64_t>(chunks.size())) {
      const std::vector<int64_t> idx = chunks[in_epoch];
      if (step >= total_steps) break;
      auto t0 = Clock::now();
      double lr = target_lr;
      if (cfg.warmup_steps > 0 && step < cfg.warmup_steps) {
        lr = cfg.lr + (target_lr - cfg.lr) * static_cast<double>(step + 1) / static_cast<double>(cfg.warmup_steps);
      } else if (cfg.schedule == "cosine") {
        double t = static_cast<double>(step - cfg.warmup_steps) / static_cast<double>(std::max<int64_t>(1, total_steps - cfg.warmup_steps));
        lr = target_lr * 0.5 * (1.0 + std::cos(M_PI * t));
      }
      if (zero) {
        zero->set_lr(lr);
      } else {
        optimizer->set_lr(lr);
      }
      // Forward window (data, --slow-rank, forward, loss): what the batch-share calibration times.
      auto tf = Clock::now();
      auto [x, y] = data::gather_batch(train_set, idx);
      shares.slow_down(static_cast<int64_t>(idx.size()), BatchSharePlan::kForwardFraction);
      double forward_s = std::chrono::duration<double>(Clock::now() - tf).count();
      const int64_t step_global = shares.step_samples(sampler, static_cast<int64_t>(idx.size()), in_epoch);
      if (ddp) ddp->prepare_forward();
      if (zero) zero->prepare_forward();
      if (ddp) {
        ddp->zero_grad();
      } else if (zero) {
        zero->zero_grad();
      } else {
        optimizer->zero_grad();
      }
      at::Tensor loss;
      if (pipe) {
        // Every stage gets the batch (stage 0 uses the inputs, the last stage the targets).
        loss = pipe->train_step(prec == Precision::kFP32 ? x : x.to(dtype), y, pipe_loss);
        const LossScaler& sc = zero ? zero->loss_scaler() : optimizer->scaler();
        if (sc.dynamic()) loss = loss / sc.scale();
        if (!zero) averager.average();  // ZeRO reduces in its hooks
        if (step > 0) {
          pipe_step_s += pipe->stats().step_seconds;
          pipe_compute_s += pipe->stats().compute_seconds;
          ++pipe_steps;
        }
        peak_live = std::max(peak_live, pipe->stats().peak_live_micro_batches);
      } else {
        // --grad-accum K: K micro-batches, DDP and ZeRO-1 communicating once (tandem/accumulate.h).
        // The same number of micro-batches on every rank: equal shares give every rank the same batch.
        loss = accumulate_gradients(x, y, cfg.grad_accum, ddp.get(), zero.get(), [&](const at::Tensor& xp,
                                                                                      const at::Tensor& yp, double w) {
          tf = Clock::now();
          const double waited = zero ? zero->gather_wait_seconds() : 0.0;
          at::Tensor part_loss = torch::nn::functional::cross_entropy(forward(xp), yp);
          forward_s += std::chrono::duration<double>(Clock::now() - tf).count();
          // ZeRO-3 gathers every unit's parameters in the forward: time spent waiting there for
          // the other ranks is theirs, not this rank's (a fast rank would otherwise time as slow
          // as the slowest and --batch-shares auto would see no difference).
          if (zero) forward_s -= zero->gather_wait_seconds() - waited;
          // Unequal shares: weight W * n_r / N, so the averaged gradient is the global-batch one.
          at::Tensor weighted =
              shares.active() ? part_loss * shares.loss_weight(static_cast<int64_t>(idx.size()), step_global) : part_loss;
          if (w != 1.0) weighted = weighted * w;
          (zero ? zero->scale_loss(weighted) : optimizer->scale_loss(weighted)).backward();
          return w == 1.0 ? part_loss : part_loss * w;
        });
      }
      shares.slow_down(static_cast<int64_t>(idx.size()), BatchSharePlan::kBackwardFraction);
      if (zero) {
        zero->step();
      } else {
        optimizer->step(cfg.max_grad_norm);
      }
      double l = loss.item<double>();
      if (!std::isfinite(l)) {
        throw std::runtime_error("rank " + std::to_string(rank) + ": loss became " + std::to_string(l) + " at step " +
                                 std::to_string(step) + "; lower --lr (now " + std::to_string(lr) + ")");
      }
      local_losses.push_back(l);
      local_loss_shares.push_back(static_cast<double>(idx.size()) / static_cast<double>(step_global));
      shares.record(static_cast<int64_t>(idx.size()), forward_s);
      ++step;
      samples += step_global;
      step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      progress.update(epoch + 1, cfg.epochs, step, l, samples, Clock::now() - t_start);
      ++in_epoch;
      if (cfg.checkpoint_every > 0 && step % cfg.checkpoint_every == 0) save_checkpoint_now(epoch, in_epoch, step);
      // --batch-shares auto: after the calibration steps, re-plan the rest of the epoch.
      if (shares.calibrate_if_due(step - start_step, *dp_comm, dev)) chunks = shares.epoch_batches(sampler, local_batch, drop_last);
    }
  }
  rep.wall_seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  progress.finish();
  {
    // Communication of the training loop alone (before the report's own collectives), summed
    // over the communicators, each with its own size in the ring model.
    const double steps_d = std::max<int64_t>(step, 1);
    for (size_t c = 0; c < comms.size(); ++c) {
      auto after = comms[c]->stats();
      std::map<std::string, OpStats> delta;
      for (auto& [op, st] : after) {
        OpStats d = st;
        auto it = stats_before[c].find(op);
        if (it != stats_before[c].end()) {
          d.calls -= it->second.calls;
          d.bytes -= it->second.bytes;
          d.seconds -= it->second.seconds;
        }
        if (d.calls > 0) delta[op] = d;
      }
      for (auto& [op, d] : delta) {
        rep.comm_bytes_per_step[op] += d.bytes / steps_d;
        rep.comm_engine_seconds += d.seconds;
      }
      rep.wire_bytes_per_step += wire_bytes(delta, comms[c]->size()) / steps_d;
    }
  }
  if (pipe) {
    // Bubble: idle over compute time of each stage's train_step (after the first step, which
    // also agrees shapes), gathered over the stages of each replica; rank 0's replica reports.
    if (pipe_compute_s <= 0.0) {
      pipe_step_s = pipe->stats().step_seconds;
      pipe_compute_s = pipe->stats().compute_seconds;
      pipe_steps = 1;
    }
    const double ratio = pipe_compute_s > 0 ? std::max(0.0, pipe_step_s - pipe_compute_s) / pipe_compute_s : 0.0;
    const double per = 1e3 / static_cast<double>(std::max<int64_t>(1, pipe_steps));
    auto mine = small(torch::tensor({ratio, static_cast<double>(peak_live), pipe_step_s * per, pipe_compute_s * per},
                                    torch::kDouble));
    auto all = small(torch::empty({4 * cfg.pp}, torch::kDouble));
    grid->pp()->allgather(all, mine);
    auto host = all.cpu();
    for (int s = 0; s < cfg.pp; ++s) {
      rep.bubble_per_stage.push_back(host[4 * s].item<double>());
      rep.peak_live_micro_batches.push_back(static_cast<int64_t>(host[4 * s + 1].item<double>()));
      rep.pipeline_step_ms_per_stage.push_back(host[4 * s + 2].item<double>());
      rep.pipeline_compute_ms_per_stage.push_back(host[4 * s + 3].item<double>());
    }
    double sum = 0;
    for (double b : rep.bubble_per_stage) sum += b;
    rep.bubble_measured = sum / cfg.pp;
    rep.bubble_theory = static_cast<double>(cfg.pp - 1) / static_cast<double>(cfg.micro_batches);
  }
  if (zero) {
    rep.loss_scale = zero->loss_scaler().scale();
    rep.skipped_steps = zero->loss_scaler().skipped_steps();
  } else {
    rep.loss_scale = optimizer->scaler().scale();
    rep.skipped_steps = optimizer->scaler().skipped_steps();
  }
  rep.steps = step;
  rep.samples = samples;
  rep.samples_per_second = rep.wall_seconds > 0 ? samples / rep.wall_seconds : 0.0;
  if (step_ms.size() > 1) {
    std::vector<double> s(step_ms.begin() + 1, step_ms.end());
    std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
    rep.step_ms_median = s[s.size() / 2];
  } else if (!step_ms.empty()) {
    rep.step_ms_median = step_ms[0];
  }

  // Global per-step losses: one all-reduce of every step's local loss.
  if (!local_losses.empty()) {
    auto lt = small(torch::tensor(local_losses, torch::kDouble));
    if (shares.active()) {  // the sample-weighted mean: sum over ranks of n_r / N * loss_r
      lt = lt * small(torch::tensor(local_loss_shares, torch::kDouble));
      comm->allreduce(lt, ReduceOp::kSum);
    } else {
      comm->allreduce(lt, ReduceOp::kAvg);
    }
    auto host = lt.cpu();
    rep.losses.assign(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
    rep.final_loss = rep.losses.back();
  }

  if (dp == world && world > 1) shares.report(*comm, dev, rep.wall_seconds, rep);

  // Evaluation: each replica scores a disjoint slice of the test set (no padding), then sum.
  // All tp and pp ranks of a replica run the same forwards; one of them (tp rank 0 of the last
  // stage) counts.
  if (cfg.evaluate && test_set.size() > 0) {
    model->eval();
    torch::NoGradGuard ng;
    std::unique_ptr<Pipeline> eval_pipe;
    if (pipe) {
      PipelineOptions po = pipe->options();
      po.micro_batches = 1;  // any batch size; no backward to overlap
      po.partition = pipe->partition();
      eval_pipe = std::make_unique<Pipeline>(model, grid->pp(), po);
    }
    const bool counts = !grid || (grid->tp_rank() == 0 && grid->pp_rank() == grid->pp_size() - 1);
    int64_t n = cfg.eval_limit >= 0 ? std::min(cfg.eval_limit, test_set.size()) : test_set.size();
    std::vector<int64_t> mine;
    for (int64_t i = dp_rank; i < n; i += dp) mine.push_back(i);
    int64_t correct = 0;
    for (auto& idx : data::batches(mine, 1000, false)) {
      auto [x, y] = data::gather_batch(test_set, idx);
      auto out = eval_pipe ? eval_pipe->forward(prec == Precision::kFP32 ? x : x.to(dtype)) : forward(x);
      if (counts) correct += out.argmax(1).eq(y).sum().item<int64_t>();
    }
    auto t = small(torch::tensor({correct, counts ? static_cast<int64_t>(mine.size()) : int64_t{0}}, torch::kLong));
    comm->allreduce(t, ReduceOp::kSum);
    auto host = t.cpu();
    rep.test_samples = host[1].item<int64_t>();
    rep.test_accuracy = rep.test_samples > 0 ? static_cast<double>(host[0].item<int64_t>()) / rep.test_samples : 0.0;
    model->train();
  }

  // Memory per rank.
  {
    int64_t mem = peak_rss_bytes();
    auto mine = small(torch::tensor({mem}, torch::kLong));
    auto all = small(torch::empty({world}, torch::kLong));
    comm->allgather(all, mine);
    auto host = all.cpu();
    rep.peak_rss_bytes.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + world);
  }
  if (zero) {
    auto m = zero->memory();
    rep.parameter_bytes = m.parameter_bytes;
    rep.gradient_bytes = m.gradient_bytes;
    rep.optimizer_state_bytes = m.optimizer_state_bytes;
    rep.peak_gathered_bytes = m.peak_gathered_bytes;
    rep.zero_pool_bytes = m.pool_bytes;
    rep.zero_pool_misses = m.pool_misses;
  } else {
    for (auto& p : trained) {
      rep.parameter_bytes += p.numel() * p.element_size();
      if (p.grad().defined()) rep.gradient_bytes += p.grad().numel() * p.grad().element_size();
    }
    rep.optimizer_state_bytes = optimizer->optimizer_state_bytes() + optimizer->master_bytes();
  }
  {
    // The same figures on every rank: rank 0's.
    auto t = small(torch::tensor({rep.parameter_bytes, rep.gradient_bytes, rep.optimizer_state_bytes}, torch::kLong));
    comm->broadcast(t, 0);
    auto host = t.cpu();
    rep.parameter_bytes = host[0].item<int64_t>();
    rep.gradient_bytes = host[1].item<int64_t>();
    rep.optimizer_state_bytes = host[2].item<int64_t>();
  }
  if (ddp) {
    auto s = ddp->stats();
    rep.comm_seconds = s.comm_seconds;
    rep.exposed_comm_seconds = s.exposed_seconds;
    rep.hidden_fraction = s.hidden_fraction();
    rep.comm_bytes = s.bytes;
  }
  // Speedup from median step times (robust to the first step and a short last batch).
  if (cfg.baseline_samples_per_second > 0 && rep.step_ms_median > 0) {
    rep.speedup = (cfg.batch * 1000.0 / rep.step_ms_median) / cfg.baseline_samples_per_second;
  }

  if (rank == 0 && !cfg.metrics_path.empty()) {
    std::ofstream f(cfg.metrics_path);
    if (!f) throw std::runtime_error("cannot write metrics to '" + cfg.metrics_path + "'; check the directory exists");
    for (size_t i = 0; i < rep.losses.size(); ++i) {
      f << nlohmann::json{{"step", rep.first_step + static_cast<int64_t>(i) + 1}, {"loss", rep.losses[i]}, {"step_ms", i < step_ms.size() ? step_ms[i] : 0.0}}.dump()
        << '\n';
    }
    nlohmann::json r = {{"report", true},
                        {"model", cfg.model},
                        {"strategy", cfg.strategy},
                        {"precision", rep.precision},
                        {"loss_scale", rep.loss_scale},
                        {"skipped_steps", rep.skipped_steps},
                        {"comm_bytes_per_step", rep.comm_bytes_per_step},
                        {"wire_bytes_per_step", rep.wire_bytes_per_step},
                        {"comm_engine_seconds", rep.comm_engine_seconds},
                        {"peak_gathered_bytes", rep.peak_gathered_bytes},
                        {"zero_pool_bytes", rep.zero_pool_bytes},
                        {"zero_pool_misses", rep.zero_pool_misses},
                        {"world_size", world},
                        {"steps", rep.steps},
                        {"samples", rep.samples},
                        {"wall_seconds", rep.wall_seconds},
                        {"samples_per_second", rep.samples_per_second},
                        {"step_ms_median", rep.step_ms_median},
                        {"final_loss", rep.final_loss},
                        {"test_accuracy", rep.test_accuracy},
                        {"test_samples", rep.test_samples},
                        {"peak_rss_bytes", rep.peak_rss_bytes},
                        {"comm_seconds", rep.comm_seconds},
                        {"exposed_comm_seconds", rep.exposed_comm_seconds},
                        {"hidden_fraction", rep.hidden_fraction},
                        {"comm_bytes", rep.comm_bytes},
                        {"parameters", rep.parameters},
                        {"parameter_bytes", rep.parameter_bytes},
                        {"gradient_bytes", rep.gradient_bytes},
                        {"optimizer_state_bytes", rep.optimizer_state_bytes},
                        {"speedup", rep.speedup},
                        {"dp", rep.dp},
                        {"tp", rep.tp},
                        {"pp", rep.pp},
                        {"layout", "dp " + std::to_string(rep.dp) + " x tp " + std::to_string(rep.tp) + " x pp " +
                                       std::to_string(rep.pp)}};
    if (!rep.batch_shares.empty()) {
      r["batch_shares_mode"] = rep.batch_shares_mode;
      r["batch_shares"] = rep.batch_shares;
      r["calibrated_samples_per_second"] = rep.calibrated_samples_per_second;
      r["rank_samples_per_second"] = rep.rank_samples_per_second;
      r["rank_forward_samples_per_second"] = rep.rank_forward_samples_per_second;
    }
    r["grad_accum"] = cfg.grad_accum;
    if (rep.pp > 1) {
      r["micro_batches"] = cfg.micro_batches;
      r["pipeline_schedule"] = cfg.pipeline_schedule;
      r["partition"] = rep.partition;
      r["bubble_per_stage"] = rep.bubble_per_stage;
      r["pipeline_step_ms_per_stage"] = rep.pipeline_step_ms_per_stage;
      r["pipeline_compute_ms_per_stage"] = rep.pipeline_compute_ms_per_stage;
      r["bubble_measured"] = rep.bubble_measured;
      r["bubble_theory"] = rep.bubble_theory;
      r["peak_live_micro_batches"] = rep.peak_live_micro_batches;
    }
    f << r.dump() << '\n';
    if (!f) throw std::runtime_error("writing metrics to '" + cfg.metrics_path + "' failed (disk full?)");
  }
  return rep;
}

std::string format_report(const TrainConfig& cfg, const TrainReport& r) {
  std::ostringstream os;
  os << std::fixed;
  os << "\n== tandem train report ==\n";
  os << "model            " << cfg.model << " (" << r.parameters << " parameters), strategy " << cfg.strategy << ", "
     << r.world_size << " worker(s), " << r.precision << "\n";
  os << "layout           dp " << r.dp << " x tp " << r.tp << " x pp " << r.pp << " (data x tensor x pipeline parallel)\n";
  if (r.pp > 1) {
    os << "pipeline         " << r.pp << " stages, layers per stage";
    for (size_t s = 0; s < r.partition.size(); ++s) os << (s ? "/" : " ") << r.partition[s];
    os << ", " << cfg.micro_batches << " micro-batches, " << cfg.pipeline_schedule << "\n";
    os << "bubble           " << std::setprecision(2) << r.bubble_measured
       << " idle/compute measured (mean over stages:";
    for (size_t s = 0; s < r.bubble_per_stage.size(); ++s) os << (s ? "," : "") << " " << r.bubble_per_stage[s];
    os << "), theory (pp-1)/m = " << r.bubble_theory << "; most micro-batches alive per stage:";
    for (size_t s = 0; s < r.peak_live_micro_batches.size(); ++s) os << (s ? "," : "") << " " << r.peak_live_micro_batches[s];
    os << "\n";
  }
  os << "steps            " << r.steps << " (global batch " << cfg.batch << ", " << r.samples << " samples";
  if (cfg.grad_accum > 1) {
    os << "; gradient accumulation: " << cfg.grad_accum << " micro-batches of about " << cfg.batch / r.dp / cfg.grad_accum
       << " per replica and step";
  }
  os << ")\n";
  os << "wall time        " << std::setprecision(1) << r.wall_seconds << " s (training loop)\n";
  os << "throughput       " << std::setprecision(0) << r.samples_per_second << " samples/s, median step "
     << std::setprecision(1) << r.step_ms_median << " ms\n";
  os << format_batch_shares(r);
  if (r.speedup > 0) {
    os << "speedup          " << std::setprecision(2) << r.speedup << "x against one worker ("
       << std::setprecision(0) << cfg.baseline_samples_per_second << " samples/s), efficiency "
       << std::setprecision(0) << 100.0 * r.speedup / r.world_size << "%\n";
  }
  os << "final loss       " << std::setprecision(4) << r.final_loss << "\n";
  if (r.test_accuracy >= 0) {
    os << "test accuracy    " << std::setprecision(2) << 100.0 * r.test_accuracy << "% (" << r.test_samples
       << " samples)\n";
  }
  os << "peak memory      ";
  for (size_t i = 0; i < r.peak_rss_bytes.size(); ++i) {
    os << (i ? ", " : "") << "rank " << i << " " << std::setprecision(0) << r.peak_rss_bytes[i] / (1024.0 * 1024.0)
       << " MiB";
  }
  os << "\n";
  os << "model state      " << std::setprecision(2) << "parameters " << r.parameter_bytes / (1024.0 * 1024.0)
     << " MiB, gradients " << r.gradient_bytes / (1024.0 * 1024.0) << " MiB, optimizer state "
     << r.optimizer_state_bytes / (1024.0 * 1024.0) << " MiB" << (r.precision != "fp32" ? " incl. fp32 masters" : "")
     << " (rank 0)\n";
  if (r.peak_gathered_bytes > 0) {
    os << "gathered (zero3) " << std::setprecision(2) << r.peak_gathered_bytes / (1024.0 * 1024.0)
       << " MiB of full parameters alive at most (rank 0)\n";
  }
  if (r.zero_pool_bytes > 0) {
    os << "zero block       " << std::setprecision(2) << r.zero_pool_bytes / (1024.0 * 1024.0)
       << " MiB of shared memory for scratch" << (r.peak_gathered_bytes > 0 ? " and gathered units" : "") << ", "
       << r.zero_pool_misses << " buffer(s) outside it" << (r.zero_pool_misses > 0 ? " (their collectives go through MPI's fifos, slower)" : "")
       << " (rank 0)\n";
  }
  if (r.precision == "fp16") {
    os << "loss scale       " << std::setprecision(0) << r.loss_scale << ", " << r.skipped_steps
       << " step(s) skipped on overflow\n";
  }
  if (r.world_size > 1 && !r.comm_bytes_per_step.empty()) {
    os << "traffic per step " << std::setprecision(2) << r.wire_bytes_per_step / (1024.0 * 1024.0)
       << " MiB on the wire per rank (ring model); payload:";
    for (auto& [op, b] : r.comm_bytes_per_step) os << " " << op << " " << b / (1024.0 * 1024.0) << " MiB";
    os << "\n";
  }
  if (r.dp > 1 && r.pp == 1 && cfg.strategy == "ddp") {  // DDP's own counters (over the dp ranks)
    os << "communication    " << std::setprecision(2) << r.comm_seconds << " s all-reduce ("
       << std::setprecision(1) << r.comm_bytes / (1024.0 * 1024.0) << " MiB), " << std::setprecision(2)
       << r.exposed_comm_seconds << " s exposed, " << std::setprecision(0) << 100.0 * r.hidden_fraction
       << "% hidden behind backward\n";
  }
  return os.str();
}

}  // namespace tandem
