// Expert parallelism's communication (tandem/moe.h): the exchange of the row counts and the
// all-to-all of the rows as an autograd function whose backward is the reverse all-to-all.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <chrono>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/moe.h"

namespace tandem::moe {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// "[2, 0, 1]"
std::string list_text(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << c10::IntArrayRef(v);
  return os.str();
}

void check_counts(const Communicator& comm, const char* where, const char* name, const std::vector<int64_t>& counts) {
  bool ok = static_cast<int64_t>(counts.size()) == comm.size();
  for (int64_t n : counts) ok = ok && n >= 0;
  if (!ok) {
    throw std::invalid_argument(std::string(where) + " on rank " + std::to_string(comm.rank()) + ": " + name + " " +
                                list_text(counts) + " must hold " + std::to_string(comm.size()) +
                                " non-negative counts, one per rank of the group");
  }
}

// What the backward needs, carried through autograd's saved data as a capsule.
struct Exchange : torch::CustomClassHolder {
  CommPtr comm;
  std::vector<int64_t> send_counts, recv_counts;
  // The forward thread's statistics: on CUDA the backward runs on autograd's device thread.
  MoeStats* stats = nullptr;
};

// Rows of `x`, send[j] of them to rank j, and back recv[j] rows from rank j; accounted in `stats`.
at::Tensor exchange_rows(const at::Tensor& x, const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                         Communicator& comm, MoeStats& stats) {
  at::Tensor in = x.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = std::accumulate(recv.begin(), recv.end(), int64_t{0});
  at::Tensor out = at::empty(shape, in.options());
  const auto t0 = std::chrono::steady_clock::now();
  auto work = comm.alltoall_async(out, in, recv, send);
  work->wait();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t row_bytes = in.size(0) > 0 ? in.numel() / in.size(0) * in.element_size() : 0;
  int64_t rows_out = 0;  // to the other ranks: a rank's own rows stay in its memory
  for (int j = 0; j < comm.size(); ++j)
    if (j != comm.rank()) rows_out += send[j];
  stats.all_to_alls += 1;
  stats.all_to_all_seconds += work->seconds() > 0.0 ? work->seconds() : wall;
  stats.all_to_all_bytes += rows_out * row_bytes;
  return out;
}

struct AllToAll : torch::autograd::Function<AllToAll> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IValue exchange) {
    auto e = c10::static_intrusive_pointer_cast<Exchange>(exchange.toCapsule());
    ctx->saved_data["exchange"] = exchange;
    return exchange_rows(x, e->send_counts, e->recv_counts, *e->comm, *e->stats);
  }
  // Every rank takes part, also one whose output had no gradient (materialised as zeros).
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto e = c10::static_intrusive_pointer_cast<Exchange>(ctx->saved_data["exchange"].toCapsule());
    return {exchange_rows(g[0], e->recv_counts, e->send_counts, *e->comm, *e->stats), at::Tensor()};
  }
};

}  // namespace

std::vector<int64_t> exchange_counts(Communicator& comm, const std::vector<int64_t>& send_counts) {
  check_counts(comm, "exchange_counts", "send_counts", send_counts);
  const int n = comm.size();
  // The NCCL backend moves tensors on this thread's current CUDA device.
  auto opts = at::TensorOptions().dtype(at::kLong).device(comm.backend() == "nccl" ? at::kCUDA : at::kCPU);
  at::Tensor in = at::tensor(send_counts, at::kLong).to(opts.device());
  at::Tensor out = at::empty({n}, opts);
  comm.alltoall(out, in, std::vector<int64_t>(n, 1), std::vector<int64_t>(n, 1));
  out = out.cpu();
  return std::vector<int64_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + n);
}

at::Tensor all_to_all(const at::Tensor& input, const std::vector<int64_t>& send_counts,
                      const std::vector<int64_t>& recv_counts, const CommPtr& comm) {
  if (!comm) throw std::invalid_argument("all_to_all: no communicator");
  check_counts(*comm, "all_to_all", "send_counts", send_counts);
  check_counts(*comm, "all_to_all", "recv_counts", recv_counts);
  const int64_t sent = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
  if (!input.defined() || input.dim() < 1 || input.size(0) != sent) {
    std::ostringstream os;
    os << "all_to_all on rank " << comm->rank() << ": send_counts " << list_text(send_counts) << " sum to " << sent
       << " rows but the input is ";
    if (input.defined()) {
      os << input.sizes();
    } else {
      os << "undefined";
    }
    throw std::invalid_argument(os.str());
  }
  auto e = c10::make_intrusive<Exchange>();
  e->comm = comm;
  e->send_counts = send_counts;
  e->recv_counts = recv_counts;
  e->stats = &mutable_moe_stats();
  return AllToAll::apply(input, c10::IValue::make_capsule(std::move(e)));
}

}  // namespace tandem::moe
