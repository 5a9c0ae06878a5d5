// The pipeline schedule flags that tandem train, pretrain and finetune share.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace tandem::cli {

// --pipeline-schedule and --virtual-stages (the Engine checks the combination).
inline void add_pipeline_schedule_options(CLI::App& app, std::string& schedule, int& virtual_stages) {
  app.add_option("--pipeline-schedule", schedule,
                 "gpipe | 1f1b | interleaved (with --pp; interleaved: --micro-batches a multiple of --pp)")
      ->capture_default_str();
  app.add_option("--virtual-stages", virtual_stages,
                 "model chunks per pipeline rank with --pipeline-schedule interleaved (chunk c of rank r is virtual "
                 "stage c*pp + r; --pp-partition then lists pp x V layer counts)")
      ->capture_default_str();
}

}  // namespace tandem::cli
