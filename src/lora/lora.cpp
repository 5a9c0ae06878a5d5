// LoRA adapters (tandem/lora.h): the modules, attaching them to a model, merging, and PEFT's
// adapter directories.
#include "tandem/lora.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tandem/pipeline.h"
#include "tandem/safetensors.h"

namespace tandem::lora {

namespace fs = std::filesystem;

double LoraConfig::scaling() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

void validate(const LoraConfig& c) {
  if (c.rank <= 0) throw std::invalid_argument("--lora-rank must be positive, got " + std::to_string(c.rank));
  if (!(c.alpha > 0)) throw std::invalid_argument("--lora-alpha must be positive, got " + std::to_string(c.alpha));
  if (!(c.dropout >= 0 && c.dropout < 1))
    throw std::invalid_argument("--lora-dropout must be in [0, 1), got " + std::to_string(c.dropout));
  if (c.targets.empty()) throw std::invalid_argument("--lora-targets names no module; give e.g. q_proj,v_proj");
  for (const auto& t : c.targets)
    if (t.empty() || t.find('.') != std::string::npos)
      throw std::invalid_argument("--lora-targets: '" + t + "' is not a module name such as q_proj");
}

std::vector<std::string> parse_targets(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string t; std::getline(ss, t, ',');) {
    t.erase(0, t.find_first_not_of(' '));
    t.erase(t.find_last_not_of(' ') + 1);
    if (!t.empty() && std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  }
  return out;
}

DownImpl::DownImpl(at::Tensor w, double p) : dropout(p) { weight = register_parameter("weight", std::move(w)); }

torch::Tensor DownImpl::forward(const torch::Tensor& x) {
  const auto in = dropout > 0 && is_training() ? torch::dropout(x, dropout, true) : x;
  return at::linear(in, weight);
}

UpImpl::UpImpl(at::Tensor w, double s) : scaling(s) { weight = register_parameter("weight", std::move(w)); }

torch::Tensor UpImpl::forward(const torch::Tensor& h) { return at::linear(h, weight) * scaling; }

Adapter adapter_of(const torch::nn::Module& m) {
  Adapter a;
  // By type, not name: a forward asks this of every adapted layer, and a plain Linear has no
  // children at all.
  for (const auto& c : m.children()) {
    if (auto* d = c->as<DownImpl>()) a.down = d;
    if (auto* u = c->as<UpImpl>()) a.up = u;
  }
  if (!a.down || !a.up) return {};
  return a;
}

bool is_adapter_parameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

void add_adapter(torch::nn::Module& m, at::Tensor a, at::Tensor b, const LoraConfig& c) {
  m.register_module("lora_A", Down(a.detach().clone().requires_grad_(true), c.dropout));
  m.register_module("lora_B", Up(b.detach().clone().requires_grad_(true), c.scaling()));
}

torch::Tensor linear(const torch::nn::Linear& base, const torch::Tensor& x) {
  auto& m = *base.ptr();
  const auto a = adapter_of(m);
  // tandem::linear is Linear::forward, whose weight gradient a zero-bubble pipeline defers to W.
  auto y = tandem::linear(x, m.weight, m.bias);
  return a ? y + a.delta(x) : y;
}

namespace {

std::string last_component(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

bool under(const std::string& name, const std::set<std::string>& modules) {
  // A whole module path the name starts with, or any component of it.
  for (const auto& m : modules)
    if (name.rfind(m + ".", 0) == 0) return true;
  std::stringstream ss(name);
  for (std::string part; std::getline(ss, part, '.');)
    if (modules.count(part)) return true;
  return false;
}

std::string joined(const std::set<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s.empty() ? "(none)" : s;
}

}  // namespace

Attached attach(torch::nn::Module& model, const LoraConfig& c) {
  validate(c);
  // Everything is checked before the model changes: a refused call leaves it as it was.
  const std::set<std::string> targets(c.targets.begin(), c.targets.end());
  std::set<std::string> found, linear_names, module_names;
  std::vector<std::pair<std::string, torch::nn::LinearImpl*>> adapt;
  std::set<const torch::nn::Module*> applied;  // Linear children of Adaptable modules
  auto note_children = [&](const torch::nn::Module& m) {
    if (dynamic_cast<const Adaptable*>(&m))
      for (const auto& child : m.children()) applied.insert(child.get());
  };
  note_children(model);  // the root may live outside a shared_ptr: not through named_modules
  for (const auto& item : model.named_modules("", /*include_self=*/false)) note_children(*item.value());
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto leaf = last_component(item.key());
    module_names.insert(leaf);
    module_names.insert(item.key());
    auto* lin = item.value()->as<torch::nn::LinearImpl>();
    if (!lin) continue;
    linear_names.insert(leaf);
    if (!targets.count(leaf)) continue;
    if (adapter_of(*lin)) throw std::invalid_argument("module '" + item.key() + "' already has an adapter");
    if (!applied.count(lin)) {
      throw std::invalid_argument("--lora-targets: '" + item.key() +
                                  "' is called by a module whose forward would ignore an adapter (not "
                                  "lora::Adaptable); this model does not support LoRA on it");
    }
    found.insert(leaf);
    adapt.emplace_back(item.key(), lin);
  }
  for (const auto& t : c.targets) {
    if (!found.count(t)) {
      throw std::invalid_argument("--lora-targets: the model has no linear layer named '" + t +
                                  "'; its linear layers are: " + joined(linear_names));
    }
  }
  for (const auto& w : c.trained_whole) {
    if (!module_names.count(w))
      throw std::invalid_argument("the module '" + w + "' to train whole is not in the model");
  }
  Attached out;
  torch::NoGradGuard ng;
  for (auto& [name, lin] : adapt) {
    // nn.Linear's default initialisation (kaiming_uniform_, a = sqrt(5)), as PEFT's lora_A.
    auto a = torch::empty({c.rank, lin->options.in_features()}, lin->weight.options());
    torch::nn::init::kaiming_uniform_(a, std::sqrt(5.0));
    add_adapter(*lin, a, torch::zeros({lin->options.out_features(), c.rank}, lin->weight.options()), c);
    out.modules.push_back(name);
  }
  const std::set<std::string> whole(c.trained_whole.begin(), c.trained_whole.end());
  for (auto& p : model.named_parameters()) {
    const auto& name = p.key();
    const bool train = is_adapter_parameter(name) || under(name, whole);
    p.value().set_requires_grad(train);
    out.total += p.value().numel();
    if (train) out.trainable += p.value().numel();
  }
  return out;
}

at::Tensor merged_weight(const at::Tensor& weight, const at::Tensor& a, const at::Tensor& b, double scaling) {
  auto delta = at::matmul(b.to(at::kFloat), a.to(at::kFloat)) * scaling;
  return (weight.to(at::kFloat) + delta).to(weight.scalar_type());
}

// ---- PEFT

std::string peft_name(const std::string& hf_name) { return "base_model.model." + hf_name; }

namespace {

[[noreturn]] void bad_adapter(const std::string& file, const std::string& what) {
  throw std::runtime_error("PEFT adapter '" + file + "': " + what);
}

// PEFT's target_modules: a list of names, or "all-linear".
std::vector<std::string> targets_of(const nlohmann::json& t, const std::string& file) {
  if (t.is_string()) {
    if (t.get<std::string>() == "all-linear")
      return {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
    bad_adapter(file, "target_modules is the pattern '" + t.get<std::string>() +
                          "'; Tandem reads a list of module names (or \"all-linear\")");
  }
  if (!t.is_array() || t.empty()) bad_adapter(file, "target_modules must be a non-empty list of module names");
  std::vector<std::string> out;
  for (const auto& v : t) {
    if (!v.is_string()) bad_adapter(file, "target_modules holds " + v.dump() + ", not a module name");
    out.push_back(v.get<std::string>());
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool empty_or_null(const nlohmann::json& j, const char* key) {
  return !j.contains(key) || j[key].is_null() || (j[key].is_object() && j[key].empty()) ||
         (j[key].is_array() && j[key].empty());
}

}  // namespace

PeftAdapter read_peft_adapter(const std::string& dir) {
  const auto file = (fs::path(dir) / "adapter_config.json").string();
  std::ifstream f(file);
  if (!f) {
    throw std::runtime_error("--init-adapter '" + dir +
                             "': no adapter_config.json there; give a directory PEFT's save_pretrained wrote");
  }
  const auto j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) bad_adapter(file, "not a JSON object");
  if (j.value("peft_type", std::string()) != "LORA")
    bad_adapter(file, "peft_type is " + (j.contains("peft_type") ? j["peft_type"].dump() : std::string("absent")) +
                          ", not \"LORA\"");
  if (!j.contains("r") || !j["r"].is_number_integer()) bad_adapter(file, "needs the integer \"r\"");
  if (j.value("use_dora", false)) bad_adapter(file, "is a DoRA adapter (use_dora), which Tandem does not train");
  if (j.value("bias", std::string("none")) != "none") bad_adapter(file, "trains biases (bias != \"none\")");
  if (j.value("fan_in_fan_out", false)) bad_adapter(file, "has fan_in_fan_out (GPT-2 style Conv1D layers)");
  if (!empty_or_null(j, "rank_pattern") || !empty_or_null(j, "alpha_pattern"))
    bad_adapter(file, "gives some modules their own rank or alpha (rank_pattern/alpha_pattern)");
  if (!empty_or_null(j, "layers_to_transform")) bad_adapter(file, "adapts only some layers (layers_to_transform)");
  PeftAdapter a;
  a.config.rank = j["r"].get<int64_t>();
  a.config.alpha = j.contains("lora_alpha") && j["lora_alpha"].is_number() ? j["lora_alpha"].get<double>() : 8.0;
  a.config.dropout =
      j.contains("lora_dropout") && j["lora_dropout"].is_number() ? j["lora_dropout"].get<double>() : 0.0;
  a.config.rslora = j.value("use_rslora", false);
  a.config.targets = targets_of(j.contains("target_modules") ? j["target_modules"] : nlohmann::json(), file);
  if (j.contains("modules_to_save") && j["modules_to_save"].is_array())
    for (const auto& m : j["modules_to_save"])
      if (m.is_string()) a.config.trained_whole.push_back(m.get<std::string>());
  a.task_type = j.contains("task_type") && j["task_type"].is_string() ? j["task_type"].get<std::string>() : "";
  a.base_model = j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string()
                     ? j["base_model_name_or_path"].get<std::string>()
                     : "";
  try {
    validate(a.config);
  } catch (const std::invalid_argument& e) {
    bad_adapter(file, e.what());
  }
  a.weights = (fs::path(dir) / "adapter_model.safetensors").string();
  if (!fs::exists(a.weights))
    bad_adapter(a.weights, "missing (PEFT's .bin adapters are not read; save with safetensors)");
  return a;
}

void write_peft_adapter(const std::string& dir, const LoraConfig& c, const std::string& task_type,
                        const std::string& base_model, const std::map<std::string, at::Tensor>& tensors) {
  fs::create_directories(dir);
  safetensors::TensorList list;
  for (const auto& [name, t] : tensors) list.emplace_back(peft_name(name), t.detach().cpu().contiguous());
  safetensors::save_file((fs::path(dir) / "adapter_model.safetensors").string(), list, {{"format", "pt"}});
  nlohmann::json j = {{"peft_type", "LORA"},
                      {"task_type", task_type},
                      {"base_model_name_or_path", base_model},
                      {"r", c.rank},
                      {"lora_alpha", c.alpha},
                      {"lora_dropout", c.dropout},
                      {"use_rslora", c.rslora},
                      {"target_modules", c.targets},
                      {"modules_to_save", c.trained_whole.empty() ? nlohmann::json() : nlohmann::json(c.trained_whole)},
                      {"bias", "none"},
                      {"fan_in_fan_out", false},
                      {"init_lora_weights", true},
                      {"inference_mode", true},
                      {"use_dora", false},
                      {"rank_pattern", nlohmann::json::object()},
                      {"alpha_pattern", nlohmann::json::object()},
                      {"layers_to_transform", nullptr},
                      {"layers_pattern", nullptr},
                      {"revision", nullptr}};
  const auto file = (fs::path(dir) / "adapter_config.json").string();
  std::ofstream f(file);
  f << j.dump(2) << "\n";
  if (!f.flush()) throw std::runtime_error("cannot write '" + file + "'");
}

}  // namespace tandem::lora
