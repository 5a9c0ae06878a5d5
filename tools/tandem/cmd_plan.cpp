// `tandem plan`: predicts memory per device and step time for every data x tensor x pipeline
// layout (x context with --cp) and ZeRO stage of a model on a cluster (tandem/plan.h), ranks the feasible ones and
// says why the others do not fit. `--calibrate` measures this machine first (compute in this
// process, collectives on 2..N workers launched through mpirun) and saves the constants.
// This file: the flags and the cluster, model and options they describe; plan_calibrate.cpp
// measures, plan_output.cpp prints the result.
#include <CLI/CLI.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "cli_app.h"
#include "commands.h"
#include "parallel_options.h"
#include "plan_internal.h"
#include "tandem/plan.h"

namespace tandem::cli {
namespace plan_cmd {

using namespace tandem::plan;

namespace {

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

void add_model_options(CLI::App& app, PlanFlags& f) {
  app.add_option("--model", f.model_name,
                 "built-in model (mlp, cnn, transformer_tiny, resnet50, gpt2, llama-7b, mixtral-8x7b, moe_tiny, ...), "
                 "or a Hugging Face checkpoint directory or config.json (model_type llama or mixtral; --seq, default "
                 "4096 or its max_position_embeddings if smaller)");
  app.add_option("--params", f.params, "custom model: parameters (e.g. 7.5e9)");
  app.add_option("--layers", f.layers, "custom model: layers (blocks)");
  app.add_option("--hidden", f.hidden, "custom model: hidden size");
  app.add_option("--heads", f.heads, "custom model: attention heads (0: not a transformer)");
  app.add_option("--kv-heads", f.kv_heads,
                 "key/value heads (grouped-query attention; default: --heads); sets --cp's ring traffic");
  app.add_option("--seq", f.seq, "custom model: sequence length (tokens per sample)");
  app.add_option("--vocab", f.vocab, "custom model: vocabulary size");
  app.add_option("--flops-per-sample", f.flops_per_sample, "forward FLOPs per sample (default: from the shape)");
  app.add_option("--activation-bytes", f.act_bytes, "activation bytes per sample kept for backward (float32)");
  app.add_option("--experts", f.experts,
                 "custom model: MoE experts per block (Mixtral style: every block's MLP a top-k router over SwiGLU "
                 "experts; needs --expert-intermediate)");
  app.add_option("--expert-intermediate", f.expert_intermediate, "custom MoE model: each expert's SwiGLU width");
  app.add_option("--top-k", f.top_k, "MoE: experts per token (default 2, or the preset's)");
  app.add_option("--capacity-factor", f.capacity_factor,
                 "MoE: each expert takes at most c x top-k x tokens / experts token slots (0: dropless, the default); "
                 "activations held for c x top-k slots per token");
  app.add_option("--lora-rank", f.lora_rank,
                 "LoRA fine-tuning: adapters of this rank on q, k, v, o of every layer train, the rest is frozen "
                 "(no gradients, no optimizer state)");
  app.add_flag("--attention-scores", f.attention_scores,
               "transformer: backward keeps the seq x seq attention scores (unfused attention; Tandem's "
               "models use fused scaled_dot_product_attention, which keeps none)");
  app.add_flag("--dropout", f.dropout, "transformer: dropout masks are kept for backward (Tandem's models have none)");
}

void add_cluster_options(CLI::App& app, PlanFlags& f) {
  app.add_option("--cluster", f.cluster_name,
                 "cluster preset: local, h200x8, h100-ib, a100-ib, a100-eth, "
                 "mixed-a100-h100, horovod-p100, goyal-p100, ...")
      ->capture_default_str();
  app.add_option("--device", f.device_name, "device preset for every node: p100 v100 a100 a100-40g h100 h200 cpu");
  app.add_option("--nodes", f.nodes, "nodes");
  app.add_option("--devices-per-node", f.per_node, "devices per node");
  app.add_option("--mixed", f.mixed,
                 "node groups of different devices: NODESxDEVICE[:PER_NODE],... e.g. 2xh100,2xa100");
  app.add_option("--memory-gb", f.memory_gb, "device memory, GB");
  app.add_option("--tflops", f.tflops, "device peak 16-bit TFLOP/s");
  app.add_option("--tflops-fp32", f.tflops_fp32, "device peak float32 TFLOP/s");
  app.add_option("--mfu", f.mfu, "achieved fraction of peak on training kernels (0-1]");
  app.add_option("--memory-bw-gbps", f.mem_bw_gbps, "device memory bandwidth, GB/s");
  app.add_option("--intra", f.intra_name, "intra-node link preset: nvlink3 nvlink4 pcie4 shm ...");
  app.add_option("--inter", f.inter_name, "inter-node link preset: ib-ndr ib-ndr-8x roce-25g eth-100g ...");
  app.add_option("--intra-gbps", f.intra_gbps, "intra-node bandwidth per device, GB/s");
  app.add_option("--intra-latency-us", f.intra_lat_us, "intra-node latency (alpha), microseconds");
  app.add_option("--inter-gbps", f.inter_gbps, "inter-node bandwidth per node, GB/s");
  app.add_option("--inter-latency-us", f.inter_lat_us, "inter-node latency (alpha), microseconds");
  app.add_option("--overlap", f.overlap, "fraction of bucketed gradient communication that can hide behind backward");
  app.add_option("--overhead-ms", f.overhead_ms, "fixed milliseconds per step");
}

// The plan's own options, the output and the calibration; after the model and cluster flags, as
// --help lists them.
void add_plan_options(CLI::App& app, PlanFlags& f) {
  PlanOptions& o = f.o;
  o.optimizer.clear();
  o.precision.clear();
  app.add_option("--batch", o.global_batch,
                 "global batch (samples per step; default 1024 transformers, 256 others; "
                 "128 on the local cluster)");
  app.add_option("--optimizer", o.optimizer,
                 "adam | adamw | sgd (momentum) | sgd-plain | lars (momentum) | lamb (default: sgd on the "
                 "local cluster, as tandem train; adam elsewhere)");
  app.add_option("--precision", o.precision,
                 "mixed | fp32 | bf16 (default: fp32 on the local cluster, mixed elsewhere)");
  app.add_option("--zero", f.zero, "ZeRO stages to consider")->delimiter(',')->capture_default_str();
  app.add_option("--bucket-mb", f.bucket_mb, "gradient bucket sizes to consider, MiB")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--workers", f.workers,
                 "data parallel only, these worker counts (default on the local cluster: 1..cores; "
                 "with --devices N instead, every data x tensor x pipeline layout of N workers)")
      ->delimiter(',');
  app.add_option("--devices", o.devices, "use this many devices (default: all)");
  app.add_option("--max-tp", o.max_tp, "largest tensor-parallel degree")->capture_default_str();
  app.add_option("--max-pp", o.max_pp, "largest pipeline depth")->capture_default_str();
  app.add_option("--ep", o.ep,
                 "MoE models: expert-parallel degree (tandem finetune --ep): experts / ep experts per rank, their "
                 "state sharded over dp / ep ranks, tokens exchanged by 4 all-to-alls per MoE layer and micro-batch; "
                 "divides dp and the experts (default: every power of two up to --max-ep that does)");
  app.add_option("--max-ep", o.max_ep, "largest expert-parallel degree searched")->capture_default_str();
  app.add_option("--cp", o.cp,
                 "context-parallel degrees to evaluate, e.g. 2 or 1,2 (tandem train --cp; transformers described "
                 "by shape, sequence a multiple of 2 x cp): each sequence split over cp ranks of a replica, "
                 "attention as ring attention. Per rank: activations and compute / cp; ZeRO shards and gradients "
                 "reduce over dp x cp ranks; the ring sends 3cp-2 k/v blocks (float32) per layer and micro-batch, "
                 "hidden behind the attention blocks while they take longer. The table then shows cp and the "
                 "ring's exposed ms")
      ->delimiter(',')
      ->capture_default_str();
  add_word_option<PipelineSchedule>(
      app, "--pipeline-schedule", o.pipeline_schedule,
      [](const std::string& word) {
        for (auto s :
             {PipelineSchedule::k1F1B, PipelineSchedule::kGPipe, PipelineSchedule::kZBH1, PipelineSchedule::kZBV}) {
          if (word == to_string(s)) return s;
        }
        throw std::invalid_argument("'" + word + "': tandem plan models 1f1b, gpipe, zb-h1 and zb-v");
      },
      to_string(o.pipeline_schedule),
      "1f1b | gpipe | zb-h1 | zb-v (layouts with pp > 1; zb-h1 and zb-v: 1F1B's bubble times 1/3 and "
      "1/6, the zero-bubble paper's figures with forward, input-gradient and weight-gradient times equal)");
  o.pipeline_partition = "auto";
  app.add_option("--pp-partition", o.pipeline_partition,
                 "where pipelines are cut: auto (the faster of params and time; the table names the cut) | params "
                 "(balanced parameter counts, tandem train's default) | time (balanced per-layer time at the "
                 "micro-batch) | the layers per stage, e.g. 3,7 (tandem train --pp-partition takes each)")
      ->capture_default_str();
  app.add_flag("--checkpointing", o.activation_checkpointing, "activation checkpointing (recompute in backward)");
  app.add_flag("--sequence-parallel", o.sequence_parallel,
               "sequence parallelism in tp layouts (transformers): norms' and residual's activations split over tp, "
               "the same tp traffic as reduce-scatters and all-gathers");
  app.add_option("--headroom", o.memory_headroom, "use at most this fraction of device memory")->capture_default_str();
  app.add_option("--top", f.top, "feasible layouts to show")->capture_default_str();
  app.add_option("--show-infeasible", f.show_infeasible, "infeasible layouts to show")->capture_default_str();
  app.add_option("--json", f.json_path, "also write the result as JSON to FILE ('-': stdout, instead of the table)");
  app.add_flag("--calibrate", f.calibrate,
               "measure this machine (compute, optimizer, collectives on 2..N workers) first; each compute point is "
               "timed for at least 0.3 s (TANDEM_CALIBRATE_POINT_S sets another span)");
  app.add_option("--calibration", f.calibration_path,
                 "calibration file written by --calibrate and read on the local cluster")
      ->capture_default_str();
  app.add_option("--calibrate-workers", f.calib_workers,
                 "world sizes for the collective calibration (default 2..max(4, cores))")
      ->delimiter(',');
  app.add_option("--calibrate-batch", f.calib_batch, "batch for the compute calibration")->capture_default_str();
  app.add_option("--calibrate-models", f.calib_models,
                 "built-in models whose compute rates --calibrate measures (default mlp,cnn,cnn_bn; "
                 "transformer_tiny too when it is --model)")
      ->delimiter(',');
  app.add_flag("--calibrate-worker", f.calibrate_worker, "(internal) one rank of the collective calibration")
      ->group("");
  app.add_option("--calibrate-out", f.calib_out, "(internal)")->group("");
}

// The --cluster preset with the device, node and link flags applied over it.
ClusterSpec cluster_from_flags(const PlanFlags& f) {
  ClusterSpec c = cluster_preset(f.cluster_name);
  if (!f.device_name.empty() || f.nodes != -1 || f.per_node != -1) {
    NodeGroup g = c.groups.at(0);
    if (!f.device_name.empty()) g.device = device_preset(f.device_name);
    if (f.nodes != -1) g.nodes = f.nodes;
    if (f.per_node != -1) g.devices_per_node = f.per_node;
    c.groups = {g};
    c.name = f.cluster_name + " (modified)";
  }
  if (!f.mixed.empty()) c.groups = parse_groups(f.mixed, f.per_node != -1 ? f.per_node : devices_per_node(c));
  for (auto& g : c.groups) {
    if (f.memory_gb != -1) g.device.memory_bytes = f.memory_gb * 1e9;
    if (f.tflops != 0) g.device.flops = f.tflops * 1e12;
    if (f.tflops_fp32 != 0) g.device.flops_fp32 = f.tflops_fp32 * 1e12;
    if (f.mfu != 0) g.device.mfu = f.mfu;
    if (f.mem_bw_gbps != 0) g.device.memory_bandwidth = f.mem_bw_gbps * 1e9;
  }
  if (!f.intra_name.empty()) c.intra = link_preset(f.intra_name);
  if (!f.inter_name.empty()) c.inter = link_preset(f.inter_name);
  if (f.intra_gbps != 0) c.intra.bandwidth = f.intra_gbps * 1e9;
  if (f.inter_gbps != 0) c.inter.bandwidth = f.inter_gbps * 1e9;
  if (f.intra_lat_us != -1) c.intra.latency = f.intra_lat_us * 1e-6;
  if (f.inter_lat_us != -1) c.inter.latency = f.inter_lat_us * 1e-6;
  if (f.overlap != -1) c.overlap = f.overlap;
  if (f.overhead_ms != -1) c.framework_overhead_s = f.overhead_ms * 1e-3;
  validate(c);
  return c;
}

// --top-k and --capacity-factor over a MoE model; --experts and --expert-intermediate describe a
// custom one (model_from_flags), not a preset.
void apply_moe_flags(const PlanFlags& f, ModelSpec& m) {
  if ((f.experts != 0 || f.expert_intermediate != 0) && !f.model_name.empty())
    throw std::invalid_argument("--experts and --expert-intermediate describe a custom MoE model by its shape "
                                "(--layers --hidden --heads --seq --vocab), not --model " +
                                f.model_name);
  if (f.expert_intermediate != 0 && f.experts == 0)
    throw std::invalid_argument("--expert-intermediate needs --experts (the experts per MoE block)");
  if ((f.top_k != -1 || f.capacity_factor != -1) && !is_moe(m))
    throw std::invalid_argument("--top-k and --capacity-factor describe MoE blocks; '" + m.name +
                                "' has none (--model mixtral-8x7b or moe_tiny, or --experts)");
  if (f.top_k != -1) m.moe.top_k = f.top_k;
  if (f.capacity_factor != -1) m.moe.capacity_factor = f.capacity_factor;
}

// --model: a built-in name, or a Hugging Face checkpoint directory (its config.json: Llama or
// Mixtral) or such a config.json itself, at --seq tokens.
ModelSpec named_model(const PlanFlags& f) {
  std::filesystem::path p(f.model_name);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  else if (p.extension() != ".json") return builtin_model(f.model_name);
  std::ifstream in(p);
  if (!in)
    throw std::invalid_argument("--model '" + f.model_name + "': cannot read " + p.string() +
                                " (a Hugging Face checkpoint directory holds its config.json)");
  std::stringstream text;
  text << in.rdbuf();
  return hf_config_model(text.str(), f.seq);
}

// The --model preset with the shape flags applied over it, or a custom model from them alone.
ModelSpec model_from_flags(const PlanFlags& f) {
  ModelSpec m;
  double flops_per_sample = f.flops_per_sample;
  const double params = f.params, act_bytes = f.act_bytes;
  const int64_t layers = f.layers, hidden = f.hidden, heads = f.heads, seq = f.seq;
  const bool custom = params != 0 || layers != 0 || hidden != 0 || heads != 0 || seq != 0 || f.experts != 0;
  if (!f.model_name.empty() && custom) {
    m = named_model(f);
    if (params != 0) m.parameters = params;
    if (layers != 0) m.layers = layers;
    if (hidden != 0) m.hidden = hidden;
    if (heads != 0) m.heads = heads;
    if (seq != 0) m.seq = seq;
    if (heads != 0 && f.kv_heads == 0) m.kv_heads = 0;  // the preset's grouping was for its heads
  } else if (!f.model_name.empty()) {
    m = named_model(f);
  } else if (custom) {
    if (f.experts != 0) {
      m = mixtral_model(layers != 0 ? layers : 1, hidden, heads, f.kv_heads != 0 ? f.kv_heads : heads,
                        f.expert_intermediate, f.experts, f.top_k > 0 ? f.top_k : 2, seq != 0 ? seq : 1, f.vocab);
      if (params != 0) m.parameters = params;
      m.name = "custom mixtral";
    } else if (heads != 0 || hidden != 0) {
      m = transformer_model(layers != 0 ? layers : 1, hidden, heads, seq != 0 ? seq : 1, f.vocab, params);
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
  if (f.kv_heads != 0) m.kv_heads = f.kv_heads;
  apply_moe_flags(f, m);
  if (flops_per_sample != 0) m.forward_flops_per_sample = flops_per_sample;
  if (act_bytes != 0) m.activation_bytes_per_sample = act_bytes;
  m.attention_scores = m.attention_scores || f.attention_scores;
  m.dropout = m.dropout || f.dropout;
  if (f.lora_rank < 0) throw std::invalid_argument("--lora-rank must be >= 0, got " + std::to_string(f.lora_rank));
  if (f.lora_rank > 0) {
    if (m.kind != "transformer" || m.hidden <= 0)
      throw std::invalid_argument(
          "--lora-rank adapts attention projections: it needs a transformer (--hidden, --heads)");
    // Four hidden x hidden projections per layer, each adapter r x (in + out).
    m.trainable_parameters = static_cast<double>(m.layers) * 4.0 * f.lora_rank * 2.0 * m.hidden;
    m.name += " + LoRA r " + std::to_string(f.lora_rank);
  }
  validate(m);
  return m;
}

// Completes f.o: the defaults that depend on the cluster, the ZeRO stages, bucket sizes and
// data-parallel worker counts.
void complete_plan_options(PlanFlags& f, const ClusterSpec& c) {
  PlanOptions& o = f.o;
  if (o.optimizer.empty()) o.optimizer = c.cpu ? "sgd" : "adam";
  if (o.precision.empty()) o.precision = c.cpu ? "fp32" : "mixed";
  if (o.global_batch == 0 && c.cpu) o.global_batch = 128;
  o.zero_stages = f.zero;
  o.bucket_bytes.clear();
  for (double b : f.bucket_mb) o.bucket_bytes.push_back(b * 1024 * 1024);
  if (f.workers.empty() && c.cpu && o.devices == 0) {  // --devices N: every dp x tp x pp layout of N workers
    for (int n = 1; n <= devices_per_node(c); ++n) f.workers.push_back(n);
  }
  o.dp_only_workers = f.workers;
}

}  // namespace
}  // namespace plan_cmd

int cmd_plan(int argc, char** argv) {
  using namespace plan_cmd;
  CLI::App app{"Predict memory per device and step time of every parallel layout of a model on a cluster, "
               "ranked; say why the others do not fit.",
               "tandem plan"};
  PlanFlags f;
  add_model_options(app, f);
  add_cluster_options(app, f);
  add_plan_options(app, f);
  app.footer(examples_footer({
      {"GPT-2 on H100 nodes over InfiniBand: the 3 fastest layouts",
       {"tandem plan --model gpt2 --cluster h100-ib --top 3"}},
      {"a model described by its shape, with context parallelism",
       {"tandem plan --params 7e9 --layers 32 --hidden 4096 --heads 32 --seq 8192 --cluster h100-ib --cp 1,2"}},
      {"this machine, measured first", {"tandem plan --model cnn --calibrate"}},
      {"Mixtral 8x7B with expert parallelism fixed at 8",
       {"tandem plan --model mixtral-8x7b --cluster h100-ib --batch 64 --ep 8 --top 3"}},
  }));
  if (auto rc = parse_command_line(app, argc, argv)) return *rc;

  const std::vector<std::string> cal_models = calibration_models(f);
  if (f.calibrate_worker) return calibration_worker(f, cal_models);
  ClusterSpec c = cluster_from_flags(f);
  const ModelSpec m = model_from_flags(f);
  complete_plan_options(f, c);
  PlanOptions& o = f.o;

  Calibration cal;
  bool use_calibration = false;
  if (f.calibrate) {
    if (int rc = calibrate_machine(f, c, cal_models, cal); rc != 0) return rc;
    use_calibration = true;
  } else if (c.cpu) {
    use_calibration = read_saved_calibration(f.calibration_path, cal);
  }
  if (use_calibration) {
    o.calibration = &cal;
    if (cal.memory_bandwidth > 0)
      for (auto& g : c.groups) g.device.memory_bandwidth = cal.memory_bandwidth;
  }

  auto results = tandem::plan::plan(m, c, o);
  int feasible = 0;
  for (const auto& e : results) feasible += e.feasible;
  if (!f.json_path.empty()) {
    write_plan_json(f.json_path, m, c, o, use_calibration, results);
    if (f.json_path == "-") return feasible > 0 ? 0 : 3;
  }
  print_setting(m, c, o, use_calibration, cal, f.calibration_path);
  print_ranking(results, f.top, f.show_infeasible);
  if (feasible == 0) {
    std::cerr << "tandem plan: no layout of " << m.name << " fits on " << c.name
              << "; add devices, use a device with more memory, or shrink the batch\n";
    return 3;
  }
  return 0;
}

}  // namespace tandem::cli
