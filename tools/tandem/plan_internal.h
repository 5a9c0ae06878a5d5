// What the files of `tandem plan` share: its flags as parsed, the calibration steps and the
// printed or JSON result. Private to tools/tandem/.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/plan.h"

namespace tandem::cli::plan_cmd {

// The flags of `tandem plan`, as parsed; cmd_plan turns them into the cluster, model and plan
// options. A cluster or model number left at its initial value (-1 or 0) keeps the preset's.
struct PlanFlags {
  std::string model_name, cluster_name = "local", device_name, intra_name, inter_name, mixed;
  double params = 0, flops_per_sample = 0, act_bytes = 0;
  int64_t lora_rank = 0;  // LoRA adapters of this rank on q, k, v, o of every layer (transformers)
  bool attention_scores = false, dropout = false;
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, seq = 0, vocab = 0;
  // MoE: experts and their width describe a custom model; top-k and the capacity factor apply
  // to a MoE preset too (-1: the preset's).
  int64_t experts = 0, expert_intermediate = 0, top_k = -1;
  double capacity_factor = -1;
  int nodes = -1, per_node = -1;
  double memory_gb = -1, tflops = 0, tflops_fp32 = 0, mfu = 0, mem_bw_gbps = 0;
  double intra_gbps = 0, intra_lat_us = -1, inter_gbps = 0, inter_lat_us = -1, overlap = -1, overhead_ms = -1;
  plan::PlanOptions o;  // the flags that are plan options as they stand; the rest is filled in from the cluster
  std::vector<int> zero = {0, 1, 2, 3};
  std::vector<double> bucket_mb = {25};
  std::vector<int> workers;
  int top = 10, show_infeasible = 10;
  std::string json_path, calibration_path = "tandem-calibration.json", calib_out;
  bool calibrate = false, calibrate_worker = false;
  std::vector<int> calib_workers;
  std::vector<std::string> calib_models;
  int64_t calib_batch = 128;
};

// plan_calibrate.cpp: the built-in models --calibrate measures (--calibrate-models, else the
// defaults), refused unless the calibration can run each.
std::vector<std::string> calibration_models(const PlanFlags& f);
// --calibrate-worker: one rank of the collective calibration; returns the exit code.
int calibration_worker(const PlanFlags& f, const std::vector<std::string>& models);
// --calibrate: measures this machine into `cal` and writes it to --calibration; returns the exit
// code (1 when a collective calibration failed).
int calibrate_machine(const PlanFlags& f, const plan::ClusterSpec& c, const std::vector<std::string>& models,
                      plan::Calibration& cal);
// Reads a saved calibration into `cal`; false (and `cal` untouched) when there is no such file.
bool read_saved_calibration(const std::string& path, plan::Calibration& cal);

// plan_output.cpp: the result as JSON to `path` ('-': stdout), the setting above the table, and
// the ranked feasible layouts with the infeasible ones and why.
void write_plan_json(const std::string& path, const plan::ModelSpec& m, const plan::ClusterSpec& c,
                     const plan::PlanOptions& o, bool calibrated, const std::vector<plan::Estimate>& results);
void print_setting(const plan::ModelSpec& m, const plan::ClusterSpec& c, const plan::PlanOptions& o, bool calibrated,
                   const plan::Calibration& cal, const std::string& calibration_path);
void print_ranking(const std::vector<plan::Estimate>& results, int top, int show_infeasible);

}  // namespace tandem::cli::plan_cmd
