// The Engine's typed configuration: the one place where strategy, compression and partition
// names are read, and the checks of a layout against the world size and the global batch.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "tandem/accumulate.h"
#include "tandem/engine.h"
#include "tandem/pipeline_schedule.h"

namespace tandem {

Strategy parse_strategy(const std::string& name) {
  static const std::pair<const char*, Strategy> kNames[] = {
      {"single", Strategy::kSingle}, {"ddp", Strategy::kDDP},     {"zero1", Strategy::kZero1},
      {"zero2", Strategy::kZero2},   {"zero3", Strategy::kZero3}, {"hsdp", Strategy::kHsdp},
      {"hsdp2", Strategy::kHsdp2},
  };
  for (const auto& [n, s] : kNames) {
    if (name == n) return s;
  }
  throw std::invalid_argument("unknown strategy '" + name +
                              "' (this build supports: single, ddp, zero1, zero2, zero3, hsdp, hsdp2)");
}

const char* to_string(Strategy s) {
  switch (s) {
    case Strategy::kSingle: return "single";
    case Strategy::kDDP: return "ddp";
    case Strategy::kZero1: return "zero1";
    case Strategy::kZero2: return "zero2";
    case Strategy::kZero3: return "zero3";
    case Strategy::kHsdp: return "hsdp";
    case Strategy::kHsdp2: return "hsdp2";
  }
  return "?";
}

int zero_stage(Strategy s) {
  switch (s) {
    case Strategy::kZero1: return 1;
    case Strategy::kZero2:
    case Strategy::kHsdp2: return 2;
    case Strategy::kZero3:
    case Strategy::kHsdp: return 3;
    default: return 0;
  }
}

Compression parse_compression(const std::string& name) {
  if (name == "none") return Compression::kNone;
  if (name == "bf16") return Compression::kBF16;
  if (name == "fp16") return Compression::kFP16;
  if (name == "powersgd") return Compression::kPowerSGD;
  throw std::invalid_argument("--compress must be none, bf16, fp16 or powersgd, not '" + name + "'");
}

const char* to_string(Compression c) {
  switch (c) {
    case Compression::kNone: return "none";
    case Compression::kBF16: return "bf16";
    case Compression::kFP16: return "fp16";
    case Compression::kPowerSGD: return "powersgd";
  }
  return "?";
}

Partition parse_partition(const std::string& text, int stages) {
  Partition p;
  if (text == "params") return p;
  if (text == "time") {
    p.method = PartitionMethod::kTime;
    return p;
  }
  p.method = PartitionMethod::kLayers;
  p.layers = parse_partition_option(text, stages);  // throws naming the option
  return p;
}

std::string to_string(const Partition& p) {
  switch (p.method) {
    case PartitionMethod::kParameters: return "params";
    case PartitionMethod::kTime: return "time";
    case PartitionMethod::kLayers: break;
  }
  std::string s;
  for (auto n : p.layers) s += (s.empty() ? "" : ",") + std::to_string(n);
  return s;
}

double LrSchedule::at(double step) const {
  const auto warmup = static_cast<double>(warmup_steps);
  if (warmup_steps > 0 && step < warmup)
    return warmup_start + (peak - warmup_start) * std::min(1.0, (step + 1) / warmup);
  if (!cosine) return peak;
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  const double t = std::min(1.0, (step - warmup) / span);
  const double c = 0.5 * (1.0 + std::cos(M_PI * t));
  return min_ratio == 0.0 ? peak * c : peak * (min_ratio + (1.0 - min_ratio) * c);
}

int data_parallel_size(const ParallelConfig& c, int world) { return world / std::max(1, c.tp * c.pp * c.cp); }

namespace {

// The interleaved schedule and its virtual stages (model chunks per pipeline rank).
void validate_virtual_stages(const ParallelConfig& c) {
  const std::string v = "--virtual-stages " + std::to_string(c.virtual_stages);
  if (c.virtual_stages < 1) throw std::invalid_argument(v + ": give 1 or more model chunks per pipeline rank");
  const bool interleaved = c.schedule == PipelineSchedule::kInterleaved;
  if (c.schedule == PipelineSchedule::kZBV) {
    if (c.virtual_stages > 2) {
      throw std::invalid_argument(v + ": --pipeline-schedule zb-v runs two model chunks per rank in a V (rank r "
                                      "holding virtual stages r and 2pp-1-r); use --virtual-stages 2 or leave it out");
    }
    if (c.pp < 2) throw std::invalid_argument("--pipeline-schedule zb-v needs --pp 2 or more");
    return;
  }
  if (c.virtual_stages > 1 && !interleaved) {
    throw std::invalid_argument(
        v + " needs --pipeline-schedule interleaved (" + to_string(c.schedule) +
        " runs one chunk per rank); use --virtual-stages 1, the interleaved schedule, or zb-v with 2");
  }
  if (!interleaved) return;
  check_interleaved(c.pp, c.virtual_stages, c.micro_batches);  // --pp >= 2, --micro-batches a multiple of --pp
}

// The model-parallel part: the grid against the world size and what composes with it.
void validate_layout(const ParallelConfig& c, int world) {
  if (c.tp < 1 || c.pp < 1 || c.cp < 1) {
    throw std::invalid_argument("--tp, --pp and --cp must be at least 1, got --tp " + std::to_string(c.tp) + " --pp " +
                                std::to_string(c.pp) + " --cp " + std::to_string(c.cp));
  }
  if (c.micro_batches < 1) throw std::invalid_argument("--micro-batches must be at least 1");
  if (c.sequence_parallel && c.tp < 2) {
    throw std::invalid_argument("--sequence-parallel splits the sequence over the tensor-parallel ranks and needs "
                                "--tp 2 or more (got --tp " +
                                std::to_string(c.tp) + "); add --tp or drop it");
  }
  validate_virtual_stages(c);
  const int chunks = pipeline_chunks(c.schedule, c.virtual_stages);
  const int64_t cuts = static_cast<int64_t>(c.pp) * chunks;
  // Without a pipeline nothing is cut, and a partition goes unused.
  if (c.pp > 1 && c.partition.method == PartitionMethod::kLayers &&
      static_cast<int64_t>(c.partition.layers.size()) != cuts) {
    throw std::invalid_argument("--pp-partition lists " + std::to_string(c.partition.layers.size()) +
                                " stage(s) for --pp " + std::to_string(c.pp) +
                                (c.schedule == PipelineSchedule::kZBV ? std::string(" x 2 chunks per rank (zb-v)")
                                 : chunks > 1                         ? " x --virtual-stages " + std::to_string(chunks)
                                                                      : std::string()) +
                                "; give " + std::to_string(cuts) + " layer counts");
  }
  if (is_single(c.strategy) && world != 1) {
    throw std::invalid_argument("--strategy single runs one worker, but " + std::to_string(world) +
                                " were launched; use -n 1 or --strategy ddp");
  }
  const int per_replica = c.tp * c.pp * c.cp;
  if (per_replica == 1) return;
  const std::string layout = "--tp " + std::to_string(c.tp) + " x --pp " + std::to_string(c.pp) +
                             (c.cp > 1 ? " x --cp " + std::to_string(c.cp) : std::string());
  if (world % per_replica != 0) {
    throw std::invalid_argument(layout + " = " + std::to_string(per_replica) +
                                " ranks per replica does not divide the " + std::to_string(world) +
                                " workers; use -n a multiple of " + std::to_string(per_replica));
  }
  // Every strategy but single composes with tp and pp over the data-parallel ranks. Under a
  // pipeline ZeRO-2 and 3 reduce-scatter after every micro-batch's backward (and ZeRO-3 gathers
  // each layer per micro-batch), which DeepSpeed refuses for its cost; here it is the user's call.
  if (is_single(c.strategy)) {
    throw std::invalid_argument(layout + " composes with --strategy ddp, zero1, zero2 or zero3 over the "
                                         "data-parallel ranks, not single (one worker)");
  }
  if (c.pp > 1 && c.compress != Compression::kNone) {
    throw std::invalid_argument("--pp " + std::to_string(c.pp) +
                                ": pipeline gradients are averaged in one uncompressed all-reduce; drop --compress");
  }
}

// Hybrid sharding: the shard group against the data-parallel size. The default (0, ranks per
// host) is resolved and checked where the hosts are known (the Engine).
void validate_shard_group(const ParallelConfig& c, int world) {
  const std::string g = "--shard-group " + std::to_string(c.shard_group);
  if (!is_hybrid(c.strategy)) {
    if (c.shard_group != 0) {
      throw std::invalid_argument(g + " applies to --strategy hsdp or hsdp2 only (" + to_string(c.strategy) +
                                  " shards over all the data-parallel ranks or none); drop it or use --strategy hsdp");
    }
    return;
  }
  if (c.shard_group < 0) throw std::invalid_argument(g + ": give 1 or more ranks per shard group (0: ranks per host)");
  if (c.tp * c.pp * c.cp > 1) {
    throw std::invalid_argument(std::string("--strategy ") + to_string(c.strategy) +
                                " shards over the data-parallel ranks alone; use it with --tp 1 --pp 1 --cp 1, or "
                                "zero2/zero3 with the model-parallel layout");
  }
  const int dp = data_parallel_size(c, world);
  if (c.shard_group > 0 && dp % c.shard_group != 0) {
    throw std::invalid_argument(g + " does not divide the " + std::to_string(dp) +
                                " data-parallel ranks; give a divisor of " + std::to_string(dp) +
                                " (shard groups of G ranks, " + std::to_string(dp) + " / G replicas)");
  }
}

// Expert parallelism: its group against the data-parallel size, and what it does not compose with.
void validate_expert_parallel(const ParallelConfig& c, int world) {
  const std::string e = "--ep " + std::to_string(c.ep);
  if (c.ep < 1) throw std::invalid_argument(e + ": give 1 or more ranks per expert-parallel group");
  if (c.ep == 1) return;
  const int dp = data_parallel_size(c, world);
  if (dp % c.ep != 0) {
    throw std::invalid_argument(e + " does not divide the " + std::to_string(dp) +
                                " data-parallel ranks; give a divisor of " + std::to_string(dp) +
                                " (the experts spread over groups of ep data-parallel ranks)");
  }
  auto refuse = [&](const std::string& what, const std::string& why) {
    throw std::invalid_argument(e + " does not compose with " + what + ": " + why);
  };
  if (c.cp > 1) {
    refuse("--cp " + std::to_string(c.cp),
           "the load-balancing loss would be over parts of sequences, not a micro-batch's tokens; use --cp 1");
  }
}

void validate_batch(const ParallelConfig& c, int world, int64_t batch) {
  const int dp = data_parallel_size(c, world);
  if (c.tp * c.pp * c.cp > 1 && batch % dp != 0) {
    throw std::invalid_argument("--batch " + std::to_string(batch) + " (global) does not split evenly over " +
                                std::to_string(dp) + " data-parallel replicas (" + std::to_string(world) +
                                " workers / (--tp " + std::to_string(c.tp) + " x --pp " + std::to_string(c.pp) +
                                " x --cp " + std::to_string(c.cp) + ")); use a multiple of " + std::to_string(dp));
  }
  if (c.pp > 1 && (batch / dp) % c.micro_batches != 0) {
    throw std::invalid_argument("--batch " + std::to_string(batch) + " gives each of the " + std::to_string(dp) +
                                " data-parallel replicas " + std::to_string(batch / dp) +
                                " samples, not divisible into " + std::to_string(c.micro_batches) +
                                " micro-batches; use a --batch multiple of " + std::to_string(dp * c.micro_batches));
  }
}

void validate_powersgd(const PowerSGDOptions& o) {
  if (o.rank < 1) {
    throw std::invalid_argument("--powersgd-rank must be at least 1 (got " + std::to_string(o.rank) +
                                "): the rank of each gradient's approximation, e.g. 4");
  }
  if (o.start_step < 0) {
    throw std::invalid_argument("--powersgd-start-step must be >= 0 (got " + std::to_string(o.start_step) +
                                "): the uncompressed steps before PowerSGD starts");
  }
}

}  // namespace

void validate(const ParallelConfig& c, int world, int64_t global_batch) {
  if (world < 1) throw std::invalid_argument("the world size must be at least 1");
  validate_layout(c, world);
  validate_shard_group(c, world);
  validate_expert_parallel(c, world);
  // Without a batch, only the settings themselves are checked (a batch of grad_accum rows per replica).
  const int dp = data_parallel_size(c, world);
  validate_grad_accum(c.grad_accum, c.pp, c.micro_batches, global_batch > 0 ? global_batch : c.grad_accum * dp, dp);
  if (c.max_grad_norm < 0) throw std::invalid_argument("--max-grad-norm must be >= 0 (0: no clipping)");
  if (c.compress != Compression::kNone && c.precision != Precision::kFP32) {
    throw std::invalid_argument(std::string("--compress ") + to_string(c.compress) +
                                " compresses fp32 gradients; with --precision " + precision_name(c.precision) +
                                " they already travel in " + precision_name(c.precision) + " (drop --compress)");
  }
  if (c.compress == Compression::kPowerSGD) validate_powersgd(c.powersgd);
  if (!is_ddp(c.strategy) && c.compress != Compression::kNone) {
    throw std::invalid_argument(std::string("--compress applies to --strategy ddp only (") + to_string(c.strategy) +
                                " does not compress gradients); drop --compress or use --strategy ddp");
  }
  if (c.bucket_mb < 0) throw std::invalid_argument("--bucket-mb must be at least 1 (0 in the library: the default)");
  validate(c.loss_scaler);
  if (global_batch > 0) validate_batch(c, world, global_batch);
}

}  // namespace tandem
