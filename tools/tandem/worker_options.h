// -n as train, pretrain and finetune take it: N workers, or MIN:MAX for an elastic run
// (tandem/elastic.h), with --min-workers M as the other spelling of M:N.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "tandem/elastic.h"

namespace tandem::cli {

struct WorkerFlags {
  std::string count = "2";  // as typed: "N" or "MIN:MAX"
  int min_workers = 0;      // 0: not given
};

// -n/--nprocs (checked as typed: a whole number in range, or MIN:MAX) and --min-workers.
void add_worker_options(CLI::App& app, WorkerFlags& flags, const std::string& default_count);

// The range the flags ask for; std::invalid_argument naming the conflict otherwise.
WorkerRange worker_range(const WorkerFlags& flags);

}  // namespace tandem::cli
