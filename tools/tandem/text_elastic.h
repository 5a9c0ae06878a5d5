// -n MIN:MAX for tandem pretrain and finetune (both forms): the workers relaunched from the text
// loop's checkpoints (tandem/text.h, TextCheckpoints) through tandem/elastic.h.
#pragma once

#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "tandem/text.h"
#include "worker_options.h"

namespace tandem::cli {

// `loop` is the run's configuration as parsed; `check(workers, batch)` throws std::exception
// when that many workers cannot run it at that global batch. With ElasticLr::kKeep every launch
// has loop.batch and loop.lr; with kScale, --batch is the global batch at MAX workers and a launch
// on W workers gets W/MAX of it and of the learning rate (the sampler continues by samples, so a
// resume at another global batch draws the documents that come next).
inline int run_text_elastic(const std::string& cmd, const text::TextTrainConfig& loop, ElasticLr mode,
                            const WorkerRange& range, const std::function<void(int, int64_t)>& check,
                            const LaunchOptions& lo, const std::vector<std::string>& args) {
  const std::string n = "-n " + std::to_string(range.min) + ":" + std::to_string(range.max);
  if (loop.checkpoints.dir.empty() || loop.checkpoints.every <= 0) {
    std::cerr << cmd << ": " << n
              << " (elastic) relaunches from checkpoints: give --checkpoint-dir DIR and --checkpoint-every N\n";
    return 2;
  }
  auto batch_at = [&](int w) -> int64_t {
    if (mode == ElasticLr::kKeep) return loop.batch;
    return loop.batch * w % range.max == 0 ? loop.batch * w / range.max : 0;
  };
  auto fits = [&](int w) {
    if (batch_at(w) < 1) return false;
    try {
      check(w, batch_at(w));
      return true;
    } catch (const std::exception&) {
      return false;
    }
  };
  bool any = false;
  for (int w = range.max; w >= range.min && !any; --w) any = fits(w);
  if (!any) {
    std::string why;  // what MAX workers are told: the flags' own problem when it is not the batch
    try {
      check(range.max, batch_at(range.max) > 0 ? batch_at(range.max) : loop.batch);
    } catch (const std::exception& e) {
      why = std::string(" (at ") + std::to_string(range.max) + " workers: " + e.what() + ")";
    }
    std::cerr << cmd << ": " << n << ": no worker count from " << range.min << " to " << range.max
              << " can run this job" << why << "; the global --batch " << loop.batch
              << " must split evenly over the workers" << (mode == ElasticLr::kScale ? " and scale to W/MAX of it" : "")
              << "\n";
    return 2;
  }
  ElasticJob job;
  job.command = cmd;
  job.checkpoint_dir = loop.checkpoints.dir;
  job.metrics_path = loop.metrics_path;
  job.args = [&](int w) {
    if (mode == ElasticLr::kKeep || w == range.max) return args;
    std::ostringstream lr;
    lr.precision(17);
    lr << loop.lr * w / range.max;
    return with_option(with_option(args, "--batch", std::to_string(batch_at(w))), "--lr", lr.str());
  };
  job.fits = fits;
  return run_elastic_job(range, job, lo);
}

}  // namespace tandem::cli
