// The collective-mismatch guard (TANDEM_CHECK_COLLECTIVES=1): ranks that disagree on the
// operation or the shape of a collective get a CommError naming every rank's call, instead of
// a hang or a silently wrong result; matching collectives pass, and the communicator stays
// usable after a detected mismatch (the mismatched operation was never issued).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "tests/dist/dist_env.h"

namespace tandem::test {
namespace {

CommPtr checked_comm() {
  setenv("TANDEM_CHECK_COLLECTIVES", "1", 1);
  auto c = world()->split(0, world()->rank());
  unsetenv("TANDEM_CHECK_COLLECTIVES");
  return c;
}

void expect_mismatch(const std::function<void()>& call, const std::vector<std::string>& words) {
  try {
    call();
    ADD_FAILURE() << "a mismatched collective went through";
  } catch (const CommError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("collective mismatch"), std::string::npos) << m;
    for (auto& w : words) EXPECT_NE(m.find(w), std::string::npos) << "missing '" << w << "' in: " << m;
  }
}

TEST(CollectiveCheck, MismatchesNameTheRanksAndTheirCalls) {
  auto c = checked_comm();
  const int R = c->size(), me = c->rank(), last = R - 1;
  auto t = torch::ones({10});
  c->allreduce(t);
  EXPECT_TRUE(torch::equal(t, torch::full({10}, static_cast<float>(R)))) << "matching collectives pass";

  // Another operation on the last rank.
  auto u = torch::ones({10});
  expect_mismatch([&] { me == last ? c->broadcast(u, 0) : c->allreduce(u); },
                  {"rank " + std::to_string(me == last ? 0 : last) + " calls", "broadcast(root 0)", "allreduce(sum)"});
  // The same operation with another shape.
  auto v = torch::ones({me == last ? 7 : 10});
  expect_mismatch([&] { c->allreduce(v); }, {"x 7", "x 10"});

  // Nothing was issued: the communicator still works, in step on every rank.
  auto w = torch::ones({3});
  c->allreduce(w);
  EXPECT_TRUE(torch::equal(w, torch::full({3}, static_cast<float>(R))));
  c->barrier();
}

// alltoall: the ranks' row counts differ by design and pass; rows of another shape do not.
TEST(CollectiveCheck, AlltoallComparesTheRowsNotTheirCount) {
  auto c = checked_comm();
  const int R = c->size(), me = c->rank(), last = R - 1;
  std::vector<int64_t> sends(R, me), recvs;  // rank s sends s rows to every rank
  for (int s = 0; s < R; ++s) recvs.push_back(s);
  auto in = torch::full({R * me, 3}, static_cast<float>(me));
  auto out = torch::empty({R * (R - 1) / 2, 3});
  c->alltoall(out, in, recvs, sends);
  std::vector<float> want;
  for (int s = 0; s < R; ++s)
    for (int k = 0; k < s * 3; ++k) want.push_back(static_cast<float>(s));
  EXPECT_TRUE(torch::equal(out.reshape({-1}), torch::tensor(want))) << "different row counts pass";

  const int64_t cols = me == last ? 4 : 3;
  auto in2 = torch::zeros({R, cols}), out2 = torch::zeros({R, cols});
  std::vector<int64_t> ones(R, 1);
  expect_mismatch([&] { c->alltoall(out2, in2, ones, ones); },
                  {"alltoall of Float rows of 4 elements", "of 3 elements"});
  c->barrier();
}

}  // namespace
}  // namespace tandem::test
