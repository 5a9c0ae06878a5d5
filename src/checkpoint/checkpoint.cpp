// Sharded checkpoints (tandem/checkpoint.h): the manifest, the atomic save protocol, and
// loading with resharding through a full, per-parameter assembly of the state.
//
// Save (collective): rank 0 creates <root>/.tmp-step-N; every rank writes and fsyncs its
// shard there; the ranks agree that all writes succeeded (one all-reduce of a failure flag)
// and all-gather the shards' sizes and hashes; rank 0 writes and fsyncs the manifest, fsyncs
// the directory, renames it to <root>/step-N and fsyncs the root. A checkpoint exists exactly
// when step-N/manifest.json exists, so a crash at any point leaves the previous one loadable.
//
// Load (local, no collective, so a bad checkpoint fails every rank the same way without a
// hang): read the manifest, read every shard (size and FNV-1a hash checked first), assemble
// the full fp32 value and optimizer slots of every parameter from the layout (replicated:
// rank 0's file has them whole; ZeRO: a bucket is the concatenation of the ranks' chunks),
// validate against the target model, then copy in (ZeRO takes its chunks).
#include "tandem/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>

#include "checkpoint/shard_io.h"
#include "tandem/zero.h"

namespace tandem {
namespace {

using json = nlohmann::json;
constexpr const char* kFormat = "tandem-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kManifest = "manifest.json";

std::string step_name(int64_t step) {
  char b[32];
  std::snprintf(b, sizeof b, "step-%08lld", static_cast<long long>(step));
  return b;
}

std::string shard_name(int r, int n) {
  char b[48];
  std::snprintf(b, sizeof b, "shard-%05d-of-%05d.bin", r, n);
  return b;
}

bool parse_step_name(const std::string& n, int64_t* step) {
  if (n.size() < 6 || n.compare(0, 5, "step-") != 0) return false;
  for (size_t i = 5; i < n.size(); ++i)
    if (n[i] < '0' || n[i] > '9') return false;
  *step = std::stoll(n.substr(5));
  return true;
}

std::string optimizer_kind(const torch::optim::Optimizer& opt) {
  if (dynamic_cast<const torch::optim::AdamW*>(&opt)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&opt)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&opt)) return "sgd";
  throw std::invalid_argument("checkpoints support the SGD, Adam and AdamW optimizers only");
}

std::vector<at::Tensor> optimizer_params(const torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (auto& g : opt.param_groups())
    for (auto& p : g.params()) out.push_back(p);
  return out;
}

at::Tensor cpu_rng_state() {
  auto& g = at::detail::getDefaultCPUGenerator();
  return g.get_state();
}

void set_cpu_rng_state(const at::Tensor& t) {
  auto g = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(t);
}

json tensor_desc(const std::string& name, const at::Tensor& t) {
  return json{{"name", name}, {"shape", t.sizes().vec()}, {"dtype", c10::toString(t.scalar_type())}};
}

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

// Every rank learns whether any rank failed; the failing rank rethrows its own message.
void agree(Communicator& comm, const std::string& err, const std::string& what) {
  auto t = at::tensor({static_cast<int64_t>(err.empty() ? 0 : 1)}, at::kLong);
  comm.allreduce(t, ReduceOp::kSum);
  if (!err.empty()) throw std::runtime_error("rank " + std::to_string(comm.rank()) + ": " + err);
  if (t.item<int64_t>() > 0) {
    throw std::runtime_error("rank " + std::to_string(comm.rank()) + ": " + what + " failed on another rank (see its error); the previous checkpoints are untouched");
  }
}

struct SavePlan {
  CheckpointMeta meta;
  json params = json::array(), buffers = json::array(), layout;
  std::vector<std::string> slots;
  int64_t optimizer_step = 0;
  std::vector<std::pair<std::string, at::Tensor>> entries;  // this rank's shard
};

void prune(const std::string& root, int keep) {
  if (keep <= 0) return;
  std::vector<std::pair<int64_t, std::string>> done;
  for (auto& n : ckpt::list_dir(root)) {
    int64_t s = 0;
    if (parse_step_name(n, &s) && ckpt::exists(root + "/" + n + "/" + kManifest)) done.emplace_back(s, n);
  }
  std::sort(done.begin(), done.end());
  for (size_t i = 0; i + keep < done.size(); ++i) ckpt::remove_tree(root + "/" + done[i].second);
}

std::string save_impl(const std::string& root, SavePlan plan, Communicator& comm, const CheckpointSaveOptions& o) {
  const int rank = comm.rank(), world = comm.size();
  auto& meta = plan.meta;
  meta.world_size = world;
  const std::string name = step_name(meta.step);
  const std::string final_dir = root + "/" + name;
  const std::string tmp = root + "/.tmp-" + name;
  json extra;
  std::string err;
  try {
    extra = json::parse(meta.extra_json.empty() ? "{}" : meta.extra_json);
  } catch (const std::exception& e) {
    err = std::string("checkpoint extra_json is not valid JSON: ") + e.what();
  }
  if (rank == 0 && err.empty()) {
    try {
      ckpt::make_dirs(root);
      for (auto& n : ckpt::list_dir(root))  // leftovers of a save that was killed
        if (n.rfind(".tmp-", 0) == 0 || n.rfind(".old-", 0) == 0) ckpt::remove_tree(root + "/" + n);
      ckpt::make_dirs(tmp);
    } catch (const std::exception& e) {
      err = std::string("checkpoint save: ") + e.what();
    }
  }
  agree(comm, err, "preparing checkpoint directory '" + tmp + "'");

  ckpt::Digest d;
  try {
    d = ckpt::write_shard(tmp + "/" + shard_name(rank, world), plan.entries);
    if (o.on_stage) o.on_stage("shard-written");
  } catch (const std::exception& e) {
    err = std::string("checkpoint save: ") + e.what();
  }
  agree(comm, err, "writing the checkpoint shards");
  auto mine = at::tensor({d.bytes, static_cast<int64_t>(d.fnv1a64)}, at::kLong);
  auto all = at::empty({2 * world}, at::kLong);
  comm.allgather(all, mine);

  if (rank == 0) {
    try {
      json m;
      m["format"] = kFormat;
      m["version"] = kVersion;
      m["byte_order"] = "little";
      m["model"] = {{"name", meta.model}, {"description", meta.model_description}, {"parameters", plan.params},
                    {"buffers", plan.buffers}};
      m["strategy"] = meta.strategy;
      m["world_size"] = world;
      m["precision"] = meta.precision;
      m["optimizer"] = {{"kind", meta.optimizer}, {"step", plan.optimizer_step}, {"slots", plan.slots}};
      m["progress"] = {{"step", meta.step}, {"epoch", meta.epoch}, {"step_in_epoch", meta.step_in_epoch}};
      m["seed"] = meta.seed;
      m["loss_scaler"] = {{"scale", meta.loss_scale},
                          {"overflow_free_steps", meta.loss_scale_good_steps},
                          {"skipped_steps", meta.skipped_steps}};
      m["rng"] = {{"kind", "torch CPU generator state"}, {"entry", "rng/cpu"}, {"per_rank", true}};
      m["layout"] = plan.layout;
      json shards = json::array();
      auto h = all.accessor<int64_t, 1>();
      for (int r = 0; r < world; ++r) {
        shards.push_back({{"rank", r},
                          {"file", shard_name(r, world)},
                          {"bytes", h[2 * r]},
                          {"fnv1a64", ckpt::hex64(static_cast<uint64_t>(h[2 * r + 1]))}});
      }
      m["shards"] = shards;
      m["extra"] = extra;
      ckpt::write_synced(tmp + "/" + kManifest, m.dump(1) + "\n");
      ckpt::fsync_dir(tmp);
      if (o.on_stage) o.on_stage("manifest-written");
      const std::string old = root + "/.old-" + name;
      if (ckpt::exists(final_dir)) ckpt::rename_path(final_dir, old);  // saving the same step again
      ckpt::rename_path(tmp, final_dir);
      ckpt::fsync_dir(root);
      ckpt::remove_tree(old);
      prune(root, o.keep);
    } catch (const std::exception& e) {
      err = std::string("checkpoint save: ") + e.what();
    }
  } else if (o.on_stage) {
    o.on_stage("manifest-written");
  }
  agree(comm, err, "committing checkpoint '" + final_dir + "'");
  if (o.on_stage) o.on_stage("renamed");
  return final_dir;
}

// ---- reading

struct Manifest {
  std::string dir;
  json j;
  CheckpointMeta meta;
  std::vector<std::string> files;
  std::vector<ckpt::Digest> digests;
};

[[noreturn]] void bad_manifest(const std::string& path, const std::string& why) {
  throw std::runtime_error("checkpoint manifest '" + path + "' " + why);
}

Manifest read_manifest(const std::string& dir) {
  Manifest M;
  M.dir = dir;
  const std::string path = dir + "/" + kManifest;
  if (!ckpt::is_dir(dir)) throw std::runtime_error("checkpoint directory '" + dir + "' does not exist");
  if (!ckpt::exists(path)) {
    throw std::runtime_error("checkpoint '" + dir + "' has no " + kManifest +
                             " (missing file: an incomplete or damaged checkpoint)");
  }
  const std::string text = ckpt::read_all(path);
  try {
    M.j = json::parse(text);
  } catch (const std::exception& e) {
    bad_manifest(path, std::string("is not valid JSON (truncated or corrupted?): ") + e.what());
  }
  try {
    auto& j = M.j;
    if (!j.is_object() || j.value("format", "") != kFormat) bad_manifest(path, "is not a Tandem checkpoint manifest");
    if (j.at("version").get<int>() != kVersion) {
      bad_manifest(path, "has format version " + j.at("version").dump() + "; this build reads version " +
                             std::to_string(kVersion));
    }
    auto& meta = M.meta;
    meta.model = j.at("model").at("name").get<std::string>();
    meta.model_description = j.at("model").at("description").get<std::string>();
    meta.strategy = j.at("strategy").get<std::string>();
    meta.world_size = j.at("world_size").get<int>();
    meta.precision = j.at("precision").get<std::string>();
    meta.optimizer = j.at("optimizer").at("kind").get<std::string>();
    meta.step = j.at("progress").at("step").get<int64_t>();
    meta.epoch = j.at("progress").at("epoch").get<int64_t>();
    meta.step_in_epoch = j.at("progress").at("step_in_epoch").get<int64_t>();
    meta.seed = j.at("seed").get<uint64_t>();
    meta.loss_scale = j.at("loss_scaler").at("scale").get<double>();
    meta.loss_scale_good_steps = j.at("loss_scaler").at("overflow_free_steps").get<int64_t>();
    meta.skipped_steps = j.at("loss_scaler").at("skipped_steps").get<int64_t>();
    meta.extra_json = j.at("extra").dump();
    if (meta.world_size < 1) bad_manifest(path, "has world_size " + std::to_string(meta.world_size));
    if (meta.step < 0 || meta.epoch < 0 || meta.step_in_epoch < 0) bad_manifest(path, "has a negative progress");
    auto& shards = j.at("shards");
    if (!shards.is_array() || static_cast<int>(shards.size()) != meta.world_size) {
      bad_manifest(path, "lists " + std::to_string(shards.size()) + " shards for world size " +
                             std::to_string(meta.world_size));
    }
    for (int r = 0; r < meta.world_size; ++r) {
      auto& s = shards[r];
      if (s.at("rank").get<int>() != r) bad_manifest(path, "lists the shards out of rank order");
      auto file = s.at("file").get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file[0] == '.') {
        bad_manifest(path, "names an invalid shard file '" + file + "'");
      }
      ckpt::Digest d;
      d.bytes = s.at("bytes").get<int64_t>();
      d.fnv1a64 = std::stoull(s.at("fnv1a64").get<std::string>(), nullptr, 16);
      M.files.push_back(file);
      M.digests.push_back(d);
    }
    auto kind = j.at("layout").at("kind").get<std::string>();
    if (kind != "replicated" && kind != "zero") bad_manifest(path, "has an unknown layout '" + kind + "'");
  } catch (const nlohmann::json::exception& e) {
    bad_manifest(path, std::string("is missing a field or has one of the wrong type: ") + e.what());
  } catch (const std::invalid_argument& e) {
    bad_manifest(path, std::string("has an invalid value: ") + e.what());
  } catch (const std::out_of_range& e) {
    bad_manifest(path, std::string("has a value out of range: ") + e.what());
  }
  return M;
}

at::Tensor take(std::map<std::string, at::Tensor>& shard, const std::string& entry, const std::string& file) {
  auto it = shard.find(entry);
  if (it == shard.end()) {
    throw std::runtime_error("checkpoint shard '" + file + "' lacks the entry '" + entry +
                             "' that the manifest's layout requires");
  }
  return it->second;
}

at::Tensor shaped(const at::Tensor& t, const json& desc, const std::string& where) {
  auto shape = desc.at("shape").get<std::vector<int64_t>>();
  int64_t n = 1;
  for (auto s : shape) n *= s;
  if (t.numel() != n) {
    throw std::runtime_error(where + ": '" + desc.at("name").get<std::string>() + "' has " +
                             std::to_string(t.numel()) + " elements, the manifest's shape " + shape_str(shape) +
                             " needs " + std::to_string(n));
  }
  return t.reshape(shape);
}

FullCheckpoint assemble(const Manifest& M) {
  FullCheckpoint fc;
  fc.meta = M.meta;
  const int N = M.meta.world_size;
  std::vector<std::map<std::string, at::Tensor>> shards(N);
  std::vector<std::string> paths(N);
  for (int r = 0; r < N; ++r) {
    paths[r] = M.dir + "/" + M.files[r];
    shards[r] = ckpt::read_shard(paths[r], M.digests[r]);
  }
  const std::string mpath = M.dir + "/" + kManifest;
  try {
    const auto& j = M.j;
    auto slots = j.at("optimizer").at("slots").get<std::vector<std::string>>();
    const int64_t opt_step = j.at("optimizer").at("step").get<int64_t>();
    const auto& layout = j.at("layout");
    for (auto& p : j.at("model").at("parameters")) fc.param_names.push_back(p.at("name").get<std::string>());
    if (layout.at("kind") == "replicated") {
      for (auto& p : j.at("model").at("parameters")) {
        const auto n = p.at("name").get<std::string>();
        fc.params[n] = shaped(take(shards[0], "param/" + n, paths[0]), p, paths[0]);
        ParamOptimizerState s;
        s.step = opt_step;
        for (auto& sl : slots) s.slots[sl] = shaped(take(shards[0], sl + "/" + n, paths[0]), p, paths[0]);
        fc.optim[n] = std::move(s);
      }
    } else {
      const auto& buckets = layout.at("buckets");
      std::vector<std::map<std::string, at::Tensor>> full(buckets.size());
      std::vector<std::string> all_slots = slots;
      all_slots.insert(all_slots.begin(), "param");
      for (size_t b = 0; b < buckets.size(); ++b) {
        const int64_t padded = buckets[b].at("padded").get<int64_t>();
        const int64_t chunk = buckets[b].at("chunk").get<int64_t>();
        if (chunk * N != padded || padded < 0) bad_manifest(mpath, "has bucket " + std::to_string(b) + " with chunk " + std::to_string(chunk) + " x " + std::to_string(N) + " ranks != padded " + std::to_string(padded));
        for (auto& sl : all_slots) {
          std::vector<at::Tensor> parts;
          for (int r = 0; r < N; ++r) {
            auto t = take(shards[r], "bucket" + std::to_string(b) + "/" + sl, paths[r]);
            if (t.numel() != chunk) {
              throw std::runtime_error("checkpoint shard '" + paths[r] + "': bucket " + std::to_string(b) + " '" + sl +
                                       "' has " + std::to_string(t.numel()) + " elements, the manifest says " +
                                       std::to_string(chunk));
            }
            parts.push_back(t.reshape({-1}));
          }
          full[b][sl] = at::cat(parts);
        }
      }
      for (auto& p : layout.at("params")) {
        const auto n = p.at("name").get<std::string>();
        const auto b = p.at("bucket").get<size_t>();
        const auto off = p.at("offset").get<int64_t>(), numel = p.at("numel").get<int64_t>();
        if (b >= full.size() || off < 0 || numel < 0 || off + numel > full[b]["param"].numel()) {
          bad_manifest(mpath, "places parameter '" + n + "' outside its bucket");
        }
        json desc;
        for (auto& d : j.at("model").at("parameters"))
          if (d.at("name") == n) desc = d;
        if (desc.is_null()) bad_manifest(mpath, "lays out parameter '" + n + "' that the model does not list");
        fc.params[n] = shaped(full[b]["param"].narrow(0, off, numel).clone(), desc, mpath);
        ParamOptimizerState s;
        s.step = opt_step;
        for (auto& sl : slots) s.slots[sl] = shaped(full[b][sl].narrow(0, off, numel).clone(), desc, mpath);
        fc.optim[n] = std::move(s);
      }
      for (auto& n : fc.param_names)
        if (!fc.params.count(n)) bad_manifest(mpath, "lists parameter '" + n + "' but lays out no place for it");
    }
    for (auto& b : j.at("model").at("buffers")) {
      const auto n = b.at("name").get<std::string>();
      fc.buffers[n] = shaped(take(shards[0], "buffer/" + n, paths[0]), b, paths[0]);
    }
    for (int r = 0; r < N; ++r) fc.rng.push_back(take(shards[r], "rng/cpu", paths[r]));
  } catch (const nlohmann::json::exception& e) {
    bad_manifest(mpath, std::string("is missing a field or has one of the wrong type: ") + e.what());
  }
  return fc;
}

// Checks that the checkpoint fits the target before anything is changed.
void check_fits(const FullCheckpoint& fc, const std::string& dir, const CheckpointLoadOptions& o,
                const std::vector<std::pair<std::string, at::Tensor>>& params,
                const std::vector<std::pair<std::string, at::Tensor>>& buffers, const std::string& opt_kind) {
  const std::string where = "checkpoint '" + dir + "'";
  if (!o.expect_model.empty() && fc.meta.model != o.expect_model) {
    throw std::runtime_error(where + " is of model '" + fc.meta.model + "', not '" + o.expect_model +
                             "'; pass the matching --model or another checkpoint directory");
  }
  if (fc.meta.optimizer != opt_kind) {
    throw std::runtime_error(where + " holds " + fc.meta.optimizer + " optimizer state; this run uses " + opt_kind);
  }
  for (auto& [n, p] : params) {
    auto it = fc.params.find(n);
    if (it == fc.params.end()) {
      throw std::runtime_error(where + " does not fit this model (" + fc.meta.model + " in the checkpoint): it has no parameter '" + n + "'");
    }
    if (it->second.sizes() != p.sizes()) {
      throw std::runtime_error(where + " does not fit this model: parameter '" + n + "' has shape " +
                               shape_str(it->second.sizes()) + " there, " + shape_str(p.sizes()) + " here");
    }
  }
  if (fc.params.size() != params.size()) {
    throw std::runtime_error(where + " does not fit this model: it has " + std::to_string(fc.params.size()) +
                             " parameters, the model " + std::to_string(params.size()));
  }
  for (auto& [n, b] : buffers) {
    auto it = fc.buffers.find(n);
    if (it == fc.buffers.end() || it->second.sizes() != b.sizes()) {
      throw std::runtime_error(where + " does not fit this model: buffer '" + n + "' is missing or misshapen");
    }
  }
}

void finish_load(const FullCheckpoint& fc, const std::vector<std::pair<std::string, at::Tensor>>& buffers, int rank,
                 const CheckpointLoadOptions& o) {
  torch::NoGradGuard ng;
  for (auto& [n, b] : buffers) b.copy_(fc.buffers.at(n));
  if (o.restore_rng && !fc.rng.empty()) {
    set_cpu_rng_state(fc.rng[rank >= 0 && rank < static_cast<int>(fc.rng.size()) ? rank : 0]);
  }
}

std::vector<std::pair<std::string, at::Tensor>> named_buffers(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& kv : m.named_buffers(true)) out.emplace_back(kv.key(), kv.value());
  return out;
}

}  // namespace

std::string save_checkpoint(const std::string& root, CheckpointMeta meta, torch::nn::Module& model,
                            torch::optim::Optimizer& opt, Communicator& comm, const CheckpointSaveOptions& o) {
  SavePlan plan;
  meta.optimizer = optimizer_kind(opt);
  plan.meta = meta;
  auto named = model.named_parameters(true);
  auto ops = optimizer_params(opt);
  if (ops.size() != named.size()) {
    throw std::invalid_argument("save_checkpoint: the optimizer has " + std::to_string(ops.size()) +
                                " parameters, the module " + std::to_string(named.size()) +
                                "; pass the optimizer over the module's parameters (or their masters)");
  }
  std::set<std::string> slots;
  size_t i = 0;
  for (auto& kv : named) {
    const auto& src = ops[i++];
    plan.params.push_back(tensor_desc(kv.key(), src));
    auto st = get_param_state(opt, src);
    plan.optimizer_step = std::max(plan.optimizer_step, st.step);
    for (auto& [k, v] : st.slots) {
      slots.insert(k);
      if (comm.rank() == 0) plan.entries.emplace_back(k + "/" + kv.key(), v);
    }
    if (comm.rank() == 0) plan.entries.emplace_back("param/" + kv.key(), src);
  }
  plan.slots.assign(slots.begin(), slots.end());
  for (auto& [n, b] : named_buffers(model)) {
    plan.buffers.push_back(tensor_desc(n, b));
    if (comm.rank() == 0) plan.entries.emplace_back("buffer/" + n, b);
  }
  plan.entries.emplace_back("rng/cpu", cpu_rng_state());
  plan.layout = {{"kind", "replicated"}, {"owner", 0}};
  return save_impl(root, std::move(plan), comm, o);
}

std::string save_checkpoint(const std::string& root, CheckpointMeta meta, ZeroDataParallel& zero, Communicator& comm,
                            const CheckpointSaveOptions& o) {
  SavePlan plan;
  meta.optimizer = optimizer_kind(zero.optimizer());
  plan.meta = meta;
  const auto st = zero.shard_state();
  json params = json::array(), buckets = json::array();
  for (auto& p : st.params) {
    const auto& master = st.buckets.at(p.bucket).slots.at("param");
    plan.params.push_back({{"name", p.name}, {"shape", p.shape}, {"dtype", c10::toString(master.scalar_type())}});
    params.push_back({{"name", p.name}, {"bucket", p.bucket}, {"offset", p.offset}, {"numel", p.numel}});
  }
  std::set<std::string> slots;
  for (size_t b = 0; b < st.buckets.size(); ++b) {
    const auto& bk = st.buckets[b];
    buckets.push_back({{"numel", bk.numel}, {"padded", bk.padded}, {"chunk", bk.chunk}});
    for (auto& [k, v] : bk.slots) {
      if (k != "param") slots.insert(k);
      plan.entries.emplace_back("bucket" + std::to_string(b) + "/" + k, v);
    }
  }
  plan.optimizer_step = st.optimizer_step;
  plan.slots.assign(slots.begin(), slots.end());
  for (auto& [n, b] : named_buffers(zero.module())) {
    plan.buffers.push_back(tensor_desc(n, b));
    if (comm.rank() == 0) plan.entries.emplace_back("buffer/" + n, b);
  }
  plan.entries.emplace_back("rng/cpu", cpu_rng_state());
  plan.layout = {{"kind", "zero"}, {"stage", st.stage}, {"buckets", buckets}, {"params", params}};
  return save_impl(root, std::move(plan), comm, o);
}

std::string latest_checkpoint(const std::string& root) {
  int64_t best = -1;
  std::string out;
  for (auto& n : ckpt::list_dir(root)) {
    int64_t s = 0;
    if (parse_step_name(n, &s) && s > best && ckpt::exists(root + "/" + n + "/" + kManifest)) {
      best = s;
      out = root + "/" + n;
    }
  }
  return out;
}

CheckpointMeta read_checkpoint_meta(const std::string& dir) { return read_manifest(dir).meta; }

FullCheckpoint read_full_checkpoint(const std::string& dir) { return assemble(read_manifest(dir)); }

CheckpointMeta load_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& opt, int rank,
                               const CheckpointLoadOptions& o) {
  auto fc = read_full_checkpoint(dir);
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (auto& kv : model.named_parameters(true)) params.emplace_back(kv.key(), kv.value());
  auto ops = optimizer_params(opt);
  if (ops.size() != params.size()) {
    throw std::invalid_argument("load_checkpoint: the optimizer has " + std::to_string(ops.size()) +
                                " parameters, the module " + std::to_string(params.size()));
  }
  auto buffers = named_buffers(model);
  check_fits(fc, dir, o, params, buffers, optimizer_kind(opt));
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& v = fc.params.at(params[i].first);
      ops[i].copy_(v);
      if (!ops[i].is_same(params[i].second)) params[i].second.copy_(v);
      set_param_state(opt, ops[i], fc.optim.at(params[i].first));
    }
  }
  finish_load(fc, buffers, rank, o);
  return fc.meta;
}

CheckpointMeta load_checkpoint(const std::string& dir, ZeroDataParallel& zero, int rank,
                               const CheckpointLoadOptions& o) {
  auto fc = read_full_checkpoint(dir);
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (auto& p : zero.shard_state().params) params.emplace_back(p.name, at::empty(p.shape));
  auto buffers = named_buffers(zero.module());
  check_fits(fc, dir, o, params, buffers, optimizer_kind(zero.optimizer()));
  zero.load_full_state(fc.params, fc.optim);
  zero.restore_loss_scaler(fc.meta.loss_scale, fc.meta.loss_scale_good_steps, fc.meta.skipped_steps);
  finish_load(fc, buffers, rank, o);
  return fc.meta;
}

}  // namespace tandem
