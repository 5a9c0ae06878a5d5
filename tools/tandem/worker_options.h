// -n as train, pretrain and finetune take it: N workers, or MIN:MAX for an elastic run
// (tandem/elastic.h), with --min-workers M as the other spelling of M:N.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

#include "tandem/elastic.h"
#include "tandem/launcher.h"

namespace tandem::cli {

struct WorkerFlags {
  std::string count = "2";  // as typed: "N" or "MIN:MAX"
  int min_workers = 0;      // 0: not given
};

// -n/--nprocs (checked as typed: a whole number in range, or MIN:MAX) and --min-workers.
void add_worker_options(CLI::App& app, WorkerFlags& flags, const std::string& default_count);

// The range the flags ask for; std::invalid_argument naming the conflict otherwise.
WorkerRange worker_range(const WorkerFlags& flags);

// `args` without `flag` (as "--flag V" or "--flag=V"), then "flag value".
std::vector<std::string> with_option(const std::vector<std::string>& args, const std::string& flag,
                                     const std::string& value);

// --elastic-lr keep|scale of an elastic run: keep the global batch and learning rate at every
// worker count (the default), or keep each worker's batch and scale the global batch and the
// learning rate with the worker count (the linear scaling rule, Goyal et al.).
enum class ElasticLr { kKeep, kScale };
void add_elastic_lr_option(CLI::App& app, std::string& value);
ElasticLr parse_elastic_lr(const std::string& value);  // std::invalid_argument naming the value

// An elastic command in terms of its global batch: a launch on W workers runs `args` with, under
// ElasticLr::kScale, W/MAX of the global --batch (the one given, at MAX workers) and of --lr,
// then adjust(W, args) when set. W workers fit when check(W, that batch) does not throw.
struct ElasticSpec {
  std::string command;           // "tandem train", for messages
  std::string checkpoint_dir;    // --checkpoint-dir
  int64_t checkpoint_every = 0;  // --checkpoint-every
  std::string metrics_path;      // --metrics
  int64_t batch = 0;             // --batch as given
  double lr = 0.0;               // --lr as given
  ElasticLr mode = ElasticLr::kKeep;
  int max_failures = 3;
  std::function<void(int workers, int64_t batch)> check;  // throws std::exception naming the problem
  std::function<std::vector<std::string>(int workers, std::vector<std::string> args)> adjust;
};

// Why the spec cannot run ("" when it can): no checkpoints to relaunch from, or no worker count
// in range that fits (with what MAX workers are told).
std::string elastic_spec_problem(const ElasticSpec& spec, const WorkerRange& range);
// Runs the spec under tandem/elastic.h's restart loop (run_elastic), printing and recording in the
// metrics file every membership change; 2 with elastic_spec_problem on stderr when it cannot work.
int run_elastic_command(const ElasticSpec& spec, const WorkerRange& range, const LaunchOptions& lo,
                        const std::vector<std::string>& args);

}  // namespace tandem::cli
