// `tandem preprocess`: a JSON lines corpus ({"text": ...} per line) tokenized once by a Hugging Face
// Llama directory's SentencePiece tokenizer into Megatron-LM's indexed dataset
// (tandem/indexed_dataset.h): DIR/text_document.bin and .idx, each document's ids followed by EOS
// (Megatron's --append-eod), and DIR/dataset.json naming the tokenizer. The input streams through
// in chunks tokenized by a pool of threads, so memory holds a few chunks and 12 bytes per
// document, whatever the corpus size.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "tandem/indexed_dataset.h"

namespace tandem::text {

struct PreprocessOptions {
  std::string model_dir;          // --init-from: whose tokenizer
  std::string data;               // the JSON lines file
  std::string out;                // the output directory (created)
  int threads = 0;                // tokenizing threads; 0: the machine's cores
  int64_t chunk_bytes = 4 << 20;  // input bytes a thread tokenizes at a time
  // Called after each chunk is written: input bytes done of the file's total, documents and tokens so far.
  std::function<void(int64_t bytes, int64_t total, int64_t documents, int64_t tokens)> progress;
};

// Throws std::runtime_error naming FILE:LINE for a line that is not {"text": "..."} (and what to
// do), the file when it is missing or holds no document, the model directory when its tokenizer
// has no EOS; std::invalid_argument for bad options.
data::DatasetInfo preprocess(const PreprocessOptions& opts);

}  // namespace tandem::text
