#include "tandem/runtime.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <thread>

#include "comm/backends.h"

namespace tandem {
namespace {

bool env_int(const char* name, int* out) {
  const char* v = std::getenv(name);
  if (!v || !*v) return false;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0) {
    throw std::invalid_argument(std::string("environment variable ") + name + "='" + v +
                                "' is not a non-negative integer");
  }
  *out = static_cast<int>(x);
  return true;
}

}  // namespace

ProcessInfo detect_process_info() {
  ProcessInfo p;
  if (env_int("OMPI_COMM_WORLD_SIZE", &p.world_size)) {
    p.launcher = "mpirun";
    env_int("OMPI_COMM_WORLD_RANK", &p.rank);
    env_int("OMPI_COMM_WORLD_LOCAL_RANK", &p.local_rank);
    env_int("OMPI_COMM_WORLD_LOCAL_SIZE", &p.local_size);
  } else if (env_int("PMI_SIZE", &p.world_size)) {  // MPICH/Hydra
    p.launcher = "mpirun";
    env_int("PMI_RANK", &p.rank);
    p.local_rank = p.rank;
    p.local_size = p.world_size;
    env_int("MPI_LOCALRANKID", &p.local_rank);
    env_int("MPI_LOCALNRANKS", &p.local_size);
  } else if (env_int("SLURM_NTASKS", &p.world_size) && std::getenv("SLURM_PROCID")) {
    p.launcher = "srun";
    env_int("SLURM_PROCID", &p.rank);
    env_int("SLURM_LOCALID", &p.local_rank);
    int per_node = 0;
    if (const char* t = std::getenv("SLURM_TASKS_PER_NODE")) per_node = std::atoi(t);  // "4(x2)" -> 4
    p.local_size = per_node > 0 ? per_node : p.world_size;
  } else if (env_int("WORLD_SIZE", &p.world_size)) {
    p.launcher = "env";
    env_int("RANK", &p.rank);
    p.local_rank = p.rank;
    env_int("LOCAL_RANK", &p.local_rank);
    p.local_size = p.world_size;
    env_int("LOCAL_WORLD_SIZE", &p.local_size);
  } else {
    p.world_size = 1;
  }
  if (p.world_size < 1 || p.rank >= p.world_size || p.local_rank >= std::max(p.local_size, 1)) {
    throw std::invalid_argument("inconsistent launch environment: rank " + std::to_string(p.rank) + ", world size " +
                                std::to_string(p.world_size) + ", local rank " + std::to_string(p.local_rank) +
                                " of " + std::to_string(p.local_size));
  }
  return p;
}

Runtime::Runtime(const RuntimeOptions& opts) : info_(detect_process_info()) {
  // Threads: cores on this host shared among its ranks.
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores <= 0) cores = 1;
  threads_ = opts.threads > 0 ? opts.threads : std::max(1, cores / std::max(1, info_.local_size));
  at::set_num_threads(threads_);
  try {
    at::set_num_interop_threads(1);
  } catch (...) {
    // already set by an earlier Runtime in this process
  }

  // Device.
  bool cuda = torch::cuda::is_available();
  if (opts.device == "cuda" && !cuda) {
    throw std::runtime_error("--device cuda was asked for, but no CUDA device is visible to rank " +
                             std::to_string(info_.rank) + "; use --device cpu");
  }
  if (opts.device != "auto" && opts.device != "cpu" && opts.device != "cuda") {
    throw std::invalid_argument("unknown device '" + opts.device + "' (use auto, cpu or cuda)");
  }
  if (cuda && opts.device != "cpu") {
    int n = static_cast<int>(torch::cuda::device_count());
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(info_.local_rank % n));
  }

  // CPU communicator: MPI when built (a single process without mpirun runs as an MPI
  // singleton), else "self" for world size 1.
  std::string backend = opts.backend;
  if (backend != "auto" && backend != "mpi" && backend != "nccl" && backend != "self") {
    throw std::invalid_argument("unknown backend '" + backend + "' (use auto, mpi, nccl or self)");
  }
  bool want_mpi = has_mpi_backend() && backend != "self" && (info_.world_size > 1 || info_.launcher == "mpirun" || backend == "mpi");
  if (want_mpi) {
#ifdef TANDEM_WITH_MPI
    mpi_initialized_here_ = detail::mpi_init_if_needed();
    cpu_world_ = detail::make_mpi_world(opts.comm);
#endif
  } else if (backend == "mpi") {
    throw std::runtime_error("the MPI backend was asked for, but this build has none (rebuild with OpenMPI installed)");
  } else if (info_.world_size == 1) {
    cpu_world_ = detail::make_self_communicator(opts.comm);
  }

  bool use_nccl = device_.is_cuda() && (backend == "auto" || backend == "nccl") && info_.world_size > 1;
  if (backend == "nccl" && !device_.is_cuda()) {
    throw std::runtime_error("the NCCL backend needs a CUDA device; rank " + std::to_string(info_.rank) + " has none");
  }
  if (use_nccl || backend == "nccl") {
#ifdef TANDEM_WITH_NCCL
    std::unique_ptr<detail::Bootstrap> boot;
    std::string dir = opts.store_dir;
    if (dir.empty() && std::getenv("TANDEM_STORE_DIR")) dir = std::getenv("TANDEM_STORE_DIR");
    if (cpu_world_ && cpu_world_->size() == info_.world_size) {
      boot = detail::make_comm_bootstrap(cpu_world_);
    } else if (!dir.empty() || info_.world_size == 1) {
      boot = detail::make_file_bootstrap(dir.empty() ? "/tmp" : dir, info_.rank, info_.world_size, opts.comm.timeout);
    } else {
      throw std::runtime_error("rank " + std::to_string(info_.rank) +
                               ": NCCL needs a bootstrap: run under mpirun or set TANDEM_STORE_DIR to a directory "
                               "shared by all ranks");
    }
    world_ = detail::make_nccl_communicator(device_.index(), *boot, opts.comm);
#else
    throw std::runtime_error("this build of Tandem has no NCCL backend (CUDA/NCCL were not found at build time)");
#endif
  } else if (device_.is_cuda() && info_.world_size == 1) {
    world_ = detail::make_self_communicator(opts.comm);
  } else {
    world_ = cpu_world_;
  }
  if (!world_) {
    throw std::runtime_error("world size " + std::to_string(info_.world_size) +
                             " needs a communication backend, and this build has neither MPI nor NCCL");
  }
}

Runtime::~Runtime() {
  world_.reset();
  cpu_world_.reset();
#ifdef TANDEM_WITH_MPI
  if (mpi_initialized_here_) detail::mpi_finalize();
#endif
}

void Runtime::abort(int code) const {
  std::cout.flush();
  std::cerr.flush();
#ifdef TANDEM_WITH_MPI
  detail::mpi_abort(code);
#else
  std::_Exit(code);
#endif
}

}  // namespace tandem
