// The MoE layer's configuration checks and names, and this thread's statistics and auxiliary
// gradient scale (tandem/moe.h), without running a layer.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <thread>

#include "tandem/moe.h"

namespace tandem::moe {
namespace {

MoeConfig good() {
  MoeConfig c;
  c.hidden_size = 8;
  c.intermediate_size = 16;
  c.num_experts = 4;
  c.top_k = 2;
  return c;
}

std::string refusal(const MoeConfig& c) {
  try {
    validate(c);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(MoeConfig, ValidateAcceptsMixtralLikeSettings) {
  auto c = good();
  EXPECT_EQ(refusal(c), "");
  c.top_k = 1;
  c.aux_loss_coef = 0.02;
  c.z_loss_coef = 0.001;
  c.capacity_factor = 1.25;
  c.aux_form = AuxLossForm::kPerLayer;
  EXPECT_EQ(refusal(c), "");
  c.top_k = 4;  // every expert
  EXPECT_EQ(refusal(c), "");
}

TEST(MoeConfig, ValidateNamesTheFieldAndTheValue) {
  struct Bad {
    std::function<void(MoeConfig&)> change;
    std::string field, value;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<Bad> bad = {
      {[](MoeConfig& c) { c.hidden_size = 0; }, "hidden_size", "0"},
      {[](MoeConfig& c) { c.intermediate_size = -3; }, "intermediate_size", "-3"},
      {[](MoeConfig& c) { c.num_experts = 0; }, "num_experts", "0"},
      {[](MoeConfig& c) { c.top_k = 0; }, "top_k", "0"},
      {[](MoeConfig& c) { c.top_k = 5; }, "top_k", "5"},
      {[](MoeConfig& c) { c.aux_loss_coef = -0.5; }, "aux_loss_coef", "-0.5"},
      {[](MoeConfig& c) { c.z_loss_coef = -1; }, "z_loss_coef", "-1"},
      {[](MoeConfig& c) { c.capacity_factor = -2; }, "capacity_factor", "-2"},
      {[nan](MoeConfig& c) { c.aux_loss_coef = nan; }, "aux_loss_coef", "nan"},
  };
  for (const auto& b : bad) {
    auto c = good();
    b.change(c);
    const auto msg = refusal(c);
    EXPECT_NE(msg.find(b.field), std::string::npos) << b.field << ": " << msg;
    EXPECT_NE(msg.find(b.value), std::string::npos) << b.field << ": " << msg;
  }
  auto c = good();
  c.top_k = 5;
  EXPECT_NE(refusal(c).find("num_experts = 4"), std::string::npos) << refusal(c);
}

TEST(MoeConfig, AuxLossFormNamesRoundTripAndAWrongOneListsTheChoices) {
  EXPECT_EQ(parse_aux_loss_form("pooled"), AuxLossForm::kPooled);
  EXPECT_EQ(parse_aux_loss_form("per-layer"), AuxLossForm::kPerLayer);
  for (auto f : {AuxLossForm::kPooled, AuxLossForm::kPerLayer}) EXPECT_EQ(parse_aux_loss_form(to_string(f)), f);
  for (const std::string wrong : {"per_layer", "Pooled", ""}) {
    try {
      parse_aux_loss_form(wrong);
      ADD_FAILURE() << "'" << wrong << "' accepted";
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'" + wrong + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("pooled"), std::string::npos) << msg;
      EXPECT_NE(msg.find("per-layer"), std::string::npos) << msg;
    }
  }
}

// Replicas of one process are threads: each keeps its own statistics and scale.
TEST(MoeStats, StatisticsAndAuxGradScaleBelongToTheThread) {
  reset_moe_stats();
  EXPECT_EQ(aux_grad_scale(), 1.0);
  mutable_moe_stats().routed += 6;
  mutable_moe_stats().all_to_all_bytes += 40;
  set_aux_grad_scale(0.25);
  MoeStats other_stats;
  double other_scale = 0;
  std::thread([&] {
    other_scale = aux_grad_scale();
    mutable_moe_stats().routed += 1;
    set_aux_grad_scale(8.0);
    other_stats = moe_stats();
  }).join();
  EXPECT_EQ(other_scale, 1.0);
  EXPECT_EQ(other_stats.routed, 1);
  EXPECT_EQ(other_stats.all_to_all_bytes, 0);
  EXPECT_EQ(moe_stats().routed, 6);
  EXPECT_EQ(moe_stats().all_to_all_bytes, 40);
  EXPECT_EQ(aux_grad_scale(), 0.25);
  EXPECT_THROW(set_aux_grad_scale(std::nan("")), std::invalid_argument);
  EXPECT_EQ(aux_grad_scale(), 0.25);
  reset_moe_stats();
  EXPECT_EQ(moe_stats().routed, 0);
  EXPECT_TRUE(moe_stats().tokens_per_expert.empty());
  set_aux_grad_scale(1.0);
}

}  // namespace
}  // namespace tandem::moe
