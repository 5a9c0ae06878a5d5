// IDX (MNIST-format) reader: the files (raw or gzip) parsed and validated by data/idx_parse.cpp,
// then normalized to float32.
#include "tandem/data.h"

#include "data/idx_parse.h"

#include <ATen/ATen.h>
#include <sys/stat.h>

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

constexpr const char* kInstallHint =
    "Fashion-MNIST is provided by the Debian package dataset-fashion-mnist "
    "(apt-get install dataset-fashion-mnist, files in /usr/share/datasets/fashion-mnist); "
    "otherwise pass the path of an existing IDX file";

// The whole file, decompressed when it starts with the gzip magic 1f 8b.
std::vector<uint8_t> read_file(const std::string& path) {
  const PathKind kind = path_kind(path);
  if (kind == PathKind::kMissing) idx_fail(path, std::string("no such file. ") + kInstallHint);
  if (kind == PathKind::kDirectory) idx_fail(path, "is a directory, expected an IDX file");
  std::ifstream f(path, std::ios::binary);
  if (!f) idx_fail(path, std::string("cannot open: ") + std::strerror(errno));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) idx_fail(path, std::string("read error: ") + std::strerror(errno));
  return idx_decompress(path, std::move(bytes));
}

}  // namespace

Dataset load_idx(const std::string& images_path, const std::string& labels_path, const LoadOptions& options) {
  if (!(options.std > 0.0)) {
    throw std::invalid_argument("tandem::data::load_idx: normalization std must be > 0, got " +
                                std::to_string(options.std));
  }
  if (options.num_classes < 0 || options.num_classes > 256) {
    throw std::invalid_argument("tandem::data::load_idx: num_classes must be in [0, 256], got " +
                                std::to_string(options.num_classes));
  }
  const std::vector<uint8_t> img = read_file(images_path);
  parse_idx_header(images_path, img, kIdxImagesMagic, "image");  // its errors before the label file's
  const std::vector<uint8_t> lab = read_file(labels_path);
  const IdxImages idx = parse_idx_images(images_path, img, labels_path, lab, options.num_classes);

  Dataset ds;
  auto raw =
      at::from_blob(const_cast<uint8_t*>(idx.pixels), {idx.n, 1, idx.h, idx.w}, at::TensorOptions().dtype(at::kByte));
  ds.images = raw.to(at::kFloat).div_(255.0).sub_(options.mean).div_(options.std);
  ds.labels =
      at::from_blob(const_cast<uint8_t*>(idx.labels), {idx.n}, at::TensorOptions().dtype(at::kByte)).to(at::kLong);
  return ds;
}

Dataset load_fashion_mnist(const std::string& dir, bool train, const LoadOptions& options) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string base = dir.empty() ? std::string(".") : (dir.back() == '/' ? dir : dir + "/");
  auto find = [&](const std::string& stem) {
    const std::string gz = base + stem + ".gz", raw = base + stem;
    if (path_kind(gz) == PathKind::kFile) return gz;
    if (path_kind(raw) == PathKind::kFile) return raw;
    throw std::runtime_error("tandem::data: Fashion-MNIST " + std::string(train ? "training" : "test") + " file " +
                             stem + "[.gz] not found in '" + dir + "' (looked for '" + gz + "' and '" + raw + "'). " +
                             kInstallHint);
  };
  const std::string images = find(prefix + "-images-idx3-ubyte");
  const std::string labels = find(prefix + "-labels-idx1-ubyte");
  return load_idx(images, labels, options);
}

}  // namespace tandem::data
