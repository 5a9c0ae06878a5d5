// Internal: rank 0's progress display. On a terminal (or when the launcher says its own output
// is one, TANDEM_PROGRESS_TTY=1) a bar redrawn in place; otherwise a plain line every N steps.
#pragma once

#include <chrono>
#include <cstdint>

namespace tandem {

class Progress {
 public:
  Progress(bool enabled, int64_t total_steps, int64_t log_every);
  void update(int epoch, int epochs, int64_t step, double loss, int64_t samples,
              std::chrono::steady_clock::duration elapsed);
  void finish();

 private:
  bool enabled_, tty_;
  int64_t total_, every_;
  std::chrono::steady_clock::time_point last_draw_{};
  bool drawn_ = false;
};

}  // namespace tandem
