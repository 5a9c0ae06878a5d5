// Placements (tandem/placement.h): a piece's runs of the global tensor against a brute-force
// index map, copies between two pieces of one tensor, coverage checks, and invalid placements.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <random>

#include "tandem/placement.h"

namespace tandem {
namespace {

// The global flat index of each held element of `p`, computed from the blocks with tensors.
torch::Tensor held_indices(const Placement& p) {
  auto global = torch::arange(p.global_numel(), torch::kLong).view(p.global_shape);
  auto local = torch::full(p.local_shape, -1, torch::kLong);
  auto blocks = p.blocks;
  if (blocks.empty())
    blocks.push_back({std::vector<int64_t>(p.global_shape.size(), 0), std::vector<int64_t>(p.global_shape.size(), 0),
                      p.global_shape});
  for (const auto& b : blocks) {
    auto dst = local, src = global;
    for (size_t d = 0; d < b.shape.size(); ++d) {
      dst = dst.narrow(static_cast<int64_t>(d), b.local_offset[d], b.shape[d]);
      src = src.narrow(static_cast<int64_t>(d), b.global_offset[d], b.shape[d]);
    }
    dst.copy_(src);
  }
  return local.reshape({-1}).narrow(0, p.flat_begin, p.held_numel());
}

// The same indices from placement_runs.
torch::Tensor indices_from_runs(const Placement& p) {
  auto out = torch::full({p.held_numel()}, -1, torch::kLong);
  for (const auto& r : placement_runs(p))
    out.narrow(0, r.held, r.length).copy_(torch::arange(r.global, r.global + r.length));
  return out;
}

// Random placements of a tensor of `global` shape: whole, split along a dimension, split into
// sections, each with a random flat range.
Placement random_placement(std::mt19937& g, const std::vector<int64_t>& global) {
  const int64_t dim = std::uniform_int_distribution<int64_t>(0, static_cast<int64_t>(global.size()) - 1)(g);
  Placement p;
  switch (std::uniform_int_distribution<int>(0, 2)(g)) {
    case 0: p = Placement::whole(global); break;
    case 1: p = Placement::split(global, dim, std::uniform_int_distribution<int64_t>(0, 1)(g), 2); break;
    default: p = Placement::split_sections(global, dim, 2, std::uniform_int_distribution<int64_t>(0, 1)(g), 2);
  }
  const int64_t n = p.local_numel();
  const int64_t a = std::uniform_int_distribution<int64_t>(0, n)(g),
                b = std::uniform_int_distribution<int64_t>(0, n)(g);
  return p.flat_range(std::min(a, b), std::max(a, b));
}

TEST(Placement, RunsMatchTheBlocksElementByElement) {
  std::mt19937 g(3);
  const std::vector<std::vector<int64_t>> shapes{{8}, {4, 12}, {12, 4}, {4, 8, 4}, {8, 4, 12}};
  for (const auto& shape : shapes) {
    for (int k = 0; k < 40; ++k) {
      const auto p = random_placement(g, shape);
      p.check("random");
      ASSERT_TRUE(torch::equal(indices_from_runs(p), held_indices(p)))
          << "shape " << torch::IntArrayRef(shape) << " local " << torch::IntArrayRef(p.local_shape) << " flat "
          << p.flat_begin << ".." << p.held_end();
    }
  }
}

TEST(Placement, RunsMergeWhereContiguous) {
  EXPECT_EQ(placement_runs(Placement::whole({64, 32})).size(), 1u);
  EXPECT_EQ(placement_runs(Placement::split({64, 32}, 0, 1, 4)).size(), 1u);            // a row block
  EXPECT_EQ(placement_runs(Placement::split({64, 32}, 1, 1, 4)).size(), 64u);           // a column block: one per row
  EXPECT_EQ(placement_runs(Placement::split_sections({6, 4}, 0, 3, 1, 2)).size(), 3u);  // q, k, v rows
  const auto r = placement_runs(Placement::whole({10}).flat_range(3, 7));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].global, 3);
  EXPECT_EQ(r[0].held, 0);
  EXPECT_EQ(r[0].length, 4);
}

// Copying along placement_overlap moves exactly the elements both pieces hold.
TEST(Placement, OverlapCopiesTheSharedElements) {
  std::mt19937 g(5);
  const std::vector<int64_t> shape{8, 4, 12};
  for (int k = 0; k < 200; ++k) {
    const auto want = random_placement(g, shape), have = random_placement(g, shape);
    const auto wi = held_indices(want), hi = held_indices(have);
    auto got = torch::full({want.held_numel()}, -1, torch::kLong);
    for (const auto& c : placement_overlap(placement_runs(want), placement_runs(have)))
      got.narrow(0, c.dst, c.length).copy_(hi.narrow(0, c.src, c.length));
    // Expected: want's index where `have` holds it too, else -1.
    auto in_have = torch::zeros({want.global_numel()}, torch::kBool);
    in_have.index_put_({hi}, true);
    auto expect = torch::where(in_have.index({wi}), wi, torch::full_like(wi, -1));
    ASSERT_TRUE(torch::equal(got, expect)) << k;
  }
}

TEST(Placement, CoverageNamesTheHoleOrTheOverlap) {
  const std::vector<int64_t> shape{4, 6};
  auto a = placement_runs(Placement::split(shape, 1, 0, 2)), b = placement_runs(Placement::split(shape, 1, 1, 2));
  EXPECT_EQ(placement_cover_error({a, b}, 24), "");
  EXPECT_NE(placement_cover_error({a}, 24).find("no piece holds element 3"), std::string::npos);
  EXPECT_NE(placement_cover_error({a, b, a}, 24).find("both hold element 0"), std::string::npos);
  auto zero = Placement::whole(shape);
  EXPECT_EQ(placement_cover_error({placement_runs(zero.flat_range(0, 10)), placement_runs(zero.flat_range(10, 24))},
                                  24),
            "");
  EXPECT_NE(placement_cover_error({placement_runs(zero)}, 12).find("past the tensor's end"), std::string::npos);
}

TEST(Placement, InvalidPlacementsAreRefused) {
  EXPECT_THROW(Placement::split({5, 4}, 0, 0, 2), std::invalid_argument);  // 2 does not divide 5
  EXPECT_THROW(Placement::split({4, 4}, 2, 0, 2), std::invalid_argument);  // no dimension 2
  auto p = Placement::split({4, 4}, 0, 0, 2);
  p.blocks[0].global_offset[0] = 3;  // outside the global tensor
  EXPECT_THROW(p.check("p"), std::invalid_argument);
  p = Placement::split({4, 4}, 0, 0, 2);
  p.blocks.clear();  // a local shape other than the global one needs a block
  EXPECT_THROW(p.check("p"), std::invalid_argument);
  p = Placement::split_sections({4, 4}, 0, 2, 0, 2);
  p.blocks[1].local_offset[0] = 0;  // two blocks over the same local rows
  EXPECT_THROW(p.check("p"), std::invalid_argument);
  EXPECT_THROW(Placement::whole({4}).flat_range(2, 5), std::out_of_range);
  try {
    Placement::whole({4, 4}).flat_range(0, 17);
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("16 held elements"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tandem
