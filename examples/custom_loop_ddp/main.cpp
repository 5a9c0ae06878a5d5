// A hand-written data-parallel loop: tandem::DistributedDataParallel averages the gradients,
// LibTorch's SGD (with momentum) updates, and Tandem's checkpoints save the model and the
// optimizer state at step --save-at; a later run with --resume continues from the newest
// checkpoint under --checkpoint-dir, with any worker count, and its losses continue those of
// an uninterrupted run. Rank 0 prints `step N loss X` (the global batch's loss) per step.
//
//   custom_loop_ddp [--steps 10] [--batch 64] [--lr 0.05] [--seed 1] [--data DIR]
//                   [--checkpoint-dir DIR] [--save-at STEP] [--resume]
#include <tandem/checkpoint.h>
#include <tandem/comm.h>
#include <tandem/data.h>
#include <tandem/ddp.h>
#include <tandem/runtime.h>

#include <torch/torch.h>

#include <cstdio>
#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>

namespace {

// Two strided convolutions and a linear classifier: 28x28 -> 13x13 -> 6x6.
struct SmallCnnImpl : torch::nn::Module {
  SmallCnnImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).stride(2)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).stride(2)))),
        fc(register_module("fc", torch::nn::Linear(16 * 6 * 6, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(torch::relu(conv2(torch::relu(conv1(x)))).flatten(1)); }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc;
};
TORCH_MODULE(SmallCnn);

struct Options {
  int64_t steps = 10, batch = 64, save_at = 0;
  double lr = 0.05;
  uint64_t seed = 1;
  std::string data = tandem::data::kFashionMnistDir, checkpoint_dir = "custom_loop_ckpt";
  bool resume = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--resume") {
      o.resume = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
    std::string v = argv[++i];
    if (a == "--steps") o.steps = std::stoll(v);
    else if (a == "--batch") o.batch = std::stoll(v);
    else if (a == "--save-at") o.save_at = std::stoll(v);
    else if (a == "--lr") o.lr = std::stod(v);
    else if (a == "--seed") o.seed = std::stoull(v);
    else if (a == "--data") o.data = v;
    else if (a == "--checkpoint-dir") o.checkpoint_dir = v;
    else throw std::invalid_argument("unknown flag " + a);
  }
  return o;
}

int run(const Options& o) {
  tandem::RuntimeOptions ro;
  ro.threads = 1;  // one compute thread: reductions in the same order on every run
  ro.device = "cpu";
  tandem::Runtime rt(ro);
  const int world = rt.world_size();
  if (o.batch % world != 0) throw std::invalid_argument("--batch must be a multiple of the worker count");

  torch::manual_seed(o.seed);
  SmallCnn model;
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(o.lr).momentum(0.9));

  // Resuming restores parameters and momentum before DDP broadcasts rank 0's values (which
  // every rank then already holds); the loop continues at the step after the saved one.
  int64_t start = 0;
  if (o.resume) {
    auto dir = tandem::latest_checkpoint(o.checkpoint_dir);
    if (dir.empty()) throw std::runtime_error("no checkpoint under " + o.checkpoint_dir);
    tandem::CheckpointLoadOptions lo;
    lo.expect_model = "small_cnn";
    start = tandem::load_checkpoint(dir, *model, opt, rt.rank(), lo).step;
    if (rt.rank() == 0) std::printf("resumed from %s at step %lld\n", dir.c_str(), static_cast<long long>(start));
  }
  tandem::DistributedDataParallel ddp(model.ptr(), rt.world());

  // The same global batches whatever the worker count: rank r takes positions r, r + W, ...
  auto train = tandem::data::load_fashion_mnist(o.data, /*train=*/true);
  tandem::data::DistributedSampler sampler(train.size(), rt.rank(), world, /*shuffle=*/true, o.seed,
                                           /*drop_last=*/true);
  auto batches = tandem::data::batches(sampler.indices(), o.batch / world, /*drop_last=*/true);
  if (o.steps > static_cast<int64_t>(batches.size())) throw std::invalid_argument("--steps exceeds one epoch");

  for (int64_t step = start + 1; step <= o.steps; ++step) {
    auto [x, y] = tandem::data::gather_batch(train, batches[step - 1]);
    ddp.prepare_forward();
    ddp.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();  // returns with every gradient averaged over the workers
    opt.step();

    auto global = loss.detach().clone();
    rt.world()->allreduce(global, tandem::ReduceOp::kAvg);
    if (rt.rank() == 0) std::printf("step %lld loss %.8f\n", static_cast<long long>(step), global.item<double>());

    if (step == o.save_at) {
      tandem::CheckpointMeta meta;
      meta.model = "small_cnn";
      meta.strategy = "ddp";
      meta.step = step;
      meta.seed = o.seed;
      auto dir = tandem::save_checkpoint(o.checkpoint_dir, meta, *model, opt, *rt.cpu_world());
      if (rt.rank() == 0) std::printf("saved %s\n", dir.c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "custom_loop_ddp: " << e.what() << "\n";
    return 1;
  }
}
