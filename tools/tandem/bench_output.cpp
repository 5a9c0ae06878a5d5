// `tandem bench`, reporting the measured rows: the table on stdout and the same figures in the
// CSV, the notes on unsteady machines and predictions, and the gnuplot plot of speedup.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "bench_internal.h"
#include "commands.h"

namespace tandem::cli::bench_cmd {
namespace {

bool have_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(ss, dir, ':');) {
    if (!dir.empty() && access((dir + "/" + name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

}  // namespace

void write_table(const BenchOptions& o, const std::vector<Row>& rows, bool have_cal) {
  const int64_t batch = o.batch;
  const double base_ms = median(rows.front().step_ms);
  std::ofstream out(o.csv);
  if (!out) throw std::runtime_error("cannot write '" + o.csv + "'");
  out << "model,workers,strategy,global_batch,steps,reps,step_ms,samples_per_s,epoch_s,speedup,efficiency,"
         "comm_share,peak_mib,accuracy,predicted_ms,prediction_error,predicted_ms_per_rep,step_ms_per_rep,"
         "measurements,spread,steal_share\n";
  std::cout << "\n"
            << std::right << std::setw(7) << "workers" << std::setw(13) << "strategy" << std::setw(10) << "samples/s"
            << std::setw(9) << "step ms" << std::setw(9) << "epoch s" << std::setw(9) << "speedup" << std::setw(7)
            << "eff." << std::setw(7) << "comm" << std::setw(10) << "peak MiB";
  const bool show_spread = o.reps >= 3;
  if (show_spread) std::cout << std::setw(8) << "spread";
  if (o.accuracy) std::cout << std::setw(9) << "accuracy";
  if (have_cal) std::cout << std::setw(11) << "predicted" << std::setw(7) << "error";
  std::cout << "\n";
  for (const auto& r : rows) {
    const double ms = median(r.step_ms);
    const double sps = batch * 1000.0 / ms;
    const double speedup = base_ms / ms;
    const double eff = speedup / r.workers;
    const double share = median(r.exposed_share);
    const double peak = median(r.peak_mib);
    const double acc = o.accuracy ? median(r.accuracy) : -1;
    const double err = r.predicted_ms > 0 ? (r.predicted_ms - ms) / ms : 0.0;
    std::cout << std::setw(7) << r.workers << std::setw(13) << r.strategy << std::setw(10) << fixed(sps, 0)
              << std::setw(9) << fixed(ms, 1) << std::setw(9) << fixed(o.epoch_samples / sps, 1) << std::setw(8)
              << fixed(speedup, 2) << "x" << std::setw(6) << fixed(eff * 100, 0) << "%" << std::setw(7)
              << (share >= 0 ? fixed(share * 100, 0) + "%" : std::string("-")) << std::setw(10) << fixed(peak, 0);
    const double spread = unsteadiness(r.step_ms);
    if (show_spread) std::cout << std::setw(7) << fixed(spread * 100, 0) << (unsteady(r, o.drift_warn) ? "%*" : "% ");
    if (o.accuracy) std::cout << std::setw(8) << (acc >= 0 ? fixed(acc * 100, 2) : std::string("-")) << "%";
    if (have_cal) {
      std::cout << std::setw(11) << (r.predicted_ms > 0 ? fixed(r.predicted_ms, 1) : std::string("-")) << std::setw(6)
                << (r.predicted_ms > 0 ? fixed(err * 100, 0) + "%" : std::string("-"));
    }
    std::cout << "\n";
    out << o.model << "," << r.workers << "," << r.strategy << "," << batch << "," << o.steps << "," << o.reps << ","
        << fixed(ms, 3) << "," << fixed(sps, 2) << "," << fixed(o.epoch_samples / sps, 3) << "," << fixed(speedup, 4)
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
}

void print_notes(const BenchOptions& o, const std::vector<Row>& rows, bool have_cal) {
  const bool show_spread = o.reps >= 3;
  // The same single-worker run, repeated: on a machine that changes speed (a shared guest, a
  // throttled laptop) its spread is the noise that every row's median and prediction carry.
  if (o.reps >= 2) {
    const auto& single = rows.front().step_ms;
    const auto [lo, hi] = std::minmax_element(single.begin(), single.end());
    const double spread = *lo > 0 ? (*hi / *lo - 1.0) * 100.0 : 0.0;
    if (spread >= o.drift_warn) {
      std::cout << "note: the single worker's step varied by " << fixed(spread, 0) << " % over the " << single.size()
                << (static_cast<int>(single.size()) > o.reps ? " measurements (" : " repetitions (");
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
      if (unsteady(r, o.drift_warn))
        list += (list.empty() ? "" : ", ") + r.strategy + " on " + std::to_string(r.workers) + " (" +
                std::to_string(r.step_ms.size()) + " measurements)";
    if (!list.empty())
      std::cout << "note: unsteady (*): the median step stayed " << fixed(o.drift_warn, 0)
                << " % or more above the fastest measurement for " << list
                << ": the machine ran slower than it can through most of them, so these medians measured the "
                   "machine's slowdown as much as the configuration; rerun them on a quiet machine"
                << (o.remeasure > 0 ? "" : " or with --remeasure") << "\n";
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
            << o.csv << "\n";
}

// The plot: speedup against workers, one line per strategy, and the ideal line. Without gnuplot,
// or when it fails, says so and leaves the CSV as the result.
void write_plot(const BenchOptions& o, const std::vector<Row>& rows) {
  const std::string& plot = o.plot;
  if (!have_program("gnuplot")) {
    std::cout << "no plot: gnuplot is not installed (apt-get install gnuplot-nox; scripts/setup.sh installs it); "
                 "the CSV has the data\n";
    return;
  }
  const double base_ms = median(rows.front().step_ms);
  const std::string script = plot + ".gp", dat = plot + ".dat";
  {
    // One data block per strategy (workers, speedup), starting at the 1-worker reference.
    std::ofstream d(dat);
    std::ofstream g(script);
    int maxw = o.workers.back();
    g << "set terminal pngcairo size 800,560\nset output '" << plot << "'\n"
      << "set title '" << o.model << ": speedup over 1 worker (global batch " << o.batch << ")'\n"
      << "set xlabel 'workers'\nset ylabel 'speedup'\nset key left top\nset grid\n"
      << "set xrange [1:" << maxw << "]\nset yrange [0:" << maxw << "]\nset xtics 1\n";
    g << "plot x title 'ideal' with lines dashtype 2 lc rgb '#888888'";
    int block = 0;
    for (const auto& s : o.strategies) {
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
    return;
  }
  ::unlink((plot + ".log").c_str());
  std::cout << "plot written to " << plot << " (gnuplot script " << script << ")\n";
}

}  // namespace tandem::cli::bench_cmd
