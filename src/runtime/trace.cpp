// tandem/trace.h: per-process event buffer, gathered and merged on rank 0.
#include "tandem/trace.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace tandem::trace {
namespace detail {
std::atomic<bool> on{false};
}

namespace {

using Clock = std::chrono::steady_clock;

struct Buffer {
  std::mutex mu;
  Clock::time_point epoch = Clock::now();
  std::string events;  // comma-separated JSON objects, pid left for the merge
  std::map<int, std::string> thread_names;
  int next_tid = 0;
  uint64_t generation = 0;
};

Buffer& buffer() {
  static Buffer b;
  return b;
}

// The calling thread's track number in this process.
int thread_track() {
  thread_local int tid = -1;
  if (tid < 0) {
    auto& b = buffer();
    std::lock_guard<std::mutex> lk(b.mu);
    tid = b.next_tid++;
    if (!b.thread_names.count(tid)) b.thread_names[tid] = "thread " + std::to_string(tid);
  }
  return tid;
}

std::string escaped(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out;
}

}  // namespace

void start(Communicator& comm) {
  auto t = at::zeros({1}, at::kLong);
  comm.allreduce(t, ReduceOp::kSum);  // the barrier the ranks' time zero follows
  auto& b = buffer();
  {
    std::lock_guard<std::mutex> lk(b.mu);
    b.events.clear();
    b.epoch = Clock::now();
    ++b.generation;
  }
  name_thread("main");
  detail::on.store(true);
}

void stop() { detail::on.store(false); }

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - buffer().epoch).count();
}

void name_thread(const std::string& name) {
  const int tid = thread_track();
  auto& b = buffer();
  std::lock_guard<std::mutex> lk(b.mu);
  b.thread_names[tid] = name;
}

uint64_t generation() {
  auto& b = buffer();
  std::lock_guard<std::mutex> lk(b.mu);
  return b.generation;
}

int named_track(const std::string& name) {
  auto& b = buffer();
  std::lock_guard<std::mutex> lk(b.mu);
  const int tid = b.next_tid++;
  b.thread_names[tid] = name;
  return tid;
}

void record(const char* name, const char* category, int64_t begin_us, int64_t end_us, const std::string& args_json) {
  if (enabled()) record_on(thread_track(), name, category, begin_us, end_us, args_json);
}

void record_on(int tid, const char* name, const char* category, int64_t begin_us, int64_t end_us,
               const std::string& args_json) {
  if (!enabled()) return;
  char head[160];
  std::snprintf(head, sizeof head, "{\"ph\":\"X\",\"tid\":%d,\"ts\":%lld,\"dur\":%lld,\"cat\":\"", tid,
                static_cast<long long>(begin_us), static_cast<long long>(std::max<int64_t>(0, end_us - begin_us)));
  std::string ev = head;
  ev += category;
  ev += "\",\"name\":\"";
  ev += name;
  ev += "\",\"args\":{" + args_json + "}}";
  auto& b = buffer();
  std::lock_guard<std::mutex> lk(b.mu);
  if (!b.events.empty()) b.events += ',';
  b.events += ev;
}

void check_path(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, std::max<size_t>(slash, 1));
  if (::access(dir.c_str(), W_OK) != 0) {
    throw std::invalid_argument("--trace " + path + ": the directory '" + dir + "' does not exist or is not writable");
  }
}

void write(const std::string& path, Communicator& comm) {
  std::string mine;
  {
    auto& b = buffer();
    std::lock_guard<std::mutex> lk(b.mu);
    mine = b.events;
    for (const auto& [tid, name] : b.thread_names) {
      mine += std::string(mine.empty() ? "" : ",") +
              "{\"ph\":\"M\",\"name\":\"thread_name\",\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":\"" +
              escaped(name) + "\"}}";
    }
  }
  const auto all = allgather_strings(comm, mine);
  if (comm.rank() != 0) return;
  std::ofstream f(path, std::ios::trunc);
  if (!f) throw std::runtime_error("--trace: cannot write '" + path + "'; check that its directory exists");
  f << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string pid = "{\"pid\":" + std::to_string(r) + ",";
    f << (r ? ",\n" : "") << pid << "\"ph\":\"M\",\"name\":\"process_name\",\"args\":{\"name\":\"rank " << r << "\"}}";
    f << ",\n" << pid << "\"ph\":\"M\",\"name\":\"process_sort_index\",\"args\":{\"sort_index\":" << r << "}}";
    // Each event of the rank gets its pid: "{" -> "{"pid":r,".
    const std::string& ev = all[r];
    size_t at = 0;
    while (at < ev.size()) {
      size_t next = ev.find(",{\"ph\"", at);
      const size_t end = next == std::string::npos ? ev.size() : next;
      f << ",\n" << pid << ev.substr(at + 1, end - at - 1);
      at = next == std::string::npos ? ev.size() : next + 1;
    }
  }
  f << "\n]}\n";
  if (!f.flush()) throw std::runtime_error("--trace: writing '" + path + "' failed (disk full?)");
}

}  // namespace tandem::trace
