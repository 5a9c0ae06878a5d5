// LARS and LAMB in one process, against float64 PyTorch references written from the papers
// (tests/unit/layerwise_reference.py, stored in tests/data/optim): every step's parameters and
// state, with weight decay and the excluded 1-D parameters; the same through a layout that packs
// the parameters into flat tensors as ZeRO does; checkpoint state; options and their errors.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "tandem/optim.h"

namespace tandem {
namespace {

using nlohmann::json;

// What the Python reference computes agrees to rounding; the issue asks for 1e-6.
constexpr double kTol = 1e-6;

json load_reference() {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  if (!src) return json();
  std::ifstream f(std::string(src) + "/tests/data/optim/layerwise_reference.json");
  if (!f) throw std::runtime_error("tests/data/optim/layerwise_reference.json is missing");
  return json::parse(f);
}

at::Tensor tensor(const json& values, const json& shape) {
  auto v = values.get<std::vector<double>>();
  return torch::tensor(v, torch::kDouble).reshape(shape.get<std::vector<int64_t>>());
}

OptimizerOptions options(const json& c) {
  const auto& o = c.at("options");
  OptimizerOptions r;
  r.kind = c.at("kind").get<std::string>();
  r.lr = o.at("lr");
  r.momentum = o.at("momentum");
  r.beta1 = o.at("beta1");
  r.beta2 = o.at("beta2");
  r.eps = o.at("eps");
  r.weight_decay = o.at("weight_decay");
  r.trust_coefficient = o.at("trust_coefficient");
  r.adapt_vectors = o.at("adapt_vectors");
  return r;
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.reshape({-1}) - b.reshape({-1})).abs().max().item<double>();
}

std::vector<at::Tensor> initial(const json& c) {
  std::vector<at::Tensor> ps;
  for (size_t i = 0; i < c.at("shapes").size(); ++i) ps.push_back(tensor(c["init"][i], c["shapes"][i]));
  return ps;
}

class LayerwiseReference : public ::testing::Test {
 protected:
  void SetUp() override {
    ref_ = load_reference();
    if (ref_.is_null()) GTEST_SKIP() << "TANDEM_SOURCE_DIR unset (ctest sets it)";
    ASSERT_GE(ref_.at("cases").size(), 6u);
  }
  json ref_;
};

// One optimizer tensor per parameter: the plain layout.
TEST_F(LayerwiseReference, StepsMatchPyTorch) {
  for (const auto& c : ref_["cases"]) {
    const std::string name = c["name"];
    auto ps = initial(c);
    auto opt = make_optimizer(ps, options(c));
    EXPECT_EQ(optimizer_kind(*opt), c["kind"].get<std::string>());
    for (size_t s = 0; s < c["grads"].size(); ++s) {
      for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = tensor(c["grads"][s][i], c["shapes"][i]);
      opt->step();
      const auto& want = c["steps"][s];
      for (size_t i = 0; i < ps.size(); ++i) {
        EXPECT_LT(max_diff(ps[i], tensor(want["params"][i], c["shapes"][i])), kTol)
            << name << ": parameter " << i << " after step " << s + 1;
        const auto st = get_param_state(*opt, ps[i]);
        for (const auto& slot : {"exp_avg", "exp_avg_sq", "momentum_buffer"}) {
          if (!want.contains(slot) || want[slot].empty()) {
            EXPECT_EQ(st.slots.count(slot), 0u) << name << ": " << slot;
            continue;
          }
          ASSERT_EQ(st.slots.count(slot), 1u) << name << ": no " << slot;
          EXPECT_LT(max_diff(st.slots.at(slot), tensor(want[slot][i], c["shapes"][i])), kTol)
              << name << ": " << slot << " of parameter " << i << " after step " << s + 1;
        }
        if (c["kind"] == "lamb") EXPECT_EQ(st.step, static_cast<int64_t>(s + 1));
      }
    }
  }
}

// The parameters packed back to back into two flat tensors with padding, cut inside the first
// parameter and inside the third (as ZeRO's chunks cut them): each parameter's norm is summed
// over its pieces and the exclusion follows the parameter, not the tensor; padding never moves.
TEST_F(LayerwiseReference, PackedLayoutMatchesWholeParameters) {
  for (const auto& c : ref_["cases"]) {
    const std::string name = c["name"];
    const auto init = initial(c);
    std::vector<at::Tensor> flat_init;
    for (const auto& p : init) flat_init.push_back(p.reshape({-1}));
    const int64_t total = at::cat(flat_init).numel(), pad = 3;
    const int64_t cut = 7;  // inside the 3x4 matrix
    auto all = at::cat({at::cat(flat_init), at::full({pad}, 5.0, torch::kDouble)});
    std::vector<at::Tensor> pieces = {all.narrow(0, 0, cut).clone(), all.narrow(0, cut, total + pad - cut).clone()};
    LayerwiseLayout L;
    L.segments.resize(2);
    int64_t off = 0;
    for (size_t i = 0; i < init.size(); ++i) {
      const int64_t n = init[i].numel();
      L.dims.push_back(init[i].dim());
      for (int t = 0; t < 2; ++t) {
        const int64_t lo = t == 0 ? 0 : cut, hi = t == 0 ? cut : total + pad;
        const int64_t from = std::max(lo, off), to = std::min(hi, off + n);
        if (from < to) L.segments[t].push_back({from - lo, to - from, static_cast<int64_t>(i)});
      }
      off += n;
    }
    auto opt = make_optimizer(pieces, options(c));
    set_layerwise_layout(*opt, L);
    for (size_t s = 0; s < c["grads"].size(); ++s) {
      std::vector<at::Tensor> g;
      for (size_t i = 0; i < init.size(); ++i) g.push_back(tensor(c["grads"][s][i], c["shapes"][i]).reshape({-1}));
      auto gall = at::cat({at::cat(g), at::full({pad}, 7.0, torch::kDouble)});
      pieces[0].mutable_grad() = gall.narrow(0, 0, cut).clone();
      pieces[1].mutable_grad() = gall.narrow(0, cut, total + pad - cut).clone();
      opt->step();
    }
    const auto& want = c["steps"].back()["params"];
    auto got = at::cat(pieces);
    off = 0;
    for (size_t i = 0; i < init.size(); ++i) {
      const int64_t n = init[i].numel();
      EXPECT_LT(max_diff(got.narrow(0, off, n), tensor(want[i], c["shapes"][i])), kTol) << name << ": parameter " << i;
      off += n;
    }
    EXPECT_EQ(max_diff(got.narrow(0, total, pad), at::full({pad}, 5.0, torch::kDouble)), 0.0) << name << ": padding";
  }
}

// Checkpoint state: copied into a fresh optimizer after two steps, the third step is the
// reference's.
TEST_F(LayerwiseReference, StateRestoresIntoAFreshOptimizer) {
  for (const auto& c : ref_["cases"]) {
    const std::string name = c["name"];
    auto ps = initial(c);
    auto opt = make_optimizer(ps, options(c));
    for (size_t s = 0; s < 2; ++s) {
      for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = tensor(c["grads"][s][i], c["shapes"][i]);
      opt->step();
    }
    std::vector<at::Tensor> qs;
    for (auto& p : ps) qs.push_back(p.detach().clone());
    auto fresh = make_optimizer(qs, options(c));
    for (size_t i = 0; i < ps.size(); ++i) set_param_state(*fresh, qs[i], get_param_state(*opt, ps[i]));
    for (size_t i = 0; i < qs.size(); ++i) qs[i].mutable_grad() = tensor(c["grads"][2][i], c["shapes"][i]);
    fresh->step();
    for (size_t i = 0; i < qs.size(); ++i) {
      EXPECT_LT(max_diff(qs[i], tensor(c["steps"][2]["params"][i], c["shapes"][i])), kTol)
          << name << ": parameter " << i;
    }
  }
}

TEST(Layerwise, StateSlotsAndOptionErrors) {
  OptimizerOptions o;
  o.kind = "lamb";
  EXPECT_EQ(optimizer_state_slots(o), 2);
  o.kind = "lars";
  EXPECT_EQ(optimizer_state_slots(o), 0);
  o.momentum = 0.9;
  EXPECT_EQ(optimizer_state_slots(o), 1);
  EXPECT_TRUE(is_layerwise(o));
  auto message = [](const OptimizerOptions& bad) {
    try {
      validate(bad);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  o.trust_coefficient = 0.0;
  EXPECT_NE(message(o).find("trust coefficient must be a positive number"), std::string::npos) << message(o);
  o.kind = "lion";
  EXPECT_NE(message(o).find("unknown optimizer 'lion' (use sgd, adam, adamw, lars or lamb)"), std::string::npos)
      << message(o);
  // A layout must fit the optimizer's tensors.
  auto w = torch::zeros({4}, torch::kDouble);
  OptimizerOptions lamb;
  lamb.kind = "lamb";
  auto opt = make_optimizer({w}, lamb);
  LayerwiseLayout L;
  L.dims = {1};
  L.segments = {{{2, 3, 0}}};
  EXPECT_THROW(set_layerwise_layout(*opt, L), std::invalid_argument);
  OptimizerOptions adam;
  adam.kind = "adam";
  auto other = make_optimizer({w}, adam);
  L.segments = {{{0, 4, 0}}};
  EXPECT_THROW(set_layerwise_layout(*other, L), std::invalid_argument);
}

}  // namespace
}  // namespace tandem
