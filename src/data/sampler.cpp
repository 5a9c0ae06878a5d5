// DistributedSampler (PyTorch semantics, own deterministic generator) and batching helpers.
#include "tandem/data.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
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

DistributedSampler::DistributedSampler(int64_t dataset_size, int rank, int world_size, bool shuffle, uint64_t seed,
                                       bool drop_last)
    : dataset_size_(dataset_size), rank_(rank), world_size_(world_size), shuffle_(shuffle), seed_(seed),
      drop_last_(drop_last) {
  if (world_size < 1) {
    throw std::invalid_argument("tandem::data::DistributedSampler: world_size must be >= 1, got " +
                                std::to_string(world_size));
  }
  if (rank < 0 || rank >= world_size) {
    throw std::invalid_argument("tandem::data::DistributedSampler: rank " + std::to_string(rank) + " is outside [0, " +
                                std::to_string(world_size) + ")");
  }
  if (dataset_size < 0) {
    throw std::invalid_argument("tandem::data::DistributedSampler: dataset_size must be >= 0, got " +
                                std::to_string(dataset_size));
  }
  if (drop_last && dataset_size < world_size) {
    throw std::invalid_argument("tandem::data::DistributedSampler: dataset of " + std::to_string(dataset_size) +
                                " samples is smaller than the world size " + std::to_string(world_size) +
                                " with drop_last, so some ranks would get no data; use fewer ranks or drop_last=false");
  }
  // Same as PyTorch: with drop_last the tail that cannot be split evenly is dropped,
  // otherwise every rank gets ceil(N / W) samples.
  num_samples_ = drop_last ? dataset_size / world_size : (dataset_size + world_size - 1) / world_size;
}

namespace {

// The epoch's order of the whole dataset: a permutation seeded by seed + epoch, or the identity.
std::vector<int64_t> epoch_order(int64_t n, bool shuffle, uint64_t seed, int64_t epoch) {
  if (shuffle) return permutation(n, seed + static_cast<uint64_t>(epoch));
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  return order;
}

}  // namespace

std::vector<int64_t> apportion(const std::vector<double>& weights, int64_t total, int64_t min_each) {
  const std::string what = "tandem::data::apportion: ";
  if (weights.empty()) throw std::invalid_argument(what + "no weights");
  if (total < 0) throw std::invalid_argument(what + "total must be >= 0, got " + std::to_string(total));
  const auto n = static_cast<int64_t>(weights.size());
  if (min_each < 0 || total < min_each * n) {
    throw std::invalid_argument(what + "cannot give each of " + std::to_string(n) + " entries at least " +
                                std::to_string(min_each) + " of " + std::to_string(total));
  }
  double sum = 0.0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!(weights[i] > 0.0) || !std::isfinite(weights[i])) {
      throw std::invalid_argument(what + "weight " + std::to_string(i) + " is " + std::to_string(weights[i]) +
                                  "; weights must be positive and finite");
    }
    sum += weights[i];
  }
  std::vector<int64_t> out(weights.size());
  std::vector<std::pair<double, size_t>> rest;  // (fractional part, index)
  int64_t given = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const double exact = static_cast<double>(total) * (weights[i] / sum);
    out[i] = std::min<int64_t>(total, static_cast<int64_t>(std::floor(exact)));
    given += out[i];
    rest.emplace_back(exact - std::floor(exact), i);
  }
  // Largest remainders first, the lower index on ties; floor() can only under-count, and the
  // sum of the remainders is total - given (up to rounding), so one pass suffices.
  std::stable_sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t k = 0; given < total; k = (k + 1) % rest.size(), ++given) ++out[rest[k].second];
  while (given > total) {  // rounding of the floors pushed past total (never seen; kept exact)
    auto it = std::max_element(out.begin(), out.end());
    --*it;
    --given;
  }
  for (;;) {
    auto low = std::find_if(out.begin(), out.end(), [&](int64_t v) { return v < min_each; });
    if (low == out.end()) break;
    ++*low;
    --*std::max_element(out.begin(), out.end());  // the first largest: the lower index on ties
  }
  return out;
}

std::vector<std::vector<int64_t>> DistributedSampler::share_batches(const std::vector<int64_t>& shares) const {
  if (static_cast<int>(shares.size()) != world_size_) {
    throw std::invalid_argument("tandem::data::DistributedSampler::share_batches: " + std::to_string(shares.size()) +
                                " shares for a world of " + std::to_string(world_size_) + "; give one per rank");
  }
  int64_t global = 0, offset = 0;
  for (int r = 0; r < world_size_; ++r) {
    if (shares[r] < 1) {
      throw std::invalid_argument("tandem::data::DistributedSampler::share_batches: rank " + std::to_string(r) +
                                  " has a share of " + std::to_string(shares[r]) +
                                  " samples; every rank needs at least 1");
    }
    if (r < rank_) offset += shares[r];
    global += shares[r];
  }
  const auto order = epoch_order(dataset_size_, shuffle_, seed_, epoch_);
  const int64_t total = total_size();
  std::vector<double> weights(shares.begin(), shares.end());
  std::vector<std::vector<int64_t>> out;
  for (int64_t start = 0; start < total; start += global) {
    int64_t mine = shares[rank_], from = start + offset;
    if (total - start < global) {  // the last, partial window
      const int64_t m = total - start;
      if (m < world_size_) break;
      const auto part = apportion(weights, m, 1);
      from = start;
      for (int r = 0; r < rank_; ++r) from += part[r];
      mine = part[rank_];
    }
    std::vector<int64_t> b(static_cast<size_t>(mine));
    for (int64_t j = 0; j < mine; ++j) b[j] = order[(from + j) % dataset_size_];
    out.push_back(std::move(b));
  }
  return out;
}

int64_t DistributedSampler::share_step_samples(int64_t global_batch, int64_t step) const {
  const int64_t left = total_size() - step * global_batch;
  if (left <= 0 || (left < global_batch && left < world_size_)) return 0;
  return std::min(left, global_batch);
}

std::vector<int64_t> DistributedSampler::indices() const {
  const auto order = epoch_order(dataset_size_, shuffle_, seed_, epoch_);
  const int64_t total = total_size();
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(num_samples_));
  // Position k of the padded/truncated order is order[k % N] (padding repeats from the start).
  for (int64_t k = rank_; k < total; k += world_size_) out.push_back(order[k % dataset_size_]);
  return out;
}

std::vector<int64_t> DistributedSampler::indices_from(int64_t consumed) const {
  if (consumed < 0) {
    throw std::invalid_argument("tandem::data::DistributedSampler::indices_from: consumed must be >= 0, got " +
                                std::to_string(consumed));
  }
  if (consumed == 0) return indices();
  const int64_t left = std::max<int64_t>(0, dataset_size_ - consumed);
  const int64_t per_rank = drop_last_ ? left / world_size_ : (left + world_size_ - 1) / world_size_;
  const auto order = epoch_order(dataset_size_, shuffle_, seed_, epoch_);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(per_rank));
  // Padding repeats the order from its start, as indices() does.
  for (int64_t k = 0; k < per_rank; ++k) out.push_back(order[(consumed + rank_ + k * world_size_) % dataset_size_]);
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
  auto t = at::tensor(at::ArrayRef<int64_t>(idx), at::TensorOptions().dtype(at::kLong)).to(ds.images.device());
  return {ds.images.index_select(0, t), ds.labels.index_select(0, t.to(ds.labels.device()))};
}

}  // namespace tandem::data
