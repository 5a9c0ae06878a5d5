// tandem: train, launch and check distributed jobs. Thin: flags in, library calls out.
#include <cstring>
#include <exception>
#include <iostream>
#include <string>

#include "commands.h"
#include "tandem/pipeline.h"
#include "tandem/runtime.h"

namespace {
const char* kUsage =
    "usage: tandem COMMAND [OPTIONS]\n"
    "\n"
    "commands:\n"
    "  train      train a model on N workers (default: the CNN on Fashion-MNIST, 2 workers, DDP)\n"
    "  launch     run a program on N workers: tandem launch -n N [--hostfile F] -- PROGRAM ARGS...\n"
    "  selftest   check every collective across the workers: tandem selftest [-n N]\n"
    "  bench      speedup table and plot of a model over strategies and worker counts\n"
    "  plan       predict memory and step time of parallel layouts on a cluster, ranked\n"
    "  k8s        write Kubernetes manifests (MPIJob, checkpoint claim) that run tandem train on a cluster\n"
    "  pretrain   pre-train a transformer language model on text (fortune cookies), with its tokenizer\n"
    "  finetune   fine-tune it to classify text by language, under any strategy and worker count;\n"
    "             or a Hugging Face Llama directory: tandem finetune --init-from DIR --data FILE.jsonl\n"
    "  preprocess tokenize JSON lines once into a memory-mapped dataset for finetune --init-from:\n"
    "             tandem preprocess --init-from DIR --data FILE.jsonl --out DATA_DIR\n"
    "  export     write a checkpoint as a Hugging Face directory: tandem export --to hf OUT --checkpoint DIR\n"
    "\n"
    "Run 'tandem COMMAND --help' for a command's options.\n";
}

int main(int argc, char** argv) {
  tandem::tune_allocator();        // before anything allocates (the calibration times compute in this process)
  tandem::MemoryMeter::install();  // counts CPU tensor bytes for the report's activation peak
  if (argc < 2) {
    // The main job: training with its defaults.
    return tandem::cli::cmd_train(argc, argv);
  }
  std::string cmd = argv[1];
  try {
    if (cmd == "train") return tandem::cli::cmd_train(argc - 1, argv + 1);
    if (cmd == "launch") return tandem::cli::cmd_launch(argc - 1, argv + 1);
    if (cmd == "selftest") return tandem::cli::cmd_selftest(argc - 1, argv + 1);
    if (cmd == "bench") return tandem::cli::cmd_bench(argc - 1, argv + 1);
    if (cmd == "plan") return tandem::cli::cmd_plan(argc - 1, argv + 1);
    if (cmd == "k8s") return tandem::cli::cmd_k8s(argc - 1, argv + 1);
    if (cmd == "preprocess") return tandem::cli::cmd_preprocess(argc - 1, argv + 1);
    if (cmd == "pretrain") return tandem::cli::cmd_pretrain(argc - 1, argv + 1);
    if (cmd == "finetune") return tandem::cli::cmd_finetune(argc - 1, argv + 1);
    if (cmd == "export") return tandem::cli::cmd_export(argc - 1, argv + 1);
    if (cmd == "-h" || cmd == "--help" || cmd == "help") {
      std::cout << kUsage;
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "tandem " << cmd << ": " << e.what() << '\n';
    return 1;
  }
  std::cerr << "tandem: unknown command '" << cmd << "'\n\n" << kUsage;
  return 2;
}
