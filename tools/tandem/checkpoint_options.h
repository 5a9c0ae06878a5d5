// The checkpoint flags that tandem pretrain, finetune and finetune --init-from share
// (tandem/text.h, TextCheckpoints).
#pragma once

#include <CLI/CLI.hpp>

#include "tandem/text.h"

namespace tandem::cli {

// --checkpoint-dir, --checkpoint-every, --keep, --checkpoint-async, --resume and the launcher's
// internal --elastic-stop-file (text::validate checks the combination).
inline void add_text_checkpoint_options(CLI::App& app, text::TextCheckpoints& c) {
  app.add_option("--checkpoint-dir", c.dir,
                 "write step-N checkpoints here (every --checkpoint-every steps, and at the end; any layout resumes "
                 "them)");
  app.add_option("--checkpoint-every", c.every, "save every N steps (0: at the end only)")->capture_default_str();
  app.add_option("--keep", c.keep, "keep the newest K checkpoints (0: all)")->capture_default_str();
  app.add_flag("--checkpoint-async", c.async,
               "write checkpoints on a background thread while training continues (committed atomically when "
               "complete)");
  app.add_flag("--resume", c.resume,
               "continue from the newest checkpoint in --checkpoint-dir (any strategy / worker count)");
  app.add_option("--elastic-stop-file", c.stop_file, "(internal) stop at a checkpoint when this file exists")
      ->group("");
}

}  // namespace tandem::cli
