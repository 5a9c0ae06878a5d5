#include "tandem/progress.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace tandem {

Progress::Progress(bool enabled, int64_t total_steps, int64_t log_every)
    : enabled_(enabled), total_(total_steps), every_(log_every > 0 ? log_every : 50) {
  const char* env = std::getenv("TANDEM_PROGRESS_TTY");
  tty_ = env ? std::strcmp(env, "1") == 0 : isatty(1) != 0;
}

void Progress::update(int epoch, int epochs, int64_t step, double loss, int64_t samples,
                      std::chrono::steady_clock::duration elapsed, const std::string& note) {
  if (!enabled_) return;
  double secs = std::chrono::duration<double>(elapsed).count();
  double sps = secs > 0 ? samples / secs : 0.0;
  double eta = step > 0 ? secs / step * (total_ - step) : 0.0;
  int em = static_cast<int>(eta) / 60, es = static_cast<int>(eta) % 60;
  const std::string after = note.empty() ? "" : " " + note;
  if (tty_) {
    auto now = std::chrono::steady_clock::now();
    if (drawn_ && step != total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    drawn_ = true;
    const int width = 30;
    int filled = total_ > 0 ? static_cast<int>(width * step / total_) : width;
    std::string bar(filled, '=');
    if (filled < width) bar += '>' + std::string(width - filled - 1, ' ');
    std::printf("\repoch %d/%d [%s] %lld/%lld loss %.4f%s %.0f samples/s ETA %02d:%02d ", epoch, epochs, bar.c_str(),
                static_cast<long long>(step), static_cast<long long>(total_), loss, after.c_str(), sps, em, es);
    std::fflush(stdout);
  } else if (step % every_ == 0 || step == total_ || step == 1) {
    std::printf("epoch %d/%d step %lld/%lld loss %.4f%s %.0f samples/s ETA %02d:%02d\n", epoch, epochs,
                static_cast<long long>(step), static_cast<long long>(total_), loss, after.c_str(), sps, em, es);
    std::fflush(stdout);
  }
}

void Progress::finish() {
  if (enabled_ && tty_ && drawn_) {
    std::printf("\n");
    std::fflush(stdout);
  }
}

}  // namespace tandem
