// The one report of every training command: its collective part (collect_engine_report), its
// text (format_report) and its JSON (report_json).
#include "tandem/report.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "tandem/engine.h"
#include "tandem/grid.h"

namespace tandem {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

template <typename T>
std::string joined(const std::vector<T>& v, const char* sep) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(0);
  for (size_t i = 0; i < v.size(); ++i) os << (i ? sep : "") << v[i];
  return os.str();
}

// Each stage's bubble, step and compute time and live micro-batches, from the stages of this
// rank's replica (collective over the pipeline group).
void gather_pipeline(Engine& eng, const EngineStats::PipelineStage& s, Report& rep) {
  const int pp = eng.config().pp;
  auto mine =
      torch::tensor({s.bubble, static_cast<double>(s.peak_live_micro_batches), s.step_ms, s.compute_ms}, torch::kDouble)
          .to(eng.device());
  auto all = torch::empty({4 * pp}, mine.options());
  eng.grid()->pp()->allgather(all, mine);
  auto host = all.cpu();
  rep.bubble_per_stage.clear();
  rep.peak_live_micro_batches.clear();
  rep.pipeline_step_ms_per_stage.clear();
  rep.pipeline_compute_ms_per_stage.clear();
  double sum = 0.0;
  for (int st = 0; st < pp; ++st) {
    rep.bubble_per_stage.push_back(host[4 * st].item<double>());
    rep.peak_live_micro_batches.push_back(static_cast<int64_t>(host[4 * st + 1].item<double>()));
    rep.pipeline_step_ms_per_stage.push_back(host[4 * st + 2].item<double>());
    rep.pipeline_compute_ms_per_stage.push_back(host[4 * st + 3].item<double>());
    sum += rep.bubble_per_stage.back();
  }
  rep.bubble_measured = sum / pp;
  const auto& cfg = eng.config();
  rep.bubble_theory =
      pipeline_bubble_theory(cfg.schedule, pp, cfg.micro_batches, pipeline_chunks(cfg.schedule, cfg.virtual_stages));
}

// Every rank's peaks, model state and pipeline stage; rank 0's model state alone as well.
// Collective over the world: the MoE figures summed (tokens: the tp ranks route the same ones,
// so once per tp group), averaged (losses) or the slowest (seconds) over the ranks; a rank whose
// stage has no MoE layer adds nothing.
void gather_moe(Engine& eng, const moe::MoeStats& s, Report& rep) {
  auto world = eng.world();
  auto experts = torch::tensor({static_cast<int64_t>(s.tokens_per_expert.size())}, torch::kLong).to(eng.device());
  world->allreduce(experts, ReduceOp::kMax);
  rep.moe_experts = experts.cpu().item<int64_t>();
  if (rep.moe_experts == 0) return;
  std::vector<double> v(static_cast<size_t>(rep.moe_experts) + 6, 0.0);
  for (size_t e = 0; e < s.tokens_per_expert.size(); ++e) v[e] = static_cast<double>(s.tokens_per_expert[e]);
  const size_t k = static_cast<size_t>(rep.moe_experts);
  v[k] = static_cast<double>(s.routed);
  v[k + 1] = static_cast<double>(s.dropped);
  v[k + 2] = s.aux_loss_sum;
  v[k + 3] = static_cast<double>(s.aux_loss_terms);
  v[k + 4] = s.z_loss_sum;
  v[k + 5] = static_cast<double>(s.z_loss_terms);
  auto sums = torch::tensor(v, torch::kDouble).to(eng.device());
  world->allreduce(sums);
  auto h = sums.cpu();
  h.narrow(0, 0, rep.moe_experts + 2).div_(eng.config().tp);
  auto at = [&](size_t i) { return h[static_cast<int64_t>(i)].item<double>(); };
  auto tokens = h.narrow(0, 0, rep.moe_experts);
  rep.moe_tokens_min = static_cast<int64_t>(tokens.min().item<double>());
  rep.moe_tokens_max = static_cast<int64_t>(tokens.max().item<double>());
  rep.moe_routed = static_cast<int64_t>(at(k));
  rep.moe_dropped = static_cast<int64_t>(at(k + 1));
  rep.moe_aux_loss = at(k + 3) > 0 ? at(k + 2) / at(k + 3) : 0.0;
  rep.moe_z_loss = at(k + 5) > 0 ? at(k + 4) / at(k + 5) : 0.0;
  // A stage without MoE layers ran none: 0 seconds and coefficients.
  auto most = torch::tensor({s.all_to_all_seconds, s.aux_loss_coef, s.z_loss_coef}, torch::kDouble).to(eng.device());
  world->allreduce(most, ReduceOp::kMax);
  const auto m = most.cpu();
  rep.all_to_all_seconds = m[0].item<double>();
  rep.moe_aux_coef = m[1].item<double>();
  rep.moe_z_coef = m[2].item<double>();
  rep.all_to_all_bytes_per_step =
      static_cast<double>(s.all_to_all_bytes) / static_cast<double>(std::max<int64_t>(eng.stats().steps, 1));
}

void gather_memory(Engine& eng, const EngineStats::Memory& s, Report& rep) {
  const int world = eng.world_size();
  const int64_t stage = eng.grid() ? eng.grid()->pp_rank() : 0;
  auto mine = torch::tensor({s.peak_rss_bytes, s.peak_activation_bytes, s.parameter_bytes, s.gradient_bytes,
                             s.optimizer_state_bytes, stage},
                            torch::kLong)
                  .to(eng.device());
  constexpr int kFields = 6;
  auto all = torch::empty({kFields * world}, mine.options());
  eng.world()->allgather(all, mine);
  auto host = all.cpu().view({world, kFields});
  rep.peak_rss_bytes.clear();
  rep.peak_activation_bytes.clear();
  rep.model_state_bytes_per_rank.clear();
  rep.pipeline_stage_per_rank.clear();
  bool measured = true;
  for (int r = 0; r < world; ++r) {
    auto v = [&](int f) { return host[r][f].item<int64_t>(); };
    rep.peak_rss_bytes.push_back(v(0));
    rep.peak_activation_bytes.push_back(v(1));
    measured = measured && rep.peak_activation_bytes.back() >= 0;
    rep.model_state_bytes_per_rank.push_back({v(2), v(3), v(4)});
    rep.pipeline_stage_per_rank.push_back(v(5));
  }
  if (!measured) rep.peak_activation_bytes.clear();
  rep.parameter_bytes = rep.model_state_bytes_per_rank[0][0];
  rep.gradient_bytes = rep.model_state_bytes_per_rank[0][1];
  rep.optimizer_state_bytes = rep.model_state_bytes_per_rank[0][2];
  rep.peak_gathered_bytes = s.peak_gathered_bytes;
  rep.zero_pool_bytes = s.pool_bytes;
  rep.zero_pool_misses = s.pool_misses;
}

// "label" padded to the report's column of values.
std::ostream& line(std::ostream& os, const std::string& label) {
  os << label;
  for (size_t i = label.size(); i < 17; ++i) os << ' ';
  return os;
}

void format_layout(std::ostringstream& os, const Report& r) {
  line(os, "model") << r.model << " (" << r.parameters << " parameters";
  if (r.trainable_parameters > 0 && r.trainable_parameters < r.parameters) {
    os << ", " << r.trainable_parameters << " trainable = " << std::fixed << std::setprecision(2)
       << 100.0 * static_cast<double>(r.trainable_parameters) / static_cast<double>(r.parameters) << " %";
    os.unsetf(std::ios::floatfield);
  }
  os << "), strategy " << r.strategy;
  if (r.shard_group > 0) os << " (shard groups of " << r.shard_group << ")";
  os << ", " << r.world_size << " worker(s), " << r.precision << "\n";
  if (r.cp > 1) {
    line(os, "layout") << "dp " << r.dp << " x cp " << r.cp << " x tp " << r.tp << " x pp " << r.pp
                       << " (data x context x tensor x pipeline parallel)\n";
  } else {
    line(os, "layout") << "dp " << r.dp << " x tp " << r.tp << " x pp " << r.pp
                       << " (data x tensor x pipeline parallel)\n";
  }
  if (r.sequence_parallel) {
    line(os, "sequence") << "split over the " << r.tp
                         << " tp ranks outside the tensor-parallel layers (--sequence-parallel: all-gathers and "
                            "reduce-scatters instead of all-reduces)\n";
  }
  if (r.pp > 1) {
    line(os, "pipeline") << r.pp << " stages";
    if (r.virtual_stages > 1) {
      os << " x " << r.virtual_stages << " virtual stages ("
         << (r.pipeline_schedule == PipelineSchedule::kZBV ? "a V: rank r holds r and 2pp-1-r"
                                                           : "chunk c of rank r: c*pp + r")
         << ")";
    }
    os << ", layers per " << (r.virtual_stages > 1 ? "virtual " : "") << "stage " << joined(r.partition, "/") << ", "
       << r.micro_batches << " micro-batches, " << to_string(r.pipeline_schedule) << "\n";
    if (!r.bubble_per_stage.empty()) {
      line(os, "bubble") << std::setprecision(2) << r.bubble_measured << " idle/compute measured (mean over stages:";
      for (size_t s = 0; s < r.bubble_per_stage.size(); ++s) os << (s ? "," : "") << " " << r.bubble_per_stage[s];
      os << "), theory " << pipeline_bubble_formula(r.pipeline_schedule) << " = " << r.bubble_theory
         << "; most micro-batches alive per stage: " << joined(r.peak_live_micro_batches, ", ") << "\n";
    }
  }
  if (r.activation_checkpointing != "none") {
    line(os, "recomputation") << (r.activation_checkpointing == "every" ? std::string("the activations of every layer")
                                  : r.activation_checkpointing == "selective"
                                      ? std::string("selective: every transformer layer's attention core, and a Llama "
                                                    "layer's RMSNorms and SwiGLU (the projections' outputs kept)")
                                      : "the activations of the first " + r.activation_checkpointing + " layer(s)" +
                                            (r.pp > 1 ? " of each stage" : ""))
                              << ", recomputed in backward: " << std::setprecision(2) << r.recompute_seconds << " s";
    if (r.wall_seconds > 0) os << " (" << std::setprecision(1) << 100.0 * r.recompute_seconds / r.wall_seconds << "%";
    os << (r.wall_seconds > 0 ? " of the loop)\n" : "\n");
  }
  for (const auto& [label, text] : r.context) line(os, label) << text << "\n";
}

void format_loop(std::ostringstream& os, const Report& r) {
  line(os, "steps") << r.steps << " (global batch " << r.global_batch << ", " << r.samples << " samples";
  if (r.grad_accum > 1) {
    os << "; gradient accumulation: " << r.grad_accum << " micro-batches of about "
       << r.global_batch / std::max(r.dp, 1) / r.grad_accum << " per replica and step";
  }
  os << ")\n";
  line(os, "wall time") << std::setprecision(1) << r.wall_seconds << " s (training loop)\n";
  line(os, "throughput") << std::setprecision(0) << r.samples_per_second << " samples/s, median step "
                         << std::setprecision(1) << r.step_ms_median << " ms\n";
  if (!r.batch_shares.empty()) {
    line(os, "batch shares") << joined(r.batch_shares, "/") << " samples per step (" << r.batch_shares_mode;
    if (r.batch_shares_mode == "auto") {
      if (r.calibrated_samples_per_second.empty()) {
        os << ", not calibrated: the run ended before the calibration steps";
      } else {
        os << ", calibrated from forward rates " << joined(r.calibrated_samples_per_second, "/") << " samples/s";
      }
    }
    os << ")\n";
    line(os, "rank throughput") << std::setprecision(0);
    for (size_t k = 0; k < r.rank_samples_per_second.size(); ++k) {
      os << (k ? ", " : "") << "rank " << k << " " << r.rank_samples_per_second[k] << " samples/s (forward "
         << r.rank_forward_samples_per_second[k] << ")";
    }
    os << "\n";
  }
  if (r.speedup > 0) {
    line(os, "speedup") << std::setprecision(2) << r.speedup << "x against one worker (" << std::setprecision(0)
                        << r.baseline_samples_per_second << " samples/s), efficiency "
                        << 100.0 * r.speedup / r.world_size << "%\n";
  }
  line(os, "final loss") << std::setprecision(6) << r.final_loss << "\n";
}

void format_evaluation(std::ostringstream& os, const Report& r) {
  if (r.eval_loss >= 0) {
    line(os, "validation loss") << std::setprecision(6) << r.eval_loss << " per token (perplexity "
                                << std::setprecision(1) << std::exp(r.eval_loss) << ")\n";
  }
  if (r.test_accuracy >= 0) {
    line(os, "test accuracy") << std::setprecision(2) << 100.0 * r.test_accuracy << "% (" << r.test_samples << " "
                              << r.test_unit << ")\n";
    os << r.evaluation_detail;
  }
}

void format_plan_memory(std::ostringstream& os, const Report& r) {
  auto four = [&](const std::vector<double>& p) -> std::ostream& {
    return os << std::setprecision(2) << "parameters " << p[0] / kMiB << " MiB, gradients " << p[1] / kMiB
              << " MiB, optimizer state " << p[2] / kMiB << " MiB, activations " << p[3] / kMiB << " MiB";
  };
  if (!r.plan_memory_bytes_per_stage.empty()) {
    for (size_t s = 0; s < r.plan_memory_bytes_per_stage.size(); ++s) {
      line(os, s ? "" : "plan predicts") << "stage " << s << ": ";
      four(r.plan_memory_bytes_per_stage[s]) << (s ? "\n" : " (tandem plan's model of this layout)\n");
    }
  } else if (r.plan_memory_bytes.size() == 4) {
    line(os, "plan predicts");
    four(r.plan_memory_bytes) << " per rank (tandem plan's model of this layout)\n";
  }
}

// Rank 0's model state, or every rank's where they differ (pipeline stages, uneven shards).
void format_model_state(std::ostringstream& os, const Report& r) {
  const auto& all = r.model_state_bytes_per_rank;
  const bool same = std::all_of(all.begin(), all.end(), [&](const auto& v) { return v == all.front(); });
  const std::string masters = r.precision != "fp32" ? " incl. fp32 masters" : "";
  auto three = [&](int64_t p, int64_t g, int64_t o) -> std::ostream& {
    return os << std::setprecision(2) << "parameters " << p / kMiB << " MiB, gradients " << g / kMiB
              << " MiB, optimizer state " << o / kMiB << " MiB";
  };
  if (same || all.size() != r.pipeline_stage_per_rank.size()) {
    line(os, "model state");
    three(r.parameter_bytes, r.gradient_bytes, r.optimizer_state_bytes)
        << masters << (same ? " (every rank)\n" : " (rank 0)\n");
    return;
  }
  for (size_t i = 0; i < all.size(); ++i) {
    line(os, i ? "" : "model state") << "rank " << i << " (stage " << r.pipeline_stage_per_rank[i] << "): ";
    three(all[i][0], all[i][1], all[i][2]) << (i ? "\n" : masters + "\n");
  }
}

void format_memory(std::ostringstream& os, const Report& r) {
  line(os, "peak memory") << std::setprecision(0);
  for (size_t i = 0; i < r.peak_rss_bytes.size(); ++i) {
    os << (i ? ", " : "") << "rank " << i << " " << r.peak_rss_bytes[i] / kMiB << " MiB";
  }
  os << "\n";
  if (!r.peak_activation_bytes.empty()) {
    line(os, "activations") << std::setprecision(1);
    for (size_t i = 0; i < r.peak_activation_bytes.size(); ++i) {
      os << (i ? ", " : "") << "rank " << i << " " << static_cast<double>(r.peak_activation_bytes[i]) / kMiB << " MiB";
    }
    os << " at most above a step's start (measured: activations and the step's transient buffers)\n";
  }
  format_plan_memory(os, r);
  format_model_state(os, r);
  if (r.peak_gathered_bytes > 0) {
    line(os, "gathered (zero3)") << r.peak_gathered_bytes / kMiB << " MiB of full parameters alive at most (rank 0)\n";
  }
  if (r.zero_pool_bytes > 0) {
    line(os, "zero block") << r.zero_pool_bytes / kMiB << " MiB of shared memory for scratch"
                           << (r.peak_gathered_bytes > 0 ? " and gathered units" : "") << ", " << r.zero_pool_misses
                           << " buffer(s) outside it"
                           << (r.zero_pool_misses > 0 ? " (their collectives go through MPI's fifos, slower)" : "")
                           << " (rank 0)\n";
  }
}

// A communicator group as the traffic line names it.
std::string group_label(const std::string& group, const Report& r) {
  if (group == "shard") return "within each shard group of " + std::to_string(r.shard_group);
  if (group == "replicate") {
    return "across the " + std::to_string(r.shard_group > 0 ? r.dp / r.shard_group : 0) + " groups";
  }
  return group;
}

void format_communication(std::ostringstream& os, const Report& r) {
  if (r.checkpoints_saved > 0) {
    line(os, "checkpoints") << r.checkpoints_saved << " saved ("
                            << (r.checkpoint_async ? "asynchronous" : "synchronous") << "), training held "
                            << std::setprecision(1)
                            << 1e3 * r.checkpoint_stall_seconds / static_cast<double>(r.checkpoints_saved)
                            << " ms per save (rank 0)\n";
  }
  if (r.precision == "fp16") {
    line(os, "loss scale") << std::setprecision(0) << r.loss_scale << ", " << r.skipped_steps
                           << " step(s) skipped on overflow\n";
  }
  if (r.world_size > 1 && !r.comm_bytes_per_step.empty()) {
    line(os, "traffic per step") << std::setprecision(2) << r.wire_bytes_per_step / kMiB
                                 << " MiB on the wire per rank (ring model); payload:";
    for (const auto& [op, b] : r.comm_bytes_per_step) os << " " << op << " " << b / kMiB << " MiB";
    os << "\n";
  }
  if (r.world_size > 1 && r.comm_group_bytes_per_step.size() > 1) {
    auto& out = line(os, "traffic by group") << std::setprecision(2);
    // Hybrid sharding's two groups first: within a shard group, then across the groups.
    std::vector<std::string> order;
    for (const char* g : {"shard", "replicate"})
      if (r.comm_group_bytes_per_step.count(g)) order.emplace_back(g);
    for (const auto& kv : r.comm_group_bytes_per_step)
      if (kv.first != "shard" && kv.first != "replicate") order.push_back(kv.first);
    const char* sep = "";
    for (const auto& group : order) {
      out << sep << group_label(group, r) << ":";
      for (const auto& [op, b] : r.comm_group_bytes_per_step.at(group)) out << " " << op << " " << b / kMiB << " MiB";
      sep = "; ";
    }
    out << "\n";
  }
  if (r.moe_experts > 0) {
    line(os, "routing") << r.moe_tokens_min << " to " << r.moe_tokens_max << " token slots per expert of "
                        << r.moe_experts << " (least and most loaded, all layers and steps"
                        << (r.ep > 1 ? ", experts over --ep " + std::to_string(r.ep) : std::string()) << "), "
                        << r.moe_dropped << " of " << r.moe_routed << " dropped; mean aux loss " << std::setprecision(4)
                        << r.moe_aux_loss;
    if (r.moe_z_loss > 0) os << ", z-loss " << r.moe_z_loss;
    os << "\n";
    if (r.ep > 1) {
      line(os, "all-to-all") << std::setprecision(2) << r.all_to_all_seconds << " s dispatching and combining tokens ("
                             << std::setprecision(2) << r.all_to_all_bytes_per_step / kMiB
                             << " MiB sent per rank and step; the slowest rank's seconds)\n";
    }
  }
  if (r.cp > 1 && r.ring_bytes > 0) {
    line(os, "ring attention") << std::setprecision(2) << r.ring_seconds << " s key/value transfers ("
                               << std::setprecision(1) << r.ring_bytes / kMiB << " MiB sent), " << std::setprecision(2)
                               << r.ring_exposed_seconds << " s exposed, " << std::setprecision(0)
                               << 100.0 * r.ring_hidden_fraction << "% hidden behind the attention blocks\n";
  }
  if (r.dp > 1 && r.pp == 1 && r.comm_bytes > 0) {  // DDP's own counters
    line(os, "communication") << std::setprecision(2) << r.comm_seconds << " s all-reduce (" << std::setprecision(1)
                              << r.comm_bytes / kMiB << " MiB), " << std::setprecision(2) << r.exposed_comm_seconds
                              << " s exposed, " << std::setprecision(0) << 100.0 * r.hidden_fraction
                              << "% hidden behind backward\n";
  }
}

}  // namespace

void describe_engine(const Engine& eng, Report& rep) {
  const ParallelConfig& pc = eng.config();
  rep.strategy = to_string(pc.strategy);
  rep.shard_group = is_hybrid(pc.strategy) ? pc.shard_group : 0;
  rep.precision = precision_name(pc.precision);
  rep.world_size = eng.world_size();
  rep.dp = eng.dp_size();
  rep.tp = pc.tp;
  rep.pp = pc.pp;
  rep.cp = pc.cp;
  rep.ep = pc.ep;
  rep.sequence_parallel = pc.sequence_parallel;
  rep.parameters = eng.parameters();
  rep.trainable_parameters = eng.trainable_parameters();
  rep.grad_accum = pc.grad_accum;
  rep.micro_batches = pc.micro_batches;
  rep.pipeline_schedule = pc.schedule;
  rep.virtual_stages = pipeline_chunks(pc.schedule, pc.virtual_stages);
  rep.partition = eng.partition();
  rep.activation_checkpointing = to_string(pc.activation_checkpointing);
}

StepMeter::StepMeter(const Engine& engine) : engine_(engine), comm_seconds_(engine.stats().comm.seconds) {}

StepFigures StepMeter::next(double step_ms, int64_t samples) {
  const EngineStats s = engine_.stats();
  StepFigures f;
  f.lr = engine_.lr();
  f.samples_per_second = step_ms > 0 ? static_cast<double>(samples) * 1000.0 / step_ms : 0.0;
  const double norm = engine_.last_grad_norm();
  f.grad_norm = std::isfinite(norm) && norm >= 0 ? norm : -1.0;  // an fp16 overflow's is inf
  f.loss_scale = s.scaler.scale;
  f.peak_rss_bytes = s.memory.peak_rss_bytes;
  f.comm_share = step_ms > 0 ? (s.comm.seconds - comm_seconds_) * 1000.0 / step_ms : 0.0;
  comm_seconds_ = s.comm.seconds;
  return f;
}

void record_loop(Report& rep, int64_t steps, int64_t samples, double wall_seconds, const std::vector<double>& step_ms) {
  rep.steps = steps;
  rep.samples = samples;
  rep.wall_seconds = wall_seconds;
  rep.step_ms = step_ms;
  rep.samples_per_second = wall_seconds > 0 ? samples / wall_seconds : 0.0;
  rep.step_ms_median = 0.0;
  if (step_ms.size() > 1) {
    std::vector<double> s(step_ms.begin() + 1, step_ms.end());
    std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
    rep.step_ms_median = s[s.size() / 2];
  } else if (!step_ms.empty()) {
    rep.step_ms_median = step_ms[0];
  }
  // From the median step: robust to the first step and a short last batch.
  rep.speedup = 0.0;
  if (rep.baseline_samples_per_second > 0 && rep.step_ms_median > 0) {
    rep.speedup = (rep.global_batch * 1000.0 / rep.step_ms_median) / rep.baseline_samples_per_second;
  }
}

void collect_engine_report(Engine& eng, Report& rep) { collect_engine_report(eng, eng.stats(), rep); }

void collect_engine_report(Engine& eng, const EngineStats& s, Report& rep) {
  const double steps = static_cast<double>(std::max<int64_t>(s.steps, 1));
  rep.comm_bytes_per_step.clear();
  for (const auto& [op, d] : s.comm.ops) rep.comm_bytes_per_step[op] = d.bytes / steps;
  rep.comm_group_bytes_per_step.clear();
  for (const auto& [group, ops] : s.comm.groups)
    for (const auto& [op, d] : ops) rep.comm_group_bytes_per_step[group][op] = d.bytes / steps;
  rep.wire_bytes_per_step = s.comm.wire_bytes / steps;
  rep.comm_engine_seconds = s.comm.seconds;
  rep.recompute_seconds = s.recompute_seconds;
  rep.loss_scale = s.scaler.scale;
  rep.skipped_steps = s.scaler.skipped_steps;
  rep.checkpoints_saved = s.checkpoints.saved;
  rep.checkpoint_stall_seconds = s.checkpoints.stall_seconds;
  rep.comm_seconds = s.ddp.comm_seconds;
  rep.exposed_comm_seconds = s.ddp.exposed_seconds;
  rep.hidden_fraction = s.ddp.hidden_fraction;
  rep.comm_bytes = s.ddp.bytes;
  rep.ring_seconds = s.cp.transfer_seconds;
  rep.ring_exposed_seconds = s.cp.exposed_seconds;
  rep.ring_hidden_fraction = s.cp.hidden_fraction;
  rep.ring_bytes = s.cp.bytes;
  if (eng.config().pp > 1) gather_pipeline(eng, s.pipeline, rep);
  gather_memory(eng, eng.stats().memory, rep);
  gather_moe(eng, s.moe, rep);
}

std::string format_report(const Report& r) {
  std::ostringstream os;
  os << std::fixed;
  os << "\n== tandem " << r.command << " report ==\n";
  format_layout(os, r);
  format_loop(os, r);
  format_evaluation(os, r);
  format_memory(os, r);
  format_communication(os, r);
  return os.str();
}

std::string report_json(const Report& r) {
  nlohmann::json j = {{"report", true},
                      {"command", r.command},
                      {"model", r.model},
                      {"strategy", r.strategy},
                      {"precision", r.precision},
                      {"world_size", r.world_size},
                      {"dp", r.dp},
                      {"tp", r.tp},
                      {"pp", r.pp},
                      {"cp", r.cp},
                      {"sequence_parallel", r.sequence_parallel},
                      {"layout", "dp " + std::to_string(r.dp) +
                                     (r.cp > 1 ? " x cp " + std::to_string(r.cp) : std::string()) + " x tp " +
                                     std::to_string(r.tp) + " x pp " + std::to_string(r.pp)},
                      {"parameters", r.parameters},
                      {"trainable_parameters", r.trainable_parameters},
                      {"global_batch", r.global_batch},
                      {"grad_accum", r.grad_accum},
                      {"activation_checkpointing", r.activation_checkpointing},
                      {"recompute_seconds", r.recompute_seconds},
                      {"first_step", r.first_step},
                      {"steps", r.steps},
                      {"samples", r.samples},
                      {"wall_seconds", r.wall_seconds},
                      {"samples_per_second", r.samples_per_second},
                      {"step_ms_median", r.step_ms_median},
                      {"speedup", r.speedup},
                      {"final_loss", r.final_loss},
                      {"eval_loss", r.eval_loss},
                      {"test_accuracy", r.test_accuracy},
                      {"test_samples", r.test_samples},
                      {"peak_rss_bytes", r.peak_rss_bytes},
                      {"peak_activation_bytes", r.peak_activation_bytes},
                      {"plan_memory_bytes", r.plan_memory_bytes},
                      {"plan_memory_bytes_per_stage", r.plan_memory_bytes_per_stage},
                      {"model_state_bytes_per_rank", r.model_state_bytes_per_rank},
                      {"pipeline_stage_per_rank", r.pipeline_stage_per_rank},
                      {"parameter_bytes", r.parameter_bytes},
                      {"gradient_bytes", r.gradient_bytes},
                      {"optimizer_state_bytes", r.optimizer_state_bytes},
                      {"peak_gathered_bytes", r.peak_gathered_bytes},
                      {"zero_pool_bytes", r.zero_pool_bytes},
                      {"zero_pool_misses", r.zero_pool_misses},
                      {"loss_scale", r.loss_scale},
                      {"skipped_steps", r.skipped_steps},
                      {"checkpoints_saved", r.checkpoints_saved},
                      {"checkpoint_stall_seconds", r.checkpoint_stall_seconds},
                      {"checkpoint_async", r.checkpoint_async},
                      {"comm_bytes_per_step", r.comm_bytes_per_step},
                      {"comm_group_bytes_per_step", r.comm_group_bytes_per_step},
                      {"shard_group", r.shard_group},
                      {"wire_bytes_per_step", r.wire_bytes_per_step},
                      {"comm_engine_seconds", r.comm_engine_seconds},
                      {"comm_seconds", r.comm_seconds},
                      {"exposed_comm_seconds", r.exposed_comm_seconds},
                      {"hidden_fraction", r.hidden_fraction},
                      {"ring_seconds", r.ring_seconds},
                      {"ring_exposed_seconds", r.ring_exposed_seconds},
                      {"ring_hidden_fraction", r.ring_hidden_fraction},
                      {"ring_bytes", r.ring_bytes},
                      {"comm_bytes", r.comm_bytes}};
  if (r.moe_experts > 0) {
    j["ep"] = r.ep;
    j["moe"] = {{"experts", r.moe_experts},
                {"tokens_per_expert_min", r.moe_tokens_min},
                {"tokens_per_expert_max", r.moe_tokens_max},
                {"routed", r.moe_routed},
                {"dropped", r.moe_dropped},
                {"aux_loss", r.moe_aux_loss},
                {"z_loss", r.moe_z_loss},
                {"aux_loss_coef", r.moe_aux_coef},
                {"z_loss_coef", r.moe_z_coef},
                {"all_to_all_seconds", r.all_to_all_seconds},
                {"all_to_all_bytes_per_step", r.all_to_all_bytes_per_step}};
  }
  if (r.pp > 1) {
    j["micro_batches"] = r.micro_batches;
    j["pipeline_schedule"] = to_string(r.pipeline_schedule);
    j["virtual_stages"] = r.virtual_stages;
    j["partition"] = r.partition;
    j["bubble_per_stage"] = r.bubble_per_stage;
    j["pipeline_step_ms_per_stage"] = r.pipeline_step_ms_per_stage;
    j["pipeline_compute_ms_per_stage"] = r.pipeline_compute_ms_per_stage;
    j["bubble_measured"] = r.bubble_measured;
    j["bubble_theory"] = r.bubble_theory;
    j["peak_live_micro_batches"] = r.peak_live_micro_batches;
  }
  if (!r.batch_shares.empty()) {
    j["batch_shares_mode"] = r.batch_shares_mode;
    j["batch_shares"] = r.batch_shares;
    j["calibrated_samples_per_second"] = r.calibrated_samples_per_second;
    j["rank_samples_per_second"] = r.rank_samples_per_second;
    j["rank_forward_samples_per_second"] = r.rank_forward_samples_per_second;
  }
  return j.dump();
}

void write_metrics(const std::string& path, const Report& rep) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot write metrics to '" + path + "'; check the directory exists");
  for (size_t i = 0; i < rep.losses.size(); ++i) {
    nlohmann::json line{{"step", rep.first_step + static_cast<int64_t>(i) + 1},
                        {"loss", rep.losses[i]},
                        {"step_ms", i < rep.step_ms.size() ? rep.step_ms[i] : 0.0}};
    if (i < rep.step_figures.size()) {
      const StepFigures& s = rep.step_figures[i];
      line["lr"] = s.lr;
      line["samples_per_second"] = s.samples_per_second;
      if (s.grad_norm >= 0) line["grad_norm"] = s.grad_norm;
      line["loss_scale"] = s.loss_scale;
      line["peak_rss_bytes"] = s.peak_rss_bytes;
      line["comm_share"] = s.comm_share;
      if (s.aux_loss >= 0) line["aux_loss"] = s.aux_loss;
      if (s.z_loss >= 0) line["z_loss"] = s.z_loss;
    }
    f << line.dump() << '\n';
  }
  f << report_json(rep) << '\n';
  if (!f) throw std::runtime_error("writing metrics to '" + path + "' failed (disk full?)");
}

}  // namespace tandem
