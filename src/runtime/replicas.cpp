#include "tandem/replicas.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <iostream>
#include <numeric>
#include <thread>

#include "tandem/backends.h"

namespace tandem {
namespace {

bool wants_cuda(const ReplicaOptions& opts) {
  return opts.runtime.device == "cuda" || (opts.runtime.device == "auto" && torch::cuda::is_available());
}

std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

// The device communicators: NCCL's one-process form on CUDA, else the CPU group itself.
std::vector<CommPtr> device_communicators(const ReplicaOptions& opts, const std::vector<CommPtr>& cpu) {
  if (!wants_cuda(opts)) return cpu;
#ifdef TANDEM_WITH_NCCL
  std::vector<int> devices(opts.replicas);
  std::iota(devices.begin(), devices.end(), 0);
  return make_nccl_device_communicators(devices, opts.runtime.comm);
#else
  throw std::invalid_argument("--replicas on CUDA devices needs the NCCL backend, which this build lacks; use "
                              "--device cpu");
#endif
}

}  // namespace

std::mutex& default_generator_mutex() {
  static std::mutex mu;
  return mu;
}

void validate_replicas(const ReplicaOptions& opts) {
  const int k = opts.replicas;
  if (k < 1) {
    throw std::invalid_argument("--replicas " + std::to_string(k) + ": a process trains at least 1 replica");
  }
  const std::string& d = opts.runtime.device;
  if (d != "auto" && d != "cpu" && d != "cuda") {
    throw std::invalid_argument("unknown device '" + d + "' (use auto, cpu or cuda)");
  }
  if (d == "cuda" && !torch::cuda::is_available()) {
    throw std::invalid_argument("--device cuda was asked for, but this process sees no CUDA device; use --device cpu");
  }
  const bool processes = detect_process_info().launcher != "none";
  if (wants_cuda(opts)) {
    if (processes) {
      throw std::invalid_argument("--replicas " + std::to_string(k) +
                                  " with several processes runs on the CPU only (--device cpu); on CUDA use "
                                  "--replicas alone or one process per device (-n)");
    }
    const int n = static_cast<int>(torch::cuda::device_count());
    if (k > n) {
      const std::string devices = std::to_string(n);
      throw std::invalid_argument("--replicas " + std::to_string(k) +
                                  " needs one CUDA device per replica, and this process sees " + devices +
                                  "; use --replicas " + devices + " or fewer (or --device cpu)");
    }
  }
  if (opts.runtime.threads < 0) {
    throw std::invalid_argument("--threads must be at least 0 (0: cores / replicas)");
  }
}

namespace {

// Replica r of this process as a rank of the job: with `process` (several processes), rank
// p * K + r of P * K, its host the process's; else rank r of K on this host.
ReplicaPlacement place(int r, int k, const Runtime* process) {
  ReplicaPlacement p;
  p.info.launcher = "threads";
  if (!process) {
    p.info.rank = p.info.local_rank = r;
    p.info.world_size = p.info.local_size = k;
    HostInfo host;
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    host.name = name;
    host.ranks.resize(k);
    std::iota(host.ranks.begin(), host.ranks.end(), 0);
    p.hosts = {host};
    p.host_of.assign(k, 0);
    return p;
  }
  const auto& pi = process->info();
  p.info.rank = pi.rank * k + r;
  p.info.world_size = pi.world_size * k;
  p.info.local_rank = pi.local_rank * k + r;
  p.info.local_size = pi.local_size * k;
  p.hosts = process->hosts();
  for (auto& h : p.hosts) {
    std::vector<int> ranks;
    for (int pr : h.ranks)
      for (int j = 0; j < k; ++j) ranks.push_back(pr * k + j);
    h.ranks = ranks;
  }
  for (int g = 0; g < p.info.world_size; ++g) p.host_of.push_back(process->host_of(g / k));
  return p;
}

}  // namespace

void run_replicas(const ReplicaOptions& opts, const std::function<void(Runtime&)>& fn) {
  validate_replicas(opts);
  const int k = opts.replicas;
  // Under a launcher, this process among the others: its MPI communicator joins the groups.
  std::unique_ptr<Runtime> process;
  if (detect_process_info().launcher != "none") {
    RuntimeOptions po = opts.runtime;
    po.device = "cpu";
    process = std::make_unique<Runtime>(po);
  }
  auto cpu = make_thread_communicators(k, opts.runtime.comm);
  std::vector<CommPtr> world;
  if (process) {
    for (auto& c : cpu) world.push_back(make_hierarchical_communicator(c, process->cpu_world(), opts.runtime.comm));
  } else {
    world = device_communicators(opts, cpu);
  }
  const bool cuda = world[0]->backend() == "nccl";
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int local_processes = process ? std::max(1, process->info().local_size) : 1;
  const int threads = opts.runtime.threads > 0 ? opts.runtime.threads : std::max(1, cores / (k * local_processes));

  std::mutex mu;
  std::exception_ptr first;
  int first_rank = -1;
  std::vector<std::thread> replica_threads;
  for (int r = 0; r < k; ++r) {
    replica_threads.emplace_back([&, r] {
      ReplicaPlacement p = place(r, k, process.get());
      const int rank = p.info.rank;
      try {
        p.threads = threads;
        p.device = cuda ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(r)) : c10::Device(c10::kCPU);
        p.world = world[r];
        p.cpu_world = process ? world[r] : cpu[r];
        Runtime rt(std::move(p));
        // at::set_num_threads also resets process-wide state (the shared pthreadpool's size,
        // oneDNN's primitive cache): no replica computes until every one has set its threads.
        cpu[r]->barrier();
        fn(rt);
      } catch (...) {
        auto e = std::current_exception();
        const std::string msg = message_of(e);
        {
          std::lock_guard<std::mutex> lk(mu);
          if (!first) {
            first = e;
            first_rank = rank;
          }
        }
        if (process && process->world_size() > 1) {  // the other processes wait in MPI: end the job at once
          std::cerr << "tandem: replica " + std::to_string(rank) + ": " + msg + "\n" << std::flush;
          process->abort(1);
        }
        abort_thread_group(*cpu[r], "replica " + std::to_string(rank) + " failed: " + msg);
      }
    });
  }
  for (auto& t : replica_threads) t.join();
  world.clear();
  cpu.clear();
  if (first) throw std::runtime_error("replica " + std::to_string(first_rank) + ": " + message_of(first));
}

}  // namespace tandem
