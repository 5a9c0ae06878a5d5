// Activation checkpointing in one process: the gradients equal those of the plain forward (the
// recomputation replays dropout's draws), the random stream goes on as without it, the wrapper
// keeps the model's parameter names, and the Engine with --strategy single trains the same.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdlib.h>

#include "tandem/activation_checkpoint.h"
#include "tandem/engine.h"

namespace tandem {
namespace {

torch::nn::Sequential dropout_net() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Dropout(0.5),
                               torch::nn::Linear(16, 16), torch::nn::GELU(), torch::nn::Dropout(0.5),
                               torch::nn::Linear(16, 3));
}

// Gradients of every parameter after one backward, and the generator's next draw.
std::map<std::string, at::Tensor> grads_of(torch::nn::Sequential net, const at::Tensor& x, double* next_draw) {
  torch::manual_seed(42);
  auto out = net->forward(x);
  out.pow(2).sum().backward();
  *next_draw = torch::rand({1}).item<double>();
  std::map<std::string, at::Tensor> g;
  for (const auto& p : net->named_parameters()) g[p.key()] = p.value().grad().clone();
  return g;
}

TEST(ActivationCheckpoint, GradientsEqualThePlainForwardWithDropout) {
  auto x = torch::randn({6, 8});
  double plain_next = 0, recomputed_next = 0;
  const auto plain = grads_of(dropout_net(), x, &plain_next);
  auto wrapped = checkpoint_sequential(dropout_net(), parse_activation_checkpointing("every"));
  const auto recomputed = grads_of(wrapped, x, &recomputed_next);
  ASSERT_EQ(plain.size(), recomputed.size());
  for (const auto& [name, g] : plain) {
    ASSERT_TRUE(recomputed.count(name)) << name << " lost its name";
    EXPECT_LE((recomputed.at(name) - g).abs().max().item<double>(), 1e-6) << name;
  }
  EXPECT_EQ(plain_next, recomputed_next) << "the generator does not go on as without recomputation";
  // The test can fail: another dropout mask gives other gradients.
  torch::manual_seed(43);
  auto other = dropout_net();
  other->forward(x).pow(2).sum().backward();
  EXPECT_GT((other->named_parameters()["0.weight"].grad() - plain.at("0.weight")).abs().max().item<double>(), 1e-3);
}

TEST(ActivationCheckpoint, FirstNLayersAndTheirNames) {
  auto net = dropout_net();
  auto wrapped = checkpoint_sequential(net, parse_activation_checkpointing("2"));
  ASSERT_EQ(wrapped->size(), net->size());
  EXPECT_TRUE(wrapped->ptr(0)->as<CheckpointedImpl>());
  EXPECT_TRUE(wrapped->ptr(1)->as<CheckpointedImpl>());
  EXPECT_FALSE(wrapped->ptr(2)->as<CheckpointedImpl>());
  const auto a = net->named_parameters(), b = wrapped->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].key(), b[i].key());
    EXPECT_TRUE(a[i].value().is_same(b[i].value())) << "the wrapper must share, not copy, " << a[i].key();
  }
  // Per pipeline stage: the first layer of each of the stages [3, 4].
  auto staged = checkpoint_sequential(net, parse_activation_checkpointing("1"), {3, 4});
  EXPECT_TRUE(staged->ptr(0)->as<CheckpointedImpl>());
  EXPECT_FALSE(staged->ptr(1)->as<CheckpointedImpl>());
  EXPECT_TRUE(staged->ptr(3)->as<CheckpointedImpl>());
  EXPECT_FALSE(staged->ptr(4)->as<CheckpointedImpl>());
}

TEST(ActivationCheckpoint, EvalModeReachesTheWrappedLayer) {
  auto wrapped = checkpoint_sequential(dropout_net(), parse_activation_checkpointing("every"));
  wrapped->eval();
  auto x = torch::randn({4, 8});
  torch::NoGradGuard ng;
  EXPECT_TRUE(wrapped->forward(x).equal(wrapped->forward(x))) << "dropout still active in eval mode";
}

TEST(ActivationCheckpoint, IntegerInputsStillGiveParameterGradients) {
  torch::manual_seed(5);
  auto net = torch::nn::Sequential(torch::nn::Embedding(10, 4), torch::nn::Flatten(), torch::nn::Linear(12, 2));
  auto wrapped = checkpoint_sequential(net, parse_activation_checkpointing("every"));
  auto ids = torch::randint(0, 10, {5, 3});
  wrapped->forward(ids).sum().backward();
  auto g = net->named_parameters()["0.weight"].grad();
  ASSERT_TRUE(g.defined()) << "the embedding (first layer, integer input) got no gradient";
  EXPECT_GT(g.abs().sum().item<double>(), 0.0);
}

TEST(ActivationCheckpoint, ParsesAndRefuses) {
  EXPECT_EQ(to_string(parse_activation_checkpointing("none")), "none");
  EXPECT_EQ(to_string(parse_activation_checkpointing("every")), "every");
  EXPECT_EQ(to_string(parse_activation_checkpointing("3")), "3");
  for (const char* bad : {"0", "-1", "all", "2x", "1.5"}) {
    EXPECT_THROW(parse_activation_checkpointing(bad), std::invalid_argument) << bad;
  }
  try {
    checkpoint_sequential(dropout_net(), parse_activation_checkpointing("2"), {1, 6});
    ADD_FAILURE() << "2 layers of a 1-layer stage were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline stage 0 has 1 layers"), std::string::npos) << e.what();
  }
}

TEST(ActivationCheckpoint, EngineRefusesAModelThatIsNotASequential) {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE"}) unsetenv(v);
  RuntimeOptions ro;
  ro.device = "cpu";
  ro.backend = "self";
  Runtime rt(ro);
  ParallelConfig c;
  c.strategy = Strategy::kSingle;
  c.activation_checkpointing = parse_activation_checkpointing("every");
  OptimizerOptions o;
  o.kind = "sgd";
  torch::nn::Linear lin(4, 2);
  try {
    Engine eng(
        rt, std::shared_ptr<torch::nn::Module>(lin.ptr()),
        [m = lin.ptr()](const at::Tensor& x) { return m->forward(x); }, o, c);
    ADD_FAILURE() << "a Linear was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tandem::Checkpointed"), std::string::npos) << e.what();
  }
  // --strategy single with recomputation trains as without it.
  std::vector<double> losses[2];
  for (int k = 0; k < 2; ++k) {
    ParallelConfig pc;
    pc.strategy = Strategy::kSingle;
    pc.activation_checkpointing = parse_activation_checkpointing(k ? "every" : "none");
    Engine eng(rt, dropout_net(), o, pc);
    torch::manual_seed(8);
    for (int s = 0; s < 3; ++s) {
      auto x = torch::randn({8, 8});
      auto y = torch::randint(0, 3, {8});
      losses[k].push_back(eng.step(x, y,
                                   [](const at::Tensor& out, const at::Tensor& t) {
                                     return torch::nn::functional::cross_entropy(out, t);
                                   })
                              .item<double>());
    }
  }
  for (int s = 0; s < 3; ++s) EXPECT_NEAR(losses[0][s], losses[1][s], 1e-6) << "step " << s;
}

}  // namespace
}  // namespace tandem
