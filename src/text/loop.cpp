// The checkpoints of the text loops (src/text/loop.h): cadence, resume and the elastic stop.
#include "text/loop.h"

#include <cstdio>
#include <iostream>

#include "tandem/checkpoint.h"
#include "tandem/elastic.h"

namespace tandem::text {

LoopCheckpoints::LoopCheckpoints(Engine& eng, const TextTrainConfig& cfg, std::string key, nlohmann::json run,
                                 std::vector<std::string> must_match)
    : eng_(eng), cfg_(cfg), key_(std::move(key)), run_(std::move(run)), must_match_(std::move(must_match)) {
  // The sampler's position counts samples, so only a run that may change its batch (elastic,
  // --elastic-lr scale) resumes at another one; the others keep the schedule they started with.
  if (!cfg.checkpoints.batch_may_change) must_match_.push_back("batch");
}

LoopHooks LoopCheckpoints::start() {
  const TextCheckpoints& c = cfg_.checkpoints;
  LoopHooks hooks;
  if (c.resume) {
    const auto dir = latest_checkpoint(c.dir);
    if (dir.empty()) {  // an elastic relaunch before the first checkpoint, as tandem train
      if (eng_.world()->rank() == 0) {
        std::cout << "no checkpoint in '" << c.dir << "' yet; starting from step 0" << std::endl;
      }
      return start_hooks(hooks);
    }
    const auto saved = nlohmann::json::parse(read_checkpoint_meta(dir).extra_json, nullptr, false);
    if (saved.is_discarded() || !saved.contains(key_)) {
      throw std::runtime_error("--resume: checkpoint '" + dir + "' was not made by this command (no '" + key_ +
                               "' record); resume from a checkpoint directory of the same command");
    }
    for (const auto& k : must_match_) {
      const auto was = saved[key_].value(k, nlohmann::json());
      if (was != run_[k]) {
        throw std::runtime_error("--resume: checkpoint '" + dir + "' was saved with " + k + " " + was.dump() +
                                 ", this run has " + run_[k].dump() + "; resume with the same " + k);
      }
    }
    const auto meta = eng_.load(dir);
    hooks.first_step = meta.step;
    hooks.first_sample = saved.value("samples", meta.step * cfg_.batch);
    if (saved.contains("data") && epoch_size_ > 0) {  // the data loader's place, by epoch
      const auto& d = saved["data"];
      if (d.value("samples_per_epoch", int64_t{0}) != epoch_size_) {
        throw std::runtime_error("--resume: checkpoint '" + dir + "' was saved over epochs of " +
                                 d.value("samples_per_epoch", nlohmann::json()).dump() + " samples, this run's have " +
                                 std::to_string(epoch_size_) + "; resume with the same data and --seq");
      }
      hooks.first_sample = d.at("epoch").get<int64_t>() * epoch_size_ + d.at("index").get<int64_t>();
    }
    steps_ = saved_at_ = hooks.first_step;
    samples_ = hooks.first_sample;
    if (eng_.world()->rank() == 0) {
      std::cout << "resuming from " << dir << " (step " << meta.step << ", sample " << hooks.first_sample
                << ", saved by " << meta.strategy << " on " << meta.world_size << " worker(s))" << std::endl;
    }
  }
  return start_hooks(hooks);
}

LoopHooks LoopCheckpoints::start_hooks(LoopHooks hooks) {
  const TextCheckpoints& c = cfg_.checkpoints;
  if (!c.dir.empty() && c.every > 0) {
    hooks.after_step = [this](int64_t steps, int64_t samples) { return save_and_check_stop(steps, samples); };
  } else if (!c.dir.empty()) {
    hooks.after_step = [this](int64_t steps, int64_t samples) {
      steps_ = steps;
      samples_ = samples;
      return false;
    };
  }
  return hooks;
}

bool LoopCheckpoints::save_and_check_stop(int64_t steps, int64_t samples) {
  steps_ = steps;
  samples_ = samples;
  const TextCheckpoints& c = cfg_.checkpoints;
  if (steps % c.every != 0) return false;
  save(steps, samples, c.async);
  stopped_ = elastic_stop_requested(*eng_.world(), c.stop_file, eng_.device());
  return stopped_;
}

void LoopCheckpoints::save(int64_t steps, int64_t samples, bool async) {
  CheckpointMeta meta;
  meta.step = steps;
  meta.seed = cfg_.seed;
  nlohmann::json extra = {{key_, run_}, {"samples", samples}};
  if (epoch_size_ > 0) {
    extra["data"] = {{"epoch", samples / epoch_size_},
                     {"index", samples % epoch_size_},
                     {"samples_per_epoch", epoch_size_}};
  }
  meta.extra_json = extra.dump();
  CheckpointSaveOptions so;
  so.keep = cfg_.checkpoints.keep;
  if (async) so.async = std::make_shared<AsyncCheckpoint>();
  eng_.save(cfg_.checkpoints.dir, meta, so);
  saved_at_ = steps;
}

void LoopCheckpoints::finish() {
  const TextCheckpoints& c = cfg_.checkpoints;
  if (c.dir.empty()) return;
  if (saved_at_ != steps_) save(steps_, samples_, false);
  eng_.wait_checkpoint();
  if (stopped_) acknowledge_elastic_stop(eng_.world()->rank(), c.stop_file, steps_);
}

MoeStepLosses moe_step_losses(Communicator& world, const c10::Device& device, const moe::MoeStats& before) {
  const auto s = moe::moe_stats();
  auto t = torch::tensor({s.aux_loss_sum - before.aux_loss_sum,
                          static_cast<double>(s.aux_loss_terms - before.aux_loss_terms),
                          s.z_loss_sum - before.z_loss_sum, static_cast<double>(s.z_loss_terms - before.z_loss_terms)},
                         torch::kDouble)
               .to(device);
  if (world.size() > 1) world.allreduce(t, ReduceOp::kSum);
  const auto h = t.cpu();
  const auto* v = h.data_ptr<double>();
  return {v[1] > 0 ? v[0] / v[1] : 0.0, v[3] > 0 ? v[2] / v[3] : 0.0};
}

std::string moe_note(const MoeStepLosses& m, bool with_z) {
  char buf[96];
  if (with_z) {
    std::snprintf(buf, sizeof buf, "(aux %.4f, z %.4f)", m.aux, m.z);
  } else {
    std::snprintf(buf, sizeof buf, "(aux %.4f)", m.aux);
  }
  return buf;
}

}  // namespace tandem::text
