// Sharded checkpoints (tandem/checkpoint.h): the manifest, the atomic save protocol, and
// loading with resharding on placements (tandem/placement.h).
//
// Save (collective): every rank describes the pieces it holds as replica 0 and the ranks
// all-gather the descriptions, so each lays out (and checks) the same manifest; rank 0 creates
// <root>/.tmp-step-N; every rank writes and fsyncs its shard there; the ranks agree that all
// writes succeeded (one all-reduce of a failure flag) and all-gather the shards' sizes and
// hashes; rank 0 writes and fsyncs the manifest, fsyncs the directory, renames it to
// <root>/step-N and fsyncs the root. A checkpoint exists exactly when step-N/manifest.json
// exists, so a crash at any point leaves the previous one loadable.
//
// Load: parse and validate the manifest (checkpoint/manifest.cpp: every tensor's pieces cover it
// exactly once), check it against the model, read the shards holding elements of what this rank
// holds (size and FNV-1a hash checked first), and only then copy into each piece the runs of the
// stored pieces it overlaps.
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
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "checkpoint/shard_io.h"
#include "tandem/trace.h"

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

json placement_json(const Placement& p, int rank, const std::string& entry) {
  json blocks = json::array();
  for (const auto& b : p.blocks)
    blocks.push_back({{"local", b.local_offset}, {"global", b.global_offset}, {"shape", b.shape}});
  return {{"rank", rank},     {"entry", entry},
          {"offset", 0},      {"local_shape", p.local_shape},
          {"blocks", blocks}, {"flat", {p.flat_begin, p.held_end()}}};
}

std::pair<std::string, std::string> split_key(const std::string& key) {
  const auto slash = key.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == key.size()) {
    throw std::invalid_argument("checkpoint: state key '" + key + "' is not KIND/NAME (param/, buffer/ or a slot)");
  }
  return {key.substr(0, slash), key.substr(slash + 1)};
}

// This rank's pieces, described for the manifest: those with replica id 0 with their placement
// (and their entries in `plan`), the others by key and shape alone.
json own_pieces(const std::vector<StatePiece>& pieces, int rank, SavePlan& plan) {
  json mine = json::array();
  std::set<std::string> keys;
  for (const auto& p : pieces) {
    split_key(p.key);
    p.placement.check("checkpoint: the piece of '" + p.key + "'");
    if (!p.data.defined() || p.data.dim() != 1 || p.data.numel() != p.placement.held_numel()) {
      throw std::invalid_argument("checkpoint: the piece of '" + p.key + "' holds " +
                                  std::to_string(p.placement.held_numel()) +
                                  " elements, its data is not a 1-D view of as many");
    }
    if (p.placement.replica != 0) {  // described all the same: a tensor no rank writes is refused
      mine.push_back(
          {{"key", p.key}, {"shape", p.placement.global_shape}, {"dtype", c10::toString(p.data.scalar_type())}});
      continue;
    }
    if (!keys.insert(p.key).second) {
      throw std::invalid_argument("checkpoint: rank " + std::to_string(rank) + " holds two pieces of '" + p.key +
                                  "' as replica 0");
    }
    mine.push_back({{"key", p.key},
                    {"shape", p.placement.global_shape},
                    {"dtype", c10::toString(p.data.scalar_type())},
                    {"piece", placement_json(p.placement, rank, p.key)}});
    plan.entries.emplace_back(p.key, p.data);
  }
  return mine;
}

// The layout every rank assembles alike from every rank's pieces, checked by the manifest's own
// parser: pieces that leave an element out or hold one twice are a strategy's bug, refused here
// on every rank rather than written.
void lay_out(const std::vector<std::string>& all, SavePlan& plan, int world) {
  std::vector<std::string> order;
  std::map<std::string, json> tensors;
  for (const auto& text : all) {
    for (auto& d : json::parse(text)) {
      const auto key = d.at("key").get<std::string>();
      auto it = tensors.find(key);
      if (it == tensors.end()) {
        order.push_back(key);
        it = tensors
                 .emplace(key, json{{"key", key},
                                    {"shape", d.at("shape")},
                                    {"dtype", d.at("dtype")},
                                    {"pieces", json::array()}})
                 .first;
      } else if (it->second.at("shape") != d.at("shape")) {
        throw std::invalid_argument("checkpoint: the ranks disagree on the shape of '" + key +
                                    "': " + it->second.at("shape").dump() + " and " + d.at("shape").dump());
      }
      if (d.contains("piece")) it->second["pieces"].push_back(d.at("piece"));
    }
  }
  for (const auto& key : order) {
    if (tensors.at(key).at("pieces").empty()) {
      throw std::invalid_argument("checkpoint save: no rank writes '" + key +
                                  "' (every rank holding it has a replica id other than 0)");
    }
  }
  std::set<std::string> slots;
  json layout_tensors = json::array();
  for (const auto& key : order) {
    const auto& t = tensors.at(key);
    const auto [kind, name] = split_key(key);
    const json desc{{"name", name}, {"shape", t.at("shape")}, {"dtype", t.at("dtype")}};
    if (kind == "param") plan.params.push_back(desc);
    else if (kind == "buffer") plan.buffers.push_back(desc);
    else slots.insert(kind);
    layout_tensors.push_back(t);
  }
  plan.slots.assign(slots.begin(), slots.end());
  plan.layout = {{"kind", "pieces"}, {"tensors", layout_tensors}};
  json probe = manifest_of(plan, json::object());
  probe["shards"] = json::array();
  for (int r = 0; r < world; ++r)
    probe["shards"].push_back({{"rank", r}, {"file", shard_name(r, world)}, {"bytes", 0}, {"fnv1a64", "0"}});
  try {
    ckpt::parse_manifest(probe.dump(), "(being saved)");
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(std::string("checkpoint save: the ranks' pieces do not describe the state: ") +
                                e.what());
  }
}

}  // namespace

std::string save_state(const std::string& root, CheckpointMeta meta, const std::vector<StatePiece>& pieces,
                       int64_t optimizer_step, Communicator& comm, const CheckpointSaveOptions& o) {
  SavePlan plan;
  plan.meta = std::move(meta);
  plan.meta.world_size = comm.size();
  plan.optimizer_step = optimizer_step;
  std::string err;
  json mine;
  try {
    mine = own_pieces(pieces, comm.rank(), plan);
  } catch (const std::exception& e) {
    err = e.what();
  }
  // Every rank learns every rank's pieces (a failing rank sends none and says why below).
  auto all = allgather_strings(comm, err.empty() ? mine.dump() : std::string("[]"));
  auto t = at::tensor({static_cast<int64_t>(err.empty() ? 0 : 1)}, at::kLong);
  comm.allreduce(t, ReduceOp::kSum);
  if (!err.empty()) throw std::invalid_argument("rank " + std::to_string(comm.rank()) + ": " + err);
  if (t.item<int64_t>() > 0)
    throw std::invalid_argument("checkpoint save: another rank's pieces are invalid (see its error)");
  lay_out(all, plan, comm.size());
  plan.entries.emplace_back("rng/cpu", cpu_rng_state());
  return save_impl(root, std::move(plan), comm, o);
}

namespace {

std::vector<std::pair<std::string, at::Tensor>> named_buffers(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& kv : m.named_buffers(true)) out.emplace_back(kv.key(), kv.value());
  return out;
}

// A replicated module's pieces: every parameter whole (its optimizer tensor: the fp32 master
// where one is kept) with its slots, and every buffer; replica id `replica`.
std::vector<StatePiece> replicated_pieces(torch::nn::Module& model, const torch::optim::Optimizer& opt,
                                          int64_t replica) {
  auto named = model.named_parameters(true);
  auto ops = optimizer_params(opt);
  if (ops.size() != named.size()) {
    throw std::invalid_argument("checkpoint: the optimizer has " + std::to_string(ops.size()) +
                                " parameters, the module " + std::to_string(named.size()) +
                                "; pass the optimizer over the module's parameters (or their masters)");
  }
  std::vector<StatePiece> out;
  for (size_t i = 0; i < ops.size(); ++i) {
    auto p = Placement::whole(ops[i].sizes().vec());
    p.replica = replica;
    append_optimizer_pieces(out, named[i].key(), p, ops[i], opt);
  }
  for (auto& [n, b] : named_buffers(model)) {
    auto p = Placement::whole(b.sizes().vec());
    p.replica = replica;
    out.push_back({ckpt::state_key("buffer", n), p, b.detach().view({-1})});
  }
  return out;
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

// Fills pieces from a checkpoint's stored pieces, reading each shard once, when first needed.
class Reader {
 public:
  explicit Reader(const std::string& dir) : M_(read_manifest(dir)), shards_(M_.meta.world_size) {}
  const Manifest& manifest() const { return M_; }
  std::string path(int rank) const { return M_.dir + "/" + M_.files.at(static_cast<size_t>(rank)); }

  // Reads (and checks) every shard that holds an element of these pieces or of the other state
  // of their names, so that a damaged file is found before anything changes.
  void preload(const std::vector<StatePiece>& pieces) {
    std::set<std::string> names;
    for (const auto& p : pieces) names.insert(split_key(p.key).second);
    for (const auto& [key, t] : M_.tensors) {
      if (!names.count(split_key(key).second)) continue;
      for (const auto& sp : t.pieces) shard(sp.rank);
    }
  }

  void fill(const StatePiece& p) {
    const auto& t = M_.tensors.at(p.key);
    if (t.shape != p.placement.global_shape) {
      throw std::runtime_error("checkpoint '" + M_.dir + "' holds '" + p.key + "' of shape " + shape_str(t.shape) +
                               ", this model's is " + shape_str(p.placement.global_shape));
    }
    const auto want = placement_runs(p.placement);
    auto dst = p.data.device().is_cpu() ? p.data : at::empty({p.data.numel()}, p.data.options().device(at::kCPU));
    torch::NoGradGuard ng;
    for (size_t i = 0; i < t.pieces.size(); ++i) {
      const auto copies = placement_overlap(want, runs(p.key, t, i));
      if (copies.empty()) continue;
      const auto src = stored(p.key, t.pieces[i]);
      for (const auto& c : copies) dst.narrow(0, c.dst, c.length).copy_(src.narrow(0, c.src, c.length));
    }
    if (!dst.is_same(p.data)) p.data.copy_(dst);
  }

  // The whole tensor `key`, in its stored dtype, on the CPU.
  at::Tensor whole(const std::string& key) {
    const auto& t = M_.tensors.at(key);
    const auto dtype = t.pieces.empty() ? at::kFloat : stored(key, t.pieces[0]).scalar_type();
    auto out = at::zeros(t.shape, at::TensorOptions().dtype(dtype));
    fill({key, Placement::whole(t.shape), out.view({-1})});
    return out;
  }

  at::Tensor rng(int rank) { return take(shard(rank), "rng/cpu", path(rank)); }

 private:
  std::map<std::string, at::Tensor>& shard(int rank) {
    auto& s = shards_.at(static_cast<size_t>(rank));
    if (!s) s = ckpt::read_shard(path(rank), M_.digests.at(static_cast<size_t>(rank)));
    return *s;
  }
  const std::vector<PlacementRun>& runs(const std::string& key, const ckpt::StoredTensor& t, size_t i) {
    auto& r = runs_[{key, i}];
    if (r.empty() && t.pieces[i].placement.held_numel() > 0) r = placement_runs(t.pieces[i].placement);
    return r;
  }
  // The stored piece's held elements, flat.
  at::Tensor stored(const std::string& key, const ckpt::StoredPiece& sp) {
    const auto e = take(shard(sp.rank), sp.entry, path(sp.rank)).reshape({-1});
    const int64_t n = sp.placement.held_numel();
    if (e.numel() < sp.entry_offset + n) {
      throw std::runtime_error("checkpoint shard '" + path(sp.rank) + "': entry '" + sp.entry + "' has " +
                               std::to_string(e.numel()) + " elements; the manifest's piece of '" + key + "' needs " +
                               std::to_string(sp.entry_offset + n));
    }
    return e.narrow(0, sp.entry_offset, n);
  }

  Manifest M_;
  std::vector<std::optional<std::map<std::string, at::Tensor>>> shards_;
  std::map<std::pair<std::string, size_t>, std::vector<PlacementRun>> runs_;
};

// Checks that the checkpoint fits the target before anything is changed.
void check_fits(const Manifest& M, const CheckpointLoadOptions& o, const StateTarget& t) {
  const std::string where = "checkpoint '" + M.dir + "'";
  if (!o.expect_model.empty() && M.meta.model != o.expect_model) {
    throw std::runtime_error(where + " is of model '" + M.meta.model + "', not '" + o.expect_model +
                             "'; pass the matching --model or another checkpoint directory");
  }
  if (M.meta.optimizer != t.optimizer) {
    throw std::runtime_error(where + " holds " + M.meta.optimizer + " optimizer state; this run uses " + t.optimizer);
  }
  auto check = [&](const std::vector<ckpt::TensorDesc>& stored,
                   const std::vector<std::pair<std::string, std::vector<int64_t>>>& want, const char* what) {
    std::map<std::string, const ckpt::TensorDesc*> by_name;
    for (const auto& d : stored) by_name[d.name] = &d;
    for (const auto& [n, shape] : want) {
      auto it = by_name.find(n);
      if (it == by_name.end()) {
        throw std::runtime_error(where + " does not fit this model (" + M.meta.model +
                                 " in the checkpoint): it has no " + what + " '" + n + "'");
      }
      if (it->second->shape != shape) {
        throw std::runtime_error(where + " does not fit this model: " + what + " '" + n + "' has shape " +
                                 shape_str(it->second->shape) + " there, " + shape_str(shape) + " here");
      }
      by_name.erase(it);
    }
    if (!by_name.empty()) {
      throw std::runtime_error(where + " does not fit this model: it has the " + what + " '" + by_name.begin()->first +
                               "', which this model lacks (" + std::to_string(stored.size()) + " " + what +
                               "s there, " + std::to_string(want.size()) + " here)");
    }
  };
  check(M.params, t.params, "parameter");
  check(M.buffers, t.buffers, "buffer");
}

}  // namespace

void append_optimizer_pieces(std::vector<StatePiece>& out, const std::string& name, const Placement& placement,
                             const at::Tensor& param, const torch::optim::Optimizer& opt) {
  out.push_back({ckpt::state_key("param", name), placement, param.detach().view({-1})});
  for (auto& [k, v] : get_param_state(opt, param).slots)
    out.push_back({ckpt::state_key(k, name), placement, v.detach().view({-1})});
}

CheckpointMeta load_state(const std::string& dir, const StateTarget& t, int rank, Communicator* comm,
                          const CheckpointLoadOptions& o) {
  Reader R(dir);
  const auto& M = R.manifest();
  check_fits(M, o, t);
  std::string err;
  try {
    R.preload(t.pieces());
    const int rng_rank = rank >= 0 && rank < M.meta.world_size ? rank : 0;
    const auto rng = o.restore_rng ? R.rng(rng_rank) : at::Tensor();
    // Nothing has changed so far; from here only a bug stops the load midway.
    t.prepare(M.slots, M.optimizer_step);
    for (const auto& p : t.pieces()) {
      if (M.tensors.count(p.key)) {
        R.fill(p);
      } else if (split_key(p.key).first != "param" && split_key(p.key).first != "buffer") {
        continue;  // optimizer state that was not made for this parameter yet: zeros
      } else {
        throw std::runtime_error("checkpoint '" + dir + "' holds no '" + p.key + "'");
      }
    }
    if (rng.defined()) set_cpu_rng_state(rng);
  } catch (const std::exception& e) {
    err = e.what();
  }
  if (comm) {
    agree(*comm, err, "loading checkpoint '" + dir + "'");
  } else if (!err.empty()) {
    throw std::runtime_error(err);
  }
  return M.meta;
}

void load_parameters(const ParameterSource& source, const std::vector<StatePiece>& pieces, Communicator& comm) {
  std::string err;
  try {
    torch::NoGradGuard ng;
    for (const auto& piece : pieces) {
      const auto [kind, name] = split_key(piece.key);
      std::vector<int64_t> shape;
      if (kind != "param" || !source.find(name, &shape)) continue;
      if (shape != piece.placement.global_shape) {
        throw std::runtime_error("the initial value of '" + name + "' has shape " + shape_str(shape) +
                                 ", the model's parameter " + shape_str(piece.placement.global_shape));
      }
      auto dst = piece.data.device().is_cpu() ? piece.data
                                              : at::empty({piece.data.numel()}, piece.data.options().device(at::kCPU));
      for (const auto& r : placement_runs(piece.placement))
        source.read(name, r.global, dst.narrow(0, r.held, r.length));
      if (!dst.is_same(piece.data)) piece.data.copy_(dst);
    }
  } catch (const std::exception& e) {
    err = std::string("reading the initial parameters: ") + e.what();
  }
  agree(comm, err, "reading the initial parameters");
}

std::string save_checkpoint(const std::string& root, CheckpointMeta meta, torch::nn::Module& model,
                            torch::optim::Optimizer& opt, Communicator& comm, const CheckpointSaveOptions& o) {
  meta.optimizer = optimizer_kind(opt);
  int64_t step = 0;
  for (const auto& p : optimizer_params(opt)) step = std::max(step, get_param_state(opt, p).step);
  return save_state(root, std::move(meta), replicated_pieces(model, opt, comm.rank()), step, comm, o);
}

CheckpointMeta load_checkpoint(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer& opt, int rank,
                               const CheckpointLoadOptions& o) {
  StateTarget t;
  for (auto& kv : model.named_parameters(true)) t.params.emplace_back(kv.key(), kv.value().sizes().vec());
  for (auto& [n, b] : named_buffers(model)) t.buffers.emplace_back(n, b.sizes().vec());
  t.optimizer = optimizer_kind(opt);
  const auto ops = optimizer_params(opt);
  t.prepare = [&](const std::vector<std::string>& slots, int64_t step) {
    for (const auto& p : ops) reset_param_state(opt, p, slots, step);
  };
  t.pieces = [&] { return replicated_pieces(model, opt, 0); };
  auto meta = load_state(dir, t, rank, nullptr, o);
  torch::NoGradGuard ng;
  auto named = model.named_parameters(true);
  for (size_t i = 0; i < ops.size(); ++i)
    if (!ops[i].is_same(named[i].value())) named[i].value().detach().copy_(ops[i]);
  return meta;
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

FullCheckpoint read_full_checkpoint(const std::string& dir) {
  Reader R(dir);
  const auto& M = R.manifest();
  FullCheckpoint fc;
  fc.meta = M.meta;
  for (const auto& p : M.params) {
    fc.param_names.push_back(p.name);
    fc.params[p.name] = R.whole(ckpt::state_key("param", p.name));
    ParamOptimizerState s;
    s.step = M.optimizer_step;
    for (const auto& sl : M.slots) {
      const auto key = ckpt::state_key(sl, p.name);
      s.slots[sl] = M.tensors.count(key) ? R.whole(key) : at::zeros_like(fc.params[p.name]);
    }
    fc.optim[p.name] = std::move(s);
  }
  for (const auto& b : M.buffers) fc.buffers[b.name] = R.whole(ckpt::state_key("buffer", b.name));
  for (int r = 0; r < M.meta.world_size; ++r) fc.rng.push_back(R.rng(r));
  return fc;
}

}  // namespace tandem
