// tandem plan's memory model for a run's own layout, beside the measured figures of its report
// (tandem/report.h): what tandem train, pretrain and finetune print as "plan predicts".
#include <algorithm>
#include <string>
#include <vector>

#include "tandem/engine.h"
#include "tandem/plan.h"
#include "tandem/report.h"

namespace tandem::plan {

void add_planned_memory(const ModelSpec& model, const ParallelConfig& pc, int world, int64_t global_batch,
                        const std::string& optimizer, const std::vector<int64_t>& partition, Report& rep) {
  // A replica spans tp x pp x cp ranks; the cp ranks' share of each sequence, their ZeRO group
  // (dp x cp) and their ring are estimate()'s (plan::Layout).
  if (pc.tp * pc.pp * pc.cp < 1 || world % (pc.tp * pc.pp * pc.cp) != 0) return;
  const int dp = data_parallel_size(pc, world);
  PlanOptions o;
  o.global_batch = global_batch;
  o.optimizer = optimizer;
  o.precision = pc.precision == Precision::kFP32 ? "fp32" : "mixed";
  // The model counts whole-layer recomputation; selective keeps most of a layer's activations,
  // so it is estimated as none (an upper bound).
  o.activation_checkpointing = pc.activation_checkpointing.enabled() &&
                               pc.activation_checkpointing.mode != ActivationCheckpointing::Mode::kSelective;
  o.sequence_parallel = pc.sequence_parallel;
  Layout l;
  l.dp = dp;
  l.tp = pc.tp;
  l.pp = pc.pp;
  l.cp = pc.cp;
  l.ep = pc.ep;
  l.zero = zero_stage(pc.strategy);
  l.micro_batches = pc.pp > 1 ? pc.micro_batches : pc.grad_accum;
  l.micro_batch = std::max<int64_t>(1, global_batch / dp / l.micro_batches);
  // hsdp, hsdp2: a rank holds what ZeRO over its shard group holds (the group the Engine
  // resolved, which the report carries when the flag left it to the hosts).
  if (is_hybrid(pc.strategy)) {
    l.dp = pc.shard_group > 0 ? pc.shard_group : rep.shard_group;
    if (l.dp < 1) return;
  }
  ClusterSpec c = cluster_preset("local");
  c.groups.at(0).devices_per_node = std::max(c.groups.at(0).devices_per_node, world);
  if (pc.pp > 1 && pc.virtual_stages == 1 && static_cast<int>(partition.size()) == pc.pp) {
    o.pipeline_partition.clear();
    for (int64_t k : partition) o.pipeline_partition += (o.pipeline_partition.empty() ? "" : ",") + std::to_string(k);
    o.pipeline_schedule = pc.schedule;
  }
  Estimate e;
  try {
    e = estimate(model, c, l, o);
  } catch (const std::exception&) {
    return;  // a setting the planner does not model (an optimizer it does not know)
  }
  auto four = [](const MemoryBreakdown& b) {
    return std::vector<double>{b.parameters, b.gradients, b.optimizer, b.activations};
  };
  rep.plan_memory_bytes = four(e.memory);
  rep.plan_memory_bytes_per_stage.clear();
  for (const auto& s : e.stage_memory) rep.plan_memory_bytes_per_stage.push_back(four(s));
}

}  // namespace tandem::plan
