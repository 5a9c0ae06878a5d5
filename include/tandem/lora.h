// Low-rank adapters (LoRA, Hu et al. 2021) as PEFT defines them: a frozen linear map W gets a
// trainable update, y = W x + b + s * B A dropout(x), with A [r, in] Kaiming-uniform, B [out, r]
// zero, and s = alpha / r (alpha / sqrt(r) with rsLoRA). The adapter lives beside the layer it
// adapts, as two children of it named as PEFT names them (`q_proj.lora_A.weight`,
// `q_proj.lora_B.weight`), so a model's parameter names stay those of its checkpoint and the
// adapters' names are PEFT's. Every parameter that is not an adapter (or of a module trained
// whole, PEFT's modules_to_save) is frozen: no gradient, no optimizer state, under any strategy
// (tandem/engine.h).
//
// Tensor parallelism splits an adapter as its layer: a column-parallel layer's B by rows (A
// whole on every tp rank), a row-parallel layer's A by columns (B whole). A model's forward must
// call lora::linear for the layers it lets be adapted (tandem/llama.h does); a layer called
// directly ignores its adapter.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tandem::lora {

struct LoraConfig {
  int64_t rank = 8;
  double alpha = 8.0;
  // On the adapter's input, in training mode, from the global generator: the tp ranks of a
  // column-parallel layer must draw alike (seed every rank the same, as Tandem's commands do),
  // since their A is one replicated matrix.
  double dropout = 0.0;
  bool rslora = false;  // scale alpha / sqrt(rank) instead of alpha / rank
  // The modules adapted, by the last component of their name (PEFT's target_modules):
  // q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj for Llama.
  std::vector<std::string> targets = {"q_proj", "v_proj"};
  // Modules trained whole beside the adapters (PEFT's modules_to_save), e.g. a new
  // classification head "score"; by a component of their name, or their whole name ("4").
  std::vector<std::string> trained_whole;
  double scaling() const;
};

// Throws std::invalid_argument naming the flag (--lora-rank, --lora-alpha, --lora-dropout,
// --lora-targets) and the value that is out of range.
void validate(const LoraConfig& c);
// "q_proj,v_proj" -> {"q_proj", "v_proj"}; "all-linear" is PEFT's every linear layer but the head.
std::vector<std::string> parse_targets(const std::string& list);

// A module whose forward applies its Linear children's adapters (calls lora::linear for them):
// attach() adapts only Linear children of such modules, so that no adapter is added where the
// forward would ignore it. Llama's attention and MLP are.
class Adaptable {
 public:
  virtual ~Adaptable() = default;
};

// lora_A: x [..., in] -> dropout(x) A^T [..., r].
class DownImpl : public torch::nn::Module {
 public:
  DownImpl(at::Tensor weight, double dropout);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  double dropout;
};
TORCH_MODULE(Down);

// lora_B: h [..., r] -> s h B^T [..., out].
class UpImpl : public torch::nn::Module {
 public:
  UpImpl(at::Tensor weight, double scaling);
  torch::Tensor forward(const torch::Tensor& h);
  torch::Tensor weight;
  double scaling;
};
TORCH_MODULE(Up);

// The adapter of a module (its children lora_A and lora_B), or none.
struct Adapter {
  DownImpl* down = nullptr;
  UpImpl* up = nullptr;
  explicit operator bool() const { return down != nullptr; }
  // s B A dropout(x).
  torch::Tensor delta(const torch::Tensor& x) const { return up->forward(down->forward(x)); }
};
Adapter adapter_of(const torch::nn::Module& m);
// Whether a parameter's name is an adapter's (holds ".lora_A." or ".lora_B.").
bool is_adapter_parameter(const std::string& name);

// Gives `m` an adapter of A [r, in] and B [out, r] (its parameters requiring gradients).
void add_adapter(torch::nn::Module& m, at::Tensor a, at::Tensor b, const LoraConfig& c);

// base(x) plus the adapter's update when `base` has one: what a model calls instead of base(x)
// for a layer that may be adapted.
torch::Tensor linear(const torch::nn::Linear& base, const torch::Tensor& x);

// What attach() did: the adapted modules' names, and the trainable and total parameter counts.
struct Attached {
  std::vector<std::string> modules;
  int64_t trainable = 0, total = 0;
};

// Adds an adapter to every Linear of `model` whose name ends in a target (A as nn.Linear's
// default initialisation, from the global generator; B zero), then freezes every parameter but
// the adapters' and those of modules in c.trained_whole. Throws std::invalid_argument naming a
// target (or trained_whole module) that matches nothing, with the names it could match, or a
// matching Linear whose parent is not Adaptable.
Attached attach(torch::nn::Module& model, const LoraConfig& c);

// The merged weight W + s B A of an adapted layer's dense weight (float32 arithmetic, the
// weight's dtype out).
at::Tensor merged_weight(const at::Tensor& weight, const at::Tensor& a, const at::Tensor& b, double scaling);

// ---- PEFT adapter directories: adapter_config.json + adapter_model.safetensors.

// The PEFT names of adapter tensors: "base_model.model." + the model's name, adapter name
// dropped ("model.layers.0.self_attn.q_proj.lora_A.weight" ->
// "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").
std::string peft_name(const std::string& hf_name);

struct PeftAdapter {
  LoraConfig config;
  std::string task_type;  // CAUSAL_LM, SEQ_CLS
  std::string base_model;
  std::string weights;  // the adapter_model.safetensors path
};

// Reads DIR/adapter_config.json (peft_type LORA; r, lora_alpha, lora_dropout, use_rslora,
// target_modules as a list or "all-linear", modules_to_save) and checks that
// DIR/adapter_model.safetensors exists. Throws std::runtime_error naming the file and what is
// wrong (another peft_type, a feature Tandem does not reproduce: DoRA, bias training,
// per-module ranks, a regex target).
PeftAdapter read_peft_adapter(const std::string& dir);

// Writes DIR/adapter_config.json and DIR/adapter_model.safetensors (tensors under their model
// names; peft_name() applied here) as PEFT's save_pretrained does.
void write_peft_adapter(const std::string& dir, const LoraConfig& c, const std::string& task_type,
                        const std::string& base_model, const std::map<std::string, at::Tensor>& tensors);

}  // namespace tandem::lora
