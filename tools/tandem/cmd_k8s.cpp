// `tandem k8s`: writes the Kubernetes manifests (an MPIJob for the Kubeflow MPI Operator, and
// the checkpoint claim) that run `tandem train` on a cluster. Flags in, tandem/k8s.h out.
#include <CLI/CLI.hpp>

#include <fstream>
#include <iostream>

#include "cli_app.h"
#include "commands.h"
#include "tandem/k8s.h"

namespace tandem::cli {

int cmd_k8s(int argc, char** argv) {
  // Everything after "--" goes to `tandem train`.
  const int split = dashdash_index(argc, argv);
  CLI::App app{"Write Kubernetes manifests that run tandem train as an MPIJob (Kubeflow MPI Operator, "
               "kubeflow.org/v2beta1): a launcher running mpirun, worker pods with GPUs, /dev/shm, checkpoints "
               "on a PersistentVolumeClaim. See docs/DEPLOY.md.",
               "tandem k8s"};
  k8s::JobSpec s;
  std::vector<std::string> node_selectors, tolerations, pools;
  std::string out_path, format = "yaml";
  app.add_option("--name", s.name, "MPIJob name (pods: NAME-launcher, NAME-worker-I)")->capture_default_str();
  app.add_option("--namespace", s.ns, "namespace")->capture_default_str();
  app.add_option("--nodes", s.nodes, "worker nodes")->capture_default_str();
  app.add_option("--gpus-per-node", s.gpus_per_node, "GPUs per node (0: a CPU job)")->capture_default_str();
  app.add_option("--slots-per-worker", s.slots_per_worker,
                 "ranks per worker pod (default: the GPUs per node, one rank per GPU; 1 for CPU jobs); with GPUs "
                 "it must divide the GPUs per node, and a node then holds GPUs/slots worker pods");
  app.add_option("--image", s.image, "container image built from deploy/Dockerfile (required)");
  app.add_option("--strategy", s.strategy,
                 "single | ddp | zero1 | zero2 | zero3 | hsdp | hsdp2 (hsdp: ZeRO-3 within each pod's ranks, "
                 "replicated across the pods)")
      ->capture_default_str();
  app.add_option("--node-selector", node_selectors, "KEY=VALUE node label every pod needs (repeatable)");
  app.add_option("--toleration", tolerations, "KEY[=VALUE]:EFFECT taint every pod tolerates (repeatable)");
  app.add_option("--pool", pools,
                 "NAME:NODES:GPUS[:KEY=VALUE[,KEY=VALUE]] a node pool of a mixed cluster (repeatable; replaces "
                 "--nodes/--gpus-per-node); workers may land on any pool's nodes");
  app.add_option("--checkpoint-pvc", s.checkpoint_pvc,
                 "PersistentVolumeClaim (ReadWriteMany) mounted at /ckpt: checkpoints, and --resume on every start");
  app.add_option("--checkpoint-size", s.checkpoint_size, "also emit that claim with this size, e.g. 50Gi");
  app.add_option("--storage-class", s.storage_class, "StorageClass of the emitted claim (default: the cluster's)");
  app.add_option("--checkpoint-every", s.checkpoint_every, "steps between checkpoints")->capture_default_str();
  app.add_option("--shm-size", s.shm_size, "memory-backed /dev/shm per worker pod")->capture_default_str();
  app.add_option("--cpu", s.cpu, "CPU request = limit per worker pod, e.g. 16 (also sets threads per rank)");
  app.add_option("--memory", s.memory, "memory request = limit per worker pod, e.g. 128Gi");
  app.add_option("--env", s.env, "NAME=VALUE for every rank (repeatable)");
  app.add_option("--backoff-limit", s.backoff_limit, "launcher restarts before the job fails")->capture_default_str();
  app.add_option("--clean-pod-policy", s.clean_pod_policy, "Running | All | None")->capture_default_str();
  app.add_option("--tandem-path", s.tandem_path, "the tandem binary inside the image")->capture_default_str();
  app.add_option("--format", format, "yaml | json")->capture_default_str();
  app.add_option("-o,--output", out_path, "write to FILE instead of standard output");
  app.footer(examples_footer({
      {"2 nodes of 8 GPUs, checkpoints on a 20 GiB claim; the training arguments follow --",
       {"tandem k8s --name fmnist --nodes 2 --gpus-per-node 8 --image REGISTRY/tandem:0.1 \\",
        "           --checkpoint-pvc fmnist-ckpt --checkpoint-size 20Gi -- --model cnn --epochs 5 --batch 512"}},
  }));
  if (auto rc = parse_command_line(app, split, argv)) return *rc;
  s.train_args.assign(argv + std::min(split + 1, argc), argv + argc);

  std::string text;
  try {
    if (!pools.empty() && (app.count("--nodes") || app.count("--gpus-per-node"))) {
      throw std::invalid_argument("--pool replaces --nodes and --gpus-per-node; give the nodes and GPUs of each pool");
    }
    for (const auto& p : pools) s.pools.push_back(k8s::parse_pool(p));
    for (const auto& t : tolerations) s.tolerations.push_back(k8s::parse_toleration(t));
    for (const auto& kv : node_selectors) s.node_selector.push_back(k8s::parse_key_value("--node-selector", kv));
    if (format != "yaml" && format != "json")
      throw std::invalid_argument("--format '" + format + "': use yaml or json");
    text = k8s::render(k8s::manifests(s), format);
  } catch (const std::invalid_argument& e) {
    std::cerr << "tandem k8s: " << e.what() << "\n";
    return 2;
  }
  if (s.checkpoint_pvc.empty()) {
    std::cerr << "tandem k8s: note: no --checkpoint-pvc: no checkpoints, so a restarted launcher starts from step 0\n";
  }
  if (out_path.empty()) {
    std::cout << text << std::flush;
    return 0;
  }
  std::ofstream f(out_path);
  f << text;
  f.close();
  if (!f) {
    std::cerr << "tandem k8s: cannot write '" << out_path << "'\n";
    return 1;
  }
  return 0;
}

}  // namespace tandem::cli
