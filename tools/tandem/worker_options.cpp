#include "worker_options.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
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
                 "checkpoint when lost hosts answer again; the global batch stays the same unless --elastic-lr scale)")
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

namespace {

// An elastic job (-n MIN:MAX): the launches of one command under tandem/elastic.h's restart loop.
struct ElasticJob {
  std::string command;         // "tandem train", for messages
  std::string checkpoint_dir;  // its --checkpoint-dir: relaunches start from the newest checkpoint there
  std::string metrics_path;    // its --metrics ("": none): the membership changes are appended to it
  int max_failures = 3;
  // The command line of a launch on `workers` workers; the stop file and, for every launch but
  // the first, --resume are added to it.
  std::function<std::vector<std::string>(int workers)> args;
  WorkersFit fits;
};

// Runs the job; its exit code. Prints and records (in the metrics file) every membership change.
int run_elastic_job(const WorkerRange& range, const ElasticJob& job, const LaunchOptions& lo) {
  ElasticOptions eo;
  eo.workers = range;
  eo.checkpoint_dir = job.checkpoint_dir;
  eo.stop_file = job.checkpoint_dir + "/elastic-stop";
  eo.max_failures = job.max_failures;
  auto command = [&](int workers, bool resume) {
    auto a = job.args(workers);
    a.insert(a.end(), {"--elastic-stop-file", eo.stop_file});
    if (resume && std::find(a.begin(), a.end(), "--resume") == a.end()) a.push_back("--resume");
    return a;
  };
  std::cout << "elastic run: " << range.min << " to " << range.max << " workers, checkpoints in '" << job.checkpoint_dir
            << "'" << std::endl;
  ElasticResult r;
  try {
    r = run_elastic(lo, eo, command, job.fits);
  } catch (const std::invalid_argument& e) {
    std::cerr << job.command << ": " << e.what() << "\n";
    return 2;
  }
  if (!r.changes.empty()) {
    std::cout << "membership changes\n" << format_membership(r.changes) << std::flush;
    if (!job.metrics_path.empty() && std::filesystem::exists(job.metrics_path)) {
      std::ofstream(job.metrics_path, std::ios::app) << membership_json_lines(r.changes);
    }
  }
  return r.exit_code;
}

}  // namespace

std::vector<std::string> with_option(const std::vector<std::string>& args, const std::string& flag,
                                     const std::string& value) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == flag) {
      ++i;  // and its value
    } else if (args[i].rfind(flag + "=", 0) != 0) {
      out.push_back(args[i]);
    }
  }
  out.insert(out.end(), {flag, value});
  return out;
}

void add_elastic_lr_option(CLI::App& app, std::string& value) {
  app.add_option("--elastic-lr", value,
                 "elastic runs (-n MIN:MAX): keep (the global batch and learning rate stay at every worker count) | "
                 "scale (each worker's batch stays; the global batch and the learning rate follow the worker count, "
                 "the linear scaling rule)")
      ->capture_default_str();
}

ElasticLr parse_elastic_lr(const std::string& value) {
  if (value == "keep") return ElasticLr::kKeep;
  if (value == "scale") return ElasticLr::kScale;
  throw std::invalid_argument("--elastic-lr '" + value + "' is not one of keep, scale");
}

namespace {

// The global batch of a launch on `workers` workers (0: W/MAX of it is not whole).
int64_t batch_at(const ElasticSpec& spec, const WorkerRange& range, int workers) {
  if (spec.mode == ElasticLr::kKeep) return spec.batch;
  return spec.batch * workers % range.max == 0 ? spec.batch * workers / range.max : 0;
}

// Whether `workers` workers can run the spec.
bool spec_fits(const ElasticSpec& spec, const WorkerRange& range, int workers) {
  if (batch_at(spec, range, workers) < 1) return false;
  try {
    spec.check(workers, batch_at(spec, range, workers));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

std::string elastic_spec_problem(const ElasticSpec& spec, const WorkerRange& range) {
  const std::string n = "-n " + std::to_string(range.min) + ":" + std::to_string(range.max);
  if (spec.checkpoint_dir.empty() || spec.checkpoint_every <= 0) {
    return n + " (elastic) relaunches from checkpoints: give --checkpoint-dir DIR and --checkpoint-every N";
  }
  for (int w = range.max; w >= range.min; --w) {
    if (spec_fits(spec, range, w)) return {};
  }
  std::string why;  // what MAX workers are told: the flags' own problem when it is not the batch
  try {
    spec.check(range.max, spec.batch);
  } catch (const std::exception& e) {
    why = std::string(" (at ") + std::to_string(range.max) + " workers: " + e.what() + ")";
  }
  return n + ": no worker count from " + std::to_string(range.min) + " to " + std::to_string(range.max) +
         " can run this job" + why + "; the global --batch " + std::to_string(spec.batch) +
         " must split evenly over the workers" + (spec.mode == ElasticLr::kScale ? " and scale to W/MAX of it" : "");
}

int run_elastic_command(const ElasticSpec& spec, const WorkerRange& range, const LaunchOptions& lo,
                        const std::vector<std::string>& args) {
  if (auto problem = elastic_spec_problem(spec, range); !problem.empty()) {
    std::cerr << spec.command << ": " << problem << "\n";
    return 2;
  }
  ElasticJob job;
  job.command = spec.command;
  job.checkpoint_dir = spec.checkpoint_dir;
  job.metrics_path = spec.metrics_path;
  job.max_failures = spec.max_failures;
  job.args = [&](int w) {
    auto a = args;
    if (spec.mode == ElasticLr::kScale && w != range.max) {
      std::ostringstream lr;
      lr.precision(17);
      lr << spec.lr * w / range.max;
      a = with_option(with_option(a, "--batch", std::to_string(batch_at(spec, range, w))), "--lr", lr.str());
    }
    return spec.adjust ? spec.adjust(w, std::move(a)) : a;
  };
  job.fits = [&](int w) { return spec_fits(spec, range, w); };
  return run_elastic_job(range, job, lo);
}

}  // namespace tandem::cli
