// Tests for tandem/indexed_dataset.h (Megatron's indexed dataset: writer -> reader round trip in
// both token types, a corrupt or truncated index or .bin refused naming the file, packed windows)
// and for packing in tandem/llama.h: document_layout's positions and mask as Megatron's
// reset_position_ids / reset_attention_mask, and a packed row's logits and loss equal to each
// document run alone, in the module tree and the Sequential form.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "tandem/indexed_dataset.h"
#include "tandem/llama.h"
#include "temp_dir.h"

namespace td = tandem::data;
namespace ll = tandem::llama;
using tandem::test::TempDir;

namespace {

std::vector<std::vector<int64_t>> some_documents(int64_t top) {
  return {{1, 5, 9, top - 1, 2}, {1, 2}, {1, 7, 7, 7, 7, 7, 7, 8, 2}, {2}};
}

std::string write(const TempDir& dir, td::TokenType type, const std::vector<std::vector<int64_t>>& docs) {
  const auto prefix = dir.file("d");
  td::IndexedDatasetWriter w(prefix, type);
  for (const auto& d : docs) w.add_document(d);
  w.finish();
  return prefix;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void spill(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// The reader's error for `prefix`, "" when it opens.
std::string open_error(const std::string& prefix) {
  try {
    td::IndexedDataset d(prefix);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(IndexedDataset, WriterThenReaderRoundTripsBothTokenTypes) {
  for (const auto type : {td::TokenType::kUint16, td::TokenType::kInt32}) {
    TempDir dir;
    const int64_t top = type == td::TokenType::kUint16 ? 65535 : 70000;
    const auto docs = some_documents(top);
    const auto prefix = write(dir, type, docs);
    td::IndexedDataset d(prefix);
    ASSERT_EQ(d.sequences(), 4);
    EXPECT_EQ(d.documents(), 4);
    EXPECT_EQ(d.type(), type);
    EXPECT_EQ(d.tokens(), 17);
    EXPECT_EQ(static_cast<int64_t>(slurp(prefix + ".bin").size()), 17 * td::token_bytes(type));
    // Megatron's layout: a 34-byte header, sizes, pointers, doc_idx 0..S.
    EXPECT_EQ(slurp(prefix + ".idx").size(), 34u + 4 * 4 + 4 * 8 + 5 * 8);
    EXPECT_EQ(slurp(prefix + ".idx").substr(0, 9), std::string("MMIDIDX\0\0", 9));
    EXPECT_EQ(static_cast<uint8_t>(slurp(prefix + ".idx")[17]), static_cast<uint8_t>(type));
    int64_t at = 0;
    for (int64_t i = 0; i < 4; ++i) {
      EXPECT_EQ(d.size(i), static_cast<int32_t>(docs[i].size()));
      EXPECT_EQ(d.pointer(i), at * td::token_bytes(type));
      std::vector<int64_t> got(docs[i].size());
      d.read(at, d.size(i), got.data());
      EXPECT_EQ(got, docs[i]);
      at += d.size(i);
    }
    for (int64_t i = 0; i <= 4; ++i) EXPECT_EQ(d.doc_index(i), i);
  }
  EXPECT_EQ(td::token_type_for_vocab(32000), td::TokenType::kUint16);
  EXPECT_EQ(td::token_type_for_vocab(65500), td::TokenType::kInt32);
  TempDir dir;
  td::IndexedDatasetWriter w(dir.file("x"), td::TokenType::kUint16);
  EXPECT_THROW(w.add_document({1, 65536}), std::invalid_argument);
}

TEST(IndexedDataset, CorruptOrTruncatedFilesAreRefusedNamingTheFile) {
  TempDir dir;
  const auto prefix = write(dir, td::TokenType::kUint16, some_documents(100));
  const auto idx = slurp(prefix + ".idx"), bin = slurp(prefix + ".bin");
  ASSERT_EQ(open_error(prefix), "");
  auto expect = [&](const std::string& what, const std::string& file, const std::string& needle) {
    const auto e = open_error(prefix);
    EXPECT_NE(e.find("'" + file + "'"), std::string::npos) << what << ": " << e;
    EXPECT_NE(e.find(needle), std::string::npos) << what << ": " << e;
    spill(prefix + ".idx", idx);
    spill(prefix + ".bin", bin);
  };
  spill(prefix + ".idx", idx.substr(0, idx.size() - 8));
  expect("index cut short", prefix + ".idx", "truncated");
  spill(prefix + ".idx", idx.substr(0, 20));
  expect("index cut in its header", prefix + ".idx", "truncated");
  spill(prefix + ".idx", idx + "xxxxxxxx");
  expect("index too long", prefix + ".idx", "longer than its counts");
  spill(prefix + ".idx", "NOTANIDX" + idx.substr(8));
  expect("magic", prefix + ".idx", "MMIDIDX");
  auto bad = idx;
  bad[17] = 7;  // float32
  spill(prefix + ".idx", bad);
  expect("dtype", prefix + ".idx", "dtype code 7");
  bad = idx;
  bad[34 + 4 * 4 + 8] = 3;  // the second sequence's pointer
  spill(prefix + ".idx", bad);
  expect("pointer", prefix + ".idx", "starts at byte 3");
  bad = idx;
  bad[34 + 4 * 4 + 4 * 8 + 2 * 8] = 9;  // doc_idx[2]
  spill(prefix + ".idx", bad);
  expect("doc_idx", prefix + ".idx", "document index 2");
  spill(prefix + ".bin", bin.substr(0, bin.size() - 2));
  expect("bin cut short", prefix + ".bin", "truncated");
  ::remove((prefix + ".bin").c_str());
  expect("no bin", prefix + ".bin", "cannot open");
  EXPECT_NE(open_error(dir.file("nothing")).find("nothing.idx"), std::string::npos);
}

TEST(IndexedDataset, PackedWindowsOverlapByOneTokenAndCheckTheVocabulary) {
  TempDir dir;
  const auto prefix = write(dir, td::TokenType::kUint16, some_documents(100));  // 17 tokens
  td::IndexedDataset d(prefix);
  td::PackedWindows w(d, 4);
  ASSERT_EQ(w.size(), 4);  // (17 - 1) / 4
  std::vector<int64_t> all(17), got(5);
  d.read(0, 17, all.data());
  for (int64_t i = 0; i < 4; ++i) {
    w.window(i, got.data());
    EXPECT_EQ(got, std::vector<int64_t>(all.begin() + 4 * i, all.begin() + 4 * i + 5));
  }
  EXPECT_THROW(w.window(0, got.data(), /*vocab_size=*/50), std::runtime_error);  // holds id 99
  EXPECT_NO_THROW(w.window(1, got.data(), /*vocab_size=*/50));
  EXPECT_EQ(td::PackedWindows(d, 16).size(), 1);
  EXPECT_THROW(td::PackedWindows(d, 17), std::invalid_argument);
}

TEST(DocumentLayout, PositionsAndMaskResetAfterEachSeparatorAsMegatron) {
  auto ids = torch::tensor({{5, 2, 7, 8, 2, 9}, {4, 4, 4, 4, 4, 4}}, torch::kLong);
  const auto l = ll::document_layout(ids, 2);
  EXPECT_TRUE(torch::equal(l.positions, torch::tensor({{0, 1, 0, 1, 2, 0}, {0, 1, 2, 3, 4, 5}}, torch::kLong)));
  ASSERT_EQ(l.mask.sizes(), (std::vector<int64_t>{2, 1, 6, 6}));
  // Row 0: documents [0, 1], [2, 4], [5]; each causal within itself.
  auto want = torch::zeros({6, 6}, torch::kBool);
  for (auto [a, b] : {std::pair{0, 2}, std::pair{2, 5}, std::pair{5, 6}})
    for (int q = a; q < b; ++q)
      for (int k = a; k <= q; ++k) want[q][k] = true;
  EXPECT_TRUE(torch::equal(l.mask[0][0], want));
  EXPECT_TRUE(torch::equal(l.mask[1][0], torch::ones({6, 6}, torch::kBool).tril()));
}

namespace {

const char* kConfig = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
  "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 64, "rms_norm_eps": 1e-05, "hidden_act": "silu",
  "rope_theta": 5000.0, "tie_word_embeddings": false})";

constexpr int64_t kEos = 2;

// Three documents (the last cut by the window's end, as in a packed window) and the packed row.
std::vector<torch::Tensor> documents() {
  torch::manual_seed(3);
  auto body = [](int64_t n) { return torch::randint(3, 300, {n}, torch::kLong); };
  return {torch::cat({body(6), torch::tensor({kEos})}), torch::cat({body(3), torch::tensor({kEos})}), body(5)};
}

// Logits of the packed row [1, T, V] against each document's logits alone, and the summed
// next-token loss over the targets inside a document (Megatron's EOS -> next document term left
// out, which the documents alone do not have).
void expect_packed_equals_alone(const std::function<torch::Tensor(const torch::Tensor&)>& packed_model,
                                const std::function<torch::Tensor(const torch::Tensor&)>& alone_model) {
  const auto docs = documents();
  const auto row = torch::cat(docs).unsqueeze(0);
  torch::NoGradGuard ng;
  const auto packed = packed_model(row);
  double packed_loss = 0, alone_loss = 0;
  int64_t at = 0;
  for (const auto& d : docs) {
    const int64_t n = d.size(0);
    const auto alone = alone_model(d.unsqueeze(0));
    const auto part = packed.narrow(1, at, n);
    EXPECT_TRUE(torch::allclose(part, alone, 1e-5, 1e-5))
        << "document at " << at << ": max |diff| " << (part - alone).abs().max().item<float>();
    auto ce = [&](const torch::Tensor& logits) {
      return torch::nn::functional::cross_entropy(logits[0].narrow(0, 0, n - 1), d.narrow(0, 1, n - 1),
                                                  torch::nn::functional::CrossEntropyFuncOptions().reduction(
                                                      torch::kSum))
          .item<double>();
    };
    packed_loss += ce(part);
    alone_loss += ce(alone);
    at += n;
  }
  EXPECT_NEAR(packed_loss, alone_loss, 1e-3);
}

}  // namespace

TEST(DocumentLayout, PackedRowEqualsEachDocumentAloneInTheModuleTree) {
  auto c = ll::parse_config(kConfig);
  torch::manual_seed(1);
  ll::LlamaForCausalLM alone(c);
  c.document_separator = kEos;
  ll::LlamaForCausalLM packed(c);
  {
    torch::NoGradGuard ng;
    auto from = alone->named_parameters();
    for (auto& p : packed->named_parameters()) p.value().copy_(from[p.key()]);
  }
  expect_packed_equals_alone([&](const torch::Tensor& x) { return packed(x); },
                             [&](const torch::Tensor& x) { return alone(x); });
  // The control: without the separator the later documents see the earlier ones.
  const auto docs = documents();
  torch::NoGradGuard ng;
  const auto mixed = alone(torch::cat(docs).unsqueeze(0)).narrow(1, docs[0].size(0), docs[1].size(0));
  EXPECT_FALSE(torch::allclose(mixed, alone(docs[1].unsqueeze(0)), 1e-3, 1e-3));
}

TEST(DocumentLayout, PackedRowEqualsEachDocumentAloneInTheSequentialForm) {
  auto c = ll::parse_config(kConfig);
  torch::manual_seed(2);
  ll::LlamaForCausalLM alone(c);
  c.document_separator = kEos;
  auto packed = ll::causal_lm_sequential(c);
  ASSERT_TRUE(packed->ptr(0)->as<ll::DocumentEmbeddingImpl>());
  {
    torch::NoGradGuard ng;
    auto from = alone->named_parameters();
    for (auto& p : packed->named_parameters()) p.value().copy_(from[ll::sequential_to_hf(p.key())]);
  }
  expect_packed_equals_alone([&](const torch::Tensor& x) { return packed->forward(x); },
                             [&](const torch::Tensor& x) { return alone(x); });
}
