// Kubernetes manifests for a Tandem training job: an MPIJob (kubeflow.org/v2beta1, the Kubeflow
// MPI Operator) whose launcher runs `mpirun ... tandem train` over worker pods, and optionally
// the PersistentVolumeClaim that holds its checkpoints. Used by `tandem k8s`; no LibTorch here.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

namespace tandem::k8s {

using Json = nlohmann::ordered_json;  // keeps Kubernetes' customary key order in the output
using KeyValues = std::vector<std::pair<std::string, std::string>>;

// A group of alike nodes (one GPU model): `--pool NAME:NODES:GPUS[:KEY=VALUE[,KEY=VALUE...]]`.
struct Pool {
  std::string name;
  int nodes = 0;
  int gpus_per_node = 0;
  KeyValues selector;  // node labels that pick the pool's nodes
};

// `--toleration KEY[=VALUE]:EFFECT`: operator Equal with a value, Exists without.
struct Toleration {
  std::string key, value, effect;
};

struct JobSpec {
  std::string name = "tandem";
  std::string ns = "default";
  int nodes = 1;             // worker nodes (without pools)
  int gpus_per_node = 0;     // 0: a CPU job
  int slots_per_worker = 0;  // ranks per worker pod; 0: the GPUs per node (GPU job) or 1 (CPU job)
  std::string image;
  std::string strategy = "ddp";
  std::vector<std::string> train_args;  // passed to `tandem train` after the generated ones
  KeyValues node_selector;              // every pod
  std::vector<Toleration> tolerations;  // every pod
  std::vector<Pool> pools;              // mixed GPU pools (replace nodes / gpus_per_node)
  std::string checkpoint_pvc;           // claim mounted at /ckpt in every pod; empty: no checkpoints
  std::string checkpoint_size;          // non-empty: also emit the claim (ReadWriteMany) of this size
  std::string storage_class;            // of the emitted claim (empty: the cluster's default)
  int checkpoint_every = 500;           // steps between checkpoints (with a claim)
  std::string shm_size = "1Gi";         // memory-backed /dev/shm of each worker
  std::string cpu, memory;              // requests = limits per worker pod (empty: none)
  std::vector<std::string> env;         // extra NAME=VALUE given to every rank
  int backoff_limit = 3;                // launcher restarts (each resumes from the claim)
  std::string clean_pod_policy = "Running";
  std::string tandem_path = "/opt/tandem/build/tandem";  // the binary inside the image
};

// Where the operator mounts its files and the generator mounts the claim.
inline constexpr const char* kCheckpointMount = "/ckpt";

// The worker layout a spec resolves to.
struct Layout {
  int workers = 0;          // worker pods
  int slots = 0;            // ranks per worker pod
  int gpus_per_worker = 0;  // nvidia.com/gpu limit per worker pod
  int ranks() const { return workers * slots; }
};

// Flag parsers: throw std::invalid_argument naming the flag and the expected form.
Pool parse_pool(const std::string& text);
Toleration parse_toleration(const std::string& text);
std::pair<std::string, std::string> parse_key_value(const std::string& flag, const std::string& text);

// Checks every value (names, counts, quantities, strategy, reserved training flags, batch
// divisibility) and returns the layout; throws std::invalid_argument with "--flag ...: what
// is wrong; what to do".
Layout validate(const JobSpec& spec);

Json mpijob(const JobSpec& spec);            // validates first
Json checkpoint_claim(const JobSpec& spec);  // the PersistentVolumeClaim (needs checkpoint_size)
// Every document the spec asks for: the claim (when checkpoint_size is set), then the MPIJob.
std::vector<Json> manifests(const JobSpec& spec);

// Block-style YAML of one document; strings that YAML could read as anything else are quoted.
std::string to_yaml(const Json& doc);
// Documents as YAML separated by "---", or as JSON (one object, or a v1 List of several).
std::string render(const std::vector<Json>& docs, const std::string& format);

}  // namespace tandem::k8s
