// Packed windows of a preprocessed dataset as the batches of tandem finetune --init-from.
#include "text/hf_packed.h"

#include <sys/stat.h>

#include <stdexcept>

#include "tandem/text.h"

namespace tandem::text {

bool is_preprocessed(const std::string& data) {
  struct stat st {};
  return ::stat(data.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void refuse_unmasked_layouts(const ParallelConfig& pc, const std::string& what) {
  if (pc.pp > 1) {
    throw std::invalid_argument(what + " whose attention and positions restart at each EOS, which the stages of --pp " +
                                std::to_string(pc.pp) +
                                " after the first cannot see (they get activations, not token ids); use --pp 1 (with "
                                "--tp or a ZeRO strategy for memory)");
  }
  if (pc.cp > 1) {
    throw std::invalid_argument(what + " whose attention restarts at each EOS, which ring attention under --cp " +
                                std::to_string(pc.cp) + " does not mask; use --cp 1");
  }
}

bool is_preprocessed_dataset(const std::string& dir) {
  struct stat st {};
  const auto has = [&](const std::string& f) { return ::stat((dir + "/" + f).c_str(), &st) == 0; };
  return is_preprocessed(dir) && has(data::kDatasetInfoFile) && has("text_document.idx");
}

PackedSet::PackedSet(const PackedSource& src, int rank) : dir_(src.dir), vocab_(src.vocab), eos_(src.eos) {
  info_ = data::read_dataset_info(dir_);
  data_ = std::make_unique<data::IndexedDataset>(dir_ + "/" + info_.prefix);
  if (data_->tokens() != info_.tokens || data_->sequences() != info_.documents) {
    throw std::runtime_error("--data '" + dir_ + "': the index holds " + std::to_string(data_->sequences()) +
                             " documents of " + std::to_string(data_->tokens()) + " tokens, " + data::kDatasetInfoFile +
                             " says " + std::to_string(info_.documents) + " of " + std::to_string(info_.tokens) +
                             "; preprocess again");
  }
  windows_ = std::make_unique<data::PackedWindows>(*data_, src.seq);
  if (!src.record.empty()) {
    const auto path = src.record + ".rank" + std::to_string(rank) + ".jsonl";
    record_ = std::make_unique<std::ofstream>(path, std::ios::app);
    if (!*record_) throw std::runtime_error("--data-record: cannot write '" + path + "'");
  }
}

PackedSet::PackedSet(const HfFinetuneConfig& cfg, const hf::Tokenizer& tok, const llama::LlamaConfig& mc, int rank)
    : PackedSet(PackedSource{cfg.data, cfg.seq, mc.vocab_size, tok.special().eos, cfg.data_record}, rank) {
  const std::string what = "--data '" + cfg.data + "' (a preprocessed dataset) packs documents into windows";
  if (cfg.task != HfTask::kLm) {
    throw std::invalid_argument(what + ", for --task lm; classification reads a JSON lines file");
  }
  refuse_unmasked_layouts(cfg.loop.parallel, what);
  if (info_.vocab_size != tok.vocab_size() || info_.eos != eos_) {
    throw std::runtime_error("--data '" + dir_ + "' was tokenized by '" + info_.tokenizer_dir + "' (vocabulary " +
                             std::to_string(info_.vocab_size) + ", EOS " + std::to_string(info_.eos) + "), not by '" +
                             cfg.model_dir + "' (vocabulary " + std::to_string(tok.vocab_size()) + ", EOS " +
                             std::to_string(eos_) + "); preprocess the text again with --init-from " + cfg.model_dir);
  }
}

std::pair<torch::Tensor, torch::Tensor> PackedSet::batch(const std::vector<int64_t>& idx, int64_t from, int64_t to) {
  const int64_t seq = windows_->seq(), rows = to - from;
  auto buf = torch::empty({rows, seq + 1}, torch::kLong);
  auto* p = buf.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) windows_->window(idx[from + r], p + r * (seq + 1), vocab_);
  auto ids = buf.narrow(1, 0, seq).contiguous(), targets = buf.narrow(1, 1, seq).contiguous();
  if (record_) record(idx, from, to, ids);
  return {ids, targets};
}

void PackedSet::record(const std::vector<int64_t>& idx, int64_t from, int64_t to, const torch::Tensor& ids) {
  nlohmann::json samples = nlohmann::json::array(), windows = nlohmann::json::array();
  for (int64_t k = from; k < to; ++k) {
    samples.push_back(next_sample_ + k);
    windows.push_back(idx[k]);
  }
  auto to_json = [](const torch::Tensor& t) {
    nlohmann::json rows = nlohmann::json::array();
    for (int64_t r = 0; r < t.size(0); ++r) {
      const auto* p = t[r].contiguous().data_ptr<int64_t>();
      rows.push_back(std::vector<int64_t>(p, p + t.size(1)));
    }
    return rows;
  };
  const auto positions = llama::document_layout(ids, eos_).positions;
  *record_ << nlohmann::json{{"step", step_},
                             {"samples", samples},
                             {"windows", windows},
                             {"ids", to_json(ids)},
                             {"positions", to_json(positions)}}
                  .dump()
           << '\n'
           << std::flush;
  next_sample_ += global_batch_;
  ++step_;
}

torch::Tensor PackedSet::sample() {
  auto buf = torch::empty({1, windows_->seq() + 1}, torch::kLong);
  windows_->window(0, buf.data_ptr<int64_t>(), vocab_);
  return buf.narrow(1, 0, windows_->seq()).contiguous();
}

nlohmann::json PackedSet::identity() const {
  return {{"windows", windows_->size()},
          {"seq", windows_->seq()},
          {"documents", info_.documents},
          {"tokens", info_.tokens}};
}

std::string PackedSet::describe() const {
  return std::to_string(windows_->size()) + " packed windows of " + std::to_string(windows_->seq()) + " + 1 tokens (" +
         std::to_string(info_.documents) + " documents, " + std::to_string(info_.tokens) + " tokens, " +
         data::to_string(info_.type) + ", mmap) from " + dir_ + "; no validation split";
}

}  // namespace tandem::text
