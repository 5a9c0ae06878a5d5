// Selective recomputation (--activation-checkpointing selective, tandem/activation_checkpoint.h):
// the Llama decoder layers (the module tree and the Sequential form, causal and packed-document
// attention) and Tandem's transformer blocks (causal, padded, packed documents) give the losses
// and gradients of the plain forward and recompute in backward; they hold less activation memory
// than the plain forward and more than whole-layer recomputation (measured by MemoryMeter);
// the word parses, and a model without transformer layers is refused naming its layers.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>

#include "tandem/activation_checkpoint.h"
#include "tandem/llama.h"
#include "tandem/models.h"
#include "tandem/pipeline.h"

namespace tandem {
namespace {

// tests/unit/test_llama.cpp's model: grouped-query attention (4 query heads, 2 key/value heads).
llama::LlamaConfig llama_config(int64_t separator = -1) {
  llama::LlamaConfig c;
  c.vocab_size = 300;
  c.hidden_size = 64;
  c.intermediate_size = 176;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 5000.0;
  c.document_separator = separator;
  return c;
}

models::TransformerConfig transformer_config(int64_t pad_id = -1, int64_t eos_id = -1) {
  auto c = models::transformer_tiny_config();
  c.pad_id = pad_id;
  c.eos_id = eos_id;
  return c;
}

// Token ids [4, 48] with some 7s (the packed models' separator) and 0s (the padded one's pad).
torch::Tensor ids_for(int64_t vocab) {
  auto g = at::detail::createCPUGenerator(5);
  auto ids = torch::randint(1, vocab, {4, 48}, g);
  ids.index_put_({0, 10}, 7);
  ids.index_put_({1, 30}, 7);
  ids.index_put_({2, torch::indexing::Slice(40, torch::indexing::None)}, 0);
  return ids;
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-30);
}

struct Pass {
  at::Tensor loss;
  std::map<std::string, at::Tensor> grads;
  int64_t held_bytes = 0;  // allocated after the forward and loss above before: what backward keeps
  double recompute_seconds = 0.0;
};

// Next-token loss of `net` (turned to `policy`) on ids, its gradients and what its forward holds.
Pass run(torch::nn::Sequential net, const std::string& policy, const torch::Tensor& ids) {
  MemoryMeter::install();
  net = checkpoint_sequential(net, parse_activation_checkpointing(policy));
  net->zero_grad();
  Pass p;
  const double recompute_before = recompute_seconds();
  const int64_t before = MemoryMeter::current_bytes();
  auto logits = net->forward(ids);
  p.loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), ids.reshape({-1}));
  logits = at::Tensor();
  p.held_bytes = MemoryMeter::current_bytes() - before;
  p.loss.backward();
  p.recompute_seconds = recompute_seconds() - recompute_before;
  for (const auto& item : net->named_parameters())
    if (item.value().grad().defined()) p.grads[item.key()] = item.value().grad().clone();
  p.loss = p.loss.detach();
  return p;
}

using Builder = std::function<torch::nn::Sequential()>;

// Selective recomputation's loss and gradients equal the plain forward's (float64: rel <= 1e-6
// holds with margin), and it recomputed something.
void expect_same_as_plain(const Builder& build, int64_t vocab, const std::string& what) {
  SCOPED_TRACE(what);
  const auto ids = ids_for(vocab);
  auto make = [&] {
    auto net = build();
    net->to(torch::kDouble);
    return net;
  };
  const auto plain = run(make(), "none", ids);
  const auto selective = run(make(), "selective", ids);
  EXPECT_EQ(plain.recompute_seconds, 0.0);
  EXPECT_GT(selective.recompute_seconds, 0.0) << "nothing was recomputed";
  EXPECT_LE(rel_err(selective.loss, plain.loss), 1e-6);
  ASSERT_EQ(plain.grads.size(), selective.grads.size());
  for (const auto& [name, g] : plain.grads) {
    ASSERT_TRUE(selective.grads.count(name)) << name << " got no gradient";
    EXPECT_LE(rel_err(selective.grads.at(name), g), 1e-6) << name;
  }
}

TEST(SelectiveRecompute, LlamaEqualsThePlainForward) {
  expect_same_as_plain(
      [] {
        torch::manual_seed(3);
        return llama::causal_lm_sequential(llama_config());
      },
      300, "causal LM");
  expect_same_as_plain(
      [] {
        torch::manual_seed(3);
        return llama::causal_lm_sequential(llama_config(7));
      },
      300, "packed documents");
}

TEST(SelectiveRecompute, TransformerEqualsThePlainForward) {
  expect_same_as_plain(
      [] {
        torch::manual_seed(4);
        return models::transformer(transformer_config());
      },
      256, "causal");
  expect_same_as_plain(
      [] {
        torch::manual_seed(4);
        return models::transformer(transformer_config(0));
      },
      256, "padded");
  expect_same_as_plain(
      [] {
        torch::manual_seed(4);
        return models::transformer(transformer_config(-1, 7));
      },
      256, "packed documents");
}

// The module tree (LlamaForCausalLM, as transformers' and `finetune` without a Sequential cut):
// its decoder layers recompute selectively too.
TEST(SelectiveRecompute, LlamaModuleTreeEqualsThePlainForward) {
  const auto ids = ids_for(300);
  std::map<std::string, at::Tensor> grads[2];
  double losses[2];
  for (int selective = 0; selective < 2; ++selective) {
    torch::manual_seed(6);
    llama::LlamaForCausalLM m(llama_config());
    m->to(torch::kDouble);
    for (auto& layer : *m->model->layers) layer->as<llama::DecoderLayerImpl>()->set_selective(selective == 1);
    const double before = recompute_seconds();
    auto logits = m(ids);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 300}), ids.reshape({-1}));
    loss.backward();
    EXPECT_EQ(recompute_seconds() > before, selective == 1);
    losses[selective] = loss.item<double>();
    for (const auto& item : m->named_parameters()) grads[selective][item.key()] = item.value().grad().clone();
  }
  EXPECT_NEAR(losses[1], losses[0], 1e-6 * std::abs(losses[0]));
  for (const auto& [name, g] : grads[0]) EXPECT_LE(rel_err(grads[1].at(name), g), 1e-6) << name;
}

// float32, as trained: none > selective > every in bytes the forward leaves for backward. On the
// Llama selective frees about a quarter (norms' float copies, rotated and repeated q/k/v, the
// attention output, silu(gate)); on Tandem's transformer only the softmax statistics (the CPU's
// fused attention keeps no probabilities; LayerNorm and GELU keep nothing recomputation frees).
void expect_between(const Builder& build, int64_t vocab, const std::string& what) {
  SCOPED_TRACE(what);
  const auto ids = ids_for(vocab);
  const auto none = run(build(), "none", ids).held_bytes;
  const auto selective = run(build(), "selective", ids).held_bytes;
  const auto every = run(build(), "every", ids).held_bytes;
  std::cout << what << ": activations held after the forward: none " << none << ", selective " << selective
            << ", every " << every << " bytes\n";
  EXPECT_LT(selective, none) << "selective recomputation frees nothing";
  EXPECT_GT(selective, every) << "selective recomputation keeps less than whole-layer recomputation";
}

TEST(SelectiveRecompute, HoldsLessThanThePlainForwardMoreThanEveryLayer) {
  expect_between(
      [] {
        torch::manual_seed(3);
        return llama::causal_lm_sequential(llama_config());
      },
      300, "Llama");
  expect_between(
      [] {
        torch::manual_seed(4);
        return models::transformer(transformer_config());
      },
      256, "transformer");
}

TEST(SelectiveRecompute, ParsesAndRefusesAModelWithoutTransformerLayers) {
  const auto a = parse_activation_checkpointing("selective");
  EXPECT_EQ(a.mode, ActivationCheckpointing::Mode::kSelective);
  EXPECT_TRUE(a.enabled());
  EXPECT_EQ(to_string(a), "selective");
  try {
    parse_activation_checkpointing("selected");
    ADD_FAILURE() << "'selected' was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("selective"), std::string::npos) << e.what();
  }
  auto mlp = models::mlp(8, {16, 16}, 3);
  try {
    checkpoint_sequential(mlp, a);
    ADD_FAILURE() << "an MLP was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("torch::nn::LinearImpl"), std::string::npos) << what;
    EXPECT_NE(what.find("use --activation-checkpointing every or N"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace tandem
