// The SentencePiece tokenizer wrapper (optional: built when libsentencepiece-dev is found).
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "tandem/text.h"
#include "tandem_build_config.h"

#if TANDEM_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#endif

namespace tandem::text {

bool have_sentencepiece() { return TANDEM_HAVE_SENTENCEPIECE != 0; }

namespace {

// Newlines and tabs become spaces: SentencePiece treats its input as one line.
std::string one_line(std::string_view s) {
  std::string out(s);
  for (auto& ch : out) {
    if (ch == '\n' || ch == '\r' || ch == '\t') ch = ' ';
  }
  return out;
}

#if !TANDEM_HAVE_SENTENCEPIECE
[[noreturn]] void no_sentencepiece() {
  throw std::runtime_error("this tandem was built without SentencePiece; install libsentencepiece-dev (apt-get install "
                           "libsentencepiece-dev), re-run cmake and rebuild");
}
#endif

}  // namespace

struct Tokenizer::Impl {
#if TANDEM_HAVE_SENTENCEPIECE
  sentencepiece::SentencePieceProcessor sp;
#endif
  std::string serialized;
};

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

#if TANDEM_HAVE_SENTENCEPIECE
namespace {

class VectorIterator : public sentencepiece::SentenceIterator {
 public:
  explicit VectorIterator(const std::vector<std::string>& v) : v_(v) {}
  bool done() const override { return i_ >= v_.size(); }
  void Next() override { ++i_; }
  const std::string& value() const override { return v_[i_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<std::string>& v_;
  size_t i_ = 0;
};

}  // namespace
#endif

Tokenizer Tokenizer::train(const std::vector<std::string>& texts, const TokenizerOptions& o) {
#if TANDEM_HAVE_SENTENCEPIECE
  if (o.vocab_size < 8)
    throw std::invalid_argument("tokenizer vocabulary must be >= 8, got " + std::to_string(o.vocab_size));
  if (texts.empty()) throw std::runtime_error("no training text for the tokenizer");
  // A deterministic sample of at most max_sentences documents.
  std::vector<size_t> order(texts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (o.max_sentences > 0 && static_cast<int64_t>(order.size()) > o.max_sentences) {
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return fnv1a64(texts[a]) + o.seed < fnv1a64(texts[b]) + o.seed; });
    order.resize(o.max_sentences);
    std::sort(order.begin(), order.end());
  }
  std::vector<std::string> lines;
  lines.reserve(order.size());
  for (size_t i : order) lines.push_back(one_line(texts[i]));
  std::ostringstream args;
  args << "--model_type=" << o.model_type << " --vocab_size=" << o.vocab_size
       << " --character_coverage=" << o.character_coverage
       << " --pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3 --num_threads=1 --minloglevel=2"
       << " --max_sentence_length=16384 --hard_vocab_limit=true --shuffle_input_sentence=false"
       << " --seed_sentencepiece_size=200000";
  VectorIterator it(lines);
  Tokenizer t;
  t.impl_ = std::make_unique<Impl>();
  auto st = sentencepiece::SentencePieceTrainer::Train(args.str(), &it, &t.impl_->serialized);
  if (!st.ok()) {
    throw std::runtime_error(
        "training the SentencePiece tokenizer (vocabulary " + std::to_string(o.vocab_size) + ") on " +
        std::to_string(lines.size()) + " documents failed: " + st.ToString() +
        (st.ToString().find("vocab_size") != std::string::npos ? "; use a smaller --vocab or more text" : ""));
  }
  st = t.impl_->sp.LoadFromSerializedProto(t.impl_->serialized);
  if (!st.ok()) throw std::runtime_error("loading the trained tokenizer failed: " + st.ToString());
  return t;
#else
  no_sentencepiece();
#endif
}

Tokenizer Tokenizer::load(const std::string& path) {
#if TANDEM_HAVE_SENTENCEPIECE
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("tokenizer '" + path + "' not found or unreadable");
  std::ostringstream ss;
  ss << f.rdbuf();
  Tokenizer t;
  t.impl_ = std::make_unique<Impl>();
  t.impl_->serialized = ss.str();
  auto st = t.impl_->sp.LoadFromSerializedProto(t.impl_->serialized);
  if (!st.ok()) {
    throw std::runtime_error("'" + path + "' is not a SentencePiece model (" + st.ToString() + ")");
  }
  const auto& sp = t.impl_->sp;
  if (sp.unk_id() < 0 || sp.bos_id() < 0 || sp.eos_id() < 0) {
    throw std::runtime_error("tokenizer '" + path + "' has no unk, bos or eos piece (unk " +
                             std::to_string(sp.unk_id()) + ", bos " + std::to_string(sp.bos_id()) + ", eos " +
                             std::to_string(sp.eos_id()) + "); let tandem pretrain train one");
  }
  t.pad_ = sp.pad_id() >= 0 ? sp.pad_id() : sp.unk_id();
  t.bos_ = sp.bos_id();
  t.eos_ = sp.eos_id();
  return t;
#else
  no_sentencepiece();
#endif
}

void Tokenizer::save(const std::string& path) const {
  if (!impl_) throw std::logic_error("Tokenizer::save: empty tokenizer");
  std::ofstream f(path, std::ios::binary);
  f.write(impl_->serialized.data(), static_cast<std::streamsize>(impl_->serialized.size()));
  if (!f) throw std::runtime_error("writing the tokenizer to '" + path + "' failed");
}

int64_t Tokenizer::vocab_size() const {
#if TANDEM_HAVE_SENTENCEPIECE
  return impl_ ? impl_->sp.GetPieceSize() : 0;
#else
  return 0;
#endif
}

std::string Tokenizer::fingerprint() const {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx",
                static_cast<unsigned long long>(fnv1a64(impl_ ? impl_->serialized : std::string())));
  return buf;
}

std::vector<int64_t> Tokenizer::encode(std::string_view text) const {
#if TANDEM_HAVE_SENTENCEPIECE
  if (!impl_) throw std::logic_error("Tokenizer::encode: empty tokenizer");
  std::vector<int> ids;
  auto st = impl_->sp.Encode(one_line(text), &ids);
  if (!st.ok()) throw std::runtime_error("tokenizing failed: " + st.ToString());
  return std::vector<int64_t>(ids.begin(), ids.end());
#else
  no_sentencepiece();
#endif
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
#if TANDEM_HAVE_SENTENCEPIECE
  if (!impl_) throw std::logic_error("Tokenizer::decode: empty tokenizer");
  std::vector<int> v(ids.begin(), ids.end());
  std::string out;
  auto st = impl_->sp.Decode(v, &out);
  if (!st.ok()) throw std::runtime_error("detokenizing failed: " + st.ToString());
  return out;
#else
  no_sentencepiece();
#endif
}

Encoded Tokenizer::encode_batch(const std::vector<std::string>& texts, int64_t seq) const {
  if (seq < 2) throw std::invalid_argument("sequence length must be >= 2, got " + std::to_string(seq));
  const int64_t n = static_cast<int64_t>(texts.size());
  auto ids = torch::full({n, seq}, pad_id(), torch::kLong);
  auto mask = torch::zeros({n, seq}, torch::kLong);
  auto* pi = ids.data_ptr<int64_t>();
  auto* pm = mask.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    auto pieces = encode(texts[i]);
    int64_t t = 0;
    pi[i * seq + t++] = bos_id();
    for (size_t k = 0; k < pieces.size() && t < seq; ++k) pi[i * seq + t++] = pieces[k];
    if (t < seq) pi[i * seq + t++] = eos_id();
    for (int64_t k = 0; k < t; ++k) pm[i * seq + k] = 1;
  }
  return {ids, mask};
}

}  // namespace tandem::text
