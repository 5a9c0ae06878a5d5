// The commands of `tandem`: their names, `tandem help` lines and the prose docs/CLI.md gives
// each before its flags (the flags themselves and the examples come from the commands' own
// CLI::App definitions).
#include "commands.h"

namespace tandem::cli {

namespace {

const char* kTrainNotes = R"md(Launches N workers of itself (`-n`, default 2) through mpirun and trains; before that it
measures one worker for a few steps (`--baseline-steps`) for the report's speedup figure.
The report gives the layout, throughput, speedup, loss, accuracy, memory per rank, traffic per
step and the share of communication hidden behind backward.

- **Strategies and layouts.** `--strategy single|ddp|zero1|zero2|zero3|hsdp|hsdp2` (ZeRO: optimizer state,
  then gradients, then parameters sharded). `--tp T --pp P` add Megatron tensor parallelism and
  pipeline stages (`--micro-batches M`, `--pipeline-schedule gpipe|1f1b|interleaved|zb-h1|zb-v`,
  interleaved with `--virtual-stages V`, `--pp-partition params|time|3,7`); the remaining ranks are data parallel
  under any strategy but `single` (under a pipeline ZeRO-2/3 reduce-scatter after every
  micro-batch and ZeRO-3 gathers each layer per micro-batch). Refused, each with its reason:
  `--tp` or `--pp` with `single`; `--tp` x `--pp` that does not divide `-n`; `--grad-accum` with
  `--pp` (use more `--micro-batches`); `--compress` with a pipeline or a strategy other than
  `ddp`. `--strategy hsdp --shard-group G` is hybrid sharding (FSDP's HYBRID_SHARD, DeepSpeed's
  hpZ): ZeRO-3 within groups of G consecutive ranks, the groups replicas that all-reduce each
  gradient shard between them; `hsdp2` is its ZeRO-2 form. G defaults to the ranks per host
  (mpirun places ranks by slot), must divide the data-parallel ranks, and hsdp takes no `--tp`,
  `--pp` or `--cp`; the report splits the traffic into that within the shard groups and that
  across them. The report gives the cut and the measured pipeline bubble beside (P-1)/M. `tandem
  train` defaults to 4 micro-batches, the text commands to 1. The layout flags are the same, with
  the same checks, on `pretrain`, `finetune` and `finetune --init-from`.
- **Replicas in one process.** `--replicas K` runs K replicas as threads of one process (no MPI
  or launcher; one CUDA device each on GPUs), gradients reduced inside the process; `-n P
  --replicas K` runs P processes of K replicas, reduced inside each process and then across
  them. Every strategy runs with a replica as a worker (ZeRO shards over all replicas).
- **Checkpoints.** `--checkpoint-dir D --checkpoint-every N [--keep K] [--checkpoint-async]`
  (async: written by a background thread while training goes on, committed atomically when
  complete); `--resume` continues from the newest in any strategy, layout and worker count:
  every rank writes only the pieces it holds (its stage, its tensor-parallel blocks, its ZeRO
  chunk of them) and a resume reads only the shards holding what each rank needs.
  `--max-restarts K` relaunches from the newest checkpoint after a failure.
- **Elastic runs.** `-n MIN:MAX` (or `--min-workers MIN -n MAX`; needs `--checkpoint-dir` and
  `--checkpoint-every`): after a failure the launcher probes the hosts, drops the unreachable
  ones and resumes from the newest checkpoint on as many workers as fit (at least MIN), keeping
  the global batch (`--elastic-batch grow|accumulate`) or, with `--elastic-lr scale`, each
  worker's share, the global batch and the learning rate following the worker count (the linear
  scaling rule; the schedule and `--max-steps` count steps of the batch at MAX workers). A host
  that answers again is taken back at the next checkpoint, up to MAX. The report lists every
  membership change.
- **Mixed devices** (`tandem/shares.h`). `--batch-shares 3,1` (weights), `counts:96,32` (samples
  per step) or `auto` (the first `--calibration-steps` steps run with equal shares while each rank
  times its forward pass, less what ZeRO-3 spent waiting for other ranks' parameter gathers; then
  the batch is split in proportion to the measured samples/s, at least one sample each) gives
  each data-parallel rank its share of the global batch. Each rank's mean loss is weighted by
  world x n_r / N, so the update and the reported loss are those of the homogeneous global batch
  (the loss trajectory matches equal shares within 1e-4). `--slow-rank R:MS` slows rank R to try
  it; the report shows each rank's share and samples/s.
- **Several machines.** `--hostfile F` (lines `NAME slots=K`; ranks fill each host's slots in
  order), `--net-if` for the interfaces or subnet between hosts, `--mpi-arg` for anything else
  mpirun needs; every host needs Tandem at the same path and passwordless ssh. A host that
  becomes unreachable ends the job after `--timeout` with a rank naming it; relaunch with
  `--resume`. See [DEPLOY.md](DEPLOY.md).
- **Models and plugins.** `--model` takes a built-in model or a plugin, a shared library built
  against Tandem that registers models and datasets (`tandem/registry.h`, `examples/plugin/`);
  `--pp` and `--tp` need a `torch::nn::Sequential` whose children can be cut.
- **Trace.** `--trace FILE` writes every rank's timeline as Chrome trace JSON (open it in
  [Perfetto](https://ui.perfetto.dev); `bench/trace_plot.py` draws one,
  [example](img/trace-ddp-async-checkpoint.png)).
)md";

const char* kLaunchNotes =
    R"md(Runs any program on N workers through mpirun (root allowed, oversubscription, no core binding,
idle ranks yielding), prefixes every output line with `[rank R]`, and if one worker fails stops
the others and exits non-zero naming it. Everything after `--` is the program and its
arguments. A program built on `tandem::Runtime` reads its rank, world and device from the
environment mpirun sets.
)md";

const char* kSelftestNotes =
    R"md(Runs all-reduce (sum, avg, max), reduce-scatter, all-gather, broadcast and send/recv across N
workers on 1, 7 and 1000003 floats and checks each against a reference every rank computes
locally; exits non-zero naming the collective that disagrees.
)md";

const char* kBenchNotes =
    R"md(Runs `tandem train` for a model under a list of strategies (`ddp`, `zero1`-`zero3`, layouts
such as `tp2`, `pp2`, `tp2pp2`, `pp2-gpipe`) and worker counts, a bounded number of steps each,
and prints speedup, efficiency, communication share and memory, writing CSV and a gnuplot plot.
After `tandem plan --calibrate` (or with `--calibrate`, a calibration before every repetition)
it shows the predicted step time beside the measured one (`--predict-only`: the predictions
alone, nothing run). With `--reps` 3 or more it shows each row's spread over its repetitions,
measures again the rows the machine ran slow through (`--remeasure`) and reports CPU time
stolen by the hypervisor. See [PLAN.md](PLAN.md).
)md";

const char* kPlanNotes = R"md(Predicts memory per device and step time of dp x tp x pp x ZeRO layouts (x cp with `--cp`)
of a model, built-in or described by its shape, on a cluster (presets: A100/H100/H200,
NVLink/InfiniBand/Ethernet, mixed nodes, or this machine with `--calibrate`), ranks the
feasible ones and says why the others do not fit. Exit code 0; 3 when nothing fits. The models,
presets, output and accuracy of the predictions are in [PLAN.md](PLAN.md).
)md";

const char* kK8sNotes =
    R"md(Writes a Kubeflow MPI Operator `MPIJob` (GPUs, `/dev/shm`, mixed GPU pools, checkpoints on a
claim, `--tp`/`--pp` runs too) and optionally the checkpoint claim; the arguments after `--` go
to `tandem train`. Deploying on one server, over SSH or Slurm, and on Kubernetes:
[DEPLOY.md](DEPLOY.md).
)md";

const char* kPretrainNotes =
    R"md(Pre-trains a small transformer on the fortune-cookie corpus (Debian's `fortunes` files; a
SentencePiece tokenizer trained on it and saved with the checkpoint) under any strategy and
worker count, `--precision fp32|bf16|fp16`, and `--tp`/`--pp` with any strategy but `single`
(`--tp` must divide `--heads` and `--vocab`), with the rest of `tandem train`'s layout flags.
Checkpoints work as for `tandem train` (`--resume` in any layout and worker count: the
checkpoint holds the sampler's position, so the run continues the same data order and
schedule), and so do elastic `-n MIN:MAX` runs. Every step's loss is normalised by the real
tokens of the whole global batch, so every layout and worker count trains as one worker with
one pass over the batch. The report is `tandem train`'s plus the corpus and the validation loss.
)md";

const char* kFinetuneNotes = R"md(Fine-tunes `tandem pretrain`'s model to classify the language of a text (or, `--task
category`, which file of the root a text comes from), with the same layouts, checkpoints and
elastic runs as `tandem pretrain`; the report adds a confusion table. Each step's loss is
normalised by the samples of the whole global batch. With `--init-from` it is another
command: [`tandem finetune --init-from DIR`](#tandem-finetune---init-from-dir).
)md";

const char* kFinetuneHfNotes = R"md(Fine-tunes a local Hugging Face Llama-family checkpoint (`config.json`, safetensors,
SentencePiece `tokenizer.model`; special tokens from its configuration files) on JSON lines
(`--task lm`: `{"text": ...}`; `--task classify`: `{"text": ..., "label": ...}`), with a
validation split, then `tandem export` writes the result back in Hugging Face's formats.

- **Layouts.** ddp, zero1-3, `--tp` and `--pp` and their combinations, for both tasks. `--tp`
  must divide the attention heads, the KV heads, the MLP width and the vocabulary (each rank holds
  whole heads and equal vocabulary shards; KV heads are not replicated): a 6-head, 3-KV-head model
  takes `--tp 3`. Tied embeddings refuse `--pp`, whose first and last stages would share them.
  The classifier's score head is on the last stage, replicated over the tp ranks. Each rank reads
  only the bytes of what it holds from the safetensors files.
- **Long sequences.** `--cp C` (context parallelism) splits every sequence over C ranks, rank r
  holding chunks r and 2C-1-r of 2C so that causal attention costs each the same, and computes
  attention as ring attention: key/value blocks travel around the ranks behind each block's
  compute, merged with an online softmax, their gradients travelling back the same way; rotary
  positions are the global ones. Activations per rank fall by about C; `--seq` must be a multiple of 2C; the cp ranks' gradients are reduced
  with the data-parallel ones, and `-n` = dp x cp x tp x pp. `--sequence-parallel` (with `--tp`)
  keeps the norms and the residual stream split along the sequence over the tp ranks, with
  all-gathers and reduce-scatters instead of all-reduces. Both for the LM and the classifier; the
  report names the layout and the ring's transfers and their hidden share; `tandem plan --cp C`
  prices these layouts.
- **LoRA**, as PEFT defines it: `--lora-rank R` adds adapters `lora_A`/`lora_B` on
  `--lora-targets`, scaled by `--lora-alpha`/R (`--lora-rslora`: /sqrt(R)); every other weight
  is frozen (a classifier's `score` head trains whole). Frozen weights get no gradient and no
  optimizer state under any layout: DDP and ZeRO reduce only the adapters, ZeRO-3 still shards the
  frozen base, `--tp` splits B of a column-parallel layer and A of a row-parallel one, pipeline
  stages hold their own.
  `--init-adapter DIR` starts from a PEFT adapter. Checkpoints hold the adapters only (a resume
  re-reads the base from `--init-from`). The report gives trainable against total parameters and
  the optimizer state per rank.
- **Mixture of experts (Mixtral).** A `model_type: "mixtral"` checkpoint
  (`MixtralForCausalLM`: each layer's `block_sparse_moe`, a router over `num_local_experts`
  SwiGLU experts of which each token takes `num_experts_per_tok`) trains as a language model. Its
  loss is transformers' with `output_router_logits=True`: the LM loss plus
  `--moe-aux-loss-coef` (default: `router_aux_loss_coef`) times the load-balancing loss, pooled
  over all layers as transformers computes it (`--moe-aux-loss pooled`), or each layer's averaged
  (`per-layer`, needed with `--pp`); `--moe-z-loss-coef` adds the router z-loss,
  `--capacity-factor F` caps each expert's token slots (default 0: dropless). The progress line,
  `--metrics` (`aux_loss`, `z_loss` per step) and the report give the auxiliary losses alone, and
  the report the token slots dropped. `--tp`, `--cp`, LoRA and `--task classify` are refused, as
  are `router_jitter_noise` other than 0 and a `sliding_window` shorter than
  `max_position_embeddings`. Selective recomputation recomputes the attention and norms, not the
  experts. `tandem export --to hf` writes a directory `MixtralForCausalLM.from_pretrained` loads.
- **Checkpoints and elastic runs** as for `tandem pretrain`.
)md";

const char* kExportNotes = R"md(Writes a checkpoint of `tandem finetune --init-from` of any layout as `config.json`,
`model.safetensors` (sharded above `--max-shard-size`) and the tokenizer, which `transformers`'
`from_pretrained` loads (`--to hf`; `--merge`: a LoRA run's base with the adapters merged in),
or a LoRA run's `adapter_config.json` and `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained` loads (`--to peft`).
)md";

const char* kPreprocessNotes =
    R"md(Tokenizes a JSON lines corpus once with a Hugging Face Llama directory's tokenizer, streaming
it in chunks over `--threads` tokenizing threads (memory: a few 4 MB chunks and 12 bytes per
document), into Megatron-LM's indexed dataset: `DIR/text_document.bin` + `.idx` (`MMIDIDX`,
version 1, uint16 ids below a 65500 vocabulary else int32, sizes, byte pointers, document
index), each document's ids followed by EOS (Megatron's `--append-eod`), and `DIR/dataset.json`
naming the tokenizer (vocabulary, EOS, model directory, counts). Megatron's `IndexedDataset`
reads the files. A bad line stops it naming `FILE:LINE`.

`tandem finetune --init-from HF_DIR --data DIR` (`--task lm`) maps the `.bin` read-only and
trains on packed windows: the token stream cut into windows of `--seq` + 1 tokens (inputs and
their next tokens, as Megatron's GPT samples), drawn in a seeded order per epoch, with attention
and rotary positions restarting after each EOS (Megatron's `reset_attention_mask` and
`reset_position_ids`: block-diagonal causal attention), computed from the ids by the model,
under ddp, zero1-3, `--tp` (with `--sequence-parallel`) and recomputation; `--pp` (later stages
do not see the ids) and `--cp` (ring attention is not masked) are refused. Memory does not grow
with the corpus but for 8 bytes per window (the order). Checkpoints record the data loader's
place (`epoch`, `index`), so a resume at another worker count continues with the next unseen
window: no repeat, no gap. `--data-record PREFIX` writes what each rank trained on per step.

`tandem pretrain --data DIR --out OUT` trains Tandem's own transformer on the same packed windows:
its vocabulary is that of the SentencePiece `tokenizer.model` in the model directory
`dataset.json` names, copied to `OUT/tokenizer.model` (so `tandem finetune --checkpoint OUT`
classifies with it; `--vocab` and `--tokenizer-sentences` are refused), and its learned
positions and causal attention restart after each EOS. The same layouts, checkpoints of the
data loader's place, `--data-record`, and refusals of `--pp` and `--cp` apply; there is no
validation split. A `--data` directory of `%`-separated files trains on fortunes as before.
)md";

}  // namespace

const std::vector<Command>& command_table() {
  static const std::vector<Command> table = {
      {"train", cmd_train, "train a model on N workers (default: the CNN on Fashion-MNIST, 2 workers, DDP)",
       kTrainNotes},
      {"launch", cmd_launch, "run a program on N workers: tandem launch -n N [--hostfile F] -- PROGRAM ARGS...",
       kLaunchNotes},
      {"selftest", cmd_selftest, "check every collective across the workers: tandem selftest [-n N]", kSelftestNotes},
      {"bench", cmd_bench, "speedup table and plot of a model over strategies and worker counts", kBenchNotes},
      {"plan", cmd_plan, "predict memory and step time of parallel layouts on a cluster, ranked", kPlanNotes},
      {"k8s", cmd_k8s, "write Kubernetes manifests (MPIJob, checkpoint claim) that run tandem train on a cluster",
       kK8sNotes},
      {"pretrain", cmd_pretrain, "pre-train a transformer language model on text (fortune cookies), with its tokenizer",
       kPretrainNotes},
      {"finetune", cmd_finetune, "fine-tune it to classify text by language, under any strategy and worker count",
       kFinetuneNotes},
      {"finetune --init-from DIR", cmd_finetune_hf,
       "fine-tune a Hugging Face Llama directory on JSON lines (full, LoRA; tp, pp, cp)", kFinetuneHfNotes},
      {"preprocess", cmd_preprocess,
       "tokenize JSON lines once into a memory-mapped dataset (Megatron's .bin/.idx) for finetune --init-from",
       kPreprocessNotes},
      {"export", cmd_export, "write a checkpoint as a Hugging Face model or PEFT adapter directory", kExportNotes},
  };
  return table;
}

}  // namespace tandem::cli
