// `tandem preprocess --init-from HF_DIR --data FILE.jsonl --out DIR`: the corpus tokenized once into
// Megatron-LM's indexed dataset, which `tandem finetune --init-from HF_DIR --data DIR` reads by mmap.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>

#include "cli_app.h"
#include "commands.h"
#include "tandem/preprocess.h"

namespace tandem::cli {

int cmd_preprocess(int argc, char** argv) {
  CLI::App app{"Tokenize a JSON lines corpus ({\"text\": ...} per line) with a Hugging Face Llama directory's "
               "tokenizer into Megatron-LM's indexed dataset (DIR/text_document.bin, .idx, dataset.json), each "
               "document followed by EOS, for tandem finetune --init-from MODEL --data DIR.",
               "tandem preprocess"};
  text::PreprocessOptions o;
  bool no_progress = false;
  app.add_option("--init-from", o.model_dir, "Hugging Face model directory whose tokenizer encodes the text")
      ->required();
  app.add_option("--data", o.data, "JSON lines file, one {\"text\": ...} object per line")->required();
  app.add_option("--out", o.out, "output directory")->required();
  app.add_option("--threads", o.threads, "tokenizing threads (0: the machine's cores)")->capture_default_str();
  app.add_flag("--no-progress", no_progress, "no progress display");
  app.footer(examples_footer({
      {"tokenize once, then train on packed windows read by mmap",
       {"tandem preprocess --init-from ./my-llama --data corpus.jsonl --out data",
        "tandem finetune --init-from ./my-llama --data data -n 2 --strategy zero2 --seq 2048"}},
  }));
  if (auto rc = parse_command_line(app, argc, argv)) return *rc;
  const bool tty = isatty(1) != 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  int last_tenth = -1;
  if (!no_progress) {
    o.progress = [&](int64_t bytes, int64_t total, int64_t docs, int64_t tokens) {
      const double f = total > 0 ? static_cast<double>(bytes) / static_cast<double>(total) : 1.0;
      const double s = seconds();
      const int tenth = static_cast<int>(f * 10);
      if (!tty && tenth == last_tenth) return;
      last_tenth = tenth;
      const int filled = static_cast<int>(f * 30);
      std::printf("%s[%s%s] %5.1f%% %.0f MB/s %lld documents %lld tokens%s", tty ? "\r" : "",
                  std::string(filled, '=').c_str(), std::string(30 - filled, ' ').c_str(), 100 * f,
                  s > 0 ? bytes / s / 1e6 : 0.0, static_cast<long long>(docs), static_cast<long long>(tokens),
                  tty ? " " : "\n");
      std::fflush(stdout);
    };
  }
  try {
    const auto info = text::preprocess(o);
    if (!no_progress && tty) std::printf("\n");
    std::cout << "preprocessed     " << o.data << ": " << info.documents << " documents, " << info.tokens << " tokens ("
              << data::to_string(info.type) << ", EOS " << info.eos << " after each) in " << fixed(seconds(), 1)
              << " s\n"
              << "wrote            " << o.out << "/" << info.prefix << ".bin, .idx, " << data::kDatasetInfoFile << "\n";
  } catch (const std::exception& e) {
    if (!no_progress && tty) std::printf("\n");
    std::cerr << "tandem preprocess: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace tandem::cli
