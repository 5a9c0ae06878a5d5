// IDX (MNIST-format) bytes -> validated dimensions and data, without LibTorch: gzip
// decompression (zlib) and every check that loading makes before building tensors. Shared by
// the library (data/idx.cpp) and the fuzz target (tests/fuzz/fuzz_idx.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tandem::data {

constexpr uint32_t kIdxImagesMagic = 0x00000803;  // ubyte, 3 dimensions
constexpr uint32_t kIdxLabelsMagic = 0x00000801;  // ubyte, 1 dimension

// Throws std::runtime_error("tandem::data: 'PATH': WHAT"), the form of every IDX error.
[[noreturn]] void idx_fail(const std::string& path, const std::string& what);

// `bytes` itself, or decompressed when it starts with the gzip magic 1f 8b (concatenated
// members allowed). Throws std::runtime_error naming `path` for corrupt or truncated gzip data,
// or when this build has no zlib.
std::vector<uint8_t> idx_decompress(const std::string& path, std::vector<uint8_t> bytes);

// Checks the magic (`kind`: "image" or "label", for messages), the header and that the data
// has exactly the size the dimensions give; returns the dimensions. The data starts at byte
// 4 + 4 * dims.size(). Throws std::runtime_error naming `path`.
std::vector<uint64_t> parse_idx_header(const std::string& path, const std::vector<uint8_t>& b, uint32_t expected_magic,
                                       const char* kind);

// An image file (N x H x W) and its label file (N) checked together: the same count, and every
// label below num_classes (0: any byte).
struct IdxImages {
  int64_t n = 0, h = 0, w = 0;
  const uint8_t* pixels = nullptr;  // n * h * w bytes inside the image file's bytes
  const uint8_t* labels = nullptr;  // n bytes inside the label file's bytes
};
IdxImages parse_idx_images(const std::string& images_path, const std::vector<uint8_t>& images,
                           const std::string& labels_path, const std::vector<uint8_t>& labels, int64_t num_classes);

}  // namespace tandem::data
