// DistributedSampler (PyTorch semantics, own deterministic generator) and batching helpers.
#include "tandem/data.h"

#include <ATen/ATen.h>

#include <random>
#include <stdexcept>

namespace tandem::data {

std::vector<int64_t> permutation(int64_t n, uint64_t seed) {
  if (n < 0) throw std::invalid_argument("tandem::data::permutation: n must be >= 0, got " + std::to_string(n));
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  // std::mt19937_64's output sequence is fixed by the standard; the bounded draw below is
  // our own (rejection sampling, no std distribution), so the permutation is the same everywhere.
  std::mt19937_64 gen(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    const uint64_t bound = static_cast<uint64_t>(i) + 1;
    const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound: reject below it
    uint64_t r;
    do {
      r = gen();
    } while (r < threshold);
    std::swap(p[i], p[static_cast<int64_t>(r % bound)]);
  }
  return p;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int rank, int world_size, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : dataset_size_(dataset_size), rank_(rank), world_size_(world_size), shuffle_(shuffle),
      seed_(seed), drop_last_(drop_last) {
  if (world_size < 1) {
    throw std::invalid_argument("tandem::data::DistributedSampler: world_size must be >= 1, got " +
                                std::to_string(world_size));
  }
  if (rank < 0 || rank >= world_size) {
    throw std::invalid_argument("tandem::data::DistributedSampler: rank " + std::to_string(rank) +
                                " is outside [0, " + std::to_string(world_size) + ")");
  }
  if (dataset_size < 0) {
    throw std::invalid_argument("tandem::data::DistributedSampler: dataset_size must be >= 0, got " +
                                std::to_string(dataset_size));
  }
  if (drop_last && dataset_size < world_size) {
    throw std::invalid_argument(
        "tandem::data::DistributedSampler: dataset of " + std::to_string(dataset_size) +
        " samples is smaller than the world size " + std::to_string(world_size) +
        " with drop_last, so some ranks would get no data; use fewer ranks or drop_last=false");
  }
  // Same as PyTorch: with drop_last the tail that cannot be split evenly is dropped,
  // otherwise every rank gets ceil(N / W) samples.
  num_samples_ = drop_last ? dataset_size / world_size : (dataset_size + world_size - 1) / world_size;
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order;
  if (shuffle_) {
    order = permutation(dataset_size_, seed_ + static_cast<uint64_t>(epoch_));
  } else {
    order.resize(static_cast<size_t>(dataset_size_));
    for (int64_t i = 0; i < dataset_size_; ++i) order[i] = i;
  }
  const int64_t total = total_size();
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(num_samples_));
  // Position k of the padded/truncated order is order[k % N] (padding repeats from the start).
  for (int64_t k = rank_; k < total; k += world_size_) out.push_back(order[k % dataset_size_]);
  return out;
}

std::vector<std::vector<int64_t>> batches(const std::vector<int64_t>& idx, int64_t batch, bool drop_last) {
  if (batch < 1) {
    throw std::invalid_argument("tandem::data::batches: batch size must be >= 1, got " + std::to_string(batch));
  }
  std::vector<std::vector<int64_t>> out;
  const int64_t n = static_cast<int64_t>(idx.size());
  for (int64_t s = 0; s < n; s += batch) {
    const int64_t e = std::min(n, s + batch);
    if (drop_last && e - s < batch) break;
    out.emplace_back(idx.begin() + s, idx.begin() + e);
  }
  return out;
}

std::pair<at::Tensor, at::Tensor> gather_batch(const Dataset& ds, const std::vector<int64_t>& idx) {
  if (!ds.images.defined() || !ds.labels.defined()) {
    throw std::invalid_argument("tandem::data::gather_batch: the dataset is empty (not loaded)");
  }
  const int64_t n = ds.size();
  for (size_t i = 0; i < idx.size(); ++i) {
    if (idx[i] < 0 || idx[i] >= n) {
      throw std::out_of_range("tandem::data::gather_batch: index " + std::to_string(idx[i]) + " (position " +
                              std::to_string(i) + ") is outside the dataset [0, " + std::to_string(n) + ")");
    }
  }
  auto t = at::tensor(at::ArrayRef<int64_t>(idx), at::TensorOptions().dtype(at::kLong))
               .to(ds.images.device());
  return {ds.images.index_select(0, t), ds.labels.index_select(0, t.to(ds.labels.device()))};
}

}  // namespace tandem::data
