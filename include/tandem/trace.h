// A timeline of what each rank did and when, as Chrome trace events (the JSON that Perfetto and
// chrome://tracing open): forward, backward, the optimizer step, every collective and
// point-to-point transfer with its size, waits on them, checkpoint writes and data loading.
// Off by default; while off, a span costs one relaxed atomic load. While on, each event is a
// few dozen bytes appended under a mutex.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "tandem/comm.h"

namespace tandem::trace {

namespace detail {
extern std::atomic<bool> on;
}

inline bool enabled() { return detail::on.load(std::memory_order_relaxed); }

// Collective over `comm`: clears the events and starts recording, with time zero taken right
// after a barrier so that the ranks' tracks line up (to the barrier's skew across hosts).
void start(Communicator& comm);
// Stops recording (the events stay until the next start()).
void stop();

// Microseconds since start() on this rank.
int64_t now_us();

// Names the calling thread's track ("main" for the thread that called start(), "thread N" for
// others until named).
void name_thread(const std::string& name);

// The number of start() calls so far: a recorder that maps another clock onto the trace's (a
// CUDA stream's events) takes a new reference point whenever it changes.
uint64_t generation();

// A track of its own, not a thread's (e.g. a device stream's), named `name`.
int named_track(const std::string& name);

// One complete event on `track` (a named_track()); ignored while off.
void record_on(int track, const char* name, const char* category, int64_t begin_us, int64_t end_us,
               const std::string& args_json = "");

// One complete event [begin_us, end_us) on the calling thread's track. `args_json`: "" or the
// members of a JSON object without braces, e.g. "\"bytes\":4096". Ignored while off.
void record(const char* name, const char* category, int64_t begin_us, int64_t end_us,
            const std::string& args_json = "");

// Records [construction, destruction) as one event.
class Span {
 public:
  Span(const char* name, const char* category) : name_(name), category_(category) {
    if (enabled()) begin_ = now_us();
  }
  ~Span() {
    if (begin_ >= 0) record(name_, category_, begin_, now_us(), args_);
  }
  // Adds "key":value (a number) to the event's arguments.
  void arg(const char* key, int64_t value) {
    if (begin_ >= 0) args_ += std::string(args_.empty() ? "" : ",") + "\"" + key + "\":" + std::to_string(value);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  const char* category_;
  int64_t begin_ = -1;
  std::string args_;
};

// Throws std::invalid_argument("--trace PATH: ...") when PATH's directory does not exist or is
// not writable: a check before training, rather than a failure after it.
void check_path(const std::string& path);

// Collective over `comm` (a CPU communicator): every rank's events go to rank 0, which writes
// `path` as {"traceEvents": [...]} with one process per rank ("rank N") and one track per
// thread. Throws std::runtime_error on rank 0 when the file cannot be written.
void write(const std::string& path, Communicator& comm);

}  // namespace tandem::trace
