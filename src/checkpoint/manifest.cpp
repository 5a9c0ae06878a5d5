// Parsing and validation of manifest.json (checkpoint/manifest.h). No LibTorch here: this file
// is also compiled alone, with clang and sanitizers, into tests/fuzz/fuzz_manifest.
//
// Every integer goes through int_in() (nlohmann's get<int64_t>() of a float or of a number
// out of range would be undefined behaviour), every product and sum is checked for overflow,
// and every error is a std::runtime_error naming the file.
#include "checkpoint/manifest.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

namespace tandem::ckpt {
namespace {

using json = nlohmann::json;
constexpr int64_t kMaxNumel = int64_t{1} << 56;
constexpr int kMaxWorld = 1 << 20;
constexpr int64_t kMaxRuns = int64_t{1} << 24;

struct Parser {
  const std::string& path;

  [[noreturn]] void bad(const std::string& why) const {
    throw std::runtime_error("checkpoint manifest '" + path + "' " + why);
  }
  const json& at(const json& j, const char* key, const std::string& where) const {
    if (!j.is_object()) bad("has " + where + " that is not a JSON object");
    auto it = j.find(key);
    if (it == j.end()) bad("lacks the field '" + std::string(key) + "' in " + where);
    return *it;
  }
  int64_t int_in(const json& v, const std::string& what, int64_t lo, int64_t hi) const {
    int64_t x = 0;
    if (v.is_number_unsigned()) {
      auto u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) bad("has " + what + " " + v.dump() + ", above " + std::to_string(hi));
      x = static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      x = v.get<int64_t>();
    } else {
      bad("has " + what + " that is not an integer (" + v.dump() + ")");
    }
    if (x < lo || x > hi) {
      bad("has " + what + " " + std::to_string(x) + ", outside [" + std::to_string(lo) + ", " + std::to_string(hi) +
          "]");
    }
    return x;
  }
  int64_t int_field(const json& j, const char* key, const std::string& where, int64_t lo, int64_t hi) const {
    return int_in(at(j, key, where), where + "." + key, lo, hi);
  }
  std::string str_field(const json& j, const char* key, const std::string& where) const {
    const auto& v = at(j, key, where);
    if (!v.is_string()) bad("has " + where + "." + key + " that is not a string");
    return v.get<std::string>();
  }
  double num_field(const json& j, const char* key, const std::string& where) const {
    const auto& v = at(j, key, where);
    if (!v.is_number()) bad("has " + where + "." + key + " that is not a number");
    return v.get<double>();
  }
  const json& array_field(const json& j, const char* key, const std::string& where) const {
    const auto& v = at(j, key, where);
    if (!v.is_array()) bad("has " + where + "." + key + " that is not an array");
    return v;
  }

  TensorDesc tensor(const json& d, const std::string& where) const {
    TensorDesc t;
    t.name = str_field(d, "name", where);
    if (t.name.empty()) bad("has " + where + " with an empty name");
    t.dtype = str_field(d, "dtype", where);
    t.numel = 1;
    for (auto& s : array_field(d, "shape", where)) {
      const int64_t n = int_in(s, "a dimension of '" + t.name + "'", 0, kMaxNumel);
      if (n > 0 && t.numel > kMaxNumel / n) bad("gives '" + t.name + "' more than 2^56 elements");
      t.numel *= n;
      t.shape.push_back(n);
    }
    if (t.shape.size() > 64) bad("gives '" + t.name + "' more than 64 dimensions");
    return t;
  }

  std::vector<TensorDesc> tensors(const json& list, const std::string& where) const {
    std::vector<TensorDesc> out;
    std::set<std::string> seen;
    for (auto& d : list) {
      out.push_back(tensor(d, where));
      if (!seen.insert(out.back().name).second) bad("lists '" + out.back().name + "' twice in " + where);
    }
    return out;
  }

  static uint64_t hex(const std::string& s, bool* ok) {
    uint64_t v = 0;
    *ok = !s.empty() && s.size() <= 16;
    for (char c : s) {
      int d = c >= '0' && c <= '9'   ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                     : -1;
      if (d < 0) *ok = false;
      v = v << 4 | static_cast<uint64_t>(d < 0 ? 0 : d);
    }
    return v;
  }

  // "name" -> index in m.params, with a clear error for names the model does not list.
  std::map<std::string, size_t> index(const std::vector<TensorDesc>& ts) const {
    std::map<std::string, size_t> out;
    for (size_t i = 0; i < ts.size(); ++i) out[ts[i].name] = i;
    return out;
  }

  // layout.params / layout.buffers of the stages layout: each tensor in exactly one rank's shard.
  std::vector<int> owners(const json& list, const std::vector<TensorDesc>& ts, const char* what, int world) const {
    auto idx = index(ts);
    std::vector<int> out(ts.size(), -1);
    for (auto& e : list) {
      auto n = str_field(e, "name", std::string("layout.") + what);
      auto it = idx.find(n);
      if (it == idx.end()) bad("lays out " + std::string(what) + " '" + n + "' that the model does not list");
      if (out[it->second] >= 0) bad("lays out '" + n + "' twice");
      out[it->second] = static_cast<int>(int_field(e, "rank", "layout." + std::string(what), 0, world - 1));
    }
    for (size_t i = 0; i < ts.size(); ++i)
      if (out[i] < 0) bad("lists '" + ts[i].name + "' but lays out no place for it");
    return out;
  }

  void zero_layout(const json& layout, Manifest& m) const {
    const int world = m.meta.world_size;
    m.zero_stage = static_cast<int>(int_field(layout, "stage", "layout", 1, 3));
    for (auto& b : array_field(layout, "buckets", "layout")) {
      ZeroBucket z;
      const std::string where = "layout.buckets[" + std::to_string(m.buckets.size()) + "]";
      z.numel = int_field(b, "numel", where, 0, kMaxNumel);
      z.padded = int_field(b, "padded", where, 0, kMaxNumel);
      z.chunk = int_field(b, "chunk", where, 0, kMaxNumel);
      if (z.chunk > kMaxNumel / world || z.chunk * world != z.padded || z.numel > z.padded) {
        bad("has " + where + " with chunk " + std::to_string(z.chunk) + " x " + std::to_string(world) +
            " ranks != padded " + std::to_string(z.padded) + " (or numel " + std::to_string(z.numel) + " > padded)");
      }
      m.buckets.push_back(z);
    }
    auto idx = index(m.params);
    m.param_bucket.assign(m.params.size(), SIZE_MAX);
    m.param_offset.assign(m.params.size(), 0);
    for (auto& p : array_field(layout, "params", "layout")) {
      auto n = str_field(p, "name", "layout.params");
      auto it = idx.find(n);
      if (it == idx.end()) bad("lays out parameter '" + n + "' that the model does not list");
      if (m.param_bucket[it->second] != SIZE_MAX) bad("lays out parameter '" + n + "' twice");
      const int64_t nb = static_cast<int64_t>(m.buckets.size());
      if (nb == 0) bad("places parameter '" + n + "' in a bucket but lists no buckets");
      const auto b = static_cast<size_t>(int_field(p, "bucket", "layout.params", 0, nb - 1));
      const int64_t off = int_field(p, "offset", "layout.params", 0, kMaxNumel);
      const int64_t numel = int_field(p, "numel", "layout.params", 0, kMaxNumel);
      if (numel != m.params[it->second].numel) {
        bad("lays out " + std::to_string(numel) + " elements for parameter '" + n + "' of " +
            std::to_string(m.params[it->second].numel));
      }
      if (off + numel > m.buckets[b].padded) bad("places parameter '" + n + "' outside its bucket");
      m.param_bucket[it->second] = b;
      m.param_offset[it->second] = off;
    }
    for (size_t i = 0; i < m.params.size(); ++i)
      if (m.param_bucket[i] == SIZE_MAX) bad("lists parameter '" + m.params[i].name + "' but lays out no place for it");
    m.buffer_owner.assign(m.buffers.size(), 0);
  }

  std::vector<int64_t> dims(const json& list, const std::string& what, size_t n) const {
    if (!list.is_array() || list.size() != n) bad("has " + what + " that is not a list of " + std::to_string(n));
    std::vector<int64_t> out;
    for (auto& v : list) out.push_back(int_in(v, what, 0, kMaxNumel));
    return out;
  }

  // One stored piece of a "pieces" layout: {"rank", "entry", "offset", "local_shape", "blocks":
  // [{"local", "global", "shape"}], "flat": [begin, end]}.
  StoredPiece piece(const json& e, const StoredTensor& t, const std::string& where,
                    const std::vector<std::string>& files) const {
    const int world = static_cast<int>(files.size());
    StoredPiece sp;
    sp.rank = static_cast<int>(int_field(e, "rank", where, 0, world - 1));
    sp.entry = str_field(e, "entry", where);
    if (sp.entry.empty()) bad("has " + where + " with an empty entry name");
    sp.entry_offset = int_field(e, "offset", where, 0, kMaxNumel);
    auto& p = sp.placement;
    p.global_shape = t.shape;
    const size_t d = t.shape.size();
    p.local_shape = dims(at(e, "local_shape", where), where + ".local_shape", d);
    int64_t rows = 0;
    for (auto& b : array_field(e, "blocks", where)) {
      PlacementBlock blk;
      blk.local_offset = dims(at(b, "local", where + ".blocks"), where + ".blocks.local", d);
      blk.global_offset = dims(at(b, "global", where + ".blocks"), where + ".blocks.global", d);
      blk.shape = dims(at(b, "shape", where + ".blocks"), where + ".blocks.shape", d);
      int64_t r = 1;  // the runs it can make: bounded, so that a hostile manifest cannot exhaust memory
      for (size_t i = 0; i + 1 < d; ++i) r = blk.shape[i] == 0 ? 0 : std::min(kMaxRuns + 1, r * blk.shape[i]);
      rows = std::min(kMaxRuns + 1, rows + r);
      p.blocks.push_back(std::move(blk));
    }
    if (rows > kMaxRuns) bad("has " + where + " cut into more than 2^24 runs");
    const auto flat = dims(at(e, "flat", where), where + ".flat", 2);
    p.flat_begin = flat[0];
    p.flat_end = flat[1];
    try {
      p.check(where);
    } catch (const std::invalid_argument& ex) {
      bad("has a piece that does not fit its tensor (in the shard file '" + files.at(static_cast<size_t>(sp.rank)) +
          "'): " + ex.what());
    }
    return sp;
  }

  void pieces_layout(const json& layout, Manifest& m) const {
    for (auto& t : array_field(layout, "tensors", "layout")) {
      const auto key = str_field(t, "key", "layout.tensors");
      if (m.tensors.count(key)) bad("lists the tensor '" + key + "' twice");
      StoredTensor st;
      const auto desc =
          tensor({{"name", key}, {"shape", at(t, "shape", "layout.tensors")}, {"dtype", "-"}}, "layout.tensors");
      st.shape = desc.shape;
      st.dtype = str_field(t, "dtype", "layout.tensors");
      for (auto& e : array_field(t, "pieces", "layout.tensors['" + key + "']"))
        st.pieces.push_back(piece(e, st, "a piece of '" + key + "'", m.files));
      m.tensors[key] = std::move(st);
    }
  }

  // Version 1, replicated and stages: each tensor whole in its owner's shard, entry = key.
  void owner_pieces(Manifest& m) const {
    auto add = [&](const std::string& kind, const TensorDesc& d, int owner) {
      const auto key = state_key(kind, d.name);
      m.tensors[key] = StoredTensor{d.shape, d.dtype, {StoredPiece{owner, key, 0, Placement::whole(d.shape)}}};
    };
    for (size_t i = 0; i < m.params.size(); ++i) {
      add("param", m.params[i], m.param_owner[i]);
      for (auto& sl : m.slots) add(sl, m.params[i], m.param_owner[i]);
    }
    for (size_t i = 0; i < m.buffers.size(); ++i) add("buffer", m.buffers[i], m.buffer_owner[i]);
  }

  // Version 1, zero: rank r's chunk of a bucket holds the part of each parameter that falls in
  // [r * chunk, (r + 1) * chunk), in entries "bucketB/param" and "bucketB/<slot>".
  void zero_pieces(Manifest& m) const {
    const int world = m.meta.world_size;
    for (size_t i = 0; i < m.params.size(); ++i) {
      const auto& d = m.params[i];
      const auto b = m.param_bucket[i];
      const int64_t chunk = m.buckets[b].chunk, off = m.param_offset[i];
      std::vector<std::string> kinds{"param"};
      kinds.insert(kinds.end(), m.slots.begin(), m.slots.end());
      for (const auto& kind : kinds) {
        StoredTensor st{d.shape, d.dtype, {}};
        for (int r = 0; r < world && d.numel > 0; ++r) {
          const int64_t lo = std::max(off, r * chunk), hi = std::min(off + d.numel, (r + 1) * chunk);
          if (lo >= hi) continue;
          st.pieces.push_back(StoredPiece{r, "bucket" + std::to_string(b) + "/" + kind, lo - r * chunk,
                                          Placement::whole(d.shape).flat_range(lo - off, hi - off)});
        }
        m.tensors[state_key(kind, d.name)] = std::move(st);
      }
    }
    for (auto& d : m.buffers)
      m.tensors[state_key("buffer", d.name)] =
          StoredTensor{d.shape, d.dtype, {StoredPiece{0, state_key("buffer", d.name), 0, Placement::whole(d.shape)}}};
  }

  // Every tensor belongs to a listed parameter, slot or buffer of its shape; every parameter
  // and buffer has one; the pieces of each hold every element exactly once.
  void check_tensors(const Manifest& m) const {
    std::map<std::string, const TensorDesc*> expect;
    std::set<std::string> required;
    for (auto& d : m.params) {
      expect[state_key("param", d.name)] = &d;
      required.insert(state_key("param", d.name));
      for (auto& sl : m.slots) expect[state_key(sl, d.name)] = &d;
    }
    for (auto& d : m.buffers) {
      expect[state_key("buffer", d.name)] = &d;
      required.insert(state_key("buffer", d.name));
    }
    for (auto& [key, t] : m.tensors) {
      auto it = expect.find(key);
      if (it == expect.end()) bad("lays out the tensor '" + key + "' that is no listed parameter, slot or buffer");
      if (t.shape != it->second->shape) bad("gives '" + key + "' another shape than the model lists for it");
      required.erase(key);
      std::vector<std::vector<PlacementRun>> runs;
      for (auto& p : t.pieces) runs.push_back(placement_runs(p.placement));
      const auto err = placement_cover_error(runs, it->second->numel);
      if (!err.empty()) bad("has pieces of '" + key + "' that do not fit together: " + err + pieces_where(m, t));
    }
    if (!required.empty()) bad("lists '" + *required.begin() + "' but lays out no piece of it");
  }

  // Which shard file holds each piece, for an error message.
  static std::string pieces_where(const Manifest& m, const StoredTensor& t) {
    std::string out = " (piece: file";
    for (size_t i = 0; i < t.pieces.size(); ++i)
      out += (i ? ", " : " ") + std::to_string(i) + ": " + m.files.at(static_cast<size_t>(t.pieces[i].rank));
    return out + ")";
  }

  Manifest parse(const json& j) const {
    Manifest m;
    if (!j.is_object() || !j.contains("format") || j["format"] != kManifestFormat)
      bad("is not a Tandem checkpoint manifest");
    const int64_t version = int_field(j, "version", "the manifest", 0, INT32_MAX);
    if (version != 1 && version != kManifestVersion) {
      bad("has format version " + std::to_string(version) + "; this build reads versions 1 to " +
          std::to_string(kManifestVersion));
    }
    auto& meta = m.meta;
    const auto& model = at(j, "model", "the manifest");
    meta.model = str_field(model, "name", "model");
    meta.model_description = str_field(model, "description", "model");
    m.params = tensors(array_field(model, "parameters", "model"), "model.parameters");
    m.buffers = tensors(array_field(model, "buffers", "model"), "model.buffers");
    meta.strategy = str_field(j, "strategy", "the manifest");
    meta.world_size = static_cast<int>(int_field(j, "world_size", "the manifest", 1, kMaxWorld));
    meta.precision = str_field(j, "precision", "the manifest");
    const auto& opt = at(j, "optimizer", "the manifest");
    meta.optimizer = str_field(opt, "kind", "optimizer");
    m.optimizer_step = int_field(opt, "step", "optimizer", 0, INT64_MAX);
    std::set<std::string> slots;
    for (auto& s : array_field(opt, "slots", "optimizer")) {
      if (!s.is_string() || s.get<std::string>().empty()) bad("has an optimizer slot that is not a non-empty string");
      if (s == "param" || !slots.insert(s.get<std::string>()).second)
        bad("has the optimizer slot " + s.dump() + " twice or reserved");
      m.slots.push_back(s.get<std::string>());
    }
    const auto& progress = at(j, "progress", "the manifest");
    meta.step = int_field(progress, "step", "progress", 0, INT64_MAX);
    meta.epoch = int_field(progress, "epoch", "progress", 0, INT64_MAX);
    meta.step_in_epoch = int_field(progress, "step_in_epoch", "progress", 0, INT64_MAX);
    const auto& seed = at(j, "seed", "the manifest");
    if (!seed.is_number_unsigned()) bad("has a seed that is not a non-negative integer");
    meta.seed = seed.get<uint64_t>();
    const auto& scaler = at(j, "loss_scaler", "the manifest");
    meta.loss_scale = num_field(scaler, "scale", "loss_scaler");
    meta.loss_scale_good_steps = int_field(scaler, "overflow_free_steps", "loss_scaler", 0, INT64_MAX);
    meta.skipped_steps = int_field(scaler, "skipped_steps", "loss_scaler", 0, INT64_MAX);
    const auto& extra = at(j, "extra", "the manifest");
    if (!extra.is_object()) bad("has 'extra' that is not a JSON object");
    meta.extra_json = extra.dump();

    const auto& shards = array_field(j, "shards", "the manifest");
    if (static_cast<int64_t>(shards.size()) != meta.world_size) {
      bad("lists " + std::to_string(shards.size()) + " shards for world size " + std::to_string(meta.world_size));
    }
    for (int r = 0; r < meta.world_size; ++r) {
      const auto& s = shards[static_cast<size_t>(r)];
      if (int_field(s, "rank", "shards", 0, kMaxWorld) != r) bad("lists the shards out of rank order");
      auto file = str_field(s, "file", "shards");
      if (file.empty() || file.find('/') != std::string::npos || file[0] == '.' ||
          file.find('\0') != std::string::npos) {
        bad("names an invalid shard file '" + file + "'");
      }
      Digest d;
      d.bytes = int_field(s, "bytes", "shards", 0, INT64_MAX);
      bool ok = false;
      d.fnv1a64 = hex(str_field(s, "fnv1a64", "shards"), &ok);
      if (!ok) bad("has a shard checksum that is not 1-16 hex digits");
      m.files.push_back(file);
      m.digests.push_back(d);
    }

    const auto& layout = at(j, "layout", "the manifest");
    const auto kind = str_field(layout, "kind", "layout");
    if (kind == "replicated") {
      m.layout = LayoutKind::kReplicated;
      const int owner = static_cast<int>(int_field(layout, "owner", "layout", 0, meta.world_size - 1));
      m.param_owner.assign(m.params.size(), owner);
      m.buffer_owner.assign(m.buffers.size(), owner);
    } else if (kind == "zero") {
      m.layout = LayoutKind::kZero;
      zero_layout(layout, m);
    } else if (kind == "stages") {
      m.layout = LayoutKind::kStages;
      for (auto& l : array_field(layout, "partition", "layout"))
        m.partition.push_back(int_in(l, "a stage's layer count", 1, INT32_MAX));
      if (m.partition.empty()) bad("has a stages layout without a partition");
      m.param_owner = owners(array_field(layout, "params", "layout"), m.params, "params", meta.world_size);
      m.buffer_owner = owners(array_field(layout, "buffers", "layout"), m.buffers, "buffers", meta.world_size);
    } else if (kind == "pieces") {
      m.layout = LayoutKind::kPieces;
      pieces_layout(layout, m);
    } else {
      bad("has an unknown layout '" + kind + "'");
    }
    if (m.layout == LayoutKind::kZero) {
      zero_pieces(m);
    } else if (m.layout != LayoutKind::kPieces) {
      owner_pieces(m);
    }
    check_tensors(m);
    return m;
  }
};

}  // namespace

std::string state_key(const std::string& kind, const std::string& name) { return kind + "/" + name; }

Manifest parse_manifest(const std::string& text, const std::string& path) {
  Parser p{path};
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    p.bad(std::string("is not valid JSON (truncated or corrupted?): ") + e.what());
  }
  try {
    return p.parse(j);
  } catch (const json::exception& e) {  // a json call the checks above did not anticipate
    p.bad(std::string("has an unexpected structure: ") + e.what());
  }
}

}  // namespace tandem::ckpt
