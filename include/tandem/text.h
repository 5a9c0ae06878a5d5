// Text classification end to end: a reader for labelled plain-text corpora (Debian's fortune
// cookies: documents separated by lines holding only '%', one folder per language), a
// deterministic train/validation/test split by a hash of each document's text, a SentencePiece
// tokenizer trained on the training split, and the loops behind `tandem pretrain` (causal LM)
// and `tandem finetune` (classification) under single, ddp and zero1-3, in fp32, bf16 or fp16,
// with tensor (--tp) and pipeline (--pp) parallelism over ddp or zero1-3 replicas. Every error
// names the file or setting at fault and what to do.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/engine.h"
#include "tandem/report.h"
#include "tandem/runtime.h"

namespace tandem::text {

// ---- corpus

struct Document {
  std::string text;    // UTF-8, whitespace-trimmed, never empty
  std::string label;   // language ("en", "de", ...) or category (the file's name)
  std::string source;  // the file it came from
};

enum class Split { kTrain, kValid, kTest };
const char* to_string(Split s);

struct CorpusOptions {
  // Directory of cookie files. Files directly in it have label `root_label`; each
  // subdirectory is a label of its own (files found recursively). Skipped: symlinks (Debian's
  // aliases and .u8 links), *.dat index files, empty files and the folders in `skip_dirs`
  // (rot13 "off" cookies).
  std::string root = "/usr/share/games/fortunes";
  std::string root_label = "en";
  std::vector<std::string> skip_dirs = {"off", "cz", "sk"};  // cz and sk: links to cs
  // "language": label = the subdirectory; "category": only the root's own files, label = the
  // file name (the harder task).
  std::string task = "language";
  double valid_fraction = 0.05;
  double test_fraction = 0.10;
  // Keep at most this many documents of each label (the first by hash order, so the choice
  // is deterministic and independent of file order); -1: all.
  int64_t max_per_label = -1;
  int64_t min_chars = 2;     // shorter documents are dropped
  int64_t max_chars = 4000;  // longer ones are dropped (ASCII art, long texts)
};

struct Corpus {
  std::vector<Document> train, valid, test;
  std::vector<std::string> labels;           // sorted; a label's index is its class id
  std::map<std::string, int64_t> per_label;  // documents kept per label (all splits)
  int64_t files = 0, duplicates = 0, dropped = 0;
  int64_t label_index(const std::string& label) const;  // -1 when unknown
};

// True when `s` is well-formed UTF-8 (no overlong forms, surrogates or code points > U+10FFFF).
// On failure *bad_offset (when given) is the offset of the first bad byte.
bool is_valid_utf8(std::string_view s, size_t* bad_offset = nullptr);

// Splits a fortune file's text into documents: a line holding only '%' separates them (a
// trailing '\r' is ignored); each document is trimmed and empty ones are dropped.
std::vector<std::string> split_documents(std::string_view text);

// 64-bit FNV-1a of the bytes: stable across machines and runs.
uint64_t fnv1a64(std::string_view s);

// Which split a document belongs to, from the hash of its text alone (so a duplicate can never
// land in two splits and adding files does not move existing documents).
Split split_of(std::string_view text, double valid_fraction, double test_fraction);

// Reads, checks, deduplicates (by text, across all files and labels) and splits. Throws
// std::runtime_error naming the file for a binary file (NUL bytes) or one that is not UTF-8,
// naming the directory when it is missing or holds no documents, and std::invalid_argument
// for bad options.
Corpus read_corpus(const CorpusOptions& opts);

// ---- tokenizer

// True when Tandem was built with SentencePiece (libsentencepiece-dev).
bool have_sentencepiece();
// True when `dir` is the output of tandem preprocess (it holds dataset.json and
// text_document.idx): tandem pretrain --data then trains on its packed windows.
bool is_preprocessed_dataset(const std::string& dir);

struct TokenizerOptions {
  int64_t vocab_size = 2000;
  std::string model_type = "unigram";  // unigram | bpe
  double character_coverage = 0.9995;
  int64_t max_sentences = 20000;  // training documents sampled (deterministically) at most
  uint64_t seed = 0;
};

struct Encoded {
  at::Tensor ids;   // int64 [N, seq]: bos, pieces, eos, then pad_id (right-padded, truncated)
  at::Tensor mask;  // int64 [N, seq]: 1 for a real token, 0 for padding
};

// A SentencePiece model. Ids of the ones tandem trains: pad 0, unk 1, bos 2, eos 3, pieces from
// 4; a loaded model keeps its own (a Llama tokenizer.model: unk 0, bos 1, eos 2, no pad piece,
// whose padding then uses the unk id: byte-fallback models never emit it). Newlines and tabs are
// encoded as spaces.
class Tokenizer {
 public:
  // Trains on `texts` and keeps the model in memory (save() writes it). Throws
  // std::runtime_error with SentencePiece's message when training fails (e.g. too few
  // distinct characters for the vocabulary size) or when built without SentencePiece.
  static Tokenizer train(const std::vector<std::string>& texts, const TokenizerOptions& opts);
  // Loads a model file written by save(), or another SentencePiece model with unk, bos and eos
  // pieces. Throws std::runtime_error naming the file.
  static Tokenizer load(const std::string& path);
  Tokenizer();
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  void save(const std::string& path) const;
  int64_t vocab_size() const;
  int64_t pad_id() const { return pad_; }
  int64_t bos_id() const { return bos_; }
  int64_t eos_id() const { return eos_; }
  // fnv1a64 of the serialized model, as 16 hex digits: identifies the tokenizer in a checkpoint.
  std::string fingerprint() const;
  std::vector<int64_t> encode(std::string_view text) const;  // pieces only, no bos/eos
  std::string decode(const std::vector<int64_t>& ids) const;
  Encoded encode_batch(const std::vector<std::string>& texts, int64_t seq) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t pad_ = 0, bos_ = 2, eos_ = 3;
};

// ---- checkpoint directory: model.pt (torch::save of the named parameters), tokenizer.model,
// manifest.json (kind, model config, tokenizer file, vocabulary and fingerprint, labels).

struct ModelShape {
  int64_t vocab = 2000, d_model = 64, heads = 4, layers = 2, seq = 64, mlp_ratio = 4;
};

struct Manifest {
  std::string kind;  // "pretrain" | "finetune"
  ModelShape shape;
  std::string task;
  std::vector<std::string> labels;
  std::string tokenizer_file = "tokenizer.model";
  std::string tokenizer_fingerprint;
  int64_t tokenizer_vocab = 0;
  int64_t steps = 0;
};

void write_manifest(const std::string& dir, const Manifest& m);
// Throws std::runtime_error naming the file when it is missing or malformed.
Manifest read_manifest(const std::string& dir);

// ---- training

// Periodic checkpoints of a text loop, through the Engine (tandem/checkpoint.h: sharded, atomic,
// loadable under any layout and worker count). A checkpoint records the steps done and the
// sampler position (global samples drawn), so a resumed run draws the same batches and follows
// the same learning-rate schedule as one never stopped, whatever its worker count.
struct TextCheckpoints {
  std::string dir;        // step-N/ checkpoints; "": none
  int64_t every = 0;      // save every N steps; 0: only at the end (when dir is given)
  int keep = 0;           // keep the newest K complete checkpoints; 0: all
  bool async = false;     // write them on a background thread while training continues (needs every > 0)
  bool resume = false;    // continue from the newest complete checkpoint in dir (none there: from step 0)
  std::string stop_file;  // elastic runs: end at the next checkpoint when this file exists (and delete it)
  // Elastic runs with --elastic-lr scale: a resume may find another global batch (the sampler
  // continues by samples drawn); otherwise a resume needs the checkpoint's batch.
  bool batch_may_change = false;
};

// The text loops' layout unless told otherwise: single, one micro-batch per step.
ParallelConfig default_text_parallel();

struct TextTrainConfig {
  CorpusOptions corpus;
  TokenizerOptions tokenizer;
  ModelShape shape;
  std::string checkpoint;      // pretrain: written here; finetune: read from here
  std::string output;          // finetune: fine-tuned model written here (empty: not saved)
  std::string tokenizer_path;  // finetune: a tokenizer other than the checkpoint's (checked)
  bool from_scratch = false;   // finetune: random initialisation (needs a tokenizer)
  // The layout and its numerics (tandem/engine.h; checked by tandem::validate): one worker,
  // no pipeline micro-batching unless told otherwise.
  ParallelConfig parallel = default_text_parallel();
  int64_t batch = 32;  // global batch, split evenly over the ranks
  int64_t steps = 200;
  double lr = 1e-3;  // AdamW, linear warmup then cosine decay to 10%
  double weight_decay = 0.01;
  int64_t warmup_steps = 20;
  uint64_t seed = 0;
  int64_t eval_limit = -1;  // test documents evaluated at most; -1: all
  bool evaluate = true;
  bool progress = true;
  int64_t log_every = 50;
  double baseline_samples_per_second = 0.0;  // one worker's, for the speedup figure
  std::string trace;                         // Chrome trace-event timeline of the loop (tandem/trace.h); "": none
  std::string metrics_path;                  // JSON lines: per-step loss and time, then the report (tandem/report.h)
  std::string tensorboard;  // TensorBoard event files of the same figures (tandem/tensorboard.h); "": none
  // pretrain on a preprocessed dataset: each rank appends what it trained on to
  // PREFIX.rankR.jsonl (step, samples, windows, ids, positions); "": none.
  std::string data_record;
  TextCheckpoints checkpoints;
};

// The one report (tandem/report.h), with what the text commands know besides: the model's
// shape, the corpus and, for classification, the confusion table.
struct TextReport : Report {
  ModelShape shape;  // as trained (vocab: the tokenizer's)
  std::vector<std::string> labels;
  std::vector<std::vector<int64_t>> confusion;  // [true][predicted]
  int64_t train_documents = 0, valid_documents = 0, test_documents = 0;
  bool initialised_from_checkpoint = false;
  // Ended at a checkpoint because TextCheckpoints::stop_file asked (no evaluation, no --out).
  bool stopped = false;
};

// Checks the configuration without reading anything (strategy, precision, the tp x pp layout
// against the world size, batch and micro-batches); throws std::invalid_argument.
void validate(const TextTrainConfig& cfg, int world);

// Causal LM pre-training. Rank 0 reads the corpus, trains the tokenizer on the training split
// (unless cfg.checkpoint already holds one) and writes it; then every rank trains; rank 0
// writes the checkpoint. Collective: every rank calls it with the same config.
TextReport pretrain(Runtime& rt, const TextTrainConfig& cfg);

// Classification fine-tuning from cfg.checkpoint (or from scratch). Throws
// std::runtime_error when the tokenizer does not match the checkpoint or the corpus's label
// set differs from the checkpoint's. Collective.
TextReport finetune(Runtime& rt, const TextTrainConfig& cfg);

}  // namespace tandem::text
