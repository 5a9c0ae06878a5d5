// libFuzzer target: checkpoint manifest text -> parse_manifest(). Besides crashes and
// sanitizer reports, it checks the promises the loader (checkpoint.cpp) relies on after a
// successful parse (every tensor's pieces valid and covering it exactly once, in every layout), and that every
// rejection is a std::runtime_error (anything else escaping aborts, which the fuzzer reports).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/manifest.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

void check(const tandem::ckpt::Manifest& m) {
  using tandem::ckpt::LayoutKind;
  const int n = m.meta.world_size;
  require(n >= 1 && m.files.size() == static_cast<size_t>(n) && m.digests.size() == m.files.size());
  for (auto& f : m.files) require(!f.empty() && f[0] != '.' && f.find('/') == std::string::npos);
  for (auto& d : m.digests) require(d.bytes >= 0);
  require(m.meta.step >= 0 && m.meta.epoch >= 0 && m.meta.step_in_epoch >= 0);
  for (auto& p : m.params) {
    int64_t numel = 1;
    for (auto s : p.shape) {
      require(s >= 0);
      numel *= s;
    }
    require(numel == p.numel);
  }
  // What the loader relies on for every layout: each tensor's pieces name a rank of the world,
  // hold a valid placement of the tensor's shape, and cover it exactly once.
  for (auto& [key, t] : m.tensors) {
    require(!key.empty());
    std::vector<std::vector<tandem::PlacementRun>> runs;
    int64_t numel = 1;
    for (auto s : t.shape) numel *= s;
    for (auto& p : t.pieces) {
      require(p.rank >= 0 && p.rank < n && !p.entry.empty() && p.entry_offset >= 0);
      require(p.placement.global_shape == t.shape);
      try {
        p.placement.check("fuzz");
      } catch (const std::invalid_argument&) {
        std::abort();
      }
      runs.push_back(tandem::placement_runs(p.placement));
    }
    require(tandem::placement_cover_error(runs, numel).empty());
  }
  for (auto& p : m.params) require(m.tensors.count(tandem::ckpt::state_key("param", p.name)) == 1);
  for (auto& b : m.buffers) require(m.tensors.count(tandem::ckpt::state_key("buffer", b.name)) == 1);
  if (m.layout == LayoutKind::kPieces) return;
  require(m.buffer_owner.size() == m.buffers.size());
  for (int r : m.buffer_owner) require(r >= 0 && r < n);
  if (m.layout == LayoutKind::kZero) {
    require(m.param_bucket.size() == m.params.size() && m.param_offset.size() == m.params.size());
    for (auto& b : m.buckets) require(b.chunk >= 0 && b.chunk * n == b.padded && b.numel <= b.padded);
    for (size_t i = 0; i < m.params.size(); ++i) {
      require(m.param_bucket[i] < m.buckets.size() && m.param_offset[i] >= 0);
      require(m.param_offset[i] + m.params[i].numel <= m.buckets[m.param_bucket[i]].padded);
    }
  } else {
    require(m.param_owner.size() == m.params.size());
    for (int r : m.param_owner) require(r >= 0 && r < n);
  }
  if (m.layout == LayoutKind::kStages) {
    require(!m.partition.empty());
    for (auto l : m.partition) require(l >= 1);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    check(tandem::ckpt::parse_manifest(text, "fuzz/manifest.json"));
  } catch (const std::runtime_error&) {
    // a rejected manifest: the expected outcome for most inputs
  }
  return 0;
}
