#include <CLI/CLI.hpp>

#include <iostream>

#include "cli_app.h"
#include "commands.h"
#include "host_options.h"
#include "tandem/launcher.h"

namespace tandem::cli {

void add_host_options(CLI::App& app, LaunchOptions& lo) {
  app.add_option("--hostfile", lo.hostfile, "mpirun hostfile, one host a line: 'NAME slots=K' (several machines)");
  app.add_option("--net-if", lo.net_if,
                 "interfaces or subnets for traffic between hosts, e.g. eth1 or 10.1.0.0/16 (default: "
                 "TANDEM_NET_IF, else every interface but loopback)");
  app.add_option("--mpi-arg", lo.mpi_args, "extra argument passed to mpirun (repeatable; --mpi-arg=--mca ...)");
}

int cmd_launch(int argc, char** argv) {
  // Everything after "--" is the program and its arguments.
  const int split = dashdash_index(argc, argv);
  CLI::App app{"Run PROGRAM on N workers through mpirun; stop all of them if one fails.", "tandem launch"};
  LaunchOptions opts;
  // No CLI11 range check: launch() rejects -n < 1 with a clearer message than CLI11's.
  app.add_option("-n,--nprocs", opts.nprocs, "number of workers")->capture_default_str();
  add_host_options(app, opts);
  app.add_option("-x,--env", opts.env, "NAME=VALUE for every worker (repeatable)");
  bool no_prefix = false;
  app.add_flag("--no-prefix", no_prefix, "do not prefix output lines with the rank");
  app.footer(examples_footer({
      {"", {"tandem launch -n 2 -- build/tandem selftest"}},
      {"a program of your own on 8 workers of two hosts", {"tandem launch -n 8 --hostfile hosts -- ./app zero2"}},
  }));
  if (auto rc = parse_command_line(app, split, argv)) return *rc;
  opts.prefix_output = !no_prefix;
  std::vector<std::string> prog(argv + std::min(split + 1, argc), argv + argc);
  if (prog.empty()) {
    std::cerr << "tandem launch: no program given; usage: tandem launch -n N -- PROGRAM ARGS...\n";
    return 2;
  }
  return launch(opts, prog);
}

}  // namespace tandem::cli
