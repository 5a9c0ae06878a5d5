// `tandem plan`: predicts memory per device and step time for every data x tensor x pipeline
// layout and ZeRO stage of a model on a cluster (tandem/plan.h), ranks the feasible ones and
// says why the others do not fit. `--calibrate` measures this machine first (compute in this
// process, collectives on 2..N workers launched through mpirun) and saves the constants.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

#include "commands.h"
#include "tandem/launcher.h"
#include "tandem/plan.h"
#include "tandem/runtime.h"

namespace tandem::cli {
namespace {

using namespace tandem::plan;

std::string human_bytes(double b) {
  if (b >= 1e9) return fixed(b / 1e9, 1) + " GB";
  if (b >= 1e6) return fixed(b / 1e6, 1) + " MB";
  return fixed(b / 1e3, 1) + " kB";
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::invalid_argument("cannot read '" + path + "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// "2xh100,2xa100-80g" or "2xh100:8,1xa100:4": NODES x DEVICE [: DEVICES PER NODE].
std::vector<NodeGroup> parse_groups(const std::string& text, int default_per_node) {
  std::vector<NodeGroup> groups;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto x = item.find('x');
    if (x == std::string::npos || x == 0)
      throw std::invalid_argument("--mixed '" + item + "': expected NODESxDEVICE[:PER_NODE], e.g. 2xh100:8");
    NodeGroup g;
    try {
      g.nodes = std::stoi(item.substr(0, x));
    } catch (...) {
      throw std::invalid_argument("--mixed '" + item + "': the node count is not a number");
    }
    std::string dev = item.substr(x + 1);
    g.devices_per_node = default_per_node;
    if (auto colon = dev.find(':'); colon != std::string::npos) {
      g.devices_per_node = std::stoi(dev.substr(colon + 1));
      dev = dev.substr(0, colon);
    }
    g.device = device_preset(dev);
    groups.push_back(g);
  }
  if (groups.empty()) throw std::invalid_argument("--mixed: no node groups given");
  return groups;
}

// The layout, and for a pipeline the cut (layers per stage) to give tandem train --pp-partition.
std::string layout_label(const Estimate& e) {
  std::string s = e.layout.strategy_name();
  if (e.layout.pp > 1 && !e.partition.empty()) {
    s += " cut ";
    for (size_t i = 0; i < e.partition.size(); ++i) s += (i ? "/" : "") + std::to_string(e.partition[i]);
  }
  return s;
}

nlohmann::json to_json(const Estimate& e) {
  nlohmann::json j = {{"layout", e.layout.strategy_name()},
                      {"partition", e.partition},
                      {"dp", e.layout.dp},
                      {"tp", e.layout.tp},
                      {"pp", e.layout.pp},
                      {"zero", e.layout.zero},
                      {"micro_batch", e.layout.micro_batch},
                      {"micro_batches", e.layout.micro_batches},
                      {"bucket_bytes", e.layout.bucket_bytes},
                      {"feasible", e.feasible},
                      {"memory_bytes",
                       {{"parameters", e.memory.parameters},
                        {"gradients", e.memory.gradients},
                        {"optimizer", e.memory.optimizer},
                        {"activations", e.memory.activations},
                        {"total", e.memory.total()}}}};
  if (e.feasible) {
    j["step_seconds"] = e.step_s;
    j["samples_per_second"] = e.samples_per_s;
    j["efficiency"] = e.efficiency;
    j["compute_seconds"] = e.compute_s;
    j["optimizer_seconds"] = e.optimizer_s;
    j["comm_seconds"] = e.comm_s;
    j["exposed_comm_seconds"] = e.exposed_comm_s;
    j["bubble_seconds"] = e.bubble_s;
    j["comm_parts"] = e.comm_parts;
    if (!e.caveat.empty()) j["caveat"] = e.caveat;
  } else {
    j["why"] = e.why;
  }
  return j;
}

}  // namespace

int cmd_plan(int argc, char** argv) {
  CLI::App app{"Predict memory per device and step time of every parallel layout of a model on a cluster, "
               "ranked; say why the others do not fit.",
               "tandem plan"};
  std::string model_name, cluster_name = "local", device_name, intra_name, inter_name, mixed;
  double params = 0, flops_per_sample = 0, act_bytes = 0;
  bool attention_scores = false, dropout = false;
  int64_t layers = 0, hidden = 0, heads = 0, seq = 0, vocab = 0;
  int nodes = -1, per_node = -1;
  double memory_gb = -1, tflops = 0, tflops_fp32 = 0, mfu = 0, mem_bw_gbps = 0;
  double intra_gbps = 0, intra_lat_us = -1, inter_gbps = 0, inter_lat_us = -1, overlap = -1, overhead_ms = -1;
  PlanOptions o;
  o.optimizer.clear();
  o.precision.clear();
  std::vector<int> zero = {0, 1, 2, 3};
  std::vector<double> bucket_mb = {25};
  std::vector<int> workers;
  int top = 10, show_infeasible = 10;
  std::string json_path, calibration_path = "tandem-calibration.json", calib_out;
  bool calibrate = false, calibrate_worker = false, use_calibration = false;
  std::vector<int> calib_workers;
  std::vector<std::string> calib_models;
  int64_t calib_batch = 128;

  app.add_option("--model", model_name, "built-in model (mlp, cnn, transformer_tiny, resnet50, gpt2, llama-7b, ...)");
  app.add_option("--params", params, "custom model: parameters (e.g. 7.5e9)");
  app.add_option("--layers", layers, "custom model: layers (blocks)");
  app.add_option("--hidden", hidden, "custom model: hidden size");
  app.add_option("--heads", heads, "custom model: attention heads (0: not a transformer)");
  app.add_option("--seq", seq, "custom model: sequence length (tokens per sample)");
  app.add_option("--vocab", vocab, "custom model: vocabulary size");
  app.add_option("--flops-per-sample", flops_per_sample, "forward FLOPs per sample (default: from the shape)");
  app.add_option("--activation-bytes", act_bytes, "activation bytes per sample kept for backward (float32)");
  app.add_flag("--attention-scores", attention_scores,
               "transformer: backward keeps the seq x seq attention scores (unfused attention; Tandem's "
               "models use fused scaled_dot_product_attention, which keeps none)");
  app.add_flag("--dropout", dropout, "transformer: dropout masks are kept for backward (Tandem's models have none)");
  app.add_option("--cluster", cluster_name,
                 "cluster preset: local, h200x8, h100-ib, a100-ib, a100-eth, "
                 "mixed-a100-h100, horovod-p100, goyal-p100, ...")
      ->capture_default_str();
  app.add_option("--device", device_name, "device preset for every node: p100 v100 a100 a100-40g h100 h200 cpu");
  app.add_option("--nodes", nodes, "nodes");
  app.add_option("--devices-per-node", per_node, "devices per node");
  app.add_option("--mixed", mixed, "node groups of different devices: NODESxDEVICE[:PER_NODE],... e.g. 2xh100,2xa100");
  app.add_option("--memory-gb", memory_gb, "device memory, GB");
  app.add_option("--tflops", tflops, "device peak 16-bit TFLOP/s");
  app.add_option("--tflops-fp32", tflops_fp32, "device peak float32 TFLOP/s");
  app.add_option("--mfu", mfu, "achieved fraction of peak on training kernels (0-1]");
  app.add_option("--memory-bw-gbps", mem_bw_gbps, "device memory bandwidth, GB/s");
  app.add_option("--intra", intra_name, "intra-node link preset: nvlink3 nvlink4 pcie4 shm ...");
  app.add_option("--inter", inter_name, "inter-node link preset: ib-ndr ib-ndr-8x roce-25g eth-100g ...");
  app.add_option("--intra-gbps", intra_gbps, "intra-node bandwidth per device, GB/s");
  app.add_option("--intra-latency-us", intra_lat_us, "intra-node latency (alpha), microseconds");
  app.add_option("--inter-gbps", inter_gbps, "inter-node bandwidth per node, GB/s");
  app.add_option("--inter-latency-us", inter_lat_us, "inter-node latency (alpha), microseconds");
  app.add_option("--overlap", overlap, "fraction of bucketed gradient communication that can hide behind backward");
  app.add_option("--overhead-ms", overhead_ms, "fixed milliseconds per step");
  app.add_option("--batch", o.global_batch,
                 "global batch (samples per step; default 1024 transformers, 256 others; "
                 "128 on the local cluster)");
  app.add_option("--optimizer", o.optimizer,
                 "adam | adamw | sgd (momentum) | sgd-plain | lars (momentum) | lamb (default: sgd on the "
                 "local cluster, as tandem train; adam elsewhere)");
  app.add_option("--precision", o.precision,
                 "mixed | fp32 | bf16 (default: fp32 on the local cluster, mixed elsewhere)");
  app.add_option("--zero", zero, "ZeRO stages to consider")->delimiter(',')->capture_default_str();
  app.add_option("--bucket-mb", bucket_mb, "gradient bucket sizes to consider, MiB")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--workers", workers,
                 "data parallel only, these worker counts (default on the local cluster: 1..cores; "
                 "with --devices N instead, every data x tensor x pipeline layout of N workers)")
      ->delimiter(',');
  app.add_option("--devices", o.devices, "use this many devices (default: all)");
  app.add_option("--max-tp", o.max_tp, "largest tensor-parallel degree")->capture_default_str();
  app.add_option("--max-pp", o.max_pp, "largest pipeline depth")->capture_default_str();
  app.add_option("--pipeline-schedule", o.pipeline_schedule, "1f1b | gpipe (layouts with pp > 1)")
      ->check(CLI::IsMember({"1f1b", "gpipe"}))
      ->capture_default_str();
  o.pipeline_partition = "auto";
  app.add_option("--pp-partition", o.pipeline_partition,
                 "where pipelines are cut: auto (the faster of params and time; the table names the cut) | params "
                 "(balanced parameter counts, tandem train's default) | time (balanced per-layer time at the "
                 "micro-batch) | the layers per stage, e.g. 3,7 (tandem train --pp-partition takes each)")
      ->capture_default_str();
  app.add_flag("--checkpointing", o.activation_checkpointing, "activation checkpointing (recompute in backward)");
  app.add_option("--headroom", o.memory_headroom, "use at most this fraction of device memory")->capture_default_str();
  app.add_option("--top", top, "feasible layouts to show")->capture_default_str();
  app.add_option("--show-infeasible", show_infeasible, "infeasible layouts to show")->capture_default_str();
  app.add_option("--json", json_path, "also write the result as JSON to FILE ('-': stdout, instead of the table)");
  app.add_flag("--calibrate", calibrate,
               "measure this machine (compute, optimizer, collectives on 2..N workers) first; each compute point is "
               "timed for at least 0.3 s (TANDEM_CALIBRATE_POINT_S sets another span)");
  app.add_option("--calibration", calibration_path,
                 "calibration file written by --calibrate and read on the local cluster")
      ->capture_default_str();
  app.add_option("--calibrate-workers", calib_workers,
                 "world sizes for the collective calibration (default 2..max(4, cores))")
      ->delimiter(',');
  app.add_option("--calibrate-batch", calib_batch, "batch for the compute calibration")->capture_default_str();
  app.add_option("--calibrate-models", calib_models,
                 "built-in models whose compute rates --calibrate measures (default mlp,cnn,cnn_bn; "
                 "transformer_tiny too when it is --model)")
      ->delimiter(',');
  app.add_flag("--calibrate-worker", calibrate_worker, "(internal) one rank of the collective calibration")->group("");
  app.add_option("--calibrate-out", calib_out, "(internal)")->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  // --- internal: one rank of the collective calibration
  std::vector<std::string> cal_models = calib_models;
  if (cal_models.empty()) {
    for (const auto& n : {"mlp", "cnn", "cnn_bn"}) cal_models.push_back(n);
    if (!model_name.empty() && model_name == "transformer_tiny") cal_models.push_back(model_name);
  }
  for (const auto& n : cal_models) {
    if (n != "mlp" && n != "cnn" && n != "cnn_bn" && n != "transformer_tiny")
      throw std::invalid_argument("--calibrate-models: '" + n +
                                  "' is not a model the calibration can run (mlp, cnn, cnn_bn, transformer_tiny)");
  }
  std::string cal_models_list;
  for (const auto& n : cal_models) cal_models_list += (cal_models_list.empty() ? "" : ",") + n;
  if (calibrate_worker) {
    RuntimeOptions ro;
    ro.threads = 1;
    ro.device = "cpu";
    Runtime rt(ro);
    Calibration cal;
    if (!calibration_path.empty()) {
      std::ifstream f(calibration_path);
      if (f) cal = calibration_from_json(read_file(calibration_path));
    }
    calibrate_collectives(rt, cal, cal_models, calib_batch);
    if (rt.rank() == 0) {
      std::ofstream f(calib_out);
      f << calibration_to_json(cal) << "\n";
      if (!f) throw std::runtime_error("cannot write '" + calib_out + "'");
    }
    return 0;
  }

  // --- cluster
  ClusterSpec c = cluster_preset(cluster_name);
  if (!device_name.empty() || nodes != -1 || per_node != -1) {
    NodeGroup g = c.groups.at(0);
    if (!device_name.empty()) g.device = device_preset(device_name);
    if (nodes != -1) g.nodes = nodes;
    if (per_node != -1) g.devices_per_node = per_node;
    c.groups = {g};
    c.name = cluster_name + " (modified)";
  }
  if (!mixed.empty()) c.groups = parse_groups(mixed, per_node != -1 ? per_node : devices_per_node(c));
  for (auto& g : c.groups) {
    if (memory_gb != -1) g.device.memory_bytes = memory_gb * 1e9;
    if (tflops != 0) g.device.flops = tflops * 1e12;
    if (tflops_fp32 != 0) g.device.flops_fp32 = tflops_fp32 * 1e12;
    if (mfu != 0) g.device.mfu = mfu;
    if (mem_bw_gbps != 0) g.device.memory_bandwidth = mem_bw_gbps * 1e9;
  }
  if (!intra_name.empty()) c.intra = link_preset(intra_name);
  if (!inter_name.empty()) c.inter = link_preset(inter_name);
  if (intra_gbps != 0) c.intra.bandwidth = intra_gbps * 1e9;
  if (inter_gbps != 0) c.inter.bandwidth = inter_gbps * 1e9;
  if (intra_lat_us != -1) c.intra.latency = intra_lat_us * 1e-6;
  if (inter_lat_us != -1) c.inter.latency = inter_lat_us * 1e-6;
  if (overlap != -1) c.overlap = overlap;
  if (overhead_ms != -1) c.framework_overhead_s = overhead_ms * 1e-3;
  validate(c);

  // --- model
  ModelSpec m;
  const bool custom = params != 0 || layers != 0 || hidden != 0 || heads != 0 || seq != 0;
  if (!model_name.empty() && custom) {
    m = builtin_model(model_name);
    if (params != 0) m.parameters = params;
    if (layers != 0) m.layers = layers;
    if (hidden != 0) m.hidden = hidden;
    if (heads != 0) m.heads = heads;
    if (seq != 0) m.seq = seq;
  } else if (!model_name.empty()) {
    m = builtin_model(model_name);
  } else if (custom) {
    if (heads != 0 || hidden != 0) {
      m = transformer_model(layers != 0 ? layers : 1, hidden, heads, seq != 0 ? seq : 1, vocab, params);
      if (params != 0) m.parameters = params;  // validate() rejects a negative count
      m.name = "custom transformer";
    } else {
      m.name = "custom";
      m.kind = "dense";
      m.parameters = params;
      m.layers = layers != 0 ? layers : 1;
      m.seq = seq != 0 ? seq : 1;
      if (flops_per_sample == 0) flops_per_sample = 2.0 * params * m.seq;
      if (act_bytes == 0) {
        throw std::invalid_argument("a model without --heads/--hidden needs --activation-bytes (per sample); "
                                    "or describe a transformer with --hidden and --heads");
      }
    }
  } else {
    throw std::invalid_argument("no model given: use --model NAME (" + std::to_string(builtin_model_names().size()) +
                                " built in, e.g. cnn, gpt2, llama-7b) or --params/--layers/--hidden/--heads/--seq");
  }
  if (flops_per_sample != 0) m.forward_flops_per_sample = flops_per_sample;
  if (act_bytes != 0) m.activation_bytes_per_sample = act_bytes;
  m.attention_scores = m.attention_scores || attention_scores;
  m.dropout = m.dropout || dropout;
  validate(m);

  // --- options
  if (o.optimizer.empty()) o.optimizer = c.cpu ? "sgd" : "adam";
  if (o.precision.empty()) o.precision = c.cpu ? "fp32" : "mixed";
  if (o.global_batch == 0 && c.cpu) o.global_batch = 128;
  o.zero_stages = zero;
  o.bucket_bytes.clear();
  for (double b : bucket_mb) o.bucket_bytes.push_back(b * 1024 * 1024);
  if (workers.empty() && c.cpu && o.devices == 0) {  // --devices N: every dp x tp x pp layout of N workers
    for (int n = 1; n <= devices_per_node(c); ++n) workers.push_back(n);
  }
  o.dp_only_workers = workers;

  // --- calibration
  Calibration cal;
  if (calibrate) {
    if (!c.cpu) throw std::invalid_argument("--calibrate measures this machine: use it with --cluster local");
    if (calib_workers.empty()) {
      int most = std::max(4, static_cast<int>(std::thread::hardware_concurrency()));
      for (int n = 2; n <= most; ++n) calib_workers.push_back(n);
    }
    std::cout << "calibrating compute (" << cal_models_list << ": one thread and all cores)..." << std::endl;
    calibrate_compute(cal, cal_models, calib_batch);
    {
      std::ofstream f(calibration_path);
      f << calibration_to_json(cal) << "\n";
      if (!f) throw std::runtime_error("cannot write the calibration to '" + calibration_path + "'");
    }
    for (int n : calib_workers) {
      std::cout << "calibrating collectives on " << n << " workers..." << std::endl;
      std::string out = calibration_path + ".n" + std::to_string(n);
      LaunchOptions lo;
      lo.nprocs = n;
      int rc = launch(lo, {self_executable(), "plan", "--calibrate-worker", "--calibration", calibration_path,
                           "--calibrate-out", out, "--calibrate-batch", std::to_string(calib_batch),
                           "--calibrate-models", cal_models_list});
      if (rc != 0) {
        std::cerr << "tandem plan: the collective calibration on " << n << " workers failed (exit " << rc << ")\n";
        return 1;
      }
      Calibration part = calibration_from_json(read_file(out));
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
      std::remove(out.c_str());
    }
    std::ofstream f(calibration_path);
    f << calibration_to_json(cal) << "\n";
    if (!f) throw std::runtime_error("cannot write the calibration to '" + calibration_path + "'");
    std::cout << "calibration written to " << calibration_path << "\n";
    use_calibration = true;
  } else if (c.cpu) {
    std::ifstream f(calibration_path);
    if (f) {
      cal = calibration_from_json(read_file(calibration_path));
      use_calibration = true;
    }
  }
  if (use_calibration) {
    o.calibration = &cal;
    if (cal.memory_bandwidth > 0)
      for (auto& g : c.groups) g.device.memory_bandwidth = cal.memory_bandwidth;
  }

  // --- plan
  auto results = tandem::plan::plan(m, c, o);
  int feasible = 0;
  for (const auto& e : results) feasible += e.feasible;

  if (!json_path.empty()) {
    nlohmann::json j;
    j["model"] = {{"name", m.name},
                  {"kind", m.kind},
                  {"parameters", m.parameters},
                  {"layers", m.layers},
                  {"hidden", m.hidden},
                  {"heads", m.heads},
                  {"seq", m.seq},
                  {"forward_flops_per_sample", forward_flops_per_sample(m)}};
    j["cluster"] = {{"name", c.name},
                    {"devices", total_devices(c)},
                    {"devices_per_node", devices_per_node(c)},
                    {"calibrated", use_calibration}};
    j["options"] = {{"global_batch", o.global_batch}, {"optimizer", o.optimizer}, {"precision", o.precision}};
    j["layouts"] = nlohmann::json::array();
    for (const auto& e : results) j["layouts"].push_back(to_json(e));
    if (json_path == "-") {
      std::cout << j.dump(2) << "\n";
      return feasible > 0 ? 0 : 3;
    }
    std::ofstream f(json_path);
    f << j.dump(2) << "\n";
    if (!f) throw std::runtime_error("cannot write '" + json_path + "'");
  }

  const DeviceSpec dev = slowest_device(c);
  std::cout << "model    " << m.name << ": " << fixed(m.parameters / 1e6, m.parameters < 1e7 ? 3 : 1)
            << " M parameters, " << m.layers << " layers, " << fixed(forward_flops_per_sample(m) / 1e9, 4)
            << " GFLOP forward per sample\n";
  std::cout << "cluster  " << c.name << ": ";
  for (size_t i = 0; i < c.groups.size(); ++i)
    std::cout << (i ? " + " : "") << c.groups[i].nodes << " x " << c.groups[i].devices_per_node << " "
              << c.groups[i].device.name;
  std::cout << " (" << total_devices(c) << " devices, " << fixed(dev.memory_bytes / 1e9, 1) << " GB each";
  if (!c.cpu)
    std::cout << ", " << fixed((o.precision == "fp32" ? dev.flops_fp32 : dev.flops) / 1e12, 1) << " TFLOP/s "
              << (o.precision == "fp32" ? "fp32" : "16-bit") << " x " << dev.mfu << " achieved";
  std::cout << "), intra " << c.intra.name << " " << fixed(c.intra.bandwidth / 1e9, 1) << " GB/s";
  if (total_devices(c) > devices_per_node(c))
    std::cout << ", inter " << c.inter.name << " " << fixed(c.inter.bandwidth / 1e9, 2) << " GB/s";
  std::cout << "\n";
  if (c.cpu) {
    if (use_calibration) {
      std::cout << "calibration " << calibration_path << " (" << cal.date << ", " << cal.host << ", " << cal.cores
                << " cores)";
      if (!cal.models.count(m.name)) std::cout << "; no rates for '" << m.name << "': GEMM rate used";
      std::cout << "\n";
    } else {
      std::cout << "uncalibrated: compute and link rates are placeholders; run tandem plan --calibrate\n";
    }
  }
  std::cout << "options  global batch "
            << (o.global_batch > 0 ? o.global_batch : (m.kind == "transformer" ? 1024 : 256)) << ", " << o.optimizer
            << ", " << o.precision << (o.activation_checkpointing ? ", checkpointing" : "") << "\n\n";

  std::cout << std::left << std::setw(5) << "rank" << std::setw(30) << "layout" << std::right << std::setw(9)
            << "micro-b" << std::setw(8) << "bucket" << std::setw(11) << "step ms" << std::setw(12) << "samples/s"
            << std::setw(8) << "eff." << std::setw(11) << "memory" << std::setw(11) << "comm ms" << std::setw(10)
            << "exposed"
            << "   memory: params/grads/optimizer/activations\n";
  int shown = 0;
  for (const auto& e : results) {
    if (!e.feasible || shown >= top) continue;
    ++shown;
    const auto& l = e.layout;
    std::cout << std::left << std::setw(5) << shown << std::setw(30) << layout_label(e) << std::right << std::setw(9)
              << (std::to_string(l.micro_batch) + "x" + std::to_string(l.micro_batches)) << std::setw(8)
              << fixed(l.bucket_bytes / 1048576.0, 0) << std::setw(11) << fixed(e.step_s * 1e3, e.step_s < 1 ? 1 : 0)
              << std::setw(12) << fixed(e.samples_per_s, e.samples_per_s < 100 ? 1 : 0) << std::setw(7)
              << fixed(e.efficiency * 100, 0) << "%" << std::setw(11) << human_bytes(e.memory.total()) << std::setw(11)
              << fixed(e.comm_s * 1e3, 1) << std::setw(10) << fixed(e.exposed_comm_s * 1e3, 1) << "   "
              << human_bytes(e.memory.parameters) << " / " << human_bytes(e.memory.gradients) << " / "
              << human_bytes(e.memory.optimizer) << " / " << human_bytes(e.memory.activations) << "\n";
  }
  {
    int k = 0;
    for (const auto& e : results) {
      if (!e.feasible || k >= shown) continue;
      ++k;
      if (!e.caveat.empty()) std::cout << "note: " << k << " (" << layout_label(e) << ") has " << e.caveat << "\n";
    }
  }
  if (feasible > shown) std::cout << "(" << feasible - shown << " more feasible layouts; --top N shows them)\n";
  int infeasible = static_cast<int>(results.size()) - feasible;
  if (infeasible > 0 && show_infeasible > 0) {
    std::cout << "\ninfeasible (" << infeasible << "):\n";
    int k = 0;
    for (const auto& e : results) {
      if (e.feasible) continue;
      if (k++ >= show_infeasible) {
        std::cout << "  ... " << infeasible - show_infeasible << " more\n";
        break;
      }
      std::cout << "  " << std::left << std::setw(30) << layout_label(e) << e.why << "\n";
    }
  }
  if (feasible == 0) {
    std::cerr << "tandem plan: no layout of " << m.name << " fits on " << c.name
              << "; add devices, use a device with more memory, or shrink the batch\n";
    return 3;
  }
  return 0;
}

}  // namespace tandem::cli
