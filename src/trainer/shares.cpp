// Batch shares for heterogeneous clusters: parsing, validation, the apportioning of the global
// batch, the loss weight, calibration from measured throughput, and the report lines.
#include "tandem/shares.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "tandem/report.h"
#include "tandem/trainer.h"

namespace tandem {
namespace {

const char* const kCountsPrefix = "counts:";

double parse_number(const std::string& item, const std::string& flag) {
  size_t used = 0;
  double v = 0.0;
  try {
    v = std::stod(item, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (item.empty() || used != item.size() || !std::isfinite(v)) {
    throw std::invalid_argument(flag + ": '" + item + "' is not a number");
  }
  return v;
}

std::string join(const std::vector<int64_t>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

std::string kind_name(BatchSharesSpec::Kind k) {
  switch (k) {
    case BatchSharesSpec::Kind::kEqual: return "equal";
    case BatchSharesSpec::Kind::kWeights: return "weights";
    case BatchSharesSpec::Kind::kCounts: return "counts";
    case BatchSharesSpec::Kind::kAuto: return "auto";
  }
  return "?";
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace

BatchSharesSpec parse_batch_shares(const std::string& text) {
  BatchSharesSpec spec;
  if (text.empty()) return spec;
  if (text == "auto") {
    spec.kind = BatchSharesSpec::Kind::kAuto;
    return spec;
  }
  std::string list = text;
  spec.kind = BatchSharesSpec::Kind::kWeights;
  if (text.rfind(kCountsPrefix, 0) == 0) {
    spec.kind = BatchSharesSpec::Kind::kCounts;
    list = text.substr(std::string(kCountsPrefix).size());
  }
  const std::string flag = "--batch-shares " + text;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const double v = parse_number(item, flag);
    const size_t r = spec.values.size();
    if (v <= 0) {
      throw std::invalid_argument(flag + ": rank " + std::to_string(r) + "'s share is " + item +
                                  "; every share must be positive (a rank with no samples is not allowed)");
    }
    if (spec.kind == BatchSharesSpec::Kind::kCounts && v != std::floor(v)) {
      throw std::invalid_argument(flag + ": rank " + std::to_string(r) + "'s count " + item +
                                  " is not a whole number of samples");
    }
    spec.values.push_back(v);
  }
  if (spec.values.empty() || list.back() == ',') {
    throw std::invalid_argument(flag + ": give one share per worker, e.g. 3,1 (weights), counts:96,32 or auto");
  }
  return spec;
}

std::vector<int64_t> resolve_batch_shares(const BatchSharesSpec& spec, int64_t global_batch, int world) {
  if (spec.kind == BatchSharesSpec::Kind::kEqual || spec.kind == BatchSharesSpec::Kind::kAuto) {
    if (global_batch < world) {
      throw std::invalid_argument("--batch " + std::to_string(global_batch) + " gives some of the " +
                                  std::to_string(world) + " workers no samples; use --batch " + std::to_string(world) +
                                  " or more");
    }
    return data::apportion(std::vector<double>(static_cast<size_t>(world), 1.0), global_batch);
  }
  if (static_cast<int>(spec.values.size()) != world) {
    throw std::invalid_argument("--batch-shares gives " + std::to_string(spec.values.size()) + " share(s) for " +
                                std::to_string(world) +
                                " data-parallel worker(s); give exactly one per worker, in rank order");
  }
  if (spec.kind == BatchSharesSpec::Kind::kCounts) {
    std::vector<int64_t> counts(spec.values.begin(), spec.values.end());
    int64_t sum = 0;
    for (auto c : counts) sum += c;
    if (sum != global_batch) {
      throw std::invalid_argument("--batch-shares counts:" + join(counts, ",") + " sum to " + std::to_string(sum) +
                                  " samples, not the global --batch " + std::to_string(global_batch) +
                                  "; make them add up, or give weights without 'counts:'");
    }
    return counts;
  }
  auto shares = data::apportion(spec.values, global_batch);
  for (int r = 0; r < world; ++r) {
    if (shares[r] < 1) {
      throw std::invalid_argument("--batch-shares: rank " + std::to_string(r) + "'s weight leaves it 0 of the " +
                                  std::to_string(global_batch) + " samples per step (shares " + join(shares, ",") +
                                  "); a rank with no samples is not allowed: raise its weight or --batch");
    }
  }
  return shares;
}

std::vector<int64_t> shares_from_throughput(const std::vector<double>& samples_per_second, int64_t global_batch) {
  return data::apportion(samples_per_second, global_batch, 1);
}

double share_loss_weight(int64_t local_samples, int64_t global_samples, int world) {
  if (global_samples < 1) throw std::invalid_argument("share_loss_weight: global_samples must be >= 1");
  return static_cast<double>(world) * static_cast<double>(local_samples) / static_cast<double>(global_samples);
}

SlowRank parse_slow_rank(const std::string& text, int world) {
  SlowRank s;
  if (text.empty()) return s;
  const auto colon = text.find(':');
  const std::string flag = "--slow-rank " + text;
  if (colon == std::string::npos) {
    throw std::invalid_argument(flag + ": expected RANK:MS (milliseconds of delay per sample), e.g. 1:0.5");
  }
  const double r = parse_number(text.substr(0, colon), flag);
  s.ms_per_sample = parse_number(text.substr(colon + 1), flag);
  if (r != std::floor(r) || r < 0 || r >= world) {
    throw std::invalid_argument(flag + ": rank " + text.substr(0, colon) + " is not one of the " +
                                std::to_string(world) + " worker(s) (0.." + std::to_string(world - 1) + ")");
  }
  if (s.ms_per_sample < 0) throw std::invalid_argument(flag + ": the delay must be >= 0 ms per sample");
  s.rank = static_cast<int>(r);
  return s;
}

void validate_batch_shares(const TrainConfig& cfg, int world) {
  parse_slow_rank(cfg.slow_rank, world);
  const auto spec = parse_batch_shares(cfg.batch_shares);
  if (spec.kind == BatchSharesSpec::Kind::kEqual) return;
  if (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp > 1) {
    throw std::invalid_argument("--batch-shares applies to pure data parallelism; drop it or use --tp 1 --pp 1 --cp 1");
  }
  if (spec.kind == BatchSharesSpec::Kind::kAuto) {
    if (cfg.calibration_steps < 2) {
      throw std::invalid_argument("--calibration-steps must be at least 2 (the first step is a warm-up), got " +
                                  std::to_string(cfg.calibration_steps));
    }
  }
  resolve_batch_shares(spec, cfg.batch, world);
}

BatchSharePlan::BatchSharePlan(const TrainConfig& cfg, int rank, int world, int dp)
    : spec_(parse_batch_shares(cfg.batch_shares)), slow_(parse_slow_rank(cfg.slow_rank, world)), rank_(rank), dp_(dp),
      global_batch_(cfg.batch), calibration_steps_(cfg.calibration_steps),
      shares_(resolve_batch_shares(spec_, cfg.batch, dp)) {}

std::vector<std::vector<int64_t>> BatchSharePlan::epoch_batches(const data::DistributedSampler& sampler,
                                                                int64_t local_batch, bool drop_last) const {
  if (active()) return sampler.share_batches(shares_);
  return data::batches(sampler.indices(), local_batch, drop_last);
}

int64_t BatchSharePlan::step_samples(const data::DistributedSampler& sampler, int64_t local_samples,
                                     int64_t step_in_epoch) const {
  if (!active()) return local_samples * dp_;
  return sampler.share_step_samples(global_batch_, step_in_epoch);
}

double BatchSharePlan::loss_weight(int64_t local_samples, int64_t global_samples) const {
  return active() ? share_loss_weight(local_samples, global_samples, dp_) : 1.0;
}

void BatchSharePlan::slow_down(int64_t samples, double fraction) const {
  if (slow_.rank != rank_ || slow_.ms_per_sample <= 0) return;
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(fraction * slow_.ms_per_sample * samples));
}

void BatchSharePlan::record(int64_t samples, double forward_seconds) {
  samples_ += samples;
  forward_seconds_ += forward_seconds;
  if (spec_.kind == BatchSharesSpec::Kind::kAuto && !calibrated_ && forward_seconds > 0) {
    step_rates_.push_back(samples / forward_seconds);
  }
}

bool BatchSharePlan::calibrate_if_due(int64_t steps_done, Communicator& dp_comm, const at::Device& device) {
  if (spec_.kind != BatchSharesSpec::Kind::kAuto || calibrated_ || dp_ < 2 || steps_done != calibration_steps_) {
    return false;
  }
  calibrated_ = true;
  // The first step warms up (allocations, the bucket plan); a step too fast for the clock
  // (rate 0, left out by record()) cannot occur with at least one sample of real work.
  std::vector<double> rates(step_rates_.begin() + std::min<size_t>(1, step_rates_.size()), step_rates_.end());
  const double mine = rates.empty() ? 1.0 : median(rates);
  auto t = at::tensor({mine}, at::kDouble).to(device);
  auto all = at::empty({dp_}, t.options());
  dp_comm.allgather(all, t);
  auto host = all.cpu();
  calibrated_rates_.assign(host.data_ptr<double>(), host.data_ptr<double>() + dp_);
  auto next = shares_from_throughput(calibrated_rates_, global_batch_);
  const bool changed = next != shares_;
  shares_ = std::move(next);
  return changed;
}

void BatchSharePlan::report(Communicator& dp_comm, const at::Device& device, double wall_seconds, Report& rep) const {
  auto t = at::tensor({static_cast<double>(samples_), forward_seconds_}, at::kDouble).to(device);
  auto all = at::empty({2 * dp_}, t.options());
  dp_comm.allgather(all, t);
  auto host = all.cpu();
  rep.batch_shares_mode = kind_name(spec_.kind);
  rep.batch_shares = shares_;
  rep.calibrated_samples_per_second = calibrated_rates_;
  rep.rank_samples_per_second.clear();
  rep.rank_forward_samples_per_second.clear();
  for (int r = 0; r < dp_; ++r) {
    const double n = host[2 * r].item<double>(), fwd = host[2 * r + 1].item<double>();
    rep.rank_samples_per_second.push_back(wall_seconds > 0 ? n / wall_seconds : 0.0);
    rep.rank_forward_samples_per_second.push_back(fwd > 0 ? n / fwd : 0.0);
  }
}

}  // namespace tandem
