// Tandem's data layer: image datasets in IDX format (MNIST, Fashion-MNIST; raw or gzip),
// a DistributedSampler with exactly PyTorch's sharding semantics, and batching helpers.
// Loading validates every byte count and label and throws std::runtime_error naming the file.
// Sampler orders come from Tandem's own generator, so they are identical on every rank,
// machine and standard library.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tandem::data {

// Images as float32 [N, 1, H, W], normalized as (x / 255 - mean) / std; labels int64 [N].
struct Dataset {
  at::Tensor images;
  at::Tensor labels;
  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
};

// How raw bytes become a Dataset. The defaults are Fashion-MNIST's training-set statistics.
struct LoadOptions {
  double mean = 0.2860;
  double std = 0.3530;
  // Labels must lie in [0, num_classes); 0 accepts any byte value.
  int64_t num_classes = 10;
};

// Reads an IDX image file (magic 0x00000803, ubyte, N x H x W) and an IDX label file
// (magic 0x00000801, ubyte, N). Either may be gzip-compressed (detected by its 1f 8b magic).
// Throws std::runtime_error naming the file for: a missing/unreadable file, a wrong magic,
// truncated or over-long data, an image/label count mismatch, a label out of range.
Dataset load_idx(const std::string& images_path, const std::string& labels_path,
                 const LoadOptions& options = LoadOptions());

// Where the Debian package dataset-fashion-mnist installs the four IDX files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// Fashion-MNIST's training (60000) or test (10000) split from `dir`; accepts
// train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-images-..., t10k-labels-...
Dataset load_fashion_mnist(const std::string& dir = kFashionMnistDir, bool train = true,
                           const LoadOptions& options = LoadOptions());

// Splits a dataset across the ranks of a job exactly like torch.utils.data.DistributedSampler:
//  1. order = a permutation of [0, N) seeded by seed + epoch (identity when !shuffle);
//  2. without drop_last it is padded by repeating from its start up to a multiple of W;
//     with drop_last it is truncated down to a multiple of W;
//  3. rank r takes order[r], order[r + W], order[r + 2W], ...
// Consequence relied on by the accuracy-parity tests: with the same seed and epoch, the
// union over ranks of their step-s batches of b samples is exactly the SET of samples in
// the step-s batch of B = W * b samples of a single worker (W = 1), for every step whose
// global batch does not reach into the padding. Only the order inside the batch differs.
class DistributedSampler {
 public:
  // Throws std::invalid_argument for world_size < 1, rank outside [0, world_size),
  // dataset_size < 0, or dataset_size < world_size with drop_last (a rank would get nothing).
  DistributedSampler(int64_t dataset_size, int rank, int world_size, bool shuffle = true, uint64_t seed = 0,
                     bool drop_last = false);

  // Call at the start of every epoch so that each epoch has a different order.
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  // This rank's dataset indices for the current epoch, num_samples() of them.
  std::vector<int64_t> indices() const;
  // The rest of the epoch after its first `consumed` samples (positions [0, consumed) of the
  // unpadded order) were trained on at another world size or batch: positions consumed + r,
  // consumed + r + W, ... of the order, padded (or, with drop_last, truncated) as indices() is,
  // to a multiple of W. Batches of b from it make step k's global batch the positions
  // [consumed + k*W*b, consumed + (k+1)*W*b), so the epoch continues with the samples that come
  // next whatever the new layout. indices_from(0) == indices(); empty once consumed >= N.
  std::vector<int64_t> indices_from(int64_t consumed) const;
  // Samples per rank per epoch (the same on every rank).
  int64_t num_samples() const { return num_samples_; }
  // num_samples() * world_size.
  int64_t total_size() const { return num_samples_ * world_size_; }

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Unequal per-rank batches (heterogeneous clusters): this rank's batches for the current
  // epoch when rank q takes shares[q] samples per step, the shares summing to the global batch
  // B. Step k's global batch is positions [k*B, (k+1)*B) of the same padded (or truncated)
  // order that indices() strides over, cut into consecutive slices in rank order: rank r takes
  // [k*B + o_r, k*B + o_r + shares[r]) with o_r = shares[0] + ... + shares[r-1]. indices()
  // with batches of B / W gives rank r positions r, r + W, ... of that same window, so for
  // every step the SET of samples in the global batch is the same whatever the shares (only
  // which rank holds which differs): loss trajectories match the equal-share run. The last,
  // partial window of m = total_size() - k*B samples is apportioned by the shares (each
  // rank at least one); when m < W it is dropped (it can only happen when W does not divide
  // B). Throws std::invalid_argument unless shares has world_size() entries, all >= 1.
  std::vector<std::vector<int64_t>> share_batches(const std::vector<int64_t>& shares) const;
  // Global samples of step `step` (0-based, in the epoch) under share_batches(): B, or what the
  // last partial window holds; 0 past the end.
  int64_t share_step_samples(int64_t global_batch, int64_t step) const;

 private:
  int64_t dataset_size_;
  int rank_;
  int world_size_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t epoch_ = 0;
  int64_t num_samples_ = 0;
};

// A permutation of [0, n) from a 64-bit Mersenne Twister seeded with `seed` and an unbiased
// Fisher-Yates shuffle (no std::*_distribution, whose output differs between libraries).
std::vector<int64_t> permutation(int64_t n, uint64_t seed);

// Splits `total` into integers proportional to `weights` (all > 0 and finite) that sum to
// exactly `total`: the largest-remainder (Hamilton) method, remainders tied in favour of the
// lower index. Then every entry below `min_each` is raised to it, one at a time, by taking
// one from the largest entry (the lower index on ties). Deterministic: the same inputs give
// the same result on every rank. Throws std::invalid_argument for an empty or bad weight,
// total < 0, or total < min_each * weights.size().
std::vector<int64_t> apportion(const std::vector<double>& weights, int64_t total, int64_t min_each = 0);

// Consecutive chunks of `batch` indices; the last one is shorter unless drop_last drops it.
// Throws std::invalid_argument when batch < 1.
std::vector<std::vector<int64_t>> batches(const std::vector<int64_t>& idx, int64_t batch, bool drop_last);

// (images[idx], labels[idx]) via index_select, on the dataset's device. Throws
// std::out_of_range naming the first index outside [0, size()).
std::pair<at::Tensor, at::Tensor> gather_batch(const Dataset& ds, const std::vector<int64_t>& idx);

}  // namespace tandem::data
