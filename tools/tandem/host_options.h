// The options for several machines, shared by launch, train, pretrain and finetune.
#pragma once

#include <CLI/CLI.hpp>

#include "tandem/launcher.h"

namespace tandem::cli {

// --hostfile, --net-if and --mpi-arg into `lo`. The hostfile is checked by launch(), not here:
// workers parse the same arguments on hosts that may not have the file.
void add_host_options(CLI::App& app, LaunchOptions& lo);

}  // namespace tandem::cli
