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
// hang): parse and validate the manifest (checkpoint/manifest.cpp), read every shard (size
// and FNV-1a hash checked first), assemble the full fp32 value and optimizer slots of every
// parameter from the layout (replicated: rank 0's file has them whole; stages: each stage's
// writer has its parameters whole; ZeRO: a bucket is the concatenation of the ranks' chunks),
// validate against the target model, then copy in (ZeRO takes its chunks, a pipeline stage
// its parameters).
#include "tandem/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "checkpoint/shard_io.h"
#include "tandem/pipeline.h"
#include "tandem/tensor_parallel.h"
#include "tandem/trace.h"
#include "tandem/zero.h"

namespace tandem {
namespace {

using json = nlohmann::json;
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
    throw std::runtime_error("rank " + std::to_string(comm.rank()) + ": " + what +
                             " failed on another rank (see its error); the previous checkpoints are untouched");
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

// What committing a save needs once the shards are written.
struct Commit {
  std::string root, final_dir, tmp, shard;
  json manifest;  // all but "shards"
  int keep = 0;
  std::function<void(const std::string&)> on_stage;
};

json manifest_of(const SavePlan& plan, const json& extra) {
  const auto& meta = plan.meta;
  json m;
  m["format"] = ckpt::kManifestFormat;
  m["version"] = ckpt::kManifestVersion;
  m["byte_order"] = "little";
  m["model"] = {{"name", meta.model},
                {"description", meta.model_description},
                {"parameters", plan.params},
                {"buffers", plan.buffers}};
  m["strategy"] = meta.strategy;
  m["world_size"] = meta.world_size;
  m["precision"] = meta.precision;
  m["optimizer"] = {{"kind", meta.optimizer}, {"step", plan.optimizer_step}, {"slots", plan.slots}};
  m["progress"] = {{"step", meta.step}, {"epoch", meta.epoch}, {"step_in_epoch", meta.step_in_epoch}};
  m["seed"] = meta.seed;
  m["loss_scaler"] = {{"scale", meta.loss_scale},
                      {"overflow_free_steps", meta.loss_scale_good_steps},
                      {"skipped_steps", meta.skipped_steps}};
  m["rng"] = {{"kind", "torch CPU generator state"}, {"entry", "rng/cpu"}, {"per_rank", true}};
  m["layout"] = plan.layout;
  m["extra"] = extra;
  return m;
}

// Collective: rank 0 makes an empty <root>/.tmp-step-N (removing what killed saves left).
Commit prepare_save(const std::string& root, SavePlan& plan, Communicator& comm, const CheckpointSaveOptions& o) {
  const int rank = comm.rank(), world = comm.size();
  plan.meta.world_size = world;
  const std::string name = step_name(plan.meta.step);
  Commit c;
  c.root = root;
  c.final_dir = root + "/" + name;
  c.tmp = root + "/.tmp-" + name;
  c.shard = c.tmp + "/" + shard_name(rank, world);
  c.keep = o.keep;
  c.on_stage = o.on_stage;
  json extra;
  std::string err;
  try {
    extra = json::parse(plan.meta.extra_json.empty() ? "{}" : plan.meta.extra_json);
    if (!extra.is_object()) err = "checkpoint extra_json must be a JSON object, not " + extra.dump();
  } catch (const std::exception& e) {
    err = std::string("checkpoint extra_json is not valid JSON: ") + e.what();
  }
  if (rank == 0 && err.empty()) {
    try {
      ckpt::make_dirs(root);
      for (auto& n : ckpt::list_dir(root))  // leftovers of a save that was killed
        if (n.rfind(".tmp-", 0) == 0 || n.rfind(".old-", 0) == 0) ckpt::remove_tree(root + "/" + n);
      ckpt::make_dirs(c.tmp);
    } catch (const std::exception& e) {
      err = std::string("checkpoint save: ") + e.what();
    }
  }
  agree(comm, err, "preparing checkpoint directory '" + c.tmp + "'");
  if (rank == 0) c.manifest = manifest_of(plan, extra);
  return c;
}

// This rank's shard; an error is returned, for the ranks to agree on.
std::string write_own_shard(const Commit& c, const std::vector<std::pair<std::string, at::Tensor>>& entries,
                            ckpt::Digest* d) {
  try {
    trace::Span span("checkpoint write", "checkpoint");
    *d = ckpt::write_shard(c.shard, entries);
    span.arg("bytes", d->bytes);
    if (c.on_stage) c.on_stage("shard-written");
  } catch (const std::exception& e) {
    return std::string("checkpoint save: ") + e.what();
  }
  return "";
}

// Collective: the ranks agree that every shard was written, rank 0 writes the manifest with
// every shard's size and checksum and renames the directory into place.
std::string commit_save(Commit& c, const ckpt::Digest& d, std::string err, Communicator& comm) {
  const int rank = comm.rank(), world = comm.size();
  agree(comm, err, "writing the checkpoint shards");
  auto mine = at::tensor({d.bytes, static_cast<int64_t>(d.fnv1a64)}, at::kLong);
  auto all = at::empty({2 * world}, at::kLong);
  comm.allgather(all, mine);

  if (rank == 0) {
    try {
      json shards = json::array();
      auto h = all.accessor<int64_t, 1>();
      for (int r = 0; r < world; ++r) {
        shards.push_back({{"rank", r},
                          {"file", shard_name(r, world)},
                          {"bytes", h[2 * r]},
                          {"fnv1a64", ckpt::hex64(static_cast<uint64_t>(h[2 * r + 1]))}});
      }
      c.manifest["shards"] = shards;
      ckpt::write_synced(c.tmp + "/" + kManifest, c.manifest.dump(1) + "\n");
      ckpt::fsync_dir(c.tmp);
      if (c.on_stage) c.on_stage("manifest-written");
      const std::string old = c.root + "/.old-" + c.final_dir.substr(c.root.size() + 1);
      if (ckpt::exists(c.final_dir)) ckpt::rename_path(c.final_dir, old);  // saving the same step again
      ckpt::rename_path(c.tmp, c.final_dir);
      ckpt::fsync_dir(c.root);
      ckpt::remove_tree(old);
      prune(c.root, c.keep);
    } catch (const std::exception& e) {
      err = std::string("checkpoint save: ") + e.what();
    }
  } else if (c.on_stage) {
    c.on_stage("manifest-written");
  }
  agree(comm, err, "committing checkpoint '" + c.final_dir + "'");
  if (c.on_stage) c.on_stage("renamed");
  return c.final_dir;
}

}  // namespace

struct AsyncCheckpoint::State {
  Commit commit;
  std::vector<std::pair<std::string, at::Tensor>> entries;  // copies, owned by the writer
  std::thread writer;
  std::atomic<bool> done{false};
  bool pending = false;
  ckpt::Digest digest;
  std::string err;

  void join() {
    if (writer.joinable()) writer.join();
  }
};

AsyncCheckpoint::AsyncCheckpoint() : s_(std::make_unique<State>()) {}
AsyncCheckpoint::~AsyncCheckpoint() { s_->join(); }
bool AsyncCheckpoint::pending() const { return s_->pending; }
bool AsyncCheckpoint::written() const { return !s_->pending || s_->done.load(); }

bool AsyncCheckpoint::all_written(Communicator& comm) const {
  auto t = at::tensor({static_cast<int64_t>(written() ? 0 : 1)}, at::kLong);
  comm.allreduce(t, ReduceOp::kSum);
  return t.item<int64_t>() == 0;
}

std::string AsyncCheckpoint::finish(Communicator& comm) {
  if (!s_->pending) throw std::logic_error("AsyncCheckpoint::finish: no save in flight");
  s_->join();
  s_->pending = false;
  s_->entries.clear();
  return commit_save(s_->commit, s_->digest, s_->err, comm);
}

// The save's friend: starts the writer over copies of the shard's tensors.
struct AsyncCheckpointAccess {
  static void start(AsyncCheckpoint& a, Commit c, std::vector<std::pair<std::string, at::Tensor>> entries) {
    auto& s = *a.s_;
    s.commit = std::move(c);
    s.entries = std::move(entries);
    for (auto& e : s.entries) e.second = e.second.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    s.done = false;
    s.err.clear();
    s.digest = {};
    s.pending = true;
    s.writer = std::thread([&s] {
      trace::name_thread("checkpoint writer");
      s.err = write_own_shard(s.commit, s.entries, &s.digest);
      s.done = true;
    });
  }
};

namespace {

std::string save_impl(const std::string& root, SavePlan plan, Communicator& comm, const CheckpointSaveOptions& o) {
  if (o.async && o.async->pending()) {
    throw std::invalid_argument("checkpoint save: the AsyncCheckpoint handle has a save in flight; finish() it first");
  }
  Commit c = prepare_save(root, plan, comm, o);
  if (o.async) {
    AsyncCheckpointAccess::start(*o.async, std::move(c), std::move(plan.entries));
    return root + "/" + step_name(plan.meta.step);
  }
  ckpt::Digest d;
  std::string err = write_own_shard(c, plan.entries, &d);
  return commit_save(c, d, std::move(err), comm);
}

std::vector<std::pair<std::string, at::Tensor>> named_buffers(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& kv : m.named_buffers(true)) out.emplace_back(kv.key(), kv.value());
  return out;
}

// Parameters (from the optimizer's tensors: fp32 masters when mixed precision), optimizer
// slots and buffers of `model`, each whole, as entries of this rank's shard when `write`; the
// descriptions and the RNG entry in any case.
SavePlan whole_tensors_plan(const CheckpointMeta& meta, torch::nn::Module& model, torch::optim::Optimizer& opt,
                            bool write) {
  SavePlan plan;
  plan.meta = meta;
  plan.meta.optimizer = optimizer_kind(opt);
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
      if (write) plan.entries.emplace_back(k + "/" + kv.key(), v);
    }
    if (write) plan.entries.emplace_back("param/" + kv.key(), src);
  }
  plan.slots.assign(slots.begin(), slots.end());
  for (auto& [n, b] : named_buffers(model)) {
    plan.buffers.push_back(tensor_desc(n, b));
    if (write) plan.entries.emplace_back("buffer/" + n, b);
  }
  plan.entries.emplace_back("rng/cpu", cpu_rng_state());
  return plan;
}

// ---- reading

struct Manifest : ckpt::Manifest {
  std::string dir;
};

Manifest read_manifest(const std::string& dir) {
  const std::string path = dir + "/" + kManifest;
  if (!ckpt::is_dir(dir)) throw std::runtime_error("checkpoint directory '" + dir + "' does not exist");
  if (!ckpt::exists(path)) {
    throw std::runtime_error("checkpoint '" + dir + "' has no " + kManifest +
                             " (missing file: an incomplete or damaged checkpoint)");
  }
  Manifest M;
  static_cast<ckpt::Manifest&>(M) = ckpt::parse_manifest(ckpt::read_all(path), path);
  M.dir = dir;
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

// The manifest has validated the shapes; the shard's entry must have as many elements.
at::Tensor shaped(const at::Tensor& t, const ckpt::TensorDesc& desc, const std::string& where) {
  if (t.numel() != desc.numel) {
    throw std::runtime_error(where + ": '" + desc.name + "' has " + std::to_string(t.numel()) +
                             " elements, the manifest's shape " + shape_str(desc.shape) + " needs " +
                             std::to_string(desc.numel));
  }
  return t.reshape(desc.shape);
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
  for (auto& p : M.params) fc.param_names.push_back(p.name);
  if (M.layout != ckpt::LayoutKind::kZero) {
    // Each parameter whole in its owner's shard (replicated: one owner; stages: its stage's writer).
    for (size_t i = 0; i < M.params.size(); ++i) {
      const auto& p = M.params[i];
      const int r = M.param_owner[i];
      fc.params[p.name] = shaped(take(shards[r], "param/" + p.name, paths[r]), p, paths[r]);
      ParamOptimizerState s;
      s.step = M.optimizer_step;
      for (auto& sl : M.slots) s.slots[sl] = shaped(take(shards[r], sl + "/" + p.name, paths[r]), p, paths[r]);
      fc.optim[p.name] = std::move(s);
    }
  } else {
    std::vector<std::map<std::string, at::Tensor>> full(M.buckets.size());
    std::vector<std::string> all_slots = M.slots;
    all_slots.insert(all_slots.begin(), "param");
    for (size_t b = 0; b < M.buckets.size(); ++b) {
      const int64_t chunk = M.buckets[b].chunk;
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
    for (size_t i = 0; i < M.params.size(); ++i) {
      const auto& p = M.params[i];
      auto& bucket = full[M.param_bucket[i]];
      const int64_t off = M.param_offset[i];
      fc.params[p.name] = shaped(bucket["param"].narrow(0, off, p.numel).clone(), p, mpath);
      ParamOptimizerState s;
      s.step = M.optimizer_step;
      for (auto& sl : M.slots) s.slots[sl] = shaped(bucket[sl].narrow(0, off, p.numel).clone(), p, mpath);
      fc.optim[p.name] = std::move(s);
    }
  }
  for (size_t i = 0; i < M.buffers.size(); ++i) {
    const int r = M.buffer_owner[i];
    fc.buffers[M.buffers[i].name] =
        shaped(take(shards[r], "buffer/" + M.buffers[i].name, paths[r]), M.buffers[i], paths[r]);
  }
  for (int r = 0; r < N; ++r) fc.rng.push_back(take(shards[r], "rng/cpu", paths[r]));
  return fc;
}

// Checks that the checkpoint fits the target before anything is changed.
void check_fits(const FullCheckpoint& fc, const std::string& dir, const CheckpointLoadOptions& o,
                const std::vector<std::pair<std::string, at::Tensor>>& params,
                const std::vector<std::pair<std::string, at::Tensor>>& buffers, const std::string& opt_kind,
                bool whole_model = true) {
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
      throw std::runtime_error(where + " does not fit this model (" + fc.meta.model +
                               " in the checkpoint): it has no parameter '" + n + "'");
    }
    if (it->second.sizes() != p.sizes()) {
      throw std::runtime_error(where + " does not fit this model: parameter '" + n + "' has shape " +
                               shape_str(it->second.sizes()) + " there, " + shape_str(p.sizes()) + " here");
    }
  }
  if (whole_model && fc.params.size() != params.size()) {
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

// Loads whole parameters, optimizer state and buffers into `model` (the whole model, or with
// !whole_model a part of it such as a pipeline stage, whose names are the whole model's).
CheckpointMeta load_whole_tensors(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& opt,
                                  int rank, const CheckpointLoadOptions& o, bool whole_model) {
  auto fc = read_full_checkpoint(dir);
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (auto& kv : model.named_parameters(true)) params.emplace_back(kv.key(), kv.value());
  auto ops = optimizer_params(opt);
  if (ops.size() != params.size()) {
    throw std::invalid_argument("load_checkpoint: the optimizer has " + std::to_string(ops.size()) +
                                " parameters, the module " + std::to_string(params.size()));
  }
  auto buffers = named_buffers(model);
  check_fits(fc, dir, o, params, buffers, optimizer_kind(opt), whole_model);
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

}  // namespace

std::string save_checkpoint(const std::string& root, CheckpointMeta meta, torch::nn::Module& model,
                            torch::optim::Optimizer& opt, Communicator& comm, const CheckpointSaveOptions& o) {
  SavePlan plan = whole_tensors_plan(meta, model, opt, comm.rank() == 0);
  plan.layout = {{"kind", "replicated"}, {"owner", 0}};
  return save_impl(root, std::move(plan), comm, o);
}

namespace {
// ZeRO's values and optimizer slots whole (the ranks' chunks over `dp`, gathered on `dev`, which
// a CUDA communicator needs), by parameter name.
struct WholeState {
  std::map<std::string, at::Tensor> params;
  std::map<std::string, std::map<std::string, at::Tensor>> slots;  // slot -> name -> tensor
  int64_t step = 0;
};

WholeState gather_zero(ZeroDataParallel& zero, Communicator& dp, at::Device dev, const char* who) {
  const auto st = zero.shard_state();
  if (st.world_size != dp.size()) {
    throw std::invalid_argument(std::string(who) + ": ZeRO shards over " + std::to_string(st.world_size) +
                                " ranks, the data-parallel communicator has " + std::to_string(dp.size()) +
                                "; pass the communicator ZeRO was built over");
  }
  std::vector<std::map<std::string, at::Tensor>> whole(st.buckets.size());
  for (size_t b = 0; b < st.buckets.size(); ++b) {
    for (auto& [k, chunk] : st.buckets[b].slots) {
      auto in = chunk.reshape({-1}).to(dev).contiguous();
      auto out = at::empty({dp.size() * in.numel()}, in.options());
      dp.allgather(out, in);
      whole[b][k] = out.cpu();
    }
  }
  WholeState w;
  w.step = st.optimizer_step;
  for (auto& p : st.params) {
    for (auto& [k, flat] : whole.at(p.bucket)) {
      auto t = flat.narrow(0, p.offset, p.numel).reshape(p.shape).clone();
      if (k == "param") w.params[p.name] = t;
      else w.slots[k][p.name] = t;
    }
  }
  return w;
}

// A pipeline checkpoint from each rank's plan of its stage (whole tensors; entries only on the
// writers, one per stage): the manifest records which rank holds what.
std::string save_stages(const std::string& root, SavePlan mine, const Pipeline& pipe, bool writer, Communicator& comm,
                        const CheckpointSaveOptions& o) {
  // Every rank learns what each writer holds (one string per rank: "" from the others).
  json what;
  if (writer) {
    what = {{"stage", pipe.stage()},
            {"params", mine.params},
            {"buffers", mine.buffers},
            {"slots", mine.slots},
            {"step", mine.optimizer_step}};
  }
  auto all = allgather_strings(comm, writer ? what.dump() : std::string());
  std::vector<int> writer_of(pipe.stages(), -1);
  std::string err;
  std::vector<json> got(all.size());
  for (size_t r = 0; r < all.size() && err.empty(); ++r) {
    if (all[r].empty()) continue;
    got[r] = json::parse(all[r]);
    const int s = got[r].at("stage").get<int>();
    if (s < 0 || s >= pipe.stages() || writer_of[s] >= 0) {
      err = "pipeline checkpoint: ranks " + std::to_string(s >= 0 && s < pipe.stages() ? writer_of[s] : -1) + " and " +
            std::to_string(r) + " both write stage " + std::to_string(s) + "; pass writer=true on one rank per stage";
    } else {
      writer_of[s] = static_cast<int>(r);
    }
  }
  for (int s = 0; s < pipe.stages() && err.empty(); ++s) {
    if (writer_of[s] < 0)
      err =
          "pipeline checkpoint: no rank writes stage " + std::to_string(s) + "; pass writer=true on one rank per stage";
  }
  if (!err.empty()) throw std::invalid_argument(err);  // every rank saw the same strings
  SavePlan plan;
  plan.meta = mine.meta;
  plan.entries = std::move(mine.entries);
  json owned_params = json::array(), owned_buffers = json::array();
  std::set<std::string> slots;
  for (int s = 0; s < pipe.stages(); ++s) {
    const int r = writer_of[s];
    const auto& g = got[r];
    for (auto& p : g.at("params")) {
      plan.params.push_back(p);
      owned_params.push_back({{"name", p.at("name")}, {"rank", r}});
    }
    for (auto& b : g.at("buffers")) {
      plan.buffers.push_back(b);
      owned_buffers.push_back({{"name", b.at("name")}, {"rank", r}});
    }
    for (auto& sl : g.at("slots")) slots.insert(sl.get<std::string>());
    plan.optimizer_step = std::max(plan.optimizer_step, g.at("step").get<int64_t>());
  }
  plan.slots.assign(slots.begin(), slots.end());
  plan.layout = {{"kind", "stages"},
                 {"partition", pipe.partition()},
                 {"params", owned_params},
                 {"buffers", owned_buffers}};
  return save_impl(root, std::move(plan), comm, o);
}
}  // namespace

std::string detail::save_checkpoint(const std::string& root, CheckpointMeta meta, const Pipeline& pipe,
                                    torch::optim::Optimizer& opt, bool writer, Communicator& comm,
                                    const CheckpointSaveOptions& o) {
  auto stage = pipe.stage_module();
  return save_stages(root, whole_tensors_plan(meta, *stage, opt, writer), pipe, writer, comm, o);
}

std::string detail::save_checkpoint(const std::string& root, CheckpointMeta meta, const Pipeline& pipe,
                                    ZeroDataParallel& zero, const CommPtr& dp, Communicator& comm,
                                    const CheckpointSaveOptions& o) {
  const char* who = "save_checkpoint";
  if (!dp) throw std::invalid_argument("save_checkpoint: no data-parallel communicator given for the pipeline's ZeRO");
  const bool writer = dp->rank() == 0;
  SavePlan mine;
  mine.meta = meta;
  mine.meta.optimizer = optimizer_kind(zero.optimizer());
  auto ps = pipe.parameters();
  const auto whole = gather_zero(zero, *dp, ps.empty() ? at::Device(at::kCPU) : ps.front().device(), who);
  for (auto& p : zero.shard_state().params) {
    const auto& value = whole.params.at(p.name);
    mine.params.push_back(tensor_desc(p.name, value));
    if (!writer) continue;
    mine.entries.emplace_back("param/" + p.name, value);
    for (auto& [k, field] : whole.slots) mine.entries.emplace_back(k + "/" + p.name, field.at(p.name));
  }
  for (auto& [k, field] : whole.slots) mine.slots.push_back(k);
  mine.optimizer_step = whole.step;
  for (auto& [n, b] : named_buffers(zero.module())) {
    mine.buffers.push_back(tensor_desc(n, b));
    if (writer) mine.entries.emplace_back("buffer/" + n, b);
  }
  mine.entries.emplace_back("rng/cpu", cpu_rng_state());
  return save_stages(root, std::move(mine), pipe, writer, comm, o);
}

std::string detail::save_checkpoint(const std::string& root, CheckpointMeta meta, ZeroDataParallel& zero,
                                    Communicator& comm, const CheckpointSaveOptions& o) {
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

namespace {
// Names "i.key" of the parameters (or buffers) of children [first, end) of a Sequential, as the
// whole model and a pipeline's stage module call them, with the tensors, in parameters() order.
std::vector<std::pair<std::string, at::Tensor>> named_range(torch::nn::Sequential m, int64_t first, int64_t end,
                                                            bool buffers) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int64_t i = first; i < end; ++i) {
    auto c = m->ptr(i);
    for (auto& kv : buffers ? c->named_buffers(true) : c->named_parameters(true))
      out.emplace_back(std::to_string(i) + "." + kv.key(), kv.value());
  }
  return out;
}

// What a tensor-parallel rank trains, resolved: the children range, the trained parameters by
// name, and the scratch pair through which shards become whole values (tp::gather_to_dense) and
// whole values shards (tp::tensor_parallel, as the model was cut).
struct TpView {
  torch::nn::Sequential parallel, dense;
  int64_t first = 0, end = 0;
  std::vector<std::pair<std::string, at::Tensor>> trained;  // in the optimizer's order
  std::string optimizer;                                    // its kind
};

TpView tp_view(const TensorParallelState& s, const char* who) {
  auto bad = [&](const std::string& what) { throw std::invalid_argument(std::string(who) + ": " + what); };
  if (!s.parallel || !s.dense) bad("no model given");
  if (!s.tp) bad("no tensor-parallel communicator given");
  if ((s.opt == nullptr) == (s.zero == nullptr)) bad("give the optimizer or ZeRO (one of them)");
  if ((s.zero || s.pipe) && !s.dp) bad("ZeRO and pipelines need the data-parallel communicator");
  TpView v{torch::nn::Sequential(s.parallel), torch::nn::Sequential(s.dense), 0, 0, {}, {}};
  if (v.parallel->size() != v.dense->size()) bad("the tensor-parallel and dense models differ in children");
  v.first = s.pipe ? s.pipe->first_layer() : 0;
  v.end = s.pipe ? s.pipe->end_layer() : static_cast<int64_t>(v.parallel->size());
  v.trained = named_range(v.parallel, v.first, v.end, false);
  if (s.opt) {
    auto ops = optimizer_params(*s.opt);
    if (ops.size() != v.trained.size()) {
      bad("the optimizer has " + std::to_string(ops.size()) + " parameters, the tensor-parallel model (or stage) " +
          std::to_string(v.trained.size()) + "; pass the optimizer over its parameters (or their masters)");
    }
    for (size_t i = 0; i < ops.size(); ++i) v.trained[i].second = ops[i];  // the masters where there are
    v.optimizer = optimizer_kind(*s.opt);
  } else {
    v.optimizer = optimizer_kind(s.zero->optimizer());
  }
  return v;
}

// The cut of `dense`'s current values for this tp rank: children [first, end) of a fresh
// tp::tensor_parallel(dense), by name (copies).
std::map<std::string, at::Tensor> cut_for_rank(TpView& v, const CommPtr& tp, const char* who) {
  tp::TensorParallelOptions to;
  to.sync_dense = false;  // the dense values are the same on every rank: no broadcast
  auto shards = named_range(tp::tensor_parallel(v.dense, tp, to), v.first, v.end, false);
  if (shards.size() != v.trained.size()) {
    throw std::invalid_argument(std::string(who) + ": the dense model cuts into " + std::to_string(shards.size()) +
                                " tensor-parallel parameters here, the model has " + std::to_string(v.trained.size()) +
                                "; pass a dense model of the same shape");
  }
  std::map<std::string, at::Tensor> out;
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& [n, t] = v.trained[i];
    if (shards[i].first != n || shards[i].second.sizes() != t.sizes()) {
      throw std::invalid_argument(std::string(who) + ": tensor-parallel parameter '" + n + "' " + shape_str(t.sizes()) +
                                  " does not match the dense model's cut '" + shards[i].first + "' " +
                                  shape_str(shards[i].second.sizes()) + "; pass a dense model of the same shape");
    }
    out[n] = shards[i].second.detach().clone();
  }
  return out;
}

}  // namespace

std::string detail::save_tensor_parallel_checkpoint(const std::string& root, CheckpointMeta meta,
                                                    const TensorParallelState& s, Communicator& comm,
                                                    const CheckpointSaveOptions& o) {
  const char* who = "save_tensor_parallel_checkpoint";
  TpView v = tp_view(s, who);
  // The trained values and slots of this rank's shards, by name.
  WholeState mine;
  if (s.zero) {
    const at::Device dev = v.trained.empty() ? at::Device(at::kCPU) : v.trained.front().second.device();
    mine = gather_zero(*s.zero, *s.dp, dev, who);
  } else {
    for (auto& [n, t] : v.trained) {
      mine.params[n] = t.detach();
      auto st = get_param_state(*s.opt, t);
      mine.step = std::max(mine.step, st.step);
      for (auto& [k, x] : st.slots) mine.slots[k][n] = x.detach();
    }
  }
  // A scratch copy of the parallel model (cut from `dense`, whose values do not matter here):
  // each field (the values, then each optimizer slot) is copied into its shards and gathered
  // into `dense` by tp::gather_to_dense, which knows how every layer was cut.
  tp::TensorParallelOptions to;
  to.sync_dense = false;
  auto scratch = tp::tensor_parallel(v.dense, s.tp, to);
  auto sp = named_range(scratch, v.first, v.end, false);
  auto dn = named_range(v.dense, v.first, v.end, false);
  auto gather_field = [&](const std::map<std::string, at::Tensor>& field) {
    {
      torch::NoGradGuard ng;
      for (auto& [n, t] : sp) {
        auto it = field.find(n);
        // A slot that some parameter lacks (one that never had a gradient) is saved as zeros for it.
        if (it == field.end()) {
          t.zero_();
          continue;
        }
        if (it->second.sizes() != t.sizes()) {
          throw std::invalid_argument(std::string(who) + ": tensor-parallel parameter '" + n + "' has shape " +
                                      shape_str(it->second.sizes()) + ", the dense model cuts it to " +
                                      shape_str(t.sizes()) + "; pass a dense model of the same shape");
        }
        t.copy_(it->second);
      }
    }
    tp::gather_to_dense(scratch, v.dense, s.tp, v.first, v.end);
    std::map<std::string, at::Tensor> out;
    for (auto& [n, t] : dn) out[n] = t.detach().clone();
    return out;
  };
  if (sp.size() != v.trained.size()) {
    throw std::invalid_argument(std::string(who) + ": the dense model cuts into " + std::to_string(sp.size()) +
                                " tensor-parallel parameters here, the model has " + std::to_string(v.trained.size()) +
                                "; pass a dense model of the same shape");
  }
  const bool writer = s.pipe ? (s.tp->rank() == 0 && s.dp->rank() == 0) : comm.rank() == 0;
  SavePlan plan;
  plan.meta = meta;
  plan.meta.optimizer = v.optimizer;
  auto values = gather_field(mine.params);
  for (auto& [n, t] : dn) {
    plan.params.push_back(tensor_desc(n, values.at(n)));
    if (writer) plan.entries.emplace_back("param/" + n, values.at(n));
  }
  for (auto& [k, field] : mine.slots) {
    auto whole = gather_field(field);
    if (writer)
      for (auto& [n, t] : dn) plan.entries.emplace_back(k + "/" + n, whole.at(n));
    plan.slots.push_back(k);
  }
  plan.optimizer_step = mine.step;
  for (auto& [n, b] : named_range(v.parallel, v.first, v.end, true)) {
    plan.buffers.push_back(tensor_desc(n, b));
    if (writer) plan.entries.emplace_back("buffer/" + n, b);
  }
  plan.entries.emplace_back("rng/cpu", cpu_rng_state());
  if (s.pipe) return save_stages(root, std::move(plan), *s.pipe, writer, comm, o);
  plan.layout = {{"kind", "replicated"}, {"owner", 0}};
  return save_impl(root, std::move(plan), comm, o);
}

CheckpointMeta detail::load_tensor_parallel_checkpoint(const std::string& dir, const TensorParallelState& s, int rank,
                                                       const CheckpointLoadOptions& o) {
  const char* who = "load_tensor_parallel_checkpoint";
  TpView v = tp_view(s, who);
  auto fc = read_full_checkpoint(dir);
  // The whole dense model is filled (a stage's cut may depend on its neighbours: the MLP pairs
  // Linears across a ReLU), so the checkpoint must hold every parameter.
  auto params = named_range(v.dense, 0, static_cast<int64_t>(v.dense->size()), false);
  auto buffers = named_range(v.parallel, v.first, v.end, true);
  check_fits(fc, dir, o, params, buffers, v.optimizer);
  // Every field whole into `dense`, then cut for this rank.
  auto cut_field = [&](const std::function<at::Tensor(const std::string&, const at::Tensor&)>& whole) {
    {
      torch::NoGradGuard ng;
      for (auto& [n, t] : params) t.copy_(whole(n, t));
    }
    return cut_for_rank(v, s.tp, who);
  };
  auto values = cut_field([&](const std::string& n, const at::Tensor&) { return fc.params.at(n); });
  std::set<std::string> slots;
  int64_t step = 0;
  for (auto& [n, st] : fc.optim) {
    step = std::max(step, st.step);
    for (auto& [k, x] : st.slots) slots.insert(k);
  }
  std::map<std::string, ParamOptimizerState> states;
  for (const auto& k : slots) {
    auto cut = cut_field([&](const std::string& n, const at::Tensor& t) {
      const auto& sl = fc.optim.at(n).slots;
      auto it = sl.find(k);
      return it != sl.end() ? it->second : at::zeros_like(t);
    });
    for (auto& [n, t] : cut) {
      states[n].slots[k] = t;
      states[n].step = step;
    }
  }
  if (s.zero) {
    s.zero->load_full_state(values, states);
    s.zero->restore_loss_scaler(fc.meta.loss_scale, fc.meta.loss_scale_good_steps, fc.meta.skipped_steps);
  } else {
    auto live = named_range(v.parallel, v.first, v.end, false);
    torch::NoGradGuard ng;
    for (size_t i = 0; i < v.trained.size(); ++i) {
      const auto& [n, op] = v.trained[i];
      op.copy_(values.at(n));
      if (!op.is_same(live[i].second)) live[i].second.copy_(values.at(n));
      set_param_state(*s.opt, op, states[n]);
    }
  }
  finish_load(fc, buffers, rank, o);
  return fc.meta;
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
  return load_whole_tensors(dir, model, opt, rank, o, /*whole_model=*/true);
}

CheckpointMeta detail::load_checkpoint(const std::string& dir, const Pipeline& pipe, torch::optim::Optimizer& opt,
                                       int rank, const CheckpointLoadOptions& o) {
  auto stage = pipe.stage_module();
  return load_whole_tensors(dir, *stage, opt, rank, o, /*whole_model=*/false);
}

namespace {
CheckpointMeta load_zero(const std::string& dir, ZeroDataParallel& zero, int rank, const CheckpointLoadOptions& o,
                         bool whole_model) {
  auto fc = read_full_checkpoint(dir);
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (auto& p : zero.shard_state().params) params.emplace_back(p.name, at::empty(p.shape));
  auto buffers = named_buffers(zero.module());
  check_fits(fc, dir, o, params, buffers, optimizer_kind(zero.optimizer()), whole_model);
  zero.load_full_state(fc.params, fc.optim);
  zero.restore_loss_scaler(fc.meta.loss_scale, fc.meta.loss_scale_good_steps, fc.meta.skipped_steps);
  finish_load(fc, buffers, rank, o);
  return fc.meta;
}
}  // namespace

CheckpointMeta detail::load_checkpoint(const std::string& dir, ZeroDataParallel& zero, int rank,
                                       const CheckpointLoadOptions& o) {
  return load_zero(dir, zero, rank, o, /*whole_model=*/true);
}

CheckpointMeta detail::load_checkpoint(const std::string& dir, const Pipeline& pipe, ZeroDataParallel& zero, int rank,
                                       const CheckpointLoadOptions& o) {
  (void)pipe;  // the stage's parameters are ZeRO's; the checkpoint may hold more (other stages)
  return load_zero(dir, zero, rank, o, /*whole_model=*/false);
}

}  // namespace tandem
