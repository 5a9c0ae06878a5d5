// Several replicas in one process (`tandem train --replicas K`): K threads, each a rank of its
// own with a Runtime, a device (CPU: all on the CPU, each with its own compute threads; CUDA:
// device r for replica r) and its own gradients, all-reduced inside the process (the thread
// backend on CPU, NCCL's single-process communicators on CUDA). One process needs neither MPI
// nor a launcher; several (`-n P --replicas K`) reduce inside each process, then across them.
#pragma once

#include <functional>
#include <mutex>

#include "tandem/runtime.h"

namespace tandem {

struct ReplicaOptions {
  int replicas = 1;
  // threads: compute threads per replica (0: cores / replicas); device: cpu, cuda (one device
  // per replica) or auto (CUDA when this process sees a device); comm: the timeout.
  RuntimeOptions runtime;
};

// Checks the options against this machine: at least one replica, a known device, no more
// replicas than CUDA devices, the CPU when a launcher started several processes. Throws
// std::invalid_argument naming the problem and what to do.
void validate_replicas(const ReplicaOptions& opts);

// Runs fn(runtime) on opts.replicas threads, replica r with rank r of world size replicas.
// Under a launcher (mpirun, srun, env) with P processes, replica r of process p is rank
// p * K + r of P * K (tandem/backends.h: make_hierarchical_communicator). When one throws, the
// others' pending and later communication fails at once instead of waiting for the timeout
// (with several processes, the message goes to stderr and the whole job ends, as
// Runtime::abort); once every thread has ended, the first failure is rethrown as
// std::runtime_error("replica r: <its message>").
void run_replicas(const ReplicaOptions& opts, const std::function<void(Runtime&)>& fn);

// LibTorch's default generator is one per process, shared by the replica threads: they hold
// this lock while they seed it and draw from it (model initialisation), so each draws the stream
// a process of its own would. Never hold it across a collective: the peers would wait for it.
std::mutex& default_generator_mutex();

}  // namespace tandem
