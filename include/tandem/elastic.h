// Elastic runs: between MIN and MAX workers on the hosts of a hostfile. When the workers fail,
// the hosts are probed, the unreachable ones dropped, and the job relaunched on the rest from the
// newest checkpoint while at least MIN workers fit; while it runs below MAX, the lost hosts are
// probed again at every committed checkpoint and, once one answers, the workers are asked to stop
// cleanly at their next checkpoint so that the job is relaunched on more hosts from it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tandem/launcher.h"

namespace c10 {
struct Device;
}

namespace tandem {

class Communicator;

// The worker count of -n: "N" (fixed: min = max = N) or "MIN:MAX" (elastic).
struct WorkerRange {
  int min = 1;
  int max = 1;
  bool elastic() const { return min != max; }
};

// Parses "N" or "MIN:MAX"; throws std::invalid_argument naming what is wrong (not a number,
// MIN < 1, MIN > MAX, above `limit`).
WorkerRange parse_worker_range(const std::string& text, int limit);

// One line of an mpirun hostfile: "NAME slots=K" (slots 1 when absent; comments and blank lines
// are skipped).
struct HostSlots {
  std::string name;
  int slots = 1;
};
std::vector<HostSlots> read_hostfile(const std::string& path);

struct ElasticOptions {
  WorkerRange workers;
  std::string checkpoint_dir;  // where the workers commit checkpoints (step-N/manifest.json)
  // The file the launcher creates to ask the workers to stop at their next checkpoint (they
  // delete it when they act on it); the workers must be told its path.
  std::string stop_file;
  // Relaunches after failures (those after a clean stop to grow do not count).
  int max_failures = 3;
  // A host answers when a TCP connection to this port is accepted or refused (its network stack
  // replies); no reply within probe_wait means unreachable.
  int probe_port = 22;
  std::chrono::milliseconds probe_wait{1500};
  // How often the checkpoint directory is looked at while the workers run.
  std::chrono::milliseconds poll_every{300};
};

// A change of the job's membership, as the report lists it.
struct MembershipChange {
  std::string at_utc;     // ISO 8601
  double at_seconds = 0;  // since the elastic run started
  int old_workers = 0;
  int new_workers = 0;
  std::vector<std::string> lost, regained;  // host names
  int64_t resume_step = 0;                  // the checkpoint step the relaunch starts from
  std::string reason;                       // "failure" | "hosts returned"
};

struct ElasticResult {
  int exit_code = 0;
  std::vector<MembershipChange> changes;
};

// What a launch of `workers` workers runs (program and arguments); `resume` is true for every
// launch but the first.
using ElasticCommand = std::function<std::vector<std::string>(int workers, bool resume)>;
// Whether `workers` workers can run the job (e.g. the global batch divides over them).
using WorkersFit = std::function<bool(int workers)>;

// Runs the job elastically through launch(); `base` gives the hostfile (empty: this machine
// with workers.max slots, never probed), network and environment. Prints each membership change
// as it happens. Throws std::invalid_argument for options that cannot work (MAX above the
// hostfile's slots, no checkpoint directory, no worker count in range that fits).
ElasticResult run_elastic(const LaunchOptions& base, const ElasticOptions& opts, const ElasticCommand& command,
                          const WorkersFit& fits);

// The workers' side of ElasticOptions::stop_file, at a committed checkpoint: rank 0 of `world`
// looks for the file and every rank gets its answer, so that all of them leave their loop at the
// same step. False when stop_file is "". `device` is where the world's tensors live.
bool elastic_stop_requested(Communicator& world, const std::string& stop_file, const c10::Device& device);
// Once the loop that stopped has committed its last checkpoint: rank 0 deletes the file (the
// launcher's sign that the checkpoint is complete) and says so.
void acknowledge_elastic_stop(int rank, const std::string& stop_file, int64_t step);

// The membership changes as report lines ("" when none), and as JSON lines for a metrics file.
std::string format_membership(const std::vector<MembershipChange>& changes);
std::string membership_json_lines(const std::vector<MembershipChange>& changes);

}  // namespace tandem
