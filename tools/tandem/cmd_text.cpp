// `tandem pretrain` and `tandem finetune`: a transformer on real text (Debian's fortune cookies
// by default) with a SentencePiece tokenizer. Parses flags, checks them, launches N workers of
// itself when asked for more than one, and each worker runs tandem::text::pretrain/finetune.
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
#include "tandem/launcher.h"
#include "tandem/runtime.h"
#include "tandem/text.h"
#include "text_elastic.h"
#include "worker_options.h"

namespace tandem::cli {
namespace {

int run_text(const char* name, bool pretraining, int argc, char** argv) {
  const std::string cmd = std::string("tandem ") + name;
  CLI::App app{pretraining ? "Pre-train a small transformer as a causal language model on text, training a "
                             "SentencePiece tokenizer on the training split; writes a checkpoint directory."
                           : "Fine-tune a pre-trained transformer (tandem pretrain's checkpoint) to classify text "
                             "by language (or category), under any strategy and worker count. With --init-from "
                             "HF_DIR: a Hugging Face Llama directory on JSON lines instead (see tandem finetune "
                             "--init-from X --help).",
               cmd};
  text::TextTrainConfig cfg;
  cfg.parallel.strategy = Strategy::kDDP;
  cfg.steps = pretraining ? 300 : 200;
  cfg.lr = pretraining ? 2e-3 : 1e-3;
  cfg.corpus.max_per_label = 3000;
  WorkerFlags workers;
  int threads = 0;
  double timeout_s = 300;
  bool no_eval = false, no_progress = false;
  std::string out;
  LaunchOptions lo;  // several machines: the hosts and their network
  add_host_options(app, lo);
  app.add_option("--data", cfg.corpus.root,
                 pretraining ? "directory of '%'-separated text files (files in it are labelled --root-label, each "
                               "subdirectory is a label), or the output of tandem preprocess (packed windows, its "
                               "tokenizer)"
                             : "directory of '%'-separated text files; files in it are labelled --root-label, each "
                               "subdirectory is a label")
      ->capture_default_str();
  app.add_option("--root-label", cfg.corpus.root_label, "label of the files directly in --data")->capture_default_str();
  app.add_option("--task", cfg.corpus.task, "language (label = subdirectory) | category (the root's files by name)")
      ->capture_default_str();
  app.add_option("--max-per-label", cfg.corpus.max_per_label, "documents kept per label at most (-1: all)")
      ->capture_default_str();
  add_worker_options(app, workers, "2");
  add_parallel_options(app, cfg.parallel);
  app.add_option("--batch", cfg.batch, "global batch size (split across workers)")->capture_default_str();
  app.add_option("--steps", cfg.steps, "optimizer steps")->capture_default_str();
  app.add_option("--lr", cfg.lr, "peak learning rate (AdamW, linear warmup, cosine to 10%)")->capture_default_str();
  app.add_option("--warmup-steps", cfg.warmup_steps, "linear warmup steps")->capture_default_str();
  app.add_option("--weight-decay", cfg.weight_decay, "AdamW weight decay")->capture_default_str();
  app.add_option("--seed", cfg.seed, "seed for initialisation and shuffling")->capture_default_str();
  app.add_option("--threads", threads, "compute threads per worker (0: cores / workers)")->capture_default_str();
  app.add_option("--eval-limit", cfg.eval_limit, "evaluate on at most this many documents (-1: all)")
      ->capture_default_str();
  app.add_flag("--no-eval", no_eval, "skip the evaluation");
  app.add_flag("--no-progress", no_progress, "no progress display");
  app.add_option("--log-every", cfg.log_every, "plain progress line every N steps")->capture_default_str();
  app.add_option("--metrics", cfg.metrics_path, "write per-step loss and time, then the report, as JSON lines");
  app.add_option(
      "--tensorboard", cfg.tensorboard,
      "write TensorBoard event files of the per-step loss, learning rate, throughput, gradient norm, loss scale, "
      "memory and communication share, then the final figures, into DIR (rank 0; the --metrics figures)");
  app.add_option("--trace", cfg.trace, "write a timeline of every rank's training loop to FILE (Chrome trace JSON)");
  app.add_option("--timeout", timeout_s, "seconds any communication may block before failing")->capture_default_str();
  add_text_checkpoint_options(app, cfg.checkpoints);
  std::string elastic_lr = "keep";
  add_elastic_lr_option(app, elastic_lr);
  auto shape_flags = [&](CLI::App& a) {
    a.add_option("--vocab", cfg.tokenizer.vocab_size, "tokenizer vocabulary size")->capture_default_str();
    a.add_option("--d-model", cfg.shape.d_model, "model width")->capture_default_str();
    a.add_option("--heads", cfg.shape.heads, "attention heads")->capture_default_str();
    a.add_option("--layers", cfg.shape.layers, "transformer blocks")->capture_default_str();
    a.add_option("--seq", cfg.shape.seq, "tokens per document (padded / truncated)")->capture_default_str();
  };
  if (pretraining) {
    app.add_option("--out", out, "checkpoint directory to write (model.pt, tokenizer.model, manifest.json)")
        ->required();
    shape_flags(app);
    app.add_option("--tokenizer-sentences", cfg.tokenizer.max_sentences, "documents the tokenizer trains on at most")
        ->capture_default_str();
    app.add_option("--data-record", cfg.data_record,
                   "with a preprocessed --data: each rank appends what it trains on to PREFIX.rankR.jsonl");
  } else {
    app.add_option("--checkpoint", cfg.checkpoint, "tandem pretrain's checkpoint directory");
    app.add_flag("--from-scratch", cfg.from_scratch,
                 "random initialisation (the checkpoint's tokenizer and shape when --checkpoint is given, else "
                 "--tokenizer and the shape flags)");
    app.add_option("--tokenizer", cfg.tokenizer_path,
                   "tokenizer model file (default: the checkpoint's; checked against it)");
    app.add_option("--out", cfg.output, "write the fine-tuned model here (a checkpoint directory)");
    shape_flags(app);
  }
  if (pretraining) {
    app.footer(examples_footer({
        {"", {"tandem pretrain --out pre"}},
        {"4 workers: 2 tensor-parallel ranks x 2 ZeRO-1 replicas, bf16",
         {"tandem pretrain --out pre -n 4 --tp 2 --strategy zero1 --precision bf16"}},
        {"packed windows of a preprocessed corpus, with its Llama tokenizer",
         {"tandem preprocess --init-from llama --data corpus.jsonl --out d", "tandem pretrain --data d --out pre"}},
    }));
  } else {
    app.footer(examples_footer({
        {"classify the language of fortune cookies with the pre-trained model",
         {"tandem finetune --checkpoint pre --out ft"}},
        {"the same on 2 to 4 workers, elastic",
         {"tandem finetune --checkpoint pre -n 2:4 --checkpoint-dir ck --checkpoint-every 50"}},
    }));
  }
  if (auto rc = parse_command_line(app, argc, argv)) return *rc;
  int nprocs = 0;
  WorkerRange range;
  ElasticLr lr_mode = ElasticLr::kKeep;
  try {
    range = worker_range(workers);
    nprocs = range.max;
    lr_mode = parse_elastic_lr(elastic_lr);
    cfg.checkpoints.batch_may_change = lr_mode == ElasticLr::kScale;
  } catch (const std::invalid_argument& e) {
    std::cerr << cmd << ": " << e.what() << "\n";
    return 2;
  }
  if (pretraining) cfg.checkpoint = out;
  const bool packed = pretraining && text::is_preprocessed_dataset(cfg.corpus.root);
  for (const char* flag : {"--vocab", "--tokenizer-sentences"}) {
    if (packed && app.count(flag) > 0) {
      std::cerr << cmd << ": " << flag << " does not apply to --data '" << cfg.corpus.root
                << "' (a preprocessed dataset): the vocabulary is that of the tokenizer its dataset.json names; "
                   "drop "
                << flag << "\n";
      return 2;
    }
  }
  if (!packed && !cfg.data_record.empty()) {
    std::cerr << cmd << ": --data-record needs a preprocessed --data (tandem preprocess --out DIR)\n";
    return 2;
  }
  cfg.evaluate = !no_eval;
  cfg.progress = !no_progress;

  RuntimeOptions ro;
  ro.threads = threads;
  ro.device = "cpu";
  ro.comm.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));

  const bool is_worker = detect_process_info().launcher != "none";
  if (!is_worker) {
    if (!text::have_sentencepiece()) {
      std::cerr << cmd
                << ": this tandem was built without SentencePiece; install libsentencepiece-dev (apt-get install "
                   "libsentencepiece-dev), re-run cmake and rebuild\n";
      return 2;
    }
    try {
      if (!range.elastic()) text::validate(cfg, nprocs);  // elastic: at each worker count, below
      if (!pretraining && cfg.checkpoint.empty() && !cfg.from_scratch) {
        throw std::invalid_argument(
            "needs --checkpoint DIR (made by tandem pretrain), or --from-scratch --tokenizer FILE");
      }
      // The cheap checks before starting workers: the data reads and the checkpoint matches.
      if (packed) {
        std::cout << "data             " << cfg.corpus.root << ": a preprocessed dataset (packed windows)" << std::endl;
      }
      auto corpus = packed ? text::Corpus{} : text::read_corpus(cfg.corpus);
      if (!pretraining && !cfg.checkpoint.empty()) {
        auto m = text::read_manifest(cfg.checkpoint);  // finetune() checks the same on the workers
        if (m.task == cfg.corpus.task && m.labels != corpus.labels) {
          std::string have, want;
          for (auto& l : corpus.labels) have += (have.empty() ? "" : ",") + l;
          for (auto& l : m.labels) want += (want.empty() ? "" : ",") + l;
          throw std::runtime_error("the labels of '" + cfg.corpus.root + "' {" + have +
                                   "} differ from those of checkpoint '" + cfg.checkpoint + "' {" + want +
                                   "}; fine-tune on data with the checkpoint's labels, or pre-train on this data");
        }
      }
      if (!packed) {
        std::cout << "data             " << cfg.corpus.root << ": " << corpus.files << " files, " << corpus.duplicates
                  << " duplicates dropped; documents per label:";
        for (auto& [l, n] : corpus.per_label) std::cout << " " << l << " " << n;
        std::cout << "; split " << corpus.train.size() << " / " << corpus.valid.size() << " / " << corpus.test.size()
                  << " (train / validation / test)" << std::endl;
      }
    } catch (const std::exception& e) {
      std::cerr << cmd << ": " << e.what() << "\n";
      return 2;
    }
  }
  if (!is_worker && (nprocs > 1 || range.elastic())) {
    std::vector<std::string> args = {self_executable(), name};
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    lo.nprocs = nprocs;
    lo.prefix_output = false;
    // Explicit either way: mpirun gives the workers a pty, so their own isatty() says yes.
    lo.env.push_back(std::string("TANDEM_PROGRESS_TTY=") + (isatty(1) ? "1" : "0"));
    if (range.elastic()) {
      ElasticSpec spec = text_elastic_spec(cmd, cfg, lr_mode);
      spec.check = [&](int w, int64_t batch) {
        auto c = cfg;
        c.batch = batch;
        text::validate(c, w);
      };
      return run_elastic_command(spec, range, lo, args);
    }
    std::cout << "launching " << nprocs << " workers (" << to_string(cfg.parallel.strategy) << ")" << std::endl;
    return launch(lo, args);
  }

  std::unique_ptr<Runtime> rt;
  try {
    rt = std::make_unique<Runtime>(ro);
  } catch (const std::exception& e) {
    std::cerr << cmd << ": " << e.what() << "\n";
    return 1;
  }
  if (rt->rank() == 0 && rt->hosts().size() > 1) std::cout << "hosts            " << rt->layout() << std::endl;
  try {
    auto report = pretraining ? text::pretrain(*rt, cfg) : text::finetune(*rt, cfg);
    if (rt->rank() == 0) {
      std::cout << format_report(report);
      if (pretraining) std::cout << "checkpoint       " << cfg.checkpoint << "\n";
      if (!cfg.output.empty()) std::cout << "saved            " << cfg.output << "\n";
      std::cout << std::flush;
    }
  } catch (const std::exception& e) {
    auto* ce = dynamic_cast<const c10::Error*>(&e);
    // One write: cerr is unbuffered, and every rank may fail at once (the lines interleaved).
    std::cerr << std::string(cmd) + ": rank " + std::to_string(rt->rank()) + ": " +
                     (ce ? ce->what_without_backtrace() : e.what()) + "\n"
              << std::flush;
    if (rt->world_size() > 1) std::cerr << rt->unreachable_peers() << std::flush;  // names a lost host
    if (rt->world_size() > 1) rt->abort(1);
    return 1;
  }
  return 0;
}

}  // namespace

int cmd_pretrain(int argc, char** argv) { return run_text("pretrain", true, argc, argv); }
int cmd_finetune(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]).rfind("--init-from", 0) == 0) return cmd_finetune_hf(argc, argv);
  }
  return run_text("finetune", false, argc, argv);
}

}  // namespace tandem::cli
