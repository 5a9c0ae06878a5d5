// Starting N workers on this machine (or on the hosts of a hostfile) through mpirun, with
// the flags a shared machine needs, each output line prefixed with its rank. If any worker
// exits non-zero or is killed, the others are stopped and the failed rank is named.
#pragma once

#include <string>
#include <vector>

namespace tandem {

// OpenMPI's btl_vader_eager_limit as the launcher sets it (unless the user does): messages up
// to this size between ranks of one host are copied into the receiver's queue when posted.
inline constexpr long kLocalEagerLimitBytes = 256 * 1024;

struct LaunchOptions {
  int nprocs = 1;
  std::string hostfile;  // empty: this machine only
  // Network interfaces or subnets for MPI's traffic between hosts ("eth1", "10.1.0.0/16",
  // comma-separated; OpenMPI's btl_tcp_if_include and oob_tcp_if_include). Empty: the
  // TANDEM_NET_IF environment variable, else OpenMPI's own choice (every interface but loopback).
  std::string net_if;
  // After mpirun reports a failed worker, how long it may take to stop the others before it is
  // terminated (it can wait forever for a daemon on a host that became unreachable).
  double stop_grace_s = 10;
  std::vector<std::string> mpi_args;  // extra mpirun arguments, passed as given
  std::vector<std::string> env;       // NAME=VALUE exported to every worker
  bool prefix_output = true;          // "[rank R] " before each line
};

// Runs `argv` (program and its arguments) on opts.nprocs ranks and waits for all of them.
// Returns 0 if every rank exited 0; otherwise prints which rank failed and how, and returns
// that rank's exit code (or 128+signal), at least 1.
int launch(const LaunchOptions& opts, const std::vector<std::string>& argv);

// The mpirun command line launch() would run (for messages and tests).
std::vector<std::string> mpirun_command(const LaunchOptions& opts, const std::vector<std::string>& argv);

// Path of the running executable (for re-launching oneself as workers).
std::string self_executable();

}  // namespace tandem
