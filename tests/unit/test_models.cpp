// Tests for tandem/models.h: shapes, hand-computed parameter counts, forward passes against
// functional re-implementations, the transformer's causality, and the registry.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>

#include "tandem/models.h"

namespace tmod = tandem::models;

namespace {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}

torch::Tensor param(torch::nn::Module& m, const std::string& name) {
  auto p = m.named_parameters(true);
  auto* t = p.find(name);
  if (!t) throw std::runtime_error("no parameter " + name);
  return *t;
}

// Parameters of a TransformerConfig model, counted layer by layer.
int64_t transformer_params(const tmod::TransformerConfig& c) {
  const int64_t D = c.d_model, H = c.mlp_ratio * D;
  const int64_t embed = c.vocab * D + c.seq * D;
  const int64_t block = 2 * D                // ln1
                        + D * 3 * D + 3 * D  // fused qkv
                        + D * D + D          // proj
                        + 2 * D              // ln2
                        + D * H + H          // fc1
                        + H * D + D;         // fc2
  const int64_t out = c.num_classes == 0 ? D * c.vocab + c.vocab : D * c.num_classes + c.num_classes;
  return embed + c.layers * block + 2 * D + out;
}

torch::Tensor layer_norm_ref(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  auto mean = x.mean(-1, true);
  auto var = (x - mean).pow(2).mean(-1, true);
  return (x - mean) / torch::sqrt(var + 1e-5) * w + b;
}

}  // namespace

TEST(Models, OutputShapes) {
  torch::manual_seed(0);
  auto x = torch::randn({5, 1, 28, 28});
  EXPECT_EQ(tmod::mlp()->forward(x).sizes(), (std::vector<int64_t>{5, 10}));
  EXPECT_EQ(tmod::cnn()->forward(x).sizes(), (std::vector<int64_t>{5, 10}));
  EXPECT_EQ(tmod::cnn_bn()->forward(x).sizes(), (std::vector<int64_t>{5, 10}));
  EXPECT_EQ(tmod::mlp(12, {7}, 3)->forward(torch::randn({4, 3, 4})).sizes(), (std::vector<int64_t>{4, 3}));
  auto lm = tmod::transformer(tmod::transformer_tiny_config());
  auto ids = torch::randint(0, 256, {2, 16}, torch::kLong);
  EXPECT_EQ(lm->forward(ids).sizes(), (std::vector<int64_t>{2, 16, 256}));
  tmod::TransformerConfig c = tmod::transformer_tiny_config();
  c.num_classes = 5;
  EXPECT_EQ(tmod::transformer(c)->forward(ids).sizes(), (std::vector<int64_t>{2, 5}));
  // Longer than the maximum sequence: a clear error.
  auto msg = error_of([&] { lm->forward(torch::zeros({1, 65}, torch::kLong)); });
  EXPECT_NE(msg.find("longer than the model's maximum 64"), std::string::npos) << msg;
}

TEST(Models, ParameterCountsMatchHandComputedValues) {
  // 784*1024+1024 + 1024*1024+1024 + 1024*10+10
  EXPECT_EQ(tmod::count_parameters(*tmod::mlp()), 1863690);
  // conv1 1*32*9+32, conv2 32*64*9+64, fc1 3136*128+128, fc2 128*10+10
  EXPECT_EQ(tmod::count_parameters(*tmod::cnn()), 320 + 18496 + 401536 + 1290);
  EXPECT_EQ(tmod::count_parameters(*tmod::cnn()), 421642);
  // + BatchNorm weight and bias (32 + 64 channels); running stats are buffers, not parameters.
  auto bn = tmod::cnn_bn();
  EXPECT_EQ(tmod::count_parameters(*bn), 421642 + 2 * 32 + 2 * 64);
  EXPECT_EQ(bn->buffers().size(), 6u);  // running_mean, running_var, num_batches_tracked x 2
  // tiny: 256*64 + 64*64 embeddings, 2 x 49984 per block, final LN 128, head 64*256+256
  EXPECT_EQ(tmod::count_parameters(*tmod::transformer(tmod::transformer_tiny_config())), 137216);
  EXPECT_EQ(transformer_params(tmod::transformer_tiny_config()), 137216);
  tmod::TransformerConfig c{1000, 96, 6, 3, 40, 2, 7};
  EXPECT_EQ(tmod::count_parameters(*tmod::transformer(c)), transformer_params(c));
  EXPECT_EQ(tmod::count_parameters(*tmod::mlp(5, {}, 2)), 12);
}

TEST(Models, SequentialStructureForPipelineSplitting) {
  EXPECT_EQ(tmod::cnn()->size(), 10u);
  EXPECT_EQ(tmod::cnn_bn()->size(), 12u);
  EXPECT_EQ(tmod::mlp()->size(), 6u);  // flatten, (linear, relu) x 2, linear
  EXPECT_EQ(tmod::transformer(tmod::transformer_tiny_config())->size(), 2u + 2u + 1u);
}

TEST(Models, MlpAndCnnMatchFunctionalReference) {
  torch::manual_seed(1);
  auto x = torch::randn({3, 1, 28, 28});
  auto m = tmod::mlp(784, {20, 30}, 10);
  auto xf = x.flatten(1);
  auto h1 = torch::relu(torch::nn::functional::linear(xf, param(*m, "1.weight"), param(*m, "1.bias")));
  auto h2 = torch::relu(torch::nn::functional::linear(h1, param(*m, "3.weight"), param(*m, "3.bias")));
  auto ref = torch::nn::functional::linear(h2, param(*m, "5.weight"), param(*m, "5.bias"));
  EXPECT_TRUE(torch::allclose(m->forward(x), ref, 1e-5, 1e-6));

  auto c = tmod::cnn();
  auto y = torch::conv2d(x, param(*c, "0.weight"), param(*c, "0.bias"), 1, 1);
  y = torch::max_pool2d(torch::relu(y), 2);
  y = torch::conv2d(y, param(*c, "3.weight"), param(*c, "3.bias"), 1, 1);
  y = torch::max_pool2d(torch::relu(y), 2).flatten(1);
  y = torch::relu(torch::nn::functional::linear(y, param(*c, "7.weight"), param(*c, "7.bias")));
  y = torch::nn::functional::linear(y, param(*c, "9.weight"), param(*c, "9.bias"));
  EXPECT_TRUE(torch::allclose(c->forward(x), y, 1e-4, 1e-5));
}

TEST(Models, TransformerBlockMatchesExplicitAttention) {
  torch::manual_seed(2);
  const int64_t B = 2, T = 5, D = 16, H = 4, hd = D / H;
  tmod::TransformerBlock block(D, H, 3);
  block->to(torch::kDouble);
  {
    // Non-trivial LayerNorm parameters so that they are exercised too.
    torch::NoGradGuard g;
    for (auto& p : block->parameters()) p.add_(torch::randn_like(p) * 0.1);
  }
  auto x = torch::randn({B, T, D}, torch::kDouble);
  auto out = block->forward(x);

  auto h = layer_norm_ref(x, block->ln1->weight, block->ln1->bias);
  auto qkv = torch::matmul(h, block->qkv->weight.t()) + block->qkv->bias;  // [B,T,3D]
  auto chunks = qkv.chunk(3, -1);
  auto heads = [&](const torch::Tensor& t) { return t.reshape({B, T, H, hd}).permute({0, 2, 1, 3}); };
  auto q = heads(chunks[0]), k = heads(chunks[1]), v = heads(chunks[2]);
  auto scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(double(hd));
  auto future = torch::ones({T, T}, torch::kBool).triu(1);
  scores = scores.masked_fill(future, -INFINITY);
  auto att = torch::matmul(torch::softmax(scores, -1), v).permute({0, 2, 1, 3}).reshape({B, T, D});
  auto r = x + torch::matmul(att, block->proj->weight.t()) + block->proj->bias;
  auto m =
      torch::matmul(layer_norm_ref(r, block->ln2->weight, block->ln2->bias), block->fc1->weight.t()) + block->fc1->bias;
  m = 0.5 * m * (1 + torch::erf(m / std::sqrt(2.0)));
  auto ref = r + torch::matmul(m, block->fc2->weight.t()) + block->fc2->bias;
  EXPECT_TRUE(torch::allclose(out, ref, 1e-9, 1e-10)) << (out - ref).abs().max();
}

TEST(Models, TransformerLanguageModelIsCausal) {
  torch::manual_seed(3);
  tmod::TransformerConfig c{50, 32, 4, 2, 16, 4, 0};
  auto lm = tmod::transformer(c);
  auto ids = torch::randint(0, 50, {3, 16}, torch::kLong);
  auto out = lm->forward(ids);
  for (int64_t t : {0, 7, 15}) {
    auto ids2 = ids.clone();
    ids2.select(1, t).add_(1).remainder_(50);
    auto out2 = lm->forward(ids2);
    if (t > 0) {
      EXPECT_TRUE(torch::allclose(out.narrow(1, 0, t), out2.narrow(1, 0, t), 1e-5, 1e-6))
          << "position < " << t << " changed";
    }
    // Positions t.. see the change.
    for (int64_t u = t; u < 16; ++u) {
      EXPECT_GT((out.select(1, u) - out2.select(1, u)).abs().max().item<float>(), 1e-4) << "t=" << t << " u=" << u;
    }
  }
  // A shorter prefix gives the same outputs as the corresponding positions of the full input.
  auto prefix = lm->forward(ids.narrow(1, 0, 6));
  EXPECT_TRUE(torch::allclose(prefix, out.narrow(1, 0, 6), 1e-5, 1e-6));
}

// Packed documents (config.eos_id): each document of a packed row gets the logits it gets
// alone (positions from 0, attention within itself), as Megatron-LM's reset_position_ids and
// reset_attention_mask; the same weights without the reset (an eos_id absent from the row) differ.
TEST(Models, TransformerPackedDocumentsEqualEachDocumentAlone) {
  torch::manual_seed(5);
  const int eos = 2;
  tmod::TransformerConfig c{40, 32, 4, 2, 16, 4, 0};
  c.eos_id = eos;
  auto lm = tmod::transformer(c);
  lm->eval();
  // Three documents of 5, 7 and 4 tokens (the last one cut by the window: no EOS).
  auto docs = std::vector<torch::Tensor>{torch::tensor({7, 9, 11, 13, eos}, torch::kLong),
                                         torch::tensor({21, 5, 8, 30, 17, 4, eos}, torch::kLong),
                                         torch::tensor({12, 6, 33, 19}, torch::kLong)};
  auto row = torch::cat(docs).unsqueeze(0);
  torch::NoGradGuard ng;
  auto packed = lm->forward(row);
  ASSERT_EQ(packed.sizes(), (std::vector<int64_t>{1, 16, 40}));
  int64_t at = 0;
  for (const auto& d : docs) {
    auto alone = lm->forward(d.unsqueeze(0));
    const int64_t n = d.size(0);
    EXPECT_TRUE(torch::allclose(packed.narrow(1, at, n), alone, 0.0, 1e-5))
        << "document at " << at << ": max difference " << (packed.narrow(1, at, n) - alone).abs().max().item<float>();
    at += n;
  }
  // The control: the same weights with an EOS that never occurs see one 16-token sequence.
  tmod::TransformerConfig whole = c;
  whole.eos_id = 39;
  auto plain = tmod::transformer(whole);
  plain->eval();
  auto mine = lm->named_parameters();
  for (auto& p : plain->named_parameters()) p.value().copy_(mine[p.key()]);
  auto unreset = plain->forward(row);
  EXPECT_TRUE(torch::allclose(unreset.narrow(1, 0, 5), packed.narrow(1, 0, 5), 0.0, 1e-5));  // the first document
  EXPECT_GT((unreset.narrow(1, 5, 11) - packed.narrow(1, 5, 11)).abs().max().item<float>(), 1e-3);
  // The mask itself: query 6 (second document, position 1) sees keys 5 and 6 only.
  auto m = tmod::document_attention_mask(torch::tensor({0, 1, 2, 0, 1}, torch::kFloat).view({1, 5, 1}));
  EXPECT_TRUE(m[0][0][4].equal(torch::tensor({false, false, false, true, true})));
  tmod::TransformerConfig bad = c;
  bad.pad_id = 0;
  EXPECT_NE(error_of([&] { tmod::transformer(bad); }).find("without pad_id"), std::string::npos);
}

TEST(Models, TransformerTrainsAndRejectsBadConfig) {
  // One intra-op thread: tiny ops on a shared 2-core machine are ~8x slower with two.
  struct ThreadGuard {
    int prev = torch::get_num_threads();
    ThreadGuard() { torch::set_num_threads(1); }
    ~ThreadGuard() { torch::set_num_threads(prev); }
  } threads;
  torch::manual_seed(4);
  tmod::TransformerConfig c{20, 32, 4, 1, 8, 2, 3};
  auto net = tmod::transformer(c);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(3e-3));
  // Class = first token mod 3: learnable only by attending back to position 0.
  auto ids = torch::randint(0, 20, {64, 8}, torch::kLong);
  auto y = ids.select(1, 0).remainder(3);
  float first = 0, last = 0;
  for (int i = 0; i < 150; ++i) {
    auto loss = torch::nn::functional::cross_entropy(net->forward(ids), y);
    if (i == 0) first = loss.item<float>();
    last = loss.item<float>();
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  EXPECT_LT(last, 0.3f * first) << "first " << first << " last " << last;

  tmod::TransformerConfig bad = c;
  bad.d_model = 30;
  bad.heads = 4;
  auto msg = error_of([&] { tmod::transformer(bad); });
  EXPECT_NE(msg.find("not divisible"), std::string::npos) << msg;
  bad = c;
  bad.layers = 0;
  EXPECT_THROW(tmod::transformer(bad), std::invalid_argument);
}

TEST(Models, RegistryBuildsKnownNamesAndListsThemOnError) {
  // The built-ins; the registry may also hold other tests' models (tests/unit/test_registry.cpp).
  const std::vector<std::string> builtin = {"mlp", "cnn", "cnn_bn", "transformer_tiny"};
  const auto names = tmod::model_names();
  ASSERT_GE(names.size(), builtin.size());
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + 4), builtin);
  for (const auto& name : builtin) {
    auto m = tmod::make_model(name);
    EXPECT_GT(tmod::count_parameters(*m), 0) << name;
  }
  EXPECT_EQ(tmod::count_parameters(*tmod::make_model("cnn")), 421642);
  auto msg = error_of([] { tmod::make_model("resnet50"); });
  EXPECT_NE(msg.find("resnet50"), std::string::npos) << msg;
  for (const char* n : {"mlp", "cnn", "cnn_bn", "transformer_tiny"}) {
    EXPECT_NE(msg.find(n), std::string::npos) << msg;
  }
  EXPECT_THROW(tmod::make_model("resnet50"), std::invalid_argument);
}
