#include "tandem/accumulate.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "tandem/ddp.h"
#include "tandem/zero.h"

namespace tandem {

at::Tensor accumulate_gradients(const at::Tensor& x, const at::Tensor& y, int64_t k, DistributedDataParallel* ddp,
                                ZeroDataParallel* zero, const MicroBatchPass& pass) {
  const int64_t n = x.size(0), parts = std::max<int64_t>(1, std::min(k, n));
  if (parts == 1) return pass(x, y, 1.0);
  at::Tensor total;
  for (int64_t p = 0, off = 0; p < parts; ++p) {
    const int64_t m = n / parts + (p < n % parts ? 1 : 0);
    if (p > 0) {
      if (ddp) ddp->prepare_forward();
      if (zero) zero->prepare_forward();
    }
    std::optional<NoSyncGuard> quiet;
    if (p + 1 < parts && ddp) quiet.emplace(ddp->no_sync());
    if (p + 1 < parts && zero && zero->stage() == 1) quiet.emplace(zero->no_sync());
    const double w = static_cast<double>(m) / static_cast<double>(n);
    const at::Tensor loss = pass(x.narrow(0, off, m), y.narrow(0, off, m), w).detach();
    total = p == 0 ? loss : total + loss;
    off += m;
  }
  return total;
}

void validate_grad_accum(int64_t k, int pp, int64_t micro_batches, int64_t batch, int dp) {
  if (k < 1) throw std::invalid_argument("--grad-accum must be at least 1");
  if (k > 1 && pp > 1) {
    throw std::invalid_argument("--grad-accum with --pp: the pipeline already accumulates over its micro-batches; use "
                                "--micro-batches " +
                                std::to_string(micro_batches * k) + " instead");
  }
  if (batch / dp < k) {
    throw std::invalid_argument("--batch " + std::to_string(batch) + " gives each of the " + std::to_string(dp) +
                                " data-parallel replicas " + std::to_string(batch / dp) +
                                " samples, fewer than --grad-accum " + std::to_string(k) +
                                "; use a --batch of at least " + std::to_string(dp * k));
  }
}

}  // namespace tandem
