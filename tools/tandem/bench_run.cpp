// `tandem bench`, running the configurations: each row as a `tandem train` child process, --reps
// rounds interleaved (with --calibrate, a `tandem plan --calibrate` before each), the unsteady rows
// measured again, and the CPU time the hypervisor stole during each measurement.
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "bench_internal.h"
#include "commands.h"
#include "tandem/launcher.h"
#include "tandem/plan.h"

namespace tandem::cli::bench_cmd {
namespace {

namespace fs = std::filesystem;

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

// What every run of one bench shares: the options, this executable and a private scratch
// directory. cleanup() removes the directory once the rows are measured, or when a run fails (POSIX
// calls: std::filesystem::remove_all resolves to a copy inside libtorch.so that crashes here).
struct Scratch {
  const BenchOptions& o;
  std::string self;
  fs::path tmp;

  void cleanup() const {
    ::unlink((tmp / "metrics.jsonl").c_str());
    ::unlink((tmp / "calibration.json").c_str());
    ::unlink((tmp / "log.txt").c_str());
    ::rmdir(tmp.c_str());
  }
};

std::vector<std::string> train_args(const Scratch& s, const Row& r, const std::string& metrics) {
  const BenchOptions& o = s.o;
  std::vector<std::string> args = {s.self,
                                   "train",
                                   "--model",
                                   o.model_option,
                                   "--dataset",
                                   o.dataset,
                                   "--strategy",
                                   r.layout.base,
                                   "-n",
                                   std::to_string(r.workers),
                                   "--batch",
                                   std::to_string(o.batch),
                                   "--max-steps",
                                   std::to_string(o.steps),
                                   "--no-baseline",
                                   "--no-progress",
                                   "--metrics",
                                   metrics,
                                   "--data",
                                   o.data,
                                   "--timeout",
                                   fixed(o.timeout_s, 0),
                                   "--schedule",
                                   "constant"};
  if (o.threads > 0) args.insert(args.end(), {"--threads", std::to_string(o.threads)});
  if (r.layout.tp > 1) args.insert(args.end(), {"--tp", std::to_string(r.layout.tp)});
  if (r.layout.pp == 1 && o.grad_accum > 1) args.insert(args.end(), {"--grad-accum", std::to_string(o.grad_accum)});
  if (r.layout.pp > 1) {
    args.insert(args.end(), {"--pp", std::to_string(r.layout.pp), "--micro-batches", std::to_string(o.micro_batches),
                             "--pipeline-schedule", r.layout.schedule, "--pp-partition", o.pp_partition});
  }
  if (o.accuracy) {
    args.insert(args.end(), {"--eval-limit", std::to_string(o.eval_limit)});
  } else {
    args.push_back("--no-eval");
  }
  return args;
}

// One measurement of a row: a `tandem train` run; false (after cleaning up) when it failed.
bool measure(const Scratch& s, Row& r, const std::string& label) {
  const std::string metrics = (s.tmp / "metrics.jsonl").string(), log = (s.tmp / "log.txt").string();
  const std::vector<std::string> args = train_args(s, r, metrics);
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
    s.cleanup();
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
    s.cleanup();
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
  if (s.o.accuracy) r.accuracy.push_back(rep_json.value("test_accuracy", -1.0));
  const double stolen = stolen_between(c0, c1);
  r.steal.push_back(stolen);
  std::cout << fixed(ms, 1) << " ms/step";
  if (stolen >= 0.01) std::cout << " (" << fixed(stolen * 100, 0) << " % of the CPU time stolen)";
  std::cout << std::endl;
  return true;
}

// --calibrate: calibrates this machine before repetition `rep` and predicts every row from it,
// keeping the calibration next to the CSV; false (after cleaning up) when the calibration failed.
bool calibrate_round(const Scratch& s, std::vector<Row>& rows, int rep, const std::string& cal_workers) {
  const BenchOptions& o = s.o;
  // Minutes, not hours, between a calibration and the runs it predicts: a shared virtual
  // machine's speed can change mode for minutes at a time (docs/BENCHMARKS.md, "Planning").
  const std::string cal_path = (s.tmp / "calibration.json").string(), log = (s.tmp / "log.txt").string();
  std::vector<std::string> args = {s.self,
                                   "plan",
                                   "--calibrate",
                                   "--cluster",
                                   "local",
                                   "--model",
                                   o.model,
                                   "--calibrate-models",
                                   o.model,
                                   "--calibrate-batch",
                                   std::to_string(o.batch),
                                   "--batch",
                                   std::to_string(o.batch),
                                   "--calibration",
                                   cal_path,
                                   "--top",
                                   "0",
                                   "--show-infeasible",
                                   "0"};
  if (!cal_workers.empty()) args.insert(args.end(), {"--calibrate-workers", cal_workers});
  std::cout << "  [" << rep + 1 << "/" << o.reps << "] calibrating... " << std::flush;
  const auto t0 = std::chrono::steady_clock::now();
  const CpuClock c0 = read_cpu_clock();
  int rc = run_logged(args, log);
  const double cal_stolen = stolen_between(c0, read_cpu_clock());
  if (rc != 0) {
    std::cout << "failed\n";
    std::cerr << "tandem bench: `tandem plan --calibrate` exited with " << rc << "; its last lines:\n"
              << tail_of(log, 15);
    s.cleanup();
    return false;
  }
  predict_rows(o, read_calibration(cal_path), rows);
  for (auto& r : rows) r.predicted_rounds.push_back(r.predicted_ms);
  fs::path keep = fs::path(o.csv).replace_extension("");
  keep += ".calibration-" + std::to_string(rep + 1) + ".json";
  {
    std::ifstream in(cal_path);
    std::ofstream out(keep);
    out << in.rdbuf();
    if (!out) {
      s.cleanup();
      throw std::runtime_error("cannot write the calibration to '" + keep.string() + "'");
    }
  }
  std::cout << fixed(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0) << " s, kept in "
            << keep.string();
  if (cal_stolen >= 0.01) std::cout << " (" << fixed(cal_stolen * 100, 0) << " % of the CPU time stolen)";
  std::cout << std::endl;
  return true;
}

}  // namespace

int run_logged(const std::vector<std::string>& argv, const std::string& log) {
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      ::close(fd);
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

bool measure_rows(const BenchOptions& o, std::vector<Row>& rows) {
  const std::string self = self_executable();
  std::string tmpl = "/tmp/tandem-bench-XXXXXX";
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("cannot create a directory under /tmp");
  const Scratch s{o, self, tmpl};
  std::cout << "tandem bench: " << o.model << ", global batch " << o.batch << ", " << o.steps << " steps per run, "
            << o.reps << " repetition(s), " << rows.size() << " configurations"
            << (o.pp_partition == "params" ? "" : ", pipelines cut by " + o.pp_partition)
            << (o.grad_accum > 1 ? ", gradient accumulation " + std::to_string(o.grad_accum) : "") << std::endl;
  std::string cal_workers;
  for (int n : o.workers)
    if (n > 1) cal_workers += (cal_workers.empty() ? "" : ",") + std::to_string(n);
  for (int rep = 0; rep < o.reps; ++rep) {
    if (o.calibrate && !calibrate_round(s, rows, rep, cal_workers)) return false;
    for (auto& r : rows)
      if (!measure(s, r, std::to_string(rep + 1) + "/" + std::to_string(o.reps))) return false;
  }
  // Rows measured while the machine ran slow through most repetitions: measured again, a round
  // of all of them at a time (minutes apart from the first measurements, not back to back), and
  // every measurement kept. A machine that stays slow leaves them unsteady, and the table says so.
  if (o.reps >= 3) {
    for (int round = 1; round <= o.remeasure; ++round) {
      std::vector<Row*> unsteady_rows;
      for (auto& r : rows)
        if (unsteady(r, o.drift_warn)) unsteady_rows.push_back(&r);
      if (unsteady_rows.empty()) break;
      if (round == 1)
        std::cout << "  " << unsteady_rows.size() << " row(s) with a median step " << fixed(o.drift_warn, 0)
                  << " % or more above their fastest repetition: measured again (--remeasure " << o.remeasure << ")"
                  << std::endl;
      for (Row* r : unsteady_rows)
        if (!measure(s, *r, "+" + std::to_string(round) + "/" + std::to_string(o.remeasure))) return false;
    }
  }
  s.cleanup();
  if (o.calibrate)
    for (auto& r : rows) {
      bool all = std::all_of(r.predicted_rounds.begin(), r.predicted_rounds.end(), [](double v) { return v > 0; });
      r.predicted_ms = all ? median(r.predicted_rounds) : 0.0;
    }
  return true;
}

}  // namespace tandem::cli::bench_cmd
