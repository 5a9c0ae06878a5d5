// IDX (MNIST-format) reader: raw or gzip files, strict validation, normalization to float32.
#include "tandem/data.h"

#include <ATen/ATen.h>
#include <sys/stat.h>
#include "tandem_build_config.h"
#if TANDEM_HAVE_ZLIB
#include <zlib.h>
#endif

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace tandem::data {
namespace {

// POSIX stat rather than std::filesystem: pip torch's libtorch.so exports its own copy of
// std::filesystem whose remove_all/recursive iteration crash, and it may interpose ours.
enum class PathKind { kMissing, kFile, kDirectory, kOther };
PathKind path_kind(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return PathKind::kMissing;
  if (S_ISDIR(st.st_mode)) return PathKind::kDirectory;
  return S_ISREG(st.st_mode) ? PathKind::kFile : PathKind::kOther;
}

constexpr uint32_t kImagesMagic = 0x00000803;  // ubyte, 3 dimensions
constexpr uint32_t kLabelsMagic = 0x00000801;  // ubyte, 1 dimension
constexpr const char* kInstallHint =
    "Fashion-MNIST is provided by the Debian package dataset-fashion-mnist "
    "(apt-get install dataset-fashion-mnist, files in /usr/share/datasets/fashion-mnist); "
    "otherwise pass the path of an existing IDX file";

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("tandem::data: '" + path + "': " + what);
}

#if TANDEM_HAVE_ZLIB
std::vector<uint8_t> gunzip(const std::string& path, const std::vector<uint8_t>& in) {
  std::vector<uint8_t> out;
  // The gzip trailer holds the uncompressed size modulo 2^32: a good first reservation.
  if (in.size() >= 18) {
    const uint8_t* t = in.data() + in.size() - 4;
    out.reserve(uint32_t(t[0]) | uint32_t(t[1]) << 8 | uint32_t(t[2]) << 16 | uint32_t(t[3]) << 24);
  }
  z_stream zs{};
  if (inflateInit2(&zs, 15 + 16) != Z_OK) fail(path, "zlib inflateInit2 failed");
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
        fail(path, "corrupt gzip data (" + msg + "); re-download or reinstall the file");
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
      fail(path, "gzip data ends early (truncated file, " + std::to_string(in.size()) +
                     " bytes); re-download or reinstall it");
    }
  }
  inflateEnd(&zs);
  return out;
}

#else
std::vector<uint8_t> gunzip(const std::string& path, const std::vector<uint8_t>&) {
  fail(path, "is gzip-compressed, but this build of Tandem has no zlib; gunzip the file or rebuild with zlib1g-dev installed");
}
#endif

// The whole file, decompressed when it starts with the gzip magic 1f 8b.
std::vector<uint8_t> read_file(const std::string& path) {
  const PathKind kind = path_kind(path);
  if (kind == PathKind::kMissing) fail(path, std::string("no such file. ") + kInstallHint);
  if (kind == PathKind::kDirectory) fail(path, "is a directory, expected an IDX file");
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path, std::string("cannot open: ") + std::strerror(errno));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) fail(path, std::string("read error: ") + std::strerror(errno));
  if (bytes.size() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b) return gunzip(path, bytes);
  return bytes;
}

uint32_t be32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | uint32_t(p[3]);
}

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// Checks the magic and the dimensions; returns the dimensions.
std::vector<uint64_t> parse_header(const std::string& path, const std::vector<uint8_t>& b,
                                   uint32_t expected_magic, const char* kind) {
  const size_t ndim = expected_magic & 0xff;
  if (b.size() < 4) {
    fail(path, "too short for an IDX header (" + std::to_string(b.size()) +
                   " bytes); the file is truncated or not an IDX file");
  }
  const uint32_t magic = be32(b.data());
  if (magic != expected_magic) {
    std::string hint;
    if (magic == kImagesMagic || magic == kLabelsMagic) {
      hint = magic == kImagesMagic ? " (it is an IDX image file; are the image and label paths swapped?)"
                                   : " (it is an IDX label file; are the image and label paths swapped?)";
    } else {
      hint = " (not an IDX ubyte file)";
    }
    fail(path, std::string("wrong magic number ") + hex(magic) + ", expected " + hex(expected_magic) +
                   " for an IDX " + kind + " file" + hint);
  }
  const size_t header = 4 + 4 * ndim;
  if (b.size() < header) {
    fail(path, "truncated IDX header: " + std::to_string(b.size()) + " bytes, need " +
                   std::to_string(header));
  }
  std::vector<uint64_t> dims(ndim);
  uint64_t total = 1;
  for (size_t i = 0; i < ndim; ++i) {
    dims[i] = be32(b.data() + 4 + 4 * i);
    if (__builtin_mul_overflow(total, dims[i], &total)) fail(path, "IDX dimensions overflow");
  }
  const uint64_t expected = header + total;
  if (b.size() < expected) {
    fail(path, "truncated: the header promises " + std::to_string(expected) + " bytes of " + kind +
                   " data and header but the (decompressed) file holds " + std::to_string(b.size()) +
                   "; re-download or reinstall it");
  }
  if (b.size() > expected) {
    fail(path, "has " + std::to_string(b.size() - expected) +
                   " bytes after the data the header describes; the file is corrupt");
  }
  return dims;
}

}  // namespace

Dataset load_idx(const std::string& images_path, const std::string& labels_path,
                 const LoadOptions& options) {
  if (!(options.std > 0.0)) {
    throw std::invalid_argument("tandem::data::load_idx: normalization std must be > 0, got " +
                                std::to_string(options.std));
  }
  if (options.num_classes < 0 || options.num_classes > 256) {
    throw std::invalid_argument("tandem::data::load_idx: num_classes must be in [0, 256], got " +
                                std::to_string(options.num_classes));
  }
  std::vector<uint8_t> img = read_file(images_path);
  auto idims = parse_header(images_path, img, kImagesMagic, "image");
  std::vector<uint8_t> lab = read_file(labels_path);
  auto ldims = parse_header(labels_path, lab, kLabelsMagic, "label");

  const int64_t n = static_cast<int64_t>(idims[0]);
  const int64_t h = static_cast<int64_t>(idims[1]);
  const int64_t w = static_cast<int64_t>(idims[2]);
  if (static_cast<int64_t>(ldims[0]) != n) {
    throw std::runtime_error("tandem::data: image/label count mismatch: '" + images_path + "' holds " +
                             std::to_string(n) + " images but '" + labels_path + "' holds " +
                             std::to_string(ldims[0]) + " labels; do the two files belong together?");
  }
  const uint8_t* lp = lab.data() + 8;
  if (options.num_classes > 0) {
    for (int64_t i = 0; i < n; ++i) {
      if (lp[i] >= options.num_classes) {
        fail(labels_path, "label " + std::to_string(lp[i]) + " at index " + std::to_string(i) +
                              " is outside [0, " + std::to_string(options.num_classes) +
                              "); wrong file, or set LoadOptions::num_classes");
      }
    }
  }

  Dataset ds;
  auto raw = at::from_blob(img.data() + 16, {n, 1, h, w}, at::TensorOptions().dtype(at::kByte));
  ds.images = raw.to(at::kFloat).div_(255.0).sub_(options.mean).div_(options.std);
  ds.labels = at::from_blob(const_cast<uint8_t*>(lp), {n}, at::TensorOptions().dtype(at::kByte)).to(at::kLong);
  return ds;
}

Dataset load_fashion_mnist(const std::string& dir, bool train, const LoadOptions& options) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string base = dir.empty() ? std::string(".") : (dir.back() == '/' ? dir : dir + "/");
  auto find = [&](const std::string& stem) {
    const std::string gz = base + stem + ".gz", raw = base + stem;
    if (path_kind(gz) == PathKind::kFile) return gz;
    if (path_kind(raw) == PathKind::kFile) return raw;
    throw std::runtime_error("tandem::data: Fashion-MNIST " + std::string(train ? "training" : "test") +
                             " file " + stem + "[.gz] not found in '" + dir + "' (looked for '" + gz +
                             "' and '" + raw + "'). " + kInstallHint);
  };
  const std::string images = find(prefix + "-images-idx3-ubyte");
  const std::string labels = find(prefix + "-labels-idx1-ubyte");
  return load_idx(images, labels, options);
}

}  // namespace tandem::data
