// Elastic runs (tandem/elastic.h): the restart loop around launch(), host probing, and the
// watcher that asks the workers to stop at a checkpoint when lost hosts answer again.
#include "tandem/elastic.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <torch/torch.h>

#include "runtime/peer_probe.h"
#include "tandem/checkpoint.h"
#include "tandem/comm.h"

namespace tandem {
namespace {

using Clock = std::chrono::steady_clock;

int parse_count(const std::string& s, const std::string& what, const std::string& text) {
  size_t used = 0;
  int v = 0;
  try {
    v = std::stoi(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (s.empty() || used != s.size()) {
    throw std::invalid_argument("'" + text + "': " + what + " '" + s +
                                "' is not a whole number; give N workers or MIN:MAX (e.g. 2:4)");
  }
  return v;
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string comma_list(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// IPv4 addresses of `host` ("" when it does not resolve).
std::vector<std::string> resolve(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::vector<std::string> out;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (auto* p = res; p; p = p->ai_next) {
    char buf[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(p->ai_addr)->sin_addr, buf, sizeof(buf));
    if (std::find(out.begin(), out.end(), buf) == out.end()) out.emplace_back(buf);
  }
  freeaddrinfo(res);
  return out;
}

// The hosts that answer, of `hosts`, all probed at once.
std::vector<HostSlots> reachable(const std::vector<HostSlots>& hosts, const ElasticOptions& o) {
  std::vector<detail::PeerAddress> peers;
  for (const auto& h : hosts) peers.push_back({resolve(h.name), o.probe_port});
  const auto state = detail::probe_peers(peers, o.probe_wait);
  std::vector<HostSlots> up;
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (state[i] != detail::PeerState::kUnreachable) up.push_back(hosts[i]);
  }
  return up;
}

int slots_of(const std::vector<HostSlots>& hosts) {
  int n = 0;
  for (const auto& h : hosts) n += h.slots;
  return n;
}

bool has_host(const std::vector<HostSlots>& hosts, const std::string& name) {
  return std::any_of(hosts.begin(), hosts.end(), [&](const HostSlots& h) { return h.name == name; });
}

// Names in `a` that are not in `b`.
std::vector<std::string> minus(const std::vector<HostSlots>& a, const std::vector<HostSlots>& b) {
  std::vector<std::string> out;
  for (const auto& h : a) {
    if (!has_host(b, h.name)) out.push_back(h.name);
  }
  return out;
}

// The most workers in [min, max] that fit on `slots` slots and run the job; 0 when none.
int choose_workers(int slots, const WorkerRange& r, const WorkersFit& fits) {
  for (int w = std::min(slots, r.max); w >= r.min; --w) {
    if (fits(w)) return w;
  }
  return 0;
}

int64_t newest_step(const std::string& dir) {
  const std::string d = latest_checkpoint(dir);
  return d.empty() ? -1 : read_checkpoint_meta(d).step;
}

// One hostfile per launch, the hosts that are in (in the user's order: ranks fill them by slot).
class SegmentHostfile {
 public:
  SegmentHostfile() {
    char tmpl[] = "/tmp/tandem-elastic-hosts-XXXXXX";
    int fd = mkstemp(tmpl);
    if (fd < 0) throw std::runtime_error(std::string("cannot create a hostfile in /tmp: ") + std::strerror(errno));
    close(fd);
    path_ = tmpl;
  }
  ~SegmentHostfile() { std::remove(path_.c_str()); }
  SegmentHostfile(const SegmentHostfile&) = delete;
  SegmentHostfile& operator=(const SegmentHostfile&) = delete;
  const std::string& write(const std::vector<HostSlots>& hosts) {
    std::ofstream f(path_, std::ios::trunc);
    for (const auto& h : hosts) f << h.name << " slots=" << h.slots << '\n';
    if (!f) throw std::runtime_error("cannot write the hostfile '" + path_ + "'");
    return path_;
  }

 private:
  std::string path_;
};

// The state one elastic run carries from launch to launch.
class ElasticRun {
 public:
  ElasticRun(const LaunchOptions& base, const ElasticOptions& o, const ElasticCommand& command, const WorkersFit& fits)
      : base_(base), o_(o), command_(command), fits_(fits), start_(Clock::now()) {}

  ElasticResult run();

 private:
  std::vector<HostSlots> listed() const {
    if (base_.hostfile.empty()) return {{"localhost", o_.workers.max}};
    return read_hostfile(base_.hostfile);
  }
  std::vector<HostSlots> probe(const std::vector<HostSlots>& hosts) const {
    return base_.hostfile.empty() ? hosts : reachable(hosts, o_);
  }
  int launch_watched(int workers, bool resume);
  void watch(int workers, const std::atomic<bool>& done);
  std::vector<std::string> hosts_to_grow(int workers);
  void record(int old_w, int new_w, const std::vector<HostSlots>& before, const std::string& reason);
  int below_minimum(const std::vector<HostSlots>& hosts, int rc);

  LaunchOptions base_;
  ElasticOptions o_;
  ElasticCommand command_;
  WorkersFit fits_;
  Clock::time_point start_;
  std::vector<HostSlots> live_;  // the hosts of the current launch
  std::atomic<bool> stop_asked_{false};
  ElasticResult result_;
};

void ElasticRun::record(int old_w, int new_w, const std::vector<HostSlots>& before, const std::string& reason) {
  MembershipChange c;
  c.at_utc = utc_now();
  c.at_seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  c.old_workers = old_w;
  c.new_workers = new_w;
  c.lost = minus(before, live_);
  c.regained = minus(live_, before);
  c.resume_step = std::max<int64_t>(0, newest_step(o_.checkpoint_dir));
  c.reason = reason;
  result_.changes.push_back(c);
  std::cout << "elastic: " << format_membership({c}) << std::flush;
}

// Runs the workers; meanwhile, at every new checkpoint below MAX, probes the hosts that are out.
int ElasticRun::launch_watched(int workers, bool resume) {
  std::remove(o_.stop_file.c_str());
  stop_asked_ = false;
  SegmentHostfile hf;
  LaunchOptions lo = base_;
  lo.nprocs = workers;
  if (!base_.hostfile.empty()) lo.hostfile = hf.write(live_);
  std::vector<std::string> names;
  for (const auto& h : live_) names.push_back(h.name);
  std::cout << "elastic: launching " << workers << " worker(s) on " << comma_list(names) << std::endl;
  std::atomic<bool> done{false};
  std::thread watcher;
  if (workers < o_.workers.max) watcher = std::thread([&] { watch(workers, done); });
  int rc = 1;
  try {
    rc = launch(lo, command_(workers, resume));
  } catch (...) {
    done = true;
    if (watcher.joinable()) watcher.join();
    throw;
  }
  done = true;
  if (watcher.joinable()) watcher.join();
  return rc;
}

void ElasticRun::watch(int workers, const std::atomic<bool>& done) {
  int64_t seen = -1;  // the checkpoint resumed from is not a new one
  try {
    seen = newest_step(o_.checkpoint_dir);
  } catch (const std::exception&) {
  }
  while (!done && !stop_asked_) {
    std::this_thread::sleep_for(o_.poll_every);
    // A checkpoint replaced (--keep) as it is read, or a hostfile being edited: look again later.
    try {
      const int64_t now = newest_step(o_.checkpoint_dir);
      if (now <= seen) continue;
      seen = now;
      const auto back = hosts_to_grow(workers);
      if (!back.empty()) {
        stop_asked_ = true;
        // One write: the workers' output goes to the same stream from the launching thread.
        std::cout << "elastic: after checkpoint step " + std::to_string(now) + ", " + comma_list(back) +
                         " answer(s) again; the workers stop at their next checkpoint to take them in\n"
                  << std::flush;
      }
    } catch (const std::exception&) {
    }
  }
}

// Probes the hosts that are out; when more workers would fit with those that answer, creates
// the stop file and returns their names (else none).
std::vector<std::string> ElasticRun::hosts_to_grow(int workers) {
  std::vector<HostSlots> out;
  for (const auto& h : listed()) {
    if (!has_host(live_, h.name)) out.push_back(h);
  }
  if (out.empty()) return {};
  auto grown = live_;
  std::vector<std::string> names;
  for (const auto& h : probe(out)) {
    grown.push_back(h);
    names.push_back(h.name);
  }
  if (choose_workers(slots_of(grown), o_.workers, fits_) <= workers) return {};
  std::ofstream f(o_.stop_file);
  f << "grow\n";
  return f ? names : std::vector<std::string>{};
}

int ElasticRun::below_minimum(const std::vector<HostSlots>& hosts, int rc) {
  std::vector<std::string> lost;
  for (const auto& h : hosts) {
    if (!has_host(live_, h.name)) lost.push_back(h.name + " (unreachable)");
  }
  std::cerr << "tandem: elastic run stopped: the hosts that answer (" << slots_of(live_)
            << " slot(s)) fit fewer than the minimum " << o_.workers.min << " worker(s)"
            << (lost.empty() ? std::string() : "; lost hosts: " + comma_list(lost))
            << ". Bring the hosts back (or lower MIN in -n MIN:MAX) and rerun with --resume to continue from the "
               "newest checkpoint in '"
            << o_.checkpoint_dir << "'" << std::endl;
  return rc != 0 ? rc : 1;
}

ElasticResult ElasticRun::run() {
  auto hosts = listed();
  if (slots_of(hosts) < o_.workers.max) {
    throw std::invalid_argument("-n " + std::to_string(o_.workers.min) + ":" + std::to_string(o_.workers.max) +
                                ": MAX is above the " + std::to_string(slots_of(hosts)) + " slot(s) of hostfile '" +
                                base_.hostfile + "'; lower MAX or add hosts (NAME slots=K)");
  }
  live_ = probe(hosts);
  int workers = choose_workers(slots_of(live_), o_.workers, fits_);
  if (workers == 0) {
    result_.exit_code = below_minimum(hosts, 1);
    return result_;
  }
  int failures = 0;
  for (bool resume = false;; resume = true) {
    const int rc = launch_watched(workers, resume);
    const bool stopped_to_grow = rc == 0 && stop_asked_ && access(o_.stop_file.c_str(), F_OK) != 0;
    if (rc == 0 && !stopped_to_grow) {
      std::remove(o_.stop_file.c_str());  // asked too late: the workers had finished
      result_.exit_code = 0;
      return result_;
    }
    if (rc != 0 && ++failures > o_.max_failures) {
      std::cerr << "tandem: the workers failed " << failures << " times; giving up (allowed relaunches after a "
                << "failure: " << o_.max_failures << ")" << std::endl;
      result_.exit_code = rc;
      return result_;
    }
    hosts = listed();  // hosts listed again in the hostfile are taken in here
    const auto before = live_;
    live_ = probe(hosts);
    const int next = choose_workers(slots_of(live_), o_.workers, fits_);
    if (next == 0) {
      result_.exit_code = below_minimum(hosts, rc);
      return result_;
    }
    record(workers, next, before, rc == 0 ? "hosts returned" : "failure");
    workers = next;
  }
}

}  // namespace

WorkerRange parse_worker_range(const std::string& text, int limit) {
  WorkerRange r;
  const auto colon = text.find(':');
  if (colon == std::string::npos) {
    r.min = r.max = parse_count(text, "the worker count", text);
  } else {
    r.min = parse_count(text.substr(0, colon), "MIN", text);
    r.max = parse_count(text.substr(colon + 1), "MAX", text);
  }
  if (r.min < 1) throw std::invalid_argument("'" + text + "': at least 1 worker is needed (MIN >= 1)");
  if (r.min > r.max) {
    throw std::invalid_argument("'" + text + "': MIN (" + std::to_string(r.min) + ") is above MAX (" +
                                std::to_string(r.max) + "); give -n MIN:MAX with MIN <= MAX");
  }
  if (r.max > limit) {
    throw std::invalid_argument("'" + text + "': at most " + std::to_string(limit) + " workers");
  }
  return r;
}

std::vector<HostSlots> read_hostfile(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::invalid_argument("hostfile '" + path + "' cannot be read: " + std::strerror(errno));
  std::vector<HostSlots> hosts;
  std::string line;
  for (int n = 1; std::getline(f, line); ++n) {
    line = line.substr(0, line.find('#'));
    std::istringstream in(line);
    HostSlots h;
    if (!(in >> h.name)) continue;
    std::string field;
    while (in >> field) {
      if (field.rfind("slots=", 0) != 0) continue;  // max_slots=... and others are mpirun's
      try {
        h.slots = std::stoi(field.substr(6));
      } catch (const std::exception&) {
        h.slots = 0;
      }
      if (h.slots < 1) {
        throw std::invalid_argument("hostfile '" + path + "' line " + std::to_string(n) + ": '" + field +
                                    "' is not a positive slot count (NAME slots=K)");
      }
    }
    hosts.push_back(h);
  }
  if (hosts.empty()) throw std::invalid_argument("hostfile '" + path + "' lists no hosts (NAME slots=K a line)");
  return hosts;
}

ElasticResult run_elastic(const LaunchOptions& base, const ElasticOptions& opts, const ElasticCommand& command,
                          const WorkersFit& fits) {
  if (opts.checkpoint_dir.empty()) {
    throw std::invalid_argument(
        "an elastic run (-n MIN:MAX) resumes from checkpoints: give --checkpoint-dir DIR and --checkpoint-every N");
  }
  if (opts.stop_file.empty()) throw std::invalid_argument("an elastic run needs a stop file path for its workers");
  ElasticRun run(base, opts, command, fits);
  return run.run();
}

std::string format_membership(const std::vector<MembershipChange>& changes) {
  std::ostringstream os;
  for (const auto& c : changes) {
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%.1f", c.at_seconds);
    os << c.at_utc << " (+" << secs << " s): " << c.old_workers << " -> " << c.new_workers << " workers (" << c.reason
       << ")";
    if (!c.lost.empty()) os << "; lost " << comma_list(c.lost);
    if (!c.regained.empty()) os << "; regained " << comma_list(c.regained);
    os << "; resuming from step " << c.resume_step << '\n';
  }
  return os.str();
}

std::string membership_json_lines(const std::vector<MembershipChange>& changes) {
  std::string out;
  for (const auto& c : changes) {
    out += nlohmann::json{{"membership",
                           {{"time", c.at_utc},
                            {"seconds", c.at_seconds},
                            {"old_workers", c.old_workers},
                            {"new_workers", c.new_workers},
                            {"lost", c.lost},
                            {"regained", c.regained},
                            {"resume_step", c.resume_step},
                            {"reason", c.reason}}}}
               .dump() +
           "\n";
  }
  return out;
}

bool elastic_stop_requested(Communicator& world, const std::string& stop_file, const c10::Device& device) {
  if (stop_file.empty()) return false;
  const bool here = world.rank() == 0 && access(stop_file.c_str(), F_OK) == 0;
  auto flag = torch::tensor({here ? 1.0 : 0.0}, torch::kDouble).to(device);
  world.allreduce(flag, ReduceOp::kSum);
  return flag.cpu().item<double>() > 0;
}

void acknowledge_elastic_stop(int rank, const std::string& stop_file, int64_t step) {
  if (rank != 0) return;
  std::remove(stop_file.c_str());
  std::cout << "stopping at step " << step << " (checkpoint committed) as '" << stop_file << "' asks" << std::endl;
}

}  // namespace tandem
