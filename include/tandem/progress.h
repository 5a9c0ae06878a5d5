// A training loop's progress display, printed by one rank (the loops pass enabled = rank 0):
// on a terminal (or when the launcher says its own output is one, TANDEM_PROGRESS_TTY=1) a bar
// with loss, samples/s and ETA redrawn in place at most every 100 ms; otherwise a plain line
// every `log_every` steps. Part of Tandem::apps (the image and text training loops use it).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace tandem {

class Progress {
 public:
  // total_steps: steps of the whole run (for the bar and the ETA); log_every <= 0: every 50.
  Progress(bool enabled, int64_t total_steps, int64_t log_every);
  // After step `step` (1-based, counted over the whole run) of epoch `epoch` of `epochs`:
  // `samples` processed so far in `elapsed`; `note` follows the loss (e.g. its parts).
  void update(int epoch, int epochs, int64_t step, double loss, int64_t samples,
              std::chrono::steady_clock::duration elapsed, const std::string& note = {});
  // Ends the bar's line (a terminal) so that later output starts on its own line.
  void finish();

 private:
  bool enabled_, tty_;
  int64_t total_, every_;
  std::chrono::steady_clock::time_point last_draw_{};
  bool drawn_ = false;
};

}  // namespace tandem
