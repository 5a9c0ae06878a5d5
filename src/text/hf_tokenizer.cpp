// A Hugging Face directory's SentencePiece tokenizer and its special tokens.
#include "tandem/hf_tokenizer.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "tandem_build_config.h"

#if TANDEM_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

namespace tandem::hf {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The parsed file, or nullopt when it does not exist.
std::optional<json> read_json(const fs::path& path) {
  std::ifstream f(path);
  if (!f) return std::nullopt;
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    throw std::runtime_error("'" + path.string() + "' is not valid JSON (" + e.what() +
                             "); restore it from the model's original files");
  }
}

// A token field: "<s>", {"content": "<s>", ...}, or null / absent.
std::optional<std::string> token_text(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return std::nullopt;
}

// An id field: 2, [2, 32000] (the first), or null / absent.
std::optional<int64_t> token_id(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return std::nullopt;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_array() && !it->empty() && (*it)[0].is_number_integer()) return (*it)[0].get<int64_t>();
  return std::nullopt;
}

struct Sources {
  const std::string& dir;
  int64_t vocab_size;
  const std::function<int64_t(const std::string&)>& piece_to_id;
  std::optional<json> tokenizer_config, special_map, tokenizer_json, config, generation;

  int64_t checked(int64_t id, const std::string& file, const std::string& what) const {
    if (id < 0 || id >= vocab_size) {
      throw std::runtime_error("'" + (fs::path(dir) / file).string() + "': " + what + " " + std::to_string(id) +
                               " is outside the tokenizer's vocabulary [0, " + std::to_string(vocab_size) +
                               "); the configuration does not belong to this tokenizer.model");
    }
    return id;
  }
  // A token's text to its id: tokenizer_config.json's added_tokens_decoder, then the pieces.
  int64_t id_of(const std::string& text, const std::string& file, const char* key) const {
    if (tokenizer_config && tokenizer_config->contains("added_tokens_decoder")) {
      for (auto& [id, tok] : (*tokenizer_config)["added_tokens_decoder"].items()) {
        if (tok.is_object() && tok.value("content", "") == text) return checked(std::stoll(id), file, key);
      }
    }
    const int64_t id = piece_to_id(text);
    if (id < 0) {
      throw std::runtime_error("'" + (fs::path(dir) / file).string() + "': " + key + " '" + text +
                               "' is not in tokenizer.model's vocabulary; the files do not belong together");
    }
    return id;
  }
  // The id of a special token ("bos", ...) by the precedence of read_special_tokens.
  int64_t resolve(const std::string& name, int64_t fallback) const {
    const std::string tkey = name + "_token", ikey = name + "_token_id";
    const std::pair<const std::optional<json>*, const char*> by_text[] = {{&tokenizer_config, "tokenizer_config.json"},
                                                                          {&special_map, "special_tokens_map.json"}};
    for (auto [j, file] : by_text) {
      if (!*j) continue;
      if (auto t = token_text(**j, tkey.c_str())) return id_of(*t, file, tkey.c_str());
    }
    const std::pair<const std::optional<json>*, const char*> by_id[] = {{&config, "config.json"},
                                                                        {&generation, "generation_config.json"}};
    for (auto [j, file] : by_id) {
      if (!*j) continue;
      if (auto id = token_id(**j, ikey.c_str())) return checked(*id, file, ikey);
    }
    return fallback;
  }
  // add_bos_token / add_eos_token, else whether tokenizer.json's single template has it.
  std::optional<bool> adds(const char* key, bool first) const {
    if (tokenizer_config && (*tokenizer_config).contains(key) && (*tokenizer_config)[key].is_boolean()) {
      return (*tokenizer_config)[key].get<bool>();
    }
    if (!tokenizer_json) return std::nullopt;
    const auto& pp = (*tokenizer_json).value("post_processor", json());
    if (!pp.is_object() || pp.value("type", "") != "TemplateProcessing" || !pp.contains("single")) {
      return std::nullopt;
    }
    const auto& single = pp["single"];
    if (!single.is_array() || single.empty()) return std::nullopt;
    return (first ? single.front() : single.back()).contains("SpecialToken");
  }
};

}  // namespace

SpecialTokens read_special_tokens(const std::string& dir, int64_t vocab_size,
                                  const std::function<int64_t(const std::string&)>& piece_to_id,
                                  const SpecialTokens& model_defaults) {
  const fs::path d(dir);
  Sources s{dir,
            vocab_size,
            piece_to_id,
            read_json(d / "tokenizer_config.json"),
            read_json(d / "special_tokens_map.json"),
            read_json(d / "tokenizer.json"),
            read_json(d / "config.json"),
            read_json(d / "generation_config.json")};
  SpecialTokens t;
  t.bos = s.resolve("bos", model_defaults.bos);
  t.eos = s.resolve("eos", model_defaults.eos);
  t.pad = s.resolve("pad", model_defaults.pad);
  t.unk = s.resolve("unk", model_defaults.unk);
  t.add_bos = s.adds("add_bos_token", true).value_or(model_defaults.add_bos) && t.bos >= 0;
  t.add_eos = s.adds("add_eos_token", false).value_or(model_defaults.add_eos) && t.eos >= 0;
  return t;
}

struct Tokenizer::Impl {
#if TANDEM_HAVE_SENTENCEPIECE
  sentencepiece::SentencePieceProcessor sp;
#endif
};

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

const std::vector<std::string>& Tokenizer::file_names() {
  static const std::vector<std::string> names = {"tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                                 "special_tokens_map.json", "generation_config.json"};
  return names;
}

Tokenizer Tokenizer::load(const std::string& dir) {
#if TANDEM_HAVE_SENTENCEPIECE
  if (!fs::is_directory(dir)) {
    throw std::runtime_error("model directory '" + dir + "' not found; give a local Hugging Face model directory");
  }
  const auto file = (fs::path(dir) / "tokenizer.model").string();
  std::ifstream f(file, std::ios::binary);
  if (!f) {
    throw std::runtime_error(
        "'" + dir + "' has no tokenizer.model; Tandem reads SentencePiece tokenizers (Llama 1/2, Mistral), " +
        (fs::exists(fs::path(dir) / "tokenizer.json") ? "not tokenizer.json alone" : "and finds none here"));
  }
  std::ostringstream bytes;
  bytes << f.rdbuf();
  Tokenizer t;
  t.impl_ = std::make_unique<Impl>();
  auto st = t.impl_->sp.LoadFromSerializedProto(bytes.str());
  if (!st.ok()) {
    const bool lfs = bytes.str().rfind("version https://git-lfs", 0) == 0;
    throw std::runtime_error("'" + file + "' is not a SentencePiece model (" + st.ToString() + ")" +
                             (lfs ? "; it is a Git LFS pointer: run git lfs pull in the model's repository" : ""));
  }
  auto& sp = t.impl_->sp;
  SpecialTokens defaults{sp.bos_id(), sp.eos_id(), sp.pad_id(), sp.unk_id(), true, false};
  auto piece_to_id = [&sp](const std::string& piece) -> int64_t {
    const int id = sp.PieceToId(piece);
    // PieceToId answers unk_id for an unknown piece; only the unknown piece itself maps there.
    return id == sp.unk_id() && sp.IdToPiece(id) != piece ? -1 : id;
  };
  t.special_ = read_special_tokens(dir, sp.GetPieceSize(), piece_to_id, defaults);
  t.dir_ = dir;
  return t;
#else
  throw std::runtime_error("this tandem was built without SentencePiece; install libsentencepiece-dev (apt-get install "
                           "libsentencepiece-dev), re-run cmake and rebuild");
#endif
}

int64_t Tokenizer::vocab_size() const {
#if TANDEM_HAVE_SENTENCEPIECE
  return impl_ ? impl_->sp.GetPieceSize() : 0;
#else
  return 0;
#endif
}

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool add_special) const {
  if (!impl_) throw std::logic_error("hf::Tokenizer::encode: empty tokenizer");
  std::vector<int64_t> out;
#if TANDEM_HAVE_SENTENCEPIECE
  std::vector<int> ids;
  auto st = impl_->sp.Encode(text, &ids);
  if (!st.ok()) throw std::runtime_error("tokenizing failed: " + st.ToString());
  out.reserve(ids.size() + 2);
  if (add_special && special_.add_bos) out.push_back(special_.bos);
  out.insert(out.end(), ids.begin(), ids.end());
  if (add_special && special_.add_eos) out.push_back(special_.eos);
#endif
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  if (!impl_) throw std::logic_error("hf::Tokenizer::decode: empty tokenizer");
  std::string out;
#if TANDEM_HAVE_SENTENCEPIECE
  std::vector<int> v;
  for (auto id : ids) {
    if (id != special_.bos && id != special_.eos && id != special_.pad) v.push_back(static_cast<int>(id));
  }
  auto st = impl_->sp.Decode(v, &out);
  if (!st.ok()) throw std::runtime_error("detokenizing failed: " + st.ToString());
#endif
  return out;
}

}  // namespace tandem::hf
