// `tandem plan`, the result: the estimates as JSON, the model, cluster and options above the
// table, the ranked feasible layouts with their notes, and the infeasible ones with the reason.
#include <nlohmann/json.hpp>

#include <fstream>
#include <iomanip>
#include <iostream>

#include "commands.h"
#include "plan_internal.h"
#include "tandem/plan.h"

namespace tandem::cli::plan_cmd {

using namespace tandem::plan;

namespace {

std::string human_bytes(double b) {
  if (b >= 1e9) return fixed(b / 1e9, 1) + " GB";
  if (b >= 1e6) return fixed(b / 1e6, 1) + " MB";
  return fixed(b / 1e3, 1) + " kB";
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
                      {"cp", e.layout.cp},
                      {"tp", e.layout.tp},
                      {"pp", e.layout.pp},
                      {"ep", e.layout.ep},
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
  if (e.memory.expert_states > 0) {
    // Parts of the four above: the experts' parameters, gradients and optimizer state, and activations.
    j["memory_bytes"]["experts"] = {{"states", e.memory.expert_states}, {"activations", e.memory.expert_activations}};
  }
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
    if (e.layout.cp > 1) {
      j["ring_bytes"] = e.ring_bytes;
      j["ring_seconds"] = e.ring_s;
      j["ring_exposed_seconds"] = e.ring_exposed_s;
    }
    if (e.layout.ep > 1) {
      j["all_to_all_bytes"] = e.all_to_all_bytes;
      j["all_to_all_seconds"] = e.all_to_all_s;
    }
    if (!e.caveat.empty()) j["caveat"] = e.caveat;
  } else {
    j["why"] = e.why;
  }
  return j;
}

}  // namespace

void write_plan_json(const std::string& path, const ModelSpec& m, const ClusterSpec& c, const PlanOptions& o,
                     bool calibrated, const std::vector<Estimate>& results) {
  nlohmann::json j;
  j["model"] = {{"name", m.name},
                {"kind", m.kind},
                {"parameters", m.parameters},
                {"layers", m.layers},
                {"hidden", m.hidden},
                {"heads", m.heads},
                {"kv_heads", m.kv_heads > 0 ? m.kv_heads : m.heads},
                {"seq", m.seq},
                {"forward_flops_per_sample", forward_flops_per_sample(m)}};
  if (is_moe(m)) {
    j["model"]["moe"] = {{"experts", m.moe.experts},
                         {"top_k", m.moe.top_k},
                         {"intermediate", m.moe.intermediate},
                         {"moe_layers", moe_layers(m)},
                         {"capacity_factor", m.moe.capacity_factor},
                         {"expert_parameters", expert_parameters(m)}};
  }
  j["cluster"] = {{"name", c.name},
                  {"devices", total_devices(c)},
                  {"devices_per_node", devices_per_node(c)},
                  {"calibrated", calibrated}};
  j["options"] = {{"global_batch", o.global_batch},
                  {"optimizer", o.optimizer},
                  {"precision", o.precision},
                  {"cp", o.cp},
                  {"ep", o.ep}};
  j["layouts"] = nlohmann::json::array();
  for (const auto& e : results) j["layouts"].push_back(to_json(e));
  if (path == "-") {
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  if (!f) throw std::runtime_error("cannot write '" + path + "'");
}

void print_setting(const ModelSpec& m, const ClusterSpec& c, const PlanOptions& o, bool calibrated,
                   const Calibration& cal, const std::string& calibration_path) {
  const DeviceSpec dev = slowest_device(c);
  std::cout << "model    " << m.name << ": " << fixed(m.parameters / 1e6, m.parameters < 1e7 ? 3 : 1)
            << " M parameters, " << m.layers << " layers, " << fixed(forward_flops_per_sample(m) / 1e9, 4)
            << " GFLOP forward per sample\n";
  if (is_moe(m)) {
    std::cout << "experts  " << m.moe.experts << " of width " << m.moe.intermediate << " in " << moe_layers(m)
              << " MoE blocks, top " << m.moe.top_k << ", "
              << (m.moe.capacity_factor > 0 ? "capacity factor " + fixed(m.moe.capacity_factor, 2) : "dropless") << ": "
              << fixed(expert_parameters(m) / 1e6, 1) << " M expert parameters\n";
  }
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
    if (calibrated) {
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
            << ", " << o.precision << (o.activation_checkpointing ? ", checkpointing" : "")
            << (o.sequence_parallel ? ", sequence-parallel" : "") << "\n\n";
}

namespace {
// Which optional columns the table carries: cp and the ring where a layout has context
// parallelism, ep and the all-to-alls where one has expert parallelism, the experts' memory for
// MoE models. Without them the table keeps its columns.
struct Columns {
  bool cp = false, ep = false, experts = false;
};

void print_header(const Columns& col) {
  std::cout << std::left << std::setw(5) << "rank" << std::setw(30) << "layout" << std::right;
  if (col.cp) std::cout << std::setw(4) << "cp";
  if (col.ep) std::cout << std::setw(4) << "ep";
  std::cout << std::setw(9) << "micro-b" << std::setw(8) << "bucket" << std::setw(11) << "step ms" << std::setw(12)
            << "samples/s" << std::setw(8) << "eff." << std::setw(11) << "memory" << std::setw(11) << "comm ms"
            << std::setw(10) << "exposed";
  if (col.cp) std::cout << std::setw(9) << "ring ms";
  if (col.ep) std::cout << std::setw(9) << "a2a ms";
  std::cout << "   memory: params/grads/optimizer/activations" << (col.experts ? " (experts: states/activations)" : "")
            << "\n";
}

void print_row(int rank, const Estimate& e, const Columns& col) {
  const auto& l = e.layout;
  std::cout << std::left << std::setw(5) << rank << std::setw(30) << layout_label(e) << std::right;
  if (col.cp) std::cout << std::setw(4) << l.cp;
  if (col.ep) std::cout << std::setw(4) << l.ep;
  std::cout << std::setw(9) << (std::to_string(l.micro_batch) + "x" + std::to_string(l.micro_batches)) << std::setw(8)
            << fixed(l.bucket_bytes / 1048576.0, 0) << std::setw(11) << fixed(e.step_s * 1e3, e.step_s < 1 ? 1 : 0)
            << std::setw(12) << fixed(e.samples_per_s, e.samples_per_s < 100 ? 1 : 0) << std::setw(7)
            << fixed(e.efficiency * 100, 0) << "%" << std::setw(11) << human_bytes(e.memory.total()) << std::setw(11)
            << fixed(e.comm_s * 1e3, 1) << std::setw(10) << fixed(e.exposed_comm_s * 1e3, 1);
  if (col.cp) std::cout << std::setw(9) << fixed(e.ring_exposed_s * 1e3, 1);
  if (col.ep) std::cout << std::setw(9) << fixed(e.all_to_all_s * 1e3, 1);
  std::cout << "   " << human_bytes(e.memory.parameters) << " / " << human_bytes(e.memory.gradients) << " / "
            << human_bytes(e.memory.optimizer) << " / " << human_bytes(e.memory.activations);
  if (col.experts)
    std::cout << " (experts " << human_bytes(e.memory.expert_states) << " / "
              << human_bytes(e.memory.expert_activations) << ")";
  std::cout << "\n";
}
}  // namespace

void print_ranking(const std::vector<Estimate>& results, int top, int show_infeasible) {
  int feasible = 0;
  Columns col;
  for (const auto& e : results) {
    feasible += e.feasible;
    col.cp = col.cp || e.layout.cp > 1;
    col.ep = col.ep || e.layout.ep > 1;
    col.experts = col.experts || e.memory.expert_states > 0;
  }
  print_header(col);
  int shown = 0;
  for (const auto& e : results) {
    if (!e.feasible || shown >= top) continue;
    print_row(++shown, e, col);
  }
  {
    int k = 0;
    for (const auto& e : results) {
      if (!e.feasible || k >= shown) continue;
      ++k;
      if (!e.caveat.empty()) std::cout << "note: " << k << " (" << layout_label(e) << ") has " << e.caveat << "\n";
    }
  }
  if (col.cp)
    std::cout << "ring ms: ring attention's transfers not hidden behind its blocks' compute (in step ms; comm ms "
                 "counts them whole)\n";
  if (col.ep)
    std::cout << "a2a ms: the MoE layers' all-to-alls (dispatch and combine, forward and backward; in step ms and "
                 "comm ms)\n";
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
}

}  // namespace tandem::cli::plan_cmd
