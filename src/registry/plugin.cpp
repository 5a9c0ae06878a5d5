// Plugin loading (tandem/registry.h): dlopen, the stamp check, and attributing what the
// plugin's static registrations added. A refused plugin's registrations are removed but the
// library stays mapped: its code may already be referenced (static destructors, LibTorch's own
// registries), and unmapping it could crash later; the process normally exits on the error.
#include <dlfcn.h>
#include <limits.h>
#include <sys/stat.h>
#include <torch/version.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>

#include "registry/registry_internal.h"
#include "tandem/registry.h"

namespace tandem {

const char* version() { return TANDEM_VERSION; }
const char* torch_version() { return TORCH_VERSION; }

namespace {

using registry_internal::join;

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  return realpath(p.c_str(), buf) ? std::string(buf) : p;
}

bool is_elf(const std::string& path) {
  char magic[4] = {};
  std::ifstream f(path, std::ios::binary);
  return f.read(magic, 4) && std::memcmp(magic,
                                         "\x7f"
                                         "ELF",
                                         4) == 0;
}

std::string this_build() {
  return "Tandem " + std::string(version()) + " with LibTorch " + torch_version() + " (registry ABI " +
         std::to_string(TANDEM_REGISTRY_ABI) + ")";
}

struct Loaded {
  std::mutex mu;  // one load at a time: registrations are attributed to the plugin being loaded
  std::map<std::string, Plugin> by_path;
  // Refused plugins stay mapped, so dlopen would not run their registrations again: a second
  // load repeats the first refusal.
  std::map<std::string, std::string> refused;
};
Loaded& loaded() {
  static Loaded* l = new Loaded;  // never destroyed, like the registry
  return *l;
}

// Runs the plugin's static objects with their registrations attributed to it.
void* open_attributed(const std::string& abs) {
  registry_internal::begin_plugin(abs);
  void* handle = dlopen(abs.c_str(), RTLD_NOW | RTLD_LOCAL);
  registry_internal::end_plugin();
  return handle;
}

}  // namespace

Plugin load_plugin(const std::string& path) {
  const std::string shown = "plugin '" + path + "'";
  if (path.empty()) throw std::runtime_error("no plugin path given; pass the .so file your plugin's build produces");
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    throw std::runtime_error(shown + " not found (" + std::strerror(errno) +
                             "); pass the path of the .so file your plugin's build produces, e.g. build/libmynet.so");
  }
  if (S_ISDIR(st.st_mode)) {
    throw std::runtime_error(shown + " is a directory; pass the .so file your plugin's build produces in it");
  }
  const std::string abs = real_path(path);
  auto& l = loaded();
  std::lock_guard<std::mutex> lk(l.mu);
  if (auto it = l.by_path.find(abs); it != l.by_path.end()) return it->second;
  if (auto it = l.refused.find(abs); it != l.refused.end()) throw std::runtime_error(it->second);

  void* handle = open_attributed(abs);
  const std::string origin = registry_internal::plugin_origin(abs);
  auto refuse = [&](const std::string& why) {
    registry_internal::unregister(origin);
    registry_internal::take_errors();
    const std::string message = shown + " " + why;
    if (handle) l.refused[abs] = message;  // not when dlopen failed: nothing of it stays mapped
    return std::runtime_error(message);
  };
  if (!handle) {
    const char* err = dlerror();
    const std::string what = err ? err : "unknown error";
    if (!is_elf(abs)) {
      throw refuse("is not a shared library (" + what + "); pass the .so file your plugin's build produces");
    }
    throw refuse("cannot be loaded (" + what + "); rebuild it against this installation, " + this_build());
  }
  dlerror();
  void* sym = dlsym(handle, kPluginStampSymbol);
  Dl_info where{};
  if (sym && (!dladdr(sym, &where) || !where.dli_fname || real_path(where.dli_fname) != abs)) {
    sym = nullptr;  // found in one of its dependencies, not in the plugin
  }
  if (!sym) {
    throw refuse("lacks the symbol " + std::string(kPluginStampSymbol) +
                 " that marks a Tandem plugin; put TANDEM_PLUGIN() (tandem/registry.h) once in one of its source "
                 "files and rebuild it");
  }
  const PluginStamp* stamp = reinterpret_cast<const PluginStamp* (*)()>(sym)();
  if (!stamp || !stamp->tandem_version || !stamp->torch_version) {
    throw refuse("has a broken " + std::string(kPluginStampSymbol) + " (no versions); define it with TANDEM_PLUGIN()");
  }
  if (stamp->registry_abi != TANDEM_REGISTRY_ABI || std::strcmp(stamp->tandem_version, version()) != 0 ||
      std::strcmp(stamp->torch_version, torch_version()) != 0) {
    throw refuse("was built against Tandem " + std::string(stamp->tandem_version) + " with LibTorch " +
                 stamp->torch_version + " (registry ABI " + std::to_string(stamp->registry_abi) + "), but this is " +
                 this_build() + "; rebuild the plugin against this installation");
  }
  const auto errors = registry_internal::take_errors();
  if (!errors.empty()) throw refuse("failed to register: " + join(errors, "; "));
  Plugin p;
  p.path = abs;
  p.tandem_version = stamp->tandem_version;
  p.torch_version = stamp->torch_version;
  p.models = registry_internal::models_from(origin);
  p.datasets = registry_internal::datasets_from(origin);
  if (p.models.empty() && p.datasets.empty()) {
    throw refuse("registers no model and no dataset; add TANDEM_REGISTER_MODEL(...) or TANDEM_REGISTER_DATASET(...) "
                 "at namespace scope in its sources (inside a function they run only when it is called)");
  }
  l.by_path[abs] = p;
  return p;
}

bool names_plugin(const std::string& option) {
  auto ends_with_so = [](const std::string& s) { return s.size() >= 3 && s.compare(s.size() - 3, 3, ".so") == 0; };
  if (option.find('/') != std::string::npos || ends_with_so(option)) return true;
  const auto colon = option.rfind(':');
  return colon != std::string::npos && ends_with_so(option.substr(0, colon));
}

void load_plugins_from_model_option(std::string& option) {
  if (!names_plugin(option)) return;
  std::string path = option, chosen;
  // "PATH:NAME" chooses a model; a ':' followed by a '/' belongs to the path.
  const auto colon = option.rfind(':');
  if (colon != std::string::npos && option.find('/', colon) == std::string::npos) {
    path = option.substr(0, colon);
    chosen = option.substr(colon + 1);
  }
  const Plugin p = load_plugin(path);
  if (!chosen.empty()) {
    if (std::find(p.models.begin(), p.models.end(), chosen) == p.models.end()) {
      throw std::invalid_argument("plugin '" + path + "' has no model '" + chosen +
                                  "' (its models: " + (p.models.empty() ? std::string("none") : join(p.models)) + ")");
    }
    option = chosen;
    return;
  }
  if (p.models.empty()) {
    throw std::invalid_argument("plugin '" + path + "' registers no model, only the dataset(s) " + join(p.datasets) +
                                "; choose a model by name and the dataset with --dataset");
  }
  if (p.models.size() > 1) {
    throw std::invalid_argument("plugin '" + path + "' registers several models (" + join(p.models) +
                                "); choose one as " + path + ":" + p.models.front());
  }
  option = p.models.front();
}

}  // namespace tandem
