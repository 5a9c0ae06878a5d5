// IDX parsing and validation (data/idx_parse.h). No LibTorch here: this file is also compiled
// alone, with clang and sanitizers, into tests/fuzz/fuzz_idx.
#include "data/idx_parse.h"

#include "tandem_build_config.h"
#if TANDEM_HAVE_ZLIB
#include <zlib.h>
#endif

#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace tandem::data {

void idx_fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("tandem::data: '" + path + "': " + what);
}

namespace {

uint32_t be32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | uint32_t(p[3]);
}

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

#if TANDEM_HAVE_ZLIB
std::vector<uint8_t> gunzip(const std::string& path, const std::vector<uint8_t>& in) {
  std::vector<uint8_t> out;
  // The gzip trailer holds the uncompressed size modulo 2^32: a good first reservation, but
  // only as far as deflate can expand (at most 1032:1), so a corrupt trailer cannot make a
  // small file reserve gigabytes.
  if (in.size() >= 18) {
    const uint8_t* t = in.data() + in.size() - 4;
    const uint64_t isize = uint32_t(t[0]) | uint32_t(t[1]) << 8 | uint32_t(t[2]) << 16 | uint32_t(t[3]) << 24;
    out.reserve(static_cast<size_t>(std::min<uint64_t>(isize, uint64_t{1032} * in.size())));
  }
  z_stream zs{};
  if (inflateInit2(&zs, 15 + 16) != Z_OK) idx_fail(path, "zlib inflateInit2 failed");
  size_t consumed = 0;
  bool done = false;
  unsigned char chunk[1 << 16];
  while (!done) {
    zs.next_in = const_cast<Bytef*>(in.data() + consumed);
    const size_t avail = std::min<size_t>(in.size() - consumed, 1u << 30);
    zs.avail_in = static_cast<uInt>(avail);
    int rc = Z_OK;
    do {
      zs.next_out = chunk;
      zs.avail_out = sizeof(chunk);
      rc = inflate(&zs, Z_NO_FLUSH);
      if (rc != Z_OK && rc != Z_STREAM_END && rc != Z_BUF_ERROR) {
        std::string msg = zs.msg ? zs.msg : "error " + std::to_string(rc);
        inflateEnd(&zs);
        idx_fail(path, "corrupt gzip data (" + msg + "); re-download or reinstall the file");
      }
      out.insert(out.end(), chunk, chunk + (sizeof(chunk) - zs.avail_out));
    } while (rc == Z_OK && (zs.avail_in > 0 || zs.avail_out == 0));
    consumed += avail - zs.avail_in;
    if (rc == Z_STREAM_END) {
      // Concatenated gzip members are legal; anything else after the end is ignored by gzip
      // too, but we stay strict only about truncation.
      if (consumed + 2 <= in.size() && in[consumed] == 0x1f && in[consumed + 1] == 0x8b) {
        inflateReset(&zs);
        continue;
      }
      done = true;
    } else if (consumed >= in.size()) {
      inflateEnd(&zs);
      idx_fail(path, "gzip data ends early (truncated file, " + std::to_string(in.size()) +
                         " bytes); re-download or reinstall it");
    }
  }
  inflateEnd(&zs);
  return out;
}

#else
std::vector<uint8_t> gunzip(const std::string& path, const std::vector<uint8_t>&) {
  idx_fail(
      path,
      "is gzip-compressed, but this build of Tandem has no zlib; gunzip the file or rebuild with zlib1g-dev installed");
}
#endif

}  // namespace

std::vector<uint8_t> idx_decompress(const std::string& path, std::vector<uint8_t> bytes) {
  if (bytes.size() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b) return gunzip(path, bytes);
  return bytes;
}

std::vector<uint64_t> parse_idx_header(const std::string& path, const std::vector<uint8_t>& b, uint32_t expected_magic,
                                       const char* kind) {
  const size_t ndim = expected_magic & 0xff;
  if (b.size() < 4) {
    idx_fail(path, "too short for an IDX header (" + std::to_string(b.size()) +
                       " bytes); the file is truncated or not an IDX file");
  }
  const uint32_t magic = be32(b.data());
  if (magic != expected_magic) {
    std::string hint;
    if (magic == kIdxImagesMagic || magic == kIdxLabelsMagic) {
      hint = magic == kIdxImagesMagic ? " (it is an IDX image file; are the image and label paths swapped?)"
                                      : " (it is an IDX label file; are the image and label paths swapped?)";
    } else {
      hint = " (not an IDX ubyte file)";
    }
    idx_fail(path, std::string("wrong magic number ") + hex(magic) + ", expected " + hex(expected_magic) +
                       " for an IDX " + kind + " file" + hint);
  }
  const size_t header = 4 + 4 * ndim;
  if (b.size() < header) {
    idx_fail(path, "truncated IDX header: " + std::to_string(b.size()) + " bytes, need " + std::to_string(header));
  }
  std::vector<uint64_t> dims(ndim);
  uint64_t total = 1;
  for (size_t i = 0; i < ndim; ++i) {
    dims[i] = be32(b.data() + 4 + 4 * i);
    if (__builtin_mul_overflow(total, dims[i], &total)) idx_fail(path, "IDX dimensions overflow");
  }
  uint64_t expected = 0;
  if (__builtin_add_overflow(total, header, &expected)) idx_fail(path, "IDX dimensions overflow");
  if (b.size() < expected) {
    idx_fail(path, "truncated: the header promises " + std::to_string(expected) + " bytes of " + kind +
                       " data and header but the (decompressed) file holds " + std::to_string(b.size()) +
                       "; re-download or reinstall it");
  }
  if (b.size() > expected) {
    idx_fail(path, "has " + std::to_string(b.size() - expected) +
                       " bytes after the data the header describes; the file is corrupt");
  }
  return dims;
}

IdxImages parse_idx_images(const std::string& images_path, const std::vector<uint8_t>& images,
                           const std::string& labels_path, const std::vector<uint8_t>& labels, int64_t num_classes) {
  const auto idims = parse_idx_header(images_path, images, kIdxImagesMagic, "image");
  const auto ldims = parse_idx_header(labels_path, labels, kIdxLabelsMagic, "label");
  if (ldims[0] != idims[0]) {
    throw std::runtime_error("tandem::data: image/label count mismatch: '" + images_path + "' holds " +
                             std::to_string(idims[0]) + " images but '" + labels_path + "' holds " +
                             std::to_string(ldims[0]) + " labels; do the two files belong together?");
  }
  IdxImages out;
  out.n = static_cast<int64_t>(idims[0]);
  out.h = static_cast<int64_t>(idims[1]);
  out.w = static_cast<int64_t>(idims[2]);
  out.pixels = images.data() + 16;
  out.labels = labels.data() + 8;
  if (num_classes > 0) {
    for (int64_t i = 0; i < out.n; ++i) {
      if (out.labels[i] >= num_classes) {
        idx_fail(labels_path, "label " + std::to_string(out.labels[i]) + " at index " + std::to_string(i) +
                                  " is outside [0, " + std::to_string(num_classes) +
                                  "); wrong file, or set LoadOptions::num_classes");
      }
    }
  }
  return out;
}

}  // namespace tandem::data
