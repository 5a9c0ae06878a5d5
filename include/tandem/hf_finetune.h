// Fine-tuning a local Hugging Face Llama-architecture directory (config.json, safetensors
// weights, SentencePiece tokenizer.model; Llama or Mixtral) on JSON lines, on the text commands' Engine and loop,
// under ddp, zero1-3, a pipeline or tensor parallelism (and their combinations); and exporting any of its checkpoints
// (whatever layout saved it) back to a directory transformers' from_pretrained loads. Every error names the file (and
// line) at fault and what to do.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tandem/llama.h"
#include "tandem/lora.h"
#include "tandem/moe.h"
#include "tandem/runtime.h"
#include "tandem/text.h"

namespace tandem::text {

// lm: next-token prediction on {"text": ...}; classify: {"text": ..., "label": ...} through
// LlamaForSequenceClassification.
enum class HfTask { kLm, kClassify };
HfTask parse_hf_task(const std::string& name);  // "lm" | "classify"; else std::invalid_argument
const char* to_string(HfTask t);
const char* peft_task_type(HfTask t);  // PEFT's task_type: CAUSAL_LM, SEQ_CLS

struct JsonlExample {
  std::string text;
  std::string label;  // classify: as written ("positive", or an integer's digits)
  bool integer_label = false;
  int64_t line = 0;  // 1-based line of the file
};

// The non-empty lines of a JSON lines file, each an object with a string "text" (and, when
// `labels`, a "label" string or non-negative integer). Throws std::runtime_error naming
// FILE:LINE and the problem (not JSON, no "text", a label of another type), or the file when it
// is missing or holds no example.
std::vector<JsonlExample> read_jsonl(const std::string& path, bool labels);
// One line of such a file (not blank); errors start with `where` ("FILE:LINE: "). line is 0.
JsonlExample parse_jsonl_line(const std::string& line, const std::string& where, bool labels);
bool blank_line(const std::string& line);  // only spaces, tabs, '\r'

// The class names by id. `model_labels`: the model's id2label when it names its classes (not
// transformers' default LABEL_i), and then every data label must be one of them (else
// std::runtime_error naming the line and the model's labels). Otherwise: integer labels are their
// own ids (names "0".."max"); string labels are sorted, a name's rank its id.
std::vector<std::string> map_labels(const std::vector<JsonlExample>& data, const std::vector<std::string>& model_labels,
                                    const std::string& path);

// The mixture-of-experts options of a Mixtral run (tandem/moe.h); unset: the default. A dense
// model refuses each of them.
struct HfMoeOptions {
  std::optional<double> aux_loss_coef;       // default: config.json's router_aux_loss_coef
  std::optional<double> z_loss_coef;         // router z-loss weight; default 0 (none)
  std::optional<double> capacity_factor;     // default 0: dropless
  std::optional<moe::AuxLossForm> aux_form;  // default pooled (as transformers); pp > 1 needs per-layer
  bool any() const { return aux_loss_coef || z_loss_coef || capacity_factor || aux_form; }
};

struct HfFinetuneConfig {
  std::string model_dir;  // --init-from: the Hugging Face directory
  HfTask task = HfTask::kLm;
  // JSON lines, or (task lm) a directory of tandem preprocess (tandem/preprocess.h): its token
  // stream read by mmap in packed windows of seq + 1 tokens (tandem/indexed_dataset.h), drawn in a
  // seeded order, the documents in a window kept apart by their EOS (llama::document_layout). No
  // validation split then.
  std::string data;
  double valid_fraction = 0.1;  // examples held out for validation, chosen by a hash of the text
  int64_t seq = 128;            // tokens per example, truncated and right-padded (<= max_position_embeddings)
  // LoRA (tandem/lora.h): adapters on lora.targets, every other weight frozen (a classifier's
  // score head trained whole). Checkpoints then hold the adapters only; `tandem export --to peft`
  // writes them as PEFT does, `--to hf --merge` the merged weights.
  bool use_lora = false;
  lora::LoraConfig lora;
  // A PEFT adapter directory to start from: its adapter_config.json replaces `lora` (rank,
  // alpha, dropout, targets) and its task_type must be the task's; use_lora is implied.
  std::string init_adapter;
  // With a preprocessed --data DIR: each rank appends one JSON line per step to
  // data_record + ".rank<R>.jsonl": {"step", "samples" (global sample numbers), "windows", "ids"
  // and "positions" (document_layout's) of the rows it trained on}. For tests and debugging of
  // the data order; it grows with steps x batch x seq. "": none.
  std::string data_record;
  HfMoeOptions moe;
  // Layout, batch, steps, optimizer, progress, metrics, trace and checkpoints (loop.checkpoints:
  // step-N/ checkpoints in any layout, which tandem export reads; its corpus, tokenizer and shape
  // fields are not used).
  TextTrainConfig loop;
};

// Checks the configuration without reading the data (layout against the world size, tp, the
// checkpoint settings); std::invalid_argument.
void validate(const HfFinetuneConfig& cfg, int world);

// The model's config.json (cfg.model_dir) with cfg.moe applied to a Mixtral's. Throws
// std::invalid_argument naming the flag and what to do for MoE options given to a dense model,
// and for a Mixtral run with --task classify, LoRA, --tp or --cp > 1 (not supported), the pooled
// load-balancing loss under --pp > 1 (use --moe-aux-loss per-layer), or an option out of range.
llama::LlamaConfig hf_model_config(const HfFinetuneConfig& cfg);

// True when `data` is a directory (a preprocessed dataset) rather than a JSON lines file.
bool is_preprocessed(const std::string& data);

// Collective: every rank reads the model directory and the data, trains, and, with a
// checkpoint directory, saves step-N checkpoints whose metadata records the model's config, the
// task and the labels, and copies the tokenizer files into checkpoint_dir/tokenizer. A Mixtral
// model's reported loss is transformers' (the LM loss plus the coefficients times the auxiliary
// losses), its auxiliary losses also reported alone (each step's StepFigures::aux_loss, z_loss; the
// run's routing in Report::moe_*).
TextReport finetune_hf(Runtime& rt, const HfFinetuneConfig& cfg);

// From a checkpoint of finetune_hf (a step-N directory or its root, whose newest is taken) to
// `out`: config.json (with the labels), the weights (model.safetensors, sharded above
// max_shard_bytes) and the tokenizer files. Local. Throws std::runtime_error naming the
// checkpoint when it is missing or was not made by finetune_hf.
// A checkpoint of a LoRA run holds the adapters only: `merge` (required then) adds s B A to each
// adapted weight of the base directory the run started from.
void export_hf(const std::string& checkpoint, const std::string& out, int64_t max_shard_bytes, bool merge = false);

// A LoRA run's checkpoint as a PEFT adapter directory (adapter_config.json,
// adapter_model.safetensors) that peft.PeftModel.from_pretrained loads over the base model.
// Throws std::runtime_error naming the checkpoint when it was not a LoRA run.
void export_peft(const std::string& checkpoint, const std::string& out);

}  // namespace tandem::text
