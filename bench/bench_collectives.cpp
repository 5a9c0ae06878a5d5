// Bus bandwidth of Tandem's collectives (MPI backend) against the same operations called on
// MPI directly (blocking, and MPI_Iallreduce + MPI_Wait: the call Tandem's progress thread
// makes) and this machine's memcpy bandwidth, for float32 messages from 4 KiB to 64 MiB.
//
//   scripts/mpirun-local.sh -n 2 build/bench_collectives [--min-bytes B] [--max-bytes B] [--iters N]
//
// Bus bandwidth as in nccl-tests, with `bytes` the full buffer (the allreduce tensor, the
// reduce_scatter input, the allgather output) and t the median time of one operation:
//   allreduce: 2(n-1)/n * bytes / t;  reduce_scatter, allgather: (n-1)/n * bytes / t.
// Each timed operation starts right after an MPI_Barrier; its time is the slowest rank's
// (from the call to the end of wait()). memcpy: one rank copies a 64 MiB buffer while the
// others wait; bandwidth = bytes read + written / time, median of 20.
#include <mpi.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tandem/runtime.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// Median over iterations of the slowest rank's time for one call of `op`.
double time_op(const std::function<void()>& op, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) op();
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = Clock::now();
    op();
    double t = std::chrono::duration<double>(Clock::now() - t0).count();
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    times.push_back(t);
  }
  return median(times);
}

double memcpy_gbps(size_t bytes, int iters) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  std::memcpy(b.data(), a.data(), bytes);  // fault the pages in
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    a[i % bytes] = static_cast<char>(i);
    auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    if (b[i % bytes] != static_cast<char>(i)) std::abort();  // keep the copy observable
  }
  return 2.0 * bytes / median(times) / 1e9;
}

// The first three fields of /proc/loadavg: other work on the machine skews every figure.
std::string loadavg() {
  char buf[128] = {0};
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (!std::fgets(buf, sizeof buf, f)) buf[0] = 0;
    std::fclose(f);
  }
  std::string s(buf);
  size_t cut = 0;
  for (int spaces = 0; cut < s.size() && spaces < 3; ++cut) spaces += s[cut] == ' ';
  return s.substr(0, cut ? cut - 1 : 0);
}

std::string human(int64_t bytes) {
  char buf[32];
  if (bytes >= (1 << 20)) std::snprintf(buf, sizeof buf, "%lld MiB", static_cast<long long>(bytes >> 20));
  else std::snprintf(buf, sizeof buf, "%lld KiB", static_cast<long long>(bytes >> 10));
  return buf;
}

std::string cell(double t, double factor, int64_t bytes) {
  char buf[64];
  double us = t * 1e6;
  if (factor <= 0) std::snprintf(buf, sizeof buf, "%9.0f us      n/a", us);
  else std::snprintf(buf, sizeof buf, "%9.0f us %6.2f GB/s", us, factor * bytes / t / 1e9);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t min_bytes = 4 << 10, max_bytes = 64 << 20;
  int iters_override = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> int64_t {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_collectives: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atoll(argv[++i]);
    };
    if (a == "--min-bytes") min_bytes = next();
    else if (a == "--max-bytes") max_bytes = next();
    else if (a == "--iters") iters_override = static_cast<int>(next());
    else {
      std::fprintf(stderr, "usage: bench_collectives [--min-bytes B] [--max-bytes B] [--iters N]\n");
      return 2;
    }
  }

  tandem::RuntimeOptions ro;
  ro.device = "cpu";
  ro.backend = "mpi";
  tandem::Runtime rt(ro);
  auto comm = rt.world();
  const int R = comm->size(), me = comm->rank();
  const double ar_factor = 2.0 * (R - 1) / R, rs_factor = 1.0 * (R - 1) / R;

  // Sanity: the operations being timed compute the right thing.
  {
    auto t = at::ones({1 << 20}, at::kFloat);
    comm->allreduce(t, tandem::ReduceOp::kSum);
    if (!t.eq(static_cast<float>(R)).all().item<bool>()) {
      std::fprintf(stderr, "rank %d: allreduce gave a wrong result; not benchmarking\n", me);
      rt.abort(1);
    }
  }

  // memcpy ceiling: rank 0 copies while the others wait.
  double memcpy_bw = 0;
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 0) memcpy_bw = memcpy_gbps(size_t{64} << 20, 20);
  MPI_Barrier(MPI_COMM_WORLD);

  struct Column {
    const char* name;
    double factor;
  };
  const std::vector<Column> columns = {
      {"allreduce", ar_factor},      {"MPI_Allreduce", ar_factor},      {"MPI_Iallreduce", ar_factor},
      {"reduce_scatter", rs_factor}, {"MPI_Reduce_scatter", rs_factor}, {"allgather", rs_factor},
      {"MPI_Allgather", rs_factor},
  };
  if (me == 0) {
    const char* poll = std::getenv("TANDEM_MPI_POLL_US");
    std::printf("Collectives, MPI backend: %d ranks, float32, %d compute thread(s) per rank, TANDEM_MPI_POLL_US=%s\n",
                R, rt.threads(), poll ? poll : "(unset)");
    std::printf("columns: Tandem's Communicator (allreduce, reduce_scatter, allgather: blocking forms, i.e. the\n"
                "progress thread runs the non-blocking MPI call) and direct MPI calls on MPI_COMM_WORLD from the\n"
                "main thread (MPI_Iallreduce: followed at once by MPI_Wait; MPI_Reduce_scatter: _block)\n");
    std::printf("time: median over iterations of the slowest rank; busbw as nccl-tests; GB/s = 1e9 bytes/s\n");
    std::printf("memcpy ceiling (one rank, 64 MiB, read+write): %.2f GB/s; load average at start: %s\n\n", memcpy_bw,
                loadavg().c_str());
    std::printf("%8s %5s", "size", "iters");
    for (auto& c : columns) std::printf(" | %-24s", c.name);
    std::printf("\n");
    std::fflush(stdout);
  }

  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const int64_t n = bytes / 4;
    const int64_t chunk = std::max<int64_t>(1, n / R);
    const int iters = iters_override > 0 ? iters_override
                                         : static_cast<int>(std::clamp<int64_t>((int64_t{512} << 20) / bytes, 10, 100));
    const int warmup = 3;
    auto buf = at::zeros({n}, at::kFloat);  // zeros: repeated sums stay finite
    auto rs_in = at::ones({chunk * R}, at::kFloat);
    auto rs_out = at::empty({chunk}, at::kFloat);
    auto ag_in = at::ones({chunk}, at::kFloat);
    auto ag_out = at::empty({chunk * R}, at::kFloat);
    float* p = buf.data_ptr<float>();
    const int cn = static_cast<int>(n), cc = static_cast<int>(chunk);
    std::vector<std::function<void()>> ops = {
        [&] { comm->allreduce(buf, tandem::ReduceOp::kSum); },
        [&] { MPI_Allreduce(MPI_IN_PLACE, p, cn, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); },
        [&] {
          MPI_Request req;
          MPI_Iallreduce(MPI_IN_PLACE, p, cn, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
          MPI_Wait(&req, MPI_STATUS_IGNORE);
        },
        [&] { comm->reduce_scatter(rs_out, rs_in, tandem::ReduceOp::kSum); },
        [&] { MPI_Reduce_scatter_block(rs_in.data_ptr(), rs_out.data_ptr(), cc, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); },
        [&] { comm->allgather(ag_out, ag_in); },
        [&] { MPI_Allgather(ag_in.data_ptr(), cc, MPI_FLOAT, ag_out.data_ptr(), cc, MPI_FLOAT, MPI_COMM_WORLD); },
    };
    std::vector<double> times;
    for (auto& op : ops) times.push_back(time_op(op, warmup, iters));
    if (me == 0) {
      std::printf("%8s %5d", human(bytes).c_str(), iters);
      for (size_t i = 0; i < ops.size(); ++i) {
        int64_t full = i < 3 ? bytes : chunk * R * 4;
        std::printf(" | %s", cell(times[i], columns[i].factor, full).c_str());
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (me == 0) std::printf("load average at end: %s\n", loadavg().c_str());
  return 0;
}
