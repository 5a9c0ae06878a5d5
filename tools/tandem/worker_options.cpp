#include "worker_options.h"

#include <stdexcept>

#include "checks.h"

namespace tandem::cli {

void add_worker_options(CLI::App& app, WorkerFlags& flags, const std::string& default_count) {
  flags.count = default_count;
  const CLI::Validator whole = whole_between(1, kMaxWorkers);
  const CLI::Validator count_or_range(
      [whole](std::string& text) -> std::string {
        if (text.find(':') == std::string::npos) return whole(text);
        try {
          (void)parse_worker_range(text, static_cast<int>(kMaxWorkers));
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
        return {};
      },
      "N or MIN:MAX", "worker_count");
  app.add_option("-n,--nprocs", flags.count,
                 "workers to launch: N, or MIN:MAX for an elastic run (on a failure, relaunch on the hosts that "
                 "answer from the newest checkpoint while at least MIN workers fit; grow back up to MAX at a "
                 "checkpoint when lost hosts answer again; the global batch stays the same)")
      ->check(count_or_range)
      ->capture_default_str();
  app.add_option("--min-workers", flags.min_workers, "elastic run between M and -n N workers (the same as -n M:N)")
      ->check(whole_between(1, kMaxWorkers));
}

WorkerRange worker_range(const WorkerFlags& flags) {
  WorkerRange r = parse_worker_range(flags.count, static_cast<int>(kMaxWorkers));
  if (flags.min_workers == 0) return r;
  if (r.elastic()) {
    throw std::invalid_argument("--min-workers " + std::to_string(flags.min_workers) + " and -n " + flags.count +
                                " both give a minimum; use one of them");
  }
  return parse_worker_range(std::to_string(flags.min_workers) + ":" + flags.count, static_cast<int>(kMaxWorkers));
}

}  // namespace tandem::cli
