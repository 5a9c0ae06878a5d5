// Placements (tandem/placement.h): a piece's held elements as runs of the flattened global
// tensor, and the intersections and coverage checks built on them. LibTorch-free.
#include "tandem/placement.h"

#include <algorithm>
#include <stdexcept>
#include <tuple>

namespace tandem {
namespace {

int64_t product(const std::vector<int64_t>& v, size_t from = 0, size_t to = SIZE_MAX) {
  int64_t n = 1;
  for (size_t i = from; i < std::min(to, v.size()); ++i) n *= v[i];
  return n;
}

std::vector<int64_t> strides_of(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) s[i - 1] = s[i] * shape[i];
  return s;
}

std::string shape_str(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The blocks of `p`, with the implicit whole-tensor block made explicit.
std::vector<PlacementBlock> blocks_of(const Placement& p) {
  if (!p.blocks.empty()) return p.blocks;
  std::vector<int64_t> zero(p.global_shape.size(), 0);
  return {PlacementBlock{zero, zero, p.global_shape}};
}

// Appends the runs of one block, in local order: one per "row", where a row spans the trailing
// dimensions that the block covers whole in both tensors.
void block_runs(const Placement& p, const PlacementBlock& b, std::vector<PlacementRun>& out) {
  const auto& L = p.local_shape;
  const auto& G = p.global_shape;
  const size_t d = b.shape.size();
  if (d == 0) {  // a scalar
    out.push_back({0, 0, 1});
    return;
  }
  size_t k = d - 1;  // rows span dimensions [k, d)
  while (k > 0 && b.shape[k] == L[k] && b.shape[k] == G[k]) --k;
  const int64_t row = product(b.shape, k);
  if (row == 0) return;
  const auto ls = strides_of(L), gs = strides_of(G);
  std::vector<int64_t> idx(k, 0);
  const int64_t rows = product(b.shape, 0, k);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t lf = b.local_offset[k] * ls[k], gf = b.global_offset[k] * gs[k];
    for (size_t i = 0; i < k; ++i) {
      lf += (b.local_offset[i] + idx[i]) * ls[i];
      gf += (b.global_offset[i] + idx[i]) * gs[i];
    }
    out.push_back({gf, lf, row});  // `held` is the local flat position until clipped
    for (size_t i = k; i-- > 0;) {
      if (++idx[i] < b.shape[i]) break;
      idx[i] = 0;
    }
  }
}

void need(bool ok, const std::string& what, const std::string& problem) {
  if (!ok) throw std::invalid_argument(what + ": " + problem);
}

}  // namespace

Placement Placement::whole(std::vector<int64_t> shape) {
  Placement p;
  p.global_shape = shape;
  p.local_shape = std::move(shape);
  return p;
}

Placement Placement::split(std::vector<int64_t> global, int64_t dim, int64_t index, int64_t parts) {
  return split_sections(std::move(global), dim, 1, index, parts);
}

Placement Placement::split_sections(std::vector<int64_t> global, int64_t dim, int64_t sections, int64_t index,
                                    int64_t parts) {
  const std::string what = "placement of a tensor of shape " + shape_str(global);
  need(dim >= 0 && dim < static_cast<int64_t>(global.size()), what, "no dimension " + std::to_string(dim));
  need(sections >= 1 && parts >= 1 && index >= 0 && index < parts, what,
       "block " + std::to_string(index) + " of " + std::to_string(parts));
  const int64_t n = global[dim];
  need(n % (sections * parts) == 0, what,
       "dimension " + std::to_string(dim) + " (" + std::to_string(n) + ") does not split into " +
           std::to_string(sections) + " x " + std::to_string(parts) + " equal blocks");
  const int64_t section = n / sections, block = section / parts;
  Placement p;
  p.global_shape = global;
  p.local_shape = global;
  p.local_shape[dim] = sections * block;
  for (int64_t s = 0; s < sections; ++s) {
    PlacementBlock b{std::vector<int64_t>(global.size(), 0), std::vector<int64_t>(global.size(), 0), p.local_shape};
    b.shape[dim] = block;
    b.local_offset[dim] = s * block;
    b.global_offset[dim] = s * section + index * block;
    p.blocks.push_back(std::move(b));
  }
  if (parts == 1 && sections == 1) p.blocks.clear();
  return p;
}

int64_t Placement::local_numel() const { return product(local_shape); }
int64_t Placement::global_numel() const { return product(global_shape); }
int64_t Placement::held_end() const { return flat_end < 0 ? local_numel() : flat_end; }

Placement Placement::flat_range(int64_t begin, int64_t end) const {
  if (begin < 0 || end < begin || end > held_numel()) {
    throw std::out_of_range("Placement::flat_range: [" + std::to_string(begin) + ", " + std::to_string(end) +
                            ") is outside the " + std::to_string(held_numel()) + " held elements");
  }
  Placement p = *this;
  p.flat_begin = flat_begin + begin;
  p.flat_end = flat_begin + end;
  return p;
}

void Placement::check(const std::string& what) const {
  const size_t d = global_shape.size();
  need(local_shape.size() == d, what,
       "the local shape " + shape_str(local_shape) + " and the global " + shape_str(global_shape) +
           " differ in dimensions");
  for (size_t i = 0; i < d; ++i) need(global_shape[i] >= 0 && local_shape[i] >= 0, what, "a negative size");
  need(!blocks.empty() || local_shape == global_shape, what,
       "the local shape " + shape_str(local_shape) + " is not the global " + shape_str(global_shape) +
           " and no block says where it lies");
  int64_t covered = 0;
  for (const auto& b : blocks) {
    need(b.shape.size() == d && b.local_offset.size() == d && b.global_offset.size() == d, what,
         "a block of another number of dimensions");
    for (size_t i = 0; i < d; ++i) {
      need(b.shape[i] >= 0 && b.local_offset[i] >= 0 && b.global_offset[i] >= 0 &&
               b.local_offset[i] + b.shape[i] <= local_shape[i] && b.global_offset[i] + b.shape[i] <= global_shape[i],
           what, "a block of shape " + shape_str(b.shape) + " lies outside the local or the global tensor");
    }
    covered += product(b.shape);
  }
  if (!blocks.empty()) {  // blocks inside the local tensor whose sizes add up tile it unless two overlap
    need(covered == local_numel(), what,
         "the blocks hold " + std::to_string(covered) + " elements, the local tensor " + std::to_string(local_numel()));
    std::vector<std::pair<int64_t, int64_t>> local;  // local runs
    for (const auto& b : blocks) {
      std::vector<PlacementRun> r;
      block_runs(*this, b, r);
      for (auto& x : r) local.emplace_back(x.held, x.length);
    }
    std::sort(local.begin(), local.end());
    for (size_t i = 1; i < local.size(); ++i)
      need(local[i - 1].first + local[i - 1].second <= local[i].first, what, "two blocks overlap");
  }
  need(flat_begin >= 0 && held_end() >= flat_begin && held_end() <= local_numel(), what,
       "the held range [" + std::to_string(flat_begin) + ", " + std::to_string(held_end()) + ") is outside the " +
           std::to_string(local_numel()) + " local elements");
  need(replica >= 0, what, "a negative replica id");
}

bool operator==(const PlacementBlock& a, const PlacementBlock& b) {
  return a.local_offset == b.local_offset && a.global_offset == b.global_offset && a.shape == b.shape;
}

bool operator==(const Placement& a, const Placement& b) {
  return a.global_shape == b.global_shape && a.local_shape == b.local_shape && a.blocks == b.blocks &&
         a.flat_begin == b.flat_begin && a.held_end() == b.held_end() && a.replica == b.replica;
}

std::vector<PlacementRun> placement_runs(const Placement& p) {
  std::vector<PlacementRun> rows;
  for (const auto& b : blocks_of(p)) block_runs(p, b, rows);
  // Clip to the held range; `held` becomes the position among the held elements.
  const int64_t lo = p.flat_begin, hi = p.held_end();
  std::vector<PlacementRun> out;
  out.reserve(rows.size());
  for (const auto& r : rows) {
    const int64_t b = std::max(r.held, lo), e = std::min(r.held + r.length, hi);
    if (b >= e) continue;
    out.push_back({r.global + (b - r.held), b - lo, e - b});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.global < b.global; });
  std::vector<PlacementRun> merged;
  for (const auto& r : out) {
    if (!merged.empty()) {
      auto& m = merged.back();
      if (m.global + m.length == r.global && m.held + m.length == r.held) {
        m.length += r.length;
        continue;
      }
    }
    merged.push_back(r);
  }
  return merged;
}

std::vector<PlacementCopy> placement_overlap(const std::vector<PlacementRun>& want,
                                             const std::vector<PlacementRun>& have) {
  std::vector<PlacementCopy> out;
  size_t j = 0;
  for (const auto& w : want) {
    while (j < have.size() && have[j].global + have[j].length <= w.global) ++j;
    for (size_t k = j; k < have.size() && have[k].global < w.global + w.length; ++k) {
      const auto& h = have[k];
      const int64_t b = std::max(w.global, h.global), e = std::min(w.global + w.length, h.global + h.length);
      if (b < e) out.push_back({w.held + (b - w.global), h.held + (b - h.global), e - b});
    }
  }
  return out;
}

std::string placement_cover_error(const std::vector<std::vector<PlacementRun>>& pieces, int64_t numel) {
  std::vector<std::tuple<int64_t, int64_t, size_t>> all;  // global, length, piece
  for (size_t i = 0; i < pieces.size(); ++i)
    for (const auto& r : pieces[i]) all.emplace_back(r.global, r.length, i);
  std::sort(all.begin(), all.end());
  int64_t next = 0;
  size_t last = 0;
  for (const auto& [g, n, i] : all) {
    if (g > next) return "no piece holds element " + std::to_string(next);
    if (g < next) {
      return "pieces " + std::to_string(last) + " and " + std::to_string(i) + " both hold element " + std::to_string(g);
    }
    next = g + n;
    last = i;
  }
  if (next < numel) return "no piece holds element " + std::to_string(next);
  if (next > numel) return "a piece holds element " + std::to_string(numel) + ", past the tensor's end";
  return "";
}

std::vector<ParameterPlacement> prefixed(std::vector<ParameterPlacement> list, const std::string& name_prefix,
                                         const std::string& dense_prefix) {
  for (auto& p : list) {
    p.name = name_prefix + p.name;
    p.dense_name = dense_prefix + p.dense_name;
  }
  return list;
}

}  // namespace tandem
