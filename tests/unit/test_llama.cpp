// Tests for tandem/llama.h: config.json parsing and its refusals, grouped-query attention
// against the same model with its key/value heads repeated, causality, save_pretrained ->
// load bitwise (sharded, tied and untied), the Sequential forms against the module tree, a
// pipeline stage and tensor-parallel shards reading only their bytes, and (in .venv-hf,
// scripts/setup-hf-venv.sh) logits against transformers on checkpoints each side wrote.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iterator>

#include "tandem/backends.h"
#include "tandem/engine.h"
#include "tandem/llama.h"
#include "tandem/placement.h"
#include "temp_dir.h"

namespace ll = tandem::llama;
namespace st = tandem::safetensors;
using tandem::test::TempDir;

namespace {

const char* kConfig = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 64,
  "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 64, "rms_norm_eps": 1e-05, "hidden_act": "silu", "pad_token_id": 0,
  "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}, "tie_word_embeddings": false,
  "id2label": {"0": "A", "1": "B", "2": "C"}})";

ll::LlamaConfig tiny(bool tied = false, int64_t kv_heads = 2) {
  auto c = ll::parse_config(kConfig);
  c.tie_word_embeddings = tied;
  c.num_key_value_heads = kv_heads;
  return c;
}

torch::Tensor token_ids(int64_t B = 3, int64_t T = 11) { return torch::randint(1, 300, {B, T}, torch::kLong); }

// Random norm weights too (they start at 1), so that a norm loaded wrongly shows.
void perturb_norms(torch::nn::Module& m) {
  torch::NoGradGuard g;
  for (auto& p : m.named_parameters())
    if (p.key().find("norm") != std::string::npos) p.value().uniform_(0.5, 1.5);
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

}  // namespace

TEST(LlamaConfig, ParsesHuggingFaceFieldsAndRefusesWhatItCannotRun) {
  const auto c = ll::parse_config(kConfig);
  EXPECT_EQ(c.vocab_size, 300);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_size(), 16);
  EXPECT_DOUBLE_EQ(c.rope_theta, 5000.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.num_labels, 3);
  EXPECT_EQ(c.pad_token_id, 0);
  // The written form parses back to the same configuration.
  const auto again = ll::parse_config(ll::config_json(c));
  EXPECT_EQ(again.hidden_size, c.hidden_size);
  EXPECT_DOUBLE_EQ(again.rope_theta, c.rope_theta);
  EXPECT_EQ(again.num_labels, c.num_labels);

  auto refused = [](std::string text, const std::string& expect) {
    try {
      ll::parse_config(text, "x/config.json");
      ADD_FAILURE() << expect << ": accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("x/config.json"), std::string::npos) << e.what();
    }
  };
  auto with = [](const std::string& from, const std::string& to) {
    std::string s = kConfig;
    s.replace(s.find(from), from.size(), to);
    return s;
  };
  refused(with("\"vocab_size\": 300,", ""), "needs the integer \"vocab_size\"");
  refused(with("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"), "not a multiple of num_key_value_heads");
  refused(with("\"hidden_size\": 64", "\"hidden_size\": 66"), "not a multiple of num_attention_heads");
  refused(with("\"silu\"", "\"gelu\""), "only silu");
  refused(with("\"rope_type\": \"default\"", "\"rope_type\": \"llama3\""), "rope type 'llama3'");
  refused(with("\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": \"small\""), "\"rms_norm_eps\" has the wrong type");
  refused(with("\"llama\"", "\"gpt2\""), "not \"llama\"");
  refused(with("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 0"), "must be positive");
  refused("{", "not valid JSON");
}

TEST(Llama, ParameterNamesAreTheHuggingFaceNames) {
  ll::LlamaForCausalLM m(tiny());
  std::set<std::string> names;
  for (auto& p : m->named_parameters()) names.insert(p.key());
  for (const char* n :
       {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"})
    EXPECT_TRUE(names.count(n)) << n;
  EXPECT_EQ(names.size(), 2u + 9 * 2 + 1);
  EXPECT_EQ(m->model->layers->size(), 2u);
  EXPECT_EQ(m->named_parameters()["model.layers.0.self_attn.k_proj.weight"].sizes(), torch::IntArrayRef({32, 64}));
  ll::LlamaForCausalLM tied(tiny(true));
  EXPECT_EQ(tied->named_parameters().size(), names.size() - 1);  // no lm_head.weight
}

// Grouped-query attention equals full multi-head attention whose key/value projections repeat
// each key/value head for the query heads of its group.
TEST(Llama, GroupedQueryAttentionEqualsRepeatedKeyValueHeads) {
  torch::manual_seed(1);
  ll::LlamaForCausalLM gqa(tiny(false, 2)), mha(tiny(false, 4));
  perturb_norms(*gqa);
  {
    torch::NoGradGuard g;
    auto src = gqa->named_parameters();
    for (auto& p : mha->named_parameters()) {
      auto w = src[p.key()];
      if (p.key().find("k_proj") != std::string::npos || p.key().find("v_proj") != std::string::npos)
        w = w.view({2, 16, 64}).repeat_interleave(2, 0).reshape({64, 64});  // head h serves queries 2h, 2h+1
      p.value().copy_(w);
    }
  }
  const auto ids = token_ids();
  EXPECT_TRUE(torch::allclose(gqa(ids), mha(ids), 1e-5, 1e-5));
}

TEST(Llama, EarlierPositionsDoNotSeeLaterTokens) {
  torch::manual_seed(2);
  ll::LlamaForCausalLM m(tiny());
  auto ids = token_ids(2, 12);
  auto a = m(ids);
  ids.index_put_({torch::indexing::Slice(), 7}, (ids.index({torch::indexing::Slice(), 7}) + 1) % 300);
  auto b = m(ids);
  EXPECT_TRUE(torch::equal(a.narrow(1, 0, 7), b.narrow(1, 0, 7)));
  EXPECT_FALSE(torch::allclose(a.narrow(1, 7, 1), b.narrow(1, 7, 1)));
  EXPECT_EQ(a.sizes(), torch::IntArrayRef({2, 12, 300}));
}

TEST(Llama, SavePretrainedThenLoadIsBitwise) {
  for (bool tied : {false, true}) {
    torch::manual_seed(3);
    ll::LlamaForCausalLM m(tiny(tied));
    perturb_norms(*m);
    TempDir d;
    st::SaveOptions opt;
    opt.max_shard_bytes = 100'000;  // several shards
    ll::save_pretrained(m, d.path, opt);
    st::Checkpoint c(d.path);
    EXPECT_GE(c.names().size(), 20u);
    EXPECT_EQ(c.contains("lm_head.weight"), !tied);
    torch::manual_seed(4);  // other initial values, all overwritten by the load
    auto back = ll::load_causal_lm(d.path);
    EXPECT_EQ(back->model->config.tie_word_embeddings, tied);
    auto mine = m->named_parameters(), theirs = back->named_parameters();
    ASSERT_EQ(mine.size(), theirs.size());
    for (auto& p : mine) EXPECT_TRUE(same_bits(p.value(), theirs[p.key()])) << p.key();
    const auto ids = token_ids();
    EXPECT_TRUE(same_bits(m(ids), back(ids))) << "tied " << tied;
  }
}

TEST(Llama, LoadRefusesACheckpointOfAnotherShape) {
  torch::manual_seed(5);
  TempDir d;
  ll::save_pretrained(ll::LlamaForCausalLM(tiny()), d.path);
  auto other = tiny();
  other.intermediate_size = 128;
  ll::LlamaForCausalLM m(other);
  try {
    ll::load_weights(*m, st::Checkpoint(d.path));
    FAIL() << "accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("'model.layers.0.mlp.gate_proj.weight' has shape [176, 64]"),
              std::string::npos)
        << e.what();
  }
  ll::LlamaForSequenceClassification cls(tiny());
  EXPECT_THROW(ll::load_weights(*cls, st::Checkpoint(d.path)), std::runtime_error);  // no score.weight
}

// transformers builds and saves tiny random models and computes their logits; Tandem loads them
// and matches within 1e-4 (fp32); Tandem saves them again and transformers, loading that,
// matches Tandem's logits within 1e-5.
TEST(Llama, MatchesTransformersBothWays) {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "TANDEM_SOURCE_DIR unset (ctest sets it)";
  const std::string python = std::string(src) + "/.venv-hf/bin/python";
  ASSERT_EQ(::access(python.c_str(), X_OK), 0) << python << " missing: run scripts/setup-hf-venv.sh";
  const std::string run =
      "HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 " + python + " " + src + "/tests/hf/llama_reference.py ";
  TempDir d;
  ASSERT_EQ(std::system((run + "make " + d.path).c_str()), 0);
  torch::NoGradGuard no_grad;
  for (std::string v : {"lm", "lm_tied", "cls"}) {
    const auto ref = st::load_file(d.file(v + "-ref.safetensors"));
    const auto ids = ref[0].first == "ids" ? ref[0].second : ref[1].second;
    const auto want = ref[0].first == "logits" ? ref[0].second : ref[1].second;
    torch::Tensor got;
    if (v == "cls") {
      auto m = ll::load_sequence_classifier(d.file(v));
      got = m(ids);
      ll::save_pretrained(m, d.file("cc-" + v));
    } else {
      if (v == "lm") EXPECT_GE(st::Checkpoint(d.file(v)).names().size(), 20u);
      if (v == "lm") EXPECT_EQ(::access(d.file(v + "/model.safetensors.index.json").c_str(), R_OK), 0);
      auto m = ll::load_causal_lm(d.file(v));
      EXPECT_EQ(m->model->config.tie_word_embeddings, v == "lm_tied");
      got = m(ids);
      ll::save_pretrained(m, d.file("cc-" + v));
    }
    ASSERT_EQ(got.sizes(), want.sizes()) << v;
    const double diff = (got - want).abs().max().item<double>();
    EXPECT_LE(diff, 1e-4) << v;
    EXPECT_GT(want.abs().max().item<double>(), 0.1) << v << ": logits too small to tell models apart";
    std::cout << v << ": Tandem vs transformers on transformers' checkpoint, max |diff| " << diff << "\n";
    st::save_file(d.file("cc-" + v + "-logits.safetensors"), {{"logits", got}});
  }
  EXPECT_EQ(std::system((run + "check " + d.path).c_str()), 0);
}

// The flat Sequential form computes the same function as the module tree, loads and saves under
// the Hugging Face names, and refuses tied embeddings.
TEST(Llama, SequentialFormEqualsTheModuleTree) {
  torch::manual_seed(6);
  ll::LlamaForCausalLM tree(tiny());
  perturb_norms(*tree);
  TempDir d;
  ll::save_pretrained(tree, d.path);
  auto seq = ll::causal_lm_sequential(tiny());
  EXPECT_EQ(seq->size(), 2u + 2u + 1u);
  ll::load_weights(*seq, st::Checkpoint(d.path), false, ll::sequential_to_hf);
  const auto ids = token_ids();
  EXPECT_TRUE(same_bits(seq->forward(ids), tree(ids)));
  EXPECT_EQ(ll::sequential_to_hf("layer1.self_attn.q_proj.weight"), "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(ll::sequential_to_hf("norm.weight"), "model.norm.weight");
  EXPECT_EQ(ll::positional_to_hf("0.weight", 2, "lm_head"), "model.embed_tokens.weight");
  EXPECT_EQ(ll::positional_to_hf("2.mlp.up_proj.weight", 2, "lm_head"), "model.layers.1.mlp.up_proj.weight");
  EXPECT_EQ(ll::positional_to_hf("3.weight", 2, "score"), "model.norm.weight");
  EXPECT_EQ(ll::positional_to_hf("4.weight", 2, "score"), "score.weight");
  EXPECT_THROW(ll::positional_to_hf("5.weight", 2, "score"), std::invalid_argument);
  EXPECT_THROW(ll::positional_to_hf("embed_tokens.weight", 2, "score"), std::invalid_argument);
  EXPECT_THROW(ll::sequential_to_hf("layerx.mlp.up_proj.weight"), std::invalid_argument);
  EXPECT_THROW(ll::causal_lm_sequential(tiny(true)), std::invalid_argument);
  // Saved from the Sequential, loaded by the tree: the same bits.
  TempDir d2;
  ll::save_pretrained(seq, tiny(), d2.path);
  auto back = ll::load_causal_lm(d2.path);
  EXPECT_TRUE(same_bits(back(ids), tree(ids)));
}

namespace {
int64_t bytes_of(const torch::nn::Module& m) {
  int64_t n = 0;
  for (auto& p : m.parameters()) n += static_cast<int64_t>(p.nbytes());
  return n;
}

void expect_same_parameters(const torch::nn::Module& got, const torch::nn::Module& want) {
  auto w = want.named_parameters();
  for (auto& p : got.named_parameters()) {
    ASSERT_TRUE(w.contains(p.key())) << p.key();
    EXPECT_TRUE(same_bits(p.value(), w[p.key()])) << p.key();
  }
}

// A random classifier (norms perturbed) saved into `dir`, and its Sequential form loaded from it.
std::pair<ll::LlamaForSequenceClassification, torch::nn::Sequential> saved_classifier(uint64_t seed,
                                                                                      const std::string& dir) {
  torch::manual_seed(seed);
  ll::LlamaForSequenceClassification tree(tiny());
  perturb_norms(*tree);
  ll::save_pretrained(tree, dir);
  auto seq = ll::sequence_classifier_sequential(tiny());
  ll::load_weights(*seq, st::Checkpoint(dir), false, ll::sequential_to_hf);
  return {tree, seq};
}
}  // namespace

// The classifier's Sequential: per-position scores pooled at the last token that is not
// padding give the tree's logits bitwise (rows padded to different lengths), and it saves as a
// LlamaForSequenceClassification.
TEST(Llama, SequentialClassifierEqualsTheModuleTree) {
  TempDir d;
  auto [tree, seq] = saved_classifier(7, d.path);
  auto ids = token_ids(3, 11);
  ids[1].narrow(0, 6, 5).fill_(0);  // pad_token_id 0: row 1 pools position 5, row 2 the last
  ids[0].narrow(0, 9, 2).fill_(0);
  const auto positions = ll::pooled_positions(ids, 0);
  EXPECT_EQ(positions[0].item<int64_t>(), 8);
  EXPECT_EQ(positions[1].item<int64_t>(), 5);
  EXPECT_EQ(positions[2].item<int64_t>(), 10);
  EXPECT_TRUE(same_bits(ll::pool_scores(seq->forward(ids), positions), tree(ids)));
  EXPECT_EQ(ll::pooled_positions(ids, -1)[1].item<int64_t>(), 10);
  TempDir d2;
  ll::save_pretrained(seq, tiny(), d2.path);
  std::ifstream config(d2.path + "/config.json");
  const std::string text((std::istreambuf_iterator<char>(config)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"LlamaForSequenceClassification\""), std::string::npos) << text;
  EXPECT_TRUE(same_bits(ll::load_sequence_classifier(d2.path)(ids), tree(ids)));
}

// What `module` holds of each parameter (its placements, tandem/placement.h), or of each
// parameter's held elements [first, first + count) when count >= 0, read from `source`.
void read_held(torch::nn::Module& module, int64_t replica, const tandem::ParameterSource& source, int64_t first = 0,
               int64_t count = -1) {
  auto named = module.named_parameters();
  torch::NoGradGuard ng;
  for (auto& p : tandem::parameter_placements(module, replica)) {
    std::vector<int64_t> shape;
    if (!source.find(p.dense_name, &shape)) continue;
    ASSERT_EQ(shape, p.placement.global_shape) << p.dense_name;
    auto pl = count < 0 ? p.placement : p.placement.flat_range(first, first + count);
    auto flat = named[p.name].detach().view({-1}).narrow(0, pl.flat_begin, pl.held_numel());
    for (const auto& r : tandem::placement_runs(pl))
      source.read(p.dense_name, r.global, flat.narrow(0, r.held, r.length));
  }
}

// A rank reads only what it holds: the last stage of a two-stage pipeline (layer1, norm, score)
// and tensor-parallel rank r of 2 of a decoder layer (q/k/v and gate/up rows, o and down columns,
// norms whole) read exactly their parameters' bytes through their placements, and hold what
// cutting the whole loaded model gives; so do flat ranges of each block (ZeRO-3's shards of it).
TEST(Llama, EachRankReadsOnlyItsStageAndShards) {
  TempDir d;
  const auto whole = saved_classifier(8, d.path).second;
  const auto fresh = ll::sequence_classifier_sequential(tiny());
  torch::nn::Sequential stage;
  const std::string names[] = {"embed_tokens", "layer0", "layer1", "norm", "score"};
  for (size_t i = 2; i < 5; ++i) stage->push_back(names[i], *(fresh->begin() + static_cast<std::ptrdiff_t>(i)));
  const st::Checkpoint for_stage(d.path);
  read_held(*stage, 0, *st::parameter_source(for_stage, ll::sequential_to_hf));
  expect_same_parameters(*stage, *whole);
  EXPECT_EQ(for_stage.bytes_read(), bytes_of(*stage));
  EXPECT_LT(for_stage.bytes_read(), bytes_of(*whole) / 2);

  auto tp = tandem::make_thread_communicators(2, tandem::CommOptions{});
  // The Sequential's child 2 is the checkpoint's decoder layer 1.
  const auto layer1 = [](const std::string& name) { return "model.layers.1." + name; };
  const auto& dense = *whole->ptr(2)->as<ll::SequentialDecoderLayerImpl>();
  const auto& random = *fresh->ptr(2)->as<ll::SequentialDecoderLayerImpl>();
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("tp rank " + std::to_string(r));
    ll::ParallelDecoderLayer cut(dense, tp[r]), read(random, tp[r]);
    const st::Checkpoint for_rank(d.path);
    read_held(*read, r, *st::parameter_source(for_rank, layer1));
    expect_same_parameters(*read, *cut);
    EXPECT_EQ(for_rank.bytes_read(), bytes_of(*read));
    EXPECT_LT(for_rank.bytes_read(), bytes_of(dense) * 2 / 3);
    // Flat ranges of the blocks, across the column blocks' row boundaries.
    for (int64_t first : {0, 3, 17}) {
      ll::ParallelDecoderLayer part(random, tp[r]);
      const st::Checkpoint from(d.path);
      int64_t held = 0, smallest = INT64_MAX;
      for (auto& p : part->parameters()) smallest = std::min(smallest, p.numel());
      const int64_t count = std::min<int64_t>(smallest - first, 29);
      read_held(*part, r, *st::parameter_source(from, layer1), first, count);
      auto got = part->named_parameters();
      for (auto& p : cut->named_parameters()) {
        const auto want = p.value().detach().reshape({-1}).narrow(0, first, count);
        EXPECT_TRUE(same_bits(got[p.key()].detach().reshape({-1}).narrow(0, first, count), want)) << p.key();
        held += count * p.value().element_size();
      }
      EXPECT_EQ(from.bytes_read(), held);
    }
  }
  // A checkpoint tensor of another shape than the placement's global one is reported.
  ll::ParallelDecoderLayer shard(random, tp[0]);
  std::vector<int64_t> shape;
  EXPECT_TRUE(st::parameter_source(st::Checkpoint(d.path), layer1)->find("self_attn.q_proj.weight", &shape));
  EXPECT_NE(shape, shard->self_attn->q_proj->weight.sizes().vec());
  EXPECT_THROW(st::parameter_source(st::Checkpoint(d.path), layer1)->find("no_such.weight", &shape),
               std::runtime_error);
}
