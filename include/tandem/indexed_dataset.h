// Pre-tokenized text in Megatron-LM's indexed dataset format (MMapIndexedDataset): PREFIX.bin holds
// every sequence's token ids back to back; PREFIX.idx is the index:
//   "MMIDIDX\0\0", u64 version 1, u8 dtype code (8: uint16, 4: int32), u64 sequence count S,
//   u64 document-index count D + 1, int32 sizes[S], int64 byte pointers[S], int64 doc_idx[D + 1]
// (all little-endian; doc_idx starts at 0 and ends at S). Tandem writes one sequence per document,
// so the .bin is the corpus as one token stream, and reads it by mmap: memory does not grow with
// the corpus. Packed windows over that stream (PackedWindows) are what the language-model loops
// train on. Every error names the file and what to do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace tandem::data {

// Megatron's dtype codes; its builder picks uint16 below a vocabulary of 65500, else int32.
enum class TokenType : uint8_t { kInt32 = 4, kUint16 = 8 };
TokenType token_type_for_vocab(int64_t vocab_size);
int64_t token_bytes(TokenType t);
const char* to_string(TokenType t);  // "uint16" | "int32"

// Writes PREFIX.bin as documents come and PREFIX.idx at finish(); holds 12 bytes per document.
class IndexedDatasetWriter {
 public:
  // Throws std::runtime_error naming the file when PREFIX.bin cannot be created.
  IndexedDatasetWriter(const std::string& prefix, TokenType type);
  // One document's ids (each in [0, 2^16) for uint16; else std::invalid_argument naming the id).
  void add_document(const int64_t* ids, int64_t n);
  void add_document(const std::vector<int64_t>& ids) { add_document(ids.data(), static_cast<int64_t>(ids.size())); }
  // Writes PREFIX.idx (to a temporary name first, so that a reader never sees a partial index).
  void finish();
  int64_t documents() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t tokens() const { return tokens_; }

 private:
  std::string prefix_;
  TokenType type_;
  std::ofstream bin_;
  std::vector<int32_t> sizes_;
  std::vector<char> buffer_;
  int64_t tokens_ = 0;
};

// PREFIX.idx and PREFIX.bin, validated and mapped read-only.
class IndexedDataset {
 public:
  // Throws std::runtime_error naming the file for a missing file, a wrong magic or version, an
  // unknown dtype code, an .idx whose length disagrees with its counts (truncated or extended),
  // sizes or pointers that do not describe the .bin back to back, doc_idx not running from 0 to
  // the sequence count, or a .bin of another length than the sizes add up to.
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  int64_t sequences() const { return sequences_; }
  int64_t documents() const { return doc_count_ - 1; }
  int64_t tokens() const { return tokens_; }
  TokenType type() const { return type_; }
  int32_t size(int64_t i) const;     // tokens of sequence i
  int64_t pointer(int64_t i) const;  // its byte offset in the .bin
  int64_t doc_index(int64_t i) const;
  // Tokens [first, first + n) of the whole stream (the sequences back to back) into out.
  void read(int64_t first, int64_t n, int64_t* out) const;
  const std::string& prefix() const { return prefix_; }

 private:
  std::string prefix_;
  TokenType type_ = TokenType::kUint16;
  int64_t sequences_ = 0, doc_count_ = 0, tokens_ = 0;
  const char* idx_ = nullptr;
  size_t idx_len_ = 0;
  const char* bin_ = nullptr;
  size_t bin_len_ = 0;
  const int32_t* sizes_ = nullptr;
  const int64_t* pointers_ = nullptr;
  const int64_t* doc_idx_ = nullptr;
};

// Megatron's GPT samples without its shuffling: the token stream cut into windows of seq + 1
// tokens that overlap by one (window w: tokens [w * seq, (w + 1) * seq]), seq inputs and their
// next tokens; (tokens - 1) / seq of them. Documents run across window edges; the model tells
// them apart by their EOS (llama::document_layout).
class PackedWindows {
 public:
  PackedWindows(const IndexedDataset& data, int64_t seq);  // std::invalid_argument: no whole window
  int64_t size() const { return windows_; }
  int64_t seq() const { return seq_; }
  // Window w's seq + 1 ids into out; throws std::runtime_error naming the file and the offset for
  // an id at or above `vocab_size` (> 0).
  void window(int64_t w, int64_t* out, int64_t vocab_size = 0) const;

 private:
  const IndexedDataset& data_;
  int64_t seq_, windows_;
};

// The description written beside a preprocessed dataset (DIR/dataset.json): which tokenizer made
// the ids and how many there are, so that training refuses a model whose tokenizer differs.
struct DatasetInfo {
  std::string prefix = "text_document";  // DIR/PREFIX.bin, DIR/PREFIX.idx
  std::string tokenizer_dir;             // the model directory whose tokenizer encoded it
  int64_t vocab_size = 0, eos = -1, bos = -1;
  std::string source;  // the JSON lines file
  int64_t documents = 0, tokens = 0;
  TokenType type = TokenType::kUint16;
};
constexpr const char* kDatasetInfoFile = "dataset.json";
void write_dataset_info(const std::string& dir, const DatasetInfo& info);
// Throws std::runtime_error naming DIR/dataset.json when it is missing or malformed (with the
// command that makes it).
DatasetInfo read_dataset_info(const std::string& dir);

}  // namespace tandem::data
