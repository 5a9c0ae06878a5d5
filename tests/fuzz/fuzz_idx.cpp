// libFuzzer target: an IDX image file and an IDX label file (raw or gzip) -> idx_decompress()
// and parse_idx_images(), as load_idx() uses them. Input: byte 0 selects the label check
// (odd: labels < 10, even: any), bytes 1-2 (little-endian, modulo the rest's length + 1) where
// the rest splits into the image file and the label file. Besides crashes and sanitizer
// reports it checks that an accepted pair's data spans its files exactly, and that every
// rejection is a std::runtime_error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "data/idx_parse.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const int64_t classes = (data[0] & 1) ? 10 : 0;
  const size_t rest = size - 3;
  const size_t split = (static_cast<size_t>(data[1]) | static_cast<size_t>(data[2]) << 8) % (rest + 1);
  const uint8_t* p = data + 3;
  using tandem::data::idx_decompress;
  try {
    auto images = idx_decompress("fuzz/images", std::vector<uint8_t>(p, p + split));
    auto labels = idx_decompress("fuzz/labels", std::vector<uint8_t>(p + split, p + rest));
    auto idx = tandem::data::parse_idx_images("fuzz/images", images, "fuzz/labels", labels, classes);
    require(idx.n >= 0 && idx.h >= 0 && idx.w >= 0);
    require(idx.pixels + idx.n * idx.h * idx.w == images.data() + images.size());
    require(idx.labels + idx.n == labels.data() + labels.size());
    for (int64_t i = 0; classes > 0 && i < idx.n; ++i) require(idx.labels[i] < classes);
  } catch (const std::runtime_error&) {
    // rejected: the expected outcome for most inputs
  }
  return 0;
}
