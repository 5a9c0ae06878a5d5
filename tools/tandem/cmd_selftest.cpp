// `tandem selftest`: every collective across all workers, checked against a reference that
// each rank computes locally from the other ranks' (deterministic) inputs.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <iostream>

#include "checks.h"
#include "cli_app.h"
#include "commands.h"
#include "tandem/launcher.h"
#include "tandem/runtime.h"

namespace tandem::cli {
namespace {

torch::Tensor input_of(int rank, int64_t n, torch::Device dev) {
  auto gen = at::detail::createCPUGenerator(1000 + rank);
  return torch::randn({n}, gen).to(dev);
}

bool close(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::allclose(a.cpu().to(torch::kDouble), b.cpu().to(torch::kDouble), 1e-5, 1e-5);
}

}  // namespace

int cmd_selftest(int argc, char** argv) {
  CLI::App app{"Check every collective across the workers against a local reference.", "tandem selftest"};
  int n = 2;
  std::string device = "cpu";
  app.add_option("-n,--nprocs", n, "workers to launch when not already running under a launcher")
      ->check(whole_between(1, kMaxWorkers))
      ->capture_default_str();
  app.add_option("--device", device, "cpu, cuda or auto")->capture_default_str();
  app.footer(
      examples_footer({{"", {"tandem selftest -n 4"}}, {"NCCL on 2 GPUs", {"tandem selftest -n 2 --device cuda"}}}));
  if (auto rc = parse_command_line(app, argc, argv)) return *rc;
  if (detect_process_info().launcher == "none" && n > 1) {
    LaunchOptions lo;
    lo.nprocs = n;
    std::vector<std::string> args = {self_executable(), "selftest", "--device", device};
    return launch(lo, args);
  }

  RuntimeOptions ro;
  ro.device = device;
  Runtime rt(ro);
  auto comm = rt.world();
  const int R = comm->size(), me = comm->rank();
  auto dev = rt.device();
  int failures = 0;
  auto report = [&](const std::string& what, bool ok) {
    if (!ok) ++failures;
    if (me == 0 || !ok)
      std::cout << "selftest " << (ok ? "ok    " : "FAILED") << " rank " << me << ": " << what << std::endl;
  };
  try {
    for (int64_t len : {1, 7, 1000003}) {
      std::string sz =
          " (" + std::to_string(len) + " floats, " + std::to_string(R) + " ranks, " + comm->backend() + ")";
      std::vector<torch::Tensor> all;
      for (int r = 0; r < R; ++r) all.push_back(input_of(r, len * R, dev));
      auto stacked = torch::stack(all);
      {
        auto t = all[me].clone();
        comm->allreduce(t, ReduceOp::kSum);
        report("allreduce sum" + sz, close(t, stacked.sum(0)));
        t = all[me].clone();
        comm->allreduce(t, ReduceOp::kAvg);
        report("allreduce avg" + sz, close(t, stacked.mean(0)));
        t = all[me].clone();
        comm->allreduce(t, ReduceOp::kMax);
        report("allreduce max" + sz, close(t, std::get<0>(stacked.max(0))));
      }
      {
        auto out = torch::empty({len}, all[me].options());
        comm->reduce_scatter(out, all[me]);
        report("reduce_scatter" + sz, close(out, stacked.sum(0).narrow(0, me * len, len)));
      }
      {
        auto in = all[me].narrow(0, 0, len).clone();
        auto out = torch::empty({len * R}, in.options());
        comm->allgather(out, in);
        std::vector<torch::Tensor> parts;
        for (int r = 0; r < R; ++r) parts.push_back(all[r].narrow(0, 0, len));
        report("allgather" + sz, close(out, torch::cat(parts)));
      }
      {
        auto t = all[me].clone();
        comm->broadcast(t, R - 1);
        report("broadcast" + sz, close(t, all[R - 1]));
      }
      if (R > 1) {
        auto t = torch::empty_like(all[me]);
        int next = (me + 1) % R, prev = (me + R - 1) % R;
        auto s = comm->send_async(all[me], next, 7);
        auto r = comm->recv_async(t, prev, 7);
        s->wait();
        r->wait();
        report("send/recv ring" + sz, close(t, all[prev]));
      }
    }
    comm->barrier();
  } catch (const std::exception& e) {
    std::cerr << "selftest: " << e.what() << std::endl;
    rt.abort(1);
  }
  if (me == 0)
    std::cout << "selftest: " << (failures ? "FAILED" : "all collectives agree with the reference") << std::endl;
  return failures ? 1 : 0;
}

}  // namespace tandem::cli
