// `tandem finetune --init-from HF_DIR`: fine-tune a local Hugging Face Llama directory on JSON
// lines (language modelling or classification), launching N workers of itself; and `tandem
// export --to hf OUT_DIR --checkpoint DIR`: any of its checkpoints as a Hugging Face directory.
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <iostream>
#include <memory>

#include "checkpoint_options.h"
#include "checks.h"
#include "cli_app.h"
#include "commands.h"
#include "host_options.h"
#include "parallel_options.h"
#include "tandem/hf_finetune.h"
#include "tandem/hf_tokenizer.h"
#include "tandem/indexed_dataset.h"
#include "tandem/launcher.h"
#include "tandem/llama.h"
#include "tandem/lora.h"
#include "tandem/moe.h"
#include "tandem/runtime.h"
#include "text_elastic.h"
#include "worker_options.h"

namespace tandem::cli {
namespace {

// The flags of the run; `task` and the worker count as typed.
struct HfFlags {
  text::HfFinetuneConfig cfg;
  std::string task = "lm";
  WorkerFlags workers;
  std::string elastic_lr = "keep";
  double moe_aux_coef = 0, moe_z_coef = 0, capacity_factor = 0;
  std::string moe_aux_form = "pooled";
  int64_t lora_rank = 0;
  std::string lora_targets = "q_proj,v_proj";
  int threads = 0;
  double timeout_s = 300;
  bool no_eval = false, no_progress = false;
  LaunchOptions lo;
};

void add_hf_flags(CLI::App& app, HfFlags& f) {
  auto& c = f.cfg;
  auto& l = c.loop;
  add_host_options(app, f.lo);
  app.add_option("--init-from", c.model_dir, "Hugging Face model directory (config.json, safetensors, tokenizer.model)")
      ->required();
  app.add_option("--task", f.task, "lm (JSON lines {\"text\"}) | classify ({\"text\", \"label\"})")
      ->capture_default_str();
  app.add_option("--data", c.data,
                 "JSON lines file of examples, or (--task lm) a directory of tandem preprocess: packed windows "
                 "of --seq + 1 tokens read by mmap")
      ->required();
  app.add_option("--data-record", c.data_record,
                 "with a preprocessed --data DIR: each rank appends what it trained on per step (samples, windows, "
                 "ids, positions) to PREFIX.rank<R>.jsonl (tests, debugging)");
  app.add_option("--valid-fraction", c.valid_fraction, "share of examples held out for validation (by text hash)")
      ->capture_default_str();
  app.add_option("--seq", c.seq, "tokens per example (truncated, padded)")->capture_default_str();
  auto* rank = app.add_option("--lora-rank", f.lora_rank,
                              "train LoRA adapters of this rank instead of every weight (0: full fine-tuning)")
                   ->capture_default_str();
  auto* alpha = app.add_option("--lora-alpha", c.lora.alpha, "LoRA scale numerator: updates are alpha / rank x B A")
                    ->capture_default_str();
  auto* dropout = app.add_option("--lora-dropout", c.lora.dropout, "dropout on the adapters' input while training")
                      ->capture_default_str();
  auto* targets = app.add_option("--lora-targets", f.lora_targets,
                                 "modules adapted, comma-separated (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                                 "down_proj), or all-linear")
                      ->capture_default_str();
  auto* rslora = app.add_flag("--lora-rslora", c.lora.rslora, "scale by alpha / sqrt(rank) (rank-stabilised LoRA)");
  app.add_option("--init-adapter", c.init_adapter,
                 "start from a PEFT LoRA adapter directory (its adapter_config.json sets rank, alpha, dropout, "
                 "targets)")
      ->excludes(rank)
      ->excludes(alpha)
      ->excludes(dropout)
      ->excludes(targets)
      ->excludes(rslora);
  app.add_option("--moe-aux-loss-coef", f.moe_aux_coef,
                 "mixture of experts (Mixtral): the load-balancing loss's weight (default: config.json's "
                 "router_aux_loss_coef)");
  app.add_option("--moe-z-loss-coef", f.moe_z_coef, "mixture of experts: the router z-loss's weight (default 0: none)");
  app.add_option("--capacity-factor", f.capacity_factor,
                 "mixture of experts: each expert takes at most ceil(F x tokens x top-k / experts) token slots of a "
                 "micro-batch, the rest dropped (default 0: dropless)");
  app.add_option("--moe-aux-loss", f.moe_aux_form,
                 "mixture of experts: pooled (transformers' load-balancing loss over all layers at once) | "
                 "per-layer (each layer's, averaged; needed with --pp)")
      ->capture_default_str();
  add_worker_options(app, f.workers, "2");
  add_parallel_options(app, l.parallel);
  app.add_option("--batch", l.batch, "global batch size (split across workers)")->capture_default_str();
  app.add_option("--steps", l.steps, "optimizer steps")->capture_default_str();
  app.add_option("--lr", l.lr, "peak learning rate (AdamW, linear warmup, cosine to 10%)")->capture_default_str();
  app.add_option("--warmup-steps", l.warmup_steps, "linear warmup steps")->capture_default_str();
  app.add_option("--weight-decay", l.weight_decay, "AdamW weight decay")->capture_default_str();
  app.add_option("--seed", l.seed, "seed for the shuffling and a new classification head")->capture_default_str();
  app.add_option("--threads", f.threads, "compute threads per worker (0: cores / workers)")->capture_default_str();
  app.add_option("--eval-limit", l.eval_limit, "validate on at most this many examples (-1: all)")
      ->capture_default_str();
  app.add_flag("--no-eval", f.no_eval, "skip the validation");
  app.add_flag("--no-progress", f.no_progress, "no progress display");
  app.add_option("--log-every", l.log_every, "plain progress line every N steps")->capture_default_str();
  app.add_option("--metrics", l.metrics_path, "write per-step loss and time, then the report, as JSON lines");
  app.add_option(
      "--tensorboard", l.tensorboard,
      "write TensorBoard event files of the per-step loss, learning rate, throughput, gradient norm, loss scale, "
      "memory and communication share, then the final figures, into DIR (rank 0; the --metrics figures)");
  app.add_option("--trace", l.trace, "write a timeline of every rank's training loop to FILE (Chrome trace JSON)");
  add_text_checkpoint_options(app, l.checkpoints);
  add_elastic_lr_option(app, f.elastic_lr);
  app.add_option("--timeout", f.timeout_s, "seconds any communication may block before failing")->capture_default_str();
}

// LoRA from the flags; with --init-adapter finetune_hf takes it from adapter_config.json (read
// here too, so that a bad directory is named before any worker starts).
void set_lora(HfFlags& f, const CLI::App& app) {
  auto& c = f.cfg;
  if (!c.init_adapter.empty()) {
    lora::read_peft_adapter(c.init_adapter);
    c.use_lora = true;
    return;
  }
  const bool asked = app.count("--lora-alpha") || app.count("--lora-dropout") || app.count("--lora-targets") ||
                     app.count("--lora-rslora");
  if (f.lora_rank == 0 && !app.count("--lora-rank")) {
    if (asked) throw std::invalid_argument("the --lora-* options need --lora-rank R (the adapters' rank)");
    return;
  }
  c.use_lora = true;
  c.lora.rank = f.lora_rank;
  c.lora.targets = lora::parse_targets(f.lora_targets);
  lora::validate(c.lora);
}

// The mixture-of-experts flags given (finetune_hf applies them to a Mixtral, refuses them for a
// dense model).
void set_moe(HfFlags& f, const CLI::App& app) {
  auto& o = f.cfg.moe;
  if (app.count("--moe-aux-loss-coef")) o.aux_loss_coef = f.moe_aux_coef;
  if (app.count("--moe-z-loss-coef")) o.z_loss_coef = f.moe_z_coef;
  if (app.count("--capacity-factor")) o.capacity_factor = f.capacity_factor;
  try {
    if (app.count("--moe-aux-loss")) o.aux_form = moe::parse_aux_loss_form(f.moe_aux_form);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("--moe-aux-loss: ") + e.what());
  }
}

}  // namespace

int cmd_finetune_hf(int argc, char** argv) {
  CLI::App app{"Fine-tune a local Hugging Face Llama-architecture model (SentencePiece tokenizer) on JSON lines, "
               "as a language model or a classifier, under any strategy and worker count.",
               "tandem finetune"};
  HfFlags f;
  f.cfg.loop.parallel.strategy = Strategy::kDDP;
  f.cfg.loop.batch = 8;
  f.cfg.loop.steps = 100;
  f.cfg.loop.lr = 1e-4;
  f.cfg.loop.warmup_steps = 10;
  f.cfg.loop.log_every = 10;
  add_hf_flags(app, f);
  app.footer(examples_footer({
      {"full fine-tuning under ZeRO-2, then the result as a Hugging Face directory",
       {"tandem finetune --init-from ./my-llama --task lm --data train.jsonl -n 2 --strategy zero2 --steps 200 "
        "--checkpoint-dir ck",
        "tandem export --to hf ./my-llama-tuned --checkpoint ck"}},
      {"LoRA adapters of rank 8 under ZeRO-3, then as a PEFT adapter",
       {"tandem finetune --init-from ./my-llama --data train.jsonl -n 2 --strategy zero3 --lora-rank 8 --lora-targets "
        "q_proj,k_proj,v_proj,o_proj --checkpoint-dir ck",
        "tandem export --to peft ./my-adapter --checkpoint ck"}},
      {"long sequences: context parallel 2 x tensor parallel 2 with sequence parallelism",
       {"tandem finetune --init-from ./my-llama --data train.jsonl -n 4 --cp 2 --tp 2 --sequence-parallel --seq 4096"}},
      {"a classifier", {"tandem finetune --init-from ./my-llama --task classify --data labelled.jsonl -n 2"}},
      {"a Mixtral (mixture of experts) in a pipeline, its load-balancing loss per layer",
       {"tandem finetune --init-from ./my-mixtral --data train.jsonl -n 2 --pp 2 --moe-aux-loss per-layer"}},
  }));
  if (auto rc = parse_command_line(app, argc, argv)) return *rc;
  auto& cfg = f.cfg;
  try {
    set_lora(f, app);
    set_moe(f, app);
  } catch (const std::exception& e) {
    std::cerr << "tandem finetune: " << e.what() << "\n";
    return 2;
  }
  cfg.loop.evaluate = !f.no_eval;
  cfg.loop.progress = !f.no_progress;
  WorkerRange range;
  ElasticLr lr_mode = ElasticLr::kKeep;
  try {
    range = worker_range(f.workers);
    lr_mode = parse_elastic_lr(f.elastic_lr);
    cfg.loop.checkpoints.batch_may_change = lr_mode == ElasticLr::kScale;
  } catch (const std::invalid_argument& e) {
    std::cerr << "tandem finetune: " << e.what() << "\n";
    return 2;
  }
  const int nprocs = range.max;
  const bool is_worker = detect_process_info().launcher != "none";
  if (!is_worker) {
    try {  // the cheap checks before starting workers
      cfg.task = text::parse_hf_task(f.task);
      if (!range.elastic()) text::validate(cfg, nprocs);  // elastic: at each worker count, below
      hf::Tokenizer::load(cfg.model_dir);                 // finetune_hf reads both again on every worker
      text::hf_model_config(cfg);
      if (text::is_preprocessed(cfg.data)) {
        const auto info = data::read_dataset_info(cfg.data);
        const data::IndexedDataset ds(cfg.data + "/" + info.prefix);
        std::cout << "data             " << cfg.data << ": " << ds.documents() << " documents, " << ds.tokens()
                  << " tokens (preprocessed)" << std::endl;
      } else {
        auto data = text::read_jsonl(cfg.data, cfg.task == text::HfTask::kClassify);
        std::cout << "data             " << cfg.data << ": " << data.size() << " examples" << std::endl;
      }
    } catch (const std::exception& e) {
      std::cerr << "tandem finetune: " << e.what() << "\n";
      return 2;
    }
    if (nprocs > 1 || range.elastic()) {
      std::vector<std::string> args = {self_executable(), "finetune"};
      for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
      f.lo.nprocs = nprocs;
      f.lo.prefix_output = false;
      f.lo.env.push_back(std::string("TANDEM_PROGRESS_TTY=") + (isatty(1) ? "1" : "0"));
      if (range.elastic()) {
        ElasticSpec spec = text_elastic_spec("tandem finetune", cfg.loop, lr_mode);
        spec.check = [&](int w, int64_t batch) {
          auto c = cfg;
          c.loop.batch = batch;
          text::validate(c, w);
        };
        return run_elastic_command(spec, range, f.lo, args);
      }
      std::cout << "launching " << nprocs << " workers (" << to_string(cfg.loop.parallel.strategy) << ")" << std::endl;
      return launch(f.lo, args);
    }
  }
  cfg.task = text::parse_hf_task(f.task);
  RuntimeOptions ro;
  ro.threads = f.threads;
  ro.device = "cpu";
  ro.comm.timeout = std::chrono::milliseconds(static_cast<int64_t>(f.timeout_s * 1000));
  std::unique_ptr<Runtime> rt;
  try {
    rt = std::make_unique<Runtime>(ro);
  } catch (const std::exception& e) {
    std::cerr << "tandem finetune: " << e.what() << "\n";
    return 1;
  }
  try {
    auto report = text::finetune_hf(*rt, cfg);
    if (rt->rank() == 0) {
      std::cout << format_report(report);
      if (!cfg.loop.checkpoints.dir.empty()) std::cout << "checkpoints      " << cfg.loop.checkpoints.dir << "\n";
      std::cout << std::flush;
    }
  } catch (const std::exception& e) {
    auto* ce = dynamic_cast<const c10::Error*>(&e);
    std::cerr << "tandem finetune: rank " + std::to_string(rt->rank()) + ": " +
                     (ce ? ce->what_without_backtrace() : e.what()) + "\n"
              << std::flush;
    if (rt->world_size() > 1) rt->abort(1);
    return 1;
  }
  return 0;
}

int cmd_export(int argc, char** argv) {
  CLI::App app{"Write a checkpoint of tandem finetune --init-from (any layout) as a Hugging Face directory: "
               "config.json, model.safetensors (sharded above --max-shard-size) and the tokenizer.",
               "tandem export"};
  std::string to, out, checkpoint;
  double max_shard_mb = 5 * 1024;
  bool merge = false;
  app.add_option("--to", to, "the format: hf (a model directory) | peft (a LoRA run's adapter directory)")->required();
  app.add_flag("--merge", merge, "hf, of a LoRA run: the base weights with the adapters merged in (W + s B A)");
  app.add_option("out", out, "output directory")->required();
  app.add_option("--checkpoint", checkpoint, "checkpoint directory (--checkpoint-dir of the run, or one step-N)")
      ->required();
  app.add_option("--max-shard-size", max_shard_mb, "largest safetensors file in MiB before sharding")
      ->capture_default_str();
  app.footer(examples_footer({
      {"", {"tandem export --to hf ./my-llama-tuned --checkpoint ck"}},
      {"a LoRA run: its adapter for PEFT, or the base with the adapters merged in",
       {"tandem export --to peft ./my-adapter --checkpoint ck",
        "tandem export --to hf ./my-llama-merged --merge --checkpoint ck"}},
  }));
  if (auto rc = parse_command_line(app, argc, argv)) return *rc;
  if (to != "hf" && to != "peft") {
    std::cerr << "tandem export: --to '" << to << "' is not a known format; use --to hf or --to peft\n";
    return 2;
  }
  if (merge && to != "hf") {
    std::cerr << "tandem export: --merge writes full weights: use it with --to hf\n";
    return 2;
  }
  if (max_shard_mb <= 0) {
    std::cerr << "tandem export: --max-shard-size must be > 0 (MiB)\n";
    return 2;
  }
  try {
    if (to == "peft") {
      text::export_peft(checkpoint, out);
    } else {
      text::export_hf(checkpoint, out, static_cast<int64_t>(max_shard_mb * 1024 * 1024), merge);
    }
  } catch (const std::exception& e) {
    auto* ce = dynamic_cast<const c10::Error*>(&e);
    std::cerr << "tandem export: " << (ce ? ce->what_without_backtrace() : e.what()) << "\n";
    return 1;
  }
  std::cout << "exported         " << out << "\n";
  return 0;
}

}  // namespace tandem::cli
