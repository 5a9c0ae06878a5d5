// The model and dataset registries (tandem/registry.h): one process-wide table each, filled
// with the built-ins on first use, then by plugins and the program's own registrations.
#include "tandem/registry.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "registry/builtins.h"
#include "registry/registry_internal.h"

namespace tandem {
namespace {

using registry_internal::join;

constexpr const char* kBuiltinOrigin = "built into Tandem";

struct ModelEntry {
  ModelInfo info;
  ModelFactory factory;
};
struct DatasetEntry {
  DatasetInfo info;
  DatasetFactory factory;
};

struct Registry {
  std::mutex mu;
  std::vector<ModelEntry> models;      // registration order
  std::vector<DatasetEntry> datasets;  // registration order
  std::vector<std::string> errors;     // from static registrations, not yet reported
  std::string loading_plugin;          // the plugin whose static objects are running, if any
};

// Never destroyed: a plugin's factories must not be destroyed after the plugin's code is gone
// at exit, and static registrations may run before or after any other static object.
Registry& storage() {
  static Registry* r = new Registry;
  return *r;
}

thread_local bool t_registering_builtins = false;

void ensure_builtins() {
  if (t_registering_builtins) return;
  static std::once_flag once;
  std::call_once(once, [] {
    t_registering_builtins = true;
    try {
      models::register_builtin_models();
      data::register_builtin_datasets();
    } catch (...) {
      t_registering_builtins = false;
      throw;
    }
    t_registering_builtins = false;
  });
}

void check_name(const char* kind, const std::string& name) {
  const bool bad = name.empty() || std::any_of(name.begin(), name.end(), [](char c) {
                     return c == '/' || c == ':' || std::isspace(static_cast<unsigned char>(c));
                   });
  if (bad) {
    throw std::invalid_argument(std::string(kind) + " name '" + name +
                                "' is not allowed: use a non-empty name without '/', ':' or spaces");
  }
}

// Who is registering now (call with the lock held).
std::string current_origin(const Registry& r) {
  if (t_registering_builtins) return kBuiltinOrigin;
  return r.loading_plugin.empty() ? "the program" : registry_internal::plugin_origin(r.loading_plugin);
}

// Static registrations of the program itself that failed are reported by the next lookup (a
// plugin's by load_plugin, which takes them first).
void report_pending_errors(Registry& r) {
  std::vector<std::string> errors;
  {
    std::lock_guard<std::mutex> lk(r.mu);
    if (!r.loading_plugin.empty()) return;
    errors.swap(r.errors);
  }
  if (!errors.empty()) throw std::runtime_error("a registration failed: " + join(errors, "; "));
}

template <typename Entry>
std::vector<std::string> names_of(const std::vector<Entry>& entries) {
  std::vector<std::string> names;
  for (const auto& e : entries) names.push_back(e.info.name);
  return names;
}

template <typename Entry>
const Entry* find(const std::vector<Entry>& entries, const std::string& name) {
  for (const auto& e : entries)
    if (e.info.name == name) return &e;
  return nullptr;
}

template <typename Entry>
[[noreturn]] void throw_unknown(const char* kind, const std::string& name, const std::vector<Entry>& entries) {
  throw std::invalid_argument(
      "unknown " + std::string(kind) + " '" + name + "' (known: " + join(names_of(entries)) +
      "); a plugin's models and datasets are known once it is loaded (--model path/to/libplugin.so)");
}

// Looks up an entry and copies it out, so that the factory runs without the lock.
template <typename Entry>
Entry lookup(std::vector<Entry> Registry::*table, const char* kind, const std::string& name) {
  ensure_builtins();
  auto& r = storage();
  report_pending_errors(r);
  std::lock_guard<std::mutex> lk(r.mu);
  const Entry* e = find(r.*table, name);
  if (!e) throw_unknown(kind, name, r.*table);
  return *e;
}

template <typename Entry>
void add(std::vector<Entry> Registry::*table, const char* kind, Entry entry) {
  check_name(kind, entry.info.name);
  if (!entry.factory)
    throw std::invalid_argument(std::string(kind) + " '" + entry.info.name + "': the factory is empty");
  ensure_builtins();
  auto& r = storage();
  std::lock_guard<std::mutex> lk(r.mu);
  entry.info.origin = current_origin(r);
  if (const Entry* old = find(r.*table, entry.info.name)) {
    throw std::invalid_argument(std::string(kind) + " '" + entry.info.name + "' (" + entry.info.origin +
                                ") is already registered (" + old->info.origin + "); give it another name");
  }
  (r.*table).push_back(std::move(entry));
}

template <typename Entry, typename Info>
std::vector<Info> infos(std::vector<Entry> Registry::*table) {
  ensure_builtins();
  auto& r = storage();
  report_pending_errors(r);
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<Info> out;
  for (const auto& e : r.*table) out.push_back(e.info);
  return out;
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << " " << t.sizes();
  return os.str();
}

void check_split(const std::string& name, const char* split, const data::Dataset& d) {
  const std::string where = "dataset '" + name + "', " + split + " split: ";
  if (!d.images.defined() || !d.labels.defined())
    throw std::runtime_error(where + "the factory returned no images or no labels");
  if (d.labels.dim() != 1 || d.labels.scalar_type() != at::kLong)
    throw std::runtime_error(where + "labels must be int64 [N], got " + shape_of(d.labels));
  if (!at::isFloatingType(d.images.scalar_type()) || d.images.dim() < 2)
    throw std::runtime_error(where + "images must be floating point [N, ...], got " + shape_of(d.images));
  if (d.images.size(0) != d.labels.size(0))
    throw std::runtime_error(where + std::to_string(d.images.size(0)) + " images but " +
                             std::to_string(d.labels.size(0)) + " labels");
  if (d.size() == 0) throw std::runtime_error(where + "it is empty");
}

}  // namespace

void register_model(const std::string& name, ModelFactory factory, const std::string& description,
                    const std::string& default_dataset) {
  add(&Registry::models, "model", ModelEntry{{name, description, default_dataset, ""}, std::move(factory)});
}

void register_dataset(const std::string& name, DatasetFactory factory, const std::string& description) {
  add(&Registry::datasets, "dataset", DatasetEntry{{name, description, ""}, std::move(factory)});
}

std::vector<ModelInfo> registered_models() { return infos<ModelEntry, ModelInfo>(&Registry::models); }

std::vector<DatasetInfo> registered_datasets() { return infos<DatasetEntry, DatasetInfo>(&Registry::datasets); }

ModelInfo model_info(const std::string& name) { return lookup(&Registry::models, "model", name).info; }

DatasetInfo dataset_info(const std::string& name) { return lookup(&Registry::datasets, "dataset", name).info; }

std::shared_ptr<torch::nn::Module> make_registered_model(const std::string& name) {
  const ModelEntry e = lookup(&Registry::models, "model", name);
  std::shared_ptr<torch::nn::Module> m;
  try {
    m = e.factory();
  } catch (const std::exception& ex) {
    throw std::runtime_error("model '" + name + "' (" + e.info.origin + "): its factory failed: " + ex.what());
  }
  if (!m) throw std::runtime_error("model '" + name + "' (" + e.info.origin + "): its factory returned no module");
  return m;
}

std::string default_dataset_for(const std::string& model) {
  const std::string d = model_info(model).default_dataset;
  return d.empty() ? "fashion-mnist" : d;
}

DatasetSplits load_registered_dataset(const std::string& name, const std::string& dir) {
  const DatasetEntry e = lookup(&Registry::datasets, "dataset", name);
  DatasetSplits s = e.factory(dir);  // its own errors name the file
  check_split(name, "training", s.train);
  check_split(name, "test", s.test);
  return s;
}

namespace detail {
void record_registration_error(const std::string& message) {
  auto& r = storage();
  std::lock_guard<std::mutex> lk(r.mu);
  r.errors.push_back(message);
}
}  // namespace detail

namespace registry_internal {

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

void begin_plugin(const std::string& path) {
  ensure_builtins();  // a plugin's name clashes with a built-in are its error, not the built-in's
  auto& r = storage();
  std::lock_guard<std::mutex> lk(r.mu);
  r.loading_plugin = path;
}

void end_plugin() {
  auto& r = storage();
  std::lock_guard<std::mutex> lk(r.mu);
  r.loading_plugin.clear();
}

std::string plugin_origin(const std::string& path) { return "plugin " + path; }

std::vector<std::string> take_errors() {
  auto& r = storage();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<std::string> e;
  e.swap(r.errors);
  return e;
}

namespace {
template <typename Entry>
std::vector<std::string> names_from(std::vector<Entry> Registry::*table, const std::string& origin) {
  auto& r = storage();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<std::string> names;
  for (const auto& e : r.*table)
    if (e.info.origin == origin) names.push_back(e.info.name);
  return names;
}
}  // namespace

std::vector<std::string> models_from(const std::string& origin) { return names_from(&Registry::models, origin); }
std::vector<std::string> datasets_from(const std::string& origin) { return names_from(&Registry::datasets, origin); }

void unregister(const std::string& origin) {
  auto& r = storage();
  std::lock_guard<std::mutex> lk(r.mu);
  auto drop = [&](auto& table) {
    table.erase(std::remove_if(table.begin(), table.end(), [&](const auto& e) { return e.info.origin == origin; }),
                table.end());
  };
  drop(r.models);
  drop(r.datasets);
}

}  // namespace registry_internal
}  // namespace tandem
