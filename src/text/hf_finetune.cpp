// Fine-tuning a Hugging Face Llama directory on JSON lines, and exporting its checkpoints.
#include "tandem/hf_finetune.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tandem/checkpoint.h"
#include "tandem/context_parallel.h"
#include "tandem/engine.h"
#include "tandem/grid.h"
#include "tandem/hf_tokenizer.h"
#include "tandem/llama.h"
#include "tandem/plan.h"
#include "tandem/safetensors.h"
#include "text/hf_packed.h"
#include "text/loop.h"

namespace tandem::text {

namespace fs = std::filesystem;

HfTask parse_hf_task(const std::string& name) {
  if (name == "lm") return HfTask::kLm;
  if (name == "classify") return HfTask::kClassify;
  throw std::invalid_argument("--task '" + name + "' is not one of lm, classify");
}

const char* to_string(HfTask t) { return t == HfTask::kLm ? "lm" : "classify"; }

const char* peft_task_type(HfTask t) { return t == HfTask::kLm ? "CAUSAL_LM" : "SEQ_CLS"; }

JsonlExample parse_jsonl_line(const std::string& line, const std::string& where, bool labels) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(where + "not a JSON object (" + e.what() + "); each line must be one object");
  }
  if (!j.is_object()) throw std::runtime_error(where + "not a JSON object; each line must be {\"text\": ...}");
  auto t = j.find("text");
  if (t == j.end() || !t->is_string()) {
    throw std::runtime_error(where + "has no string field \"text\"; each line must be {\"text\": \"...\"" +
                             (labels ? ", \"label\": ...}" : "}"));
  }
  JsonlExample ex{t->get<std::string>(), "", false, 0};
  if (labels) {
    auto l = j.find("label");
    if (l != j.end() && l->is_number_unsigned()) {
      ex.label = std::to_string(l->get<uint64_t>());
      ex.integer_label = true;
    } else if (l != j.end() && l->is_string() && !l->get<std::string>().empty()) {
      ex.label = l->get<std::string>();
    } else {
      throw std::runtime_error(where + "needs a \"label\": a non-empty string or a non-negative integer");
    }
  }
  return ex;
}

bool blank_line(const std::string& line) { return line.find_first_not_of(" \t\r") == std::string::npos; }

std::vector<JsonlExample> read_jsonl(const std::string& path, bool labels) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("data file '" + path + "' not found or unreadable; give a JSON lines file");
  std::vector<JsonlExample> out;
  std::string line;
  for (int64_t n = 1; std::getline(f, line); ++n) {
    if (blank_line(line)) continue;
    out.push_back(parse_jsonl_line(line, path + ":" + std::to_string(n) + ": ", labels));
    out.back().line = n;
  }
  if (out.empty()) throw std::runtime_error("data file '" + path + "' holds no examples");
  return out;
}

std::vector<std::string> map_labels(const std::vector<JsonlExample>& data, const std::vector<std::string>& model_labels,
                                    const std::string& path) {
  if (!model_labels.empty()) {
    for (const auto& ex : data) {
      if (std::find(model_labels.begin(), model_labels.end(), ex.label) == model_labels.end()) {
        std::string known;
        for (const auto& l : model_labels) known += (known.empty() ? "" : ", ") + l;
        throw std::runtime_error(path + ":" + std::to_string(ex.line) + ": label '" + ex.label +
                                 "' is not one of the model's labels {" + known +
                                 "}; fix the data or fine-tune from a model without named labels");
      }
    }
    return model_labels;
  }
  const bool all_int = std::all_of(data.begin(), data.end(), [](const JsonlExample& e) { return e.integer_label; });
  if (all_int) {
    uint64_t top = 0;
    for (const auto& ex : data) top = std::max<uint64_t>(top, std::stoull(ex.label));
    if (top >= 100000) throw std::runtime_error(path + ": integer label " + std::to_string(top) + " is too large");
    std::vector<std::string> names;
    for (uint64_t i = 0; i <= top; ++i) names.push_back(std::to_string(i));
    return names;
  }
  std::set<std::string> names;
  for (const auto& ex : data) names.insert(ex.label);
  return {names.begin(), names.end()};
}

void validate(const HfFinetuneConfig& cfg, int world) {
  if (cfg.model_dir.empty()) throw std::invalid_argument("--init-from needs a Hugging Face model directory");
  if (cfg.seq < 2) throw std::invalid_argument("--seq must be >= 2, got " + std::to_string(cfg.seq));
  const auto& pc = cfg.loop.parallel;
  if (pc.sequence_parallel && pc.tp > 1 && cfg.seq % pc.tp != 0) {
    throw std::invalid_argument("--sequence-parallel splits each sequence over the --tp " + std::to_string(pc.tp) +
                                " ranks: --seq " + std::to_string(cfg.seq) + " must be a multiple of " +
                                std::to_string(pc.tp));
  }
  if (cfg.valid_fraction < 0 || cfg.valid_fraction >= 1)
    throw std::invalid_argument("--valid-fraction must be in [0, 1)");
  validate(cfg.loop, world);
}

namespace {

[[noreturn]] void refuse_for_moe(const HfFinetuneConfig& cfg, const std::string& what) {
  throw std::invalid_argument("'" + cfg.model_dir + "' is a mixture-of-experts model (Mixtral), which " + what);
}

// cfg.moe into a Mixtral's config, and the layouts and tasks its layers do not run under refused.
void apply_moe_options(const HfFinetuneConfig& cfg, llama::LlamaConfig& mc) {
  const auto& o = cfg.moe;
  const auto& pc = cfg.loop.parallel;
  if (cfg.task != HfTask::kLm) refuse_for_moe(cfg, "fine-tunes as a language model only: use --task lm");
  if (cfg.use_lora || !cfg.init_adapter.empty())
    refuse_for_moe(cfg, "LoRA does not adapt (its experts are not adaptable modules): fine-tune every weight, "
                        "without --lora-rank or --init-adapter");
  if (pc.cp > 1) refuse_for_moe(cfg, "context parallelism does not split: use --cp 1");
  const std::pair<const char*, std::optional<double>> given[] = {{"--moe-aux-loss-coef", o.aux_loss_coef},
                                                                 {"--moe-z-loss-coef", o.z_loss_coef},
                                                                 {"--capacity-factor", o.capacity_factor}};
  for (const auto& [flag, v] : given)
    if (v && !(*v >= 0)) throw std::invalid_argument(std::string(flag) + " must be >= 0, got " + std::to_string(*v));
  mc.router_aux_loss_coef = o.aux_loss_coef.value_or(mc.router_aux_loss_coef);
  mc.moe_z_loss_coef = o.z_loss_coef.value_or(0.0);
  mc.moe_capacity_factor = o.capacity_factor.value_or(0.0);
  mc.moe_aux_form = o.aux_form.value_or(moe::AuxLossForm::kPooled);
  if (pc.pp > 1 && mc.moe_aux_form == moe::AuxLossForm::kPooled)
    throw std::invalid_argument("--moe-aux-loss pooled (the default: transformers' load-balancing loss, over all "
                                "layers at once) needs every layer in one process; with --pp " +
                                std::to_string(pc.pp) + " use --moe-aux-loss per-layer");
  try {
    moe::validate(llama::moe_config(mc));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("--moe-aux-loss-coef, --moe-z-loss-coef, --capacity-factor: " + std::string(e.what()));
  }
}

}  // namespace

llama::LlamaConfig hf_model_config(const HfFinetuneConfig& cfg) {
  auto mc = llama::load_config(cfg.model_dir);
  if (mc.is_moe()) {
    apply_moe_options(cfg, mc);
  } else if (cfg.moe.any()) {
    throw std::invalid_argument("--moe-aux-loss-coef, --moe-z-loss-coef, --capacity-factor and --moe-aux-loss apply "
                                "to a mixture-of-experts model; '" +
                                cfg.model_dir + "' is dense (no num_local_experts): leave them out");
  }
  return mc;
}

namespace hf_impl {

// The model's class names from config.json's id2label, unless they are transformers' defaults.
std::vector<std::string> named_labels(const std::string& dir) {
  std::ifstream f(fs::path(dir) / "config.json");
  auto j = nlohmann::json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.contains("id2label") || !j["id2label"].is_object()) return {};
  std::vector<std::string> names(j["id2label"].size());
  for (auto& [k, v] : j["id2label"].items()) {
    const size_t i = std::stoul(k);
    if (i >= names.size() || !v.is_string()) return {};
    names[i] = v.get<std::string>();
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] != "LABEL_" + std::to_string(i)) return names;
  }
  return {};
}

// The module that trains and how its parameter names read as Hugging Face names.
struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<Engine> engine;
  std::string form;     // "sequential" (pipeline-ready) or "tree" (transformers' module tree)
  lora::Attached lora;  // what LoRA adapted (none without it)
};

// The task's Sequential with its children named by position: a pipeline stage names its layers
// so, and every layout then saves and loads the same names. A tied LM: tied_causal_lm_sequential's
// (for tp and cp only); the classifier has no LM head to tie.
torch::nn::Sequential positional(const llama::LlamaConfig& mc, HfTask task) {
  const auto named = task == HfTask::kClassify ? llama::sequence_classifier_sequential(mc)
                     : mc.tie_word_embeddings  ? llama::tied_causal_lm_sequential(mc)
                                               : llama::causal_lm_sequential(mc);
  torch::nn::Sequential net;
  for (const auto& child : *named) net->push_back(child);
  return net;
}

// The head's Hugging Face name: the LM's lm_head, the classifier's score.
const char* head_name(HfTask task) { return task == HfTask::kClassify ? "score" : "lm_head"; }

// A checkpoint parameter's Hugging Face name: the positional Sequential's mapped, the tree's its own.
std::string hf_name(const std::string& form, const std::string& name, int64_t layers, HfTask task) {
  return form == "sequential" ? llama::positional_to_hf(name, layers, head_name(task)) : name;
}

// Rows of token ids [N, seq] and their targets: for the LM the next token at each position (-100
// after the text's last token: nothing to predict), aligned with the ids so that any cut along
// the sequence (context parallelism) cuts both alike; for
// classification [N, 2]: the class id, and the position the classifier pools (its last token
// that is not padding), which the per-position scores of the Sequential's last stage need.
struct Encoded {
  torch::Tensor ids, targets;
};

Encoded encode(const hf::Tokenizer& tok, const std::vector<const JsonlExample*>& rows, int64_t seq, bool lm,
               int64_t pad, const std::vector<std::string>& labels) {
  const int64_t n = static_cast<int64_t>(rows.size());
  auto ids = torch::full({n, seq}, pad, torch::kLong);
  auto targets = lm ? torch::full({n, seq}, int64_t{-100}, torch::kLong) : torch::zeros({n, 2}, torch::kLong);
  auto* pi = ids.data_ptr<int64_t>();
  auto* pt = targets.data_ptr<int64_t>();
  const auto& s = tok.special();
  for (int64_t i = 0; i < n; ++i) {
    auto v = tok.encode(rows[i]->text);
    // The LM learns where a text ends: EOS after it even when the tokenizer does not add one.
    if (lm && !s.add_eos && s.eos >= 0) v.push_back(s.eos);
    const int64_t len = std::min<int64_t>(seq, static_cast<int64_t>(v.size()));
    for (int64_t k = 0; k < len; ++k) pi[i * seq + k] = v[k];
    if (lm) {
      for (int64_t k = 0; k + 1 < len; ++k) pt[i * seq + k] = v[k + 1];
    } else {
      pt[2 * i] = std::find(labels.begin(), labels.end(), rows[i]->label) - labels.begin();
    }
  }
  if (!lm && n > 0) targets.select(1, 1).copy_(llama::pooled_positions(ids, pad));
  return {ids, targets};
}

torch::Tensor lm_loss_sum(const torch::Tensor& logits, const torch::Tensor& targets) {
  auto pred = logits.reshape({-1, logits.size(2)}).to(torch::kFloat);
  auto o = torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum);
  return torch::nn::functional::cross_entropy(pred, targets.reshape({-1}), o);
}

// lm_loss_sum of logits split along the vocabulary over `tp` (the tensor-parallel LM head's):
// the same value on every tp rank, without gathering the logits.
torch::Tensor vocab_parallel_lm_loss_sum(const torch::Tensor& logits, const torch::Tensor& targets, const CommPtr& tp) {
  auto pred = logits.to(torch::kFloat);
  auto real = targets.ne(-100);
  auto per_token = tp::vocab_parallel_cross_entropy(pred, targets.masked_fill(real.logical_not(), 0), tp);
  return (per_token * real.to(per_token.scalar_type())).sum();
}

// The classifier's logits [B, labels] from its per-position scores [B, T, labels] and the
// targets [B, 2] (class, pooled position).
torch::Tensor cls_logits(const torch::Tensor& scores, const torch::Tensor& y) {
  return llama::pool_scores(scores, y.select(1, 1)).to(torch::kFloat);
}

torch::Tensor cls_loss_sum(const torch::Tensor& scores, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(cls_logits(scores, y), y.select(1, 0),
                                              torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

// Loss terms: predicted tokens that are not padding (LM), or rows (classification).
double terms(const torch::Tensor& targets, bool lm) {
  if (!lm) return static_cast<double>(targets.size(0));
  return static_cast<double>(targets.ne(-100).sum().item<int64_t>());
}

// Adapters on the configured targets, the rest frozen (cfg.lora.trained_whole: a classifier's
// score head, which the Sequential form names by its position, the last).
void attach_adapters(torch::nn::Module& net, const HfFinetuneConfig& cfg, const llama::LlamaConfig& mc, bool positional,
                     Model& m) {
  auto c = cfg.lora;
  if (positional)
    for (auto& w : c.trained_whole)
      if (w == "score") w = std::to_string(mc.num_hidden_layers + 2);
  m.lora = lora::attach(net, c);
}

// The first source that holds a parameter gives it.
class FirstOf final : public ParameterSource {
 public:
  explicit FirstOf(std::vector<std::shared_ptr<const ParameterSource>> s) : sources_(std::move(s)) {}
  bool find(const std::string& name, std::vector<int64_t>* shape) const override {
    for (const auto& s : sources_)
      if (s->find(name, shape)) return true;
    return false;
  }
  void read(const std::string& name, int64_t first, at::Tensor dest) const override {
    std::vector<int64_t> shape;
    for (const auto& s : sources_) {
      if (s->find(name, &shape)) return s->read(name, first, dest);
    }
    throw std::runtime_error("no source holds '" + name + "'");
  }

 private:
  std::vector<std::shared_ptr<const ParameterSource>> sources_;
};

// The base directory's weights (`to_hf`: a parameter's name there, "" for adapters and a new
// head), and with --init-adapter the adapter's A and B (and a trained-whole head) from PEFT's
// file, under "base_model.model." + the Hugging Face name `hf` gives.
std::shared_ptr<const ParameterSource> initial_values(const HfFinetuneConfig& cfg,
                                                      const safetensors::Checkpoint& weights,
                                                      const std::function<std::string(const std::string&)>& to_hf,
                                                      const std::function<std::string(const std::string&)>& hf) {
  auto base = safetensors::parameter_source(weights, to_hf);
  if (cfg.init_adapter.empty()) return base;
  const safetensors::Checkpoint file(lora::read_peft_adapter(cfg.init_adapter).weights);
  // A classifier's head comes from the adapter when it holds one (else: a fresh head, or the base's).
  const bool head = cfg.task == HfTask::kClassify && file.contains(lora::peft_name("score.weight"));
  const std::function<std::string(const std::string&)> to_peft = [=](const std::string& n) {
    const auto name = hf(n);
    if (lora::is_adapter_parameter(n)) return lora::peft_name(name);
    if (head && name.rfind("score.", 0) == 0) return lora::peft_name(name);
    return std::string();
  };
  auto from_adapter = safetensors::parameter_source(file, to_peft);
  return std::make_shared<FirstOf>(std::vector<std::shared_ptr<const ParameterSource>>{from_adapter, base});
}

// The model of the task, initialised from the directory's weights: checked against the
// directory whole (headers only), then read by each rank in its part (EngineOptions::init_from). A
// classification head the directory lacks starts at random (seeded, the same on every rank).
Model build(Runtime& rt, const HfFinetuneConfig& cfg, const llama::LlamaConfig& mc, const at::Tensor& sample) {
  const safetensors::Checkpoint weights(cfg.model_dir);
  Model m;
  EngineOptions eo;
  const bool lm = cfg.task == HfTask::kLm;
  eo.model_name = lm ? "llama-lm" : "llama-classify";
  // LoRA: checkpoints hold what trains; the frozen base comes from the directory again.
  eo.save_frozen = !cfg.use_lora;
  if (lm && mc.tie_word_embeddings && cfg.loop.parallel.tp == 1 && cfg.loop.parallel.cp == 1) {
    llama::LlamaForCausalLM net(mc);
    const std::function<std::string(const std::string&)> base = [](const std::string& n) {
      return lora::is_adapter_parameter(n) ? std::string() : n;
    };
    if (cfg.use_lora) attach_adapters(*net, cfg, mc, false, m);
    llama::check_weights(*net, weights, false, base);
    eo.init_from = initial_values(cfg, weights, base, [](const std::string& n) { return n; });
    m.engine = make_engine(rt, cfg.loop, net, sample, eo);
    m.module = net.ptr();
    m.form = "tree";
    return m;
  }
  const bool new_head = !lm && !weights.contains("score.weight");
  const auto task = cfg.task;
  const int64_t layers = mc.num_hidden_layers;
  const std::function<std::string(const std::string&)> hf = [=](const std::string& n) {
    return hf_name("sequential", n, layers, task);
  };
  const std::function<std::string(const std::string&)> to_hf = [=](const std::string& n) {
    auto name = hf(n);
    return lora::is_adapter_parameter(n) || (new_head && name == "score.weight") ? std::string() : name;
  };
  auto net = positional(mc, task);
  if (cfg.use_lora) attach_adapters(*net, cfg, mc, true, m);
  // A classifier may start from an LM's directory: its lm_head goes unused.
  llama::check_weights(*net, weights, /*allow_unused=*/!lm, to_hf);
  // Each rank reads only what it holds: its stage's tensors, its tensor-parallel blocks of them,
  // under ZeRO-3 its shard's elements.
  eo.init_from = initial_values(cfg, weights, to_hf, hf);
  if (cfg.loop.parallel.tp > 1)
    eo.tensor_parallel = [](torch::nn::Sequential dense, CommPtr tp, const tp::TensorParallelOptions& o) {
      return llama::tensor_parallel(dense, tp, o);
    };
  m.engine = make_engine(rt, cfg.loop, net, sample, eo);
  m.module = net.ptr();
  m.form = "sequential";
  return m;
}

void copy_bytes(const fs::path& from, const fs::path& to) {
  std::ifstream in(from, std::ios::binary);
  std::ofstream out(to, std::ios::binary);
  out << in.rdbuf();
  if (!out) throw std::runtime_error("copying '" + from.string() + "' to '" + to.string() + "' failed");
}

void copy_tokenizer(const std::string& from, const std::string& to) {
  fs::create_directories(to);
  for (const auto& name : hf::Tokenizer::file_names()) {
    if (fs::exists(fs::path(from) / name)) copy_bytes(fs::path(from) / name, fs::path(to) / name);
  }
}

// The report's line of a Mixtral run: how it routes (the Engine's "routing" line has the figures).
std::string moe_summary(const llama::LlamaConfig& mc) {
  std::ostringstream os;
  os << mc.num_local_experts << " per layer, top " << mc.num_experts_per_tok << ", load-balancing loss "
     << moe::to_string(mc.moe_aux_form) << " x " << mc.router_aux_loss_coef;
  if (mc.moe_z_loss_coef > 0) os << ", z-loss x " << mc.moe_z_loss_coef;
  os << "; capacity factor ";
  if (mc.moe_capacity_factor > 0) {
    os << mc.moe_capacity_factor;
  } else {
    os << "none (dropless)";
  }
  return os.str();
}

// Validation: loss per predicted token (LM) or accuracy (classify). Collective.
void evaluate(Runtime& rt, Engine& eng, const Encoded& valid, bool lm, int64_t limit, TextReport& rep) {
  const int64_t n = limit >= 0 ? std::min<int64_t>(limit, valid.ids.size(0)) : valid.ids.size(0);
  double sum = 0.0, count = 0.0, correct = 0.0;
  eng.evaluate(valid.ids, n, 64, [&](const torch::Tensor& out, int64_t from, int64_t to) {
    auto y = valid.targets.narrow(0, from, to - from).to(out.device());
    sum += (lm ? lm_loss_sum(out, y) : cls_loss_sum(out, y)).item<double>();
    count += terms(y, lm);
    if (!lm) correct += cls_logits(out, y).argmax(1).eq(y.select(1, 0)).sum().item<double>();
  });
  auto t = torch::tensor({sum, count, correct}, torch::kDouble).to(rt.device());
  rt.world()->allreduce(t, ReduceOp::kSum);
  auto h = t.cpu();
  if (lm) {  // the report's validation loss is per token
    rep.eval_loss = h[1].item<double>() > 0 ? h[0].item<double>() / h[1].item<double>() : -1.0;
  } else {
    rep.test_samples = static_cast<int64_t>(h[1].item<double>());
    rep.test_unit = "validation examples";
    rep.test_accuracy = rep.test_samples > 0 ? h[2].item<double>() / h[1].item<double>() : 0.0;
  }
}

}  // namespace hf_impl

TextReport finetune_hf(Runtime& rt, const HfFinetuneConfig& given) {
  using namespace hf_impl;
  HfFinetuneConfig cfg = given;
  validate(cfg, rt.world_size());
  const bool lm = cfg.task == HfTask::kLm;
  auto tok = hf::Tokenizer::load(cfg.model_dir);
  auto mc = hf_model_config(cfg);
  if (tok.vocab_size() > mc.vocab_size) {
    throw std::runtime_error("'" + cfg.model_dir + "': tokenizer.model has " + std::to_string(tok.vocab_size()) +
                             " pieces, more than config.json's vocab_size " + std::to_string(mc.vocab_size));
  }
  if (lm && mc.tie_word_embeddings && cfg.loop.parallel.pp > 1) {
    throw std::invalid_argument("'" + cfg.model_dir +
                                "' ties its input and output embeddings, which a pipeline cannot split; run without "
                                "--pp");
  }
  if (cfg.loop.parallel.tp > 1) {
    try {
      llama::check_tensor_parallel(mc, cfg.loop.parallel.tp);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("'" + cfg.model_dir + "/config.json', --tp " + std::to_string(cfg.loop.parallel.tp) +
                                  ": " + e.what());
    }
  }
  if (cfg.loop.parallel.cp > 1) cp::check_length(cfg.seq, cfg.loop.parallel.cp);  // names --seq and the rule
  const auto& pc = cfg.loop.parallel;
  if (cfg.task == HfTask::kLm && mc.tie_word_embeddings && pc.tp * pc.cp > 1 && pc.strategy == Strategy::kZero3) {
    // The tied head of the Sequential form reads the embedding's weight outside the embedding's
    // ZeRO-3 unit, where that weight is released.
    throw std::invalid_argument("'" + cfg.model_dir +
                                "' ties its LM head to the embedding (tie_word_embeddings), which --strategy zero3 "
                                "cannot shard under --tp or --cp (the head reads the embedding's weight outside its "
                                "unit); use --strategy zero2, zero1 or ddp, or --tp 1 --cp 1");
  }
  if (cfg.seq > mc.max_position_embeddings) {
    throw std::invalid_argument("--seq " + std::to_string(cfg.seq) + " exceeds the model's max_position_embeddings " +
                                std::to_string(mc.max_position_embeddings));
  }
  if (!cfg.init_adapter.empty()) {  // the adapter's configuration is the run's
    const auto adapter = lora::read_peft_adapter(cfg.init_adapter);
    if (!adapter.task_type.empty() && adapter.task_type != peft_task_type(cfg.task)) {
      throw std::invalid_argument("--init-adapter '" + cfg.init_adapter + "' was made for task_type " +
                                  adapter.task_type + ", not for --task " + to_string(cfg.task));
    }
    cfg.lora = adapter.config;
    cfg.use_lora = true;
  }
  if (cfg.use_lora) {
    lora::validate(cfg.lora);
    // PEFT's SEQ_CLS trains the head whole (its modules_to_save: "classifier", "score"; Llama's
    // is score); an LM trains nothing whole beside the adapters.
    auto& whole = cfg.lora.trained_whole;
    if (!lm) {
      whole = {"score"};
    } else if (!whole.empty()) {
      throw std::invalid_argument("--init-adapter '" + cfg.init_adapter + "' trains modules whole (modules_to_save " +
                                  nlohmann::json(whole).dump() +
                                  "), which Tandem reads for a classifier's score head only");
    }
  }
  std::unique_ptr<PackedSet> packed;
  std::vector<JsonlExample> data;
  if (is_preprocessed(cfg.data)) {
    packed = std::make_unique<PackedSet>(cfg, tok, mc, rt.rank());
    mc.document_separator = tok.special().eos;
  } else {
    data = read_jsonl(cfg.data, !lm);
  }
  std::vector<std::string> labels;
  if (!lm) {
    labels = map_labels(data, named_labels(cfg.model_dir), cfg.data);
    if (labels.size() < 2) throw std::runtime_error("'" + cfg.data + "' has one label only; classification needs two");
    mc.num_labels = static_cast<int64_t>(labels.size());
    // The classifier pools the last token that is not padding: padding needs an id.
    if (mc.pad_token_id < 0) mc.pad_token_id = tok.special().pad >= 0 ? tok.special().pad : tok.special().eos;
  }
  const auto& s = tok.special();
  const int64_t pad = mc.pad_token_id >= 0 ? mc.pad_token_id : (s.pad >= 0 ? s.pad : std::max<int64_t>(s.eos, 0));
  std::vector<const JsonlExample*> train, valid;
  for (const auto& ex : data) {
    (split_of(ex.text, cfg.valid_fraction, 0.0) == Split::kValid ? valid : train).push_back(&ex);
  }
  if (train.empty() && !packed)
    throw std::runtime_error("'" + cfg.data + "': every example fell into validation; lower --valid-fraction");
  const auto tr = encode(tok, train, cfg.seq, lm, pad, labels);
  const auto va = encode(tok, valid, cfg.seq, lm, pad, labels);

  torch::manual_seed(cfg.loop.seed);
  Model model = build(rt, cfg, mc, packed ? packed->sample() : tr.ids);
  Engine& eng = *model.engine;
  TextReport rep;
  rep.command = "finetune";
  rep.model = std::string(mc.is_moe() ? "Mixtral " : "Llama ") + std::to_string(mc.num_hidden_layers) +
              " layers, hidden " + std::to_string(mc.hidden_size) +
              (mc.is_moe() ? ", " + std::to_string(mc.num_local_experts) + " experts (top " +
                                 std::to_string(mc.num_experts_per_tok) + ")"
                           : "") +
              ", vocabulary " + std::to_string(mc.vocab_size) + ", seq " + std::to_string(cfg.seq) + " (" +
              to_string(cfg.task) + ")";
  rep.global_batch = cfg.loop.batch;
  rep.labels = labels;
  rep.initialised_from_checkpoint = true;
  describe_engine(eng, rep);
  rep.context.emplace_back("data", packed ? packed->describe()
                                          : std::to_string(train.size()) + " train / " + std::to_string(valid.size()) +
                                                " validation examples" +
                                                (lm ? "" : ", " + std::to_string(labels.size()) + " labels"));
  rep.context.emplace_back("initialised", "from " + cfg.model_dir);

  nlohmann::json run = {{"task", to_string(cfg.task)},
                        {"labels", labels},
                        {"form", model.form},
                        {"batch", cfg.loop.batch},
                        {"seed", cfg.loop.seed}};
  if (packed) run["dataset"] = packed->identity();
  run["config"] = nlohmann::json::parse(llama::config_json(mc));
  if (cfg.use_lora) {  // what export needs: the adapters' shape and the base they adapt
    run["lora"] = {{"rank", cfg.lora.rank},       {"alpha", cfg.lora.alpha},
                   {"dropout", cfg.lora.dropout}, {"rslora", cfg.lora.rslora},
                   {"targets", cfg.lora.targets}, {"trained_whole", cfg.lora.trained_whole}};
    run["base"] = fs::absolute(cfg.model_dir).lexically_normal().string();
  }
  const auto& ck = cfg.loop.checkpoints;
  if (!ck.dir.empty() && rt.rank() == 0) copy_tokenizer(cfg.model_dir, (fs::path(ck.dir) / "tokenizer").string());
  // The data position holds only with the same examples, global batch and seed.
  LoopCheckpoints checkpoints(eng, cfg.loop, "hf_finetune", run, {"task", "labels", "seed", "lora", "dataset"});
  const int64_t samples = packed ? packed->size() : tr.ids.size(0);
  checkpoints.set_epoch_size(samples);
  tensorboard::Log tb(cfg.loop.tensorboard, rt.rank() == 0);
  LoopHooks hooks = checkpoints.start();
  hooks.tensorboard = &tb;
  hooks.moe = mc.is_moe();
  hooks.moe_aux_coef = mc.router_aux_loss_coef;
  hooks.moe_z_coef = mc.moe_z_loss_coef;
  if (packed)
    packed->start(hooks.first_step, hooks.first_sample >= 0 ? hooks.first_sample : hooks.first_step * cfg.loop.batch,
                  cfg.loop.batch);
  LossFn loss_fn = lm ? LossFn(lm_loss_sum) : LossFn(cls_loss_sum);
  if (lm && cfg.loop.parallel.tp > 1) {
    loss_fn = [tp = eng.grid()->tp()](const torch::Tensor& logits, const torch::Tensor& targets) {
      return vocab_parallel_lm_loss_sum(logits, targets, tp);
    };
  }
  const EngineStats loop = train_loop(
      rt, cfg.loop, eng, samples,
      [&](const std::vector<int64_t>& idx, int64_t from, int64_t to) {
        if (packed) {
          auto [x, y] = packed->batch(idx, from, to);
          return std::make_pair(x.to(rt.device()), y.to(rt.device()));
        }
        return std::make_pair(rows(tr.ids, idx, from, to).to(rt.device()),
                              rows(tr.targets, idx, from, to).to(rt.device()));
      },
      loss_fn,
      [&](const std::vector<int64_t>& idx, int64_t from, int64_t to) {
        return packed ? packed->terms(idx, from, to) : terms(rows(tr.targets, idx, from, to), lm);
      },
      rep, hooks);
  checkpoints.finish();
  if (cfg.loop.evaluate && !rep.stopped && va.ids.defined() && va.ids.size(0) > 0)
    evaluate(rt, eng, va, lm, cfg.loop.eval_limit, rep);
  collect_engine_report(eng, loop, rep);
  if (cfg.use_lora) {  // with the optimizer state, and what training every weight would hold instead
    const auto& c = cfg.lora;
    const double mib = 1024.0 * 1024.0, opt = static_cast<double>(rep.optimizer_state_bytes);
    const double full =
        opt * static_cast<double>(rep.parameters) / static_cast<double>(std::max<int64_t>(1, rep.trainable_parameters));
    std::ostringstream line;
    line << "LoRA r " << c.rank << ", alpha " << c.alpha << (c.rslora ? " (rsLoRA)" : "") << ", dropout " << c.dropout
         << ", on " << model.lora.modules.size() << " modules (" << nlohmann::json(c.targets).dump() << ")";
    if (!cfg.init_adapter.empty()) line << ", from " << cfg.init_adapter;
    line << std::fixed << std::setprecision(2) << "; optimizer state " << opt / mib
         << " MiB on rank 0 (every weight: " << full / mib << " MiB)";
    rep.context.emplace_back("adapters", line.str());
  }
  if (rt.rank() == 0) {  // tandem plan's memory for a transformer of this shape (per-rank figures only)
    auto spec = plan::llama_model(mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads,
                                  mc.intermediate_size, cfg.seq, mc.vocab_size, static_cast<double>(rep.parameters));
    if (cfg.use_lora) spec.trainable_parameters = static_cast<double>(rep.trainable_parameters);
    plan::add_planned_memory(spec, cfg.loop.parallel, rt.world_size(), cfg.loop.batch, "adamw", {}, rep);
    rep.plan_memory_bytes_per_stage.clear();
  }
  if (mc.is_moe()) rep.context.emplace_back("experts", moe_summary(mc));
  if (rt.rank() == 0 && !cfg.loop.metrics_path.empty()) write_metrics(cfg.loop.metrics_path, rep);
  tb.finish(rep);
  return rep;
}

namespace hf_impl {

// A checkpoint of finetune_hf, read whole.
struct Finetuned {
  std::string dir, root;  // the step-N directory and the run's --checkpoint-dir
  FullCheckpoint full;
  nlohmann::json run;  // its "hf_finetune" record
  llama::LlamaConfig mc;
  std::string form;
  HfTask task = HfTask::kLm;
  std::string hf(const std::string& n) const { return hf_name(form, n, mc.num_hidden_layers, task); }
};

Finetuned read_finetuned(const std::string& checkpoint, const char* to) {
  if (!fs::is_directory(checkpoint)) throw std::runtime_error("checkpoint '" + checkpoint + "' not found");
  Finetuned f;
  // A root of step-N/ checkpoints (its newest is taken), or one step-N directory inside one.
  f.dir = latest_checkpoint(checkpoint);
  f.root = checkpoint;
  if (f.dir.empty()) {
    if (!fs::exists(fs::path(checkpoint) / "manifest.json")) {
      throw std::runtime_error("'" + checkpoint +
                               "' holds no complete checkpoint; give the --checkpoint-dir of tandem finetune "
                               "--init-from, or one step-N directory in it");
    }
    f.dir = checkpoint;
    f.root = fs::path(checkpoint).lexically_normal().parent_path().string();
  }
  f.full = read_full_checkpoint(f.dir);
  const auto extra = nlohmann::json::parse(f.full.meta.extra_json, nullptr, false);
  if (extra.is_discarded() || !extra.contains("hf_finetune")) {
    throw std::runtime_error("checkpoint '" + f.dir + "' was not made by tandem finetune --init-from; export --to " +
                             to + " needs one that was");
  }
  f.run = extra["hf_finetune"];
  f.mc = llama::parse_config(f.run["config"].dump(), f.dir);
  f.form = f.run["form"];
  f.task = parse_hf_task(f.run["task"].get<std::string>());
  return f;
}

lora::LoraConfig lora_of(const nlohmann::json& j) {
  lora::LoraConfig c;
  c.rank = j.at("rank");
  c.alpha = j.at("alpha");
  c.dropout = j.at("dropout");
  c.rslora = j.at("rslora");
  c.targets = j.at("targets").get<std::vector<std::string>>();
  c.trained_whole = j.at("trained_whole").get<std::vector<std::string>>();
  return c;
}

// The checkpoint's parameters by Hugging Face name; a LoRA run's adapted weights merged into
// the base directory's (W + s B A), its trained-whole head taken from the checkpoint.
std::map<std::string, at::Tensor> hf_parameters(const Finetuned& f, bool merge) {
  std::map<std::string, at::Tensor> by_hf;
  for (auto& [n, t] : f.full.params) by_hf[f.hf(n)] = t;
  if (!f.run.contains("lora")) return by_hf;
  if (!merge) {
    throw std::runtime_error("checkpoint '" + f.dir +
                             "' holds LoRA adapters only; export them with --to peft, or merged into the base "
                             "weights with --to hf --merge");
  }
  const auto c = lora_of(f.run["lora"]);
  const std::string base_dir = f.run.at("base");
  if (!fs::exists(fs::path(base_dir) / "config.json")) {
    throw std::runtime_error("--merge: the base model '" + base_dir +
                             "' the run started from is gone; restore it there to merge");
  }
  const safetensors::Checkpoint base(base_dir);
  std::map<std::string, at::Tensor> out;
  for (const auto& name : base.names()) out[name] = base.get(name).to(at::kFloat);
  for (auto& [name, t] : by_hf) {
    const auto a = name.find(".lora_A.weight");
    if (a != std::string::npos) {
      const auto module = name.substr(0, a);
      const auto b = by_hf.find(module + ".lora_B.weight");
      const auto w = out.find(module + ".weight");
      if (b == by_hf.end() || w == out.end())
        throw std::runtime_error("checkpoint '" + f.dir + "': no weight to merge the adapter '" + name + "' into");
      w->second = lora::merged_weight(w->second, t, b->second, c.scaling());
    } else if (name.find(".lora_B.weight") == std::string::npos) {
      out[name] = t;  // trained whole
    }
  }
  return out;
}

}  // namespace hf_impl

void export_hf(const std::string& checkpoint, const std::string& out, int64_t max_shard_bytes, bool merge) {
  using namespace hf_impl;
  const auto f = read_finetuned(checkpoint, "hf");
  if (merge && !f.run.contains("lora")) {
    throw std::runtime_error("--merge: checkpoint '" + f.dir +
                             "' is not of a LoRA run (its weights are whole); "
                             "export it without --merge");
  }
  const auto& dir = f.dir;
  const auto& root = f.root;
  const auto& run = f.run;
  const auto& mc = f.mc;
  safetensors::SaveOptions so;
  so.max_shard_bytes = max_shard_bytes;
  const auto by_hf = hf_parameters(f, merge);
  auto fill = [&](torch::nn::Module& m) {
    torch::NoGradGuard ng;
    for (auto& p : m.named_parameters()) {
      auto it = by_hf.find(p.key());
      if (it == by_hf.end())
        throw std::runtime_error("checkpoint '" + dir + "' has no parameter for '" + p.key() + "'");
      p.value().copy_(it->second);
    }
  };
  if (f.task == HfTask::kClassify) {
    llama::LlamaForSequenceClassification m(mc);
    fill(*m);
    llama::save_pretrained(m, out, so);
  } else {
    llama::LlamaForCausalLM m(mc);
    fill(*m);
    llama::save_pretrained(m, out, so);
  }
  const auto labels = run["labels"].get<std::vector<std::string>>();
  if (!labels.empty()) {  // the class names, for pipelines and the model card
    const auto file = fs::path(out) / "config.json";
    std::ifstream in(file);
    auto j = nlohmann::json::parse(in);
    j["id2label"] = nlohmann::json::object();
    j["label2id"] = nlohmann::json::object();
    for (size_t i = 0; i < labels.size(); ++i) {
      j["id2label"][std::to_string(i)] = labels[i];
      j["label2id"][labels[i]] = i;
    }
    std::ofstream(file) << j.dump(2) << '\n';
  }
  const auto tok_dir = fs::path(root) / "tokenizer";
  if (!fs::exists(tok_dir / "tokenizer.model")) {
    throw std::runtime_error("'" + tok_dir.string() + "' holds no tokenizer.model; the checkpoint is incomplete");
  }
  copy_tokenizer(tok_dir.string(), out);
}

void export_peft(const std::string& checkpoint, const std::string& out) {
  using namespace hf_impl;
  const auto f = read_finetuned(checkpoint, "peft");
  if (!f.run.contains("lora")) {
    throw std::runtime_error("checkpoint '" + f.dir +
                             "' is not of a LoRA run (no adapters); export its weights with --to hf");
  }
  const auto c = lora_of(f.run["lora"]);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [n, t] : f.full.params) tensors[f.hf(n)] = t;
  lora::write_peft_adapter(out, c, peft_task_type(f.task), f.run.value("base", ""), tensors);
}

}  // namespace tandem::text
