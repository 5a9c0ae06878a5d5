// Megatron-LM's indexed dataset (tandem/indexed_dataset.h): the writer, the mmap reader that
// validates every count against the files' lengths, packed windows, and dataset.json.
#include "tandem/indexed_dataset.h"

#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace tandem::data {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;
constexpr const char* kRemake = "; make it again with tandem preprocess";

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw std::runtime_error("'" + file + "': " + what);
}

// The whole file mapped read-only (nullptr for an empty file).
const char* map_file(const std::string& path, size_t* len) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    fail(path, std::string("cannot open (") + std::strerror(errno) + "); give the prefix of a preprocessed dataset");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a regular file");
  }
  *len = static_cast<size_t>(st.st_size);
  void* p = nullptr;
  if (*len > 0) {
    p = ::mmap(nullptr, *len, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      fail(path, std::string("mmap failed (") + std::strerror(errno) + ")");
    }
    ::madvise(p, *len, MADV_RANDOM);
  }
  ::close(fd);
  return static_cast<const char*>(p);
}

template <typename T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

TokenType token_type_for_vocab(int64_t vocab_size) {
  return vocab_size < 65500 ? TokenType::kUint16 : TokenType::kInt32;
}

int64_t token_bytes(TokenType t) { return t == TokenType::kUint16 ? 2 : 4; }

const char* to_string(TokenType t) { return t == TokenType::kUint16 ? "uint16" : "int32"; }

// ---- writer

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, TokenType type)
    : prefix_(prefix), type_(type), bin_(prefix + ".bin", std::ios::binary | std::ios::trunc) {
  if (!bin_) fail(prefix + ".bin", "cannot be created; check that the output directory is writable");
}

void IndexedDatasetWriter::add_document(const int64_t* ids, int64_t n) {
  const int64_t limit = type_ == TokenType::kUint16 ? (int64_t{1} << 16) : (int64_t{1} << 31);
  if (n > INT32_MAX) {
    throw std::invalid_argument("a document of " + std::to_string(n) + " tokens exceeds the format's int32 size");
  }
  const int64_t w = token_bytes(type_);
  buffer_.resize(static_cast<size_t>(n * w));
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= limit) {
      throw std::invalid_argument("token id " + std::to_string(ids[i]) + " does not fit the dataset's " +
                                  to_string(type_) + " ids");
    }
    if (type_ == TokenType::kUint16) {
      const uint16_t v = static_cast<uint16_t>(ids[i]);
      std::memcpy(buffer_.data() + i * 2, &v, 2);
    } else {
      const int32_t v = static_cast<int32_t>(ids[i]);
      std::memcpy(buffer_.data() + i * 4, &v, 4);
    }
  }
  bin_.write(buffer_.data(), static_cast<std::streamsize>(buffer_.size()));
  if (!bin_) fail(prefix_ + ".bin", "write failed (disk full?)");
  sizes_.push_back(static_cast<int32_t>(n));
  tokens_ += n;
}

void IndexedDatasetWriter::finish() {
  bin_.close();
  if (!bin_) fail(prefix_ + ".bin", "write failed (disk full?)");
  const std::string idx = prefix_ + ".idx", tmp = idx + ".tmp";
  std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
  if (!f) fail(tmp, "cannot be created; check that the output directory is writable");
  auto put = [&](const void* p, size_t n) { f.write(static_cast<const char*>(p), static_cast<std::streamsize>(n)); };
  const uint64_t version = 1, n = sizes_.size(), docs = n + 1;
  const uint8_t code = static_cast<uint8_t>(type_);
  put(kMagic, 9);
  put(&version, 8);
  put(&code, 1);
  put(&n, 8);
  put(&docs, 8);
  put(sizes_.data(), sizes_.size() * 4);
  int64_t pointer = 0;
  for (const int32_t s : sizes_) {
    put(&pointer, 8);
    pointer += static_cast<int64_t>(s) * token_bytes(type_);
  }
  for (uint64_t d = 0; d < docs; ++d) put(&d, 8);
  f.close();
  if (!f) fail(tmp, "write failed (disk full?)");
  if (std::rename(tmp.c_str(), idx.c_str()) != 0) fail(idx, std::string("rename failed: ") + std::strerror(errno));
}

// ---- reader

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  idx_ = map_file(idx, &idx_len_);
  try {
    if (idx_len_ < kHeaderBytes)
      fail(idx, "truncated: " + std::to_string(idx_len_) + " bytes, shorter than the header" + kRemake);
    if (std::memcmp(idx_, kMagic, 9) != 0) fail(idx, "not a Megatron indexed dataset index (no MMIDIDX magic)");
    if (load<uint64_t>(idx_ + 9) != 1) fail(idx, "version " + std::to_string(load<uint64_t>(idx_ + 9)) + ", not 1");
    const uint8_t code = load<uint8_t>(idx_ + 17);
    if (code != 4 && code != 8) {
      fail(idx, "dtype code " + std::to_string(code) + " is not a token id type Tandem reads (4: int32, 8: uint16)");
    }
    type_ = static_cast<TokenType>(code);
    const uint64_t n = load<uint64_t>(idx_ + 18), d = load<uint64_t>(idx_ + 26);
    const uint64_t limit = idx_len_ / 8;  // no count can exceed the file's length
    if (n > limit || d > limit || d < 1)
      fail(idx, "impossible counts (" + std::to_string(n) + " sequences, " + std::to_string(d) + " document indices)" +
                    kRemake);
    const uint64_t want = kHeaderBytes + n * 4 + n * 8 + d * 8;
    if (idx_len_ != want) {
      fail(idx, std::string(idx_len_ < want ? "truncated" : "longer than its counts") + ": " +
                    std::to_string(idx_len_) + " bytes, its header's " + std::to_string(n) + " sequences and " +
                    std::to_string(d) + " document indices need " + std::to_string(want) + kRemake);
    }
    sequences_ = static_cast<int64_t>(n);
    doc_count_ = static_cast<int64_t>(d);
    // The arrays start at offsets Megatron fixes, not always aligned to their type: every read
    // of them goes through memcpy (load).
    sizes_ = reinterpret_cast<const int32_t*>(idx_ + kHeaderBytes);
    pointers_ = reinterpret_cast<const int64_t*>(idx_ + kHeaderBytes + n * 4);
    doc_idx_ = reinterpret_cast<const int64_t*>(idx_ + kHeaderBytes + n * 12);
    const int64_t w = token_bytes(type_);
    int64_t expect = 0;
    for (int64_t i = 0; i < sequences_; ++i) {
      if (size(i) < 0) fail(idx, "sequence " + std::to_string(i) + " has a negative size" + kRemake);
      if (pointer(i) != expect) {
        fail(idx, "sequence " + std::to_string(i) + " starts at byte " + std::to_string(pointer(i)) + ", not " +
                      std::to_string(expect) +
                      " after the ones before it (Tandem reads sequences stored back to back)");
      }
      expect += static_cast<int64_t>(size(i)) * w;
    }
    tokens_ = expect / w;
    for (int64_t i = 0; i < doc_count_; ++i) {
      const int64_t v = doc_index(i), prev = i > 0 ? doc_index(i - 1) : 0;
      if (v < prev || v > sequences_ || (i == 0 && v != 0) || (i + 1 == doc_count_ && v != sequences_)) {
        fail(idx, "document index " + std::to_string(i) + " is " + std::to_string(v) +
                      "; they must rise from 0 to the sequence count" + kRemake);
      }
    }
    bin_ = map_file(bin, &bin_len_);
    if (static_cast<int64_t>(bin_len_) != expect) {
      fail(bin, std::to_string(bin_len_) + " bytes, but its index '" + idx + "' describes " + std::to_string(expect) +
                    " (" + (static_cast<int64_t>(bin_len_) < expect ? "truncated" : "longer") +
                    "); the two files must come from the same run of tandem preprocess");
    }
  } catch (...) {
    if (idx_) ::munmap(const_cast<char*>(idx_), idx_len_);
    if (bin_) ::munmap(const_cast<char*>(bin_), bin_len_);
    throw;
  }
}

IndexedDataset::~IndexedDataset() {
  if (idx_) ::munmap(const_cast<char*>(idx_), idx_len_);
  if (bin_) ::munmap(const_cast<char*>(bin_), bin_len_);
}

int32_t IndexedDataset::size(int64_t i) const { return load<int32_t>(reinterpret_cast<const char*>(sizes_ + i)); }
int64_t IndexedDataset::pointer(int64_t i) const { return load<int64_t>(reinterpret_cast<const char*>(pointers_ + i)); }
int64_t IndexedDataset::doc_index(int64_t i) const {
  return load<int64_t>(reinterpret_cast<const char*>(doc_idx_ + i));
}

void IndexedDataset::read(int64_t first, int64_t n, int64_t* out) const {
  if (first < 0 || n < 0 || first + n > tokens_) {
    throw std::out_of_range("'" + prefix_ + ".bin': tokens [" + std::to_string(first) + ", " +
                            std::to_string(first + n) + ") outside its " + std::to_string(tokens_));
  }
  if (type_ == TokenType::kUint16) {
    for (int64_t i = 0; i < n; ++i) out[i] = load<uint16_t>(bin_ + (first + i) * 2);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = load<int32_t>(bin_ + (first + i) * 4);
  }
}

// ---- packed windows

PackedWindows::PackedWindows(const IndexedDataset& data, int64_t seq)
    : data_(data), seq_(seq), windows_(seq > 0 ? std::max<int64_t>(0, (data.tokens() - 1) / seq) : 0) {
  if (seq < 1) throw std::invalid_argument("--seq must be >= 1");
  if (windows_ < 1) {
    throw std::invalid_argument("'" + data.prefix() + "' holds " + std::to_string(data.tokens()) +
                                " tokens, less than one window of --seq " + std::to_string(seq) +
                                " + 1; lower --seq or preprocess more text");
  }
}

void PackedWindows::window(int64_t w, int64_t* out, int64_t vocab_size) const {
  if (w < 0 || w >= windows_)
    throw std::out_of_range("window " + std::to_string(w) + " of " + std::to_string(windows_));
  data_.read(w * seq_, seq_ + 1, out);
  if (vocab_size <= 0) return;
  for (int64_t i = 0; i <= seq_; ++i) {
    if (out[i] < 0 || out[i] >= vocab_size) {
      throw std::runtime_error("'" + data_.prefix() + ".bin': token " + std::to_string(w * seq_ + i) + " is id " +
                               std::to_string(out[i]) + ", outside the model's vocabulary of " +
                               std::to_string(vocab_size) + "; preprocess with this model's tokenizer");
    }
  }
}

// ---- dataset.json

void write_dataset_info(const std::string& dir, const DatasetInfo& i) {
  nlohmann::json j = {{"format", "megatron-mmap-indexed-dataset"},
                      {"prefix", i.prefix},
                      {"dtype", to_string(i.type)},
                      {"tokenizer",
                       {{"model_dir", i.tokenizer_dir}, {"vocab_size", i.vocab_size}, {"eos", i.eos}, {"bos", i.bos}}},
                      {"source", i.source},
                      {"documents", i.documents},
                      {"tokens", i.tokens},
                      {"eod_appended", true}};
  const std::string path = dir + "/" + kDatasetInfoFile;
  std::ofstream f(path);
  f << j.dump(2) << '\n';
  if (!f) fail(path, "cannot be written");
}

DatasetInfo read_dataset_info(const std::string& dir) {
  const std::string path = dir + "/" + kDatasetInfoFile;
  std::ifstream f(path);
  if (!f) {
    fail(path, "missing: --data DIR must be an output directory of tandem preprocess --init-from MODEL --data FILE "
               "--out DIR (or a JSON lines file)");
  }
  const auto j = nlohmann::json::parse(f, nullptr, false);
  DatasetInfo i;
  try {
    if (j.is_discarded()) throw std::runtime_error("not JSON");
    i.prefix = j.at("prefix").get<std::string>();
    const auto& t = j.at("tokenizer");
    i.tokenizer_dir = t.at("model_dir").get<std::string>();
    i.vocab_size = t.at("vocab_size").get<int64_t>();
    i.eos = t.at("eos").get<int64_t>();
    i.bos = t.value("bos", int64_t{-1});
    i.source = j.value("source", std::string());
    i.documents = j.at("documents").get<int64_t>();
    i.tokens = j.at("tokens").get<int64_t>();
    const auto dtype = j.at("dtype").get<std::string>();
    if (dtype != "uint16" && dtype != "int32") throw std::runtime_error("dtype '" + dtype + "'");
    i.type = dtype == "uint16" ? TokenType::kUint16 : TokenType::kInt32;
  } catch (const std::exception& e) {
    fail(path, std::string("malformed (") + e.what() + ")" + kRemake);
  }
  if (i.prefix.empty() || i.prefix.find('/') != std::string::npos) fail(path, "bad prefix '" + i.prefix + "'");
  return i;
}

}  // namespace tandem::data
