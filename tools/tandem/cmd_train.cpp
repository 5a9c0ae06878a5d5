// `tandem train`: parses flags; when not already a worker, measures one worker briefly (for
// the speedup figure) and launches N workers of itself; each worker runs tandem::train().
// --model may name a plugin (.so): every process, the launcher and each worker, loads it itself.
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "checks.h"
#include "cli_app.h"
#include "commands.h"
#include "host_options.h"
#include "parallel_options.h"
#include "tandem/elastic.h"
#include "tandem/launcher.h"
#include "tandem/registry.h"
#include "tandem/replicas.h"
#include "tandem/runtime.h"
#include "tandem/trainer.h"
#include "worker_options.h"

namespace tandem::cli {
namespace {

// How an elastic run keeps the global batch on fewer workers than MAX.
struct ElasticBatch {
  bool accumulate = false;  // false: each worker's share grows; true: --grad-accum grows by MAX / W
  int max = 1;
  // The --grad-accum for `workers` workers (0: no whole number keeps the micro-batch).
  int64_t grad_accum(const TrainConfig& cfg, int workers) const {
    const int64_t k = cfg.parallel.grad_accum;
    if (!accumulate) return k;
    return k * max % workers == 0 ? k * max / workers : 0;
  }
};

// -n MIN:MAX: the workers under tandem/elastic.h's restart loop. With --elastic-lr keep the
// global batch is the same at every worker count (each worker's share grows, or with
// --elastic-batch accumulate its accumulation steps); with scale each worker keeps its share, a
// launch on W workers trains at W/MAX of the batch and rate, and the schedule counts steps of the
// batch at MAX (TrainConfig::schedule_batch). Either way a relaunch on W workers computes what
// `--resume` on W workers with the same flags would.
ElasticSpec train_elastic_spec(const TrainConfig& cfg, const ElasticBatch& eb, ElasticLr mode, int max_failures) {
  ElasticSpec spec;
  spec.command = "tandem train";
  spec.checkpoint_dir = cfg.checkpoint_dir;
  spec.checkpoint_every = cfg.checkpoint_every;
  spec.metrics_path = cfg.metrics_path;
  spec.batch = cfg.batch;
  spec.lr = cfg.lr;
  spec.mode = mode;
  spec.max_failures = max_failures;
  spec.check = [cfg, eb](int w, int64_t batch) {
    TrainConfig c = cfg;
    c.batch = batch;
    c.parallel.grad_accum = eb.grad_accum(cfg, w);
    if (c.parallel.grad_accum == 0) {
      throw std::invalid_argument("--elastic-batch accumulate: --grad-accum " +
                                  std::to_string(cfg.parallel.grad_accum) + " x " + std::to_string(eb.max) + " / " +
                                  std::to_string(w) + " workers is not a whole number");
    }
    // Each of the W workers keeps whole micro-batches (what --elastic-batch accumulate preserves).
    const int64_t k = c.parallel.grad_accum;
    if (c.parallel.tp * c.parallel.pp == 1 && c.batch_shares.empty() && c.batch % (w * k) != 0) {
      throw std::invalid_argument("--batch " + std::to_string(c.batch) + " does not split into " + std::to_string(w) +
                                  " workers x " + std::to_string(k) + " micro-batches");
    }
    validate_config(c, w);
  };
  spec.adjust = [cfg, eb, mode](int w, std::vector<std::string> a) {
    if (eb.accumulate) a = with_option(a, "--grad-accum", std::to_string(eb.grad_accum(cfg, w)));
    if (mode == ElasticLr::kScale) a = with_option(a, "--schedule-batch", std::to_string(cfg.batch));
    return a;
  };
  return spec;
}

}  // namespace

namespace {

// Why --replicas K cannot run with the other flags ("" when it can).
std::string replica_conflict(int replicas, int nprocs, int max_restarts, const std::string& device,
                             const TrainConfig& cfg) {
  if (replicas < 1) return "--replicas " + std::to_string(replicas) + ": a process trains at least 1 replica";
  const std::string both = "--replicas " + std::to_string(replicas) + " with -n " + std::to_string(nprocs);
  if (nprocs > 1 && device != "cpu") {
    return both + " runs on the CPU only (--device cpu); on CUDA use --replicas alone or -n alone";
  }
  if (nprocs > 1 && cfg.parallel.tp * cfg.parallel.pp > 1) {
    return both + ": --tp and --pp split the replicas into groups, which is not supported across processes; use "
                  "--replicas alone or -n alone";
  }
  if (max_restarts > 0) return "--max-restarts relaunches worker processes; it does not apply to --replicas";
  if (!cfg.trace.empty()) return "--trace records one timeline per process; it does not apply to --replicas yet";
  return "";
}

// One worker, the same per-worker threads and global batch, a few steps: the reference for the
// speedup figure, as samples per second in *sps (0 when unmeasured). False after printing a failure.
bool measure_baseline(const TrainConfig& cfg, const RuntimeOptions& ro, int workers, int64_t steps, double* sps) {
  TrainConfig b = cfg;
  b.max_steps = steps;
  b.evaluate = false;
  b.progress = false;
  b.metrics_path.clear();
  b.tensorboard.clear();
  b.checkpoint_every = 0;  // the measurement neither saves nor resumes
  b.resume = false;
  b.parallel.strategy = Strategy::kSingle;
  b.parallel.tp = b.parallel.pp = 1;  // the whole model on one worker
  b.batch_shares.clear();             // one worker takes the whole batch, at full speed
  b.slow_rank.clear();
  RuntimeOptions bro = ro;
  bro.threads = ro.threads > 0 ? ro.threads : std::max(1u, std::thread::hardware_concurrency() / workers);
  bro.backend = "self";
  std::cout << "measuring one worker (" << steps << " steps, " << bro.threads << " thread(s)) for the speedup figure..."
            << std::endl;
  try {
    Runtime rt(bro);
    auto r = train(rt, b);
    *sps = r.step_ms_median > 0 ? cfg.batch * 1000.0 / r.step_ms_median : 0.0;
  } catch (const std::exception& e) {
    std::cerr << "tandem train: " << e.what() << "\n";
    return false;
  }
  return true;
}

// --replicas K: K replica threads in this process; replica 0 prints the report.
int train_replicas(const TrainConfig& cfg, const ReplicaOptions& opts, bool announce) {
  if (announce) {
    std::cout << "training " << opts.replicas << " replicas in this process (" << to_string(cfg.parallel.strategy)
              << ")" << std::endl;
  }
  try {
    run_replicas(opts, [&](Runtime& rt) {
      auto report = train(rt, cfg);
      if (rt.rank() == 0) std::cout << format_report(report) << std::flush;
    });
  } catch (const std::exception& e) {
    std::cerr << "tandem train: " << e.what() << "\n" << std::flush;
    return 1;
  }
  return 0;
}

}  // namespace

int cmd_train(int argc, char** argv) {
  CLI::App app{"Train a model on N workers. With no options: the CNN on Fashion-MNIST, 2 workers, DDP, one epoch.",
               "tandem train"};
  TrainConfig cfg;
  WorkerFlags workers;
  int replicas = 1;
  int threads = 0;
  std::string device = "cpu";
  double timeout_s = 300;
  bool no_baseline = false, no_eval = false, no_progress = false, no_overlap = false;
  int64_t baseline_steps = 30;
  int max_restarts = 0;
  app.add_option("--model", cfg.model,
                 "mlp | cnn | cnn_bn, another registered model, or a plugin: path/to/libplugin.so (the model it "
                 "registers; path/to/libplugin.so:NAME when it registers several)")
      ->capture_default_str();
  app.add_option("--dataset", cfg.dataset,
                 "registered dataset: fashion-mnist, or one a plugin registers (default: the model's own, else "
                 "fashion-mnist)");
  app.add_option("--data", cfg.data, "directory the dataset reads (fashion-mnist: the IDX files)")
      ->capture_default_str();
  add_parallel_options(app, cfg.parallel);
  add_worker_options(app, workers, "2");
  app.add_option("--replicas", replicas,
                 "replicas per process, each on its own thread (and CUDA device), gradients reduced inside the "
                 "process (no MPI needed); alone it means one process: --replicas 2 trains 2 replicas")
      ->capture_default_str();
  app.add_option("--epochs", cfg.epochs, "epochs")->check(whole_between(1, 10000))->capture_default_str();
  app.add_option("--batch", cfg.batch, "global batch size (split across workers)")
      ->check(whole_between(1, 1 << 24))
      ->capture_default_str();
  app.add_option("--optimizer", cfg.optimizer,
                 "sgd | adam | adamw | lars | lamb (layer-wise trust ratios, for large batches)")
      ->capture_default_str();
  app.add_option("--lr", cfg.lr, "learning rate")->capture_default_str();
  app.add_option("--momentum", cfg.momentum, "SGD and LARS momentum")->capture_default_str();
  app.add_option("--weight-decay", cfg.weight_decay, "weight decay")->capture_default_str();
  app.add_option("--trust-coefficient", cfg.trust_coefficient, "LARS: eta, the scale of the layer-wise learning rate")
      ->capture_default_str();
  app.add_flag("--adapt-vectors", cfg.adapt_vectors,
               "LARS, LAMB: give biases and norm weights the trust ratio and weight decay too (default: excluded)");
  app.add_flag("--scale-lr", cfg.scale_lr, "linear scaling rule: lr x workers (Goyal et al.)");
  app.add_option("--warmup-steps", cfg.warmup_steps,
                 "linear warmup steps: from 0 to --lr, or with --scale-lr from lr to the scaled lr")
      ->capture_default_str();
  app.add_option("--schedule", cfg.schedule, "learning rate after warmup: cosine (to 0 at the end) | constant")
      ->capture_default_str();
  app.add_option("--seed", cfg.seed, "seed for initialisation and shuffling")->capture_default_str();
  app.add_option("--threads", threads, "compute threads per worker (0: cores / workers)")->capture_default_str();
  app.add_option("--max-steps", cfg.max_steps, "stop after this many steps (-1: all)")->capture_default_str();
  app.add_option("--metrics", cfg.metrics_path, "write per-step metrics and the report as JSON lines");
  app.add_option(
      "--tensorboard", cfg.tensorboard,
      "write TensorBoard event files of the per-step loss, learning rate, throughput, gradient norm, loss scale, "
      "memory and communication share, then the final figures, into DIR (rank 0; the --metrics figures)");
  app.add_option("--bucket-mb", cfg.parallel.bucket_mb, "gradient bucket size cap in MiB (DDP, ZeRO-1/2)")
      ->check(whole_between(1, 1 << 20))
      ->capture_default_str();
  app.add_flag("--find-unused", cfg.parallel.find_unused, "allow parameters that get no gradient (taken as zero)");
  add_word_option<Compression>(app, "--compress", cfg.parallel.compress, parse_compression,
                               to_string(cfg.parallel.compress),
                               "DDP's gradients on the wire: none | bf16 | fp16 | powersgd (low-rank factors with "
                               "error feedback; with --precision fp32)");
  app.add_option("--powersgd-rank", cfg.parallel.powersgd.rank,
                 "with --compress powersgd: the rank of each gradient matrix's approximation")
      ->check(whole_between(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--powersgd-start-step", cfg.parallel.powersgd.start_step,
                 "with --compress powersgd: steps averaged uncompressed before compression starts")
      ->check(whole_between(0, 1 << 30))
      ->capture_default_str();
  app.add_flag("--no-overlap", no_overlap, "all-reduce only after backward (to measure overlap)");
  app.add_option("--eval-limit", cfg.eval_limit, "evaluate on at most this many test samples")->capture_default_str();
  app.add_flag("--no-eval", no_eval, "skip the test-set evaluation");
  app.add_flag("--no-baseline", no_baseline, "skip measuring one worker for the speedup figure");
  app.add_option("--baseline-steps", baseline_steps, "steps of the one-worker measurement")->capture_default_str();
  app.add_flag("--no-progress", no_progress, "no progress display");
  app.add_option("--log-every", cfg.log_every, "plain progress line every N steps")->capture_default_str();
  app.add_option("--device", device, "cpu | cuda | auto")->capture_default_str();
  app.add_option("--timeout", timeout_s, "seconds any communication may block before failing")->capture_default_str();
  app.add_option("--checkpoint-dir", cfg.checkpoint_dir, "directory of sharded checkpoints (step-N/ inside)");
  app.add_option("--checkpoint-every", cfg.checkpoint_every, "save a checkpoint every N steps (0: never)")
      ->capture_default_str();
  app.add_option("--keep", cfg.checkpoint_keep, "keep the newest K checkpoints (0: all)")->capture_default_str();
  app.add_option("--trace", cfg.trace,
                 "write a timeline of the training loop (every rank: forward, backward, collectives with their "
                 "sizes, waits, optimizer, checkpoints, data) to FILE as Chrome trace JSON (open it in Perfetto)");
  app.add_flag("--checkpoint-async", cfg.checkpoint_async,
               "write checkpoints on a background thread while training continues (committed atomically when "
               "complete)");
  std::string elastic_batch = "grow";
  app.add_option("--elastic-batch", elastic_batch,
                 "-n MIN:MAX on fewer than MAX workers keeps the global batch by: grow (each worker's share of "
                 "--batch grows) | accumulate (each worker's micro-batch stays as on MAX workers; --grad-accum is "
                 "multiplied by MAX / workers)")
      ->check(CLI::IsMember({"grow", "accumulate"}))
      ->capture_default_str();
  std::string elastic_lr = "keep";
  add_elastic_lr_option(app, elastic_lr);
  auto* restarts_opt =
      app.add_option("--max-restarts", max_restarts,
                     "after a failed run of the workers, relaunch up to K times from the newest checkpoint "
                     "(elastic runs: 3 unless given)")
          ->check(whole_between(0, 100))
          ->capture_default_str();
  app.add_flag("--resume", cfg.resume,
               "continue from the newest checkpoint in --checkpoint-dir (any strategy / worker count)");
  LaunchOptions lo;  // several machines: the hosts and their network
  add_host_options(app, lo);
  // Heterogeneous clusters (tandem/shares.h).
  app.add_option("--batch-shares", cfg.batch_shares,
                 "each worker's share of the global batch: W0,W1,... (weights, e.g. 3,1), counts:N0,N1,... (samples "
                 "per step, summing to --batch), or auto (calibrated from measured throughput); default: equal");
  app.add_option("--calibration-steps", cfg.calibration_steps,
                 "with --batch-shares auto: equal-share steps timed before the shares are set (the first is a warm-up)")
      ->capture_default_str();
  app.add_option("--slow-rank", cfg.slow_rank,
                 "R:MS: rank R sleeps MS milliseconds per sample of its share each step (models a slower device; "
                 "for tests and demos)");
  app.add_option("--baseline-sps", cfg.baseline_samples_per_second, "(internal) one worker's samples/s")->group("");
  app.add_option("--elastic-stop-file", cfg.stop_file, "(internal) stop at a checkpoint when this file exists")
      ->group("");
  app.add_option("--schedule-batch", cfg.schedule_batch,
                 "(internal) the global batch whose steps the schedule counts (--elastic-lr scale: the one at MAX)")
      ->group("");
  app.footer(examples_footer({
      {"the CNN on Fashion-MNIST, 2 workers, DDP, one epoch", {"tandem train"}},
      {"4 workers, ZeRO-2, bf16 mixed precision, AdamW",
       {"tandem train -n 4 --strategy zero2 --precision bf16 --optimizer adamw --lr 1e-3"}},
      {"dp 1 x tp 2 x pp 2: tensor parallel inside each of 2 pipeline stages",
       {"tandem train -n 4 --model mlp --tp 2 --pp 2 --micro-batches 8 --strategy zero1"}},
      {"checkpoints every 100 steps, written in the background; resumed on 4 workers under ZeRO-3",
       {"tandem train --checkpoint-dir ck --checkpoint-every 100 --checkpoint-async",
        "tandem train -n 4 --strategy zero3 --checkpoint-dir ck --checkpoint-every 100 --resume"}},
      {"elastic: 2 to 4 workers, relaunched from the newest checkpoint after a failure",
       {"tandem train -n 2:4 --checkpoint-dir ck --checkpoint-every 50"}},
      {"8 workers on two hosts (ranks 0-3 on node1, 4-7 on node2)",
       {"printf 'node1 slots=4\\nnode2 slots=4\\n' > hosts",
        "tandem train -n 8 --hostfile hosts --net-if 10.1.0.0/16 --strategy zero2"}},
      {"4 replicas as threads of one process, no MPI", {"tandem train --replicas 4 --strategy zero1"}},
      {"shares of the batch from each worker's measured speed; a timeline of 50 steps",
       {"tandem train --batch-shares auto --max-steps 50 --trace trace.json"}},
      {"a model from a plugin", {"tandem train --model path/to/libmynet.so"}},
  }));
  if (auto rc = parse_command_line(app, argc, argv)) return *rc;
  // --replicas alone: one process, the replicas are the workers.
  if (app.count("--replicas") > 0 && app.count("--nprocs") == 0 && app.count("--min-workers") == 0) {
    workers.count = "1";
  }
  cfg.evaluate = !no_eval;
  cfg.progress = !no_progress;
  cfg.parallel.overlap = !no_overlap;
  WorkerRange range;
  ElasticLr lr_mode = ElasticLr::kKeep;
  try {
    range = worker_range(workers);
    lr_mode = parse_elastic_lr(elastic_lr);
    if ((app.count("--powersgd-rank") > 0 || app.count("--powersgd-start-step") > 0) &&
        cfg.parallel.compress != Compression::kPowerSGD) {
      throw std::invalid_argument("--powersgd-rank and --powersgd-start-step apply to --compress powersgd; add it "
                                  "or drop them");
    }
    cfg.batch_may_change = lr_mode == ElasticLr::kScale;
    if (cfg.batch_may_change && app.count("--elastic-batch") > 0) {
      throw std::invalid_argument("--elastic-batch " + elastic_batch +
                                  " keeps the global batch (--elastic-lr keep); with --elastic-lr scale each worker "
                                  "keeps its share instead: drop one of them");
    }
  } catch (const std::invalid_argument& e) {
    std::cerr << "tandem train: " << e.what() << "\n";
    return 2;
  }
  const int nprocs = range.max;
  const ElasticBatch elastic{elastic_batch == "accumulate", range.max};

  RuntimeOptions ro;
  ro.threads = threads;
  ro.device = device;
  ro.comm.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));

  const bool is_worker = detect_process_info().launcher != "none";
  // The plugin and the dataset, in every process: workers parse the same arguments.
  try {
    load_plugins_from_model_option(cfg.model);
    (void)model_info(cfg.model);  // an unknown model or dataset fails here, before anything starts
    if (cfg.dataset.empty()) cfg.dataset = default_dataset_for(cfg.model);
    (void)dataset_info(cfg.dataset);
  } catch (const std::exception& e) {
    std::cerr << "tandem train: " << e.what() << "\n";
    return 2;
  }
  if (!is_worker) {
    if (cfg.dataset == "fashion-mnist" && !std::filesystem::is_directory(cfg.data)) {
      std::cerr << "tandem train: dataset directory '" << cfg.data
                << "' not found; install Fashion-MNIST (apt-get install dataset-fashion-mnist) or pass --data DIR\n";
      return 2;
    }
    if (replicas != 1) {
      std::string why = range.elastic() ? "--replicas does not combine with an elastic -n MIN:MAX; use -n N"
                                        : replica_conflict(replicas, nprocs, max_restarts, device, cfg);
      if (!why.empty()) {
        std::cerr << "tandem train: " << why << "\n";
        return 2;
      }
    }
    const int total = nprocs * replicas;
    if (range.elastic()) {
      if (auto problem = elastic_spec_problem(train_elastic_spec(cfg, elastic, lr_mode, 0), range); !problem.empty()) {
        std::cerr << "tandem train: " << problem << "\n";
        return 2;
      }
    }
    if (max_restarts > 0 && cfg.checkpoint_dir.empty()) {
      std::cerr
          << "tandem train: --max-restarts needs --checkpoint-dir DIR (and --checkpoint-every N) to restart from\n";
      return 2;
    }
    try {
      if (!range.elastic()) validate_config(cfg, total);  // the rest of the flags, before starting anything
    } catch (const std::exception& e) {
      std::cerr << "tandem train: " << e.what() << "\n";
      return 2;
    }
    // Allowed but slow: CPUs have no fast fp16 convolution kernels (oneDNN falls back to its
    // reference kernel; a CNN step took 64x fp32's on an Intel Xeon, docs/BENCHMARKS.md).
    if (cfg.parallel.precision == Precision::kFP16 && device == "cpu" && cfg.model != "mlp") {
      std::cerr << "tandem train: warning: --precision fp16 on the CPU runs convolutions without fast kernels "
                   "(a step can take 10-60x fp32's); bf16 is the CPU's mixed precision\n";
    }
  }
  // One worker is launched as a child too when --max-restarts may have to relaunch it.
  if (!is_worker && (nprocs > 1 || max_restarts > 0 || range.elastic())) {
    std::vector<std::string> args = {self_executable(), "train"};
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    if (nprocs > 1 && !no_baseline && cfg.baseline_samples_per_second <= 0) {
      double sps = 0;
      if (!measure_baseline(cfg, ro, nprocs * replicas, baseline_steps, &sps)) return 1;
      if (sps > 0) {
        args.push_back("--baseline-sps");
        args.push_back(std::to_string(sps));
      }
    }
    lo.nprocs = nprocs;
    lo.prefix_output = false;
    // Explicit either way: mpirun gives the workers a pty, so their own isatty() says yes.
    lo.env.push_back(std::string("TANDEM_PROGRESS_TTY=") + (isatty(1) ? "1" : "0"));
    if (range.elastic()) {
      return run_elastic_command(train_elastic_spec(cfg, elastic, lr_mode,
                                                    restarts_opt->count() > 0 ? max_restarts : 3),
                                 range, lo, args);
    }
    const ParallelConfig& pc = cfg.parallel;
    std::cout << "launching " << nprocs << " workers (" << to_string(pc.strategy);
    if (replicas > 1) std::cout << ", " << replicas << " replicas each";
    if (pc.tp * pc.pp > 1) {
      std::cout << ", dp " << nprocs / (pc.tp * pc.pp) << " x tp " << pc.tp << " x pp " << pc.pp;
    }
    std::cout << ")" << std::endl;
    int rc = launch(lo, args);
    for (int attempt = 1; rc != 0 && attempt <= max_restarts; ++attempt) {
      std::cerr << "tandem train: the workers failed (exit code " << rc << "); restart " << attempt << " of "
                << max_restarts << " from the newest complete checkpoint in '" << cfg.checkpoint_dir << "'"
                << std::endl;
      if (std::find(args.begin(), args.end(), "--resume") == args.end()) args.push_back("--resume");
      rc = launch(lo, args);
    }
    return rc;
  }

  if (replicas != 1) {  // one process (not launched) or each launched worker
    ReplicaOptions opts;
    opts.replicas = replicas;
    opts.runtime = ro;
    try {
      validate_replicas(opts);  // before the baseline, which would fail on the same device
    } catch (const std::exception& e) {
      std::cerr << "tandem train: " << e.what() << "\n";
      return 2;
    }
    if (!is_worker && !no_baseline && cfg.baseline_samples_per_second <= 0 &&
        !measure_baseline(cfg, ro, replicas, baseline_steps, &cfg.baseline_samples_per_second)) {
      return 1;
    }
    return train_replicas(cfg, opts, !is_worker);
  }

  std::unique_ptr<Runtime> rt;
  try {
    rt = std::make_unique<Runtime>(ro);
  } catch (const std::exception& e) {
    std::cerr << "tandem train: " << e.what() << "\n";
    return 1;
  }
  if (rt->rank() == 0 && rt->hosts().size() > 1) std::cout << "hosts            " << rt->layout() << std::endl;
  try {
    auto report = train(*rt, cfg);
    if (rt->rank() == 0) std::cout << format_report(report) << std::flush;
  } catch (const std::exception& e) {
    auto* ce = dynamic_cast<const c10::Error*>(&e);
    // One write: cerr is unbuffered, and every rank may fail at once (the lines interleaved).
    std::cerr << "tandem train: rank " + std::to_string(rt->rank()) + ": " +
                     (ce ? ce->what_without_backtrace() : e.what()) + "\n"
              << std::flush;
    if (rt->world_size() > 1) std::cerr << rt->unreachable_peers() << std::flush;  // names a lost host
    if (rt->world_size() > 1) rt->abort(1);  // stop the peers at once instead of letting them time out
    return 1;
  }
  return 0;
}

}  // namespace tandem::cli
