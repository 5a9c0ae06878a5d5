#include "tandem/runtime.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <thread>

#include "runtime/peer_probe.h"
#include "tandem/backends.h"

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

// "0-3,6,8-9"
std::string rank_ranges(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
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
                                std::to_string(p.world_size) + ", local rank " + std::to_string(p.local_rank) + " of " +
                                std::to_string(p.local_size));
  }
  return p;
}

bool tune_allocator() {
  const char* v = std::getenv("TANDEM_MALLOC_TUNE");
  if (v && std::strcmp(v, "0") == 0) return false;
#if defined(__GLIBC__)
  // mallopt returns 1 on success; 32 MiB is DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc.
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
#else
  return false;
#endif
}

int default_wait_sleep_us(int local_ranks, int threads_per_rank, int cores) {
  return std::max(1, local_ranks) * std::max(1, threads_per_rank) > std::max(1, cores) ? 50 : 0;
}

Runtime::Runtime(const RuntimeOptions& opts) : info_(detect_process_info()) {
  tune_allocator();
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
  bool want_mpi = has_mpi_backend() && backend != "self" &&
                  (info_.world_size > 1 || info_.launcher == "mpirun" || backend == "mpi");
  if (want_mpi) {
#ifdef TANDEM_WITH_MPI
    mpi_initialized_here_ = mpi_init_if_needed();
    CommOptions co = opts.comm;
    if (co.wait_sleep_us < 0) co.wait_sleep_us = default_wait_sleep_us(info_.local_size, threads_, cores);
    cpu_world_ = make_mpi_world(co);
#endif
  } else if (backend == "mpi") {
    throw std::runtime_error("the MPI backend was asked for, but this build has none (rebuild with OpenMPI installed)");
  } else if (info_.world_size == 1) {
    cpu_world_ = make_self_communicator(opts.comm);
  }

  bool use_nccl = device_.is_cuda() && (backend == "auto" || backend == "nccl") && info_.world_size > 1;
  if (backend == "nccl" && !device_.is_cuda()) {
    throw std::runtime_error("the NCCL backend needs a CUDA device; rank " + std::to_string(info_.rank) + " has none");
  }
  if (use_nccl || backend == "nccl") {
#ifdef TANDEM_WITH_NCCL
    std::unique_ptr<Bootstrap> boot;
    std::string dir = opts.store_dir;
    if (dir.empty() && std::getenv("TANDEM_STORE_DIR")) dir = std::getenv("TANDEM_STORE_DIR");
    if (cpu_world_ && cpu_world_->size() == info_.world_size) {
      boot = make_comm_bootstrap(cpu_world_);
    } else if (!dir.empty() || info_.world_size == 1) {
      boot = make_file_bootstrap(dir.empty() ? "/tmp" : dir, info_.rank, info_.world_size, opts.comm.timeout);
    } else {
      throw std::runtime_error("rank " + std::to_string(info_.rank) +
                               ": NCCL needs a bootstrap: run under mpirun or set TANDEM_STORE_DIR to a directory "
                               "shared by all ranks");
    }
    world_ = make_nccl_communicator(device_.index(), *boot, opts.comm);
#else
    throw std::runtime_error("this build of Tandem has no NCCL backend (CUDA/NCCL were not found at build time)");
#endif
  } else if (device_.is_cuda() && info_.world_size == 1) {
    world_ = make_self_communicator(opts.comm);
  } else {
    world_ = cpu_world_;
  }
  if (!world_) {
    throw std::runtime_error("world size " + std::to_string(info_.world_size) +
                             " needs a communication backend, and this build has neither MPI nor NCCL");
  }
  exchange_hosts();
}

Runtime::Runtime(ReplicaPlacement p)
    : info_(p.info), threads_(std::max(1, p.threads)), device_(p.device), cpu_world_(std::move(p.cpu_world)),
      world_(std::move(p.world)), hosts_(std::move(p.hosts)), host_of_(std::move(p.host_of)) {
  if (!world_ || !cpu_world_ || world_->size() != info_.world_size ||
      static_cast<int>(host_of_.size()) != info_.world_size) {
    throw std::invalid_argument("ReplicaPlacement of rank " + std::to_string(info_.rank) +
                                ": its communicators and hosts must span its world size " +
                                std::to_string(info_.world_size));
  }
  at::set_num_threads(threads_);  // OpenMP's team size is a setting of the calling thread
  probe_port_.assign(info_.world_size, 0);
}

// Every rank contributes "hostname\naddress,address\nport" in a fixed-size record.
void Runtime::exchange_hosts() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::string selection;
  for (const char* v : {"TANDEM_NET_IF", "OMPI_MCA_btl_tcp_if_include"}) {
    if (const char* e = std::getenv(v); e && *e && selection.empty()) selection = e;
  }
  int port = 0;
  if (info_.world_size > 1) {
    try {
      auto l = std::make_shared<detail::ProbeListener>();
      port = l->port();
      listener_ = l;
    } catch (const std::exception& e) {
      std::cerr << "tandem: rank " << info_.rank << ": " << e.what() << " (unreachable peers will not be named)\n";
    }
  }
  constexpr int64_t kRecord = 1024;
  std::string mine =
      std::string(name) + "\n" + joined(detail::local_addresses(selection)) + "\n" + std::to_string(port);
  mine.resize(kRecord - 1);  // zero-padded (or cut: a host with dozens of addresses)
  mine.push_back('\0');
  const int n = info_.world_size;
  std::vector<std::string> records(n, "(unknown)\n\n0");  // without a CPU communicator over all ranks
  if (n > 1 && cpu_world_ && cpu_world_->size() == n) {
    auto in = at::empty({kRecord}, at::kByte);
    std::memcpy(in.data_ptr(), mine.data(), kRecord);
    auto out = at::empty({n * kRecord}, at::kByte);
    cpu_world_->allgather(out, in);
    cpu_world_->reset_stats();  // the user's communication figures start at zero
    const char* all = static_cast<const char*>(out.data_ptr());
    for (int r = 0; r < n; ++r) records[r] = std::string(all + r * kRecord, strnlen(all + r * kRecord, kRecord));
  }
  records[info_.rank] = mine.c_str();
  host_of_.assign(n, 0);
  probe_port_.assign(n, 0);
  for (int r = 0; r < n; ++r) {
    std::istringstream is(records[r]);
    std::string host, addrs, p;
    std::getline(is, host);
    std::getline(is, addrs);
    std::getline(is, p);
    probe_port_[r] = std::atoi(p.c_str());
    size_t h = 0;
    while (h < hosts_.size() && hosts_[h].name != host) ++h;
    if (h == hosts_.size()) {
      HostInfo info;
      info.name = host;
      std::istringstream as(addrs);
      for (std::string a; std::getline(as, a, ',');) info.addresses.push_back(a);
      hosts_.push_back(info);
    }
    hosts_[h].ranks.push_back(r);
    host_of_[r] = static_cast<int>(h);
  }
}

std::string Runtime::layout() const {
  std::string out = std::to_string(hosts_.size()) + (hosts_.size() == 1 ? " host: " : " hosts: ");
  for (size_t h = 0; h < hosts_.size(); ++h) {
    if (h) out += ", ";
    out += hosts_[h].name;
    if (!hosts_[h].addresses.empty()) out += " (" + joined(hosts_[h].addresses) + ")";
    out += hosts_[h].ranks.size() == 1 ? " rank " : " ranks ";
    out += rank_ranges(hosts_[h].ranks);
  }
  return out;
}

std::string Runtime::unreachable_peers(std::chrono::milliseconds wait) const {
  std::vector<detail::PeerAddress> peers;
  std::vector<int> who;
  for (int r = 0; r < info_.world_size; ++r) {
    if (r == info_.rank || probe_port_[r] <= 0 || hosts_[host_of_[r]].addresses.empty()) continue;
    peers.push_back({hosts_[host_of_[r]].addresses, probe_port_[r]});
    who.push_back(r);
  }
  if (peers.empty()) return "";
  auto state = detail::probe_peers(peers, wait);
  const auto& me = hosts_[host_of_[info_.rank]];
  std::ostringstream os;
  for (size_t i = 0; i < who.size(); ++i) {
    if (state[i] == detail::PeerState::kAnswers) continue;
    const auto& h = hosts_[host_of_[who[i]]];
    os << "rank " << who[i] << " on host " << h.name << " (" << joined(h.addresses) << ") ";
    if (state[i] == detail::PeerState::kUnreachable) {
      os << "is unreachable from rank " << info_.rank << " on host " << me.name << ": no answer within "
         << std::chrono::duration<double>(wait).count() << " s (link or host down, or a firewall)\n";
    } else {
      os << "has no process any more: its host answers but refuses the connection\n";
    }
  }
  return os.str();
}

Runtime::~Runtime() {
  world_.reset();
  cpu_world_.reset();
#ifdef TANDEM_WITH_MPI
  if (mpi_initialized_here_) mpi_finalize();
#endif
}

void Runtime::abort(int code) const {
  std::cout.flush();
  std::cerr.flush();
#ifdef TANDEM_WITH_MPI
  mpi_abort(code);
#else
  std::_Exit(code);
#endif
}

}  // namespace tandem
