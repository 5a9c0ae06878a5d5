// Range checks for numeric flags, with messages in plain words: CLI11 puts the flag's name in
// front ("--nprocs: must be between 1 and 4096, got 0"). They run on the text as typed, so a
// non-number gets the same message.
#pragma once

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace tandem::cli {

// Most workers any command launches.
inline constexpr int64_t kMaxWorkers = 4096;

namespace detail {
inline std::string plain(double v) {
  if (std::fabs(v) < 1e15 && v == std::floor(v)) return std::to_string(static_cast<int64_t>(v));
  std::string s = std::to_string(v);
  return s.substr(0, s.find_last_not_of('0') + 1);
}
}  // namespace detail

// A whole number in [lo, hi].
inline CLI::Validator whole_between(int64_t lo, int64_t hi) {
  const std::string range = "between " + std::to_string(lo) + " and " + std::to_string(hi);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long v = std::strtoll(text.c_str(), &end, 10);
        const bool whole = !text.empty() && end && *end == '\0' && errno == 0;
        if (!whole) return "must be a whole number " + range + ", got '" + text + "'";
        if (v < lo || v > hi) return "must be " + range + ", got " + text;
        return {};
      },
      std::to_string(lo) + " to " + std::to_string(hi), "whole_between");
}

// A finite number in [lo, hi], or in (lo, hi] when above_lo.
inline CLI::Validator number_between(double lo, double hi, bool above_lo = false) {
  const std::string range = above_lo ? "greater than " + detail::plain(lo) + " and at most " + detail::plain(hi)
                                     : "between " + detail::plain(lo) + " and " + detail::plain(hi);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        const bool number = !text.empty() && end && *end == '\0' && std::isfinite(v);
        if (!number) return "must be a number " + range + ", got '" + text + "'";
        if ((above_lo ? v <= lo : v < lo) || v > hi) return "must be " + range + ", got " + text;
        return {};
      },
      (above_lo ? "above " : "") + detail::plain(lo) + " to " + detail::plain(hi), "number_between");
}

}  // namespace tandem::cli
