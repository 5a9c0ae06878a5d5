// gpu_bench: GPU correctness checks of the NCCL communicator and GPU benchmarks of Tandem's
// DDP, driven by scripts/gpu-check.sh. Plain flags and plain output (no CLI11, no JSON
// library), so that it builds wherever LibTorch does.
//
//   gpu_bench check [--skip-timeout-test]
//       Every Communicator operation of the NCCL backend on CUDA tensors, against references
//       each rank computes locally, plus stream semantics, errors, split, timeout/abort and a
//       DDP gradient check; then the trace, checkpoints, LoRA, context parallelism, PowerSGD,
//       hsdp, the zero-bubble pipelines and selective recomputation on the GPU. World size
//       from RANK / WORLD_SIZE / LOCAL_RANK (with TANDEM_STORE_DIR for the file bootstrap) or
//       mpirun; 1 when none is set.
//   gpu_bench bench --model cnn|transformer [--batch B] [--steps N] [--warmup W]
//                   [--layers L] [--dmodel D] [--heads H] [--seq S] [--no-oom-retry]
//       Step time of Tandem DDP on NCCL for one model (mirrored exactly by
//       bench/torch_ddp_gpu.py); prints one line "RESULT {json}".
//
// Exit codes: 0 ok, 1 a check or benchmark failed, 2 usage error or no CUDA in this build /
// on this machine, 3 skipped: NCCL refused this setup (e.g. two ranks on one GPU).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "tandem/activation_checkpoint.h"
#include "tandem/checkpoint.h"
#include "tandem/comm.h"
#include "tandem/context_parallel.h"
#include "tandem/ddp.h"
#include "tandem/engine.h"
#include "tandem/llama.h"
#include "tandem/lora.h"
#include "tandem/moe.h"
#include "tandem/pipeline.h"
#include "tandem/runtime.h"
#include "tandem/trace.h"
#include "tests/dist/all_to_all_cases.h"

#ifdef TANDEM_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/cuda.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "compat/torch_compat.h"
#endif

namespace {

struct Args {
  std::string cmd;
  std::map<std::string, std::string> kv;
  std::string get(const std::string& k, const std::string& d) const {
    auto it = kv.find(k);
    return it == kv.end() ? d : it->second;
  }
  int64_t num(const std::string& k, int64_t d) const { return std::stoll(get(k, std::to_string(d))); }
  bool flag(const std::string& k) const { return kv.count(k) > 0; }
};

const char* kUsage = "usage: gpu_bench check [--skip-timeout-test]\n"
                     "       gpu_bench bench --model cnn|transformer [--batch B] [--steps N] [--warmup W]\n"
                     "                       [--layers L] [--dmodel D] [--heads H] [--seq S] [--no-oom-retry]\n";

// ---------------------------------------------------------------- models (mirrored in bench/torch_ddp_gpu.py)

// conv32-conv64-fc128-fc10 on 1x28x28 inputs.
struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)))),
        fc1(register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    x = torch::relu(fc1(x.flatten(1)));
    return fc2(x);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Cnn);

// Pre-LN block: x + proj(attn(ln1(x))), then x + fc2(gelu(fc1(ln2(x)))); non-causal SDPA.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t h)
      : heads(h), ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        qkv(register_module("qkv", torch::nn::Linear(d, 3 * d))),
        proj(register_module("proj", torch::nn::Linear(d, d))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(torch::Tensor x) {
    const int64_t B = x.size(0), S = x.size(1), D = x.size(2);
    auto t = qkv(ln1(x)).view({B, S, 3, heads, D / heads}).permute({2, 0, 3, 1, 4});  // [3, B, H, S, hd]
    auto a = at::scaled_dot_product_attention(t[0], t[1], t[2]);                      // [B, H, S, hd]
    x = x + proj(a.transpose(1, 2).reshape({B, S, D}));
    x = x + fc2(torch::gelu(fc1(ln2(x))));
    return x;
  }
  int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct TransformerImpl : torch::nn::Module {
  TransformerImpl(int64_t layers, int64_t d, int64_t h) {
    for (int64_t i = 0; i < layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(d, h)));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b->forward(x);
    return ln_f(x);
  }
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Transformer);

int64_t count_params(torch::nn::Module& m) {
  int64_t n = 0;
  for (auto& p : m.parameters()) n += p.numel();
  return n;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

#ifdef TANDEM_WITH_CUDA

using tandem::CommError;
using tandem::CommPtr;
using tandem::CommTimeout;
using tandem::ReduceOp;

bool is_skip_error(const std::string& msg) {
  return msg.find("Duplicate GPU") != std::string::npos || msg.find("duplicate GPU") != std::string::npos;
}

// ---------------------------------------------------------------- check

class Checker {
 public:
  Checker(CommPtr comm, c10::Device dev, bool timeout_test)
      : comm_(std::move(comm)), dev_(dev), me_(comm_->rank()), R_(comm_->size()), timeout_test_(timeout_test) {}

  int run() {
    section("collectives per dtype", [&] { dtypes(); });
    section("non-contiguous tensors", [&] { noncontiguous(); });
    section("errors", [&] { errors(); });
    section("streams", [&] { streams(); });
    section("many in flight", [&] { many_in_flight(); });
    section("synchronize, seconds, stats", [&] { sync_and_stats(); });
    section("barrier", [&] {
      comm_->barrier();
      report("barrier", true);
    });
    section("split", [&] { split(); });
    section("ddp", [&] { ddp(); });
    if (timeout_test_) section("timeout and abort", [&] { timeout_abort(); });
    section("world still healthy", [&] {
      auto t = at::ones({1000}, opts(at::kFloat));
      auto w = comm_->allreduce_async(t, ReduceOp::kSum);
      w->synchronize();
      report("allreduce after the abort test", t.cpu().eq(static_cast<double>(R_)).all().item<bool>());
    });
    std::cout << "check: rank " << me_ << ": " << passed_ << " passed, " << failed_ << " failed (world size " << R_
              << ", backend " << comm_->backend() << ")" << std::endl;
    return failed_ == 0 ? 0 : 1;
  }

 private:
  at::TensorOptions opts(at::ScalarType t) const { return at::TensorOptions().dtype(t).device(dev_); }

  void report(const std::string& what, bool ok, const std::string& detail = "") {
    (ok ? passed_ : failed_) += 1;
    if (me_ == 0 || !ok) {
      std::cout << "check " << (ok ? "ok     " : "FAILED ") << "rank " << me_ << ": " << what;
      if (!detail.empty()) std::cout << " -- " << detail;
      std::cout << std::endl;
    }
  }

  template <typename F>
  void section(const std::string& name, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      report(name + " (threw)", false, e.what());
    }
  }

  // Rank r's input: small integers, exact in every dtype and in sums over a few ranks.
  at::Tensor input(int r, int64_t n, at::ScalarType t) const {
    auto v = (at::arange(n, at::kLong) * 7 + r * 131).remainder(23);
    if (t == at::kBool) return v.remainder(3).eq(0).to(dev_);
    if (t != at::kByte) v = v - 11;
    return v.to(t).to(dev_);
  }
  at::Tensor input_d(int r, int64_t n, at::ScalarType t) const { return input(r, n, t).cpu().to(at::kDouble); }

  static bool same(const at::Tensor& got, const at::Tensor& want, double tol = 1e-6) {
    auto g = got.cpu().to(at::kDouble).reshape(-1);
    auto w = want.cpu().to(at::kDouble).reshape(-1);
    return g.numel() == w.numel() && at::allclose(g, w, tol, tol);
  }

  std::string tag(const std::string& op, at::ScalarType t, int64_t n) const {
    return op + " " + c10::toString(t) + "[" + std::to_string(n) + "]";
  }

  void dtypes() {
    const std::vector<at::ScalarType> types = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                               at::kLong,  at::kInt,    at::kByte};
    for (auto t : types) {
      const bool fp = at::isFloatingType(t);
      const double tol = (t == at::kBFloat16 || t == at::kHalf) ? 1e-2 : 1e-6;
      for (int64_t n : {int64_t(1), int64_t(1000), int64_t(1 << 20) + 3}) {
        at::Tensor sum = at::zeros({n}, at::kDouble), mx;
        for (int r = 0; r < R_; ++r) {
          auto x = input_d(r, n, t);
          sum += x;
          mx = mx.defined() ? at::maximum(mx, x) : x;
        }
        auto a = input(me_, n, t);
        comm_->allreduce(a, ReduceOp::kSum);
        report(tag("allreduce sum", t, n), same(a, sum, tol));
        a = input(me_, n, t);
        comm_->allreduce(a, ReduceOp::kMax);
        report(tag("allreduce max", t, n), same(a, mx, tol));
        if (fp) {
          a = input(me_, n, t);
          comm_->allreduce(a, ReduceOp::kAvg);
          report(tag("allreduce avg", t, n), same(a, sum / R_, tol));
        }
        // reduce_scatter: input R*n, chunk `me` of the sum over ranks
        {
          at::Tensor big_sum = at::zeros({n * R_}, at::kDouble);
          for (int r = 0; r < R_; ++r) big_sum += input_d(r, n * R_, t);
          auto out = at::empty({n}, opts(t));
          comm_->reduce_scatter(out, input(me_, n * R_, t), ReduceOp::kSum);
          report(tag("reduce_scatter sum", t, n), same(out, big_sum.narrow(0, me_ * n, n), tol));
          if (fp) {
            comm_->reduce_scatter(out, input(me_, n * R_, t), ReduceOp::kAvg);
            report(tag("reduce_scatter avg", t, n), same(out, big_sum.narrow(0, me_ * n, n) / R_, tol));
          }
        }
        {
          auto out = at::empty({n * R_}, opts(t));
          comm_->allgather(out, input(me_, n, t));
          std::vector<at::Tensor> parts;
          for (int r = 0; r < R_; ++r) parts.push_back(input_d(r, n, t));
          report(tag("allgather", t, n), same(out, at::cat(parts)));
        }
        {
          auto b = input(me_, n, t);
          comm_->broadcast(b, R_ - 1);
          report(tag("broadcast from " + std::to_string(R_ - 1), t, n), same(b, input_d(R_ - 1, n, t)));
        }
        {
          // Ring (to self when alone): post the send first on every rank, then the receive.
          int next = (me_ + 1) % R_, prev = (me_ + R_ - 1) % R_;
          auto got = at::empty({n}, opts(t));
          auto ws = comm_->send_async(input(me_, n, t), next, 7);
          auto wr = comm_->recv_async(got, prev, 7);
          ws->wait();
          wr->wait();
          report(tag("send/recv ring", t, n), same(got, input_d(prev, n, t)));
        }
        // alltoall of rows with uneven and zero counts (values up to a few thousand: exact in
        // these dtypes), once per dtype.
        if (n == 1000 && (t == at::kFloat || t == at::kDouble || t == at::kLong || t == at::kInt)) {
          namespace a2a = tandem::test::a2a;
          for (const auto& c : a2a::cases(R_)) {
            auto want = a2a::received_by(me_, c, {3}, at::kDouble);
            auto got = at::empty(want.sizes(), opts(t));
            comm_->alltoall(got, a2a::sent_by(me_, c, {3}, t).to(dev_), c.recvs(me_), c.sends(me_));
            report(tag("alltoall (" + c.name + ")", t, want.size(0)), same(got, want));
          }
        }
      }
    }
  }

  void noncontiguous() {
    const int64_t rows = 64, cols = 33, n = rows * cols;
    at::Tensor sum = at::zeros({n}, at::kDouble);
    for (int r = 0; r < R_; ++r) sum += input_d(r, n, at::kFloat);
    {
      auto base = input(me_, n, at::kFloat).view({rows, cols});
      auto view = base.t();  // [cols, rows], not contiguous
      comm_->allreduce(view, ReduceOp::kSum);
      report("allreduce on a transposed view", !view.is_contiguous() && same(base, sum));
    }
    {
      auto store = at::zeros({n, R_}, opts(at::kFloat));
      auto out = store.t();  // [R, n], not contiguous
      comm_->allgather(out, input(me_, n, at::kFloat));
      bool ok = true;
      for (int r = 0; r < R_; ++r) ok = ok && same(store.select(1, r), input_d(r, n, at::kFloat));
      report("allgather into a non-contiguous output", ok);
    }
    {
      at::Tensor big_sum = at::zeros({n * R_}, at::kDouble);
      for (int r = 0; r < R_; ++r) big_sum += input_d(r, n * R_, at::kFloat);
      auto store = at::zeros({2 * n}, opts(at::kFloat));
      auto out = store.slice(0, 0, 2 * n, 2);  // every other element
      auto in_store = at::zeros({n * R_, 2}, opts(at::kFloat));
      in_store.select(1, 1).copy_(input(me_, n * R_, at::kFloat));
      comm_->reduce_scatter(out, in_store.select(1, 1), ReduceOp::kSum);
      report("reduce_scatter with strided input and output",
             same(out, big_sum.narrow(0, me_ * n, n)) && store.slice(0, 1, 2 * n, 2).eq(0).all().item<bool>());
    }
    {
      auto base = input(me_, n, at::kFloat).view({rows, cols});
      auto view = base.t();
      comm_->broadcast(view, 0);
      report("broadcast on a transposed view", same(base, input_d(0, n, at::kFloat)));
    }
    {
      int next = (me_ + 1) % R_, prev = (me_ + R_ - 1) % R_;
      auto store = at::zeros({rows, cols}, opts(at::kFloat));
      auto view = store.t();
      auto src = input(me_, n, at::kFloat).view({rows, cols}).t();
      auto ws = comm_->send_async(src, next, 1);
      auto wr = comm_->recv_async(view, prev, 1);
      ws->wait();
      wr->wait();
      report("send/recv with transposed views", same(store, input_d(prev, n, at::kFloat)));
    }
  }

  template <typename F>
  void expect_error(const std::string& what, F&& f, const std::string& must_contain) {
    try {
      f();
      report(what, false, "no exception");
    } catch (const CommError& e) {
      std::string msg = e.what();
      bool ok =
          msg.find(must_contain) != std::string::npos && msg.find("rank " + std::to_string(me_)) != std::string::npos;
      report(what, ok, ok ? "" : "message: " + msg);
      if (ok && me_ == 0) std::cout << "      message: " << msg << std::endl;
    } catch (const std::exception& e) {
      report(what, false, std::string("wrong exception type: ") + e.what());
    }
  }

  void errors() {
    expect_error(
        "CPU tensor is refused", [&] { comm_->allreduce(at::ones({4}), ReduceOp::kSum); }, "CUDA tensors");
    expect_error(
        "reduce_scatter size mismatch",
        [&] { comm_->reduce_scatter(at::empty({3}, opts(at::kFloat)), at::empty({3 * R_ + 1}, opts(at::kFloat))); },
        "elements");
    expect_error(
        "allgather size mismatch",
        [&] { comm_->allgather(at::empty({2 * R_ + 1}, opts(at::kFloat)), at::empty({2}, opts(at::kFloat))); },
        "elements");
    expect_error(
        "allgather dtype mismatch",
        [&] { comm_->allgather(at::empty({2 * R_}, opts(at::kDouble)), at::empty({2}, opts(at::kFloat))); }, "dtype");
    expect_error(
        "peer out of range", [&] { comm_->send(at::empty({2}, opts(at::kFloat)), R_, 0); }, "out of range");
    expect_error(
        "broadcast root out of range", [&] { comm_->broadcast(at::empty({2}, opts(at::kFloat)), -1); }, "out of range");
    expect_error(
        "unsupported dtype", [&] { comm_->allreduce(at::zeros({2}, opts(at::kComplexFloat)), ReduceOp::kSum); },
        "not supported");
    expect_error(
        "avg of integers", [&] { comm_->allreduce(at::zeros({2}, opts(at::kInt)), ReduceOp::kAvg); }, "floating-point");
    expect_error(
        "undefined tensor", [&] { comm_->allreduce(at::Tensor(), ReduceOp::kSum); }, "undefined");
  }

  void streams() {
    const int idx = dev_.index();
    auto side = c10::cuda::getStreamFromPool(false, idx);
    const int64_t n = 1 << 20;
    at::Tensor t;
    double host_ms = 0;
    {
      c10::cuda::CUDAStreamGuard g(side);
      t = at::ones({n}, opts(at::kFloat));
      at::cuda::sleep(int64_t(1) << 30);  // ~0.5 s of GPU time on the side stream
      t.fill_(2.0);                       // the allreduce must see this value
      auto h0 = std::chrono::steady_clock::now();
      auto w = comm_->allreduce_async(t, ReduceOp::kSum);
      w->wait();
      host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
      t.mul_(1.0);  // a consumer on the same stream, ordered after the allreduce by wait()
      side.synchronize();
    }
    report("allreduce ordered after the producer on the caller's (non-default) stream",
           t.cpu().eq(2.0 * R_).all().item<bool>());
    std::ostringstream d;
    d << "async + wait() took " << host_ms << " ms on the host while the GPU was busy ~500 ms";
    report("wait() does not block the host", host_ms < 200.0, d.str());
    if (me_ == 0) std::cout << "      " << d.str() << std::endl;
    // is_completed() turns true without any wait on the host side.
    auto t2 = at::ones({n}, opts(at::kFloat));
    auto w2 = comm_->allreduce_async(t2, ReduceOp::kSum);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!w2->is_completed() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    report("is_completed() becomes true", w2->is_completed());
  }

  void many_in_flight() {
    const int64_t n = (1 << 20) + 5;
    std::vector<at::Tensor> ts;
    std::vector<tandem::WorkPtr> ws;
    for (int k = 0; k < 16; ++k) {
      ts.push_back(at::full({n}, static_cast<double>(k + me_), opts(at::kFloat)));
      ws.push_back(comm_->allreduce_async(ts.back(), ReduceOp::kSum));
    }
    // Drop our references to half of the inputs' producers: record_stream must keep memory safe.
    for (auto& w : ws) w->wait();
    bool ok = true;
    double rank_sum = R_ * (R_ - 1) / 2.0;
    for (int k = 0; k < 16; ++k) ok = ok && ts[k].cpu().eq(k * R_ + rank_sum).all().item<bool>();
    report("16 allreduces in flight, then waited", ok);
    // Temporaries freed right after the call: their memory must not be reused before the op ran.
    std::vector<tandem::WorkPtr> ws2;
    for (int k = 0; k < 8; ++k)
      ws2.push_back(comm_->allreduce_async(at::full({n}, 1.0, opts(at::kFloat)), ReduceOp::kSum));
    auto junk = at::full({8 * n}, 5.0, opts(at::kFloat));  // would overwrite reused memory
    for (auto& w : ws2) w->synchronize();
    report("inputs freed while in flight (record_stream)", junk.eq(5.0).all().item<bool>());
  }

  void sync_and_stats() {
    comm_->reset_stats();
    auto t = at::ones({16 << 20}, opts(at::kFloat));  // 64 MB
    auto w = comm_->allreduce_async(t, ReduceOp::kSum);
    w->synchronize();
    report("synchronize() then is_completed()", w->is_completed());
    report("seconds() > 0 after completion", w->seconds() > 0.0, std::to_string(w->seconds()) + " s");
    auto st = comm_->stats();
    auto& a = st["allreduce"];
    report("stats count the allreduce", a.calls == 1 && a.bytes == (int64_t(16) << 20) * 4,
           std::to_string(a.calls) + " calls, " + std::to_string(a.bytes) + " bytes");
    report("stats accumulate seconds", a.seconds > 0.0, std::to_string(a.seconds) + " s");
    report("result of the 64 MB allreduce", t.cpu().eq(static_cast<double>(R_)).all().item<bool>());
  }

  void split() {
    auto sub = comm_->split(me_ % 2, me_);
    if (!sub) {
      report("split(rank % 2) returned a communicator", false);
      return;
    }
    int expect = (R_ + 1 - me_ % 2) / 2;
    report("split(rank % 2): size", sub->size() == expect && sub->rank() == me_ / 2,
           "size " + std::to_string(sub->size()) + ", rank " + std::to_string(sub->rank()));
    auto t = at::full({1000}, static_cast<double>(me_), opts(at::kFloat));
    sub->allreduce(t, ReduceOp::kSum);
    double want = 0;
    for (int r = me_ % 2; r < R_; r += 2) want += r;
    report("allreduce on the split communicator", t.cpu().eq(want).all().item<bool>());
    auto only0 = comm_->split(me_ == 0 ? 0 : -1, 0);
    report("split with a negative color returns nullptr", me_ == 0 ? (only0 && only0->size() == 1) : !only0);
    if (only0) {
      auto u = at::full({10}, 3.0, opts(at::kFloat));
      only0->allreduce(u, ReduceOp::kSum);
      report("size-1 communicator from split", u.cpu().eq(3.0).all().item<bool>());
    }
  }

  void ddp() {
    torch::manual_seed(42 + me_);  // different init per rank: DDP must broadcast rank 0's
    auto model = torch::nn::Linear(16, 4);
    model->to(dev_);
    tandem::DistributedDataParallel ddp(model.ptr(), comm_);
    std::vector<at::Tensor> xs;
    for (int r = 0; r < R_; ++r) {
      auto gen = at::detail::createCPUGenerator(100 + r);
      xs.push_back(at::randn({8, 16}, gen).to(dev_));
    }
    // Reference: the average over ranks of the local gradients of rank 0's parameters.
    auto w0 = model->weight.detach().clone(), b0 = model->bias.detach().clone();
    at::Tensor gw = at::zeros_like(w0), gb = at::zeros_like(b0);
    for (int r = 0; r < R_; ++r) {
      auto w = w0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
      at::linear(xs[r], w, b).pow(2).sum().backward();
      gw += w.grad() / R_;
      gb += b.grad() / R_;
    }
    for (int step = 0; step < 2; ++step) {  // the second step runs on the rebuilt buckets
      model->zero_grad();
      ddp.prepare_forward();
      model->forward(xs[me_]).pow(2).sum().backward();
      bool ok = at::allclose(model->weight.grad().cpu(), gw.cpu(), 1e-4, 1e-4) &&
                at::allclose(model->bias.grad().cpu(), gb.cpu(), 1e-4, 1e-4);
      report("DDP averages gradients over NCCL (step " + std::to_string(step + 1) + ")", ok);
    }
  }

  void timeout_abort() {
    // A receive nobody sends: synchronize() must give up after the timeout, abort that
    // communicator and throw CommTimeout; the world communicator must stay usable.
    auto sub = comm_->split(0, me_);
    sub->set_timeout(std::chrono::milliseconds(3000));
    if (me_ == 0) {
      int peer = R_ > 1 ? 1 : 0;
      auto t = at::empty({1024}, opts(at::kFloat));
      auto t0 = std::chrono::steady_clock::now();
      try {
        auto w = sub->recv_async(t, peer, 99);
        w->synchronize();
        report("unmatched recv times out", false, "synchronize() returned");
      } catch (const CommTimeout& e) {
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        report("unmatched recv: CommTimeout after the timeout", s >= 2.5 && s < 30, e.what());
        expect_error(
            "an aborted communicator refuses new work",
            [&] { sub->allreduce(at::ones({1}, opts(at::kFloat)), ReduceOp::kSum); }, "aborted");
      } catch (const CommError& e) {
        // NCCL may refuse an unmatched receive from self outright; that is an error too.
        report("unmatched recv fails with CommError", R_ == 1, e.what());
      }
    }
    comm_->barrier();
  }

  CommPtr comm_;
  c10::Device dev_;
  int me_, R_;
  bool timeout_test_;
  int passed_ = 0, failed_ = 0;
};

// --trace on CUDA: three allreduces on the NCCL communicator appear on the trace's NCCL stream
// track with their size, on the trace's clock inside the span the host waited for them.
bool check_trace(tandem::Runtime& rt, const CommPtr& comm, int rank) {
  namespace trace = tandem::trace;
  CommPtr cpu = rt.cpu_world();
  if (!cpu) {
    std::cout << "check SKIPPED rank " << rank << ": trace (no CPU communicator)" << std::endl;
    return true;
  }
  trace::start(*cpu);
  const int64_t bytes = int64_t{4} << 20, t0 = trace::now_us();
  auto t = at::ones({bytes / 4}, at::TensorOptions().dtype(at::kFloat).device(rt.device()));
  for (int i = 0; i < 3; ++i) comm->allreduce_async(t, ReduceOp::kSum)->synchronize();
  const int64_t t1 = trace::now_us();
  trace::stop();
  const std::string path = "/tmp/tandem-gpu-check-trace-" + std::to_string(rank) + ".json";
  trace::write(path, *cpu);
  if (cpu->rank() != 0) return true;
  const auto j = nlohmann::json::parse(std::ifstream(path));
  const std::string track = "NCCL stream (a group of " + std::to_string(comm->size()) + ")";
  int tid = -1, good = 0, seen = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == track) tid = e["tid"];
  }
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] != "X" || e["tid"] != tid || e["name"] != "allreduce") continue;
    ++seen;
    const int64_t ts = e["ts"], dur = e["dur"];
    good += e["args"]["bytes"] == bytes && ts >= t0 - 1000 && ts + dur <= t1 + 1000 && dur >= 0;
  }
  const bool ok = tid >= 0 && seen == 3 && good == 3;
  std::cout << "check " << (ok ? "ok     " : "FAILED ") << "rank " << rank << ": trace: " << seen
            << " allreduce event(s) on the track '" << track << "', " << good << " with their size inside [" << t0
            << ", " << t1 << "] us (" << path << ")" << std::endl;
  return ok;
}

// Checkpoints on placements with the state on the GPU: ZeRO-3 trains 3 steps and saves (its
// shards staged through the CPU), a plain engine loads the checkpoint back onto the GPU; the
// values must come back bit for bit (full_parameters and the checkpoint read whole) and the
// next step's loss must agree. Needs the CPU communicator the checkpoint protocol runs on.
bool check_checkpoint(tandem::Runtime& rt, int rank) {
  if (!rt.cpu_world()) {
    std::cout << "check SKIPPED rank " << rank << ": checkpoint (no CPU communicator)" << std::endl;
    return true;
  }
  auto model = [](uint64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(torch::nn::Linear(64, 128), torch::nn::Tanh(), torch::nn::Linear(128, 10));
  };
  tandem::OptimizerOptions adamw;
  adamw.kind = "adamw";
  adamw.lr = 1e-2;
  tandem::ParallelConfig z3, plain;
  z3.strategy = tandem::Strategy::kZero3;
  plain.strategy = rt.world()->size() > 1 ? tandem::Strategy::kDDP : tandem::Strategy::kSingle;
  auto loss_fn = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  auto batch = [&rt](int64_t s) {
    auto g = at::detail::createCPUGenerator(100 + static_cast<uint64_t>(s));
    return std::make_pair(torch::randn({32, 64}, g).to(rt.device()), torch::randint(0, 10, {32}, g).to(rt.device()));
  };
  tandem::Engine a(rt, model(1), adamw, z3);
  for (int64_t s = 0; s < 3; ++s) {
    auto [x, y] = batch(s);
    a.step(x, y, loss_fn);
  }
  const std::string root = "/tmp/tandem-gpu-check-ckpt-" + std::to_string(rt.world()->size());
  const auto dir = a.save(root);
  tandem::Engine b(rt, model(2), adamw, plain);
  b.load(dir);
  const auto wa = a.full_parameters(), wb = b.full_parameters();
  const auto whole = tandem::read_full_checkpoint(dir).params;
  bool same = wa.size() == wb.size() && wa.size() == whole.size();
  for (const auto& [n, t] : wa) same = same && wb.count(n) && torch::equal(t, wb.at(n)) && torch::equal(t, whole.at(n));
  auto [x, y] = batch(3);
  const double la = a.step(x, y, loss_fn).item<double>(), lb = b.step(x, y, loss_fn).item<double>();
  const bool ok = same && std::abs(la - lb) <= 1e-5 * std::abs(la);
  std::cout << "check " << (ok ? "ok     " : "FAILED ") << "rank " << rank << ": checkpoint: zero3 on "
            << rt.device().str() << " -> " << tandem::to_string(plain.strategy) << ", values "
            << (same ? "bitwise equal" : "DIFFER") << ", next loss " << la << " / " << lb << std::endl;
  return ok;
}

// LoRA on the GPU: a small Llama's Sequential form with adapters on every projection trains
// 3 steps under ZeRO-3 (the frozen base sharded and gathered through NCCL); the losses follow
// plain LibTorch on the CPU training the adapters alone, and the base comes back bitwise.
at::Tensor slice_rows(const at::Tensor& t, int rank, int world) {
  const int64_t n = t.size(0) / world;
  return t.narrow(0, rank * n, n).contiguous();
}

// Two layers of width 64 over 4 query and 2 key/value heads, a vocabulary of 64.
tandem::llama::LlamaConfig small_llama(int64_t max_positions) {
  tandem::llama::LlamaConfig mc;
  mc.vocab_size = 64;
  mc.hidden_size = 64;
  mc.intermediate_size = 96;
  mc.num_hidden_layers = 2;
  mc.num_attention_heads = 4;
  mc.num_key_value_heads = 2;
  mc.max_position_embeddings = max_positions;
  return mc;
}

bool check_lora(tandem::Runtime& rt, int rank) {
  const auto mc = small_llama(16);
  auto adapted = [&] {
    torch::manual_seed(9);
    auto seq = tandem::llama::causal_lm_sequential(mc);
    tandem::lora::LoraConfig c;
    c.rank = 4;
    c.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
    tandem::lora::attach(*seq, c);
    return seq;
  };
  auto loss_fn = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
  };
  const int world = rt.world()->size();
  auto batch = [&](int64_t s) {
    auto g = at::detail::createCPUGenerator(300 + static_cast<uint64_t>(s));
    auto ids = torch::randint(0, mc.vocab_size, {4 * world, 17}, g);
    return std::make_pair(ids.narrow(1, 0, 16).contiguous(), ids.narrow(1, 1, 16).contiguous());
  };
  auto ref = adapted();
  std::map<std::string, at::Tensor> initial;
  std::vector<at::Tensor> trainable;
  for (auto& p : ref->named_parameters()) {
    initial[p.key()] = p.value().detach().clone();
    if (p.value().requires_grad()) trainable.push_back(p.value());
  }
  torch::optim::Adam opt(trainable, torch::optim::AdamOptions(1e-2));
  tandem::OptimizerOptions adam;
  adam.kind = "adam";
  adam.lr = 1e-2;
  tandem::ParallelConfig z3;
  z3.strategy = tandem::Strategy::kZero3;
  tandem::Engine eng(rt, adapted(), adam, z3);
  double worst = 0;
  for (int64_t s = 0; s < 3; ++s) {
    auto [x, y] = batch(s);
    opt.zero_grad();
    auto want = loss_fn(ref->forward(x), y);
    want.backward();
    opt.step();
    const int r = rt.world()->rank();
    auto got = eng.step(slice_rows(x, r, world).to(rt.device()), slice_rows(y, r, world).to(rt.device()), loss_fn)
                   .detach()
                   .reshape({1});
    rt.world()->allreduce(got, tandem::ReduceOp::kAvg);
    worst = std::max(worst, std::abs(got.cpu().item<double>() - want.item<double>()) / want.item<double>());
  }
  bool frozen = true;
  for (const auto& [n, t] : eng.full_parameters())
    if (n.find("lora_") == std::string::npos) frozen = frozen && torch::equal(t.cpu(), initial.at(n));
  const bool ok = frozen && worst <= 1e-4;
  std::cout << "check " << (ok ? "ok     " : "FAILED ") << "rank " << rank << ": lora: zero3 on " << rt.device().str()
            << ", " << eng.trainable_parameters() << " of " << eng.parameters()
            << " parameters trained, losses vs CPU LibTorch rel " << worst << ", base "
            << (frozen ? "bitwise unchanged" : "CHANGED") << std::endl;
  return ok;
}

// Context parallelism on the GPU: ring attention over the world's ranks (key/value blocks
// through NCCL's point-to-point) against whole causal attention computed in float64 on the CPU,
// and with 2 or more ranks a small Llama trained 3 steps with cp = world, its losses against
// plain LibTorch on the CPU.
bool check_context_parallel(tandem::Runtime& rt, int rank) {
  const int C = rt.world()->size();
  torch::manual_seed(17);
  const int64_t T = 2 * C * 24;
  auto q = torch::randn({2, 4, T, 16}, torch::kDouble), k = torch::randn({2, 2, T, 16}, torch::kDouble),
       v = torch::randn({2, 2, T, 16}, torch::kDouble);
  auto s = torch::matmul(q, k.repeat_interleave(2, 1).transpose(-2, -1)) / 4.0;
  s = s.masked_fill(torch::ones({T, T}, torch::kBool).triu(1), -std::numeric_limits<double>::infinity());
  const auto want = torch::matmul(torch::softmax(s, -1), v.repeat_interleave(2, 1));
  auto part = [&](const at::Tensor& t) {
    return tandem::cp::split_sequence(t, 2, rank, C).to(torch::kFloat).to(rt.device());
  };
  const auto got = tandem::cp::ring_attention(part(q), part(k), part(v), rt.world()).cpu().to(torch::kDouble);
  const double attn_err = (got - tandem::cp::split_sequence(want, 2, rank, C)).abs().max().item<double>();
  double worst = 0;
  if (C > 1) {
    const auto mc = small_llama(64);
    auto make = [&] {
      torch::manual_seed(5);
      return tandem::llama::causal_lm_sequential(mc);
    };
    auto loss_fn = [](const at::Tensor& out, const at::Tensor& y) {
      return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
    };
    auto ref = make();
    torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
    tandem::OptimizerOptions adam;
    adam.kind = "adam";
    adam.lr = 1e-2;
    tandem::ParallelConfig pc;
    pc.cp = C;
    tandem::Engine eng(rt, make(), adam, pc);
    for (int64_t st = 0; st < 3; ++st) {
      auto g = at::detail::createCPUGenerator(500 + static_cast<uint64_t>(st));
      auto ids = torch::randint(0, mc.vocab_size, {4, 8 * C + 1}, g);
      auto x = ids.narrow(1, 0, 8 * C).contiguous(), y = ids.narrow(1, 1, 8 * C).contiguous();
      opt.zero_grad();
      auto l = loss_fn(ref->forward(x), y);
      l.backward();
      opt.step();
      const double got_loss = eng.step(x.to(rt.device()), y.to(rt.device()), loss_fn).cpu().item<double>();
      worst = std::max(worst, std::abs(got_loss - l.item<double>()) / l.item<double>());
    }
  }
  const bool ok = attn_err <= 1e-4 && worst <= 1e-4;
  std::cout << "check " << (ok ? "ok     " : "FAILED ") << "rank " << rank << ": context parallel: ring attention over "
            << C << " rank(s) on " << rt.device().str() << " max abs err " << attn_err;
  if (C > 1) std::cout << "; Llama cp" << C << " losses vs CPU LibTorch rel " << worst;
  std::cout << std::endl;
  return ok;
}

// fp32 matrix products and convolutions in full precision while alive: TF32 (LibTorch's default
// for cuDNN convolutions, 10 mantissa bits) would put the exactness checks below near 1e-3.
class NoTf32 {
 public:
  NoTf32() : cublas_(at::globalContext().allowTF32CuBLAS()), cudnn_(at::globalContext().allowTF32CuDNN()) {
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
  }
  ~NoTf32() {
    at::globalContext().setAllowTF32CuBLAS(cublas_);
    at::globalContext().setAllowTF32CuDNN(cudnn_);
  }
  NoTf32(const NoTf32&) = delete;
  NoTf32& operator=(const NoTf32&) = delete;

 private:
  bool cublas_, cudnn_;
};

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  const auto x = a.detach().cpu().to(torch::kDouble), y = b.detach().cpu().to(torch::kDouble);
  return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), 1e-30);
}

double rel_diff(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

bool verdict(bool ok, int rank, const std::string& text) {
  std::cout << "check " << (ok ? "ok     " : "FAILED ") << "rank " << rank << ": " << text << std::endl;
  return ok;
}

at::Tensor cross_entropy(const at::Tensor& out, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
}

// PowerSGD on NCCL: with the full rank of every matrix (r = min(n, m)) from step 0 the
// projection is onto the whole column space, so DDP's gradients must be one process's average
// over the whole batch, step after step (warm start and residuals included); the bytes counted
// are the factors' (n + m) r per matrix, not the dense gradient's. 1e-4 relative: fp32 sums in
// another order plus the GPU's QR and products (1e-5 on the CPU in tests/dist/test_powersgd.cpp).
bool check_powersgd(tandem::Runtime& rt, int rank) {
  NoTf32 exact;
  const int R = rt.world()->size();
  const auto dev = rt.device();
  auto net = [&](uint64_t seed) {
    torch::manual_seed(seed);
    torch::nn::Sequential m(torch::nn::Conv2d(2, 3, 3), torch::nn::Flatten(), torch::nn::Linear(27, 6),
                            torch::nn::Tanh(), torch::nn::Linear(6, 27), torch::nn::Tanh(), torch::nn::Linear(27, 5));
    m->to(dev);
    return m;
  };
  auto model = net(20 + rank), ref = net(20);  // DDP broadcasts rank 0's weights
  tandem::DDPOptions o;
  o.powersgd = tandem::PowerSGDOptions{};
  o.powersgd->rank = 64;  // clipped to each matrix's min(n, m)
  o.powersgd->start_step = 0;
  o.powersgd->min_compression_rate = 0;  // compress every matrix, though full rank saves nothing
  o.bucket_cap_bytes = 1000;             // several buckets
  tandem::DistributedDataParallel ddp(model.ptr(), rt.world(), o);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const int64_t steps = 3;
  double worst = 0;
  for (int64_t s = 0; s < steps; ++s) {
    auto g = at::detail::createCPUGenerator(40 + static_cast<uint64_t>(s));
    auto x = torch::randn({6 * R, 2, 5, 5}, g).to(dev), y = torch::randint(0, 5, {6 * R}, g).to(dev);
    ref->zero_grad();
    cross_entropy(ref->forward(x), y).backward();
    ddp.prepare_forward();
    ddp.zero_grad();
    cross_entropy(model->forward(slice_rows(x, rank, R)), slice_rows(y, rank, R)).backward();
    const auto got = model->parameters(), want = ref->parameters();
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, rel_err(got[i].grad(), want[i].grad()));
    opt.step();
    ref_opt.step();
  }
  int64_t factors = 0, dense = 0;
  for (const auto& p : model->parameters()) {
    dense += p.numel();
    const int64_t rows = p.dim() < 2 ? 0 : p.size(0), cols = rows ? p.numel() / rows : 0;
    factors += rows ? (rows + cols) * std::min(rows, cols) : p.numel();
  }
  const int64_t bytes = ddp.stats().bytes;
  std::ostringstream text;
  text << "powersgd: full rank on " << dev.str() << ", gradients vs one process rel " << worst << ", bytes " << bytes
       << " (the factors' " << steps * 4 * factors << ", dense " << steps * 4 * dense << ")";
  return verdict(worst <= 1e-4 && bytes == steps * 4 * factors, rank, text.str());
}

// Hybrid sharding on NCCL: hsdp with shard groups of 1 (every rank a replica: an all-reduce of
// every gradient) and of the whole world (zero3) trains 3 AdamW steps as DDP does.
bool check_hsdp(tandem::Runtime& rt, int rank) {
  NoTf32 exact;
  const int world = rt.world()->size();
  const auto dev = rt.device();
  auto run = [&](tandem::Strategy strategy, int group) {
    torch::manual_seed(7);
    torch::nn::Sequential mlp(torch::nn::Linear(13, 32), torch::nn::ReLU(), torch::nn::Linear(32, 32),
                              torch::nn::ReLU(), torch::nn::Linear(32, 5));
    tandem::OptimizerOptions adamw;
    adamw.kind = "adamw";
    adamw.lr = 1e-2;
    tandem::ParallelConfig c;
    c.strategy = strategy;
    c.shard_group = group;
    tandem::Engine eng(rt, mlp, adamw, c);
    std::vector<double> losses;
    for (int64_t s = 0; s < 3; ++s) {
      auto g = at::detail::createCPUGenerator(500 + static_cast<uint64_t>(s));
      auto x = torch::randn({8 * world, 13}, g), y = torch::randint(0, 5, {8 * world}, g);
      auto l = eng.step(slice_rows(x, rank, world).to(dev), slice_rows(y, rank, world).to(dev), cross_entropy)
                   .detach()
                   .reshape({1})
                   .clone();
      rt.world()->allreduce(l, ReduceOp::kAvg);
      losses.push_back(l.cpu().item<double>());
    }
    return losses;
  };
  const auto want = run(world > 1 ? tandem::Strategy::kDDP : tandem::Strategy::kSingle, 0);
  std::ostringstream text;
  text << "hsdp on " << dev.str() << ", losses vs " << (world > 1 ? "ddp" : "single") << " rel:";
  bool ok = true;
  for (int group : world > 1 ? std::vector<int>{1, world} : std::vector<int>{1}) {
    const auto got = run(tandem::Strategy::kHsdp, group);
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, rel_diff(got[i], want[i]));
    ok = ok && worst <= 1e-5;
    text << " shard_group " << group << " " << worst;
  }
  return verdict(ok, rank, text.str());
}

// Mixture of experts on CUDA: a model of two MoE layers (top-2 of 4 experts, load-balancing and
// z-losses). One rank: a forward and backward against the same on the CPU (the router's top-k
// picks the same experts; loss and every gradient, the injected auxiliary ones included, agree).
// Several: 3 steps with --ep = ranks (tokens dispatched by NCCL's all-to-all), and with --tp =
// ranks (every expert cut over them; one replica running the ranks' rows as micro-batches),
// against every rank holding all experts, which computes the same losses.
bool check_moe(tandem::Runtime& rt, int rank) {
  NoTf32 exact;
  const int world = rt.world()->size();
  const auto dev = rt.device();
  auto make = [] {
    torch::manual_seed(11);
    auto log = tandem::moe::make_router_log(2);
    tandem::moe::MoeConfig mc;
    mc.hidden_size = 8;
    mc.intermediate_size = 12;
    mc.num_experts = 4;
    mc.top_k = 2;
    mc.aux_loss_coef = 0.05;
    mc.z_loss_coef = 0.01;
    return torch::nn::Sequential(torch::nn::Linear(8, 8), tandem::moe::SparseMoeBlock(mc, log, 0),
                                 torch::nn::Linear(8, 8), tandem::moe::SparseMoeBlock(mc, log, 1),
                                 torch::nn::Linear(8, 6));  // 6 classes: a head tp 2 can cut
  };
  auto token_loss = [](const at::Tensor& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out.reshape({-1, 6}), y.reshape({-1}));
  };
  auto batch = [&](int64_t s) {
    auto g = at::detail::createCPUGenerator(900 + static_cast<uint64_t>(s));
    auto x = torch::randn({8 * world, 3, 8}, g);
    return std::make_pair(x, torch::randint(0, 6, {8 * world, 3}, g));
  };
  std::ostringstream text;
  text << "mixture of experts on " << dev.str();
  double worst = 0;
  if (world == 1) {
    auto cpu = make(), gpu = make();
    gpu->to(dev);
    auto [x, y] = batch(0);
    auto lc = token_loss(cpu->forward(x), y), lg = token_loss(gpu->forward(x.to(dev)), y.to(dev));
    lc.backward();
    lg.backward();
    worst = rel_diff(lg.cpu().item<double>(), lc.item<double>());
    auto pc = cpu->named_parameters(), pg = gpu->named_parameters();
    for (auto& p : pc) {
      const auto& g = pg[p.key()].grad();
      if (!p.value().grad().defined() || !g.defined()) continue;
      worst = std::max(worst, (g.cpu() - p.value().grad()).norm().item<double>() /
                                  std::max(p.value().grad().norm().item<double>(), 1e-30));
    }
    text << ", loss and gradients vs the CPU rel " << worst;
    return verdict(worst <= 1e-5, rank, text.str());
  }
  auto run = [&](int ep, int tp) {
    tandem::OptimizerOptions adamw;
    adamw.kind = "adamw";
    adamw.lr = 1e-2;
    tandem::ParallelConfig c;
    c.strategy = tandem::Strategy::kDDP;
    c.ep = ep;
    c.tp = tp;
    c.grad_accum = tp;  // the auxiliary losses are per micro-batch: the rows each rank runs
    tandem::Engine eng(rt, make(), adamw, c);
    const int dp = eng.dp_size(), r = eng.dp_rank();
    std::vector<double> losses;
    for (int64_t s = 0; s < 3; ++s) {
      auto [x, y] = batch(s);
      auto l = eng.step(slice_rows(x, r, dp).to(dev), slice_rows(y, r, dp).to(dev), token_loss)
                   .detach()
                   .reshape({1})
                   .clone();
      rt.world()->allreduce(l, ReduceOp::kAvg);
      losses.push_back(l.cpu().item<double>());
    }
    return losses;
  };
  const auto want = run(1, 1), ep = run(world, 1), tp = run(1, world);
  double worst_tp = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, rel_diff(ep[i], want[i]));
    worst_tp = std::max(worst_tp, rel_diff(tp[i], want[i]));
  }
  text << ", vs all experts on every rank: --ep " << world << " losses rel " << worst << ", --tp " << world << " rel "
       << worst_tp;
  return verdict(worst <= 1e-5 && worst_tp <= 1e-5, rank, text.str());
}

// Zero-bubble pipelines on NCCL with pp = the world's ranks: one step of zb-h1 and of zb-v
// (two chunks per rank in a V, so other layers per rank than 1F1B: the gradients are compared
// whole, each stage's summed over the ranks into zeros) against 1F1B, and 1F1B against one
// process over the whole batch on this GPU.
bool check_zero_bubble(tandem::Runtime& rt, int rank) {
  const int P = rt.world()->size();
  if (P < 2) {
    std::cout << "check SKIPPED rank " << rank << ": zero-bubble pipeline (needs 2 ranks)" << std::endl;
    return true;
  }
  NoTf32 exact;
  const auto dev = rt.device();
  auto mlp = [&] {
    torch::manual_seed(3);
    torch::nn::Sequential net(torch::nn::Linear(13, 11), torch::nn::Tanh(), torch::nn::Linear(11, 11),
                              torch::nn::Tanh(), torch::nn::Linear(11, 11), torch::nn::Tanh(), torch::nn::Linear(11, 7),
                              torch::nn::Linear(7, 5));
    net->to(dev);
    return net;
  };
  auto g = at::detail::createCPUGenerator(5);
  const auto x = torch::randn({24, 13}, g).to(dev), y = torch::randint(0, 5, {24}, g).to(dev);
  using Grads = std::map<std::string, at::Tensor>;
  auto run = [&](tandem::PipelineSchedule s) {
    tandem::PipelineOptions o;
    o.schedule = s;
    o.micro_batches = 2 * P;
    o.device = dev;
    tandem::Pipeline pipe(mlp(), rt.world(), o);
    const double loss = pipe.train_step(x, y, cross_entropy).cpu().item<double>();
    Grads grads;
    for (const auto& np : mlp()->named_parameters()) grads[np.key()] = torch::zeros_like(np.value());
    for (const auto& np : pipe.stage_module()->named_parameters())
      if (np.value().grad().defined()) grads.at(np.key()).copy_(np.value().grad());
    for (auto& [name, t] : grads) rt.world()->allreduce(t, ReduceOp::kSum);
    return std::make_pair(loss, grads);
  };
  auto differ = [](const std::pair<double, Grads>& a, const std::pair<double, Grads>& b) {
    double worst = rel_diff(a.first, b.first);
    for (const auto& [name, t] : b.second) worst = std::max(worst, rel_err(a.second.at(name), t));
    return worst;
  };
  auto ref = mlp();
  const auto ref_l = cross_entropy(ref->forward(x), y);
  ref_l.backward();
  const double ref_loss = ref_l.item<double>();
  Grads ref_grads;
  for (const auto& np : ref->named_parameters()) ref_grads[np.key()] = np.value().grad();
  const auto f1b = run(tandem::PipelineSchedule::k1F1B);
  const double e1f1b = differ(f1b, {ref_loss, ref_grads});
  const double eh1 = differ(run(tandem::PipelineSchedule::kZBH1), f1b);
  const double ev = differ(run(tandem::PipelineSchedule::kZBV), f1b);
  std::ostringstream text;
  text << "zero-bubble pipeline, pp " << P << " on " << dev.str() << ", loss and gradients rel: zb-h1 vs 1f1b " << eh1
       << ", zb-v vs 1f1b " << ev << ", 1f1b vs one process " << e1f1b;
  return verdict(eh1 <= 1e-5 && ev <= 1e-5 && e1f1b <= 1e-5, rank, text.str());
}

// Selective recomputation of a small Llama on the GPU (fp32): the loss and gradients of the
// plain forward, something recomputed in backward, and less activation memory: both what the
// forward leaves allocated for backward and the allocator's peak during the forward and loss
// (above what was allocated before; the same logits and loss transients on both sides).
bool check_selective_recompute(tandem::Runtime& rt, int rank) {
  NoTf32 exact;
  const auto dev = rt.device();
  const auto idx = dev.index();
  auto mc = small_llama(64);
  mc.vocab_size = 300;
  mc.intermediate_size = 176;
  auto g = at::detail::createCPUGenerator(5);
  const auto ids = torch::randint(1, mc.vocab_size, {4, 48}, g).to(dev);
  struct Pass {
    double loss = 0, recomputed = 0;
    int64_t held = 0, peak = 0;
    std::map<std::string, at::Tensor> grads;
  };
  auto run = [&](const std::string& policy) {
    torch::manual_seed(3);
    auto base = tandem::llama::causal_lm_sequential(mc);
    base->to(dev);
    auto net = tandem::checkpoint_sequential(base, tandem::parse_activation_checkpointing(policy));
    Pass p;
    torch::cuda::synchronize();
    const int64_t before = tandem::compat::cuda_allocated_bytes(idx);
    tandem::compat::reset_cuda_peak_stats(idx);
    const double recomputed = tandem::recompute_seconds();
    auto logits = net->forward(ids);
    auto loss = cross_entropy(logits, ids);
    logits = at::Tensor();
    torch::cuda::synchronize();
    p.held = tandem::compat::cuda_allocated_bytes(idx) - before;
    p.peak = tandem::compat::cuda_peak_allocated_bytes(idx) - before;
    loss.backward();
    p.recomputed = tandem::recompute_seconds() - recomputed;
    p.loss = loss.item<double>();
    for (const auto& item : net->named_parameters())
      if (item.value().grad().defined()) p.grads[item.key()] = item.value().grad().clone();
    return p;
  };
  const auto none = run("none");
  const auto selective = run("selective");
  double worst = rel_diff(selective.loss, none.loss);
  bool same_params = none.grads.size() == selective.grads.size() && !none.grads.empty();
  for (const auto& [name, t] : none.grads) {
    same_params = same_params && selective.grads.count(name);
    if (selective.grads.count(name)) worst = std::max(worst, rel_err(selective.grads.at(name), t));
  }
  const bool ok = same_params && worst <= 1e-5 && none.recomputed == 0 && selective.recomputed > 0 &&
                  selective.held < none.held && selective.peak < none.peak;
  std::ostringstream text;
  text << "selective recompute: Llama on " << dev.str() << ", loss and gradients vs none rel " << worst
       << ", activations held after the forward " << selective.held << " / " << none.held << " bytes, peak "
       << selective.peak << " / " << none.peak << " bytes (selective / none)";
  return verdict(ok, rank, text.str());
}

int run_check(const Args& a) {
  if (!torch::cuda::is_available()) {
    std::cerr << "gpu_bench check: no CUDA device visible\n";
    return 2;
  }
  auto info = tandem::detect_process_info();
  std::unique_ptr<tandem::Runtime> rt;
  try {
    tandem::RuntimeOptions ro;
    ro.device = "cuda";
    ro.backend = "nccl";
    ro.comm.timeout = std::chrono::seconds(60);
    rt = std::make_unique<tandem::Runtime>(ro);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (is_skip_error(msg)) {
      std::cout << "check SKIPPED rank " << info.rank << ": NCCL refuses this setup (" << msg << ")" << std::endl;
      return 3;
    }
    std::cerr << "gpu_bench check: rank " << info.rank << ": cannot create the NCCL runtime: " << msg << std::endl;
    return 1;
  }
  auto comm = rt->world();
  if (!comm || comm->backend() != "nccl") {
    std::cerr << "gpu_bench check: expected the nccl backend, got " << (comm ? comm->backend() : "none") << std::endl;
    return 1;
  }
  std::cout << "check: rank " << comm->rank() << " of " << comm->size() << " on " << rt->device().str()
            << (std::getenv("TANDEM_NCCL_BLOCKING") ? " (TANDEM_NCCL_BLOCKING set)" : "") << std::endl;
  Checker c(comm, rt->device(), !a.flag("--skip-timeout-test"));
  int rc = c.run();
  torch::cuda::synchronize();
  const std::vector<std::pair<std::string, std::function<bool()>>> checks = {
      {"trace", [&] { return check_trace(*rt, comm, comm->rank()); }},
      {"checkpoint", [&] { return check_checkpoint(*rt, comm->rank()); }},
      {"lora", [&] { return check_lora(*rt, comm->rank()); }},
      {"context parallel", [&] { return check_context_parallel(*rt, comm->rank()); }},
      {"powersgd", [&] { return check_powersgd(*rt, comm->rank()); }},
      {"hsdp", [&] { return check_hsdp(*rt, comm->rank()); }},
      {"zero-bubble pipeline", [&] { return check_zero_bubble(*rt, comm->rank()); }},
      {"selective recompute", [&] { return check_selective_recompute(*rt, comm->rank()); }},
      {"mixture of experts", [&] { return check_moe(*rt, comm->rank()); }},
  };
  for (const auto& [name, check] : checks) {
    try {
      if (!check()) rc = 1;
    } catch (const std::exception& e) {
      std::cout << "check FAILED rank " << comm->rank() << ": " << name << " (threw) -- " << e.what() << std::endl;
      rc = 1;
    }
  }
  return rc;
}

// ---------------------------------------------------------------- bench

struct BenchConfig {
  std::string model = "cnn";
  int64_t batch = 512, steps = 50, warmup = 10;
  int64_t layers = 12, dmodel = 2048, heads = 16, seq = 2048;
  bool oom_retry = true;
};

struct BenchOut {
  std::vector<double> ms;
  double total_ms = 0;
  int64_t params = 0;
  int64_t batch = 0;
  int64_t peak_bytes = 0;
  tandem::DDPStats ddp;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}
double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0.0;
  size_t i = static_cast<size_t>(std::lround(q * (v.size() - 1)));
  return v[i];
}

// Model FLOPs per step (forward + backward), the MFU convention of PaLM / Megatron:
// 6 * params * tokens for the weights, plus 12 * layers * seq^2 * d_model * batch for the
// attention scores and their use (QK^T and AV, 2 FLOPs per multiply-add, backward twice the
// forward). Recomputation inside flash attention's backward is not counted.
double transformer_flops(const BenchConfig& c, int64_t params, int64_t batch) {
  double tokens = static_cast<double>(batch) * c.seq;
  return 6.0 * params * tokens + 12.0 * c.layers * double(c.seq) * c.seq * c.dmodel * batch;
}

BenchOut bench_once(const BenchConfig& c, int64_t batch, tandem::Runtime& rt) {
  auto dev = rt.device();
  const auto idx = dev.index();
  torch::manual_seed(0);
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  at::Tensor x, y;
  bool autocast = false;
  auto gen = at::detail::createCPUGenerator(1234);
  if (c.model == "cnn") {
    Cnn m;
    m->to(dev);
    module = m.ptr();
    forward = [m](const at::Tensor& in) mutable { return m->forward(in); };
    x = at::randn({batch, 1, 28, 28}, gen).to(dev);
    y = at::randint(0, 10, {batch}, gen).to(dev);
  } else if (c.model == "transformer") {
    Transformer m(c.layers, c.dmodel, c.heads);
    m->to(dev);
    module = m.ptr();
    forward = [m](const at::Tensor& in) mutable { return m->forward(in); };
    x = at::randn({batch, c.seq, c.dmodel}, at::TensorOptions().device(dev));
    autocast = true;
  } else {
    throw std::invalid_argument("unknown --model '" + c.model + "' (use cnn or transformer)");
  }
  BenchOut out;
  out.batch = batch;
  out.params = count_params(*module);
  tandem::DistributedDataParallel ddp(module, rt.world());
  torch::optim::AdamW opt(module->parameters(), torch::optim::AdamWOptions(1e-4));
  auto stream = c10::cuda::getCurrentCUDAStream(idx);

  auto step = [&] {
    opt.zero_grad();  // set_to_none, as PyTorch's default
    ddp.prepare_forward();
    at::Tensor loss;
    {
      std::optional<tandem::compat::AutocastScope> ac;
      if (autocast) ac.emplace(at::kCUDA, at::kBFloat16);
      auto o = forward(x);
      loss = autocast ? o.to(at::kFloat).pow(2).mean() : at::cross_entropy_loss(o, y);
    }
    loss.backward();
    opt.step();
  };

  for (int64_t s = 0; s < c.warmup; ++s) step();
  torch::cuda::synchronize(idx);
  tandem::compat::reset_cuda_peak_stats(idx);
  ddp.reset_stats();
  std::vector<cudaEvent_t> ev(c.steps + 1);
  for (auto& e : ev) cudaEventCreate(&e);
  cudaEventRecord(ev[0], stream.stream());
  for (int64_t s = 0; s < c.steps; ++s) {
    step();
    cudaEventRecord(ev[s + 1], stream.stream());
  }
  torch::cuda::synchronize(idx);
  for (int64_t s = 0; s < c.steps; ++s) {
    float ms = 0;
    cudaEventElapsedTime(&ms, ev[s], ev[s + 1]);
    out.ms.push_back(ms);
  }
  float total = 0;
  cudaEventElapsedTime(&total, ev[0], ev[c.steps]);
  out.total_ms = total;
  for (auto& e : ev) cudaEventDestroy(e);
  out.peak_bytes = tandem::compat::cuda_peak_allocated_bytes(idx);
  out.ddp = ddp.stats();
  return out;
}

bool is_oom(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) return true;
  std::string m = e.what();
  return m.find("out of memory") != std::string::npos || m.find("CUDA out of memory") != std::string::npos;
}

int run_bench(const Args& a) {
  if (!torch::cuda::is_available()) {
    std::cerr << "gpu_bench bench: no CUDA device visible\n";
    return 2;
  }
  BenchConfig c;
  c.model = a.get("--model", "cnn");
  const bool tf = c.model == "transformer";
  c.batch = a.num("--batch", tf ? 32 : 512);
  c.steps = a.num("--steps", tf ? 20 : 50);
  c.warmup = a.num("--warmup", tf ? 5 : 10);
  c.layers = a.num("--layers", 12);
  c.dmodel = a.num("--dmodel", 2048);
  c.heads = a.num("--heads", 16);
  c.seq = a.num("--seq", 2048);
  c.oom_retry = !a.flag("--no-oom-retry");
  if (c.steps < 1 || c.batch < 1 || c.warmup < 0 || c.dmodel % c.heads) {
    std::cerr << "gpu_bench bench: need --steps >= 1, --batch >= 1, --warmup >= 0 and heads dividing dmodel\n";
    return 2;
  }

  tandem::RuntimeOptions ro;
  ro.device = "cuda";
  ro.backend = "nccl";
  tandem::Runtime rt(ro);
  const int64_t total_steps = c.steps;
  BenchOut out;
  int64_t batch = c.batch;
  for (;;) {
    try {
      out = bench_once(c, batch, rt);
      break;
    } catch (const std::exception& e) {
      if (!is_oom(e) || !c.oom_retry || batch <= 1) throw;
      std::cerr << "gpu_bench: out of memory at batch " << batch << "; retrying with batch " << batch / 2 << std::endl;
      batch /= 2;
      torch::cuda::synchronize();
      c10::cuda::CUDACachingAllocator::emptyCache();
    }
  }
  const double med = median(out.ms);
  double flops = 0;
  std::string formula;
  if (c.model == "transformer") {
    flops = transformer_flops(c, out.params, out.batch);
    formula = "6*params*tokens + 12*layers*seq^2*d_model*batch (tokens = batch*seq; non-causal attention)";
  }
  const double tflops = flops > 0 ? flops / (med / 1e3) / 1e12 : 0.0;
  std::ostringstream js;
  js.precision(6);
  js << "{\"framework\": \"tandem\", \"model\": \"" << c.model << "\", \"world_size\": " << rt.world_size()
     << ", \"backend\": \"" << rt.world()->backend() << "\", \"batch\": " << out.batch
     << ", \"requested_batch\": " << c.batch << ", \"steps\": " << total_steps << ", \"warmup\": " << c.warmup
     << ", \"params\": " << out.params << ", \"ms_median\": " << med << ", \"ms_p10\": " << quantile(out.ms, 0.1)
     << ", \"ms_p90\": " << quantile(out.ms, 0.9) << ", \"ms_mean_throughput\": " << out.total_ms / total_steps
     << ", \"peak_mem_gb\": " << out.peak_bytes / 1e9 << ", \"flops_per_step\": " << flops << ", \"tflops\": " << tflops
     << ", \"mfu_vs_989\": " << tflops / 989.0 << ", \"flops_formula\": \"" << json_escape(formula)
     << "\", \"precision\": \""
     << (c.model == "transformer" ? "bf16 autocast" : "fp32 (TF32 convolutions per LibTorch defaults)")
     << "\", \"optimizer\": \"AdamW (LibTorch, per-tensor)\", \"ddp_buckets\": " << out.ddp.buckets
     << ", \"ddp_bytes_per_step\": " << (out.ddp.steps ? out.ddp.bytes / out.ddp.steps : 0)
     << ", \"ddp_hidden_fraction\": " << out.ddp.hidden_fraction();
  if (c.model == "transformer") {
    js << ", \"layers\": " << c.layers << ", \"d_model\": " << c.dmodel << ", \"heads\": " << c.heads
       << ", \"seq\": " << c.seq;
  }
  js << "}";
  std::cout << "RESULT " << js.str() << std::endl;
  return 0;
}

#endif  // TANDEM_WITH_CUDA

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (argc < 2) {
    std::cerr << kUsage;
    return 2;
  }
  a.cmd = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) {
      std::cerr << "gpu_bench: unexpected argument '" << k << "'\n" << kUsage;
      return 2;
    }
    if (k == "--no-oom-retry" || k == "--skip-timeout-test") {
      a.kv[k] = "1";
    } else if (i + 1 < argc) {
      a.kv[k] = argv[++i];
    } else {
      std::cerr << "gpu_bench: option " << k << " needs a value\n" << kUsage;
      return 2;
    }
  }
#ifdef TANDEM_WITH_CUDA
  try {
    if (a.cmd == "check") return run_check(a);
    if (a.cmd == "bench") return run_bench(a);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    std::cerr << "gpu_bench " << a.cmd << ": " << msg << std::endl;
    return is_skip_error(msg) ? 3 : 1;
  }
  std::cerr << "gpu_bench: unknown command '" << a.cmd << "'\n" << kUsage;
  return 2;
#else
  (void)count_params;
  (void)json_escape;
  std::cerr << "gpu_bench: this build has no CUDA (LibTorch without CUDA); nothing to run\n";
  return 2;
#endif
}
