// Shared by the unit and distributed tests of `tandem export --to hf`: a few fine-tuning steps
// of a directory of tests/hf/hf_fixture.py under a layout the caller sets, the checkpoint
// exported, and the logits Tandem computes from that checkpoint written for
// `hf_fixture.py check-export` to compare with transformers' on the export.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>

#include "tandem/checkpoint.h"
#include "tandem/hf_finetune.h"
#include "tandem/llama.h"
#include "tandem/runtime.h"
#include "tandem/safetensors.h"

namespace tandem::test {

// `hf_fixture.py MODE` in .venv-hf (TANDEM_SOURCE_DIR set), offline.
inline std::string fixture_script(const std::string& mode) {
  const std::string src = std::getenv("TANDEM_SOURCE_DIR");
  return "HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 " + src + "/.venv-hf/bin/python " + src +
         "/tests/hf/hf_fixture.py " + mode;
}

// Fine-tunes `sub` of the fixture in `fixture_dir` for 3 steps under the layout `layout` sets
// (collective over rt's ranks), exports the checkpoint, and writes the ids and the logits Tandem
// computes from the checkpoint (its own parameter names, through read_full_checkpoint) into
// `work`/SUB-ref.safetensors. Rank 0 exports and writes; returns the export's directory.
inline std::string finetune_and_export(Runtime& rt, const std::string& fixture_dir, const std::string& work,
                                       const std::string& sub, text::HfTask task,
                                       const std::function<void(text::HfFinetuneConfig&)>& layout) {
  namespace tt = tandem::text;
  namespace ll = tandem::llama;
  const std::string data = work + "/" + sub + ".jsonl";
  if (rt.rank() == 0) {
    std::ofstream f(data);
    const char* labels[] = {"negative", "neutral", "positive"};
    int i = 0;
    const auto tokens = nlohmann::json::parse(std::ifstream(fixture_dir + "/tokens.json"));
    for (const auto& t : tokens.at("lm").at("texts"))
      f << nlohmann::json{{"text", t.at("text")}, {"label", labels[i++ % 3]}}.dump() << "\n";
  }
  rt.world()->barrier();
  tt::HfFinetuneConfig cfg;
  cfg.model_dir = fixture_dir + "/" + sub;
  cfg.task = task;
  cfg.data = data;
  cfg.seq = 24;
  cfg.loop.checkpoints.dir = work + "/" + sub + "-ckpt";
  cfg.loop.batch = 4;
  cfg.loop.steps = 3;
  cfg.loop.lr = 1e-2;
  cfg.loop.warmup_steps = 0;
  cfg.loop.progress = false;
  cfg.loop.evaluate = false;
  layout(cfg);
  tt::finetune_hf(rt, cfg);
  rt.world()->barrier();
  const std::string out = work + "/" + sub + "-hf";
  if (rt.rank() != 0) return out;
  tt::export_hf(cfg.loop.checkpoints.dir, out, 100 * 1024);  // shards of 100 KiB
  auto full = read_full_checkpoint(latest_checkpoint(cfg.loop.checkpoints.dir));
  auto mc = ll::load_config(cfg.model_dir);
  auto ids = torch::randint(3, mc.vocab_size, {2, 11}, torch::kLong);
  torch::NoGradGuard ng;
  torch::Tensor logits;
  // By registration order: the checkpoint's names are the trained module's own.
  auto fill = [&](torch::nn::Module& m) {
    auto params = m.parameters();
    if (params.size() != full.param_names.size()) throw std::runtime_error("the checkpoint's parameters differ");
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(full.params.at(full.param_names[i]));
  };
  if (task == tt::HfTask::kLm) {
    auto seq = ll::causal_lm_sequential(mc);
    fill(*seq);
    logits = seq->forward(ids);
    auto original = ll::load_causal_lm(cfg.model_dir)->forward(ids);
    if ((original - logits).abs().max().item<double>() < 1e-3) throw std::runtime_error("fine-tuning changed nothing");
  } else {
    mc.num_labels = 3;
    mc.pad_token_id = 2;
    ll::LlamaForSequenceClassification m(mc);
    fill(*m);
    logits = m->forward(ids);
  }
  safetensors::save_file(work + "/" + sub + "-ref.safetensors", {{"ids", ids}, {"logits", logits}});
  return out;
}

}  // namespace tandem::test
