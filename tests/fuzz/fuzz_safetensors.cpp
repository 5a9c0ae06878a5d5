// libFuzzer target: bytes of a safetensors file -> parse_st_header(). Besides crashes and
// sanitizer reports, it checks the promises the reader (safetensors.cpp) relies on after a
// successful parse (ranges in bounds, ordered, tiling the buffer, sized by dtype and shape), and
// that formatting the parsed header and parsing it again gives the same tensors and metadata.
// Every rejection must be a std::runtime_error (anything else escaping aborts).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "checkpoint/safetensors_header.h"

namespace {

using tandem::ckpt::StHeader;

void require(bool ok) {
  if (!ok) std::abort();
}

void check(const StHeader& h, uint64_t file_size) {
  require(h.data_start >= 8 && h.data_start <= file_size);
  uint64_t at = 0;
  for (auto& e : h.tensors) {
    require(e.begin == at && e.end >= e.begin);
    uint64_t bytes = tandem::ckpt::st_dtype_size(e.dtype);
    for (auto s : e.shape) {
      require(s >= 0);
      bytes *= static_cast<uint64_t>(s);
    }
    require(bytes == e.end - e.begin);
    at = e.end;
  }
  require(h.data_start + at == file_size);
}

void check_round_trip(const StHeader& h) {
  const std::string head = tandem::ckpt::format_st_header(h);
  require(head.size() % 8 == 0);
  const uint64_t data = h.tensors.empty() ? 0 : h.tensors.back().end;
  std::string file = head + std::string(data, '\0');
  const auto again = tandem::ckpt::parse_st_header(reinterpret_cast<const uint8_t*>(file.data()), file.size(),
                                                   file.size(), "fuzz/again.safetensors");
  require(again.metadata == h.metadata && again.tensors.size() == h.tensors.size());
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const auto &a = again.tensors[i], &b = h.tensors[i];
    require(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin && a.end == b.end);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto h = tandem::ckpt::parse_st_header(data, size, size, "fuzz/input.safetensors");
    check(h, size);
    check_round_trip(h);
  } catch (const std::runtime_error&) {
    // a rejected file: the expected outcome for most inputs
  }
  return 0;
}
