#include "parallel_options.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "checks.h"
#include "tandem/activation_checkpoint.h"
#include "tandem/pipeline.h"
#include "tandem/precision.h"

namespace tandem::cli {
void add_parallel_options(CLI::App& app, ParallelConfig& pc) {
  add_word_option<Strategy>(app, "--strategy", pc.strategy, parse_strategy, to_string(pc.strategy),
                            "single | ddp | zero1 | zero2 | zero3 | hsdp | hsdp2 (ZeRO: optimizer state, +gradients, "
                            "+parameters sharded over the data-parallel ranks; hsdp: ZeRO-3 within each --shard-group, "
                            "the groups replicas whose gradient shards are all-reduced between them, hsdp2 the same "
                            "with ZeRO-2, as FSDP's HYBRID_SHARD and _HYBRID_SHARD_ZERO2); every one but single and "
                            "hsdp/hsdp2 composes with --tp and --pp");
  app.add_option("--shard-group", pc.shard_group,
                 "hsdp, hsdp2: consecutive data-parallel ranks per shard group (all-gathers and reduce-scatters stay "
                 "inside it; it must divide the data-parallel ranks); 0: the ranks per host, which needs every host "
                 "to hold as many consecutive ranks (mpirun's by-slot mapping, as tandem launches)")
      ->capture_default_str();
  add_word_option<Precision>(app, "--precision", pc.precision, parse_precision, precision_name(pc.precision),
                             "fp32 | bf16 | fp16 (compute precision; fp32 master weights; fp16 with dynamic loss "
                             "scaling)");
  app.add_option(
         "--initial-loss-scale", pc.loss_scaler.init_scale,
         "fp16: the dynamic loss scale to start from (halved on every overflow, doubled after 1000 clean steps)")
      ->check(number_between(0, 4294967296.0, /*above_lo=*/true))
      ->capture_default_str();
  app.add_option("--max-grad-norm", pc.max_grad_norm,
                 "clip the norm of the whole model's gradient, across shards and stages (0: off)")
      ->capture_default_str();
  app.add_option("--tp", pc.tp,
                 "tensor-parallel ranks per replica (Megatron column/row-parallel layers; it must divide the model's "
                 "attention and KV heads, widths and vocabulary); composes with --pp and every --strategy but single")
      ->capture_default_str();
  app.add_flag("--sequence-parallel", pc.sequence_parallel,
               "Megatron sequence parallelism: between the tensor-parallel layers the activations (residual stream, "
               "norms) are split along the sequence over the --tp ranks, all-gathers and reduce-scatters replacing the "
               "all-reduces (activation memory of those parts / tp, same traffic); needs --tp > 1, a sequence length "
               "divisible by --tp and a Llama model (finetune --init-from); composes with --pp and every --strategy "
               "but single");
  app.add_option("--pp", pc.pp,
                 "pipeline stages per replica (the model cut as --pp-partition says); composes with --tp and every "
                 "--strategy but single")
      ->capture_default_str();
  app.add_option("--cp", pc.cp,
                 "context-parallel ranks per replica: each sequence split over them (2 x cp chunks, rank r holding "
                 "chunks r and 2cp-1-r), attention as ring attention at global positions; --seq must be a multiple "
                 "of 2 x cp. Llama models (finetune --init-from); composes with --tp, --pp and every --strategy but "
                 "single")
      ->capture_default_str();
  app.add_option(
         "--ep", pc.ep,
         "expert-parallel ranks: the experts of every mixture-of-experts layer spread over groups of ep "
         "consecutive data-parallel ranks, tokens dispatched to them and combined back by all-to-all (dense "
         "weights data-parallel over all of them, experts over the dp / ep ranks holding the same ones); it must "
         "divide the data-parallel ranks and the experts. Mixtral models (finetune --init-from); composes with "
         "--tp (each expert cut over the tp ranks), --pp, every --strategy, fp16, --max-grad-norm and "
         "--activation-checkpointing, not --cp")
      ->capture_default_str();
  app.add_option("--micro-batches", pc.micro_batches, "pipeline micro-batches per step and replica (with --pp)")
      ->capture_default_str();
  add_word_option<PipelineSchedule>(app, "--pipeline-schedule", pc.schedule, parse_pipeline_schedule,
                                    to_string(pc.schedule),
                                    "gpipe | 1f1b | interleaved | zb-h1 | zb-v (with --pp; interleaved: "
                                    "--micro-batches a multiple of --pp, and --tp 1; zb-h1 and zb-v split each "
                                    "backward into input and weight gradients, the latter filling the bubble: zb-h1 "
                                    "at 1F1B's memory, zb-v with two chunks per rank in a V, rank r holding virtual "
                                    "stages r and 2pp-1-r)");
  app.add_option("--virtual-stages", pc.virtual_stages,
                 "model chunks per pipeline rank with --pipeline-schedule interleaved (chunk c of rank r is virtual "
                 "stage c*pp + r; --pp-partition then lists pp x V layer counts); zb-v always runs 2 (1 or 2)")
      ->capture_default_str();
  // Registered after --pp and --virtual-stages: CLI11 stores options in the order they were
  // added, so those two hold their values when this one reads its list's stage count.
  add_word_option<Partition>(
      app, "--pp-partition", pc.partition,
      [&pc](const std::string& text) {
        // Without a pipeline the cut is unused; a list is still read, counted by its own items.
        const auto items = static_cast<int>(std::count(text.begin(), text.end(), ',')) + 1;
        return parse_partition(text, pc.pp > 1 ? pc.pp * pipeline_chunks(pc.schedule, std::max(1, pc.virtual_stages))
                                               : items);
      },
      to_string(pc.partition),
      "where the stages are cut: params (balanced parameter counts) | time (balanced forward+backward time of a "
      "micro-batch, measured before training) | the layers per stage, e.g. 3,7");
  app.add_option(
         "--grad-accum", pc.grad_accum,
         "gradient accumulation without --pp: each replica's share of --batch runs as K micro-batches before one "
         "optimizer step (DDP and ZeRO-1 communicate once per step, ZeRO-2/3 reduce-scatter per micro-batch)")
      ->capture_default_str();
  add_word_option<ActivationCheckpointing>(
      app, "--activation-checkpointing", pc.activation_checkpointing, parse_activation_checkpointing,
      to_string(pc.activation_checkpointing),
      "recompute activations in backward instead of keeping them: none, every layer, the first N layers (of each "
      "pipeline stage), or selective (every transformer layer keeps its projections' outputs and recomputes its "
      "attention core, RMSNorms and SwiGLU activations)");
}

}  // namespace tandem::cli
