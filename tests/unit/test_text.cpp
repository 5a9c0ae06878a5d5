// The text pipeline's pieces: UTF-8 checks, document splitting, the corpus reader (labels,
// deduplication, a hash split that is deterministic and never leaks a duplicate), the
// SentencePiece wrapper (padding, masks, save/load, fingerprints) and the padded transformer
// (padding never changes what the real tokens compute), and the checks of precision and layout.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include "tandem/models.h"
#include "tandem/text.h"

namespace fs = std::filesystem;
using namespace tandem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("tandem_text_" + std::to_string(::getpid()) + "_" + std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(path);
  }
  // Not fs::remove_all: libtorch.so exports a std::filesystem::remove_all of its own that
  // crashes when it wins symbol resolution (seen with torch 2.11).
  ~TempDir() { (void)std::system(("rm -rf '" + path.string() + "'").c_str()); }
  void write(const std::string& rel, const std::string& bytes) const {
    fs::create_directories((path / rel).parent_path());
    std::ofstream(path / rel, std::ios::binary) << bytes;
  }
};

std::string cookies(const std::string& stem, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += stem + " number " + std::to_string(i) + " says hello.\n%\n";
  return s;
}

}  // namespace

TEST(TextUtf8, AcceptsValidRejectsInvalid) {
  EXPECT_TRUE(text::is_valid_utf8("plain ascii"));
  EXPECT_TRUE(text::is_valid_utf8("Zażółć gęślą jaźń, Привет, 😀"));
  size_t at = 99;
  EXPECT_FALSE(text::is_valid_utf8("ok\xff", &at));
  EXPECT_EQ(at, 2u);
  EXPECT_FALSE(text::is_valid_utf8("caf\xe9 au lait", &at));  // Latin-1 é
  EXPECT_EQ(at, 3u);
  EXPECT_FALSE(text::is_valid_utf8("\xc0\xaf"));          // overlong '/'
  EXPECT_FALSE(text::is_valid_utf8("\xed\xa0\x80"));      // surrogate
  EXPECT_FALSE(text::is_valid_utf8("\xf4\x90\x80\x80"));  // > U+10FFFF
  EXPECT_FALSE(text::is_valid_utf8("\xe2\x82"));          // truncated
}

TEST(TextSplit, SeparatorLinesOnly) {
  auto d = text::split_documents("first\nline two\n%\n  second 100%\n%\r\n\n%\nthird");
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0], "first\nline two");
  EXPECT_EQ(d[1], "second 100%");  // a '%' inside a line is text
  EXPECT_EQ(d[2], "third");
  EXPECT_TRUE(text::split_documents("%\n%\n  \n%").empty());
}

TEST(TextSplit, HashSplitIsStableAndRoughlyProportional) {
  EXPECT_EQ(text::fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(text::fnv1a64("a"), 0xaf63dc4c8601ec8cull);  // the published FNV-1a test vector
  int counts[3] = {0, 0, 0};
  for (int i = 0; i < 20000; ++i) {
    auto s = "document " + std::to_string(i);
    auto a = text::split_of(s, 0.05, 0.10);
    EXPECT_EQ(a, text::split_of(s, 0.05, 0.10));
    counts[static_cast<int>(a)]++;
  }
  EXPECT_NEAR(counts[0] / 20000.0, 0.85, 0.01);
  EXPECT_NEAR(counts[1] / 20000.0, 0.05, 0.01);
  EXPECT_NEAR(counts[2] / 20000.0, 0.10, 0.01);
}

TEST(TextCorpus, LabelsDedupSkipsAndSplit) {
  TempDir d;
  d.write("english", cookies("english cookie", 60) + "shared text\n%\n");
  d.write("english.dat", std::string("\0\0\1binary index", 16));  // skipped: .dat
  d.write("de/witze", cookies("deutscher Keks", 50) + "shared text\n%\n");
  d.write("de/empty", "");                                   // skipped: empty
  d.write("off/rot13", cookies("rot13 text", 10));           // skipped: off
  fs::create_symlink(d.path / "english", d.path / "alias");  // skipped: symlink
  text::CorpusOptions o;
  o.root = d.path.string();
  auto c = text::read_corpus(o);
  EXPECT_EQ(c.labels, (std::vector<std::string>{"de", "en"}));
  EXPECT_EQ(c.per_label.at("en"), 60);
  EXPECT_EQ(c.per_label.at("de"), 51);  // "shared text" kept once, by the first file in order: de/witze
  EXPECT_EQ(c.duplicates, 1);
  EXPECT_EQ(c.files, 2);
  EXPECT_EQ(c.train.size() + c.valid.size() + c.test.size(), 111u);
  // No document in two splits; same result on a second read.
  std::set<std::string> train;
  for (auto& x : c.train) train.insert(x.text);
  for (auto& x : c.test) EXPECT_EQ(train.count(x.text), 0u);
  auto c2 = text::read_corpus(o);
  ASSERT_EQ(c2.test.size(), c.test.size());
  for (size_t i = 0; i < c.test.size(); ++i) EXPECT_EQ(c.test[i].text, c2.test[i].text);
  // Per-label cap: deterministic, by hash.
  o.max_per_label = 20;
  auto c3 = text::read_corpus(o);
  EXPECT_EQ(c3.per_label.at("en"), 20);
  EXPECT_EQ(c3.per_label.at("de"), 20);
  // Category task: the root's files only, by name.
  o.max_per_label = -1;
  o.task = "category";
  auto c4 = text::read_corpus(o);
  EXPECT_EQ(c4.labels, (std::vector<std::string>{"english"}));
}

TEST(TextCorpus, BadInputIsNamed) {
  text::CorpusOptions o;
  {
    TempDir d;
    o.root = (d.path / "missing").string();
    EXPECT_THROW(text::read_corpus(o), std::runtime_error);
    o.root = d.path.string();
    d.write("empty", "");
    try {
      text::read_corpus(o);
      FAIL() << "an empty directory was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("no documents"), std::string::npos) << e.what();
    }
  }
  {
    TempDir d;
    o.root = d.path.string();
    d.write("good", cookies("fine", 30));
    d.write("de/latin1", "Gr\xfc\xdf Gott\n%\n");
    try {
      text::read_corpus(o);
      FAIL() << "Latin-1 text was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("latin1' is not UTF-8"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("offset 2"), std::string::npos) << e.what();
    }
  }
  {
    TempDir d;
    o.root = d.path.string();
    d.write("good", cookies("fine", 30));
    d.write("de/blob", std::string("ELF\0\0\0binary", 12));
    try {
      text::read_corpus(o);
      FAIL() << "a binary file was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("is binary"), std::string::npos) << e.what();
    }
  }
}

TEST(TextTokenizer, TrainsEncodesPadsAndRoundTrips) {
  if (!text::have_sentencepiece()) GTEST_SKIP() << "built without SentencePiece";
  std::vector<std::string> texts;
  const char* words[] = {"the",      "quick",  "brown", "fox",     "jumps", "over", "lazy",   "dog", "der",
                         "schnelle", "braune", "Fuchs", "springt", "über",  "den",  "faulen", "Hund"};
  for (int i = 0; i < 400; ++i) {
    std::string s;
    for (int k = 0; k < 8; ++k) s += std::string(words[(i * 7 + k * 3) % 17]) + (k == 3 ? "\n" : " ");
    texts.push_back(s);
  }
  text::TokenizerOptions o;
  o.vocab_size = 40;
  auto tok = text::Tokenizer::train(texts, o);
  EXPECT_EQ(tok.vocab_size(), 40);
  auto ids = tok.encode("the quick brown fox");
  ASSERT_FALSE(ids.empty());
  for (auto id : ids) EXPECT_GE(id, 4);  // pieces never collide with pad/unk/bos/eos... unless unknown
  EXPECT_EQ(tok.decode(ids), "the quick brown fox");

  auto enc = tok.encode_batch({"the dog", std::string(400, 'x') + " fox"}, 12);
  ASSERT_EQ(enc.ids.sizes(), (std::vector<int64_t>{2, 12}));
  auto row0 = enc.ids[0];
  auto n0 = enc.mask[0].sum().item<int64_t>();
  EXPECT_EQ(row0[0].item<int64_t>(), tok.bos_id());
  EXPECT_EQ(row0[n0 - 1].item<int64_t>(), tok.eos_id());
  EXPECT_EQ(n0, static_cast<int64_t>(tok.encode("the dog").size()) + 2);
  EXPECT_TRUE(row0.slice(0, 0, n0).ne(tok.pad_id()).all().item<bool>());
  EXPECT_TRUE(enc.mask[0].slice(0, n0, 12).eq(0).all().item<bool>());
  EXPECT_TRUE(row0.slice(0, n0, 12).eq(tok.pad_id()).all().item<bool>());
  EXPECT_EQ(enc.mask[1].sum().item<int64_t>(), 12);  // truncated: no room for eos, no padding

  TempDir d;
  const auto path = (d.path / "tok.model").string();
  tok.save(path);
  auto back = text::Tokenizer::load(path);
  EXPECT_EQ(back.fingerprint(), tok.fingerprint());
  EXPECT_EQ(back.encode("lazy dog"), tok.encode("lazy dog"));
  o.vocab_size = 35;
  EXPECT_NE(text::Tokenizer::train(texts, o).fingerprint(), tok.fingerprint());
  // Too large a vocabulary for the text: SentencePiece's reason, passed on.
  o.vocab_size = 5000;
  EXPECT_THROW(text::Tokenizer::train(texts, o), std::runtime_error);
  d.write("junk.model", "not a model");
  EXPECT_THROW(text::Tokenizer::load((d.path / "junk.model").string()), std::runtime_error);
  EXPECT_THROW(text::Tokenizer::load((d.path / "none.model").string()), std::runtime_error);
}

TEST(TextModel, PaddingDoesNotChangeRealTokens) {
  torch::manual_seed(3);
  models::TransformerConfig c;
  c.vocab = 50;
  c.d_model = 16;
  c.heads = 2;
  c.layers = 2;
  c.seq = 10;
  c.pad_id = 0;
  c.num_classes = 3;
  auto clf = models::transformer(c);
  c.num_classes = 0;
  auto lm = models::transformer(c);
  // The LM and the classifier differ only in the head (the last child).
  auto lp = lm->named_parameters(), cp = clf->named_parameters();
  for (auto& p : cp) {
    if (p.key().rfind(std::to_string(clf->size() - 1) + ".", 0) == 0) continue;
    EXPECT_TRUE(lp.contains(p.key())) << p.key();
  }
  // A document of 4 tokens, alone (T = 4) and right-padded to 10 with pad id 0.
  auto doc = torch::tensor({{5, 17, 9, 33}}, torch::kLong);
  auto padded = torch::cat({doc, torch::zeros({1, 6}, torch::kLong)}, 1);
  auto a = clf->forward(doc), b = clf->forward(padded);
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-6)) << a << b;
  auto la = lm->forward(doc), lb = lm->forward(padded).narrow(1, 0, 4);
  EXPECT_TRUE(torch::allclose(la, lb, 1e-5, 1e-6));
  // ... and the padding matters when it is not masked: a different (non-pad) filler changes it.
  auto filled = torch::cat({doc, torch::full({1, 6}, 7, torch::kLong)}, 1);
  EXPECT_FALSE(torch::allclose(clf->forward(filled), a, 1e-4, 1e-5));
  c.pad_id = 50;
  EXPECT_THROW(models::transformer(c), std::invalid_argument);
}

// The tp x pp layout of `tandem pretrain/finetune` is checked before anything is read, each
// error naming the flag at fault; every strategy but single composes with --tp and --pp.
TEST(TextConfig, PrecisionAndLayoutAreChecked) {
  auto fails_with = [](const text::TextTrainConfig& c, int world, const std::string& want) {
    try {
      text::validate(c, world);
      ADD_FAILURE() << "accepted; expected an error with '" << want << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  text::TextTrainConfig c;
  auto& p = c.parallel;
  EXPECT_EQ(p.strategy, Strategy::kSingle);  // the library's default: one worker
  EXPECT_EQ(p.micro_batches, 1);
  fails_with(c, 2, "strategy single runs one worker");
  p.strategy = Strategy::kDDP;
  p.precision = Precision::kBF16;
  EXPECT_NO_THROW(text::validate(c, 2));
  p.precision = Precision::kFP32;
  p.tp = 2;
  EXPECT_NO_THROW(text::validate(c, 2));
  EXPECT_NO_THROW(text::validate(c, 4));  // dp 2 x tp 2
  fails_with(c, 3, "does not divide the 3 workers");
  for (auto s : {Strategy::kZero1, Strategy::kZero2, Strategy::kZero3}) {
    p.strategy = s;  // ZeRO over the replicas of a tensor-parallel model
    EXPECT_NO_THROW(text::validate(c, 4)) << to_string(s);
  }
  p.strategy = Strategy::kSingle;
  fails_with(c, 2, "strategy single runs one worker");
  p.strategy = Strategy::kDDP;
  p.precision = Precision::kBF16;
  EXPECT_NO_THROW(text::validate(c, 2));  // 16-bit on a split model with DDP over the replicas
  p.precision = Precision::kFP16;
  EXPECT_NO_THROW(text::validate(c, 4));
  p.precision = Precision::kFP32;
  p.tp = 1;
  p.pp = 2;
  p.micro_batches = 3;
  fails_with(c, 2, "micro-batches");
  p.micro_batches = 2;
  EXPECT_NO_THROW(text::validate(c, 2));
  c.batch = 30;
  fails_with(c, 4, "not divisible into 2 micro-batches");  // dp 2 x pp 2: 15 samples per replica
}
