// Heterogeneous clusters: each data-parallel rank takes a share of the global batch in
// proportion to its throughput, so that a step no longer waits for the slowest device with a
// full equal share. Shares are given by the user (weights or exact per-rank counts) or
// calibrated: the first steps run with equal shares while every rank times its forward pass,
// then the ranks all-gather their samples/s and apportion the batch (data::apportion:
// deterministic, identical on every rank, at least one sample each).
//
// The update stays the homogeneous global-batch update: rank r's local mean loss over n_r of
// the step's N samples is multiplied by share_loss_weight() = W * n_r / N before backward, so
// the strategies' all-reduce AVERAGE of gradients (DDP; ZeRO's reduce-scatter) gives
// sum_r (n_r / N) grad_r, the gradient of the mean loss over the N samples. Clipping, loss
// scaling and the optimizer act after the reduction and are unchanged; one worker gets
// weight 1. The data side is data::DistributedSampler::share_batches(): the same global
// samples per step whatever the shares.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/comm.h"
#include "tandem/data.h"

namespace tandem {

struct TrainConfig;
struct Report;

// --batch-shares: "" (equal shares, PyTorch's strided sampler), "auto" (calibrated),
// "W0,W1,..." (relative weights, one per rank in rank order, e.g. 3,1) or
// "counts:N0,N1,..." (exact samples per step, summing to the global batch).
struct BatchSharesSpec {
  enum class Kind { kEqual, kWeights, kCounts, kAuto };
  Kind kind = Kind::kEqual;
  std::vector<double> values;  // kWeights: weights; kCounts: samples per step
};

// Throws std::invalid_argument naming the bad entry: not a number, zero or negative, empty.
BatchSharesSpec parse_batch_shares(const std::string& text);

// Each of `world` ranks' samples per step: the counts, the weights apportioned, or (kEqual,
// kAuto before calibration) the batch split as evenly as possible. Throws
// std::invalid_argument for a count of shares other than `world`, counts not summing to
// global_batch, or weights that leave a rank 0 samples (not allowed: a rank with no samples
// has no loss to weight and would still have to join every collective).
std::vector<int64_t> resolve_batch_shares(const BatchSharesSpec& spec, int64_t global_batch, int world);

// Shares in proportion to measured throughputs (samples/s per rank, all > 0), each >= 1.
std::vector<int64_t> shares_from_throughput(const std::vector<double>& samples_per_second, int64_t global_batch);

// The factor on a rank's local mean loss over local_samples of the step's global_samples so
// that averaging gradients over `world` ranks gives the global-batch gradient:
// world * local_samples / global_samples (1 for equal shares and for one worker).
double share_loss_weight(int64_t local_samples, int64_t global_samples, int world);

// --slow-rank R:MS: rank R sleeps MS milliseconds per sample of its share every step, a test
// and demo aid that models a slower device: its time grows with its share, so calibrated
// shares have something to find (a fixed per-step delay could not be balanced by any share).
// A third of it is spent in the timed forward window and two thirds after backward, as a
// device slower by a constant factor spends it (backward costs about twice the forward), so
// the forward rate the calibration measures is slowed by the same factor as the whole step.
// rank -1: off.
struct SlowRank {
  int rank = -1;
  double ms_per_sample = 0.0;
};
// "" gives rank -1. Throws std::invalid_argument for a bad format, a rank outside
// [0, world), or a negative or non-finite delay.
SlowRank parse_slow_rank(const std::string& text, int world);

// Checks --batch-shares, --calibration-steps and --slow-rank of a configuration for `world`
// ranks (called by validate_config()). Throws std::invalid_argument.
void validate_batch_shares(const TrainConfig& cfg, int world);

// The trainer's side of it: which batches this rank takes, the loss weight, the artificial
// slowdown, the timing, the calibration and the report figures.
class BatchSharePlan {
 public:
  // rank and world: this rank and the job's size (for --slow-rank); dp: the data-parallel
  // ranks (the shares are theirs; with shares active dp == world). Expects a validated
  // configuration (validate_batch_shares()).
  BatchSharePlan(const TrainConfig& cfg, int rank, int world, int dp);

  // True when --batch-shares is given (shares path of the sampler, weighted loss).
  bool active() const { return spec_.kind != BatchSharesSpec::Kind::kEqual; }
  const std::vector<int64_t>& shares() const { return shares_; }

  // This rank's batches of the sampler's current epoch: share_batches(shares()) when active,
  // else batches of local_batch from the strided indices() (the unchanged equal-share path).
  std::vector<std::vector<int64_t>> epoch_batches(const data::DistributedSampler& sampler, int64_t local_batch,
                                                  bool drop_last) const;
  // Global samples of step `step_in_epoch` whose local batch has local_samples.
  int64_t step_samples(const data::DistributedSampler& sampler, int64_t local_samples, int64_t step_in_epoch) const;
  // share_loss_weight() for that step (1 when not active).
  double loss_weight(int64_t local_samples, int64_t global_samples) const;

  // Sleeps `fraction` of the --slow-rank delay for `samples` when this is the slowed rank.
  static constexpr double kForwardFraction = 1.0 / 3.0, kBackwardFraction = 2.0 / 3.0;
  void slow_down(int64_t samples, double fraction) const;
  // One step's local samples and forward seconds (data, slow-down, forward and loss).
  void record(int64_t samples, double forward_seconds);
  // With --batch-shares auto, once `steps_done` steps of this run have been recorded equals
  // the calibration steps: all-gathers each rank's median forward samples/s (the first step
  // left out as warm-up) over dp_comm and sets the shares from them. Collective over dp_comm
  // (every rank calls it after every step). Returns true when the shares changed.
  bool calibrate_if_due(int64_t steps_done, Communicator& dp_comm, const at::Device& device);

  // Fills the report's batch-share figures; collective over dp_comm. Call on every rank when
  // dp > 1 with one replica per rank (no --tp/--pp).
  void report(Communicator& dp_comm, const at::Device& device, double wall_seconds, Report& rep) const;

 private:
  BatchSharesSpec spec_;
  SlowRank slow_;
  int rank_, dp_;
  int64_t global_batch_;
  int64_t calibration_steps_;
  bool calibrated_ = false;
  std::vector<int64_t> shares_;
  std::vector<double> step_rates_;  // samples/s of each recorded step, for the calibration
  std::vector<double> calibrated_rates_;
  int64_t samples_ = 0;
  double forward_seconds_ = 0.0;
};

}  // namespace tandem
