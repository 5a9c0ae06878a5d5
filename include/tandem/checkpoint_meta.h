// What a checkpoint records besides tensors (tandem/checkpoint.h). Kept free of LibTorch so
// that the manifest parser (and its fuzz target) build without it.
#pragma once

#include <cstdint>
#include <string>

namespace tandem {

// save_checkpoint() fills world_size and optimizer (and stores the layout, Adam's step count
// and the RNG state itself); the caller fills the rest.
struct CheckpointMeta {
  std::string model;              // model name; loading into another name fails
  std::string model_description;  // free text (architecture, parameter count)
  std::string strategy;           // ddp | single | zero1 | zero2 | zero3 | any label
  std::string precision = "fp32";
  std::string optimizer;      // sgd | adam | adamw | lars | lamb: loading into another kind fails
  int world_size = 1;         // set by save
  int64_t step = 0;           // optimizer steps done (all epochs)
  int64_t epoch = 0;          // epoch in progress at the save
  int64_t step_in_epoch = 0;  // batches of that epoch already consumed
  uint64_t seed = 0;
  double loss_scale = 1.0;  // fp16 dynamic loss scaler
  int64_t loss_scale_good_steps = 0;
  int64_t skipped_steps = 0;
  std::string extra_json = "{}";  // any JSON object the caller wants back (e.g. the config)
};

}  // namespace tandem
