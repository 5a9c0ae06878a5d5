// Trains a residual MLP of its own on Fashion-MNIST through tandem::Engine, under the strategy
// given by --strategy (single, ddp, zero1, zero2, zero3), and saves a checkpoint at the end.
// Deterministic: seeded weights (broadcast from rank 0), the same global batch at every step
// whatever the worker count, one compute thread per worker. Rank 0 prints one line per step,
// `step N loss X`, with the loss of the global batch (the average over the replicas), so the
// lines of `tandem launch -n 2 -- resnet_engine` match those of one worker.
//
//   resnet_engine [--strategy ddp] [--steps 10] [--batch 64] [--lr 0.05] [--seed 1]
//                 [--data DIR] [--checkpoint-dir DIR]
#include <tandem/comm.h>
#include <tandem/data.h>
#include <tandem/engine.h>
#include <tandem/runtime.h>

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <map>
#include <stdexcept>
#include <string>

namespace {

// x + W2 relu(W1 norm(x)): a pre-norm residual block.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc1(register_module("fc1", torch::nn::Linear(width, width))),
        fc2(register_module("fc2", torch::nn::Linear(width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::relu(fc1(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

// A stem, `depth` residual blocks held in a ModuleList, and a classifier head: a nested module
// tree, not a Sequential.
struct ResidualMlpImpl : torch::nn::Module {
  ResidualMlpImpl(int64_t in, int64_t width, int64_t depth, int64_t classes)
      : stem(register_module("stem", torch::nn::Linear(in, width))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(width, classes))) {
    for (int64_t i = 0; i < depth; ++i) blocks->push_back(Block(width));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(stem(x.flatten(1)));
    for (const auto& b : *blocks) x = b->as<Block>()->forward(x);
    return head(x);
  }
  torch::nn::Linear stem;
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(ResidualMlp);

// --name value pairs; every name must be one of `defaults`.
std::map<std::string, std::string> parse_flags(int argc, char** argv, std::map<std::string, std::string> defaults) {
  for (int i = 1; i < argc; i += 2) {
    std::string name = argv[i];
    if (name.rfind("--", 0) != 0 || !defaults.count(name.substr(2)) || i + 1 >= argc) {
      std::string known;
      for (const auto& [k, v] : defaults) known += " --" + k;
      throw std::invalid_argument("bad argument '" + name + "'; each of" + known + " takes a value");
    }
    defaults[name.substr(2)] = argv[i + 1];
  }
  return defaults;
}

int run(int argc, char** argv) {
  auto flags = parse_flags(argc, argv,
                           {{"strategy", "ddp"},
                            {"steps", "10"},
                            {"batch", "64"},
                            {"lr", "0.05"},
                            {"seed", "1"},
                            {"data", tandem::data::kFashionMnistDir},
                            {"checkpoint-dir", "resnet_engine_ckpt"}});
  const int64_t steps = std::stoll(flags["steps"]), batch = std::stoll(flags["batch"]);
  const uint64_t seed = std::stoull(flags["seed"]);

  tandem::RuntimeOptions ro;
  ro.threads = 1;  // one compute thread: reductions in the same order on every run
  ro.device = "cpu";
  tandem::Runtime rt(ro);

  tandem::ParallelConfig config;
  config.strategy = tandem::parse_strategy(flags["strategy"]);
  tandem::validate(config, rt.world_size(), batch);

  torch::manual_seed(seed);
  ResidualMlp model(28 * 28, 128, 3, 10);
  tandem::OptimizerOptions opt;
  opt.kind = "sgd";
  opt.lr = std::stod(flags["lr"]);
  opt.momentum = 0.9;
  tandem::EngineOptions eo;
  eo.model_name = "residual_mlp";
  tandem::Engine engine(rt, model, opt, config, eo);

  // Replica r takes positions r, r + R, ... of each global batch of the seeded order: every
  // step's global batch holds the same samples for any replica count R.
  auto train = tandem::data::load_fashion_mnist(flags["data"], /*train=*/true);
  tandem::data::DistributedSampler sampler(train.size(), engine.dp_rank(), engine.dp_size(), /*shuffle=*/true, seed,
                                           /*drop_last=*/true);
  auto batches = tandem::data::batches(sampler.indices(), batch / engine.dp_size(), /*drop_last=*/true);
  if (steps > static_cast<int64_t>(batches.size())) throw std::invalid_argument("--steps exceeds one epoch");

  auto loss_fn = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  for (int64_t s = 0; s < steps; ++s) {
    auto [x, y] = tandem::data::gather_batch(train, batches[s]);
    auto loss = engine.step(x, y, loss_fn).clone();
    engine.world()->allreduce(loss, tandem::ReduceOp::kAvg);  // the replicas' mean: the global batch's loss
    if (rt.rank() == 0) std::printf("step %lld loss %.8f\n", static_cast<long long>(s + 1), loss.item<double>());
  }

  tandem::CheckpointMeta meta;
  meta.step = steps;
  meta.seed = seed;
  auto dir = engine.save(flags["checkpoint-dir"], meta);
  if (rt.rank() == 0) std::printf("saved %s\n", dir.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "resnet_engine: " << e.what() << "\n";
    return 1;
  }
}
