// Parsing and validation of manifest.json (checkpoint/manifest.h). No LibTorch here: this file
// is also compiled alone, with clang and sanitizers, into tests/fuzz/fuzz_manifest.
//
// Every integer goes through int_in() (nlohmann's get<int64_t>() of a float or of a number
// out of range would be undefined behaviour), every product and sum is checked for overflow,
// and every error is a std::runtime_error naming the file.
#include "checkpoint/manifest.h"

#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <stdexcept>

namespace tandem::ckpt {
namespace {

using json = nlohmann::json;
constexpr int64_t kMaxNumel = int64_t{1} << 56;
constexpr int kMaxWorld = 1 << 20;

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

  Manifest parse(const json& j) const {
    Manifest m;
    if (!j.is_object() || !j.contains("format") || j["format"] != kManifestFormat)
      bad("is not a Tandem checkpoint manifest");
    const int64_t version = int_field(j, "version", "the manifest", 0, INT32_MAX);
    if (version != kManifestVersion) {
      bad("has format version " + std::to_string(version) + "; this build reads version " +
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
    } else {
      bad("has an unknown layout '" + kind + "'");
    }
    return m;
  }
};

}  // namespace

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
