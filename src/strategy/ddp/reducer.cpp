// DDP's bucket reduction policies: the gradients as they are (or rounded to bf16/fp16 on the
// wire), one all-reduce per bucket; PowerSGD's low-rank factors are in powersgd.cpp.
#include "strategy/ddp/reducer.h"

#include <exception>

namespace tandem::detail {

void wait_all(const std::vector<WorkPtr>& works) {
  std::exception_ptr err;
  for (const auto& w : works) {
    if (!w) continue;
    try {
      w->wait();
    } catch (...) {
      if (!err) err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
}

namespace {

class DenseBucketReducer final : public BucketReducer {
 public:
  DenseBucketReducer(Communicator& comm, c10::optional<at::ScalarType> wire, int64_t& bytes)
      : comm_(comm), wire_dtype_(wire), bytes_(bytes) {}

  void start(size_t b, Bucket& bk) override {
    if (wires_.size() <= b) wires_.resize(b + 1);
    auto& w = wires_[b];
    w = wire_dtype_ && *wire_dtype_ != bk.flat.scalar_type() ? bk.flat.to(*wire_dtype_) : bk.flat;
    bytes_ += w.numel() * w.element_size();
    const auto at = DDPClock::now();
    bk.works.emplace_back(comm_.allreduce_async(w, ReduceOp::kAvg), at);
  }

  void finish(std::vector<Bucket>& buckets) override {
    std::vector<WorkPtr> works;
    for (auto& bk : buckets)
      for (auto& w : bk.works) works.push_back(w.first);
    wait_all(works);
    for (size_t b = 0; b < buckets.size() && b < wires_.size(); ++b) {
      if (wires_[b].defined() && !wires_[b].is_same(buckets[b].flat)) buckets[b].flat.copy_(wires_[b]);
      wires_[b] = at::Tensor();
    }
  }

 private:
  Communicator& comm_;
  c10::optional<at::ScalarType> wire_dtype_;
  int64_t& bytes_;
  std::vector<at::Tensor> wires_;  // per bucket: what this step sends (the flat itself when uncompressed)
};

}  // namespace

std::unique_ptr<BucketReducer> make_dense_reducer(Communicator& comm, c10::optional<at::ScalarType> wire,
                                                  int64_t& bytes) {
  return std::make_unique<DenseBucketReducer>(comm, wire, bytes);
}

std::unique_ptr<BucketReducer> make_bucket_reducer(Communicator& comm, const std::vector<at::Tensor>& params,
                                                   const DDPOptions& opts, int64_t& bytes) {
  if (opts.powersgd) return make_powersgd_reducer(comm, params, *opts.powersgd, bytes);
  return make_dense_reducer(comm, opts.compress_dtype, bytes);
}

}  // namespace tandem::detail
