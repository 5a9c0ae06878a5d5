// tandem/preprocess.h: the JSON lines read in chunks by this thread, tokenized by up to `threads`
// others, and written in input order.
#include "tandem/preprocess.h"

#include <limits.h>
#include <sys/stat.h>

#include <cstdlib>

#include <algorithm>
#include <deque>
#include <fstream>
#include <future>
#include <stdexcept>
#include <thread>
#include <vector>

#include "tandem/hf_finetune.h"
#include "tandem/hf_tokenizer.h"

namespace tandem::text {
namespace {

struct Chunk {
  std::vector<std::string> lines;
  int64_t first_line = 1, bytes = 0;
};

struct Tokenized {
  std::vector<int64_t> ids;
  std::vector<int64_t> sizes;  // per document
  int64_t bytes = 0;
};

// Each non-blank line's ids, then EOS (unless the tokenizer adds it).
Tokenized tokenize(const hf::Tokenizer& tok, const Chunk& c, const std::string& path) {
  Tokenized t;
  t.bytes = c.bytes;
  const auto& s = tok.special();
  for (size_t i = 0; i < c.lines.size(); ++i) {
    if (blank_line(c.lines[i])) continue;
    const auto ex =
        parse_jsonl_line(c.lines[i], path + ":" + std::to_string(c.first_line + static_cast<int64_t>(i)) + ": ", false);
    auto v = tok.encode(ex.text);
    if (!s.add_eos) v.push_back(s.eos);
    t.ids.insert(t.ids.end(), v.begin(), v.end());
    t.sizes.push_back(static_cast<int64_t>(v.size()));
  }
  return t;
}

// The next chunk of about `bytes` (whole lines); empty at the end of the file.
Chunk read_chunk(std::istream& in, int64_t bytes, int64_t* line) {
  Chunk c;
  c.first_line = *line;
  std::string l;
  while (c.bytes < bytes && std::getline(in, l)) {
    c.bytes += static_cast<int64_t>(l.size()) + 1;
    c.lines.push_back(std::move(l));
    ++*line;
  }
  return c;
}

int64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
}

void make_dir(const std::string& dir) {
  std::string part;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || dir[i] == '/') {
      if (!part.empty()) ::mkdir(part.c_str(), 0755);
    }
    if (i < dir.size()) part += dir[i];
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw std::runtime_error("--out '" + dir + "' is not a directory and cannot be made one; give a directory path");
  }
}

}  // namespace

data::DatasetInfo preprocess(const PreprocessOptions& o) {
  if (o.model_dir.empty()) throw std::invalid_argument("--init-from needs a Hugging Face model directory");
  if (o.out.empty()) throw std::invalid_argument("--out needs an output directory");
  if (o.chunk_bytes < 1) throw std::invalid_argument("the chunk size must be > 0");
  const auto tok = hf::Tokenizer::load(o.model_dir);
  const auto& s = tok.special();
  if (s.eos < 0) {
    throw std::runtime_error("'" + o.model_dir +
                             "': the tokenizer has no EOS token, which separates the packed documents; give a model "
                             "whose tokenizer_config.json or config.json names one");
  }
  std::ifstream in(o.data, std::ios::binary);
  if (!in) throw std::runtime_error("data file '" + o.data + "' not found or unreadable; give a JSON lines file");
  make_dir(o.out);
  data::DatasetInfo info;
  char resolved[PATH_MAX];
  info.tokenizer_dir = ::realpath(o.model_dir.c_str(), resolved) ? resolved : o.model_dir;
  info.vocab_size = tok.vocab_size();
  info.eos = s.eos;
  info.bos = s.add_bos ? s.bos : -1;
  info.source = o.data;
  info.type = data::token_type_for_vocab(info.vocab_size);
  data::IndexedDatasetWriter writer(o.out + "/" + info.prefix, info.type);
  const int threads = o.threads > 0 ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  const int64_t total = file_size(o.data);
  int64_t line = 1, done = 0;
  std::deque<std::future<Tokenized>> pending;
  auto write_front = [&] {
    const Tokenized t = pending.front().get();  // rethrows a thread's FILE:LINE error
    pending.pop_front();
    int64_t at = 0;
    for (const int64_t n : t.sizes) {
      writer.add_document(t.ids.data() + at, n);
      at += n;
    }
    done += t.bytes;
    if (o.progress) o.progress(std::min(done, total), total, writer.documents(), writer.tokens());
  };
  try {
    for (;;) {
      auto c = std::make_shared<Chunk>(read_chunk(in, o.chunk_bytes, &line));
      if (c->lines.empty()) break;
      pending.push_back(std::async(std::launch::async, [&tok, c, &o] { return tokenize(tok, *c, o.data); }));
      if (static_cast<int>(pending.size()) >= threads) write_front();
    }
    while (!pending.empty()) write_front();
  } catch (...) {
    for (auto& p : pending)
      if (p.valid()) p.wait();  // no thread outlives the tokenizer
    throw;
  }
  if (writer.documents() == 0) throw std::runtime_error("data file '" + o.data + "' holds no documents");
  writer.finish();
  info.documents = writer.documents();
  info.tokens = writer.tokens();
  data::write_dataset_info(o.out, info);
  return info;
}

}  // namespace tandem::text
