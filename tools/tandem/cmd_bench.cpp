// `tandem bench`: runs `tandem train` for a model under a list of strategies and worker counts,
// a bounded number of steps each (median over repetitions, interleaved), and prints samples/s,
// time per epoch, speedup over one worker, efficiency, communication share, peak memory and
// optionally accuracy; with a calibration from `tandem plan --calibrate` (or one measured before
// every repetition, --calibrate), also the predicted step time. Writes CSV and a plot of
// speedup against workers (gnuplot) next to the ideal line.
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <regex>
#include <sstream>

#include "checks.h"
#include "commands.h"
#include "tandem/engine.h"
#include "tandem/launcher.h"
#include "tandem/pipeline_schedule.h"
#include "tandem/plan.h"
#include "tandem/registry.h"

namespace tandem::cli {
namespace {

namespace fs = std::filesystem;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// Runs argv with stdout and stderr to `log`; returns the exit status (128+signal when killed).
int run_logged(const std::vector<std::string>& argv, const std::string& log) {
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw std::runtime_error("waitpid failed");
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

std::string tail_of(const std::string& path, size_t lines) {
  std::ifstream f(path);
  std::vector<std::string> all;
  for (std::string l; std::getline(f, l);) all.push_back(l);
  std::string s;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) s += "    " + all[i] + "\n";
  return s;
}

// A --strategies entry: ddp | zero1..3, or a model-parallel layout tpK, ppK or tpKppK with an
// optional -gpipe/-1f1b schedule and -ddp/-zeroN for the data-parallel replicas (dp = workers / (tp*pp)).
struct Layout {
  std::string base = "ddp", schedule = "1f1b";
  int tp = 1, pp = 1;
};

Layout parse_layout(const std::string& token) {
  static const std::regex re("^(tp([0-9]+))?(pp([0-9]+))?(-(gpipe|1f1b))?(-?(ddp|zero[123]))?$");
  std::smatch mt;
  Layout l;
  if (token == "single") {
    l.base = "single";
    return l;
  }
  if (!std::regex_match(token, mt, re) || token.empty() ||
      (mt[1].length() == 0 && mt[3].length() == 0 && mt[5].length() > 0)) {
    throw std::invalid_argument("--strategies: unknown entry '" + token +
                                "'; use ddp, zero1, zero2, zero3 or a layout such as tp2, pp2, tp2pp2, pp2-gpipe, "
                                "pp2-zero1");
  }
  if (mt[2].length()) l.tp = std::stoi(mt[2]);
  if (mt[4].length()) l.pp = std::stoi(mt[4]);
  if (mt[6].length()) l.schedule = mt[6];
  if (mt[8].length()) l.base = mt[8];
  if (l.tp < 1 || l.pp < 1) throw std::invalid_argument("--strategies '" + token + "': tp and pp must be at least 1");
  return l;
}

struct Row {
  int workers = 1;
  std::string strategy;
  Layout layout;
  std::vector<double> step_ms, exposed_share, peak_mib, accuracy;
  std::vector<double> steal;  // per measurement: the hypervisor's share of the CPU time (-1: unknown)
  double predicted_ms = 0;
  std::vector<double> predicted_rounds;  // --calibrate: one prediction per repetition
  std::string caveat;                    // the plan's, when the prediction extrapolates
};

// How far the median measurement sits above the fastest one (0.15: 15 % slower). Small when the
// machine ran at one speed through the repetitions, or slowed down for one of them (the median
// absorbs that); large when it ran slow for most of them, so the median measured the slowdown.
double unsteadiness(const std::vector<double>& v) {
  if (v.size() < 3) return 0.0;
  const double lo = *std::min_element(v.begin(), v.end());
  return lo > 0 ? median(v) / lo - 1.0 : 0.0;
}

// All CPUs' time from /proc/stat's first line, and the part of it that the hypervisor gave to
// other guests ("steal", its 8th value): on a shared virtual machine, the plainest sign that a
// measurement ran on less machine than the calibration saw.
struct CpuClock {
  double total = 0, steal = 0;
  bool ok = false;
};

CpuClock read_cpu_clock() {
  CpuClock c;
  std::ifstream f("/proc/stat");
  std::string tag;
  if (!(f >> tag) || tag != "cpu") return c;
  double v[8];
  for (double& x : v)
    if (!(f >> x)) return c;
  for (double x : v) c.total += x;
  c.steal = v[7];
  c.ok = true;
  return c;
}

// The stolen share of the CPU time between two readings; -1 where it cannot be told.
double stolen_between(const CpuClock& a, const CpuClock& b) {
  if (!a.ok || !b.ok || b.total <= a.total) return -1.0;
  return std::max(0.0, (b.steal - a.steal) / (b.total - a.total));
}

int64_t lcm(int64_t a, int64_t b) {
  int64_t x = a, y = b;
  while (y) {
    int64_t t = x % y;
    x = y;
    y = t;
  }
  return a / x * b;
}

bool have_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(ss, dir, ':');) {
    if (!dir.empty() && access((dir + "/" + name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

}  // namespace

int cmd_bench(int argc, char** argv) {
  CLI::App app{"Speedup table of a model over strategies and worker counts (runs tandem train for each), "
               "with CSV and a plot.",
               "tandem bench"};
  std::string model = "cnn", data = "/usr/share/datasets/fashion-mnist", csv = "bench.csv", plot = "bench.png";
  std::vector<std::string> strategies = {"ddp", "zero1", "zero2"};
  std::vector<int> workers = {1, 2, 4};
  int64_t batch = 0, steps = 30, eval_limit = 2000, epoch_samples = 60000;
  int reps = 1, threads = 0;
  int64_t micro_batches = 4, grad_accum = 1;
  std::string pp_partition = "params";
  bool accuracy = false, no_plot = false;
  std::string calibration = "tandem-calibration.json";
  double timeout_s = 600;
  std::string dataset;
  app.add_option("--model", model,
                 "mlp | cnn | cnn_bn, another registered model, or a plugin (path/to/libplugin.so[:NAME]), as for "
                 "tandem train")
      ->capture_default_str();
  app.add_option("--dataset", dataset, "registered dataset (default: the model's own, else fashion-mnist)");
  app.add_option("--strategies", strategies,
                 "strategies for more than one worker: ddp, zero1, zero2, zero3, and model-parallel layouts tpK, ppK, "
                 "tpKppK (optionally -gpipe, -zeroN); layouts run where they divide the worker count")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("-n,--workers", workers, "worker counts (1 runs --strategy single: the speedup reference)")
      ->delimiter(',')
      ->check(whole_between(1, kMaxWorkers))
      ->capture_default_str();
  app.add_option("--batch", batch, "global batch (0: the multiple of every worker count nearest 128)")
      ->check(whole_between(0, 1 << 24))
      ->capture_default_str();
  app.add_option("--steps", steps, "training steps per run (the median step time is reported)")->capture_default_str();
  app.add_option("--micro-batches", micro_batches, "pipeline micro-batches per step (layouts with pp)")
      ->capture_default_str();
  app.add_option("--grad-accum", grad_accum,
                 "gradient accumulation of the layouts without a pipeline, the single worker's too (tandem train "
                 "--grad-accum): micro-batches per step and replica")
      ->capture_default_str();
  app.add_option("--pp-partition", pp_partition,
                 "where pipelines are cut (tandem train --pp-partition): params | time | the layers per stage")
      ->capture_default_str();
  app.add_option("--reps", reps, "repetitions of every run, interleaved (median)")->capture_default_str();
  app.add_flag("--accuracy", accuracy, "evaluate test accuracy after the step budget");
  app.add_option("--eval-limit", eval_limit, "test samples for --accuracy")->capture_default_str();
  app.add_option("--epoch-samples", epoch_samples, "samples per epoch for the time-per-epoch column")
      ->capture_default_str();
  app.add_option("--data", data, "dataset directory (IDX files)")->capture_default_str();
  app.add_option("--threads", threads, "compute threads per worker (0: cores / workers, as tandem train)")
      ->capture_default_str();
  app.add_option("--csv", csv, "CSV output")->capture_default_str();
  app.add_option("--plot", plot, "plot output (PNG; needs gnuplot)")->capture_default_str();
  app.add_flag("--no-plot", no_plot, "no plot");
  app.add_option("--calibration", calibration, "calibration from tandem plan --calibrate: adds predicted step times")
      ->capture_default_str();
  app.add_option("--timeout", timeout_s, "seconds a single run may take")->capture_default_str();
  double drift_warn = 15.0;
  app.add_option("--drift-warn", drift_warn,
                 "with --reps >= 2: warn when the single worker's step varies by this many percent or more "
                 "between repetitions (the machine changed speed during the bench)")
      ->check(number_between(0, 1000))
      ->capture_default_str();
  int remeasure = 2;
  app.add_option("--remeasure", remeasure,
                 "with --reps >= 3: a row whose median step is --drift-warn percent or more above its fastest "
                 "repetition (the machine ran slow through most of them) is measured again, one round of all such "
                 "rows at a time, at most this many rounds; every measurement counts in the median, none is dropped "
                 "(0: report such rows as they are)")
      ->check(whole_between(0, 100))
      ->capture_default_str();
  bool predict_only = false, calibrate = false;
  app.add_flag("--predict-only", predict_only,
               "print the runs and their predicted step times (needs --calibration's file) without running them");
  app.add_flag("--calibrate", calibrate,
               "calibrate this machine (tandem plan --calibrate, this model only) before every repetition and "
               "predict each repetition from its own calibration (median over repetitions); the calibrations "
               "are kept next to the CSV");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // `model` becomes the registered name; the runs get the option as given, and load the plugin.
  const std::string model_option = model;
  load_plugins_from_model_option(model);
  if (dataset.empty()) dataset = default_dataset_for(model);
  (void)dataset_info(dataset);
  std::sort(workers.begin(), workers.end());
  workers.erase(std::unique(workers.begin(), workers.end()), workers.end());
  if (workers.empty() || workers.front() < 1) throw std::invalid_argument("--workers must be positive counts");
  if (steps < 2) throw std::invalid_argument("--steps must be at least 2 (the first step is not timed)");
  if (reps < 1) throw std::invalid_argument("--reps must be at least 1");
  if (calibrate && predict_only)
    throw std::invalid_argument("--predict-only predicts from an existing calibration without running anything; "
                                "drop --calibrate (or --predict-only to measure and calibrate)");
  if (calibrate && model != "mlp" && model != "cnn" && model != "cnn_bn")
    throw std::invalid_argument("--calibrate: the calibration runs the built-in models mlp, cnn and cnn_bn, not '" +
                                model + "'");
  if (!predict_only && dataset == "fashion-mnist" && !fs::is_directory(data))
    throw std::invalid_argument("dataset directory '" + data +
                                "' not found; install dataset-fashion-mnist or pass --data DIR");
  int64_t step_multiple = 1;
  for (int n : workers) step_multiple = lcm(step_multiple, n);
  if (batch == 0) batch = std::max<int64_t>(1, (128 + step_multiple / 2) / step_multiple) * step_multiple;
  if (batch % step_multiple != 0)
    throw std::invalid_argument("--batch " + std::to_string(batch) +
                                " does not split evenly over every worker count; use a multiple of " +
                                std::to_string(step_multiple));

  if (micro_batches < 1) throw std::invalid_argument("--micro-batches must be at least 1");
  if (grad_accum < 1) throw std::invalid_argument("--grad-accum must be at least 1");
  if (batch % grad_accum != 0)
    throw std::invalid_argument("--batch " + std::to_string(batch) + " does not split into --grad-accum " +
                                std::to_string(grad_accum) + " micro-batches on one worker");
  // The runs: one worker with `single` (always: the reference), then every strategy for n > 1;
  // a model-parallel layout where tp*pp divides n (and leaves replicas to shard for ZeRO).
  std::vector<Row> rows;
  rows.push_back({1, "single", parse_layout("single")});
  for (int n : workers) {
    if (n == 1) continue;
    for (const auto& s : strategies) {
      if (s == "single") continue;
      Row r;
      r.workers = n;
      r.strategy = s;
      r.layout = parse_layout(s);
      const int per_replica = r.layout.tp * r.layout.pp;
      if (n % per_replica != 0 || (r.layout.base != "ddp" && n == per_replica)) continue;
      const int64_t dp = n / per_replica;
      if (r.layout.pp > 1 && (batch / dp) % micro_batches != 0)
        throw std::invalid_argument("--batch " + std::to_string(batch) + " over " + std::to_string(dp) +
                                    " replica(s) does not split into --micro-batches " + std::to_string(micro_batches));
      if (r.layout.pp > 1) (void)parse_partition_option(pp_partition, r.layout.pp);  // as tandem train would refuse it
      if (r.layout.pp == 1 && (batch / dp) % grad_accum != 0)
        throw std::invalid_argument("--batch " + std::to_string(batch) + " over " + std::to_string(dp) +
                                    " replica(s) does not split into --grad-accum " + std::to_string(grad_accum));
      rows.push_back(r);
    }
  }

  // Predictions from a calibration: the file given, or with --calibrate one measured before
  // every repetition.
  auto predict = [&](const plan::Calibration& cal) {
    plan::ModelSpec m = plan::builtin_model(model);
    plan::ClusterSpec c = plan::cluster_preset("local");
    if (cal.memory_bandwidth > 0) c.groups[0].device.memory_bandwidth = cal.memory_bandwidth;
    plan::PlanOptions o;
    o.optimizer = "sgd";
    o.precision = "fp32";
    o.global_batch = batch;
    o.calibration = &cal;
    for (auto& r : rows) {
      plan::Layout l;
      l.tp = r.layout.tp;
      l.pp = r.layout.pp;
      l.dp = r.workers / (l.tp * l.pp);
      l.zero = zero_stage(parse_strategy(r.layout.base));
      l.micro_batches = l.pp > 1 ? micro_batches : grad_accum;
      l.micro_batch = batch / l.dp / l.micro_batches;
      o.pipeline_schedule = r.layout.schedule;
      o.pipeline_partition = pp_partition;
      plan::Estimate e = plan::estimate(m, c, l, o);
      r.predicted_ms = e.feasible ? e.step_s * 1e3 : 0.0;
      r.caveat = e.caveat;
    }
  };
  auto read_calibration = [](const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return plan::calibration_from_json(ss.str());
  };
  bool have_cal = calibrate;
  const auto planned = plan::builtin_model_names();
  const bool plannable = std::find(planned.begin(), planned.end(), model) != planned.end();
  if (!calibrate && plannable && std::ifstream(calibration)) {
    predict(read_calibration(calibration));
    have_cal = true;
  }

  if (predict_only) {
    if (!plannable)
      throw std::invalid_argument("--predict-only: the planner describes its built-in models (" +
                                  std::to_string(planned.size()) + " of them, see tandem plan), not '" + model + "'");
    if (!have_cal)
      throw std::invalid_argument(
          "--predict-only needs a calibration: run tandem plan --calibrate or pass --calibration FILE");
    std::cout << std::setw(7) << "workers" << std::setw(13) << "strategy" << std::setw(11) << "predicted"
              << "\n";
    for (const auto& r : rows)
      std::cout << std::setw(7) << r.workers << std::setw(13) << r.strategy << std::setw(11)
                << (r.predicted_ms > 0 ? fixed(r.predicted_ms, 1) : std::string("-")) << "\n";
    return 0;
  }

  // The CSV is written at the end: find out now, not after the runs, that it cannot be.
  if (!std::ofstream(csv, std::ios::app))
    throw std::invalid_argument("cannot write the CSV '" + csv + "'; pass --csv with a writable path");
  const std::string self = self_executable();
  // A private scratch directory (POSIX calls: std::filesystem::remove_all resolves to a copy
  // inside libtorch.so that crashes here).
  std::string tmpl = "/tmp/tandem-bench-XXXXXX";
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("cannot create a directory under /tmp");
  const fs::path tmp = tmpl;
  auto cleanup = [&] {
    ::unlink((tmp / "metrics.jsonl").c_str());
    ::unlink((tmp / "calibration.json").c_str());
    ::unlink((tmp / "log.txt").c_str());
    ::rmdir(tmp.c_str());
  };
  std::cout << "tandem bench: " << model << ", global batch " << batch << ", " << steps << " steps per run, " << reps
            << " repetition(s), " << rows.size() << " configurations"
            << (pp_partition == "params" ? "" : ", pipelines cut by " + pp_partition)
            << (grad_accum > 1 ? ", gradient accumulation " + std::to_string(grad_accum) : "") << std::endl;
  std::string cal_workers;
  for (int n : workers)
    if (n > 1) cal_workers += (cal_workers.empty() ? "" : ",") + std::to_string(n);
  // One measurement of a row: a `tandem train` run; false (after cleaning up) when it failed.
  auto measure = [&](Row& r, const std::string& label) -> bool {
    const std::string metrics = (tmp / "metrics.jsonl").string(), log = (tmp / "log.txt").string();
    std::vector<std::string> args = {self,
                                     "train",
                                     "--model",
                                     model_option,
                                     "--dataset",
                                     dataset,
                                     "--strategy",
                                     r.layout.base,
                                     "-n",
                                     std::to_string(r.workers),
                                     "--batch",
                                     std::to_string(batch),
                                     "--max-steps",
                                     std::to_string(steps),
                                     "--no-baseline",
                                     "--no-progress",
                                     "--metrics",
                                     metrics,
                                     "--data",
                                     data,
                                     "--timeout",
                                     fixed(timeout_s, 0),
                                     "--schedule",
                                     "constant"};
    if (threads > 0) args.insert(args.end(), {"--threads", std::to_string(threads)});
    if (r.layout.tp > 1) args.insert(args.end(), {"--tp", std::to_string(r.layout.tp)});
    if (r.layout.pp == 1 && grad_accum > 1) args.insert(args.end(), {"--grad-accum", std::to_string(grad_accum)});
    if (r.layout.pp > 1) {
      args.insert(args.end(), {"--pp", std::to_string(r.layout.pp), "--micro-batches", std::to_string(micro_batches),
                               "--pipeline-schedule", r.layout.schedule, "--pp-partition", pp_partition});
    }
    if (accuracy) {
      args.insert(args.end(), {"--eval-limit", std::to_string(eval_limit)});
    } else {
      args.push_back("--no-eval");
    }
    std::cout << "  [" << label << "] " << r.workers << " worker(s), " << r.strategy << "... " << std::flush;
    ::unlink(metrics.c_str());
    const CpuClock c0 = read_cpu_clock();
    int rc = run_logged(args, log);
    const CpuClock c1 = read_cpu_clock();
    if (rc != 0) {
      std::cout << "failed\n";
      std::cerr << "tandem bench: `tandem train` with " << r.workers << " worker(s), strategy " << r.strategy
                << " exited with " << rc << "; its last lines:\n"
                << tail_of(log, 15);
      cleanup();
      return false;
    }
    nlohmann::json rep_json;
    std::ifstream mf(metrics);
    for (std::string line; std::getline(mf, line);) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.value("report", false)) rep_json = j;
    }
    if (rep_json.is_null()) {
      std::cerr << "tandem bench: no report in " << metrics << "\n";
      cleanup();
      return false;
    }
    const double ms = rep_json.value("step_ms_median", 0.0);
    r.step_ms.push_back(ms);
    const double wall = rep_json.value("wall_seconds", 0.0);
    const double exposed = rep_json.value("exposed_comm_seconds", 0.0);
    const bool has_comm = rep_json.value("comm_bytes", int64_t{0}) > 0;
    r.exposed_share.push_back(has_comm && wall > 0 ? exposed / wall : -1.0);
    double peak = 0;
    for (auto& b : rep_json["peak_rss_bytes"]) peak = std::max(peak, b.get<double>());
    r.peak_mib.push_back(peak / 1048576.0);
    if (accuracy) r.accuracy.push_back(rep_json.value("test_accuracy", -1.0));
    const double stolen = stolen_between(c0, c1);
    r.steal.push_back(stolen);
    std::cout << fixed(ms, 1) << " ms/step";
    if (stolen >= 0.01) std::cout << " (" << fixed(stolen * 100, 0) << " % of the CPU time stolen)";
    std::cout << std::endl;
    return true;
  };
  for (int rep = 0; rep < reps; ++rep) {
    if (calibrate) {
      // Minutes, not hours, between a calibration and the runs it predicts: a shared virtual
      // machine's speed can change mode for minutes at a time (docs/BENCHMARKS.md, "Planning").
      const std::string cal_path = (tmp / "calibration.json").string(), log = (tmp / "log.txt").string();
      std::vector<std::string> args = {self,
                                       "plan",
                                       "--calibrate",
                                       "--cluster",
                                       "local",
                                       "--model",
                                       model,
                                       "--calibrate-models",
                                       model,
                                       "--calibrate-batch",
                                       std::to_string(batch),
                                       "--batch",
                                       std::to_string(batch),
                                       "--calibration",
                                       cal_path,
                                       "--top",
                                       "0",
                                       "--show-infeasible",
                                       "0"};
      if (!cal_workers.empty()) args.insert(args.end(), {"--calibrate-workers", cal_workers});
      std::cout << "  [" << rep + 1 << "/" << reps << "] calibrating... " << std::flush;
      const auto t0 = std::chrono::steady_clock::now();
      const CpuClock c0 = read_cpu_clock();
      int rc = run_logged(args, log);
      const double cal_stolen = stolen_between(c0, read_cpu_clock());
      if (rc != 0) {
        std::cout << "failed\n";
        std::cerr << "tandem bench: `tandem plan --calibrate` exited with " << rc << "; its last lines:\n"
                  << tail_of(log, 15);
        cleanup();
        return 1;
      }
      predict(read_calibration(cal_path));
      for (auto& r : rows) r.predicted_rounds.push_back(r.predicted_ms);
      fs::path keep = fs::path(csv).replace_extension("");
      keep += ".calibration-" + std::to_string(rep + 1) + ".json";
      {
        std::ifstream in(cal_path);
        std::ofstream out(keep);
        out << in.rdbuf();
        if (!out) {
          cleanup();
          throw std::runtime_error("cannot write the calibration to '" + keep.string() + "'");
        }
      }
      std::cout << fixed(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0)
                << " s, kept in " << keep.string();
      if (cal_stolen >= 0.01) std::cout << " (" << fixed(cal_stolen * 100, 0) << " % of the CPU time stolen)";
      std::cout << std::endl;
    }
    for (auto& r : rows)
      if (!measure(r, std::to_string(rep + 1) + "/" + std::to_string(reps))) return 1;
  }
  auto unsteady_row = [&](const Row& r) { return unsteadiness(r.step_ms) * 100.0 >= drift_warn; };
  // Rows measured while the machine ran slow through most repetitions: measured again, a round
  // of all of them at a time (minutes apart from the first measurements, not back to back), and
  // every measurement kept. A machine that stays slow leaves them unsteady, and the table says so.
  if (reps >= 3) {
    for (int round = 1; round <= remeasure; ++round) {
      std::vector<Row*> unsteady;
      for (auto& r : rows)
        if (unsteady_row(r)) unsteady.push_back(&r);
      if (unsteady.empty()) break;
      if (round == 1)
        std::cout << "  " << unsteady.size() << " row(s) with a median step " << fixed(drift_warn, 0)
                  << " % or more above their fastest repetition: measured again (--remeasure " << remeasure << ")"
                  << std::endl;
      for (Row* r : unsteady)
        if (!measure(*r, "+" + std::to_string(round) + "/" + std::to_string(remeasure))) return 1;
    }
  }
  cleanup();
  if (calibrate)
    for (auto& r : rows) {
      bool all = std::all_of(r.predicted_rounds.begin(), r.predicted_rounds.end(), [](double v) { return v > 0; });
      r.predicted_ms = all ? median(r.predicted_rounds) : 0.0;
    }

  // The table.
  const double base_ms = median(rows.front().step_ms);
  std::ofstream out(csv);
  if (!out) throw std::runtime_error("cannot write '" + csv + "'");
  out << "model,workers,strategy,global_batch,steps,reps,step_ms,samples_per_s,epoch_s,speedup,efficiency,"
         "comm_share,peak_mib,accuracy,predicted_ms,prediction_error,predicted_ms_per_rep,step_ms_per_rep,"
         "measurements,spread,steal_share\n";
  std::cout << "\n"
            << std::right << std::setw(7) << "workers" << std::setw(13) << "strategy" << std::setw(10) << "samples/s"
            << std::setw(9) << "step ms" << std::setw(9) << "epoch s" << std::setw(9) << "speedup" << std::setw(7)
            << "eff." << std::setw(7) << "comm" << std::setw(10) << "peak MiB";
  const bool show_spread = reps >= 3;
  if (show_spread) std::cout << std::setw(8) << "spread";
  if (accuracy) std::cout << std::setw(9) << "accuracy";
  if (have_cal) std::cout << std::setw(11) << "predicted" << std::setw(7) << "error";
  std::cout << "\n";
  for (const auto& r : rows) {
    const double ms = median(r.step_ms);
    const double sps = batch * 1000.0 / ms;
    const double speedup = base_ms / ms;
    const double eff = speedup / r.workers;
    const double share = median(r.exposed_share);
    const double peak = median(r.peak_mib);
    const double acc = accuracy ? median(r.accuracy) : -1;
    const double err = r.predicted_ms > 0 ? (r.predicted_ms - ms) / ms : 0.0;
    std::cout << std::setw(7) << r.workers << std::setw(13) << r.strategy << std::setw(10) << fixed(sps, 0)
              << std::setw(9) << fixed(ms, 1) << std::setw(9) << fixed(epoch_samples / sps, 1) << std::setw(8)
              << fixed(speedup, 2) << "x" << std::setw(6) << fixed(eff * 100, 0) << "%" << std::setw(7)
              << (share >= 0 ? fixed(share * 100, 0) + "%" : std::string("-")) << std::setw(10) << fixed(peak, 0);
    const double spread = unsteadiness(r.step_ms);
    if (show_spread) std::cout << std::setw(7) << fixed(spread * 100, 0) << (unsteady_row(r) ? "%*" : "% ");
    if (accuracy) std::cout << std::setw(8) << (acc >= 0 ? fixed(acc * 100, 2) : std::string("-")) << "%";
    if (have_cal) {
      std::cout << std::setw(11) << (r.predicted_ms > 0 ? fixed(r.predicted_ms, 1) : std::string("-")) << std::setw(6)
                << (r.predicted_ms > 0 ? fixed(err * 100, 0) + "%" : std::string("-"));
    }
    std::cout << "\n";
    out << model << "," << r.workers << "," << r.strategy << "," << batch << "," << steps << "," << reps << ","
        << fixed(ms, 3) << "," << fixed(sps, 2) << "," << fixed(epoch_samples / sps, 3) << "," << fixed(speedup, 4)
        << "," << fixed(eff, 4) << "," << (share >= 0 ? fixed(share, 4) : "") << "," << fixed(peak, 1) << ","
        << (acc >= 0 ? fixed(acc, 4) : "") << "," << (r.predicted_ms > 0 ? fixed(r.predicted_ms, 3) : "") << ","
        << (r.predicted_ms > 0 ? fixed(err, 4) : "") << ",";
    for (size_t k = 0; k < r.predicted_rounds.size(); ++k)
      out << (k ? ";" : "") << (r.predicted_rounds[k] > 0 ? fixed(r.predicted_rounds[k], 3) : "");
    out << ",";
    for (size_t k = 0; k < r.step_ms.size(); ++k) out << (k ? ";" : "") << fixed(r.step_ms[k], 3);
    const double stolen = median(r.steal);
    out << "," << r.step_ms.size() << "," << (r.step_ms.size() >= 3 ? fixed(spread, 4) : "") << ","
        << (stolen >= 0 ? fixed(stolen, 4) : "") << "\n";
  }
  out.close();
  // The same single-worker run, repeated: on a machine that changes speed (a shared guest, a
  // throttled laptop) its spread is the noise that every row's median and prediction carry.
  if (reps >= 2) {
    const auto& single = rows.front().step_ms;
    const auto [lo, hi] = std::minmax_element(single.begin(), single.end());
    const double spread = *lo > 0 ? (*hi / *lo - 1.0) * 100.0 : 0.0;
    if (spread >= drift_warn) {
      std::cout << "note: the single worker's step varied by " << fixed(spread, 0) << " % over the " << single.size()
                << (static_cast<int>(single.size()) > reps ? " measurements (" : " repetitions (");
      for (size_t k = 0; k < single.size(); ++k) std::cout << (k ? ", " : "") << fixed(single[k], 1);
      std::cout << " ms): this machine changed speed during the bench, and every row's median"
                << (have_cal ? " and prediction" : "") << " carries noise of that order; the CSV's step_ms_per_rep "
                << "lists each repetition\n";
    }
  }
  // Rows the machine did not measure steadily, and CPU time the hypervisor took.
  if (show_spread) {
    std::string list;
    for (const auto& r : rows)
      if (unsteady_row(r))
        list += (list.empty() ? "" : ", ") + r.strategy + " on " + std::to_string(r.workers) + " (" +
                std::to_string(r.step_ms.size()) + " measurements)";
    if (!list.empty())
      std::cout << "note: unsteady (*): the median step stayed " << fixed(drift_warn, 0)
                << " % or more above the fastest measurement for " << list
                << ": the machine ran slower than it can through most of them, so these medians measured the "
                   "machine's slowdown as much as the configuration; rerun them on a quiet machine"
                << (remeasure > 0 ? "" : " or with --remeasure") << "\n";
  }
  {
    std::string list;
    for (const auto& r : rows) {
      const double stolen = median(r.steal);
      if (stolen >= 0.01)
        list += (list.empty() ? "" : ", ") + r.strategy + " on " + std::to_string(r.workers) + " " +
                fixed(stolen * 100, 0) + " %";
    }
    if (!list.empty())
      std::cout << "note: the hypervisor gave part of this machine's CPU time to other guests (steal in /proc/stat, "
                   "median over the measurements): "
                << list << "\n";
  }
  if (have_cal) {
    for (const auto& r : rows)
      if (!r.caveat.empty())
        std::cout << "note: the prediction of " << r.strategy << " on " << r.workers << " worker(s) has " << r.caveat
                  << "\n";
  }
  std::cout << "(speedup and efficiency against 1 worker, median step times; comm: exposed communication share of "
               "the loop, DDP only"
            << (show_spread ? "; spread: the median step above the fastest measurement" : "") << ")\nCSV written to "
            << csv << "\n";

  // The plot: speedup against workers, one line per strategy, and the ideal line.
  if (no_plot) return 0;
  if (!have_program("gnuplot")) {
    std::cout << "no plot: gnuplot is not installed (apt-get install gnuplot-nox; scripts/setup.sh installs it); "
                 "the CSV has the data\n";
    return 0;
  }
  const std::string script = plot + ".gp", dat = plot + ".dat";
  {
    // One data block per strategy (workers, speedup), starting at the 1-worker reference.
    std::ofstream d(dat);
    std::ofstream g(script);
    int maxw = workers.back();
    g << "set terminal pngcairo size 800,560\nset output '" << plot << "'\n"
      << "set title '" << model << ": speedup over 1 worker (global batch " << batch << ")'\n"
      << "set xlabel 'workers'\nset ylabel 'speedup'\nset key left top\nset grid\n"
      << "set xrange [1:" << maxw << "]\nset yrange [0:" << maxw << "]\nset xtics 1\n";
    g << "plot x title 'ideal' with lines dashtype 2 lc rgb '#888888'";
    int block = 0;
    for (const auto& s : strategies) {
      if (s == "single") continue;
      d << "# " << s << "\n1 1\n";
      for (const auto& r : rows)
        if (r.strategy == s) d << r.workers << " " << base_ms / median(r.step_ms) << "\n";
      d << "\n\n";
      g << ", '" << dat << "' index " << block++ << " using 1:2 title '" << s << "' with linespoints pt 7";
    }
    g << "\n";
  }
  int rc = run_logged({"/bin/sh", "-c", "gnuplot '" + script + "'"}, plot + ".log");
  if (rc != 0) {
    std::cout << "no plot: gnuplot failed (exit " << rc << "):\n" << tail_of(plot + ".log", 5);
    return 0;
  }
  ::unlink((plot + ".log").c_str());
  std::cout << "plot written to " << plot << " (gnuplot script " << script << ")\n";
  return 0;
}

}  // namespace tandem::cli
