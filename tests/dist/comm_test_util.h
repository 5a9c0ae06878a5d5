// Helpers of the communication tests: deterministic per-rank inputs (so that every rank can
// compute the reference from all ranks' inputs locally), dtype-aware comparison against a
// float64 reference, and checks on the text of CommError.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/comm.h"

namespace tandem::test {

// Rank `rank`'s input for a test: `n` values drawn from a generator seeded by (rank, salt),
// uniform in [-4, 4) for floating dtypes (drawn in float64, then rounded to `dtype`), integers
// in [-1000, 1000) for integer dtypes.
inline at::Tensor rank_input(int rank, int64_t n, at::ScalarType dtype, int64_t salt) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000003 * salt + 7919 * rank + 17));
  if (at::isIntegralType(dtype, /*includeBool=*/false)) {
    return at::randint(-1000, 1000, {n}, gen, at::TensorOptions().dtype(dtype));
  }
  return (at::rand({n}, gen, at::TensorOptions().dtype(at::kDouble)) * 8 - 4).to(dtype);
}

// [R, n] float64: every rank's input, exactly as that rank holds it (after rounding).
inline at::Tensor all_inputs(int R, int64_t n, at::ScalarType dtype, int64_t salt) {
  std::vector<at::Tensor> v;
  for (int r = 0; r < R; ++r) v.push_back(rank_input(r, n, dtype, salt).to(at::kDouble));
  return at::stack(v);
}

// Machine epsilon of a dtype (0 for integers: results must be exact).
inline double eps_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return 2.220446049250313e-16;
    case at::kFloat: return 1.1920928955078125e-07;
    case at::kHalf: return 9.765625e-04;
    case at::kBFloat16: return 7.8125e-03;
    default: return 0.0;
  }
}

// |got - ref| <= bound elementwise, all compared in float64; names the worst element.
inline ::testing::AssertionResult within(const at::Tensor& got, const at::Tensor& ref, const at::Tensor& bound) {
  auto g = got.reshape({-1}).to(at::kDouble);
  auto r = ref.reshape({-1}).to(at::kDouble);
  auto b = bound.reshape({-1}).to(at::kDouble).expand_as(r);
  if (g.numel() != r.numel()) {
    return ::testing::AssertionFailure() << "got " << g.numel() << " elements, reference has " << r.numel();
  }
  if (g.numel() == 0) return ::testing::AssertionSuccess();
  auto excess = (g - r).abs() - b;
  if (!at::isfinite(g).all().item<bool>()) {
    return ::testing::AssertionFailure() << "result has non-finite values";
  }
  auto worst = excess.argmax().item<int64_t>();
  if (excess[worst].item<double>() > 0) {
    return ::testing::AssertionFailure() << "element " << worst << " of " << g.numel() << " ("
                                         << c10::toString(got.scalar_type()) << "): got " << g[worst].item<double>()
                                         << ", reference " << r[worst].item<double>() << ", allowed error "
                                         << b[worst].item<double>() << ", error "
                                         << (g[worst] - r[worst]).abs().item<double>() << "; "
                                         << (excess > 0).sum().item<int64_t>() << " elements out of tolerance";
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult exactly(const at::Tensor& got, const at::Tensor& ref) {
  return within(got, ref, at::zeros({1}, at::kDouble));
}

// Runs `f`, expects a CommError (or subclass `E`) whose message contains every one of `parts`.
template <typename E = CommError, typename F>
::testing::AssertionResult throws_with(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
  } catch (const E& e) {
    std::string msg = e.what();
    for (const auto& p : parts) {
      if (msg.find(p) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << p << "\"";
      }
    }
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw another exception type: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace tandem::test
