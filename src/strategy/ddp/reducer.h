// Internal to DDP: a bucket of gradients and the policy that turns the buckets' local gradients
// into their average over the ranks. DistributedDataParallel fills the buckets and calls
// start() on each as soon as it is full (in the same bucket order on every rank, so that the
// collectives match), then finish() once at the end of backward; the policy decides what goes
// on the wire: the gradients as they are, rounded to bf16/fp16, or PowerSGD's factors.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "tandem/comm.h"
#include "tandem/ddp.h"

namespace tandem::detail {

using DDPClock = std::chrono::steady_clock;

struct Bucket {
  std::vector<size_t> params;    // indices into the DDP's parameters, in launch order
  std::vector<int64_t> offsets;  // element offset of each parameter in `flat`
  at::Tensor flat;               // the parameters' dtype and device
  size_t pending = 0;            // parameters still waiting for their gradient this step
  // The step's collectives with their launch times (for the communication accounting).
  std::vector<std::pair<WorkPtr, DDPClock::time_point>> works;

  // Slot s's gradient in `flat`, flattened.
  at::Tensor slot(const std::vector<at::Tensor>& all, size_t s) const {
    return flat.narrow(0, offsets[s], all[params[s]].numel());
  }
};

class BucketReducer {
 public:
  virtual ~BucketReducer() = default;
  // The buckets were (re)planned: size per-bucket buffers. Called on every rank at the same
  // point with the same plan and no collective in flight, so it may allocate symmetric memory.
  virtual void planned(const std::vector<Bucket>& buckets) { (void)buckets; }
  // Bucket `b`'s gradients are complete: start averaging them (collectives into bk.works).
  virtual void start(size_t b, Bucket& bk) = 0;
  // After every bucket was started: wait for them and leave each flat holding the average.
  // Throws the first failure, after waiting for every collective still in flight.
  virtual void finish(std::vector<Bucket>& buckets) = 0;
  // PowerSGD's residuals per parameter (empty for the others).
  virtual std::vector<at::Tensor> residuals() const { return {}; }
};

// `params` and `bytes` (the payload counter, bytes as sent) outlive the reducers.
// The gradients themselves, in `wire` dtype when given.
std::unique_ptr<BucketReducer> make_dense_reducer(Communicator& comm, c10::optional<at::ScalarType> wire,
                                                  int64_t& bytes);
std::unique_ptr<BucketReducer> make_powersgd_reducer(Communicator& comm, const std::vector<at::Tensor>& params,
                                                     const PowerSGDOptions& opts, int64_t& bytes);
// The policy DDPOptions asks for.
std::unique_ptr<BucketReducer> make_bucket_reducer(Communicator& comm, const std::vector<at::Tensor>& params,
                                                   const DDPOptions& opts, int64_t& bytes);

// Waits for every work; rethrows the first failure once all are done.
void wait_all(const std::vector<WorkPtr>& works);

}  // namespace tandem::detail
