// Models and datasets by name, for the CLI, the trainer and user plugins. Built-ins (mlp, cnn,
// cnn_bn, transformer_tiny; the dataset fashion-mnist) are always there; a plugin (a shared
// library with TANDEM_PLUGIN() and TANDEM_REGISTER_* lines) adds its own when load_plugin()
// loads it, e.g. through `tandem train --model ./libmynet.so`. Names are unique; every lookup of
// an unknown name throws std::invalid_argument listing the known ones.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/version.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "tandem/data.h"
#include "tandem/version.h"

// Raised whenever the types below or the exported plugin stamp change shape: a plugin built
// against another registry ABI is refused before any of its factories is called.
#define TANDEM_REGISTRY_ABI 1

namespace tandem {

// ---- models --------------------------------------------------------------------------------

// A model factory returns a freshly initialised module (torch's global seed decides the
// initial weights, so call torch::manual_seed first for reproducible runs). tandem train runs a
// torch::nn::Sequential (a TORCH_MODULE holder of another module arrives as the only child of
// one, through model_factory) with a single worker, DDP and ZeRO; pipeline (--pp) and tensor
// (--tp) parallelism cut a Sequential between its children. A bare std::shared_ptr of another
// module carries no forward that the trainer could call.
using ModelFactory = std::function<std::shared_ptr<torch::nn::Module>()>;

struct ModelInfo {
  std::string name;
  std::string description;
  std::string default_dataset;  // the dataset it trains on unless told otherwise; "" = none
  std::string origin;           // "built into Tandem", "the program", or "plugin /path/libx.so"
};

namespace detail {
// A holder of another module becomes the only child of a Sequential (its parameters named
// "0.<name>"): the Sequential knows how to call its forward, so the engine and the CLI can run
// it under single, DDP and ZeRO (a pipeline cannot cut a single child).
template <typename T>
std::shared_ptr<torch::nn::Module> as_module(const torch::nn::ModuleHolder<T>& m) {
  if constexpr (std::is_same_v<T, torch::nn::SequentialImpl>) {
    return m.ptr();
  } else {
    return torch::nn::Sequential(m).ptr();
  }
}
template <typename T>
std::shared_ptr<torch::nn::Module> as_module(const std::shared_ptr<T>& m) {
  return m;
}
}  // namespace detail

// Adapts a factory returning a torch::nn::Sequential (or any TORCH_MODULE holder) or a
// std::shared_ptr of a module to a ModelFactory.
template <typename F>
ModelFactory model_factory(F factory) {
  return [factory] { return detail::as_module(factory()); };
}

// Throws std::invalid_argument for an empty name, one with '/', ':' or whitespace, a name
// already registered (naming who registered it), or an empty factory.
void register_model(const std::string& name, ModelFactory factory, const std::string& description,
                    const std::string& default_dataset = "");

// Every registered model, in registration order (the built-ins first).
std::vector<ModelInfo> registered_models();
// One model's entry; throws std::invalid_argument "unknown model 'x' (known: mlp, cnn, ...)".
ModelInfo model_info(const std::string& name);

// THE way to build a model by name (the trainer calls it with TrainConfig::model after
// load_plugins_from_model_option). A new module each call; throws std::invalid_argument for an
// unknown name and std::runtime_error when the factory fails or returns no module.
std::shared_ptr<torch::nn::Module> make_registered_model(const std::string& name);

// The dataset a model trains on when none is chosen: its registered default, else
// "fashion-mnist". Throws std::invalid_argument for an unknown model.
std::string default_dataset_for(const std::string& model);

// ---- datasets ------------------------------------------------------------------------------

// A training and a test split, each images [N, ...] float + labels int64 [N] (tandem/data.h;
// Fashion-MNIST's are [N, 1, 28, 28]).
struct DatasetSplits {
  data::Dataset train;
  data::Dataset test;
};

// Loads (or generates) both splits; `dir` is the --data directory, which a dataset that needs
// no files ignores. Errors: throw std::runtime_error naming the file and what to do.
using DatasetFactory = std::function<DatasetSplits(const std::string& dir)>;

struct DatasetInfo {
  std::string name;
  std::string description;
  std::string origin;  // as ModelInfo::origin
};

// Same rules for the name as register_model.
void register_dataset(const std::string& name, DatasetFactory factory, const std::string& description);
std::vector<DatasetInfo> registered_datasets();
// One dataset's entry; throws std::invalid_argument "unknown dataset 'x' (known: ...)".
DatasetInfo dataset_info(const std::string& name);

// THE way to load a dataset by name (the trainer calls it with the chosen dataset and
// TrainConfig::data). Checks what the factory returned: images and labels defined, labels int64
// [N] matching the images' first dimension, a non-empty training split; throws
// std::runtime_error naming the dataset and the split otherwise, std::invalid_argument for an
// unknown name.
DatasetSplits load_registered_dataset(const std::string& name, const std::string& dir);

// ---- plugins -------------------------------------------------------------------------------

// What TANDEM_PLUGIN() exports (C layout, read before anything else of the plugin is trusted).
struct PluginStamp {
  int registry_abi;            // TANDEM_REGISTRY_ABI
  const char* tandem_version;  // TANDEM_VERSION
  const char* torch_version;   // TORCH_VERSION
};
// The name of the function TANDEM_PLUGIN() defines.
inline constexpr const char* kPluginStampSymbol = "tandem_plugin_stamp";

struct Plugin {
  std::string path;  // absolute, symlinks resolved
  std::string tandem_version, torch_version;
  std::vector<std::string> models, datasets;  // what it registered
};

// Loads a plugin (dlopen, RTLD_NOW | RTLD_LOCAL: its undefined symbols resolve at once, against
// the libtandem and LibTorch already in the process, whose registry its static registrations
// reach; its own symbols stay private). Loading the same file again returns the first result.
// Throws std::runtime_error naming the file and what to do when: it does not exist; it is not
// a shared library or cannot be loaded (dlerror's text); it lacks tandem_plugin_stamp (no
// TANDEM_PLUGIN()); it was built against another Tandem, LibTorch or registry ABI (both
// versions named); one of its registrations failed (e.g. a name already taken); it registers
// nothing. After a failure nothing it registered stays registered.
Plugin load_plugin(const std::string& path);

// True when a --model value names a plugin file rather than a registered model: it contains
// '/' or ends in ".so" (optionally followed by ":MODEL").
bool names_plugin(const std::string& model_option);

// For the CLI and the trainer: when `model_option` names a plugin ("./libx.so", or
// "./libx.so:NAME" to choose among several models), loads it and rewrites the option to the
// registered model name; otherwise does nothing. Throws as load_plugin, and
// std::invalid_argument when the plugin registers no model, several without ":NAME", or not NAME.
void load_plugins_from_model_option(std::string& model_option);

namespace detail {
// Registrations made by the macros below run during static initialisation, where an exception
// would terminate the process: they are recorded instead, and reported by load_plugin (for a
// plugin) or by the next lookup in the registry (for the program itself).
void record_registration_error(const std::string& message);

struct ModelRegistration {
  template <typename F>
  ModelRegistration(const char* name, F factory, const char* description, const char* default_dataset = "") {
    try {
      register_model(name, model_factory(factory), description, default_dataset);
    } catch (const std::exception& e) {
      record_registration_error(e.what());
    }
  }
};

struct DatasetRegistration {
  template <typename F>
  DatasetRegistration(const char* name, F factory, const char* description) {
    try {
      register_dataset(name, DatasetFactory(factory), description);
    } catch (const std::exception& e) {
      record_registration_error(e.what());
    }
  }
};
}  // namespace detail

}  // namespace tandem

#define TANDEM_REGISTRY_CONCAT_(a, b) a##b
#define TANDEM_REGISTRY_CONCAT(a, b) TANDEM_REGISTRY_CONCAT_(a, b)

// At namespace scope, in a plugin or a program linked with Tandem (registered when the library
// or program is loaded):
//   TANDEM_REGISTER_MODEL("tiny_mlp", make_tiny_mlp, "a 784-128-10 MLP");
//   TANDEM_REGISTER_MODEL("tiny_mlp", make_tiny_mlp, "a 784-128-10 MLP", "blobs");  // default dataset
// The factory takes no argument and returns a torch::nn::Sequential or a TORCH_MODULE holder
// (trainable by tandem train), or a std::shared_ptr of a module (for programs of their own).
#define TANDEM_REGISTER_MODEL(name, factory_fn, ...)                                                  \
  static const ::tandem::detail::ModelRegistration TANDEM_REGISTRY_CONCAT(tandem_model_registration_, \
                                                                          __COUNTER__)(name, factory_fn, __VA_ARGS__)

// TANDEM_REGISTER_DATASET("blobs", make_blobs, "synthetic Gaussian blobs, 10 classes"): the
// factory takes the data directory (const std::string&) and returns tandem::DatasetSplits.
#define TANDEM_REGISTER_DATASET(name, factory_fn, description)                                             \
  static const ::tandem::detail::DatasetRegistration TANDEM_REGISTRY_CONCAT(tandem_dataset_registration_,  \
                                                                            __COUNTER__)(name, factory_fn, \
                                                                                         description)

// Once per plugin, at namespace scope in one of its source files: exports the stamp that
// load_plugin checks (this header's registry ABI, Tandem and LibTorch versions).
#define TANDEM_PLUGIN()                                                                                  \
  extern "C" __attribute__((visibility("default"))) const ::tandem::PluginStamp* tandem_plugin_stamp() { \
    static const ::tandem::PluginStamp stamp{TANDEM_REGISTRY_ABI, TANDEM_VERSION, TORCH_VERSION};        \
    return &stamp;                                                                                       \
  }
