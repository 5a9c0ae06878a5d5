#include <CLI/CLI.hpp>

#include <iostream>

#include "commands.h"
#include "tandem/launcher.h"

namespace tandem::cli {

int cmd_launch(int argc, char** argv) {
  // Everything after "--" is the program and its arguments.
  int split = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      split = i;
      break;
    }
  }
  CLI::App app{"Run PROGRAM on N workers through mpirun; stop all of them if one fails.", "tandem launch"};
  LaunchOptions opts;
  // No CLI11 range check: launch() rejects -n < 1 with a clearer message than CLI11's.
  app.add_option("-n,--nprocs", opts.nprocs, "number of workers");
  app.add_option("--hostfile", opts.hostfile, "mpirun hostfile (several machines)")->check(CLI::ExistingFile);
  app.add_option("-x,--env", opts.env, "NAME=VALUE for every worker (repeatable)");
  app.add_option("--mpi-arg", opts.mpi_args, "extra argument passed to mpirun (repeatable)");
  bool no_prefix = false;
  app.add_flag("--no-prefix", no_prefix, "do not prefix output lines with the rank");
  app.footer("example: tandem launch -n 2 -- ./build/tandem selftest");
  try {
    app.parse(split, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  opts.prefix_output = !no_prefix;
  std::vector<std::string> prog(argv + std::min(split + 1, argc), argv + argc);
  if (prog.empty()) {
    std::cerr << "tandem launch: no program given; usage: tandem launch -n N -- PROGRAM ARGS...\n";
    return 2;
  }
  return launch(opts, prog);
}

}  // namespace tandem::cli
