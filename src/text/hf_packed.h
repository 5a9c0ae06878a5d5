// The training samples of `tandem finetune --init-from MODEL --data DIR` and `tandem pretrain
// --data DIR` (a preprocessed dataset, tandem/preprocess.h): packed windows read by mmap, as
// batches for the text loops. Private to src/text.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/hf_finetune.h"
#include "tandem/hf_tokenizer.h"
#include "tandem/indexed_dataset.h"
#include "tandem/llama.h"

namespace tandem::text {

// What a model trains on: the dataset directory, window length, the model's vocabulary (ids at or
// above it are refused) and the EOS that ends documents; record: --data-record's prefix or "".
struct PackedSource {
  std::string dir;
  int64_t seq = 0, vocab = 0, eos = -1;
  std::string record;
};

// Throws std::invalid_argument naming `what` (the dataset) for a layout whose later ranks cannot
// see the document boundaries: --pp above 1 (later stages get activations, not ids), --cp above 1
// (ring attention does not mask documents).
void refuse_unmasked_layouts(const ParallelConfig& pc, const std::string& what);

class PackedSet {
 public:
  // Opens the dataset: std::runtime_error naming the directory for a missing or corrupt one.
  PackedSet(const PackedSource& src, int rank);
  // Checks the run against the dataset and opens it. Throws std::invalid_argument naming the flag
  // for a layout that cannot see the document boundaries (--pp above 1, --cp above 1) or --task
  // classify, std::runtime_error naming the directory for a missing or corrupt dataset or one made
  // by another tokenizer.
  PackedSet(const HfFinetuneConfig& cfg, const hf::Tokenizer& tok, const llama::LlamaConfig& mc, int rank);
  int64_t size() const { return windows_->size(); }
  // Rows [from, to) of the global batch `idx` (window numbers): ids [rows, seq] and their next
  // tokens; every target counts (Megatron's loss, EOS predicting the next document's first token).
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& idx, int64_t from, int64_t to);
  double terms(const std::vector<int64_t>& idx, int64_t from, int64_t to) const {
    return static_cast<double>((to - from) * windows_->seq());
  }
  torch::Tensor sample();  // the first window's ids [1, seq] (--pp-partition time)
  // What a resumed run must match: the windows (count, seq) and the dataset's counts.
  nlohmann::json identity() const;
  std::string describe() const;
  const data::DatasetInfo& info() const { return info_; }
  // Where the loop starts (its first step and the sampler's position), for the record.
  void start(int64_t first_step, int64_t first_sample, int64_t global_batch) {
    step_ = first_step;
    next_sample_ = first_sample;
    global_batch_ = global_batch;
  }

 private:
  void record(const std::vector<int64_t>& idx, int64_t from, int64_t to, const torch::Tensor& ids);
  data::DatasetInfo info_;
  std::string dir_;
  std::unique_ptr<data::IndexedDataset> data_;
  std::unique_ptr<data::PackedWindows> windows_;
  int64_t vocab_ = 0, eos_ = -1;
  std::unique_ptr<std::ofstream> record_;
  int64_t next_sample_ = 0, global_batch_ = 0, step_ = 0;
};

}  // namespace tandem::text
