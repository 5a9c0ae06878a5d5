// Who am I: rank, world size, local rank and device of this process, read from mpirun
// (OMPI_COMM_WORLD_*), srun (SLURM_*) or plain env (RANK, WORLD_SIZE, LOCAL_RANK), and the
// communicators over all ranks. One Runtime per process, created once and passed explicitly.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm.h"

namespace tandem {

struct ProcessInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::string launcher = "none";  // "mpirun", "srun", "env", "none", or "threads" for a replica thread
};

// Reads the environment only; never initializes anything.
ProcessInfo detect_process_info();

// Makes glibc's malloc keep freed memory for reuse instead of returning it to the kernel: a
// fixed 32 MiB mmap threshold (glibc's largest; by default it moves with what the process freed
// before) and a 1 GiB trim threshold. Without it, a step's activations may be mmapped and
// unmapped every iteration and re-faulted page by page: the CNN's forward+backward at batch 96
// took 60-63 ms instead of 48-49 ms (4,000-6,000 page faults per step) after the process had
// run another model or used two threads (medians of 3 runs, docs/BENCHMARKS.md). Called by
// Runtime's constructor; idempotent; TANDEM_MALLOC_TUNE=0 leaves malloc as it is. Returns
// whether the settings were applied (false off glibc or when disabled).
bool tune_allocator();

// CommOptions::wait_sleep_us for the MPI backend when it is left to the Runtime: 50 us sleeps
// between a blocked rank's polls where this node's ranks times compute threads exceed its cores
// (the ranks that compute keep the cores), else 0 (yield and poll: the lowest latency).
int default_wait_sleep_us(int local_ranks, int threads_per_rank, int cores);

// One host of the job: its name, the addresses its ranks advertise and its ranks (ascending).
// Hosts are numbered by their lowest rank: the node rank of a process is its host's index.
struct HostInfo {
  std::string name;
  std::vector<std::string> addresses;  // IPv4 (TANDEM_NET_IF / btl_tcp_if_include selects)
  std::vector<int> ranks;
};

struct RuntimeOptions {
  // Compute threads per rank; 0 = cores on this host / local ranks (at least 1).
  int threads = 0;
  // "auto" (CUDA when available), "cpu" or "cuda".
  std::string device = "auto";
  // "auto" (NCCL for CUDA, MPI for CPU), "mpi", "nccl" or "self" (world size 1 only).
  std::string backend = "auto";
  CommOptions comm;
  // NCCL bootstrap without MPI: a directory shared by all ranks (TANDEM_STORE_DIR).
  std::string store_dir;
};

// One replica of a process that trains several on its own threads (tandem/replicas.h): where it
// sits in the job and its communicators, filled in by run_replicas.
struct ReplicaPlacement {
  ProcessInfo info;  // counted in replicas: rank, world size, local rank and size on this host
  int threads = 1;   // compute threads of this replica's thread
  c10::Device device{c10::kCPU};
  CommPtr world, cpu_world;
  std::vector<HostInfo> hosts;
  std::vector<int> host_of;  // rank -> index in hosts
};

class Runtime {
 public:
  explicit Runtime(const RuntimeOptions& opts = {});
  // The Runtime of one replica thread: initializes nothing, sets the calling thread's compute
  // threads.
  explicit Runtime(ReplicaPlacement placement);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const ProcessInfo& info() const { return info_; }
  int rank() const { return info_.rank; }
  int world_size() const { return info_.world_size; }
  int threads() const { return threads_; }
  c10::Device device() const { return device_; }

  // The hosts of the job, found by all-gathering every rank's host name at start-up.
  const std::vector<HostInfo>& hosts() const { return hosts_; }
  int node_rank() const { return host_of_[info_.rank]; }
  int host_of(int rank) const { return host_of_.at(rank); }
  // "2 hosts: h0 (10.0.0.1) ranks 0-1, h1 (10.0.0.2) ranks 2-3".
  std::string layout() const;
  // After a communication failure: which peers do not answer a TCP connection to their
  // reachability port within `wait`, one line each naming the rank, its host and why ("" when
  // every peer answers). Reaches no further than the network; MPI is not used.
  std::string unreachable_peers(std::chrono::milliseconds wait = std::chrono::milliseconds(2000)) const;

  // Communicator for tensors on device(): NCCL on CUDA, MPI (or self) on CPU.
  CommPtr world() const { return world_; }
  // Communicator for CPU tensors (MPI or self); used for metadata and host-side checks.
  CommPtr cpu_world() const { return cpu_world_; }

  // Ends every rank of the job at once (MPI_Abort when under MPI); use after an unrecoverable
  // error so that no peer hangs waiting for this rank.
  [[noreturn]] void abort(int code) const;

 private:
  ProcessInfo info_;
  int threads_ = 1;
  c10::Device device_{c10::kCPU};
  CommPtr cpu_world_;
  CommPtr world_;
  bool mpi_initialized_here_ = false;
  std::vector<HostInfo> hosts_;
  std::vector<int> host_of_;        // rank -> index in hosts_
  std::vector<int> probe_port_;     // rank -> its reachability port (0: none)
  std::shared_ptr<void> listener_;  // detail::ProbeListener
  void exchange_hosts();
};

}  // namespace tandem
