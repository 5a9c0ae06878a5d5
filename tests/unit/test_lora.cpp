// LoRA adapters (tandem/lora.h): the update s B A x beside a layer, what attach() freezes and
// refuses, merging, and PEFT adapter directories written and read back (or refused).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "tandem/llama.h"
#include "tandem/lora.h"
#include "tandem/safetensors.h"
#include "tests/unit/temp_dir.h"

namespace tandem::test {
namespace {

// A module that applies adapters (its forward would call lora::linear).
struct Block : torch::nn::Module, lora::Adaptable {
  Block() {
    q_proj = register_module("q_proj", torch::nn::Linear(6, 5));
    other = register_module("other", torch::nn::Linear(5, 3));
  }
  torch::nn::Linear q_proj{nullptr}, other{nullptr};
};

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Lora, AdapterAddsTheScaledLowRankUpdate) {
  torch::manual_seed(0);
  Block b;
  lora::LoraConfig c;
  c.rank = 2;
  c.alpha = 3;
  c.targets = {"q_proj"};
  const auto got = lora::attach(b, c);
  ASSERT_EQ(got.modules, std::vector<std::string>{"q_proj"});
  auto a = lora::adapter_of(*b.q_proj);
  ASSERT_TRUE(a);
  EXPECT_TRUE(torch::equal(a.up->weight, torch::zeros({5, 2}))) << "B starts at zero, as PEFT's";
  {
    torch::NoGradGuard ng;
    a.up->weight.normal_();
  }
  auto x = torch::randn({4, 6});
  const double s = 3.0 / 2.0;
  auto want = torch::nn::functional::linear(x, b.q_proj->weight, b.q_proj->bias) +
              s * x.matmul(a.down->weight.t()).matmul(a.up->weight.t());
  EXPECT_TRUE(torch::allclose(lora::linear(b.q_proj, x), want, 1e-6, 1e-6));
  auto merged = lora::merged_weight(b.q_proj->weight, a.down->weight, a.up->weight, s);
  EXPECT_TRUE(torch::allclose(torch::nn::functional::linear(x, merged, b.q_proj->bias), want, 1e-5, 1e-5));
  // rsLoRA scales by alpha / sqrt(r).
  c.rslora = true;
  EXPECT_DOUBLE_EQ(c.scaling(), 3.0 / std::sqrt(2.0));
  // The layer without an adapter is the plain layer.
  EXPECT_TRUE(torch::equal(lora::linear(b.other, want), b.other->forward(want)));
}

TEST(Lora, AttachFreezesEverythingButTheAdapters) {
  llama::LlamaConfig mc;
  mc.vocab_size = 32;
  mc.hidden_size = 16;
  mc.intermediate_size = 24;
  mc.num_hidden_layers = 2;
  mc.num_attention_heads = 4;
  mc.num_key_value_heads = 2;
  auto seq = llama::causal_lm_sequential(mc);
  lora::LoraConfig c;
  c.rank = 4;
  c.targets = {"q_proj", "v_proj", "down_proj"};
  const auto got = lora::attach(*seq, c);
  EXPECT_EQ(got.modules.size(), 6u);
  // q: 16 -> 16, v: 16 -> 8 (2 KV heads of 4), down: 24 -> 16; per layer r (in + out) each.
  const int64_t per_layer = 4 * (16 + 16) + 4 * (16 + 8) + 4 * (24 + 16);
  EXPECT_EQ(got.trainable, 2 * per_layer);
  int64_t trainable = 0;
  for (auto& p : seq->named_parameters()) {
    const bool adapter = p.key().find("lora_") != std::string::npos;
    EXPECT_EQ(p.value().requires_grad(), adapter) << p.key();
    if (p.value().requires_grad()) trainable += p.value().numel();
  }
  EXPECT_EQ(trainable, got.trainable);
  EXPECT_EQ(
      got.total, trainable + [&] {
        int64_t n = 0;
        for (auto& p : llama::causal_lm_sequential(mc)->parameters()) n += p.numel();
        return n;
      }());
  // A head trained whole (PEFT's modules_to_save).
  auto cls = llama::sequence_classifier_sequential(mc);
  c.trained_whole = {"score"};
  lora::attach(*cls, c);
  for (auto& p : cls->named_parameters())
    if (p.key().rfind("score.", 0) == 0 || p.key().find(".score.") != std::string::npos)
      EXPECT_TRUE(p.value().requires_grad()) << p.key();
}

TEST(Lora, RefusesWhatItCannotAdapt) {
  Block b;
  lora::LoraConfig c;
  c.targets = {"q_proj", "nonesuch"};
  const auto msg = message_of([&] { lora::attach(b, c); });
  EXPECT_NE(msg.find("nonesuch"), std::string::npos) << msg;
  EXPECT_NE(msg.find("other, q_proj"), std::string::npos) << "lists the linear layers: " << msg;
  // A Linear whose caller would ignore an adapter is refused, naming it.
  torch::nn::Sequential plain(torch::nn::Linear(4, 4));
  c.targets = {"0"};
  EXPECT_NE(message_of([&] { lora::attach(*plain, c); }).find("ignore an adapter"), std::string::npos);
  c.targets = {"q_proj"};
  c.rank = 0;
  EXPECT_NE(message_of([&] { lora::validate(c); }).find("--lora-rank"), std::string::npos);
  c.rank = 2;
  c.alpha = 0;
  EXPECT_NE(message_of([&] { lora::validate(c); }).find("--lora-alpha"), std::string::npos);
  c.alpha = 1;
  c.dropout = 1.0;
  EXPECT_NE(message_of([&] { lora::validate(c); }).find("--lora-dropout"), std::string::npos);
  c.dropout = 0;
  c.trained_whole = {"head"};
  EXPECT_NE(message_of([&] { lora::attach(b, c); }).find("head"), std::string::npos);
  EXPECT_EQ(lora::parse_targets(" q_proj, v_proj,,q_proj"), (std::vector<std::string>{"q_proj", "v_proj"}));
}

TEST(Lora, PeftAdapterDirectoryRoundTrip) {
  TempDir tmp;
  lora::LoraConfig c;
  c.rank = 2;
  c.alpha = 5;
  c.dropout = 0.05;
  c.rslora = true;
  c.targets = {"q_proj", "v_proj"};
  const std::map<std::string, at::Tensor> tensors = {{"model.layers.0.self_attn.q_proj.lora_A.weight",
                                                      torch::randn({2, 6})},
                                                     {"model.layers.0.self_attn.q_proj.lora_B.weight",
                                                      torch::randn({5, 2})}};
  lora::write_peft_adapter(tmp.path, c, "CAUSAL_LM", "/models/base", tensors);
  const auto a = lora::read_peft_adapter(tmp.path);
  EXPECT_EQ(a.config.rank, 2);
  EXPECT_DOUBLE_EQ(a.config.alpha, 5);
  EXPECT_DOUBLE_EQ(a.config.dropout, 0.05);
  EXPECT_TRUE(a.config.rslora);
  EXPECT_EQ(a.config.targets, c.targets);
  EXPECT_EQ(a.task_type, "CAUSAL_LM");
  EXPECT_EQ(a.base_model, "/models/base");
  safetensors::File f(a.weights);
  EXPECT_EQ(f.names().size(), 2u);
  EXPECT_TRUE(torch::equal(f.get("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"),
                           tensors.at("model.layers.0.self_attn.q_proj.lora_B.weight")));
  // What Tandem does not reproduce is refused, naming the file and the feature.
  auto rewrite = [&](const std::string& text) { std::ofstream(tmp.path + "/adapter_config.json") << text; };
  rewrite(R"({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "use_dora": true})");
  EXPECT_NE(message_of([&] { lora::read_peft_adapter(tmp.path); }).find("DoRA"), std::string::npos);
  rewrite(R"({"peft_type": "IA3", "target_modules": ["q_proj"]})");
  EXPECT_NE(message_of([&] { lora::read_peft_adapter(tmp.path); }).find("IA3"), std::string::npos);
  rewrite(R"({"peft_type": "LORA", "r": 4, "target_modules": ".*proj"})");
  EXPECT_NE(message_of([&] { lora::read_peft_adapter(tmp.path); }).find(".*proj"), std::string::npos);
  rewrite(R"({"peft_type": "LORA", "r": 0, "target_modules": ["q_proj"]})");
  EXPECT_NE(message_of([&] { lora::read_peft_adapter(tmp.path); }).find("--lora-rank"), std::string::npos);
  EXPECT_NE(message_of([&] { lora::read_peft_adapter(tmp.path + "/missing"); }).find("adapter_config.json"),
            std::string::npos);
}

// PEFT makes adapters (A and B random) over the fixture's LM and classifier; Tandem loads each
// into its Llama, and its logits equal PEFT's (max abs <= 1e-4); then Tandem writes the adapter
// itself, and PEFT, loading Tandem's directory strictly (every tensor name PEFT expects, no
// other), gives Tandem's logits again. The test venv is part of the test setup: without it the
// test fails.
TEST(LoraPeft, TandemLogitsEqualPeftsBothWays) {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "TANDEM_SOURCE_DIR unset (ctest sets it)";
  const std::string python = std::string(src) + "/.venv-hf/bin/python";
  ASSERT_EQ(::access(python.c_str(), X_OK), 0) << python << " missing: run scripts/setup-hf-venv.sh";
  const std::string env = "HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 " + python + " " + src;
  const std::string peft = env + "/tests/hf/peft_reference.py ";
  TempDir d;
  ASSERT_EQ(std::system((env + "/tests/hf/hf_fixture.py make " + d.path + " > " + d.file("fx.log")).c_str()), 0);
  torch::NoGradGuard ng;
  for (std::string task : {"lm", "classify"}) {
    SCOPED_TRACE(task);
    const bool lm = task == "lm";
    const auto base = d.file(lm ? "lm" : "cls"), made = d.file("peft-" + task), mine = d.file("tandem-" + task);
    ASSERT_EQ(std::system((peft + "make-adapter " + base + " " + made +
                           " --rank 4 --alpha 8 --rslora --seed 3 --task " + task +
                           " --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj > /dev/null")
                              .c_str()),
              0);
    auto adapter = lora::read_peft_adapter(made);
    EXPECT_TRUE(adapter.config.rslora);
    if (!lm) adapter.config.trained_whole = {"score"};  // PEFT lists "classifier" too, which Llama lacks
    std::shared_ptr<torch::nn::Module> model;
    std::function<torch::Tensor(const torch::Tensor&)> run;
    if (lm) {
      auto m = llama::load_causal_lm(base);
      model = m.ptr();
      run = [m](const torch::Tensor& x) mutable { return m(x); };
    } else {
      auto m = llama::load_sequence_classifier(base);
      model = m.ptr();
      run = [m](const torch::Tensor& x) mutable { return m(x); };
    }
    lora::attach(*model, adapter.config);
    const safetensors::File file(adapter.weights);
    std::map<std::string, at::Tensor> trained;
    for (auto& p : model->named_parameters()) {
      if (!p.value().requires_grad()) continue;
      p.value().copy_(file.get(lora::peft_name(p.key())));
      trained[p.key()] = p.value();
    }
    EXPECT_EQ(trained.size(), file.names().size()) << "every tensor of PEFT's file has its parameter";
    model->eval();
    auto ids = torch::randint(3, 700, {2, 12}, at::detail::createCPUGenerator(9));
    const auto logits = run(ids).contiguous();
    safetensors::save_file(d.file("ref-" + task + ".safetensors"), {{"ids", ids}, {"logits", logits}});
    EXPECT_EQ(std::system(
                  (peft + "check-adapter " + base + " " + made + " " + d.file("ref-" + task + ".safetensors")).c_str()),
              0)
        << "PEFT's adapter in Tandem";
    lora::write_peft_adapter(mine, adapter.config, lm ? "CAUSAL_LM" : "SEQ_CLS", base, trained);
    EXPECT_EQ(std::system(
                  (peft + "check-adapter " + base + " " + mine + " " + d.file("ref-" + task + ".safetensors")).c_str()),
              0)
        << "Tandem's adapter in PEFT";
  }
}

}  // namespace
}  // namespace tandem::test
