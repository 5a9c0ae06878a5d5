// What the files of `tandem bench` share: its options, the configurations it runs (a row each)
// and the functions that predict, measure and report them. Private to tools/tandem/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace tandem::plan {
struct Calibration;
}

namespace tandem::cli::bench_cmd {

// The flags of `tandem bench`, as parsed; cmd_bench validates them and fills in --batch.
struct BenchOptions {
  std::string model = "cnn", data = "/usr/share/datasets/fashion-mnist", csv = "bench.csv", plot = "bench.png";
  std::string model_option;  // --model as given: the runs load its plugin themselves; `model` is the registered name
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
  double drift_warn = 15.0;
  int remeasure = 2;
  bool predict_only = false, calibrate = false;
};

// A --strategies entry: ddp | zero1..3, or a model-parallel layout tpK, ppK or tpKppK with an
// optional -gpipe/-1f1b schedule and -ddp/-zeroN for the data-parallel replicas (dp = workers / (tp*pp)).
struct Layout {
  std::string base = "ddp", schedule = "1f1b";
  int tp = 1, pp = 1;
};

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

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// How far the median measurement sits above the fastest one (0.15: 15 % slower). Small when the
// machine ran at one speed through the repetitions, or slowed down for one of them (the median
// absorbs that); large when it ran slow for most of them, so the median measured the slowdown.
inline double unsteadiness(const std::vector<double>& v) {
  if (v.size() < 3) return 0.0;
  const double lo = *std::min_element(v.begin(), v.end());
  return lo > 0 ? median(v) / lo - 1.0 : 0.0;
}

// A row whose median step sits --drift-warn percent or more above its fastest measurement.
inline bool unsteady(const Row& r, double drift_warn) { return unsteadiness(r.step_ms) * 100.0 >= drift_warn; }

// cmd_bench.cpp: each row's predicted step time (0 where the plan finds the layout infeasible).
void predict_rows(const BenchOptions& o, const plan::Calibration& cal, std::vector<Row>& rows);
plan::Calibration read_calibration(const std::string& path);

// bench_run.cpp: runs argv with stdout and stderr to `log`; returns the exit status (128+signal when killed).
int run_logged(const std::vector<std::string>& argv, const std::string& log);
// The last `lines` lines of a file, indented, for a failure message.
std::string tail_of(const std::string& path, size_t lines);
// Measures every row --reps times, interleaved (with --calibrate, a calibration before each
// round), then remeasures unsteady rows; false after a run that failed (and was reported).
bool measure_rows(const BenchOptions& o, std::vector<Row>& rows);

// bench_output.cpp: the table on stdout and the CSV, the notes under them, and the plot.
void write_table(const BenchOptions& o, const std::vector<Row>& rows, bool have_cal);
void print_notes(const BenchOptions& o, const std::vector<Row>& rows, bool have_cal);
void write_plot(const BenchOptions& o, const std::vector<Row>& rows);

}  // namespace tandem::cli::bench_cmd
