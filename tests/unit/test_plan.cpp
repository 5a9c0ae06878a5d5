// The scaling model of `tandem plan` against published figures (the ZeRO paper's memory example,
// Horovod's and Goyal et al.'s scaling efficiencies), against Tandem's own models (parameter counts
// from LibTorch), and against its own formulas computed another way.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "tandem/engine.h"
#include "tandem/models.h"
#include "tandem/pipeline.h"
#include "tandem/plan.h"
#include "tandem/report.h"

namespace tp = tandem::plan;

namespace {

tp::Estimate data_parallel(const tp::ModelSpec& m, const tp::ClusterSpec& c, int dp, int64_t per_device_batch,
                           const tp::PlanOptions& base, double bucket_bytes) {
  tp::PlanOptions o = base;
  o.global_batch = per_device_batch * dp;
  tp::Layout l;
  l.dp = dp;
  l.micro_batch = per_device_batch;
  l.micro_batches = 1;
  l.bucket_bytes = bucket_bytes;
  auto e = tp::estimate(m, c, l, o);
  EXPECT_TRUE(e.feasible) << e.why;
  return e;
}

}  // namespace

// Optimizer state per parameter in mixed precision: fp32 masters (4 bytes) plus 4 bytes per
// fp32 state tensor: LAMB keeps Adam's two moments, LARS one momentum buffer.
TEST(Plan, LayerwiseOptimizerState) {
  EXPECT_EQ(tp::state_bytes("mixed", "lamb").optimizer, 12);
  EXPECT_EQ(tp::state_bytes("mixed", "lars").optimizer, 8);
  EXPECT_EQ(tp::state_bytes("fp32", "lars").optimizer, 4);
  EXPECT_THROW(tp::state_bytes("fp32", "lion"), std::invalid_argument);
}

// ZeRO paper (Rajbhandari et al. 2020), fig. 1: Psi = 7.5B, Nd = 64, K = 12 (Adam, mixed precision):
// 120 GB, 31.4 GB, 16.6 GB, 1.9 GB for no sharding and stages 1, 2, 3.
TEST(Plan, ZeroPaperMemoryExample) {
  const auto b = tp::state_bytes("mixed", "adam");
  EXPECT_EQ(b.param, 2);
  EXPECT_EQ(b.grad, 2);
  EXPECT_EQ(b.optimizer, 12);
  const double published[] = {120.0, 31.4, 16.6, 1.9};
  for (int stage = 0; stage <= 3; ++stage) {
    const auto m = tp::zero_model_states(7.5e9, stage, 64, b);
    EXPECT_NEAR(m.total() / 1e9, published[stage], 0.05) << "stage " << stage;
  }
  // The same through estimate(): the zero-7.5b description on 64 devices, activations aside.
  tp::ClusterSpec c = tp::cluster_preset("a100-ib");
  c.groups[0].nodes = 8;
  tp::PlanOptions o;
  o.global_batch = 64;
  for (int stage = 0; stage <= 3; ++stage) {
    tp::Layout l;
    l.dp = 64;
    l.zero = stage;
    l.micro_batch = 1;
    auto e = tp::estimate(tp::builtin_model("zero-7.5b"), c, l, o);
    double states = e.memory.parameters + e.memory.gradients + e.memory.optimizer;
    EXPECT_NEAR(states / 1e9, published[stage], 0.05) << "stage " << stage;
  }
  // Stage 0 does not fit in 80 GB, stage 3 does: the reason names the memory.
  tp::Layout l0;
  l0.dp = 64;
  l0.micro_batch = 1;
  auto e0 = tp::estimate(tp::builtin_model("zero-7.5b"), c, l0, o);
  EXPECT_FALSE(e0.feasible);
  EXPECT_NE(e0.why.find("out of memory"), std::string::npos) << e0.why;
}

// Frozen parameters (LoRA) keep their parameter memory and ZeRO-3's sharding of it, but hold
// no gradient or optimizer state: the 7.5 B model with 1 % trainable.
TEST(Plan, FrozenParametersHoldNoGradientsOrOptimizerState) {
  tp::ClusterSpec c = tp::cluster_preset("a100-ib");
  c.groups[0].nodes = 8;
  tp::PlanOptions o;
  o.global_batch = 64;
  auto full = tp::builtin_model("zero-7.5b"), lora = full;
  lora.trainable_parameters = 0.01 * full.parameters;
  for (int stage : {0, 3}) {
    tp::Layout l;
    l.dp = 64;
    l.zero = stage;
    l.micro_batch = 1;
    const auto a = tp::estimate(full, c, l, o).memory, b = tp::estimate(lora, c, l, o).memory;
    EXPECT_DOUBLE_EQ(b.parameters, a.parameters) << "stage " << stage;
    EXPECT_NEAR(b.gradients, 0.01 * a.gradients, 1e-6 * a.gradients) << "stage " << stage;
    EXPECT_NEAR(b.optimizer, 0.01 * a.optimizer, 1e-6 * a.optimizer) << "stage " << stage;
  }
}

// Horovod (Sergeev & Del Balso 2018, docs/benchmarks): ResNet-101, batch 64 per GPU, 128 servers x
// 4 Pascal GPUs, RoCE 25 Gbit/s: 90 % scaling efficiency at 512 GPUs. Within 10 points.
TEST(Plan, HorovodResNet101On512Gpus) {
  const auto c = tp::cluster_preset("horovod-p100");
  ASSERT_EQ(tp::total_devices(c), 512);
  tp::PlanOptions o;
  o.precision = "fp32";
  o.optimizer = "sgd";
  const auto m = tp::builtin_model("resnet101");
  auto e = data_parallel(m, c, 512, 64, o, 64.0 * 1024 * 1024);  // Horovod's 64 MB fusion buffer
  EXPECT_NEAR(e.efficiency, 0.90, 0.10) << "predicted " << e.efficiency;
  // Sanity of the compute side: one P100 at the preset rate does ResNet-101 near the published
  // ~103 images/s per GPU (1656.82 images/s on 16 GPUs).
  auto one = data_parallel(m, c, 1, 64, o, 64.0 * 1024 * 1024);
  EXPECT_NEAR(one.samples_per_s, 103.6, 25.0);
  // On 1 Gbit/s instead the same job stops scaling: the model must see the network.
  auto slow = c;
  slow.inter.bandwidth = 0.125e9;
  auto es = data_parallel(m, slow, 512, 64, o, 64.0 * 1024 * 1024);
  EXPECT_LT(es.efficiency, 0.5);
}

// Goyal et al. 2017: ResNet-50, 32 images per GPU, Big Basin servers (8 P100 on NVLink, 50 Gbit
// Ethernet): ~90 % scaling efficiency from 8 to 256 GPUs. Within 10 points.
TEST(Plan, GoyalResNet50From8To256Gpus) {
  const auto c = tp::cluster_preset("goyal-p100");
  tp::PlanOptions o;
  o.precision = "fp32";
  o.optimizer = "sgd";
  const auto m = tp::builtin_model("resnet50");
  auto e8 = data_parallel(m, c, 8, 32, o, 25.0 * 1024 * 1024);
  auto e256 = data_parallel(m, c, 256, 32, o, 25.0 * 1024 * 1024);
  const double eff = (e256.samples_per_s / e8.samples_per_s) / 32.0;
  EXPECT_NEAR(eff, 0.90, 0.10) << "predicted " << eff;
  EXPECT_LT(eff, 1.0);
}

// The ring formulas, computed by hand for one case, and their relations.
TEST(Plan, AlphaBetaCollectives) {
  tp::AlphaBeta ab{10e-6, 10e9};
  const double s = 100e6;
  EXPECT_NEAR(tp::ring_allreduce_seconds(8, s, ab), 14 * 10e-6 + 2.0 * 7 / 8 * s / 10e9, 1e-12);
  EXPECT_NEAR(tp::ring_reduce_scatter_seconds(8, s, ab) + tp::ring_allgather_seconds(8, s, ab),
              tp::ring_allreduce_seconds(8, s, ab), 1e-12);
  EXPECT_EQ(tp::ring_allreduce_seconds(1, s, ab), 0.0);
  // Across nodes the slow link dominates: 2 nodes of 8 on 12.5 GB/s take longer than one node on NVLink.
  auto c = tp::cluster_preset("a100-eth");
  tp::PlanOptions o;
  double intra = tp::collective_seconds(c, o, "allreduce", 8, s);
  double inter = tp::collective_seconds(c, o, "allreduce", 16, s);
  EXPECT_GT(inter, 5 * intra);
  // Hierarchical bandwidth term: 2(m-1)/m * S / B_node across m = 2 nodes.
  EXPECT_GT(inter, 2.0 * 1 / 2 * s / c.inter.bandwidth);
}

// Tandem's built-in descriptions count the same parameters as the LibTorch models.
TEST(Plan, BuiltinModelsMatchLibTorch) {
  for (const std::string name : {"mlp", "cnn", "cnn_bn", "transformer_tiny"}) {
    auto module = tandem::models::make_model(name);
    EXPECT_EQ(static_cast<int64_t>(tp::builtin_model(name).parameters), tandem::models::count_parameters(*module))
        << name;
  }
}

// Pipeline bubble (p-1)/m, tensor-parallel communication, and the reasons layouts do not fit.
TEST(Plan, PipelineTensorParallelAndInfeasibility) {
  auto c = tp::cluster_preset("h100x8");
  auto m = tp::builtin_model("gpt3-1.3b");
  tp::PlanOptions o;
  o.global_batch = 64;
  tp::Layout l;
  l.dp = 1;
  l.pp = 4;
  l.tp = 2;
  l.micro_batch = 4;
  l.micro_batches = 16;
  auto e = tp::estimate(m, c, l, o);
  ASSERT_TRUE(e.feasible) << e.why;
  // (m + p - 1) slots, of which p - 1 are the bubble: bubble / busy time = (p-1)/m.
  const double slot = e.bubble_s / 3.0;
  EXPECT_NEAR(e.step_s, (16 + 3) * slot + e.exposed_comm_s + e.optimizer_s, 1e-9 * e.step_s);
  EXPECT_GE(slot * 16, e.compute_s);
  EXPECT_GT(e.comm_parts["tp allreduce"], 0.0);
  // More micro-batches, smaller bubble share.
  tp::Layout l2 = l;
  l2.micro_batch = 1;
  l2.micro_batches = 64;
  auto e2 = tp::estimate(m, c, l2, o);
  EXPECT_LT(e2.bubble_s / e2.step_s, e.bubble_s / e.step_s);
  // The zero-bubble schedules: a third (zb-h1) and a sixth (zb-v) of 1F1B's bubble, the step
  // shorter by the difference, the same activations (zb-v's on stage 0).
  for (auto [sched, share] :
       {std::pair{tandem::PipelineSchedule::kZBH1, 1.0 / 3}, std::pair{tandem::PipelineSchedule::kZBV, 1.0 / 6}}) {
    tp::PlanOptions oz = o;
    oz.pipeline_schedule = sched;
    auto ez = tp::estimate(m, c, l, oz);
    ASSERT_TRUE(ez.feasible) << ez.why;
    EXPECT_NEAR(ez.bubble_s, e.bubble_s * share, 1e-9 * e.bubble_s) << tandem::to_string(sched);
    EXPECT_NEAR(ez.step_s, e.step_s - (e.bubble_s - ez.bubble_s), 1e-9 * e.step_s) << tandem::to_string(sched);
    EXPECT_NEAR(ez.memory.activations, e.memory.activations, 1e-9 * e.memory.activations) << tandem::to_string(sched);
  }
  // 1F1B: at most p micro-batches of activations in flight (not m).
  tp::Layout l3 = l;
  l3.micro_batches = 2;
  l3.micro_batch = 32;
  auto e3 = tp::estimate(m, c, l3, o);
  EXPECT_NEAR(e3.memory.activations / e.memory.activations, (2.0 * 32) / (4.0 * 4), 1e-9);

  tp::Layout bad_heads = l;
  bad_heads.tp = 8;
  bad_heads.pp = 1;
  bad_heads.micro_batch = 64;
  bad_heads.micro_batches = 1;
  auto m12 = tp::builtin_model("gpt2");  // 12 heads
  auto eb = tp::estimate(m12, c, bad_heads, o);
  EXPECT_FALSE(eb.feasible);
  EXPECT_NE(eb.why.find("indivisible heads"), std::string::npos) << eb.why;
  tp::Layout deep = l;
  deep.tp = 1;
  deep.pp = 8;
  auto tiny = tp::builtin_model("transformer_tiny");
  auto ed = tp::estimate(tiny, c, deep, o);
  EXPECT_FALSE(ed.feasible);
  EXPECT_NE(ed.why.find("too few layers"), std::string::npos) << ed.why;
}

// The search ranks feasible layouts by step time and puts a 70B model's DDP out of memory.
TEST(Plan, SearchRanksAndExplains) {
  auto c = tp::cluster_preset("h100-ib");
  tp::PlanOptions o;
  o.global_batch = 256;
  o.activation_checkpointing = true;  // without it, 4096-token activations fill any layout here
  auto res = tp::plan(tp::builtin_model("llama-70b"), c, o);
  ASSERT_FALSE(res.empty());
  ASSERT_TRUE(res.front().feasible);
  for (size_t i = 1; i < res.size() && res[i].feasible; ++i) EXPECT_LE(res[i - 1].step_s, res[i].step_s);
  bool ddp_oom = false;
  for (const auto& e : res)
    if (!e.feasible && e.layout.tp == 1 && e.layout.pp == 1 && e.layout.zero == 0)
      ddp_oom = e.why.find("out of memory") != std::string::npos;
  EXPECT_TRUE(ddp_oom);
  for (const auto& e : res)
    if (e.feasible) EXPECT_LE(e.memory.total(), o.memory_headroom * 80 * 1024.0 * 1024 * 1024);
}

TEST(Plan, BadDescriptionsAreRejected) {
  auto m = tp::transformer_model(24, 1000, 16, 1024, 50000);
  EXPECT_THROW(tp::validate(m), std::invalid_argument);  // 1000 not divisible by 16 heads
  auto small = tp::transformer_model(96, 12288, 96, 2048, 50000, 1e6);
  try {
    tp::validate(small);
    FAIL() << "1e6 parameters for 96 layers of 12288 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("far fewer"), std::string::npos);
  }
  auto c = tp::cluster_preset("h100x8");
  c.groups[0].device.memory_bytes = 0;
  EXPECT_THROW(tp::validate(c), std::invalid_argument);
  auto c2 = tp::cluster_preset("a100-ib");
  c2.inter.bandwidth = -1;
  EXPECT_THROW(tp::validate(c2), std::invalid_argument);
  EXPECT_THROW(tp::cluster_preset("tpu-pod"), std::invalid_argument);
  EXPECT_THROW(tp::builtin_model("resnet9000"), std::invalid_argument);
}

// Mixed nodes: paced by the slowest device, bounded by the smallest memory.
TEST(Plan, MixedNodesRunAtTheSlowestDevice) {
  auto mixed = tp::cluster_preset("mixed-a100-h100");
  auto h100 = tp::cluster_preset("h100-ib");
  h100.groups[0].nodes = 4;
  tp::PlanOptions o;
  o.global_batch = 256;
  tp::Layout l;
  l.dp = 32;
  l.zero = 1;
  l.micro_batch = 8;
  auto m = tp::builtin_model("gpt2");
  auto em = tp::estimate(m, mixed, l, o);
  auto eh = tp::estimate(m, h100, l, o);
  ASSERT_TRUE(em.feasible && eh.feasible);
  EXPECT_GT(em.compute_s, 2.5 * eh.compute_s);  // A100 312 vs H100 989 TFLOP/s
}

// A 2-core calibration of the CNN's compute (no collectives).
static tp::Calibration cnn_compute_calibration() {
  tp::Calibration cal;
  cal.cores = 2;
  tp::ModelRates r;
  r.flops_1t = 40e9;
  r.flops_all = 70e9;
  r.flops_concurrent = 35e9;
  r.overhead_s = 1e-3;
  r.sgd_s_per_param = 2e-9;
  cal.models["cnn"] = r;
  return cal;
}

// The local CPU model with a calibration: time-sharing beyond the cores, optimizer on the shard.
// The CNN's compute calibration with flat alpha-beta collectives on 2-4 ranks, the local
// cluster with 2 cores, and the bench's options (fp32, SGD, global batch 192).
static tp::Calibration cnn_calibration_with_collectives() {
  tp::Calibration cal = cnn_compute_calibration();
  for (int n : {2, 3, 4}) {
    cal.collectives[n]["allreduce"] = {20e-6, 2e9};
    cal.collectives[n]["reduce_scatter"] = {20e-6, 1e9};
    cal.collectives[n]["allgather"] = {20e-6, 2e9};
  }
  return cal;
}
static tp::ClusterSpec two_core_local() {
  auto c = tp::cluster_preset("local");
  c.groups[0].devices_per_node = 2;
  return c;
}
static tp::PlanOptions fp32_sgd_options(const tp::Calibration* cal) {
  tp::PlanOptions o;
  o.precision = "fp32";
  o.optimizer = "sgd";
  o.global_batch = 192;
  o.calibration = cal;
  return o;
}

// dp replicas of the whole model (ZeRO stage `zero`), k micro-batches each; must be feasible.
static tp::Estimate data_parallel_estimate(const tp::ModelSpec& m, const tp::ClusterSpec& c, const tp::PlanOptions& o,
                                           int dp, int zero, int64_t k) {
  tp::Layout l;
  l.dp = dp;
  l.zero = zero;
  l.micro_batches = k;
  l.micro_batch = o.global_batch / dp / k;
  auto e = tp::estimate(m, c, l, o);
  EXPECT_TRUE(e.feasible) << e.why;
  return e;
}

TEST(Plan, LocalCalibratedModel) {
  tp::Calibration cal = cnn_calibration_with_collectives();
  const auto c = two_core_local();
  tp::PlanOptions o = fp32_sgd_options(&cal);
  auto m = tp::builtin_model("cnn");
  auto step = [&](int n, int zero) { return data_parallel_estimate(m, c, o, n, zero, 1); };
  auto e1 = step(1, 0), e2 = step(2, 0), e4 = step(4, 0), z2 = step(2, 2);
  const double f = 3 * tp::forward_flops_per_sample(m);
  // One worker on both cores: its optimizer's kernels use both threads too, scaled as compute
  // (70 / 40) while the calibration has no all-core optimizer timing.
  EXPECT_NEAR(e1.step_s, 1e-3 + f * 192 / 70e9 + 421642 * 2e-9 / 1.75, 1e-9);
  const double comm2 = tp::ring_allreduce_seconds(2, 421642 * 4.0, {20e-6, 2e9});
  EXPECT_NEAR(e2.step_s, 1e-3 + f * 96 / 35e9 + 421642 * 2e-9 + comm2, 1e-9);  // no overlap on CPU
  // 4 workers on 2 cores: compute per worker at half the concurrent rate.
  EXPECT_NEAR(e4.compute_s, f * 48 / (35e9 / 2), 1e-9);
  // ZeRO-2: optimizer on half the parameters; reduce-scatter + all-gather instead of all-reduce.
  EXPECT_NEAR(z2.optimizer_s, 421642 / 2.0 * 2e-9, 1e-12);
  EXPECT_GT(z2.comm_parts.at("dp allgather"), 0.0);
  // With the all-core optimizer time and intercept measured, the single worker uses those; the
  // workers of a dp run, one thread each, keep the one-thread ones.
  cal.models["cnn"].sgd_all_s_per_param = 1.2e-9;
  cal.models["cnn"].overhead_all_s = 0.4e-3;
  auto a1 = step(1, 0), a2 = step(2, 0);
  EXPECT_NEAR(a1.step_s, 0.4e-3 + f * 192 / 70e9 + 421642 * 1.2e-9, 1e-9);
  EXPECT_NEAR(a2.step_s, e2.step_s, 1e-12);
  // Both travel in the calibration file; older files without them read as not measured.
  auto back = tp::calibration_from_json(tp::calibration_to_json(cal));
  EXPECT_DOUBLE_EQ(back.models.at("cnn").sgd_all_s_per_param, 1.2e-9);
  EXPECT_DOUBLE_EQ(back.models.at("cnn").overhead_all_s, 0.4e-3);
  auto old = nlohmann::json::parse(tp::calibration_to_json(cal));
  old["models"]["cnn"].erase("overhead_all_s");
  old["models"]["cnn"].erase("sgd_all_s_per_param");
  auto legacy = tp::calibration_from_json(old.dump());
  EXPECT_DOUBLE_EQ(legacy.models.at("cnn").overhead_all_s, -1.0);
  EXPECT_DOUBLE_EQ(legacy.models.at("cnn").sgd_all_s_per_param, 0.0);
}

// Gradient accumulation (tandem train --grad-accum): DDP and ZeRO-1 communicate once per step
// (no_sync before the last micro-batch), ZeRO-2/3 reduce-scatter after every micro-batch's backward.
TEST(Plan, GradientAccumulationCommunicatesAsTandemDoes) {
  tp::Calibration cal = cnn_calibration_with_collectives();
  const auto c = two_core_local();
  tp::PlanOptions o = fp32_sgd_options(&cal);
  auto m = tp::builtin_model("cnn");
  auto est = [&](int zero, int64_t k) { return data_parallel_estimate(m, c, o, 2, zero, k); };
  const auto d1 = est(0, 1), d4 = est(0, 4);
  EXPECT_NEAR(d4.comm_parts.at("dp allreduce"), d1.comm_parts.at("dp allreduce"), 1e-12);
  // The same samples' compute; the calibrated intercept (1 ms, one forward+backward pass's)
  // once per micro-batch.
  EXPECT_NEAR(d4.compute_s, d1.compute_s, 1e-12);
  EXPECT_NEAR(d4.step_s - d1.step_s, 3 * 1e-3, 1e-9);
  // A cluster's fixed overhead (--overhead-ms, no calibration) is per step, not per micro-batch.
  auto fixed = c;
  fixed.framework_overhead_s = 5e-3;
  tp::PlanOptions plain = fp32_sgd_options(nullptr);
  const auto u1 = data_parallel_estimate(m, fixed, plain, 2, 0, 1),
             u4 = data_parallel_estimate(m, fixed, plain, 2, 0, 4);
  EXPECT_NEAR(u4.step_s, u1.step_s, 1e-9);
  for (int z : {1, 2, 3}) {
    const auto z1 = est(z, 1), z4 = est(z, 4);
    const double rounds = z == 1 ? 1.0 : 4.0;  // ZeRO-1 accumulates under no_sync as DDP does
    EXPECT_NEAR(z4.comm_parts.at("dp reduce_scatter"), rounds * z1.comm_parts.at("dp reduce_scatter"), 1e-12)
        << "ZeRO-" << z;
    if (z > 1) EXPECT_GT(z4.exposed_comm_s, z1.exposed_comm_s) << "ZeRO-" << z;
  }
}

// A pass far outside the batches the compute fits were timed at is flagged: priced, with a caveat
// that names the batch a calibration would need. Calibrations that do not record them flag nothing.
TEST(Plan, PassesOutsideTheCalibratedBatchesCarryACaveat) {
  tp::Calibration cal = cnn_calibration_with_collectives();
  cal.models["cnn"].fit_batch_lo = 32;
  cal.models["cnn"].fit_batch_hi = 128;
  const auto c = two_core_local();
  tp::PlanOptions o = fp32_sgd_options(&cal);
  auto m = tp::builtin_model("cnn");
  EXPECT_EQ(data_parallel_estimate(m, c, o, 2, 0, 1).caveat, "");  // 96 per pass
  EXPECT_EQ(data_parallel_estimate(m, c, o, 2, 0, 6).caveat, "");  // 16, half the smaller
  const auto low = data_parallel_estimate(m, c, o, 2, 0, 48);      // passes of 2
  EXPECT_NE(low.caveat.find("passes of 2 samples"), std::string::npos) << low.caveat;
  EXPECT_NE(low.caveat.find("--calibrate-batch 4"), std::string::npos) << low.caveat;
  o.global_batch = 1024;
  EXPECT_NE(data_parallel_estimate(m, c, o, 2, 0, 1).caveat, "");  // 512, over twice 128
  // Round trip; files without fit_batches read as not recorded; a malformed pair is refused.
  auto back = tp::calibration_from_json(tp::calibration_to_json(cal));
  EXPECT_EQ(back.models.at("cnn").fit_batch_lo, 32);
  EXPECT_EQ(back.models.at("cnn").fit_batch_hi, 128);
  auto j = nlohmann::json::parse(tp::calibration_to_json(cal));
  j["models"]["cnn"].erase("fit_batches");
  auto legacy = tp::calibration_from_json(j.dump());
  EXPECT_EQ(legacy.models.at("cnn").fit_batch_lo, 0);
  o.calibration = &legacy;
  EXPECT_EQ(data_parallel_estimate(m, c, o, 2, 0, 1).caveat, "");
  j["models"]["cnn"]["fit_batches"] = {128, 32};
  EXPECT_THROW(tp::calibration_from_json(j.dump()), std::invalid_argument);
}

// ZeRO-3 waits for each unit's gather before its forward and its backward (the last unit's
// excepted): 2U - 1 rendezvous, each priced at the calibrated sync_point_s beyond the 4 KiB
// collective's own time; without the measurement, nothing is added.
TEST(Plan, ZeroThreeRendezvousFromTheCalibration) {
  tp::Calibration cal = cnn_compute_calibration();
  for (int n : {2, 4})
    for (const char* op : {"allreduce", "reduce_scatter", "allgather", "reduce_scatter_shm", "allgather_shm"})
      cal.collectives[n][op] = {20e-6, 2e9};
  auto c = tp::cluster_preset("local");
  tp::PlanOptions o;
  o.precision = "fp32";
  o.optimizer = "sgd";
  o.global_batch = 192;
  o.calibration = &cal;
  const auto m = tp::builtin_model("cnn");
  int units = 0;
  for (const auto& ly : m.children) units += ly.parameters > 0 ? 1 : 0;
  ASSERT_EQ(units, 4);  // conv, conv, linear, linear
  auto step = [&](int zero) {
    tp::Layout l;
    l.dp = 4;
    l.zero = zero;
    l.micro_batch = 48;
    auto e = tp::estimate(m, c, l, o);
    EXPECT_TRUE(e.feasible) << e.why;
    return e;
  };
  const auto before = step(3);
  EXPECT_EQ(before.comm_parts.count("dp zero3 rendezvous"), 0u);
  cal.models["cnn"].sync_point_s = {{2, 1e-4}, {4, 5e-4}};
  const auto after = step(3), z2 = step(2);
  const double alpha4k = tp::ring_allgather_seconds(4, 4096.0, {20e-6, 2e9});
  EXPECT_NEAR(after.comm_parts.at("dp zero3 rendezvous"), 7 * (5e-4 - alpha4k), 1e-12);
  EXPECT_NEAR(after.step_s - before.step_s, 7 * (5e-4 - alpha4k), 1e-12);
  EXPECT_EQ(z2.comm_parts.count("dp zero3 rendezvous"), 0u);  // stage 2 waits once, after backward
  // The calibration file carries it; a negative value is refused.
  auto back = tp::calibration_from_json(tp::calibration_to_json(cal));
  EXPECT_DOUBLE_EQ(back.models.at("cnn").sync_point_s.at(4), 5e-4);
  auto text = tp::calibration_to_json(cal);
  text.replace(text.find("0.0005"), 6, "-0.001");
  EXPECT_THROW(tp::calibration_from_json(text), std::invalid_argument);
}

// The dense built-ins list their children as LibTorch builds them (parameters child by child),
// the pipeline cut is the trainer's (tandem::partition_by_parameters), and tensor parallelism
// pairs Linears as tandem::tp::tensor_parallel does (column, elementwise children, row).
TEST(Plan, LayeredModelsMatchLibTorchAndTheTrainersCut) {
  for (const std::string name : {"mlp", "cnn", "cnn_bn"}) {
    auto module = tandem::models::make_model(name);
    const auto spec = tp::builtin_model(name);
    ASSERT_EQ(spec.children.size(), module->size()) << name;
    double total = 0;
    for (size_t i = 0; i < spec.children.size(); ++i) {
      int64_t n = 0;
      for (const auto& p : (module->begin() + static_cast<std::ptrdiff_t>(i))->ptr()->parameters()) n += p.numel();
      EXPECT_EQ(static_cast<int64_t>(spec.children[i].parameters), n) << name << " child " << i;
      total += spec.children[i].parameters;
      if (i > 0) EXPECT_EQ(spec.children[i].input_elems, spec.children[i - 1].output_elems) << name << " child " << i;
      if (spec.children[i].tp == "row") {
        size_t j = i - 1;
        while (spec.children[j].name == "relu") --j;
        EXPECT_EQ(spec.children[j].tp, "column") << name;
      }
    }
    EXPECT_EQ(total, spec.parameters) << name;
    auto c = tp::cluster_preset("h100x8");
    tp::PlanOptions o;
    o.global_batch = 64;
    for (int pp = 2; pp <= 4; ++pp) {
      tp::Layout l;
      l.pp = pp;
      l.micro_batch = 16;
      l.micro_batches = 4;
      auto e = tp::estimate(spec, c, l, o);
      ASSERT_TRUE(e.feasible) << name << " pp " << pp << ": " << e.why;
      EXPECT_EQ(e.partition, tandem::partition_by_parameters(module, pp)) << name << " pp " << pp;
    }
  }
  // Tensor parallelism of a dense model: the pair's width must split; a model without pairs cannot.
  auto c = tp::cluster_preset("h100x8");
  tp::PlanOptions o;
  o.global_batch = 64;
  tp::Layout l;
  l.tp = 2;
  l.micro_batch = 64;
  EXPECT_TRUE(tp::estimate(tp::builtin_model("mlp"), c, l, o).feasible);
  l.tp = 3;
  auto e3 = tp::estimate(tp::builtin_model("mlp"), c, l, o);
  EXPECT_FALSE(e3.feasible);
  EXPECT_NE(e3.why.find("does not split over tensor-parallel 3"), std::string::npos) << e3.why;
  auto no_pairs = tp::builtin_model("mlp");
  for (auto& ch : no_pairs.children) ch.tp.clear();
  l.tp = 2;
  auto en = tp::estimate(no_pairs, c, l, o);
  EXPECT_FALSE(en.feasible);
  EXPECT_NE(en.why.find("Linear pairs"), std::string::npos) << en.why;
}

// Layer by layer: equal stages give the textbook (m + p - 1) slots under both schedules;
// unequal ones Sum(t_s) + (m - 1) max(t_s); a calibration's per-layer fits and the tensor-parallel
// split and all-reduces enter as the formulas say.
TEST(Plan, LayeredPipelineAndTensorParallelTimes) {
  tp::ModelSpec m;
  m.name = "four";
  m.kind = "dense";
  m.layers = 4;
  for (int i = 0; i < 4; ++i) {
    tp::LayerSpec ly;
    ly.name = "linear";
    ly.parameters = 1e6;
    ly.forward_flops = 2e6;
    ly.input_elems = ly.output_elems = 1000;
    m.children.push_back(ly);
    m.parameters += ly.parameters;
    m.forward_flops_per_sample += ly.forward_flops;
  }
  m.activation_bytes_per_sample = 1e4;
  auto c = tp::cluster_preset("h100x8");
  c.intra.latency = 0;
  c.intra.bandwidth = 1e30;  // free transfers
  tp::PlanOptions o;
  o.global_batch = 64;
  const double rate = c.groups[0].device.flops * c.groups[0].device.mfu;
  for (auto sched : {tandem::PipelineSchedule::kGPipe, tandem::PipelineSchedule::k1F1B}) {
    o.pipeline_schedule = sched;
    tp::Layout l;
    l.pp = 4;
    l.micro_batch = 8;
    l.micro_batches = 8;
    auto e = tp::estimate(m, c, l, o);
    ASSERT_TRUE(e.feasible) << e.why;
    // Stage 0's first layer computes no input gradient: 2 passes, the others 3.
    const double t0 = 2 * 2e6 * 8 / rate, t = 3 * 2e6 * 8 / rate;
    EXPECT_NEAR(e.step_s - e.optimizer_s, t0 + 3 * t + 7 * t, 1e-6 * e.step_s) << tandem::to_string(sched);
    EXPECT_EQ(e.partition, (std::vector<int64_t>{1, 1, 1, 1}));
  }
  // The CPU model with per-layer fits (one thread) and the tensor-parallel split of a pair.
  tp::Calibration cal;
  cal.cores = 2;
  tp::ModelRates r;
  r.flops_1t = 6e11;               // the whole model's 3 x 8e6 FLOPs per sample in 4e-5 s: the children's sum
  r.overhead_s = 4e-4;             // and its fixed part, the children's too
  r.flops_synchronized[2] = 3e11;  // two workers at once: each at half one thread's rate
  r.layer_overhead_s = {1e-4, 1e-4, 1e-4, 1e-4};
  r.layer_s_per_sample = {1e-5, 1e-5, 1e-5, 1e-5};
  cal.models["four"] = r;
  cal.collectives[2]["allreduce"] = {10e-6, 1e9};
  cal.p2p[2] = {10e-6, 1e9};
  auto local = tp::cluster_preset("local");
  tp::PlanOptions lo;
  lo.global_batch = 64;
  lo.precision = "fp32";
  lo.optimizer = "sgd-plain";
  lo.calibration = &cal;
  m.children[0].tp = "column";
  m.children[1].tp = "row";
  tp::Layout l;
  l.tp = 2;
  l.micro_batch = 64;
  auto e = tp::estimate(m, local, l, lo);
  ASSERT_TRUE(e.feasible) << e.why;
  // Per worker: the pair at half its time (fixed and per-sample parts), the rest whole; both
  // workers at once run at 25/50 of one thread's speed. Plus the row layer's all-reduce of
  // 64 x 1000 floats (the column layer needs no input gradient: it is the first).
  const double compute = (2 * (1e-4 + 64 * 1e-5) / 2 + 2 * (1e-4 + 64 * 1e-5)) / 0.5;
  const double ar = tp::ring_allreduce_seconds(2, 64 * 1000 * 4.0, {10e-6, 1e9});
  EXPECT_NEAR(e.comm_parts.at("tp allreduce"), ar, 1e-12);
  EXPECT_NEAR(e.step_s - e.optimizer_s, compute + ar, 1e-9);
  // With the shard itself timed on both workers at once (tp_synchronized: at batch 32, 4 ms),
  // the compute is scaled by that measurement instead: the shard alone at batch 32 takes
  // (1e-4 + 32e-5) / 2 * 2 + (1e-4 + 32e-5) * 2 = 1.26 ms, so its speed is 1.26 / 4.
  cal.models["four"].tp_synchronized[2][2] = {32.0, 4e-3};
  auto et = tp::estimate(m, local, l, lo);
  const double alone32 = 2 * (1e-4 + 32 * 1e-5) / 2 + 2 * (1e-4 + 32 * 1e-5);
  const double alone64 = 2 * (1e-4 + 64 * 1e-5) / 2 + 2 * (1e-4 + 64 * 1e-5);
  EXPECT_NEAR(et.step_s - et.optimizer_s, alone64 / (alone32 / 4e-3) + ar, 1e-9);
  // It travels in the calibration file; a non-positive time is refused. Other worker counts
  // and layouts with a pipeline keep the whole model's rate.
  auto back = tp::calibration_from_json(tp::calibration_to_json(cal));
  EXPECT_EQ(back.models.at("four").tp_synchronized.at(2).at(2), (std::pair<double, double>{32.0, 4e-3}));
  auto text = tp::calibration_to_json(cal);
  text.replace(text.find("0.004"), 5, "-0.004");
  EXPECT_THROW(tp::calibration_from_json(text), std::invalid_argument);
  cal.models["four"].tp_synchronized.clear();

  // A CPU pipeline sends a stage's output when the stage next stops computing, or after the
  // calibrated send delay. GPipe, two stages, two micro-batches, free transfers, a delay longer
  // than any operation: stage 0's first activation leaves after its second forward, stage 1's
  // first input gradient after its second backward, so nothing overlaps and the step is the
  // sum of every stage's work at one stage's speed (1), although two stages could compute at
  // once at full speed here. With no delay they overlap.
  cal.models["four"].flops_synchronized[2] = 6e11;
  m.children[0].tp.clear();
  m.children[1].tp.clear();
  cal.p2p[2] = {0.0, 1e30};
  cal.send_delay[2] = {{4096.0, 1.0}};
  lo.pipeline_schedule = tandem::PipelineSchedule::kGPipe;
  tp::Layout pl;
  pl.pp = 2;
  pl.micro_batch = 32;
  pl.micro_batches = 2;
  auto pe = tp::estimate(m, local, pl, lo);
  ASSERT_TRUE(pe.feasible) << pe.why;
  const double serial = 2 * 4 * (1e-4 + 32 * 1e-5);
  EXPECT_NEAR(pe.step_s - pe.optimizer_s, serial, 1e-9);
  cal.send_delay[2] = {{4096.0, 0.0}};
  auto overlapped = tp::estimate(m, local, pl, lo);
  EXPECT_LT(overlapped.step_s - overlapped.optimizer_s, serial - 2e-4);
  // A delay shorter than the forward (1e-4 + 32e-5 s of each layer, half of it forward for the
  // first): the first activation leaves mid-way through stage 0's second forward.
  cal.send_delay[2] = {{4096.0, 1e-4}};
  auto part = tp::estimate(m, local, pl, lo);
  EXPECT_GT(part.step_s, overlapped.step_s + 1e-5);
  EXPECT_LT(part.step_s, pe.step_s - 1e-5);
  // The children's times are scaled to add up to the whole model's at the micro-batch: with the
  // whole model timed at twice the children's per-sample rate and half their fixed part, the
  // serial step above is the whole model's time at 32 samples for each micro-batch, 2 x 7.4e-4 s
  // (the children's 4 x 4.2e-4 s each).
  cal.send_delay[2] = {{4096.0, 1.0}};
  cal.models["four"].flops_1t = 1.2e12;
  cal.models["four"].overhead_s = 2e-4;
  cal.models["four"].flops_synchronized[2] = 1.2e12;
  auto fast = tp::estimate(m, local, pl, lo);
  EXPECT_NEAR(fast.step_s - fast.optimizer_s, 2 * (2e-4 + 32 * 3 * 8e6 / 1.2e12), 1e-9);
  // Each child keeps its own share of the whole: with the last child timed twice as slow as
  // each of the others, a tp2 worker (half of the first two, the last two whole) computes
  // (1/2 + 1/2 + 1 + 2) / 5 of the whole model's 1.48 ms at 64 samples.
  cal.models["four"].layer_overhead_s[3] = 2e-4;
  cal.models["four"].layer_s_per_sample[3] = 2e-5;
  m.children[0].tp = "column";
  m.children[1].tp = "row";
  auto skew = tp::estimate(m, local, l, lo);
  ASSERT_TRUE(skew.feasible) << skew.why;
  EXPECT_NEAR(skew.step_s - skew.optimizer_s, (2e-4 + 64 * 2e-5) * 4.0 / 5.0 + ar, 1e-9);

  // The measured forward share of each child splits a stage's time into its forward and
  // backward. Four equal children of T = (2e-4 + 16 x 3 x 8e6 / 1.2e12) / 4 = 1.3e-4 s at a
  // 16-sample micro-batch, two stages, four micro-batches, free transfers sent at once, full
  // speed with both stages busy. Stage 0 forward-heavy (0.9: F 1.8T, B 0.2T), stage 1
  // backward-heavy (0.1: F 0.2T, B 1.8T): GPipe runs stage 0's four forwards, stage 1's last
  // forward, its four backwards, stage 0's last backward, 7.2T + 0.2T + 7.2T + 0.2T = 14.8T;
  // 1F1B interleaves them in 10T (stage 0: F0 F1, waits 0.2T, B0 F2 B1 F3 B2, waits, B3).
  cal.models["four"].layer_overhead_s[3] = 1e-4;
  cal.models["four"].layer_s_per_sample[3] = 1e-5;
  m.children[0].tp.clear();
  m.children[1].tp.clear();
  cal.send_delay[2] = {{4096.0, 0.0}};
  cal.models["four"].layer_forward_share = {0.9, 0.9, 0.1, 0.1};
  tp::Layout pl4;
  pl4.pp = 2;
  pl4.micro_batch = 16;
  pl4.micro_batches = 4;
  const double T = (2e-4 + 16 * 3 * 8e6 / 1.2e12) / 4;
  lo.pipeline_schedule = tandem::PipelineSchedule::kGPipe;
  auto g = tp::estimate(m, local, pl4, lo);
  lo.pipeline_schedule = tandem::PipelineSchedule::k1F1B;
  auto f = tp::estimate(m, local, pl4, lo);
  ASSERT_TRUE(g.feasible && f.feasible) << g.why << f.why;
  EXPECT_NEAR(g.step_s - g.optimizer_s, 14.8 * T, 1e-9);
  EXPECT_NEAR(f.step_s - f.optimizer_s, 10.0 * T, 1e-9);
  // Without the measured shares (FLOP split: the first child half forward, the others a third)
  // the two schedules are priced closer together.
  cal.models["four"].layer_forward_share.clear();
  lo.pipeline_schedule = tandem::PipelineSchedule::kGPipe;
  auto g0 = tp::estimate(m, local, pl4, lo);
  EXPECT_LT(g0.step_s - g0.optimizer_s, 13.0 * T);
  // The shares travel in the calibration file; a share outside [0, 1] or a list of the wrong
  // length is refused.
  cal.models["four"].layer_forward_share = {0.9, 0.9, 0.1, 0.1};
  auto back4 = tp::calibration_from_json(tp::calibration_to_json(cal));
  EXPECT_EQ(back4.models.at("four").layer_forward_share, (std::vector<double>{0.9, 0.9, 0.1, 0.1}));
  cal.models["four"].layer_forward_share = {0.9, 1.5, 0.1, 0.1};
  EXPECT_THROW(tp::calibration_from_json(tp::calibration_to_json(cal)), std::invalid_argument);
  cal.models["four"].layer_forward_share = {0.9, 0.1};
  EXPECT_THROW(tp::calibration_from_json(tp::calibration_to_json(cal)), std::invalid_argument);
}

// A calibrated world size is timed from its measured sizes (log-log between them), not the fit.
TEST(Plan, CalibratedCollectivesInterpolateMeasuredSizes) {
  tp::Calibration cal;
  cal.cores = 2;
  cal.collectives[2]["allreduce"] = {1.0, 1.0};  // a fit that would give seconds: must not be used
  cal.collective_times[2]["allreduce"] = {{4096.0, 1e-5}, {1048576.0, 1e-3}};
  auto c = tp::cluster_preset("local");
  tp::PlanOptions o;
  o.calibration = &cal;
  EXPECT_DOUBLE_EQ(tp::collective_seconds(c, o, "allreduce", 2, 4096), 1e-5);
  EXPECT_DOUBLE_EQ(tp::collective_seconds(c, o, "allreduce", 2, 1024), 1e-5);
  EXPECT_NEAR(tp::collective_seconds(c, o, "allreduce", 2, 65536), 1e-4, 1e-12);
  EXPECT_NEAR(tp::collective_seconds(c, o, "allreduce", 2, 4 * 1048576.0), 4e-3, 1e-12);
  // Other world sizes and operations: the alpha-beta fit of the nearest one.
  cal.collectives[3]["allreduce"] = {1e-5, 1e9};
  EXPECT_NEAR(tp::collective_seconds(c, o, "allreduce", 3, 3e6), tp::ring_allreduce_seconds(3, 3e6, {1e-5, 1e9}),
              1e-15);
  // "_shm" (in place in symmetric memory): its own curve where measured, else the plain operation.
  cal.collective_times[2]["reduce_scatter"] = {{4096.0, 1e-4}, {1048576.0, 1e-2}};
  cal.collective_times[2]["reduce_scatter_shm"] = {{4096.0, 1e-5}, {1048576.0, 1e-3}};
  EXPECT_NEAR(tp::collective_seconds(c, o, "reduce_scatter_shm", 2, 1048576.0), 1e-3, 1e-12);
  EXPECT_NEAR(tp::collective_seconds(c, o, "reduce_scatter", 2, 1048576.0), 1e-2, 1e-12);
  EXPECT_NEAR(tp::collective_seconds(c, o, "allreduce_shm", 2, 1048576.0), 1e-3, 1e-12);
  EXPECT_NEAR(tp::collective_seconds(c, o, "reduce_scatter_shm", 3, 3e6),
              tp::collective_seconds(c, o, "reduce_scatter", 3, 3e6), 1e-15);
  // Every ZeRO stage reduce-scatters its gradients from symmetric memory on a CPU node (ZeRO-1
  // from its flat buffer, ZeRO-2/3 from scratch carved from a block allocated up front), and
  // ZeRO-3 gathers its units into that block too.
  tp::ModelSpec m = tp::builtin_model("mlp");
  tp::PlanOptions lo;
  lo.calibration = &cal;
  lo.global_batch = 64;
  lo.precision = "fp32";
  lo.optimizer = "sgd";
  tp::Layout z1, z2;
  z1.dp = z2.dp = 2;
  z1.zero = 1;
  z2.zero = 2;
  z1.micro_batch = z2.micro_batch = 32;
  const double grads = m.parameters * 4.0;
  auto e1 = tp::estimate(m, c, z1, lo), e2 = tp::estimate(m, c, z2, lo);
  ASSERT_TRUE(e1.feasible && e2.feasible) << e1.why << e2.why;
  EXPECT_NEAR(e1.comm_parts.at("dp reduce_scatter"), tp::collective_seconds(c, lo, "reduce_scatter_shm", 2, grads),
              1e-9);
  EXPECT_NEAR(e2.comm_parts.at("dp reduce_scatter"), tp::collective_seconds(c, lo, "reduce_scatter_shm", 2, grads),
              1e-9);
  EXPECT_LT(e2.comm_parts.at("dp reduce_scatter"), tp::collective_seconds(c, lo, "reduce_scatter", 2, grads) / 2);
  tp::Layout z3 = z2;
  z3.zero = 3;
  cal.collective_times[2]["allgather"] = {{4096.0, 1e-4}, {1048576.0, 1e-2}};
  cal.collective_times[2]["allgather_shm"] = {{4096.0, 1e-5}, {1048576.0, 1e-3}};
  auto e3 = tp::estimate(m, c, z3, lo);
  ASSERT_TRUE(e3.feasible) << e3.why;
  EXPECT_NEAR(e3.comm_parts.at("dp allgather (fwd+bwd)"), 2 * tp::collective_seconds(c, lo, "allgather_shm", 2, grads),
              1e-9);
  // ZeRO-3 gathers from a separate shard: the "allgather_copy_shm" curve where it was calibrated
  // (above, without it, the in-place one); ZeRO-1/2 keep gathering in place.
  cal.collective_times[2]["allgather_copy_shm"] = {{4096.0, 2e-5}, {1048576.0, 2e-3}};
  EXPECT_NEAR(tp::collective_seconds(c, lo, "allgather_copy_shm", 2, 1048576.0), 2e-3, 1e-12);
  EXPECT_NEAR(tp::collective_seconds(c, lo, "allgather_copy_shm", 3, 3e6),
              tp::collective_seconds(c, lo, "allgather", 3, 3e6), 1e-15);
  auto e3c = tp::estimate(m, c, z3, lo), e2c = tp::estimate(m, c, z2, lo);
  ASSERT_TRUE(e3c.feasible && e2c.feasible) << e3c.why << e2c.why;
  EXPECT_NEAR(e3c.comm_parts.at("dp allgather (fwd+bwd)"),
              2 * tp::collective_seconds(c, lo, "allgather_copy_shm", 2, grads), 1e-9);
  EXPECT_GT(e3c.comm_parts.at("dp allgather (fwd+bwd)"), e3.comm_parts.at("dp allgather (fwd+bwd)"));
  EXPECT_NEAR(e2c.comm_parts.at("dp allgather"), tp::collective_seconds(c, lo, "allgather_shm", 2, grads), 1e-9);
}

// A calibration of the CNN on 2 cores whose first max-pool is its slowest child (8 of 17 units
// per sample, the other children 1 each).
static tp::Calibration slow_pool_cnn_calibration() {
  tp::Calibration cal;
  cal.cores = 2;
  tp::ModelRates r;
  r.flops_1t = 1e10;
  r.layer_overhead_s.assign(10, 0.0);
  r.layer_s_per_sample = {1e-5, 1e-5, 8e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 1e-5};
  cal.models["cnn"] = r;
  cal.p2p[2] = {1e-5, 1e9};
  return cal;
}

// --pp-partition: the cut by parameter count (tandem's default), by time (the calibrated per-child
// fits on CPU, FLOPs elsewhere) or an explicit list; a list that does not fit is infeasible.
TEST(Plan, PipelinePartitionFollowsTheOption) {
  const tp::ModelSpec m = tp::builtin_model("cnn");
  ASSERT_EQ(m.children.size(), 10u);
  const auto gpu = tp::cluster_preset("h100x8");
  tp::PlanOptions o;
  o.global_batch = 64;
  tp::Layout l;
  l.pp = 2;
  l.micro_batch = 16;
  l.micro_batches = 4;
  // Parameters: the first Linear (401k of 421k) alone outweighs everything before it.
  EXPECT_EQ(tp::estimate(m, gpu, l, o).partition, (std::vector<int64_t>{7, 3}));
  // FLOPs: the second convolution is 90 % of the training work; it ends stage 0.
  o.pipeline_partition = "time";
  EXPECT_EQ(tp::estimate(m, gpu, l, o).partition, (std::vector<int64_t>{4, 6}));
  // Calibrated on CPU: the fits, which give the pooling layers their time (here the first max-pool
  // is the slowest child), so the cut falls after it.
  const tp::Calibration cal = slow_pool_cnn_calibration();
  auto local = tp::cluster_preset("local");
  tp::PlanOptions lo = o;
  lo.precision = "fp32";
  lo.optimizer = "sgd";
  lo.calibration = &cal;
  EXPECT_EQ(tp::estimate(m, local, l, lo).partition, (std::vector<int64_t>{3, 7}));
  lo.pipeline_partition = "params";
  EXPECT_EQ(tp::estimate(m, local, l, lo).partition, (std::vector<int64_t>{7, 3}));
  // A list: used as given where it has pp stages covering every layer, else infeasible.
  o.pipeline_partition = "5,5";
  EXPECT_EQ(tp::estimate(m, gpu, l, o).partition, (std::vector<int64_t>{5, 5}));
  o.pipeline_partition = "5,4";
  auto bad = tp::estimate(m, gpu, l, o);
  EXPECT_FALSE(bad.feasible);
  EXPECT_NE(bad.why.find("does not cut the 10 layers into 2 non-empty stages"), std::string::npos) << bad.why;
  o.pipeline_partition = "0,10";
  EXPECT_THROW(tp::estimate(m, gpu, l, o), std::invalid_argument);
  o.pipeline_partition = "5,x";
  EXPECT_THROW(tp::estimate(m, gpu, l, o), std::invalid_argument);
}

// Per stage: each stage's own parameters' state, and activations by the stage's share of the
// children's inputs and the micro-batches alive on it.
TEST(Plan, StageMemoryFollowsThePartitionAndSchedule) {
  const tp::ModelSpec m = tp::builtin_model("cnn");
  const auto gpu = tp::cluster_preset("h100x8");
  tp::PlanOptions o;
  o.global_batch = 64;
  o.precision = "fp32";
  o.optimizer = "adam";
  o.pipeline_partition = "3,7";
  tp::Layout l;
  l.pp = 2;
  l.micro_batch = 16;
  l.micro_batches = 4;
  const tp::Estimate e = tp::estimate(m, gpu, l, o);
  ASSERT_EQ(e.stage_memory.size(), 2u);
  double first = 0, inputs_first = 0, inputs_all = 0;
  for (size_t i = 0; i < m.children.size(); ++i) {
    if (i < 3) first += m.children[i].parameters, inputs_first += m.children[i].input_elems;
    inputs_all += m.children[i].input_elems;
  }
  EXPECT_DOUBLE_EQ(e.stage_memory[0].parameters, 4 * first);
  EXPECT_DOUBLE_EQ(e.stage_memory[1].parameters, 4 * (m.parameters - first));
  EXPECT_DOUBLE_EQ(e.stage_memory[1].optimizer, 8 * (m.parameters - first));  // Adam: two fp32 moments
  // 1F1B: 2 micro-batches alive on stage 0, 1 on stage 1.
  const double per_input = e.stage_memory[0].activations / (2 * inputs_first);
  EXPECT_NEAR(e.stage_memory[1].activations, per_input * (inputs_all - inputs_first), 1e-6 * per_input);
  o.pipeline_schedule = tandem::PipelineSchedule::kGPipe;  // every micro-batch alive on every stage
  const tp::Estimate g = tp::estimate(m, gpu, l, o);
  EXPECT_NEAR(g.stage_memory[0].activations, 2 * e.stage_memory[0].activations, 1e-6);
  EXPECT_NEAR(g.stage_memory[1].activations, 4 * e.stage_memory[1].activations, 1e-6);
  l.pp = 1;
  o.pipeline_partition = "params";
  EXPECT_TRUE(tp::estimate(m, gpu, l, o).stage_memory.empty());
}

// tandem plan's default: the faster of the two cuts, named in Estimate::partition.
TEST(Plan, PipelinePartitionAutoTakesTheFasterCut) {
  const tp::ModelSpec m = tp::builtin_model("cnn");
  const tp::Calibration cal = slow_pool_cnn_calibration();
  const auto local = tp::cluster_preset("local");
  tp::PlanOptions o;
  o.global_batch = 64;
  o.precision = "fp32";
  o.optimizer = "sgd";
  o.calibration = &cal;
  tp::Layout l;
  l.pp = 2;
  l.micro_batch = 16;
  l.micro_batches = 4;
  o.pipeline_partition = "params";
  const auto by_params = tp::estimate(m, local, l, o);
  o.pipeline_partition = "time";
  const auto by_time = tp::estimate(m, local, l, o);
  ASSERT_TRUE(by_params.feasible && by_time.feasible);
  ASSERT_LT(by_time.step_s, by_params.step_s);  // 10 of 17 units in the slower stage, not 16
  o.pipeline_partition = "auto";
  const auto a = tp::estimate(m, local, l, o);
  EXPECT_EQ(a.partition, (std::vector<int64_t>{3, 7}));
  EXPECT_DOUBLE_EQ(a.step_s, by_time.step_s);
  // Without a pipeline there is nothing to choose.
  tp::Layout dp2;
  dp2.dp = 2;
  dp2.micro_batch = 32;
  o.pipeline_partition = "auto";
  const auto d = tp::estimate(m, local, dp2, o);
  o.pipeline_partition = "params";
  EXPECT_DOUBLE_EQ(d.step_s, tp::estimate(m, local, dp2, o).step_s);
  // The local search lists the pipeline's cut, and no gradient accumulation without a pipeline.
  o.pipeline_partition = "auto";
  o.devices = 2;
  o.global_batch = 192;
  bool saw_pipeline = false;
  for (const auto& e : tp::plan(m, local, o)) {
    if (!e.feasible) continue;
    if (e.layout.pp == 1) {
      EXPECT_EQ(e.layout.micro_batches, 1) << e.layout.strategy_name();
    } else {
      saw_pipeline = true;
      EXPECT_EQ(e.partition, (std::vector<int64_t>{3, 7}));
    }
  }
  EXPECT_TRUE(saw_pipeline);
}

// On the local cluster the search tries no gradient accumulation without a pipeline. With the
// calibration of a 2-core machine in tests/data/plan (see its README), the CNN's tp2 was listed
// at 96 micro-batches of 2, which tandem train --grad-accum 96 measured at twice the step time.
TEST(Plan, LocalSearchHasNoGradientAccumulation) {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  if (!src) GTEST_SKIP() << "TANDEM_SOURCE_DIR unset (ctest sets it)";
  std::ifstream f(std::string(src) + "/tests/data/plan/calibration-cnn-2vcpu.json");
  ASSERT_TRUE(f) << "the stored calibration is missing";
  std::stringstream text;
  text << f.rdbuf();
  const tp::Calibration cal = tp::calibration_from_json(text.str());
  tp::PlanOptions o;
  o.global_batch = 192;
  o.precision = "fp32";
  o.optimizer = "sgd";
  o.calibration = &cal;
  o.devices = 2;
  bool saw_tp = false;
  for (const auto& e : tp::plan(tp::builtin_model("cnn"), tp::cluster_preset("local"), o)) {
    if (!e.feasible || e.layout.pp > 1) continue;
    saw_tp = saw_tp || e.layout.tp == 2;
    EXPECT_EQ(e.layout.micro_batches, 1) << e.layout.strategy_name();
    EXPECT_EQ(e.layout.micro_batch, 192 / e.layout.dp) << e.layout.strategy_name();
  }
  EXPECT_TRUE(saw_tp);
}

// Transformer activations: Korthikanti et al.'s s*h*(10 + 24/t + 5*a*s/(h*t)) per layer (16-bit)
// for layers with dropout and unfused attention; without dropout the two masks (2*s*h) go, and
// with fused attention the scores (5*a*s^2 with dropout, the softmax output 2*a*s^2 without).
TEST(Plan, TransformerActivationsFollowDropoutAndAttention) {
  auto m = tp::transformer_model(4, 1024, 16, 2048, 50257);
  const double s = 2048, h = 1024, a = 16, L = 4;
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(m), L * s * h * 32);  // Tandem's models: neither
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(m, 2), L * s * h * (8 + 12));
  m.attention_scores = true;
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(m), L * (s * h * 32 + 2 * a * s * s));
  m.dropout = true;
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(m), L * s * h * (34 + 5 * a * s / h));
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(m, 4), L * s * h * (10 + 6 + 5 * a * s / (h * 4)));
  // Sequence parallelism (eq. 4): the 10 outside the tensor-parallel layers split over t too.
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(m, 4, true), L * s * h * (10.0 / 4 + 6 + 5 * a * s / (h * 4)));
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(m, 1, true), tp::activation_bytes_per_sample(m, 1));
}

// ZeRO-2/3 make the gradients in backward and free them in zero_grad(), so with one micro-batch
// per step the peak is the larger of forward's end (activations) and backward's end (gradients
// and one layer's activations); with accumulation (or ZeRO-0/1) the gradients live throughout.
TEST(Plan, ZeroTwoAndThreeGradientsDoNotCoexistWithForwardsActivations) {
  auto m = tp::transformer_model(8, 256, 4, 128, 512);
  auto c = tp::cluster_preset("local");
  c.groups.at(0).devices_per_node = 4;
  tp::PlanOptions o;
  o.global_batch = 8;
  o.optimizer = "adamw";
  o.precision = "fp32";
  for (bool ckpt : {false, true}) {
    SCOPED_TRACE(ckpt ? "activation checkpointing" : "no recomputation");
    o.activation_checkpointing = ckpt;
    for (int zero : {1, 3}) {
      tp::Layout l;
      l.dp = 2;
      l.zero = zero;
      l.micro_batch = 4;
      auto e = tp::estimate(m, c, l, o);
      ASSERT_TRUE(e.feasible) << e.why;
      const auto& b = e.memory;
      const double layer = tp::activation_bytes_per_sample(m) * 2 / 8 * 4;  // fp32: twice; 4 samples
      EXPECT_DOUBLE_EQ(b.layer_activations, layer);
      const double state = b.parameters + b.optimizer;
      EXPECT_DOUBLE_EQ(b.total(), zero == 3 ? state + std::max(b.activations, b.gradients + layer)
                                            : state + b.gradients + b.activations);
      l.micro_batch = 2;
      l.micro_batches = 2;  // accumulation: the first micro-batch's gradients live through the second's forward
      auto acc = tp::estimate(m, c, l, o);
      ASSERT_TRUE(acc.feasible) << acc.why;
      EXPECT_DOUBLE_EQ(acc.memory.total(),
                       acc.memory.parameters + acc.memory.optimizer + acc.memory.gradients + acc.memory.activations);
    }
  }
}

// ---------------------------------------------------------------- context parallelism

namespace {

tp::Estimate context_parallel(const tp::ModelSpec& m, const tp::ClusterSpec& c, int dp, int cp, int tensor, int zero,
                              int64_t micro_batch, int64_t micro_batches, tp::PlanOptions o = {}) {
  o.global_batch = dp * micro_batch * micro_batches;
  tp::Layout l;
  l.dp = dp;
  l.cp = cp;
  l.tp = tensor;
  l.zero = zero;
  l.micro_batch = micro_batch;
  l.micro_batches = micro_batches;
  return tp::estimate(m, c, l, o);
}

}  // namespace

// Each cp rank holds T/cp tokens of every sample and computes 1/cp of it: activations and
// compute per rank are cp 1's over cp, the model states (replicated over cp) unchanged.
TEST(Plan, ContextParallelDividesActivationsAndCompute) {
  const auto m = tp::transformer_model(8, 1024, 16, 4096, 32000);
  const auto c = tp::cluster_preset("h100x8");
  for (bool ckpt : {false, true}) {
    SCOPED_TRACE(ckpt ? "activation checkpointing" : "no recomputation");
    tp::PlanOptions o;
    o.activation_checkpointing = ckpt;
    const auto one = context_parallel(m, c, 1, 1, 1, 0, 2, 1, o);
    ASSERT_TRUE(one.feasible) << one.why;
    if (!ckpt) EXPECT_DOUBLE_EQ(one.memory.activations, tp::activation_bytes_per_sample(m) * 2);  // 16-bit, 2 samples
    for (int cp : {2, 4}) {
      const auto e = context_parallel(m, c, 1, cp, 1, 0, 2, 1, o);
      ASSERT_TRUE(e.feasible) << e.why;
      EXPECT_DOUBLE_EQ(e.memory.activations, one.memory.activations / cp) << "cp " << cp;
      EXPECT_DOUBLE_EQ(e.memory.layer_activations, one.memory.layer_activations / cp) << "cp " << cp;
      EXPECT_NEAR(e.compute_s, one.compute_s / cp, 1e-12 * one.compute_s) << "cp " << cp;
      EXPECT_DOUBLE_EQ(e.memory.parameters, one.memory.parameters);
      EXPECT_DOUBLE_EQ(e.memory.optimizer, one.memory.optimizer);
    }
  }
}

// The cp ranks hold the same parameters and reduce their gradients with dp's: ZeRO shards over
// dp x cp ranks, so dp 1 x cp 2 holds what dp 2 x cp 1 does, and DDP all-reduces over the cp
// ranks even with one replica.
TEST(Plan, ContextParallelShardsZeroOverDpTimesCp) {
  const auto m = tp::builtin_model("gpt2");
  const auto c = tp::cluster_preset("h100x8");
  const auto sb = tp::state_bytes("mixed", "adam");
  for (int zero : {0, 1, 2, 3}) {
    SCOPED_TRACE("zero " + std::to_string(zero));
    const auto cp2 = context_parallel(m, c, 1, 2, 1, zero, 2, 1);
    const auto dp2 = context_parallel(m, c, 2, 1, 1, zero, 1, 1);
    ASSERT_TRUE(cp2.feasible) << cp2.why;
    ASSERT_TRUE(dp2.feasible) << dp2.why;
    const auto want = tp::zero_model_states(m.parameters, zero, 2, sb);
    for (const auto* e : {&cp2, &dp2}) {
      EXPECT_DOUBLE_EQ(e->memory.parameters, want.parameters);
      EXPECT_DOUBLE_EQ(e->memory.gradients, want.gradients);
      EXPECT_DOUBLE_EQ(e->memory.optimizer, want.optimizer);
    }
    EXPECT_DOUBLE_EQ(cp2.optimizer_s, dp2.optimizer_s);  // each updates its half under ZeRO
    const char* grad_part = zero >= 1 ? "dp reduce_scatter" : "dp allreduce";
    ASSERT_TRUE(cp2.comm_parts.count(grad_part)) << "no gradient reduction over the cp ranks";
    EXPECT_DOUBLE_EQ(cp2.comm_parts.at(grad_part), dp2.comm_parts.at(grad_part));
  }
  const auto z3 = context_parallel(m, c, 1, 2, 1, 3, 2, 1);
  EXPECT_LT(z3.memory.parameters, tp::zero_model_states(m.parameters, 3, 1, sb).parameters);
}

// Ring traffic by hand. 2 layers, hidden 64, 4 heads of which 2 key/value heads (kv width 32),
// T = 32, micro-batches of 3, 2 per step, cp 2, in fp32: each send is k and v of T/cp = 16
// tokens: 2 * 16 * 32 * 3 samples * 4 bytes = 12288 bytes; per layer and micro-batch cp - 1 = 1
// forward, cp - 1 = 1 backward k/v and cp = 2 gradient sends (4); 2 layers x 2 micro-batches:
// 16 sends, 196608 bytes. cp 4: 2 * 8 * 32 * 3 * 4 = 6144 bytes, 10 sends per layer and
// micro-batch, 40 in all: 245760 bytes. At 1 GB/s and 1 us per message a 12288-byte send takes
// 13.288 us.
TEST(Plan, ContextParallelRingTrafficByHand) {
  auto m = tp::transformer_model(2, 64, 4, 32, 100);
  m.kv_heads = 2;
  auto c = tp::cluster_preset("h100x8");
  c.intra.bandwidth = 1e9;
  c.intra.latency = 1e-6;
  c.framework_overhead_s = 0;
  tp::PlanOptions fp32;
  fp32.precision = "fp32";
  auto cp2 = context_parallel(m, c, 1, 2, 1, 0, 3, 2, fp32);
  ASSERT_TRUE(cp2.feasible) << cp2.why;
  EXPECT_DOUBLE_EQ(cp2.ring_bytes, 196608.0);
  EXPECT_NEAR(cp2.ring_s, 16 * 13.288e-6, 1e-15);
  EXPECT_NEAR(cp2.comm_parts.at("cp ring"), cp2.ring_s, 1e-15);
  const auto cp4 = context_parallel(m, c, 1, 4, 1, 0, 3, 2, fp32);
  ASSERT_TRUE(cp4.feasible) << cp4.why;
  EXPECT_DOUBLE_EQ(cp4.ring_bytes, 245760.0);
  // Tensor parallelism splits the heads: half the bytes.
  const auto cp2tp2 = context_parallel(m, c, 1, 2, 2, 0, 3, 2, fp32);
  ASSERT_TRUE(cp2tp2.feasible) << cp2tp2.why;
  EXPECT_DOUBLE_EQ(cp2tp2.ring_bytes, 196608.0 / 2);
  // No ring without context parallelism.
  EXPECT_EQ(context_parallel(m, c, 1, 1, 1, 0, 3, 2, fp32).ring_bytes, 0.0);
  // The exposed part lies in the step beside the compute, the exposed data-parallel traffic and
  // the optimizer (no fixed overhead here).
  EXPECT_NEAR(cp2.step_s, cp2.compute_s + cp2.ring_exposed_s + cp2.exposed_comm_s + cp2.optimizer_s,
              1e-12 * cp2.step_s);

  // Blocks that take no time hide nothing: every send is exposed. Blocks far longer than a send
  // hide all but backward's last gradient send of each layer and micro-batch (2 x 2 of them).
  for (auto& g : c.groups) g.device.flops = g.device.flops_fp32 = 1e30;
  cp2 = context_parallel(m, c, 1, 2, 1, 0, 3, 2, fp32);
  ASSERT_TRUE(cp2.feasible) << cp2.why;
  EXPECT_NEAR(cp2.ring_exposed_s, cp2.ring_s, 1e-12);
  const auto fast4 = context_parallel(m, c, 1, 4, 1, 0, 3, 2, fp32);
  EXPECT_NEAR(fast4.ring_exposed_s, fast4.ring_s, 1e-12);
  for (auto& g : c.groups) g.device.flops = g.device.flops_fp32 = 1e3;
  cp2 = context_parallel(m, c, 1, 2, 1, 0, 3, 2, fp32);
  ASSERT_TRUE(cp2.feasible) << cp2.why;
  EXPECT_NEAR(cp2.ring_exposed_s, 4 * 13.288e-6, 1e-15);
  // In 16-bit, k and v travel in 2 bytes and the accumulated gradients in float32: cp 2 sends 2
  // k/v blocks of 6144 bytes and 2 gradients of 12288 per layer and micro-batch, 147456 in all.
  const auto mixed = context_parallel(m, c, 1, 2, 1, 0, 3, 2);
  ASSERT_TRUE(mixed.feasible) << mixed.why;
  EXPECT_DOUBLE_EQ(mixed.ring_bytes, 147456.0);
}

// A replica spans cp x tp x pp devices: a cp that divides no device count is refused, every
// layout plan() prices with a cp uses all the devices, and a model without a sequence to split
// (or one not in 2 x cp chunks) is infeasible with the reason.
TEST(Plan, ContextParallelLayoutsMustDivideTheDevices) {
  const auto m = tp::transformer_model(4, 512, 8, 1024, 1000);
  const auto c = tp::cluster_preset("h100x8");
  tp::PlanOptions o;
  o.global_batch = 8;
  o.devices = 6;
  o.cp = {4};
  EXPECT_THROW(tp::plan(m, c, o), std::invalid_argument);
  o.cp = {0};
  EXPECT_THROW(tp::plan(m, c, o), std::invalid_argument);
  o.devices = 8;
  o.cp = {2};
  const auto all = tp::plan(m, c, o);
  ASSERT_FALSE(all.empty());
  for (const auto& e : all) {
    EXPECT_EQ(e.layout.cp, 2);
    EXPECT_EQ(e.layout.dp * e.layout.cp * e.layout.tp * e.layout.pp, 8) << e.layout.strategy_name();
  }
  o.devices = 0;
  o.dp_only_workers = {1, 2, 3, 4};
  const auto listed = tp::plan(m, c, o);
  for (const auto& e : listed) EXPECT_TRUE(e.layout.devices() == 2 || e.layout.devices() == 4);
  o.dp_only_workers = {3};
  EXPECT_THROW(tp::plan(m, c, o), std::invalid_argument);

  tp::Layout l;
  l.dp = 2;
  l.cp = 2;
  l.zero = 1;
  EXPECT_EQ(l.strategy_name(), "dp2 cp2 tp1 pp1 zero1");
  const auto odd = context_parallel(tp::transformer_model(4, 512, 8, 1020, 1000), c, 1, 4, 1, 0, 1, 1);
  EXPECT_FALSE(odd.feasible);
  EXPECT_NE(odd.why.find("multiple of 2 * cp"), std::string::npos) << odd.why;
  const auto cnn = context_parallel(tp::builtin_model("cnn"), c, 1, 2, 1, 0, 1, 1);
  EXPECT_FALSE(cnn.feasible);
  EXPECT_NE(cnn.why.find("context parallelism"), std::string::npos) << cnn.why;
}

// The run report's "plan predicts" figures take the run's cp: per-replica micro-batches as
// dp 2 x cp 1, activations halved, ZeRO-1's optimizer state sharded over the 4 ranks.
TEST(Plan, PlannedMemoryOfARunModelsContextParallelism) {
  const auto m = tp::transformer_model(2, 64, 4, 32, 100);
  tandem::ParallelConfig pc;
  pc.strategy = tandem::Strategy::kZero1;
  tandem::Report one, two;
  tp::add_planned_memory(m, pc, 2, 8, "adamw", {}, one);
  pc.cp = 2;
  tp::add_planned_memory(m, pc, 4, 8, "adamw", {}, two);
  ASSERT_EQ(one.plan_memory_bytes.size(), 4u);
  ASSERT_EQ(two.plan_memory_bytes.size(), 4u);
  EXPECT_DOUBLE_EQ(two.plan_memory_bytes[0], one.plan_memory_bytes[0]);
  EXPECT_DOUBLE_EQ(two.plan_memory_bytes[2], one.plan_memory_bytes[2] / 2);
  EXPECT_DOUBLE_EQ(two.plan_memory_bytes[3], one.plan_memory_bytes[3] / 2);
  tandem::Report none;
  tp::add_planned_memory(m, pc, 3, 8, "adamw", {}, none);  // 3 ranks do not hold replicas of 2
  EXPECT_TRUE(none.plan_memory_bytes.empty());
}

// A Llama's activations are counted from what its layers keep per token (fp32 elements):
// 11h + 2 h_kv + 4i per layer, the final norm's 2h and the log-softmax's vocabulary, here by hand
// for 2 layers, h 8 over 2 heads with 1 key/value head (h_kv 4), i 12, 4 tokens, 10 words. In
// 16-bit the planner halves it.
TEST(Plan, LlamaActivationsCountWhatItsLayersKeep) {
  const auto m = tp::llama_model(2, 8, 2, 1, 12, 4, 10, 1000);
  const double per_layer = 11 * 8 + 2 * 4 + 4 * 12;
  EXPECT_DOUBLE_EQ(m.activation_bytes_per_sample, 4.0 * 4 * (2 * per_layer + 2 * 8 + 10));
  EXPECT_EQ(m.kv_heads, 1);
  EXPECT_DOUBLE_EQ(tp::activation_bytes_per_sample(m, 1), m.activation_bytes_per_sample);
}
