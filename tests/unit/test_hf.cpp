// tandem/hf_tokenizer.h: a Hugging Face directory's SentencePiece tokenizer gives the ids of
// transformers' tokenizer (tests/hf/hf_fixture.py in .venv-hf builds the directory), special
// tokens come from the configuration files in transformers' order, and bad directories are named.
// tandem/hf_finetune.h: a fine-tuned checkpoint exported to a Hugging Face directory gives, in
// transformers, the logits Tandem computes from the checkpoint.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "tandem/checkpoint.h"
#include "tandem/hf_finetune.h"
#include "tandem/hf_tokenizer.h"
#include "tandem/llama.h"
#include "tandem/runtime.h"
#include "tandem/safetensors.h"
#include "tandem/text.h"
#include "tests/hf/export_check.h"
#include "tests/unit/temp_dir.h"

using tandem::test::fixture_script;
using tandem::test::TempDir;
namespace hf = tandem::hf;

namespace {

void write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

// A SentencePiece model (pad 0, unk 1, bos 2, eos 3) in `dir`/tokenizer.model, trained here.
void write_sentencepiece(const std::string& dir) {
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i) {
    texts.push_back("the quick brown fox " + std::to_string(i) + " jumps over the lazy dog <s> [PAD]");
  }
  tandem::text::TokenizerOptions o;
  o.vocab_size = 60;
  tandem::text::Tokenizer::train(texts, o).save(dir + "/tokenizer.model");
}

// The .venv-hf interpreter, or "" (the reason in *why).
std::string hf_python(std::string* why) {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  const std::string python = std::string(src ? src : "") + "/.venv-hf/bin/python";
  if (!tandem::text::have_sentencepiece()) {
    *why = "built without SentencePiece";
  } else if (!src) {
    *why = "TANDEM_SOURCE_DIR unset (ctest sets it)";
  } else if (::access(python.c_str(), X_OK) != 0) {
    *why = python + " missing: run scripts/setup-hf-venv.sh";
  } else if (::access("/usr/share/games/fortunes", R_OK) != 0) {
    *why = "no fortunes corpus (apt-get install fortunes)";
  } else {
    return python;
  }
  return "";
}

// tests/hf/hf_fixture.py's directories, made once for the tests of this file; nullptr when they
// cannot be made here (the reason in *why).
const TempDir* fixture(std::string* why) {
  static TempDir d;
  static int rc = -1;
  if (hf_python(why).empty()) return nullptr;
  if (rc < 0) rc = std::system((fixture_script("make ") + d.path + " > " + d.file("log") + " 2>&1").c_str());
  if (rc == 0) return &d;
  *why = "hf_fixture.py failed: see " + d.file("log");
  return nullptr;
}

std::string message_of(const std::string& dir) {
  try {
    hf::Tokenizer::load(dir);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(loaded)";
}

}  // namespace

// transformers' LlamaTokenizer for the fixture's two directories (lm: BOS only; cls: BOS and EOS,
// pad = EOS) against Tandem's ids, decoding included. transformers' BPE conversion of the model
// differs from SentencePiece itself on runs of spaces; there Tandem must equal SentencePiece
// (libsentencepiece is the model's reference implementation), and such texts must stay few.
TEST(HfTokenizer, MatchesTransformers) {
  std::string why;
  const TempDir* fx = fixture(&why);
  ASSERT_NE(fx, nullptr) << why;
  const TempDir& d = *fx;
  std::ifstream f(d.file("tokens.json"));
  const auto ref = nlohmann::json::parse(f);
  for (std::string sub : {"lm", "cls"}) {
    const auto tok = hf::Tokenizer::load(d.file(sub));
    const auto& r = ref.at(sub);
    EXPECT_EQ(tok.special().bos, r.at("bos").get<int64_t>()) << sub;
    EXPECT_EQ(tok.special().eos, r.at("eos").get<int64_t>()) << sub;
    EXPECT_EQ(tok.special().pad, r.at("pad").is_null() ? -1 : r.at("pad").get<int64_t>()) << sub;
    EXPECT_TRUE(tok.special().add_bos) << sub;
    EXPECT_EQ(tok.special().add_eos, sub == "cls");
    size_t agree = 0, texts = 0;
    for (const auto& t : r.at("texts")) {
      const auto text = t.at("text").get<std::string>();
      const auto plain = tok.encode(text, false);
      EXPECT_EQ(plain, t.at("sentencepiece").get<std::vector<int64_t>>()) << sub << ": " << text;
      ++texts;
      if (t.at("plain") != t.at("sentencepiece")) continue;
      ++agree;
      EXPECT_EQ(tok.encode(text), t.at("ids").get<std::vector<int64_t>>()) << sub << ": " << text;
      EXPECT_EQ(tok.decode(tok.encode(text)), t.at("decoded").get<std::string>()) << sub << ": " << text;
    }
    EXPECT_GE(texts, 40u);
    EXPECT_GE(agree + 2, texts) << sub << ": transformers and SentencePiece disagree on more than 2 texts";
  }
}

// Each source of a special token in turn, the highest present winning; ids checked against the
// vocabulary.
TEST(HfTokenizer, SpecialTokensFromTheConfigurationFiles) {
  ASSERT_TRUE(tandem::text::have_sentencepiece()) << "built without SentencePiece (scripts/setup.sh installs it)";
  TempDir d;
  write_sentencepiece(d.path);
  // 5: the SentencePiece model's own ids; Llama's default adds BOS only.
  auto t = hf::Tokenizer::load(d.path);
  EXPECT_EQ(t.special().bos, 2);
  EXPECT_EQ(t.special().eos, 3);
  EXPECT_EQ(t.special().pad, 0);
  EXPECT_EQ(t.special().unk, 1);
  const auto pieces = t.encode("the fox", false);
  auto with = pieces;
  with.insert(with.begin(), 2);
  EXPECT_EQ(t.encode("the fox"), with);
  // 4: generation_config.json, overridden by config.json (an id list: its first).
  write(d.file("generation_config.json"), R"({"bos_token_id": 5, "eos_token_id": [6, 7], "pad_token_id": 8})");
  t = hf::Tokenizer::load(d.path);
  EXPECT_EQ(t.special().bos, 5);
  EXPECT_EQ(t.special().eos, 6);
  EXPECT_EQ(t.special().pad, 8);
  write(d.file("config.json"), R"({"bos_token_id": 9, "eos_token_id": 10, "pad_token_id": null})");
  t = hf::Tokenizer::load(d.path);
  EXPECT_EQ(t.special().bos, 9);
  EXPECT_EQ(t.special().eos, 10);
  EXPECT_EQ(t.special().pad, 8);  // null in config.json: the next source
  // 3: tokenizer.json's template adds EOS as well.
  write(d.file("tokenizer.json"),
        R"({"post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}},
            {"Sequence": {"id": "A"}}, {"SpecialToken": {"id": "</s>"}}]}})");
  t = hf::Tokenizer::load(d.path);
  EXPECT_TRUE(t.special().add_eos);
  EXPECT_EQ(t.encode("the fox").back(), 10);
  // 2 and 1: token texts, looked up in the pieces and in added_tokens_decoder.
  write(d.file("special_tokens_map.json"), R"({"bos_token": "<s>", "pad_token": {"content": "<pad>"}})");
  t = hf::Tokenizer::load(d.path);
  EXPECT_EQ(t.special().bos, 2);
  EXPECT_EQ(t.special().pad, 0);
  EXPECT_EQ(t.special().eos, 10);
  write(d.file("tokenizer_config.json"), R"({"bos_token": "<mine>", "add_bos_token": false, "add_eos_token": false,
      "added_tokens_decoder": {"11": {"content": "<mine>", "special": true}}})");
  t = hf::Tokenizer::load(d.path);
  EXPECT_EQ(t.special().bos, 11);
  EXPECT_EQ(t.encode("the fox"), pieces);
  EXPECT_EQ(t.decode(t.encode("the fox")), "the fox");
}

TEST(HfTokenizer, BadDirectoriesAreNamed) {
  ASSERT_TRUE(tandem::text::have_sentencepiece()) << "built without SentencePiece (scripts/setup.sh installs it)";
  EXPECT_NE(message_of("/nonexistent/model").find("model directory '/nonexistent/model' not found"), std::string::npos);
  TempDir d;
  write(d.file("tokenizer.json"), "{}");
  EXPECT_NE(message_of(d.path).find("has no tokenizer.model"), std::string::npos);
  EXPECT_NE(message_of(d.path).find("not tokenizer.json alone"), std::string::npos) << message_of(d.path);
  write(d.file("tokenizer.model"), "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n");
  EXPECT_NE(message_of(d.path).find("Git LFS pointer"), std::string::npos) << message_of(d.path);
  write_sentencepiece(d.path);
  write(d.file("config.json"), R"({"bos_token_id": 1000})");
  EXPECT_NE(message_of(d.path).find("config.json': bos_token_id 1000 is outside the tokenizer's vocabulary [0, 60)"),
            std::string::npos)
      << message_of(d.path);
  write(d.file("config.json"), "{");
  EXPECT_NE(message_of(d.path).find("config.json' is not valid JSON"), std::string::npos) << message_of(d.path);
  write(d.file("config.json"), "{}");
  write(d.file("tokenizer_config.json"), R"({"eos_token": "<|end|>"})");
  EXPECT_NE(message_of(d.path).find("eos_token '<|end|>' is not in tokenizer.model's vocabulary"), std::string::npos)
      << message_of(d.path);
}

// The export of a checkpoint (sharded safetensors, config, tokenizer) loads in transformers and
// gives the logits Tandem computes from that checkpoint within 1e-5, for the causal LM (trained
// as a Sequential, renamed to Hugging Face names) and the classifier (with its label names).
TEST(HfExport, TransformersLoadsTheExport) {
  std::string why;
  const TempDir* fx = fixture(&why);
  ASSERT_NE(fx, nullptr) << why;
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE"}) unsetenv(v);
  tandem::RuntimeOptions ro;
  ro.device = "cpu";
  ro.backend = "self";
  tandem::Runtime rt(ro);
  TempDir d;
  const auto single_worker = [](tandem::text::HfFinetuneConfig& cfg) {
    cfg.loop.parallel.strategy = tandem::Strategy::kSingle;
  };
  const auto lm =
      tandem::test::finetune_and_export(rt, fx->path, d.path, "lm", tandem::text::HfTask::kLm, single_worker);
  EXPECT_EQ(::access((lm + "/model.safetensors.index.json").c_str(), R_OK), 0) << "not sharded";
  EXPECT_EQ(::access((lm + "/tokenizer.model").c_str(), R_OK), 0);
  const auto cls =
      tandem::test::finetune_and_export(rt, fx->path, d.path, "cls", tandem::text::HfTask::kClassify, single_worker);
  EXPECT_EQ(std::system((fixture_script("check-export ") + lm + " " + d.file("lm-ref.safetensors") + " lm").c_str()),
            0);
  EXPECT_EQ(std::system((fixture_script("check-export ") + cls + " " + d.file("cls-ref.safetensors") + " cls").c_str()),
            0);
}
