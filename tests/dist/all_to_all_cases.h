// Known all-to-all cases for the tests of Communicator::alltoall and moe::all_to_all: how many
// rows each rank sends each other rank, and row values that name their sender, receiver, row and
// element, so that a rank writes down what it must receive (or what gradient must come back)
// from the ranks' ids alone, without the code under test.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tandem::test::a2a {

// counts[s][d]: rows rank s sends rank d.
struct Case {
  std::string name;
  std::vector<std::vector<int64_t>> counts;
  std::vector<int64_t> sends(int s) const { return counts[s]; }
  std::vector<int64_t> recvs(int d) const {
    std::vector<int64_t> v;
    for (const auto& row : counts) v.push_back(row[d]);
    return v;
  }
};

inline Case make_case(const std::string& name, int R, const std::function<int64_t(int, int)>& f) {
  Case c{name, {}};
  for (int s = 0; s < R; ++s) {
    c.counts.emplace_back();
    for (int d = 0; d < R; ++d) c.counts.back().push_back(f(s, d));
  }
  return c;
}

// Every pattern on R ranks: uneven counts with zeros here and there; rank 0 sending nothing
// while rank R-1 receives nothing; rank R-1 with no rows at all (it still takes part); nothing
// sent anywhere.
inline std::vector<Case> cases(int R) {
  return {
      make_case("uneven", R, [](int s, int d) { return (2 * s + 3 * d + 1) % 4; }),
      make_case("silent sender, idle receiver", R, [R](int s, int d) { return s == 0 || d == R - 1 ? 0 : s + d + 1; }),
      make_case("a rank without rows", R, [R](int s, int d) { return s == R - 1 || d == R - 1 ? 0 : s + 2 * d + 1; }),
      make_case("nothing at all", R, [](int, int) { return 0; }),
  };
}

// Element e of row k of those rank s sends rank d: the forward's value and the backward's
// weight (both exact in float32).
inline double value(int s, int d, int64_t k, int64_t e) { return 1000.0 * s + 100.0 * d + 10.0 * k + e; }
inline double weight(int s, int d, int64_t k, int64_t e) {
  return 0.5 + 0.25 * s - 0.125 * d + 0.0625 * k + 0.03125 * e;
}

using ValueFn = double (*)(int, int, int64_t, int64_t);

// Rows of the blocks (s, d) for s, d in `pairs` order, each row of `row_shape`.
inline at::Tensor rows_of(const std::vector<std::pair<int, int>>& pairs, const Case& c, at::IntArrayRef row_shape,
                          at::ScalarType dtype, ValueFn f) {
  int64_t per_row = 1;
  for (auto n : row_shape) per_row *= n;
  std::vector<double> v;
  int64_t rows = 0;
  for (auto [s, d] : pairs) {
    for (int64_t k = 0; k < c.counts[s][d]; ++k, ++rows)
      for (int64_t e = 0; e < per_row; ++e) v.push_back(f(s, d, k, e));
  }
  std::vector<int64_t> shape{rows};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  return at::tensor(v, at::kDouble).view(shape).to(dtype);
}

// What rank s sends: its blocks to ranks 0, 1, ... in order.
inline at::Tensor sent_by(int s, const Case& c, at::IntArrayRef row_shape, at::ScalarType dtype, ValueFn f = value) {
  std::vector<std::pair<int, int>> pairs;
  for (int d = 0; d < static_cast<int>(c.counts.size()); ++d) pairs.emplace_back(s, d);
  return rows_of(pairs, c, row_shape, dtype, f);
}

// What rank d receives: the blocks from ranks 0, 1, ... in order.
inline at::Tensor received_by(int d, const Case& c, at::IntArrayRef row_shape, at::ScalarType dtype,
                              ValueFn f = value) {
  std::vector<std::pair<int, int>> pairs;
  for (int s = 0; s < static_cast<int>(c.counts.size()); ++s) pairs.emplace_back(s, d);
  return rows_of(pairs, c, row_shape, dtype, f);
}

// Rows rank r sends to and receives from the other ranks.
inline int64_t rows_sent_to_others(int r, const Case& c) {
  int64_t n = 0;
  for (int d = 0; d < static_cast<int>(c.counts.size()); ++d) n += d == r ? 0 : c.counts[r][d];
  return n;
}
inline int64_t rows_received_from_others(int r, const Case& c) {
  int64_t n = 0;
  for (int s = 0; s < static_cast<int>(c.counts.size()); ++s) n += s == r ? 0 : c.counts[s][r];
  return n;
}

}  // namespace tandem::test::a2a
