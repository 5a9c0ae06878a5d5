// `tandem k8s`'s manifests: flags -> checked JobSpec -> MPIJob (+ PersistentVolumeClaim).
//
// How the MPI Operator (v2beta1) runs it: it makes the worker pods `<name>-worker-<i>` from
// the Worker template (sshd in the foreground), a headless Service `<name>-worker`, an SSH key
// Secret, and a ConfigMap mounted at /etc/mpi whose hostfile lists
// `<name>-worker-<i>.<name>-worker.<namespace>.svc slots=<slotsPerWorker>`; then the launcher
// Job, whose container gets OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile and runs our
// `mpirun`, which starts the ranks on the workers over ssh. A process started through sshd does
// not see the worker container's environment, so every variable the ranks need is set on the
// launcher and forwarded with `mpirun -x NAME`.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tandem/k8s.h"

#include "tandem/engine.h"

namespace tandem::k8s {
namespace {

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument(msg); }

bool matches(const std::string& s, const char* re) { return std::regex_match(s, std::regex(re)); }

// RFC 1123 label (pod host names, namespaces) and subdomain (claims, label key prefixes).
bool dns1123_label(const std::string& s) { return s.size() <= 63 && matches(s, "[a-z0-9]([-a-z0-9]*[a-z0-9])?"); }
bool dns1123_subdomain(const std::string& s) {
  return s.size() <= 253 && matches(s, "[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*");
}

// Label keys ([prefix/]name) and values, as node selectors need them.
void check_label(const std::string& flag, const std::string& key, const std::string& value) {
  const auto slash = key.find('/');
  const std::string prefix = slash == std::string::npos ? "" : key.substr(0, slash);
  const std::string name = slash == std::string::npos ? key : key.substr(slash + 1);
  const char* part = "([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)";
  if ((slash != std::string::npos && !dns1123_subdomain(prefix)) || name.empty() || name.size() > 63 ||
      !matches(name, part)) {
    bad(flag + ": '" + key +
        "' is not a valid label key (optional DNS prefix and '/', then up to 63 of "
        "A-Z a-z 0-9 - _ . starting and ending alphanumeric), e.g. cloud.google.com/gke-accelerator");
  }
  if (value.size() > 63 || !(value.empty() || matches(value, part))) {
    bad(flag + ": '" + value +
        "' is not a valid label value (up to 63 of A-Z a-z 0-9 - _ . starting and ending "
        "alphanumeric)");
  }
}

// A Kubernetes quantity ("4", "500m", "16Gi", "1.5") in base units; -1 when malformed.
double quantity(const std::string& s) {
  std::smatch m;
  static const std::regex re("([0-9]+(\\.[0-9]*)?|\\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?");
  if (!std::regex_match(s, m, re)) return -1;
  double v = std::stod(m[1]);
  const std::string suffix = m[3];
  const char* dec[] = {"k", "M", "G", "T", "P", "E"};
  const char* bin[] = {"Ki", "Mi", "Gi", "Ti", "Pi", "Ei"};
  for (int i = 0; i < 6; ++i) {
    if (suffix == dec[i]) v *= std::pow(1000.0, i + 1);
    if (suffix == bin[i]) v *= std::pow(1024.0, i + 1);
  }
  if (suffix == "m") v /= 1000.0;
  return v;
}

double check_quantity(const std::string& flag, const std::string& s, const char* example) {
  double v = quantity(s);
  if (v <= 0) bad(flag + " '" + s + "': not a positive Kubernetes quantity; write it like " + example);
  return v;
}

int to_int(const std::string& flag, const std::string& s) {
  try {
    size_t used = 0;
    long v = std::stol(s, &used);
    if (used == s.size() && v >= -1000000000 && v <= 1000000000) return static_cast<int>(v);
  } catch (...) {
  }
  bad(flag + ": '" + s + "' is not a whole number");
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) parts.push_back(item);
  if (!s.empty() && s.back() == sep) parts.emplace_back();
  return parts;
}

// The value of a training flag given as "--flag V" or "--flag=V"; empty when absent.
std::string train_flag(const std::vector<std::string>& args, const std::string& flag) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == flag && i + 1 < args.size()) return args[i + 1];
    if (args[i].rfind(flag + "=", 0) == 0) return args[i].substr(flag.size() + 1);
  }
  return "";
}

bool has_train_flag(const std::vector<std::string>& args, const std::string& flag) {
  for (const auto& a : args) {
    if (a == flag || a.rfind(flag + "=", 0) == 0) return true;
  }
  return false;
}

// Training flags the manifest sets itself, and what to use instead.
void check_reserved(const std::vector<std::string>& args) {
  const std::pair<const char*, const char*> reserved[] = {
      {"-n", "the rank count is --nodes x --gpus-per-node (or --slots-per-worker); drop -n"},
      {"--nprocs", "the rank count is --nodes x --gpus-per-node (or --slots-per-worker); drop --nprocs"},
      {"--strategy", "give it to tandem k8s: --strategy S before the --"},
      {"--device", "it follows --gpus-per-node (cuda with GPUs, else cpu); drop --device"},
      {"--checkpoint-dir", "checkpoints go to the claim of --checkpoint-pvc, mounted at /ckpt; drop --checkpoint-dir"},
      {"--resume", "every start resumes from the claim of --checkpoint-pvc by itself; drop --resume"},
      {"--hostfile", "the MPI Operator writes the hostfile; drop --hostfile"},
      {"--max-restarts", "the launcher Job restarts the run (--backoff-limit); drop --max-restarts"},
  };
  for (const auto& a : args) {
    for (const auto& [flag, instead] : reserved) {
      const std::string f = flag;
      bool hit = a == f || a.rfind(f + "=", 0) == 0 ||
                 (f == "-n" && a.size() > 2 && a.rfind("-n", 0) == 0 && std::isdigit(static_cast<unsigned char>(a[2])));
      if (hit) bad("training argument '" + a + "' after --: " + instead);
    }
  }
}

Json env_var(const std::string& name, const std::string& value) { return Json{{"name", name}, {"value", value}}; }

Json labels(const JobSpec& s, const char* role) {
  return Json{{"app.kubernetes.io/name", "tandem"},
              {"app.kubernetes.io/instance", s.name},
              {"app.kubernetes.io/component", role}};
}

Json tolerations_json(const std::vector<Toleration>& tols) {
  Json out = Json::array();
  for (const auto& t : tols) {
    Json j = {{"key", t.key}, {"operator", t.value.empty() ? "Exists" : "Equal"}};
    if (!t.value.empty()) j["value"] = t.value;
    j["effect"] = t.effect;
    out.push_back(j);
  }
  return out;
}

// Node selector (every pod), tolerations, and for pools a required node affinity whose terms
// (ORed) admit the nodes of any pool.
void placement(Json& pod_spec, const JobSpec& s, bool with_pools) {
  if (!s.node_selector.empty()) {
    Json sel = Json::object();
    for (const auto& [k, v] : s.node_selector) sel[k] = v;
    pod_spec["nodeSelector"] = sel;
  }
  if (with_pools && !s.pools.empty() && !s.pools[0].selector.empty()) {
    Json terms = Json::array();
    for (const auto& p : s.pools) {
      Json exprs = Json::array();
      for (const auto& [k, v] : p.selector) exprs.push_back({{"key", k}, {"operator", "In"}, {"values", {v}}});
      terms.push_back({{"matchExpressions", exprs}});
    }
    pod_spec["affinity"] = {
        {"nodeAffinity", {{"requiredDuringSchedulingIgnoredDuringExecution", {{"nodeSelectorTerms", terms}}}}}};
  }
  if (!s.tolerations.empty()) pod_spec["tolerations"] = tolerations_json(s.tolerations);
}

}  // namespace

std::pair<std::string, std::string> parse_key_value(const std::string& flag, const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) bad(flag + " '" + text + "': expected KEY=VALUE");
  auto kv = std::make_pair(text.substr(0, eq), text.substr(eq + 1));
  check_label(flag, kv.first, kv.second);
  return kv;
}

Pool parse_pool(const std::string& text) {
  const auto parts = split(text, ':');
  const std::string form = "expected NAME:NODES:GPUS[:KEY=VALUE[,KEY=VALUE...]], e.g. h100:2:8:"
                           "cloud.google.com/gke-accelerator=nvidia-h100-80gb";
  if (parts.size() < 3 || parts.size() > 4) bad("--pool '" + text + "': " + form);
  Pool p;
  p.name = parts[0];
  if (!dns1123_label(p.name)) bad("--pool '" + text + "': the pool name '" + p.name + "' must be lower-case a-z 0-9 -");
  p.nodes = to_int("--pool '" + text + "' (nodes)", parts[1]);
  p.gpus_per_node = to_int("--pool '" + text + "' (GPUs per node)", parts[2]);
  if (parts.size() == 4) {
    for (const auto& kv : split(parts[3], ',')) p.selector.push_back(parse_key_value("--pool '" + text + "'", kv));
  }
  return p;
}

Toleration parse_toleration(const std::string& text) {
  const auto colon = text.rfind(':');
  const std::string form = "expected KEY[=VALUE]:EFFECT with EFFECT NoSchedule, PreferNoSchedule or NoExecute, "
                           "e.g. nvidia.com/gpu:NoSchedule";
  if (colon == std::string::npos || colon == 0) bad("--toleration '" + text + "': " + form);
  Toleration t;
  t.effect = text.substr(colon + 1);
  if (t.effect != "NoSchedule" && t.effect != "PreferNoSchedule" && t.effect != "NoExecute") {
    bad("--toleration '" + text + "': unknown effect '" + t.effect + "'; " + form);
  }
  const std::string kv = text.substr(0, colon);
  const auto eq = kv.find('=');
  t.key = kv.substr(0, eq);
  if (eq != std::string::npos) t.value = kv.substr(eq + 1);
  if (t.key.empty()) bad("--toleration '" + text + "': " + form);
  check_label("--toleration '" + text + "'", t.key, t.value);
  return t;
}

Layout validate(const JobSpec& s) {
  // Names: the operator makes pods `<name>-launcher` and `<name>-worker-<i>` (DNS-1123 labels)
  // and a Service `<name>-worker` (a DNS-1035 label: it must start with a letter).
  if (s.name.empty() || !dns1123_label(s.name) || !std::isalpha(static_cast<unsigned char>(s.name[0]))) {
    bad("--name '" + s.name +
        "': must be lower-case letters, digits and '-', start with a letter and end with a "
        "letter or digit (the operator names a Service after it), e.g. fmnist-ddp");
  }
  if (!dns1123_label(s.ns)) {
    bad("--namespace '" + s.ns + "': not a valid namespace (lower-case a-z 0-9 -, at most 63 characters)");
  }
  if (s.image.empty()) {
    bad("--image is required: the image built from deploy/Dockerfile and pushed to a registry the cluster pulls "
        "from, e.g. --image registry.example.com/tandem:0.1");
  }
  if (s.image.find_first_of(" \t\n") != std::string::npos) bad("--image '" + s.image + "': no spaces in an image name");

  Layout l;
  const bool pools = !s.pools.empty();
  if (pools) {
    std::set<std::string> names;
    int cpu_pools = 0;
    for (const auto& p : s.pools) {
      const std::string where = "--pool " + p.name + ": ";
      if (!names.insert(p.name).second) bad(where + "the pool name is given twice; name each pool once");
      if (p.nodes < 1) bad(where + "nodes must be at least 1, got " + std::to_string(p.nodes));
      if (p.gpus_per_node < 0) bad(where + "GPUs per node must be 0 or more, got " + std::to_string(p.gpus_per_node));
      if (p.gpus_per_node == 0) ++cpu_pools;
      if (s.pools.size() > 1 && p.selector.empty()) {
        bad(where + "a node selector is needed when there are several pools (NAME:NODES:GPUS:KEY=VALUE), else its "
                    "workers could land on any node");
      }
    }
    if (cpu_pools != 0 && cpu_pools != static_cast<int>(s.pools.size())) {
      bad("--pool: mixing GPU and CPU-only pools is not supported (one Worker template serves every pool); make "
          "all pools GPU pools or all CPU pools");
    }
  } else {
    if (s.nodes < 1)
      bad("--nodes must be at least 1, got " + std::to_string(s.nodes) + "; give the number of worker nodes");
    if (s.gpus_per_node < 0) {
      bad("--gpus-per-node must be 0 (a CPU job) or more, got " + std::to_string(s.gpus_per_node));
    }
  }
  if (s.slots_per_worker < 0) {
    bad("--slots-per-worker must be at least 1 (0: automatic), got " + std::to_string(s.slots_per_worker));
  }

  // Worker pods: GPU jobs run one rank per GPU, slots ranks (= GPUs) per pod, so a node of G
  // GPUs holds G / slots pods; CPU jobs run one pod per node with slots ranks.
  std::vector<Pool> groups = s.pools;
  if (!pools) groups.push_back(Pool{"", s.nodes, s.gpus_per_node, {}});
  const bool gpu = groups[0].gpus_per_node > 0;
  if (gpu) {
    int g = 0;
    for (const auto& p : groups) g = std::gcd(g, p.gpus_per_node);
    l.slots = s.slots_per_worker > 0 ? s.slots_per_worker : g;
    for (const auto& p : groups) {
      if (p.gpus_per_node % l.slots != 0) {
        const std::string what = pools ? "pool " + p.name + "'s " + std::to_string(p.gpus_per_node) + " GPUs per node"
                                       : "--gpus-per-node " + std::to_string(p.gpus_per_node);
        bad("--slots-per-worker " + std::to_string(l.slots) + " does not divide " + what +
            " (Tandem runs one rank per GPU, a worker pod holds slots GPUs); use a divisor, e.g. " + std::to_string(g));
      }
      l.workers += p.nodes * (p.gpus_per_node / l.slots);
    }
    l.gpus_per_worker = l.slots;
  } else {
    l.slots = s.slots_per_worker > 0 ? s.slots_per_worker : 1;
    for (const auto& p : groups) l.workers += p.nodes;
  }
  // The operator's own check: the last worker's host name must be a DNS-1123 label.
  const std::string last = s.name + "-worker-" + std::to_string(l.workers - 1);
  if (last.size() > 63 || (s.name + "-launcher").size() > 63) {
    bad("--name '" + s.name + "': too long: the pod host name '" + (last.size() > 63 ? last : s.name + "-launcher") +
        "' would exceed 63 characters; use a shorter name");
  }

  bool single = false;
  try {
    single = is_single(parse_strategy(s.strategy));
  } catch (const std::invalid_argument&) {
    bad("--strategy '" + s.strategy + "': unknown; use single, ddp, zero1, zero2, zero3, hsdp or hsdp2");
  }
  if (single && l.ranks() != 1) {
    bad("--strategy single runs one rank, but the layout has " + std::to_string(l.ranks()) +
        "; use --strategy ddp (or zero1/2/3), or one node with one slot");
  }

  if (!s.checkpoint_pvc.empty() && !dns1123_subdomain(s.checkpoint_pvc)) {
    bad("--checkpoint-pvc '" + s.checkpoint_pvc + "': not a valid claim name (lower-case a-z 0-9 - .)");
  }
  if (!s.checkpoint_size.empty()) {
    if (s.checkpoint_pvc.empty()) bad("--checkpoint-size needs --checkpoint-pvc NAME (the claim to create)");
    check_quantity("--checkpoint-size", s.checkpoint_size, "50Gi");
  }
  if (!s.storage_class.empty() && s.checkpoint_size.empty()) {
    bad("--storage-class applies to the claim that --checkpoint-size creates; add --checkpoint-size");
  }
  if (!s.storage_class.empty() && !dns1123_subdomain(s.storage_class)) {
    bad("--storage-class '" + s.storage_class + "': not a valid StorageClass name");
  }
  if (s.checkpoint_every < 1) bad("--checkpoint-every must be at least 1, got " + std::to_string(s.checkpoint_every));
  double shm = check_quantity("--shm-size", s.shm_size, "2Gi");
  if (!s.cpu.empty()) check_quantity("--cpu", s.cpu, "8 or 7500m");
  if (!s.memory.empty()) {
    double mem = check_quantity("--memory", s.memory, "64Gi");
    if (shm >= mem) {
      bad("--shm-size " + s.shm_size + " must be below --memory " + s.memory +
          " (the memory-backed /dev/shm counts against the pod's memory limit)");
    }
  }
  if (s.backoff_limit < 0) bad("--backoff-limit must be 0 or more, got " + std::to_string(s.backoff_limit));
  if (s.clean_pod_policy != "Running" && s.clean_pod_policy != "All" && s.clean_pod_policy != "None") {
    bad("--clean-pod-policy '" + s.clean_pod_policy + "': use Running, All or None");
  }
  for (const auto& e : s.env) {
    const auto eq = e.find('=');
    if (eq == std::string::npos || !matches(e.substr(0, eq), "[A-Za-z_][A-Za-z0-9_]*")) {
      bad("--env '" + e + "': expected NAME=VALUE with NAME of letters, digits and '_'");
    }
  }
  if (s.tandem_path.empty() || s.tandem_path[0] != '/') {
    bad("--tandem-path '" + s.tandem_path + "': give the absolute path of the tandem binary in the image");
  }

  // Training arguments that the manifest owns, and what the ranks will check anyway, early.
  check_reserved(s.train_args);
  const std::string tp = train_flag(s.train_args, "--tp"), pp = train_flag(s.train_args, "--pp"),
                    cp = train_flag(s.train_args, "--cp");
  const int model_parallel = (tp.empty() ? 1 : to_int("--tp", tp)) * (pp.empty() ? 1 : to_int("--pp", pp)) *
                             (cp.empty() ? 1 : to_int("--cp", cp));
  if (model_parallel < 1 || l.ranks() % model_parallel != 0) {
    bad("training arguments --tp/--pp/--cp: " + std::to_string(l.ranks()) + " ranks do not split into tp x pp x cp = " +
        std::to_string(model_parallel) + " groups; change --tp/--pp/--cp or the node count");
  }
  const std::string batch_text = train_flag(s.train_args, "--batch");
  const int batch = batch_text.empty() ? 128 : to_int("--batch", batch_text);
  const int dp = l.ranks() / model_parallel;
  // Uneven --batch-shares (tandem train's heterogeneous shares) need only a sample per rank.
  const bool shares = has_train_flag(s.train_args, "--batch-shares");
  if (shares && batch < dp) {
    bad("the global batch " + std::to_string(batch) + " is smaller than the " + std::to_string(dp) +
        " data-parallel ranks (each needs at least one sample); pass a larger --batch after --");
  }
  if (!shares && (batch < 1 || batch % dp != 0)) {
    bad("the global batch " + std::to_string(batch) + (batch_text.empty() ? " (tandem train's default)" : "") +
        " does not split over " + std::to_string(dp) + " data-parallel ranks; pass --batch with a multiple of " +
        std::to_string(dp) + " after --");
  }
  return l;
}

Json mpijob(const JobSpec& s) {
  const Layout l = validate(s);
  const bool gpu = l.gpus_per_worker > 0;
  const bool ckpt = !s.checkpoint_pvc.empty();

  // Threads per rank: the pod's CPUs shared by its ranks (hardware_concurrency() would see the node's).
  int threads = 0;
  if (!s.cpu.empty()) threads = std::max(1, static_cast<int>(std::floor(quantity(s.cpu) / l.slots)));

  // Environment of every rank: set on the launcher, forwarded by mpirun -x.
  Json env = Json::array();
  env.push_back(env_var("TANDEM_PROGRESS_TTY", "0"));  // plain progress lines in the pod logs
  if (threads > 0) env.push_back(env_var("OMP_NUM_THREADS", std::to_string(threads)));
  if (gpu) env.push_back(env_var("NCCL_DEBUG", "WARN"));
  for (const auto& e : s.env) {
    const auto eq = e.find('=');
    Json var = env_var(e.substr(0, eq), e.substr(eq + 1));
    auto same = std::find_if(env.begin(), env.end(), [&](const Json& x) { return x["name"] == var["name"]; });
    if (same != env.end()) {
      *same = var;  // --env overrides a default
    } else {
      env.push_back(var);
    }
  }

  Json command = Json::array({"mpirun", "--allow-run-as-root", "-n", std::to_string(l.ranks()), "--bind-to", "none",
                              "--map-by", "slot", "--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp", "--mca",
                              "btl_vader_single_copy_mechanism", "none"});
  for (const auto& e : env) {
    command.push_back("-x");
    command.push_back(e["name"]);
  }
  command.push_back(s.tandem_path);
  command.push_back("train");
  command.push_back("--strategy");
  command.push_back(s.strategy);
  command.push_back("--device");
  command.push_back(gpu ? "cuda" : "cpu");
  if (threads > 0 && !has_train_flag(s.train_args, "--threads")) {
    command.push_back("--threads");
    command.push_back(std::to_string(threads));
  }
  if (ckpt) {
    command.push_back("--checkpoint-dir");
    command.push_back(kCheckpointMount);
    if (!has_train_flag(s.train_args, "--checkpoint-every")) {
      command.push_back("--checkpoint-every");
      command.push_back(std::to_string(s.checkpoint_every));
    }
    command.push_back("--resume");
  }
  for (const auto& a : s.train_args) command.push_back(a);

  Json ckpt_volume = {{"name", "checkpoints"}, {"persistentVolumeClaim", {{"claimName", s.checkpoint_pvc}}}};
  Json ckpt_mount = {{"name", "checkpoints"}, {"mountPath", kCheckpointMount}};

  // Launcher: mpirun only (the operator runs no rank there), so small requests and no GPU.
  Json launcher = {{"name", "launcher"},
                   {"image", s.image},
                   {"imagePullPolicy", "IfNotPresent"},
                   {"command", command},
                   {"env", env},
                   {"resources", {{"requests", {{"cpu", "500m"}, {"memory", "512Mi"}}}}}};
  Json launcher_spec = Json::object();
  placement(launcher_spec, s, false);
  if (ckpt) {
    launcher["volumeMounts"] = Json::array({ckpt_mount});
    launcher_spec["volumes"] = Json::array({ckpt_volume});
  }
  launcher_spec["containers"] = Json::array({launcher});

  // Workers: sshd in the foreground (the operator's convention); mpirun starts the ranks there.
  Json limits = Json::object(), requests = Json::object();
  if (gpu) limits["nvidia.com/gpu"] = std::to_string(l.gpus_per_worker);
  if (!s.cpu.empty()) limits["cpu"] = requests["cpu"] = s.cpu;
  if (!s.memory.empty()) limits["memory"] = requests["memory"] = s.memory;
  Json resources = Json::object();
  if (!requests.empty()) resources["requests"] = requests;
  if (!limits.empty()) resources["limits"] = limits;
  Json worker = {{"name", "worker"},
                 {"image", s.image},
                 {"imagePullPolicy", "IfNotPresent"},
                 {"command", {"/usr/sbin/sshd", "-De"}},
                 {"resources", resources}};
  Json mounts = Json::array({{{"name", "dshm"}, {"mountPath", "/dev/shm"}}});
  Json volumes = Json::array({{{"name", "dshm"}, {"emptyDir", {{"medium", "Memory"}, {"sizeLimit", s.shm_size}}}}});
  if (ckpt) {
    mounts.push_back(ckpt_mount);
    volumes.push_back(ckpt_volume);
  }
  worker["volumeMounts"] = mounts;
  Json worker_spec = Json::object();
  placement(worker_spec, s, true);
  worker_spec["volumes"] = volumes;
  worker_spec["containers"] = Json::array({worker});

  Json run_policy = {{"cleanPodPolicy", s.clean_pod_policy}, {"backoffLimit", s.backoff_limit}};
  return Json{{"apiVersion", "kubeflow.org/v2beta1"},
              {"kind", "MPIJob"},
              {"metadata", {{"name", s.name}, {"namespace", s.ns}, {"labels", labels(s, "job")}}},
              {"spec",
               {{"slotsPerWorker", l.slots},
                {"mpiImplementation", "OpenMPI"},
                {"sshAuthMountPath", "/root/.ssh"},
                {"launcherCreationPolicy", "WaitForWorkersReady"},
                {"runPolicy", run_policy},
                {"mpiReplicaSpecs",
                 {{"Launcher",
                   {{"replicas", 1},
                    {"restartPolicy", "OnFailure"},
                    {"template", {{"metadata", {{"labels", labels(s, "launcher")}}}, {"spec", launcher_spec}}}}},
                  {"Worker",
                   {{"replicas", l.workers},
                    {"restartPolicy", "OnFailure"},
                    {"template", {{"metadata", {{"labels", labels(s, "worker")}}}, {"spec", worker_spec}}}}}}}}}};
}

Json checkpoint_claim(const JobSpec& s) {
  validate(s);
  if (s.checkpoint_size.empty()) throw std::invalid_argument("checkpoint_claim needs --checkpoint-size");
  // ReadWriteMany: every worker pod, on its own node, writes its shards to the same directory.
  Json spec = {{"accessModes", {"ReadWriteMany"}}, {"resources", {{"requests", {{"storage", s.checkpoint_size}}}}}};
  if (!s.storage_class.empty()) spec["storageClassName"] = s.storage_class;
  return Json{{"apiVersion", "v1"},
              {"kind", "PersistentVolumeClaim"},
              {"metadata", {{"name", s.checkpoint_pvc}, {"namespace", s.ns}, {"labels", labels(s, "checkpoints")}}},
              {"spec", spec}};
}

std::vector<Json> manifests(const JobSpec& s) {
  std::vector<Json> docs;
  if (!s.checkpoint_size.empty()) docs.push_back(checkpoint_claim(s));
  docs.push_back(mpijob(s));
  return docs;
}

}  // namespace tandem::k8s
