// `tandem bench`: runs `tandem train` for a model under a list of strategies and worker counts,
// a bounded number of steps each (median over repetitions, interleaved), and prints samples/s,
// time per epoch, speedup over one worker, efficiency, communication share, peak memory and
// optionally accuracy; with a calibration from `tandem plan --calibrate` (or one measured before
// every repetition, --calibrate), also the predicted step time. Writes CSV and a plot of
// speedup against workers (gnuplot) next to the ideal line.
// This file: the options, the configurations and their predictions; bench_run.cpp measures them
// and bench_output.cpp reports them.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <regex>
#include <sstream>

#include "bench_internal.h"
#include "checks.h"
#include "cli_app.h"
#include "commands.h"
#include "tandem/engine.h"
#include "tandem/pipeline_schedule.h"
#include "tandem/plan.h"
#include "tandem/registry.h"

namespace tandem::cli {
namespace bench_cmd {
namespace {

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

int64_t lcm(int64_t a, int64_t b) {
  int64_t x = a, y = b;
  while (y) {
    int64_t t = x % y;
    x = y;
    y = t;
  }
  return a / x * b;
}

void add_bench_options(CLI::App& app, BenchOptions& o) {
  app.add_option("--model", o.model,
                 "mlp | cnn | cnn_bn, another registered model, or a plugin (path/to/libplugin.so[:NAME]), as for "
                 "tandem train")
      ->capture_default_str();
  app.add_option("--dataset", o.dataset, "registered dataset (default: the model's own, else fashion-mnist)");
  app.add_option("--strategies", o.strategies,
                 "strategies for more than one worker: ddp, zero1, zero2, zero3, and model-parallel layouts tpK, ppK, "
                 "tpKppK (optionally -gpipe, -zeroN); layouts run where they divide the worker count")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("-n,--workers", o.workers, "worker counts (1 runs --strategy single: the speedup reference)")
      ->delimiter(',')
      ->check(whole_between(1, kMaxWorkers))
      ->capture_default_str();
  app.add_option("--batch", o.batch, "global batch (0: the multiple of every worker count nearest 128)")
      ->check(whole_between(0, 1 << 24))
      ->capture_default_str();
  app.add_option("--steps", o.steps, "training steps per run (the median step time is reported)")
      ->capture_default_str();
  app.add_option("--micro-batches", o.micro_batches, "pipeline micro-batches per step (layouts with pp)")
      ->capture_default_str();
  app.add_option("--grad-accum", o.grad_accum,
                 "gradient accumulation of the layouts without a pipeline, the single worker's too (tandem train "
                 "--grad-accum): micro-batches per step and replica")
      ->capture_default_str();
  app.add_option("--pp-partition", o.pp_partition,
                 "where pipelines are cut (tandem train --pp-partition): params | time | the layers per stage")
      ->capture_default_str();
  app.add_option("--reps", o.reps, "repetitions of every run, interleaved (median)")->capture_default_str();
  app.add_flag("--accuracy", o.accuracy, "evaluate test accuracy after the step budget");
  app.add_option("--eval-limit", o.eval_limit, "test samples for --accuracy")->capture_default_str();
  app.add_option("--epoch-samples", o.epoch_samples, "samples per epoch for the time-per-epoch column")
      ->capture_default_str();
  app.add_option("--data", o.data, "dataset directory (IDX files)")->capture_default_str();
  app.add_option("--threads", o.threads, "compute threads per worker (0: cores / workers, as tandem train)")
      ->capture_default_str();
  app.add_option("--csv", o.csv, "CSV output")->capture_default_str();
  app.add_option("--plot", o.plot, "plot output (PNG; needs gnuplot)")->capture_default_str();
  app.add_flag("--no-plot", o.no_plot, "no plot");
  app.add_option("--calibration", o.calibration, "calibration from tandem plan --calibrate: adds predicted step times")
      ->capture_default_str();
  app.add_option("--timeout", o.timeout_s, "seconds a single run may take")->capture_default_str();
  app.add_option("--drift-warn", o.drift_warn,
                 "with --reps >= 2: warn when the single worker's step varies by this many percent or more "
                 "between repetitions (the machine changed speed during the bench)")
      ->check(number_between(0, 1000))
      ->capture_default_str();
  app.add_option("--remeasure", o.remeasure,
                 "with --reps >= 3: a row whose median step is --drift-warn percent or more above its fastest "
                 "repetition (the machine ran slow through most of them) is measured again, one round of all such "
                 "rows at a time, at most this many rounds; every measurement counts in the median, none is dropped "
                 "(0: report such rows as they are)")
      ->check(whole_between(0, 100))
      ->capture_default_str();
  app.add_flag("--predict-only", o.predict_only,
               "print the runs and their predicted step times (needs --calibration's file) without running them");
  app.add_flag("--calibrate", o.calibrate,
               "calibrate this machine (tandem plan --calibrate, this model only) before every repetition and "
               "predict each repetition from its own calibration (median over repetitions); the calibrations "
               "are kept next to the CSV");
}

// Refuses option combinations the runs would fail on, before any of them starts, and fills in
// the default --batch.
void check_bench_options(BenchOptions& o) {
  std::sort(o.workers.begin(), o.workers.end());
  o.workers.erase(std::unique(o.workers.begin(), o.workers.end()), o.workers.end());
  if (o.workers.empty() || o.workers.front() < 1) throw std::invalid_argument("--workers must be positive counts");
  if (o.steps < 2) throw std::invalid_argument("--steps must be at least 2 (the first step is not timed)");
  if (o.reps < 1) throw std::invalid_argument("--reps must be at least 1");
  if (o.calibrate && o.predict_only)
    throw std::invalid_argument("--predict-only predicts from an existing calibration without running anything; "
                                "drop --calibrate (or --predict-only to measure and calibrate)");
  if (o.calibrate && o.model != "mlp" && o.model != "cnn" && o.model != "cnn_bn")
    throw std::invalid_argument("--calibrate: the calibration runs the built-in models mlp, cnn and cnn_bn, not '" +
                                o.model + "'");
  if (!o.predict_only && o.dataset == "fashion-mnist" && !std::filesystem::is_directory(o.data))
    throw std::invalid_argument("dataset directory '" + o.data +
                                "' not found; install dataset-fashion-mnist or pass --data DIR");
  int64_t step_multiple = 1;
  for (int n : o.workers) step_multiple = lcm(step_multiple, n);
  if (o.batch == 0) o.batch = std::max<int64_t>(1, (128 + step_multiple / 2) / step_multiple) * step_multiple;
  if (o.batch % step_multiple != 0)
    throw std::invalid_argument("--batch " + std::to_string(o.batch) +
                                " does not split evenly over every worker count; use a multiple of " +
                                std::to_string(step_multiple));

  if (o.micro_batches < 1) throw std::invalid_argument("--micro-batches must be at least 1");
  if (o.grad_accum < 1) throw std::invalid_argument("--grad-accum must be at least 1");
  if (o.batch % o.grad_accum != 0)
    throw std::invalid_argument("--batch " + std::to_string(o.batch) + " does not split into --grad-accum " +
                                std::to_string(o.grad_accum) + " micro-batches on one worker");
}

// The runs: one worker with `single` (always: the reference), then every strategy for n > 1;
// a model-parallel layout where tp*pp divides n (and leaves replicas to shard for ZeRO).
std::vector<Row> bench_rows(const BenchOptions& o) {
  const int64_t batch = o.batch, micro_batches = o.micro_batches, grad_accum = o.grad_accum;
  std::vector<Row> rows;
  rows.push_back({1, "single", parse_layout("single")});
  for (int n : o.workers) {
    if (n == 1) continue;
    for (const auto& s : o.strategies) {
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
      if (r.layout.pp > 1)
        (void)parse_partition_option(o.pp_partition, r.layout.pp);  // as tandem train would refuse it
      if (r.layout.pp == 1 && (batch / dp) % grad_accum != 0)
        throw std::invalid_argument("--batch " + std::to_string(batch) + " over " + std::to_string(dp) +
                                    " replica(s) does not split into --grad-accum " + std::to_string(grad_accum));
      rows.push_back(r);
    }
  }
  return rows;
}

}  // namespace

// Predictions from a calibration: the file given, or with --calibrate one measured before
// every repetition.
void predict_rows(const BenchOptions& o, const plan::Calibration& cal, std::vector<Row>& rows) {
  plan::ModelSpec m = plan::builtin_model(o.model);
  plan::ClusterSpec c = plan::cluster_preset("local");
  if (cal.memory_bandwidth > 0) c.groups[0].device.memory_bandwidth = cal.memory_bandwidth;
  plan::PlanOptions po;
  po.optimizer = "sgd";
  po.precision = "fp32";
  po.global_batch = o.batch;
  po.calibration = &cal;
  for (auto& r : rows) {
    plan::Layout l;
    l.tp = r.layout.tp;
    l.pp = r.layout.pp;
    l.dp = r.workers / (l.tp * l.pp);
    l.zero = zero_stage(parse_strategy(r.layout.base));
    l.micro_batches = l.pp > 1 ? o.micro_batches : o.grad_accum;
    l.micro_batch = o.batch / l.dp / l.micro_batches;
    po.pipeline_schedule = parse_pipeline_schedule(r.layout.schedule);
    po.pipeline_partition = o.pp_partition;
    plan::Estimate e = plan::estimate(m, c, l, po);
    r.predicted_ms = e.feasible ? e.step_s * 1e3 : 0.0;
    r.caveat = e.caveat;
  }
}

plan::Calibration read_calibration(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return plan::calibration_from_json(ss.str());
}

}  // namespace bench_cmd

int cmd_bench(int argc, char** argv) {
  using namespace bench_cmd;
  CLI::App app{"Speedup table of a model over strategies and worker counts (runs tandem train for each), "
               "with CSV and a plot.",
               "tandem bench"};
  BenchOptions o;
  add_bench_options(app, o);
  app.footer(examples_footer({
      {"the CNN under DDP, ZeRO and model-parallel layouts on 1, 2 and 4 workers, 3 repetitions",
       {"tandem bench --model cnn --strategies ddp,zero1,zero2,tp2,pp2 -n 1,2,4 --reps 3"}},
      {"predicted step times only, from this machine's calibration",
       {"tandem plan --calibrate", "tandem bench --predict-only -n 1,2,4"}},
  }));
  if (auto rc = parse_command_line(app, argc, argv)) return *rc;
  // `model` becomes the registered name; the runs get the option as given, and load the plugin.
  o.model_option = o.model;
  load_plugins_from_model_option(o.model);
  if (o.dataset.empty()) o.dataset = default_dataset_for(o.model);
  (void)dataset_info(o.dataset);
  check_bench_options(o);
  std::vector<Row> rows = bench_rows(o);

  bool have_cal = o.calibrate;
  const auto planned = plan::builtin_model_names();
  const bool plannable = std::find(planned.begin(), planned.end(), o.model) != planned.end();
  if (!o.calibrate && plannable && std::ifstream(o.calibration)) {
    predict_rows(o, read_calibration(o.calibration), rows);
    have_cal = true;
  }

  if (o.predict_only) {
    if (!plannable)
      throw std::invalid_argument("--predict-only: the planner describes its built-in models (" +
                                  std::to_string(planned.size()) + " of them, see tandem plan), not '" + o.model + "'");
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
  if (!std::ofstream(o.csv, std::ios::app))
    throw std::invalid_argument("cannot write the CSV '" + o.csv + "'; pass --csv with a writable path");
  if (!measure_rows(o, rows)) return 1;
  write_table(o, rows, have_cal);
  print_notes(o, rows, have_cal);
  if (!o.no_plot) write_plot(o, rows);
  return 0;
}

}  // namespace tandem::cli
