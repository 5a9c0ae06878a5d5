// -n MIN:MAX for tandem pretrain and finetune (both forms): the workers relaunched from the text
// loop's checkpoints (tandem/text.h, TextCheckpoints) as run_elastic_command says.
#pragma once

#include <string>

#include "tandem/text.h"
#include "worker_options.h"

namespace tandem::cli {

// `loop` is the run's configuration as parsed; the spec's check is the caller's.
inline ElasticSpec text_elastic_spec(const std::string& cmd, const text::TextTrainConfig& loop, ElasticLr mode) {
  ElasticSpec spec;
  spec.command = cmd;
  spec.checkpoint_dir = loop.checkpoints.dir;
  spec.checkpoint_every = loop.checkpoints.every;
  spec.metrics_path = loop.metrics_path;
  spec.batch = loop.batch;
  spec.lr = loop.lr;
  spec.mode = mode;
  return spec;
}

}  // namespace tandem::cli
