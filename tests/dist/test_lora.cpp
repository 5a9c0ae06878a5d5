// LoRA adapters (tandem/lora.h) on the Llama Sequential form through the Engine: under single,
// ddp, zero1, zero3, tp2 and pp2 the losses and the trained adapters follow one process
// training the adapters alone in plain LibTorch; the frozen base comes out bitwise unchanged;
// the optimizer holds state for the adapters only (ZeRO: its share of them), DDP all-reduces
// only their gradients, ZeRO-3 keeps a shard of the frozen base, not the whole; and a checkpoint
// of the adapters alone resumes to the same next loss.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "tandem/engine.h"
#include "tandem/grid.h"
#include "tandem/llama.h"
#include "tandem/lora.h"
#include "tests/dist/dist_env.h"
#include "tests/dist/train_test_util.h"

namespace tandem::test {
namespace {

constexpr int64_t kVocab = 48, kSeq = 8, kBatch = 8;

llama::LlamaConfig config() {
  llama::LlamaConfig c;
  c.vocab_size = kVocab;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = kSeq;
  return c;
}

lora::LoraConfig lora_config() {
  lora::LoraConfig c;
  c.rank = 4;
  c.alpha = 8;
  c.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return c;
}

// The same adapted model on every call: seeded base, adapters whose B is not zero (so that the
// first forward already tells a wrong adapter from none).
torch::nn::Sequential adapted() {
  torch::manual_seed(5);
  auto seq = llama::causal_lm_sequential(config());
  lora::attach(*seq, lora_config());
  torch::NoGradGuard ng;
  for (auto& p : seq->named_parameters())
    if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0.0, 0.05);
  return seq;
}

std::pair<torch::Tensor, torch::Tensor> batch(uint64_t seed) {
  auto g = at::detail::createCPUGenerator(seed);
  auto ids = torch::randint(0, kVocab, {kBatch, kSeq + 1}, g);
  return {ids.narrow(1, 0, kSeq).contiguous(), ids.narrow(1, 1, kSeq).contiguous()};
}

const LossFn kNextToken = [](const at::Tensor& logits, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
};

OptimizerOptions adam() {
  OptimizerOptions o;
  o.kind = "adam";
  o.lr = 1e-2;
  return o;
}

std::map<std::string, torch::Tensor> values(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

struct Reference {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> trained;
};

// One process, plain LibTorch: Adam over the parameters that require gradients.
Reference reference(int steps) {
  auto seq = adapted();
  std::vector<torch::Tensor> trainable;
  for (auto& p : seq->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  torch::optim::Adam opt(trainable, torch::optim::AdamOptions(1e-2));
  Reference r;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(70 + s);
    opt.zero_grad();
    auto loss = kNextToken(seq->forward(x), y);
    loss.backward();
    opt.step();
    r.losses.push_back(loss.item<double>());
  }
  r.trained = values(*seq);
  return r;
}

struct Layout {
  const char* name;
  Strategy strategy;
  int tp, pp;
};

ParallelConfig layout_config(const Layout& l) {
  ParallelConfig c;
  c.strategy = l.strategy;
  c.tp = l.tp;
  c.pp = l.pp;
  if (l.pp > 1) c.micro_batches = 2;
  return c;
}

double step(Engine& eng, int s) {
  auto [x, y] = batch(70 + s);
  const int dp = eng.dp_size();
  if (dp > 1) {
    x = slice_for_rank(x, eng.dp_group()->rank(), dp);
    y = slice_for_rank(y, eng.dp_group()->rank(), dp);
  }
  auto l = eng.step(x, y, kNextToken).detach().reshape({1}).clone();  // the replica's loss on every stage
  eng.dp_group()->allreduce(l, ReduceOp::kAvg);
  return l.item<double>();
}

int64_t trainable_count() {
  int64_t n = 0;
  for (auto& p : adapted()->parameters())
    if (p.requires_grad()) n += p.numel();
  return n;
}

TEST(LoraLayouts, AdaptersTrainAsOneProcessAndTheBaseStaysFrozen) {
  ASSERT_EQ(runtime().world()->size(), 2) << "the layouts here are written for 2 ranks";
  const int steps = 3;
  const auto want = reference(steps);
  const auto initial = values(*adapted());
  const int64_t trainable = trainable_count();
  int64_t total_bytes = 0;
  for (auto& [n, t] : initial) total_bytes += t.numel() * 4;
  const Layout layouts[] = {{"ddp", Strategy::kDDP, 1, 1},     {"zero1", Strategy::kZero1, 1, 1},
                            {"zero3", Strategy::kZero3, 1, 1}, {"tp2", Strategy::kDDP, 2, 1},
                            {"pp2", Strategy::kDDP, 1, 2},     {"tp2 x zero3", Strategy::kZero3, 2, 1}};
  for (const auto& l : layouts) {
    SCOPED_TRACE(l.name);
    Engine eng(runtime(), adapted(), adam(), layout_config(l));
    EXPECT_EQ(eng.trainable_parameters(), trainable);
    for (int s = 0; s < steps; ++s) EXPECT_NEAR(step(eng, s), want.losses[s], 1e-5) << "step " << s;
    const auto full = eng.full_parameters();
    for (const auto& [name, value] : full) {
      if (name.find("lora_") != std::string::npos) {
        EXPECT_LT(rel_err(value, want.trained.at(name)), 1e-4) << name;
        EXPECT_FALSE(torch::equal(value, initial.at(name))) << name << " did not train";
      } else {
        EXPECT_TRUE(torch::equal(value, initial.at(name))) << name << " changed: the base must stay frozen";
      }
    }
    const auto st = eng.stats();
    const int dp = eng.dp_size();
    // Adam's two moments of the adapters (ZeRO: this rank's share, padded): 8 bytes a scalar.
    if (l.tp == 1 && l.pp == 1) {
      const double expected = 8.0 * trainable / (l.strategy == Strategy::kDDP ? 1 : dp);
      EXPECT_NEAR(st.memory.optimizer_state_bytes, expected, 0.01 * expected);
    }
    if (l.strategy == Strategy::kDDP && l.tp == 1 && l.pp == 1)
      EXPECT_EQ(st.ddp.bytes, 4 * trainable * steps) << "DDP all-reduced more than the adapters' gradients";
    if (l.strategy == Strategy::kZero3 && l.tp == 1) {
      EXPECT_LT(st.memory.parameter_bytes, 0.6 * total_bytes)
          << "ZeRO-3 holds " << st.memory.parameter_bytes << " bytes of " << total_bytes
          << ": the frozen base is not sharded";
    }
  }
}

// With dropout on the adapters' input, the tp ranks of a column-parallel layer must drop the
// same elements of their (replicated) input, or its whole A would drift apart between them.
TEST(LoraLayouts, DropoutKeepsReplicatedAdaptersInStep) {
  ASSERT_EQ(runtime().world()->size(), 2) << "the layouts here are written for 2 ranks";
  ParallelConfig c;
  c.strategy = Strategy::kDDP;
  c.tp = 2;
  auto trained = [&](double dropout) {
    torch::manual_seed(5);
    auto s = llama::causal_lm_sequential(config());
    auto lc = lora_config();
    lc.dropout = dropout;
    lora::attach(*s, lc);
    Engine eng(runtime(), s, adam(), c);
    for (int k = 0; k < 3; ++k) step(eng, k);
    std::map<std::string, torch::Tensor> a;  // the column-parallel layers' A matrices
    for (auto& p : eng.module().named_parameters())
      if (p.key().find("q_proj.lora_A") != std::string::npos || p.key().find("gate_proj.lora_A") != std::string::npos)
        a[p.key()] = p.value().detach().clone();
    for (auto& [name, mine] : a) {
      auto other = mine.clone();
      eng.grid()->tp()->broadcast(other, 0);
      EXPECT_TRUE(torch::equal(mine, other)) << name << " differs between the tp ranks (dropout " << dropout << ")";
    }
    return a;
  };
  const auto with = trained(0.3), without = trained(0.0);
  ASSERT_EQ(with.size(), 4u);
  // Dropout took part: the same run without it ends elsewhere.
  for (auto& [name, a] : with) EXPECT_FALSE(torch::equal(a, without.at(name))) << name;
}

// A checkpoint without the frozen base (EngineOptions::save_frozen off) resumes the adapters and
// the optimizer: the next loss is the uninterrupted run's.
TEST(LoraLayouts, AdapterOnlyCheckpointResumes) {
  ASSERT_EQ(runtime().world()->size(), 2) << "the layouts here are written for 2 ranks";
  const auto dir = shared_dir(*runtime().world(), "lora_ckpt");
  for (auto strategy : {Strategy::kDDP, Strategy::kZero3}) {
    SCOPED_TRACE(to_string(strategy));
    ParallelConfig c;
    c.strategy = strategy;
    EngineOptions eo;
    eo.save_frozen = false;
    const auto root = dir + "/" + to_string(strategy);
    double next = 0;
    {
      Engine eng(runtime(), adapted(), adam(), c, eo);
      step(eng, 0);
      step(eng, 1);
      eng.save(root);
      next = step(eng, 2);
    }
    Engine eng(runtime(), adapted(), adam(), c, eo);
    eng.load(root);
    EXPECT_NEAR(step(eng, 2), next, 1e-6);
  }
}

}  // namespace
}  // namespace tandem::test
