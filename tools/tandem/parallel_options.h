// The layout flags of tandem train, pretrain, finetune and finetune --init-from: one set, parsed
// into the typed tandem::ParallelConfig as they are read (the only place their words are read),
// so every command reaches every layout. Conflicts between them are tandem::validate's to find.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <stdexcept>
#include <string>

#include "tandem/engine.h"

namespace tandem::cli {

// A flag whose word `parse` turns into `target` as it is read; `shown` is the default --help
// prints. parse's std::invalid_argument becomes the parse error, which names the flag (once:
// a message that already starts with the flag keeps its own wording).
template <typename T>
CLI::Option* add_word_option(CLI::App& app, const std::string& name, T& target,
                             std::function<T(const std::string&)> parse, const std::string& shown,
                             const std::string& help) {
  return app
      .add_option_function<std::string>(
          name,
          [&target, parse, name](const std::string& word) {
            try {
              target = parse(word);
            } catch (const std::invalid_argument& e) {
              const std::string why = e.what();
              throw CLI::ValidationError(why.rfind(name, 0) == 0 ? why : name + ": " + why);
            }
          },
          help)
      ->type_name("TEXT")
      ->default_str(shown);
}

// --strategy, --precision, --initial-loss-scale, --max-grad-norm, --tp, --pp, --micro-batches,
// --pipeline-schedule, --virtual-stages, --pp-partition, --grad-accum and
// --activation-checkpointing, writing into `pc`; the defaults shown are `pc`'s values when
// called. A word that is not one of a flag's choices fails the parse naming the flag and the
// choices. `pc` must outlive the parse.
void add_parallel_options(CLI::App& app, ParallelConfig& pc);

}  // namespace tandem::cli
