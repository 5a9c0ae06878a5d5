// `tandem plan --calibrate`: measures this machine's compute in this process and its collectives
// on 2..N workers (each a `tandem plan --calibrate-worker` rank under the launcher), merges them
// into one calibration file; and reads a saved one back.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "plan_internal.h"
#include "tandem/launcher.h"
#include "tandem/plan.h"
#include "tandem/runtime.h"

namespace tandem::cli::plan_cmd {

using namespace tandem::plan;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::invalid_argument("cannot read '" + path + "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string comma_list(const std::vector<std::string>& names) {
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "" : ",") + n;
  return list;
}

// Folds the collective calibration on n workers into `cal`.
void merge_collectives(Calibration& cal, const Calibration& part, int n) {
  for (auto& [k, v] : part.collectives) cal.collectives[k] = v;
  for (auto& [k, v] : part.collective_times) cal.collective_times[k] = v;
  for (auto& [k, v] : part.p2p) cal.p2p[k] = v;
  for (auto& [k, v] : part.send_delay) cal.send_delay[k] = v;
  // The concurrent compute rate is a property of all cores busy: take it from n == cores.
  for (auto& [name, r] : part.models) {
    if (n == cal.cores || (n == 2 && cal.cores < 2)) cal.models[name].flops_concurrent = r.flops_concurrent;
    for (auto& [k, v] : r.flops_synchronized) cal.models[name].flops_synchronized[k] = v;
    for (auto& [k, v] : r.flops_while_waiting) cal.models[name].flops_while_waiting[k] = v;
    for (auto& [k, v] : r.sync_point_s) cal.models[name].sync_point_s[k] = v;
    for (auto& [k, v] : r.tp_synchronized) cal.models[name].tp_synchronized[k] = v;
  }
}

}  // namespace

std::vector<std::string> calibration_models(const PlanFlags& f) {
  std::vector<std::string> cal_models = f.calib_models;
  if (cal_models.empty()) {
    for (const auto& n : {"mlp", "cnn", "cnn_bn"}) cal_models.push_back(n);
    if (!f.model_name.empty() && f.model_name == "transformer_tiny") cal_models.push_back(f.model_name);
  }
  for (const auto& n : cal_models) {
    if (n != "mlp" && n != "cnn" && n != "cnn_bn" && n != "transformer_tiny")
      throw std::invalid_argument("--calibrate-models: '" + n +
                                  "' is not a model the calibration can run (mlp, cnn, cnn_bn, transformer_tiny)");
  }
  return cal_models;
}

int calibration_worker(const PlanFlags& f, const std::vector<std::string>& models) {
  RuntimeOptions ro;
  ro.threads = 1;
  ro.device = "cpu";
  Runtime rt(ro);
  Calibration cal;
  if (!f.calibration_path.empty()) {
    std::ifstream in(f.calibration_path);
    if (in) cal = calibration_from_json(read_file(f.calibration_path));
  }
  calibrate_collectives(rt, cal, models, f.calib_batch);
  if (rt.rank() == 0) {
    std::ofstream out(f.calib_out);
    out << calibration_to_json(cal) << "\n";
    if (!out) throw std::runtime_error("cannot write '" + f.calib_out + "'");
  }
  return 0;
}

int calibrate_machine(const PlanFlags& f, const ClusterSpec& c, const std::vector<std::string>& models,
                      Calibration& cal) {
  if (!c.cpu) throw std::invalid_argument("--calibrate measures this machine: use it with --cluster local");
  const std::string& calibration_path = f.calibration_path;
  const std::string models_list = comma_list(models);
  std::vector<int> calib_workers = f.calib_workers;
  if (calib_workers.empty()) {
    int most = std::max(4, static_cast<int>(std::thread::hardware_concurrency()));
    for (int n = 2; n <= most; ++n) calib_workers.push_back(n);
  }
  std::cout << "calibrating compute (" << models_list << ": one thread and all cores)..." << std::endl;
  calibrate_compute(cal, models, f.calib_batch);
  {
    std::ofstream file(calibration_path);
    file << calibration_to_json(cal) << "\n";
    if (!file) throw std::runtime_error("cannot write the calibration to '" + calibration_path + "'");
  }
  for (int n : calib_workers) {
    std::cout << "calibrating collectives on " << n << " workers..." << std::endl;
    std::string out = calibration_path + ".n" + std::to_string(n);
    LaunchOptions lo;
    lo.nprocs = n;
    int rc = launch(lo, {self_executable(), "plan", "--calibrate-worker", "--calibration", calibration_path,
                         "--calibrate-out", out, "--calibrate-batch", std::to_string(f.calib_batch),
                         "--calibrate-models", models_list});
    if (rc != 0) {
      std::cerr << "tandem plan: the collective calibration on " << n << " workers failed (exit " << rc << ")\n";
      return 1;
    }
    merge_collectives(cal, calibration_from_json(read_file(out)), n);
    std::remove(out.c_str());
  }
  std::ofstream file(calibration_path);
  file << calibration_to_json(cal) << "\n";
  if (!file) throw std::runtime_error("cannot write the calibration to '" + calibration_path + "'");
  std::cout << "calibration written to " << calibration_path << "\n";
  return 0;
}

bool read_saved_calibration(const std::string& path, Calibration& cal) {
  std::ifstream f(path);
  if (!f) return false;
  cal = calibration_from_json(read_file(path));
  return true;
}

}  // namespace tandem::cli::plan_cmd
