// tandem plan's mixture-of-experts model (tandem/plan.h, MoeSpec): parameters, FLOPs, activations,
// expert-parallel memory, all-to-all traffic and the expert gradient reduction, against numbers
// worked out by hand for a small model, also with tensor-parallel experts beside ep; the Mixtral
// preset against its published size; the search over ep (and ep x tp) and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <stdexcept>
#include <string>

#include "tandem/plan.h"

namespace tp = tandem::plan;

namespace {

// 2 blocks, hidden 64, 4 heads (no grouping), 4 experts of width 128, top 2, seq 16, vocab 100.
// Parameters by hand: per block q, k, v, o 4 * 64^2 = 16384, router 64 * 4 = 256, norms 2 * 64 =
// 128, experts 4 * 3 * 64 * 128 = 98304; two blocks 2 * (16384 + 256 + 128) = 33536 dense and
// 196608 expert; embedding and LM head 2 * 100 * 64 = 12800, final norm 64. Dense 46400, total 243008.
tp::ModelSpec small_moe() { return tp::mixtral_model(2, 64, 4, 4, 128, 4, 2, 16, 100); }

tp::Layout layout(int dp, int ep, int zero, int64_t mb) {
  tp::Layout l;
  l.dp = dp;
  l.ep = ep;
  l.zero = zero;
  l.micro_batch = mb;
  l.micro_batches = 1;
  return l;
}

tp::PlanOptions fp32_adam(int64_t batch) {
  tp::PlanOptions o;
  o.precision = "fp32";  // parameters 4, gradients 4, Adam's two moments 8 bytes per parameter
  o.optimizer = "adam";
  o.global_batch = batch;
  return o;
}

}  // namespace

TEST(PlanMoe, ParametersFlopsAndActivationsByHand) {
  auto m = small_moe();
  EXPECT_NO_THROW(tp::validate(m));
  EXPECT_TRUE(tp::is_moe(m));
  EXPECT_EQ(tp::moe_layers(m), 2);
  EXPECT_DOUBLE_EQ(tp::expert_parameters(m), 196608.0);
  EXPECT_DOUBLE_EQ(m.parameters, 243008.0);
  // Forward FLOPs per sample: per token 2 * (dense 46400 + 2 slots x 2 blocks x 3 x 64 x 128 =
  // 98304 active expert weights) = 289408, times 16 tokens = 4630528; attention 4 * 2 * 16^2 * 64
  // = 131072. Total 4761600 (every expert counted would give 2 * 243008 * 16 + 131072 = 7907328).
  EXPECT_DOUBLE_EQ(tp::forward_flops_per_sample(m), 4761600.0);
  // Activations (float32 bytes): Llama's without the MLP, 4 * 16 * (2 * (11 * 64 + 2 * 64) + 2 *
  // 64 + 100) = 121088, and the MoE blocks' 2 blocks x 16 tokens x (2 slots x (2 * 64 + 4 * 128)
  // + 2 * 4 router values) x 4 bytes = 2 * 16 * 1288 * 4 = 164864. Total 285952.
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(m), 285952.0);

  // Capacity factor 0.5: one slot per token computed and held. FLOPs 2 * (46400 + 49152) * 16 +
  // 131072 = 3188736; MoE activations 2 * 16 * (640 + 8) * 4 = 82944.
  auto half = m;
  half.moe.capacity_factor = 0.5;
  EXPECT_DOUBLE_EQ(tp::moe_slots_per_token(half), 1.0);
  EXPECT_DOUBLE_EQ(tp::forward_flops_per_sample(half), 3188736.0);
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(half), 121088.0 + 82944.0);
  // Capacity factor 1.5: balanced routing computes the 2 slots, but the experts may receive 3 per
  // token: 2 * 16 * (3 * 640 + 8) * 4 = 246784 held.
  auto loose = m;
  loose.moe.capacity_factor = 1.5;
  EXPECT_DOUBLE_EQ(tp::moe_slots_per_token(loose), 2.0);
  EXPECT_DOUBLE_EQ(tp::moe_slots_held_per_token(loose), 3.0);
  EXPECT_DOUBLE_EQ(tp::forward_flops_per_sample(loose), 4761600.0);
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(loose), 121088.0 + 246784.0);
}

TEST(PlanMoe, ExpertParallelismDividesTheExpertState) {
  auto m = small_moe();
  auto c = tp::cluster_preset("h100x8");
  auto o = fp32_adam(8);
  // ep 1, no ZeRO: every parameter on each rank: 243008 * 4 = 972032 bytes; the experts' state
  // 196608 * (4 + 4 + 8) = 3145728.
  auto e1 = tp::estimate(m, c, layout(2, 1, 0, 4), o);
  ASSERT_TRUE(e1.feasible) << e1.why;
  EXPECT_DOUBLE_EQ(e1.memory.parameters, 972032.0);
  EXPECT_DOUBLE_EQ(e1.memory.expert_states, 3145728.0);
  // ep 2 halves the experts: 46400 * 4 + 98304 * 4 = 578816 parameter bytes, expert state 1572864.
  auto e2 = tp::estimate(m, c, layout(2, 2, 0, 4), o);
  ASSERT_TRUE(e2.feasible) << e2.why;
  EXPECT_DOUBLE_EQ(e2.memory.parameters, 578816.0);
  EXPECT_DOUBLE_EQ(e2.memory.expert_states, e1.memory.expert_states / 2);
  EXPECT_DOUBLE_EQ(e2.memory.gradients, 578816.0);
  EXPECT_DOUBLE_EQ(e2.memory.optimizer, 2 * 578816.0);
  // Balanced routing: a rank's experts receive as many token slots whatever the ep.
  EXPECT_DOUBLE_EQ(e2.memory.activations, e1.memory.activations);
  EXPECT_GT(e2.memory.expert_activations, 0.0);
  EXPECT_LT(e2.memory.expert_activations, e2.memory.activations);
  // ZeRO-1 on dp 4, ep 2: the dense moments over 4 ranks (46400 * 8 / 4 = 92800), the experts'
  // over the dp / ep = 2 ranks holding the same ones (98304 * 8 / 2 = 393216).
  o.global_batch = 16;
  auto z1 = tp::estimate(m, c, layout(4, 2, 1, 4), o);
  ASSERT_TRUE(z1.feasible) << z1.why;
  EXPECT_DOUBLE_EQ(z1.memory.optimizer, 92800.0 + 393216.0);
  EXPECT_DOUBLE_EQ(z1.memory.expert_states, 98304.0 * 8 + 393216.0);
  // ZeRO-3 with ep: the experts stay at ZeRO-1 (the Engine's expert bank keeps its weights and
  // gradients whole); without ep ZeRO-3 shards them with the dense weights.
  auto z3 = tp::estimate(m, c, layout(4, 2, 3, 4), o);
  ASSERT_TRUE(z3.feasible) << z3.why;
  EXPECT_DOUBLE_EQ(z3.memory.expert_states, z1.memory.expert_states);
  auto z3_ep1 = tp::estimate(m, c, layout(4, 1, 3, 4), o);
  ASSERT_TRUE(z3_ep1.feasible) << z3_ep1.why;
  EXPECT_DOUBLE_EQ(z3_ep1.memory.expert_states, 196608.0 * 16 / 4);
}

TEST(PlanMoe, AllToAllBytesAndSecondsByHand) {
  auto m = small_moe();
  // (ep - 1) / ep of top_k * tokens * hidden values: 3/4 * 2 * 16 * 64 * 4 bytes = 6144.
  EXPECT_DOUBLE_EQ(tp::all_to_all_bytes(m, 4, 16, 4.0), 6144.0);
  EXPECT_DOUBLE_EQ(tp::all_to_all_bytes(m, 1, 16, 4.0), 0.0);
  auto half = m;
  half.moe.capacity_factor = 0.5;  // half the slots kept and sent
  EXPECT_DOUBLE_EQ(tp::all_to_all_bytes(half, 4, 16, 4.0), 3072.0);

  // Within a node (NVLink 4: 450 GB/s, 5 us): (ep - 1) alpha + bytes / B.
  auto c = tp::cluster_preset("h100x8");
  tp::PlanOptions none;
  EXPECT_NEAR(tp::all_to_all_seconds(c, none, 4, 1, 8, 6144.0), 3 * 5e-6 + 6144.0 / 450e9, 1e-15);
  // 16 ranks over two nodes of 8: 7/15 of the bytes over NVLink, 8/15 over the node's 400 GB/s
  // shared by its 8 devices (50 GB/s each), 15 steps of the inter-node latency: 15e6 bytes take
  // 15 * 5e-6 + max(7e6 / 450e9, 8e6 / 50e9) = 7.5e-5 + 1.6e-4 = 2.35e-4 s.
  auto ib = tp::cluster_preset("h100-ib");
  EXPECT_NEAR(tp::all_to_all_seconds(ib, none, 16, 1, 32, 15e6), 2.35e-4, 1e-12);

  // In the estimate: dp 4 = ep 4, micro-batch 2 of 16 tokens: 32 tokens per rank, each of the 4
  // all-to-alls of the 2 MoE blocks sends 3/4 * 2 * 32 * 64 * 4 = 12288 bytes (float32):
  // 8 * 12288 = 98304 bytes and 8 * (15e-6 + 12288 / 450e9) s per step.
  auto e = tp::estimate(m, c, layout(4, 4, 0, 2), fp32_adam(8));
  ASSERT_TRUE(e.feasible) << e.why;
  EXPECT_DOUBLE_EQ(e.all_to_all_bytes, 98304.0);
  EXPECT_NEAR(e.all_to_all_s, 8 * (15e-6 + 12288.0 / 450e9), 1e-15);
  EXPECT_DOUBLE_EQ(e.comm_parts.at("ep all-to-all"), e.all_to_all_s);
  EXPECT_EQ(e.layout.strategy_name(), "dp4 ep4 tp1 pp1");
  // Without expert parallelism there is none, and the step is shorter by at least the all-to-alls
  // less what the smaller expert gradient reduction saves.
  auto e1 = tp::estimate(m, c, layout(4, 1, 0, 2), fp32_adam(8));
  EXPECT_EQ(e1.all_to_all_bytes, 0.0);
  EXPECT_EQ(e1.comm_parts.count("ep all-to-all"), 0u);
  EXPECT_DOUBLE_EQ(e.compute_s, e1.compute_s);
}

TEST(PlanMoe, ExpertGradientsReduceOverTheRanksHoldingThem) {
  auto m = small_moe();
  auto c = tp::cluster_preset("h100x8");
  tp::PlanOptions none;
  // dp 4, ep 2, DDP, float32: the dense gradients (46400 * 4 = 185600 bytes) all-reduced over 4
  // ranks, the experts' (98304 * 4 = 393216) over the 2 holding them:
  // 2*3*5e-6 + 2*3/4 * 185600 / 450e9  +  2*1*5e-6 + 2*1/2 * 393216 / 450e9.
  auto e = tp::estimate(m, c, layout(4, 2, 0, 2), fp32_adam(8));
  ASSERT_TRUE(e.feasible) << e.why;
  const double by_hand = 30e-6 + 1.5 * 185600 / 450e9 + 10e-6 + 393216 / 450e9;
  EXPECT_NEAR(e.comm_parts.at("dp allreduce"), by_hand, 1e-15);
  EXPECT_NEAR(by_hand,
              tp::collective_seconds(c, none, "allreduce", 4, 185600, 1) +
                  tp::collective_seconds(c, none, "allreduce", 2, 393216, 2),
              1e-15);
  // ep 1: everything over the 4 ranks, 243008 * 4 = 972032 bytes.
  auto e1 = tp::estimate(m, c, layout(4, 1, 0, 2), fp32_adam(8));
  EXPECT_NEAR(e1.comm_parts.at("dp allreduce"), 30e-6 + 1.5 * 972032 / 450e9, 1e-15);
  // dp = ep: no rank shares its experts, nothing to reduce for them.
  auto e4 = tp::estimate(m, c, layout(4, 4, 0, 2), fp32_adam(8));
  EXPECT_NEAR(e4.comm_parts.at("dp allreduce"), 30e-6 + 1.5 * 185600 / 450e9, 1e-15);
}

// Tensor-parallel experts beside expert parallelism: each tp rank holds its part of its ep
// group's experts (half the expert states of tp 1 with tp 2) and dispatches whole rows of the
// same tokens (the same all-to-all bytes per rank); an expert width tp does not divide is refused.
TEST(PlanMoe, TensorParallelExpertsBesideExpertParallelism) {
  auto m = small_moe();
  auto c = tp::cluster_preset("h100x8");
  auto l = layout(2, 2, 0, 2);
  auto lt = l;
  lt.tp = 2;
  const auto e = tp::estimate(m, c, l, fp32_adam(4)), et = tp::estimate(m, c, lt, fp32_adam(4));
  ASSERT_TRUE(e.feasible) << e.why;
  ASSERT_TRUE(et.feasible) << et.why;
  // 196608 expert parameters / (ep 2 x tp 2) x 16 bytes (fp32 weight, gradient, two moments).
  EXPECT_DOUBLE_EQ(et.memory.expert_states, 196608.0 / 4 * 16);
  EXPECT_DOUBLE_EQ(et.memory.expert_states, e.memory.expert_states / 2);
  EXPECT_DOUBLE_EQ(et.all_to_all_bytes, e.all_to_all_bytes);
  EXPECT_GT(et.all_to_all_bytes, 0.0);
  auto odd = tp::mixtral_model(2, 64, 4, 4, 126, 4, 2, 16, 100);
  auto bad = tp::estimate(
      odd, c,
      [&] {
        auto x = lt;
        x.tp = 4;
        return x;
      }(),
      fp32_adam(4));
  EXPECT_FALSE(bad.feasible);
  EXPECT_NE(bad.why.find("expert width 126"), std::string::npos) << bad.why;
}

TEST(PlanMoe, MixtralPresetMatchesItsPublishedSize) {
  auto m = tp::builtin_model("mixtral-8x7b");
  EXPECT_EQ(m.layers, 32);
  EXPECT_EQ(m.hidden, 4096);
  EXPECT_EQ(m.heads, 32);
  EXPECT_EQ(m.kv_heads, 8);
  EXPECT_EQ(m.vocab, 32000);
  EXPECT_EQ(m.moe.experts, 8);
  EXPECT_EQ(m.moe.top_k, 2);
  EXPECT_EQ(m.moe.intermediate, 14336);
  // 46.7 B parameters, 12.9 B active per token (Mixtral's paper and model card).
  EXPECT_NEAR(m.parameters / 1e9, 46.7, 0.05);
  const double s = static_cast<double>(m.seq);
  const double attention = 4.0 * m.layers * s * s * m.hidden;
  EXPECT_NEAR((tp::forward_flops_per_sample(m) - attention) / (2 * s) / 1e9, 12.9, 0.05);
  auto tiny = tp::builtin_model("moe_tiny");
  EXPECT_TRUE(tp::is_moe(tiny));
  EXPECT_NO_THROW(tp::validate(tiny));
}

TEST(PlanMoe, SearchCoversExpertParallelDegrees) {
  auto m = tp::builtin_model("mixtral-8x7b");
  auto c = tp::cluster_preset("h100x8");
  tp::PlanOptions o;
  o.global_batch = 16;
  o.zero_stages = {3};
  auto all = tp::plan(m, c, o);
  std::set<int> eps;
  bool ep_with_tp = false;
  for (const auto& e : all) {
    eps.insert(e.layout.ep);
    EXPECT_EQ(e.layout.dp % e.layout.ep, 0) << e.layout.strategy_name();
    EXPECT_EQ(m.moe.experts % e.layout.ep, 0) << e.layout.strategy_name();
    if (e.layout.ep > 1 && e.feasible) EXPECT_GT(e.all_to_all_s, 0.0) << e.layout.strategy_name();
    if (e.layout.ep > 1 && e.layout.tp > 1) ep_with_tp = true;
  }
  EXPECT_EQ(eps, (std::set<int>{1, 2, 4, 8}));
  EXPECT_TRUE(ep_with_tp) << "ep x tp layouts are searched";
  o.ep = 4;  // fixed, as --ep 4
  for (const auto& e : tp::plan(m, c, o)) EXPECT_EQ(e.layout.ep, 4) << e.layout.strategy_name();
  o.ep = 0;
  o.max_ep = 2;
  for (const auto& e : tp::plan(m, c, o)) EXPECT_LE(e.layout.ep, 2) << e.layout.strategy_name();
  // A dense model is priced without expert parallelism.
  o.max_ep = 8;
  for (const auto& e : tp::plan(tp::builtin_model("gpt2"), c, o)) EXPECT_EQ(e.layout.ep, 1);
}

TEST(PlanMoe, BadExpertParallelismIsRefused) {
  auto m = small_moe();
  auto c = tp::cluster_preset("h100x8");
  auto message = [&](const tp::Layout& l) {
    try {
      tp::estimate(m, c, l, fp32_adam(12));
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  // Both numbers named: 3 does not divide the 4 experts.
  const std::string three = message(layout(3, 3, 0, 4));
  EXPECT_NE(three.find("degree 3"), std::string::npos) << three;
  EXPECT_NE(three.find("4 experts"), std::string::npos) << three;
  const std::string not_dp = message(layout(6, 4, 0, 2));
  EXPECT_NE(not_dp.find("degree 4"), std::string::npos) << not_dp;
  EXPECT_NE(not_dp.find("6 data-parallel"), std::string::npos) << not_dp;
  auto dense = tp::builtin_model("gpt2");
  EXPECT_THROW(tp::estimate(dense, c, layout(2, 2, 0, 4), fp32_adam(8)), std::invalid_argument);
  tp::PlanOptions o = fp32_adam(8);
  o.ep = 3;
  EXPECT_THROW(tp::plan(m, c, o), std::invalid_argument);
  o.ep = 2;
  EXPECT_THROW(tp::plan(dense, c, o), std::invalid_argument);
  o.ep = 16;  // divides no dp of 8 devices (and not the 4 experts)
  EXPECT_THROW(tp::plan(m, c, o), std::invalid_argument);
  // Descriptions: top-k beyond the experts, no expert width, a negative capacity factor.
  auto bad = m;
  bad.moe.top_k = 5;
  EXPECT_THROW(tp::validate(bad), std::invalid_argument);
  bad = m;
  bad.moe.intermediate = 0;
  EXPECT_THROW(tp::validate(bad), std::invalid_argument);
  bad = m;
  bad.moe.capacity_factor = -1;
  EXPECT_THROW(tp::validate(bad), std::invalid_argument);
}

// Hugging Face configs: Mixtral 8x7B's own config.json (its published fields) gives the preset's
// model; a Llama config counts llama-7b's 6.74 B; other model types and missing fields are refused.
TEST(PlanMoe, HuggingFaceConfigsOfMixtralAndLlama) {
  const std::string mixtral = R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
    "max_position_embeddings": 32768, "tie_word_embeddings": false, "router_aux_loss_coef": 0.02})";
  auto m = tp::hf_config_model(mixtral);
  auto preset = tp::builtin_model("mixtral-8x7b");
  EXPECT_DOUBLE_EQ(m.parameters, preset.parameters);
  EXPECT_EQ(m.seq, 4096);  // 4096, under its 32768 positions
  EXPECT_EQ(m.moe.experts, 8);
  EXPECT_EQ(m.moe.top_k, 2);
  EXPECT_EQ(m.moe.intermediate, 14336);
  EXPECT_DOUBLE_EQ(tp::forward_flops_per_sample(m), tp::forward_flops_per_sample(preset));
  EXPECT_EQ(tp::hf_config_model(mixtral, 512).seq, 512);
  const std::string llama = R"({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000, "max_position_embeddings": 2048})";
  auto l = tp::hf_config_model(llama);
  EXPECT_FALSE(tp::is_moe(l));
  EXPECT_NEAR(l.parameters / 1e9, 6.74, 0.005);
  EXPECT_EQ(l.seq, 2048);
  // Tied embeddings: the LM head is the embedding, counted once (32000 * 4096 fewer).
  std::string tied = llama;
  tied.insert(tied.size() - 1, R"(, "tie_word_embeddings": true)");
  EXPECT_DOUBLE_EQ(tp::hf_config_model(tied).parameters, l.parameters - 32000.0 * 4096);
  try {
    tp::hf_config_model(R"({"model_type": "qwen2_moe", "hidden_size": 8})");
    FAIL() << "qwen2_moe accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("model_type 'qwen2_moe'"), std::string::npos) << e.what();
  }
  std::string no_experts = mixtral;
  no_experts.replace(no_experts.find("\"num_local_experts\""), 23, "\"local_experts_typo\": 8,");
  try {
    tp::hf_config_model(no_experts);
    FAIL() << "a Mixtral config without num_local_experts accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'num_local_experts' missing"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tp::hf_config_model("{not json"), std::invalid_argument);
}
