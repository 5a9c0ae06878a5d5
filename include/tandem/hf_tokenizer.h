// The tokenizer of a Hugging Face model directory that ships a SentencePiece tokenizer.model
// (Llama 1/2, Mistral and similar), read with libsentencepiece, with its special tokens (BOS,
// EOS, PAD, UNK) and whether encoding adds BOS/EOS taken from the directory's configuration
// files the way transformers reads them. Ids are those of transformers' tokenizer for the same
// directory; every error names the file at fault and what to do.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::hf {

// Special token ids (-1: the model has none) and the encoding convention.
struct SpecialTokens {
  int64_t bos = -1, eos = -1, pad = -1, unk = -1;
  bool add_bos = true;   // encode(text) starts with bos (Llama's default)
  bool add_eos = false;  // encode(text) ends with eos
};

// Where each special token comes from, first found wins:
//   1. tokenizer_config.json: bos_token / eos_token / pad_token / unk_token (a string or
//      {"content": ...}), looked up in its added_tokens_decoder, then in the SentencePiece
//      pieces; add_bos_token / add_eos_token.
//   2. special_tokens_map.json: the same token fields.
//   3. tokenizer.json: add_bos / add_eos from its post_processor's "single" template.
//   4. config.json, then generation_config.json: bos_token_id / eos_token_id / pad_token_id (the
//      first of a list).
//   5. The SentencePiece model's own bos/eos/pad/unk ids.
// Missing files are skipped. `piece_to_id` returns -1 for a piece the vocabulary lacks.
// Throws std::runtime_error naming the file for malformed JSON, a token the vocabulary lacks,
// or an id outside [0, vocab_size).
SpecialTokens read_special_tokens(const std::string& dir, int64_t vocab_size,
                                  const std::function<int64_t(const std::string&)>& piece_to_id,
                                  const SpecialTokens& model_defaults);

class Tokenizer {
 public:
  // DIR/tokenizer.model and the configuration files beside it. Throws std::runtime_error naming
  // the path when the directory or tokenizer.model is missing, the model is not a SentencePiece
  // model (e.g. a Git LFS pointer, or a tokenizer.json-only model), or a configuration file is
  // malformed; or when Tandem was built without SentencePiece.
  static Tokenizer load(const std::string& dir);
  Tokenizer();
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  int64_t vocab_size() const;
  const SpecialTokens& special() const { return special_; }
  // The ids of `text` (UTF-8, newlines and tabs kept), with bos/eos as special() says when
  // `add_special`.
  std::vector<int64_t> encode(std::string_view text, bool add_special = true) const;
  std::string decode(const std::vector<int64_t>& ids) const;  // special tokens dropped
  const std::string& dir() const { return dir_; }

  // The tokenizer files a Hugging Face directory may hold (copied with a model on export).
  static const std::vector<std::string>& file_names();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  SpecialTokens special_;
  std::string dir_;
};

}  // namespace tandem::hf
