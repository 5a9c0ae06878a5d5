// Reading labelled fortune-cookie corpora: documents, UTF-8 checks, deduplication, hash split.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "tandem/text.h"

namespace tandem::text {

namespace fs = std::filesystem;

const char* to_string(Split s) {
  switch (s) {
    case Split::kTrain: return "train";
    case Split::kValid: return "valid";
    case Split::kTest: return "test";
  }
  return "?";
}

int64_t Corpus::label_index(const std::string& label) const {
  auto it = std::lower_bound(labels.begin(), labels.end(), label);
  return it != labels.end() && *it == label ? it - labels.begin() : -1;
}

bool is_valid_utf8(std::string_view s, size_t* bad_offset) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  auto fail = [&](size_t at) {
    if (bad_offset) *bad_offset = at;
    return false;
  };
  while (i < n) {
    unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return fail(i);  // continuation byte, overlong lead (C0, C1) or > F4
    }
    if (i + len > n) return fail(i);
    for (int k = 1; k < len; ++k) {
      unsigned cc = p[i + k];
      if ((cc & 0xC0) != 0x80) return fail(i);
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return fail(i);
    }
    i += len;
  }
  return true;
}

namespace {

std::string_view trim(std::string_view s) {
  const char* ws = " \t\r\n\f\v";
  auto b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  auto e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

}  // namespace

std::vector<std::string> split_documents(std::string_view text) {
  std::vector<std::string> docs;
  std::string cur;
  size_t pos = 0;
  auto flush = [&] {
    auto t = trim(cur);
    if (!t.empty()) docs.emplace_back(t);
    cur.clear();
  };
  while (pos <= text.size()) {
    size_t nl = text.find('\n', pos);
    std::string_view line = text.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    std::string_view bare = line;
    if (!bare.empty() && bare.back() == '\r') bare.remove_suffix(1);
    if (bare == "%") {
      flush();
    } else {
      cur.append(line);
      cur.push_back('\n');
    }
    if (nl == std::string_view::npos) break;
    pos = nl + 1;
  }
  flush();
  return docs;
}

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

Split split_of(std::string_view text, double valid_fraction, double test_fraction) {
  // FNV-1a's high bits mix poorly when texts differ only at the end; splitmix64's finalizer
  // spreads them. The top 53 bits then give a uniform number in [0, 1).
  uint64_t h = fnv1a64(text);
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  h ^= h >> 31;
  const double u = static_cast<double>(h >> 11) / static_cast<double>(1ull << 53);
  if (u < test_fraction) return Split::kTest;
  if (u < test_fraction + valid_fraction) return Split::kValid;
  return Split::kTrain;
}

Corpus read_corpus(const CorpusOptions& o) {
  if (o.task != "language" && o.task != "category") {
    throw std::invalid_argument("unknown task '" + o.task + "'; use language or category");
  }
  if (o.valid_fraction < 0 || o.test_fraction <= 0 || o.valid_fraction + o.test_fraction >= 1) {
    throw std::invalid_argument("validation and test fractions must be >= 0 and > 0 with a sum below 1");
  }
  std::error_code ec;
  if (!fs::is_directory(o.root, ec)) {
    throw std::runtime_error("text directory '" + o.root +
                             "' not found; install the fortune packages (apt-get install fortunes fortunes-de "
                             "fortunes-es fortunes-it fortunes-pl fortunes-ru fortunes-cs) or pass --data DIR");
  }
  // (label, path) of every regular file, sorted for a deterministic order.
  std::vector<std::pair<std::string, fs::path>> files;
  const fs::path root(o.root);
  for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::skip_permission_denied);
       it != fs::recursive_directory_iterator(); ++it) {
    const auto& e = *it;
    if (e.is_symlink()) continue;
    auto rel = fs::relative(e.path(), root);
    const std::string top = rel.begin()->string();
    if (e.is_directory()) {
      if (std::find(o.skip_dirs.begin(), o.skip_dirs.end(), top) != o.skip_dirs.end()) it.disable_recursion_pending();
      continue;
    }
    if (!e.is_regular_file() || e.path().extension() == ".dat" || e.file_size() == 0) continue;
    const bool in_root = std::distance(rel.begin(), rel.end()) == 1;
    std::string label;
    if (o.task == "language") {
      label = in_root ? o.root_label : top;
    } else {
      if (!in_root) continue;
      label = e.path().stem().string();
    }
    if (e.path().filename().string().rfind('.', 0) == 0) continue;  // hidden files
    files.emplace_back(label, e.path());
  }
  std::sort(files.begin(), files.end());

  Corpus c;
  std::unordered_set<std::string> seen;
  std::map<std::string, std::vector<Document>> by_label;
  for (const auto& [label, path] : files) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot read '" + path.string() + "'");
    std::ostringstream ss;
    ss << f.rdbuf();
    const std::string bytes = ss.str();
    ++c.files;
    if (bytes.find('\0') != std::string::npos) {
      throw std::runtime_error("'" + path.string() + "' is binary (NUL byte at offset " +
                               std::to_string(bytes.find('\0')) + "), not text; remove it from the text directory");
    }
    size_t bad = 0;
    if (!is_valid_utf8(bytes, &bad)) {
      std::ostringstream msg;
      msg << "'" << path.string() << "' is not UTF-8 (invalid byte 0x" << std::hex
          << static_cast<int>(static_cast<unsigned char>(bytes[bad])) << std::dec << " at offset " << bad
          << "); convert it (iconv -t UTF-8) or remove it";
      throw std::runtime_error(msg.str());
    }
    for (auto& d : split_documents(bytes)) {
      const int64_t chars = static_cast<int64_t>(d.size());
      if (chars < o.min_chars || chars > o.max_chars) {
        ++c.dropped;
        continue;
      }
      if (!seen.insert(d).second) {
        ++c.duplicates;
        continue;
      }
      by_label[label].push_back(Document{std::move(d), label, path.string()});
    }
  }
  if (by_label.empty()) {
    throw std::runtime_error("no documents in '" + o.root + "' (" + std::to_string(c.files) + " non-empty text files" +
                             (o.task == "category" ? " directly in it" : "") +
                             "); expected files of '%'-separated documents, one subdirectory per label");
  }
  for (auto& [label, docs] : by_label) {
    // Deterministic and independent of file order: by a salted hash of the text (salted, so
    // that the documents kept are not biased towards one split, which uses the plain hash).
    auto key = [](const std::string& t) { return fnv1a64("keep:" + t); };
    std::sort(docs.begin(), docs.end(), [&](const Document& a, const Document& b) {
      auto ha = key(a.text), hb = key(b.text);
      return ha != hb ? ha < hb : a.text < b.text;
    });
    if (o.max_per_label >= 0 && static_cast<int64_t>(docs.size()) > o.max_per_label) docs.resize(o.max_per_label);
    c.labels.push_back(label);
    c.per_label[label] = static_cast<int64_t>(docs.size());
    for (auto& d : docs) {
      switch (split_of(d.text, o.valid_fraction, o.test_fraction)) {
        case Split::kTrain: c.train.push_back(std::move(d)); break;
        case Split::kValid: c.valid.push_back(std::move(d)); break;
        case Split::kTest: c.test.push_back(std::move(d)); break;
      }
    }
  }
  std::sort(c.labels.begin(), c.labels.end());
  if (c.train.empty() || c.test.empty()) {
    throw std::runtime_error("'" + o.root + "' has too few documents (" + std::to_string(c.train.size()) + " train, " +
                             std::to_string(c.test.size()) + " test) for a train/test split; add text");
  }
  return c;
}

}  // namespace tandem::text
