// `tandem launch`: wraps mpirun, rewrites its output tags to "[rank R] ", and turns its
// failure report into one line naming the failed rank.
#include "tandem/launcher.h"

#include "tandem_build_config.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <regex>
#include <stdexcept>

namespace tandem {
namespace {

pid_t g_child = -1;

void forward_signal(int sig) {
  if (g_child > 0) kill(g_child, sig);
}

std::string find_mpirun() {
  if (const char* p = std::getenv("TANDEM_MPIRUN")) return p;
  if (*TANDEM_MPIEXEC && access(TANDEM_MPIEXEC, X_OK) == 0) return TANDEM_MPIEXEC;
  return "mpirun";
}

// --net-if, else TANDEM_NET_IF; checked so that it cannot smuggle other mpirun arguments.
std::string network_selection(const LaunchOptions& opts) {
  std::string sel = opts.net_if;
  if (sel.empty() && std::getenv("TANDEM_NET_IF")) sel = std::getenv("TANDEM_NET_IF");
  for (char c : sel) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && !std::strchr("./,:_-", c)) {
      throw std::invalid_argument("network selection '" + sel +
                                  "' is not a comma-separated list of interface names or subnets (e.g. eth1 or "
                                  "10.1.0.0/16); set --net-if or TANDEM_NET_IF accordingly");
    }
  }
  return sel;
}

// Splits a byte stream into lines and hands each to `on_line`.
struct LineBuffer {
  std::string pending;
  template <typename F>
  void feed(const char* data, size_t n, F&& on_line) {
    pending.append(data, n);
    size_t pos;
    while ((pos = pending.find('\n')) != std::string::npos) {
      on_line(pending.substr(0, pos));
      pending.erase(0, pos + 1);
    }
  }
  template <typename F>
  void flush(F&& on_line) {
    if (!pending.empty()) on_line(pending);
    pending.clear();
  }
};

}  // namespace

std::string self_executable() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot read /proc/self/exe to re-launch this program");
  buf[n] = '\0';
  return buf;
}

std::vector<std::string> mpirun_command(const LaunchOptions& opts, const std::vector<std::string>& argv) {
  std::vector<std::string> cmd = {find_mpirun(), "-n", std::to_string(opts.nprocs)};
  if (geteuid() == 0) cmd.push_back("--allow-run-as-root");
  // Workers may outnumber cores on a development machine; never pin them to cores, and let
  // idle ranks yield the CPU instead of spinning.
  for (const char* a : {"--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1", "--mca",
                        "btl_vader_single_copy_mechanism", "none"}) {
    cmd.push_back(a);
  }
  if (opts.hostfile.empty()) {
    for (const char* a : {"--mca", "btl", "self,vader"}) cmd.push_back(a);
  } else {
    for (const char* a : {"--hostfile"}) cmd.push_back(a);
    cmd.push_back(opts.hostfile);
    for (const char* a : {"--mca", "btl", "self,vader,tcp"}) cmd.push_back(a);
  }
  if (std::string sel = network_selection(opts); !sel.empty()) {
    for (const char* p : {"btl_tcp_if_include", "oob_tcp_if_include"}) {
      cmd.push_back("--mca");
      cmd.push_back(p);
      cmd.push_back(sel);
    }
    cmd.push_back("-x");
    cmd.push_back("TANDEM_NET_IF=" + sel);  // the workers advertise these addresses for reachability checks
  }
  if (opts.prefix_output) cmd.push_back("--tag-output");
  for (const auto& e : opts.env) {
    cmd.push_back("-x");
    cmd.push_back(e);
  }
  for (const auto& a : opts.mpi_args) cmd.push_back(a);
  cmd.insert(cmd.end(), argv.begin(), argv.end());
  return cmd;
}

int launch(const LaunchOptions& opts, const std::vector<std::string>& argv) {
  if (opts.nprocs < 1) throw std::invalid_argument("-n must be at least 1 (got " + std::to_string(opts.nprocs) + ")");
  if (argv.empty()) throw std::invalid_argument("no program to launch; usage: tandem launch -n N -- PROGRAM ARGS...");
  if (!opts.hostfile.empty() && access(opts.hostfile.c_str(), R_OK) != 0) {
    throw std::invalid_argument("hostfile '" + opts.hostfile + "' cannot be read: " + std::strerror(errno));
  }
  auto cmd = mpirun_command(opts, argv);

  int out_pipe[2], err_pipe[2];
  if (pipe(out_pipe) != 0 || pipe(err_pipe) != 0) throw std::runtime_error("pipe() failed");
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork() failed");
  if (pid == 0) {
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    close(out_pipe[0]);
    close(err_pipe[0]);
    close(out_pipe[1]);
    close(err_pipe[1]);
    setenv("OMPI_MCA_mpi_yield_when_idle", "1", 1);
    // Messages up to 256 KiB between ranks of one host go eagerly (copied into the receiver's
    // shared-memory queue when posted) instead of by rendezvous, which needs the sender's
    // progress thread again after the receiver answers: on shared cores that thread waits for
    // the compute thread's time slice. A pipeline's activations and gradients are such
    // messages; the MLP's 2-stage pipeline step went from 28.7 to 23.4 ms, medians of 4 runs
    // (docs/BENCHMARKS.md).
    // The user's own setting (environment or --mpi-arg) wins.
    setenv("OMPI_MCA_btl_vader_eager_limit", std::to_string(kLocalEagerLimitBytes).c_str(), 0);
    std::vector<char*> args;
    for (auto& s : cmd) args.push_back(const_cast<char*>(s.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    std::fprintf(stderr, "tandem launch: cannot run '%s': %s; install OpenMPI (apt-get install openmpi-bin)\n", args[0],
                 std::strerror(errno));
    _exit(127);
  }
  g_child = pid;
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  close(out_pipe[1]);
  close(err_pipe[1]);

  static const std::regex tag(R"(^\[\d+,(\d+)\]<(stdout|stderr)>:(.*)$)");
  static const std::regex exit_rank(R"(Process name:\s*\[\[\d+,\d+\],(\d+)\])");
  static const std::regex exit_code(R"(Exit code:\s*(-?\d+))");
  static const std::regex signal_rank(R"(process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)(.*))");
  static const std::regex abort_rank(R"(MPI_ABORT was invoked on rank (\d+) in communicator \S+)");
  static const std::regex abort_code(R"(with errorcode (-?\d+))");

  std::vector<std::string> mpirun_lines;  // mpirun's own messages
  int failed_rank = -1, failed_code = 0, failed_signal = 0;
  bool aborted = false;  // MPI_Abort: the rank ended the job after an error of its own or a peer's
  std::string signal_name;
  bool in_box = false;
  auto handle = [&](const std::string& line, bool is_err) {
    std::smatch m;
    if (opts.prefix_output && std::regex_match(line, m, tag)) {
      std::ostream& os = m[2] == "stderr" ? std::cerr : std::cout;
      os << "[rank " << m[1] << "] " << m[3] << '\n';
      os.flush();
      return;
    }
    bool is_mpirun_report = false;
    if (std::regex_search(line, m, exit_rank)) {
      if (failed_rank < 0) failed_rank = std::stoi(m[1]);
      is_mpirun_report = true;
    } else if (std::regex_search(line, m, exit_code)) {
      failed_code = std::stoi(m[1]);
      is_mpirun_report = true;
    } else if (std::regex_search(line, m, signal_rank)) {
      if (failed_rank < 0) {
        failed_rank = std::stoi(m[1]);
        failed_signal = std::stoi(m[2]);
        signal_name = m[3];
        while (!signal_name.empty() && (signal_name.back() == '.' || signal_name.back() == ' ')) signal_name.pop_back();
      }
      is_mpirun_report = true;
    } else if (std::regex_search(line, m, abort_rank)) {
      if (failed_rank < 0) {
        failed_rank = std::stoi(m[1]);
        aborted = true;
      }
      is_mpirun_report = true;
    } else if (std::regex_search(line, m, abort_code)) {
      if (failed_code == 0) failed_code = std::stoi(m[1]);
      is_mpirun_report = true;
    }
    // mpirun's boxed help texts and "[host:pid] ..." notes are kept for the summary, not shown.
    static const std::regex orte_note(R"(^\[[^\]\s]+:\d+\] )");
    bool rule = line.rfind("-----", 0) == 0;
    if (rule) in_box = !in_box;
    if (opts.prefix_output || is_mpirun_report || rule || in_box || std::regex_search(line, orte_note) ||
        line.find("mpirun") != std::string::npos || line.find("mpiexec") != std::string::npos ||
        line.find("Primary job") != std::string::npos) {
      mpirun_lines.push_back(line);
      return;
    }
    (is_err ? std::cerr : std::cout) << line << '\n';
    (is_err ? std::cerr : std::cout).flush();
  };

  LineBuffer out_buf, err_buf;
  struct pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  char buf[65536];
  // mpirun normally stops the other workers at once after a failure; when a host became
  // unreachable it can wait forever for that host's daemon, so it gets stop_grace_s, then
  // SIGTERM, then (5 s later) SIGKILL. Once mpirun has exited, orphans on other hosts may still
  // hold the output pipes: they get 3 s.
  using Clock = std::chrono::steady_clock;
  const auto grace = std::chrono::duration<double>(opts.stop_grace_s);
  Clock::time_point failed_at, killed_at, reaped_at;
  int status = 0, kill_stage = 0;
  bool failure_seen = false, reaped = false;
  while (open_fds > 0) {
    const auto now = Clock::now();
    if (!failure_seen && failed_rank >= 0) {
      failure_seen = true;
      failed_at = now;
    }
    if (!reaped && waitpid(pid, &status, WNOHANG) == pid) {
      reaped = true;
      reaped_at = now;
    }
    if (reaped) {
      if (now - reaped_at > std::chrono::seconds(3)) break;
    } else if (failure_seen && kill_stage == 0 && now - failed_at > grace) {
      kill(pid, SIGTERM);
      kill_stage = 1;
      killed_at = now;
    } else if (kill_stage == 1 && now - killed_at > std::chrono::seconds(5)) {
      kill(pid, SIGKILL);
      kill_stage = 2;
    }
    int rc = poll(fds, 2, 250);
    if (rc < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n <= 0) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
        continue;
      }
      // Progress lines ("\r...") from an untagged rank 0 go straight through.
      if (!opts.prefix_output && i == 0 && std::memchr(buf, '\r', static_cast<size_t>(n))) {
        auto& lb = out_buf;
        lb.pending.append(buf, static_cast<size_t>(n));
        size_t cut = lb.pending.rfind('\r');
        size_t nl = lb.pending.rfind('\n');
        size_t upto = (nl != std::string::npos && nl > cut) ? nl + 1 : cut + 1;
        std::string chunk = lb.pending.substr(0, upto);
        lb.pending.erase(0, upto);
        std::cout << chunk;
        std::cout.flush();
        continue;
      }
      (i == 0 ? out_buf : err_buf).feed(buf, static_cast<size_t>(n), [&](const std::string& l) { handle(l, i == 1); });
    }
  }
  out_buf.flush([&](const std::string& l) { handle(l, false); });
  err_buf.flush([&](const std::string& l) { handle(l, true); });

  for (int i = 0; i < 2; ++i) {
    if (fds[i].fd >= 0) close(fds[i].fd);
  }
  while (!reaped && waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  g_child = -1;
  int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (rc == 0) return 0;

  std::string reason;
  if (failed_rank >= 0) {
    reason = "rank " + std::to_string(failed_rank);
    if (failed_signal) {
      reason += " was killed by signal " + std::to_string(failed_signal) + signal_name;
      rc = 128 + failed_signal;
    } else {
      reason += (aborted ? " aborted the job with code " : " exited with code ") + std::to_string(failed_code);
      if (failed_code > 0 && failed_code < 256) rc = failed_code;
    }
    if (kill_stage > 0) {
      reason += "; mpirun had not stopped the other ranks " + std::to_string(static_cast<int>(opts.stop_grace_s)) +
                " s later (a host may be unreachable) and was terminated: processes on unreachable hosts may still run";
    } else {
      reason += "; the other ranks were stopped";
    }
  } else {
    for (const auto& l : mpirun_lines) std::cerr << l << '\n';
    reason = "mpirun exited with code " + std::to_string(rc);
    // A worker killed very early can be reported only as "returned a non-zero exit code".
    if (rc > 128 && rc < 160) {
      reason += " (a worker was killed by signal " + std::to_string(rc - 128) + "; mpirun did not say which rank)";
    }
  }
  std::cerr << "tandem launch: " << reason << '\n';
  return rc == 0 ? 1 : rc;
}

}  // namespace tandem
