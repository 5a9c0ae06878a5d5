// The torch-free parts of pipeline parallelism, shared by tandem::Pipeline and the planner
// (tandem/plan.h): how a model's layers are cut into stages and in which order a stage runs the
// forwards and backwards of its micro-batches.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tandem {

enum class PipelineSchedule { kGPipe, k1F1B, kInterleaved, kZBH1, kZBV };
const char* to_string(PipelineSchedule s);
// "gpipe", "1f1b", "interleaved", "zb-h1" or "zb-v"; throws std::invalid_argument otherwise.
PipelineSchedule parse_pipeline_schedule(const std::string& s);

// Contiguous split of `costs` into `stages` non-empty parts minimising the largest part's cost
// (exact, dynamic programming). Throws std::invalid_argument when stages > costs.size().
std::vector<int64_t> balance_partition(const std::vector<double>& costs, int stages);

// The order stage `stage` of `stages` runs its m micro-batches in: (true, i) is micro-batch i's
// forward, (false, i) its backward. GPipe: all forwards, then all backwards. 1F1B
// (PipeDream-Flush): p - s - 1 warm-up forwards, then one forward and one backward, then the rest
// of the backwards.
std::vector<std::pair<bool, int64_t>> pipeline_order(bool gpipe, int stage, int stages, int64_t m);

// What a PipelineOp computes: a micro-batch's forward (F), its backward (B) or its weight
// gradients (W). Schedules without W ops (GPipe, 1F1B, interleaved) run the whole backward in B;
// the zero-bubble ones (zb-h1, zb-v) split it: B computes the input gradients (and the weight
// gradients of layers that cannot defer theirs), W the deferred weight gradients of the linear
// layers (tandem/pipeline.h, WeightGradStore).
enum class PipelineOpKind : uint8_t { kForward, kBackward, kWeight };

// One operation of a rank's schedule: F, B or W of micro-batch `micro_batch` through the rank's
// model chunk `chunk`. With `chunks` chunks per rank over `stages` ranks, chunk c of rank r is
// virtual stage c * stages + r in the interleaved (loop) layout: the model is cut into stages *
// chunks contiguous parts and rank r holds parts r, r + stages, ... (non-adjacent). zb-v's V
// layout has two chunks: rank r holds virtual stages r and 2 * stages - 1 - r
// (pipeline_virtual_stage). GPipe, 1F1B and zb-h1 have one chunk per rank.
struct PipelineOp {
  PipelineOpKind kind = PipelineOpKind::kForward;
  int chunk = 0;
  int64_t micro_batch = 0;
  bool forward() const { return kind == PipelineOpKind::kForward; }
  bool operator==(const PipelineOp& o) const {
    return kind == o.kind && chunk == o.chunk && micro_batch == o.micro_batch;
  }
};

// The virtual stage of chunk `chunk` of rank `rank`: chunk * stages + rank (the loop layout of
// the interleaved schedule), or with v_shape (zb-v, two chunks) rank for chunk 0 and
// 2 * stages - 1 - rank for chunk 1, so that the last virtual stage is on rank 0 and virtual
// stages stages - 1 and stages are both on rank stages - 1.
int64_t pipeline_virtual_stage(int chunk, int rank, int stages, bool v_shape);
// The (rank, chunk) holding virtual stage v: the inverse of pipeline_virtual_stage.
std::pair<int, int> pipeline_stage_owner(int64_t v, int stages, bool v_shape);

// Throws std::invalid_argument naming --pp, --virtual-stages and --micro-batches unless the
// interleaved schedule can run them: stages >= 2, chunks >= 1, m >= 1 and a multiple of stages
// (micro-batches go through the chunks in groups of one per stage, as in Megatron-LM).
void check_interleaved(int stages, int chunks, int64_t m);

// Megatron-LM's interleaved 1F1B order for rank `stage`: the rank's k-th forward is micro-batch
// (k / (stages * chunks)) * stages + k % stages through chunk (k / stages) % chunks, and its
// k-th backward the same micro-batch through chunk chunks - 1 - (k / stages) % chunks; after
// (stages - stage - 1) * 2 + (chunks - 1) * stages warm-up forwards (all m * chunks when m ==
// stages) one forward and one backward alternate, then the remaining backwards. Every rank runs
// its forwards (and its backwards) in the same (chunk, micro-batch) order, so messages between
// two ranks arrive in the order they are received. Checks with check_interleaved().
std::vector<PipelineOp> interleaved_order(int stage, int stages, int chunks, int64_t m);

// ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B's order of forwards and
// backwards (B: input gradients only), with each W placed where the rank would otherwise wait.
// The order is what a simulation of all ranks with equal F, B and W times runs: a rank starts
// its next F or B as soon as its input is there, else the oldest pending W; stage s keeps at
// most s pending W before its next B and at most `stages` micro-batches between F and W. Peak
// live micro-batches (F done, B not yet) on stage s: min(stages - s, m), as 1F1B; with the W
// pending, at most `stages` hold part of their activations (1F1B's stage 0). Idle time per rank
// with equal times and m >= stages: (stages - 1) (T_F + T_B - T_W), a third of 1F1B's
// (stages - 1) (T_F + T_B + T_W). Any stages >= 1 and m >= 1.
std::vector<PipelineOp> zb_h1_order(int stage, int stages, int64_t m);

// ZB-V (ibid.): two chunks per rank in the V layout (pipeline_virtual_stage), PyTorch's
// ScheduleZBVZeroBubble order: 2 (stages - r) - 1 warm-up forwards of chunk 0, r pairs of
// chunk-1 and chunk-0 forwards, stages - r rounds of F B W of chunk 1, then F B W of chunk 0 and
// chunk 1 alternating, and a cool-down of B's whose W's fill the end. Built for
// max(m, 2 stages - 1) micro-batches, those >= m dropped (dropping operations of all ranks keeps
// the order free of deadlock). Peak live chunk micro-batches (F done, B not yet) on every rank:
// at most 2 stages, each through half a 1F1B stage's layers: 1F1B's stage-0 activation memory;
// exactly 2 stages when m >= 2 stages. Idle time per rank with equal chunk F, B, W times t and
// m >= 2 stages: (stages - 1) t, against 1F1B's 6 (stages - 1) t. Throws std::invalid_argument
// unless stages >= 2.
std::vector<PipelineOp> zb_v_order(int stage, int stages, int64_t m);

// The idle over compute time of each of `stages` equal stages running `m` micro-batches (the
// quantity of PipelineStats::bubble_ratio), for a schedule named as --pipeline-schedule, with a
// whole stage's forward, input-gradient and weight-gradient times t_f, t_b, t_w (an unsplit
// backward takes t_b + t_w; the zero-bubble paper's T_F = T_B = T_W by default):
//   gpipe, 1f1b:  (p - 1) / m
//   interleaved:  (p - 1) / (m v)                                (v = chunks)
//   zb-h1:        (p - 1) (t_f + t_b - t_w) / (m (t_f + t_b + t_w))   = (p - 1) / (3 m), m >= p
//   zb-v:         (p - 1) (t_f + t_b - t_w) / (2 m (t_f + t_b + t_w)) = (p - 1) / (6 m), m >= 2p
// (zb-h1: the paper's (p - 1)(T_F + T_B - T_W) idle; zb-v: zb_v_order's p - 1 idle chunk
// operations of half those times; both as the unit tests' simulations of the orders find; the
// paper's own ZB-V order reaches zero with equal times).
double pipeline_bubble_theory(PipelineSchedule schedule, int stages, int64_t m, int chunks = 1, double t_f = 1.0,
                              double t_b = 1.0, double t_w = 1.0);
// The formula above as the report prints it: "(pp-1)/m", "(pp-1)/(m*v)", "(pp-1)/(3m)", "(pp-1)/(6m)".
std::string pipeline_bubble_formula(PipelineSchedule schedule);

// The --pp-partition option of tandem train, pretrain and finetune: "params" and "time" give an
// empty list (the caller cuts), otherwise one positive layer count per stage, comma-separated
// ("3,7"). Throws std::invalid_argument naming the option otherwise. Whether the counts add up to
// the model's layers is tandem::Pipeline's check.
std::vector<int64_t> parse_partition_option(const std::string& text, int stages);

}  // namespace tandem
