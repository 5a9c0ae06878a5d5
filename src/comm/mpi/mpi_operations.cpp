// The MPI backend's operations: collectives and point-to-point, each queued for the progress
// thread as its blocking and non-blocking MPI calls, and the 16-bit reductions MPI lacks.
#include <mpi.h>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "comm/backends.h"
#include "comm/mpi/mpi_communicator.h"
#include "tandem/comm.h"

namespace tandem {
namespace detail {

namespace {

// ---- reductions MPI lacks: bfloat16 and float16, carried as 16-bit words
template <typename T>
void sum_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}
template <typename T>
void max_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    if (x > y || x != x) b[i] = a[i];
  }
}

struct HalfOps {
  MPI_Op bf16_sum, bf16_max, f16_sum, f16_max;
};
const HalfOps& half_ops() {
  static HalfOps ops = [] {
    HalfOps o{};
    MPI_Op_create(&sum_fn<c10::BFloat16>, 1, &o.bf16_sum);
    MPI_Op_create(&max_fn<c10::BFloat16>, 1, &o.bf16_max);
    MPI_Op_create(&sum_fn<c10::Half>, 1, &o.f16_sum);
    MPI_Op_create(&max_fn<c10::Half>, 1, &o.f16_max);
    return o;
  }();
  return ops;
}

MPI_Datatype mpi_type(at::ScalarType t, const std::string& where) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kChar: return MPI_INT8_T;
    case at::kBool: return MPI_C_BOOL;
    case at::kBFloat16:
    case at::kHalf: return MPI_UINT16_T;
    default:
      throw CommError(where + ": dtype " + c10::toString(t) +
                      " is not supported by the MPI backend (use float32, float64, bfloat16, float16, "
                      "int64, int32, int8 or uint8)");
  }
}

MPI_Op mpi_op(ReduceOp op, at::ScalarType t, const std::string& where) {
  if (t == at::kBFloat16) return op == ReduceOp::kMax ? half_ops().bf16_max : half_ops().bf16_sum;
  if (t == at::kHalf) return op == ReduceOp::kMax ? half_ops().f16_max : half_ops().f16_sum;
  if (t == at::kBool) {
    if (op == ReduceOp::kAvg) throw CommError(where + ": avg of a bool tensor is undefined");
    return op == ReduceOp::kMax ? MPI_LOR : MPI_LOR;
  }
  if (op == ReduceOp::kAvg && !at::isFloatingType(t)) {
    throw CommError(where + ": avg needs a floating-point tensor; use sum on " + c10::toString(t));
  }
  return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
}

int checked_count(int64_t n, const std::string& where) {
  if (n > INT_MAX) {
    throw CommError(where + ": " + std::to_string(n) + " elements exceed MPI's int count; split the tensor");
  }
  return static_cast<int>(n);
}

}  // namespace

WorkPtr MpiCommunicator::allreduce_async(at::Tensor t, ReduceOp op) {
  auto what = describe(rank_, std::string("allreduce(") + to_string(op) + ")", t);
  check_cpu(t, what);
  verify(kOpAllreduce, static_cast<int64_t>(op), &t, what);
  auto type = mpi_type(t.scalar_type(), what);
  auto mop = mpi_op(op, t.scalar_type(), what);
  int count = checked_count(t.numel(), what);
  at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
  int n = size_;
  if (auto shm = find_window(buf, op)) {
    const size_t off = static_cast<size_t>(static_cast<char*>(buf.data_ptr()) - shm->base);
    const auto st = buf.scalar_type();
    const int64_t numel = buf.numel();
    auto run = [=] { shm_allreduce(*shm, off, numel, st, op == ReduceOp::kAvg, what); };
    return enqueue(
        "allreduce", what, t.numel() * t.element_size(),
        [=](std::vector<MPI_Request>& r) {
          r.clear();
          run();
        },
        [] {}, run);
  }
  // fp16 averages divide first: the sum of n gradients near fp16's largest value (a loss
  // scale just under overflow) would overflow where their mean does not, and skip a step that
  // one process takes.
  const bool pre = op == ReduceOp::kAvg && t.scalar_type() == at::kHalf;
  return enqueue(
      "allreduce", what, t.numel() * t.element_size(),
      [=](std::vector<MPI_Request>& r) {
        r.resize(1);
        if (pre) buf.div_(n);
        check(MPI_Iallreduce(MPI_IN_PLACE, buf.data_ptr(), count, type, mop, comm_, &r[0]), what);
      },
      [=]() mutable {
        if (op == ReduceOp::kAvg && !pre) buf.div_(n);
        if (!buf.is_same(t)) t.copy_(buf);
      },
      [=] {
        if (pre) buf.div_(n);
        check(MPI_Allreduce(MPI_IN_PLACE, buf.data_ptr(), count, type, mop, comm_), what);
      });
}

WorkPtr MpiCommunicator::reduce_scatter_async(at::Tensor out, at::Tensor in, ReduceOp op) {
  auto what = describe(rank_, std::string("reduce_scatter(") + to_string(op) + ")", in);
  check_cpu(in, what);
  verify(kOpReduceScatter, static_cast<int64_t>(op), &in, what);
  check_pair(out, in, what);
  if (in.numel() != out.numel() * size_) {
    throw CommError(what + ": input has " + std::to_string(in.numel()) + " elements, expected world size " +
                    std::to_string(size_) + " x output's " + std::to_string(out.numel()));
  }
  auto type = mpi_type(in.scalar_type(), what);
  auto mop = mpi_op(op, in.scalar_type(), what);
  int count = checked_count(out.numel(), what);
  checked_count(in.numel(), what);
  int n = size_;
  if (auto shm = find_window(in, op)) {
    // Shared memory: each rank sums its chunk straight from the n input buffers.
    const size_t off = static_cast<size_t>(static_cast<char*>(in.data_ptr()) - shm->base);
    const auto st = in.scalar_type();
    const int64_t chunk = out.numel();
    at::Tensor dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
    auto run = [=] { shm_reduce_scatter(*shm, off, chunk, st, op == ReduceOp::kAvg, dst.data_ptr(), what); };
    return enqueue(
        "reduce_scatter", what, in.numel() * in.element_size(),
        [=](std::vector<MPI_Request>& r) {
          r.clear();
          run();
        },
        [=]() mutable {
          if (!dst.is_same(out)) out.copy_(dst);
        },
        run);
  }
  const bool pre = op == ReduceOp::kAvg && in.scalar_type() == at::kHalf;  // as allreduce
  if (is_own_chunk(out, in)) {
    // In place: MPI_IN_PLACE takes the input from the receive buffer and leaves the result
    // at its start; move it to this rank's chunk.
    const int64_t bytes = out.numel() * out.element_size();
    const int me = rank_;
    return enqueue(
        "reduce_scatter", what, in.numel() * in.element_size(),
        [=](std::vector<MPI_Request>& r) {
          r.resize(1);
          if (pre) in.div_(n);
          check(MPI_Ireduce_scatter_block(MPI_IN_PLACE, in.data_ptr(), count, type, mop, comm_, &r[0]), what);
        },
        [=]() mutable {
          if (me != 0) std::memcpy(out.data_ptr(), in.data_ptr(), bytes);
          if (op == ReduceOp::kAvg && !pre) out.div_(n);
        },
        [=] {
          if (pre) in.div_(n);
          check(MPI_Reduce_scatter_block(MPI_IN_PLACE, in.data_ptr(), count, type, mop, comm_), what);
        });
  }
  // Not in place: the input is the caller's, so a divided fp16 input is a copy.
  at::Tensor src = pre ? in.div(n).contiguous() : in.contiguous();
  at::Tensor dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  return enqueue(
      "reduce_scatter", what, in.numel() * in.element_size(),
      [=](std::vector<MPI_Request>& r) {
        r.resize(1);
        check(MPI_Ireduce_scatter_block(src.data_ptr(), dst.data_ptr(), count, type, mop, comm_, &r[0]), what);
      },
      [=]() mutable {
        if (op == ReduceOp::kAvg && !pre) dst.div_(n);
        if (!dst.is_same(out)) out.copy_(dst);
      },
      [=] { check(MPI_Reduce_scatter_block(src.data_ptr(), dst.data_ptr(), count, type, mop, comm_), what); });
}

WorkPtr MpiCommunicator::allgather_async(at::Tensor out, at::Tensor in) {
  auto what = describe(rank_, "allgather", in);
  check_cpu(in, what);
  verify(kOpAllgather, 0, &in, what);
  check_pair(out, in, what);
  if (out.numel() != in.numel() * size_) {
    throw CommError(what + ": output has " + std::to_string(out.numel()) + " elements, expected world size " +
                    std::to_string(size_) + " x input's " + std::to_string(in.numel()));
  }
  auto type = mpi_type(in.scalar_type(), what);
  int count = checked_count(in.numel(), what);
  checked_count(out.numel(), what);
  if (auto shm = find_window(out, ReduceOp::kSum)) {
    // Shared memory: each rank copies the others' chunks straight from their output buffers.
    const size_t off = static_cast<size_t>(static_cast<char*>(out.data_ptr()) - shm->base);
    const int64_t bytes = in.numel() * in.element_size();
    at::Tensor src = is_own_chunk(in, out) ? at::Tensor() : in.contiguous();
    auto run = [=] { shm_allgather(*shm, off, bytes, src.defined() ? src.data_ptr() : nullptr, what); };
    return enqueue(
        "allgather", what, bytes,
        [=](std::vector<MPI_Request>& r) {
          r.clear();
          run();
        },
        [] {}, run);
  }
  if (is_own_chunk(in, out)) {
    // In place: this rank's contribution already sits where it will be received.
    return enqueue(
        "allgather", what, in.numel() * in.element_size(),
        [=](std::vector<MPI_Request>& r) {
          r.resize(1);
          check(MPI_Iallgather(MPI_IN_PLACE, 0, type, out.data_ptr(), count, type, comm_, &r[0]), what);
        },
        [] {}, [=] { check(MPI_Allgather(MPI_IN_PLACE, 0, type, out.data_ptr(), count, type, comm_), what); });
  }
  at::Tensor src = in.contiguous();
  at::Tensor dst = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  return enqueue(
      "allgather", what, in.numel() * in.element_size(),
      [=](std::vector<MPI_Request>& r) {
        r.resize(1);
        check(MPI_Iallgather(src.data_ptr(), count, type, dst.data_ptr(), count, type, comm_, &r[0]), what);
      },
      [=]() mutable {
        if (!dst.is_same(out)) out.copy_(dst);
      },
      [=] { check(MPI_Allgather(src.data_ptr(), count, type, dst.data_ptr(), count, type, comm_), what); });
}

WorkPtr MpiCommunicator::broadcast_async(at::Tensor t, int root) {
  auto what = describe(rank_, "broadcast(root " + std::to_string(root) + ")", t);
  check_cpu(t, what);
  check_peer(root, what);
  verify(kOpBroadcast, root, &t, what);
  auto type = mpi_type(t.scalar_type(), what);
  int count = checked_count(t.numel(), what);
  at::Tensor buf = t.is_contiguous() ? t : t.contiguous();
  return enqueue(
      "broadcast", what, t.numel() * t.element_size(),
      [=](std::vector<MPI_Request>& r) {
        r.resize(1);
        check(MPI_Ibcast(buf.data_ptr(), count, type, root, comm_, &r[0]), what);
      },
      [=]() mutable {
        if (!buf.is_same(t)) t.copy_(buf);
      },
      [=] { check(MPI_Bcast(buf.data_ptr(), count, type, root, comm_), what); });
}

WorkPtr MpiCommunicator::send_async(at::Tensor t, int dst, int tag) {
  auto what = describe(rank_, "send(to " + std::to_string(dst) + ", tag " + std::to_string(tag) + ")", t);
  check_cpu(t, what);
  check_peer(dst, what);
  auto type = mpi_type(t.scalar_type(), what);
  int count = checked_count(t.numel(), what);
  at::Tensor buf = t.contiguous();
  return enqueue(
      "send", what, t.numel() * t.element_size(),
      [=](std::vector<MPI_Request>& r) {
        r.resize(1);
        check(MPI_Isend(buf.data_ptr(), count, type, dst, tag, comm_, &r[0]), what);
      },
      [] {});
}

WorkPtr MpiCommunicator::recv_async(at::Tensor t, int src, int tag) {
  auto what = describe(rank_, "recv(from " + std::to_string(src) + ", tag " + std::to_string(tag) + ")", t);
  check_cpu(t, what);
  check_peer(src, what);
  auto type = mpi_type(t.scalar_type(), what);
  int count = checked_count(t.numel(), what);
  at::Tensor buf = t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous);
  return enqueue(
      "recv", what, t.numel() * t.element_size(),
      [=](std::vector<MPI_Request>& r) {
        r.resize(1);
        check(MPI_Irecv(buf.data_ptr(), count, type, src, tag, comm_, &r[0]), what);
      },
      [=]() mutable {
        if (!buf.is_same(t)) t.copy_(buf);
      });
}

WorkPtr MpiCommunicator::alltoall_async(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits,
                                        std::vector<int64_t> in_splits) {
  auto what = describe(rank_, "alltoall", in);
  check_cpu(in, what);
  check_cpu(out, what);
  // The fingerprint of a row: the ranks' row counts differ, the row's dtype and shape must not.
  std::vector<int64_t> row_shape = in.sizes().vec();
  int64_t row_elems = 1;
  for (size_t d = 1; d < row_shape.size(); ++d) row_elems *= row_shape[d];
  if (!row_shape.empty()) row_shape[0] = 0;
  at::Tensor rows = at::empty(row_shape, in.options());
  verify(kOpAlltoall, row_elems, &rows, what);
  const int64_t row = check_alltoall(rank_, size_, out, in, out_splits, in_splits);
  auto type = mpi_type(in.scalar_type(), what);
  // MPI counts and displacements are ints, in elements: they fit when both totals do.
  checked_count(in.numel(), what);
  checked_count(out.numel(), "rank " + std::to_string(rank_) + ": alltoall's output of " +
                                 c10::toString(out.scalar_type()) + " x " + std::to_string(out.numel()));
  // counts, displacements: sends at [0, n), [n, 2n); receives at [2n, 3n), [3n, 4n).
  const int n = size_;
  auto cd = std::make_shared<std::vector<int>>(4 * static_cast<size_t>(n));
  const auto soff = split_offsets(in_splits), roff = split_offsets(out_splits);
  for (int j = 0; j < n; ++j) {
    (*cd)[j] = static_cast<int>(in_splits[j] * row);
    (*cd)[n + j] = static_cast<int>(soff[j] * row);
    (*cd)[2 * n + j] = static_cast<int>(out_splits[j] * row);
    (*cd)[3 * n + j] = static_cast<int>(roff[j] * row);
  }
  // An empty tensor may have no storage: MPI gets distinct placeholders, never read or written.
  static char no_send, no_recv;
  void* sbuf = in.numel() > 0 ? in.data_ptr() : &no_send;
  void* rbuf = out.numel() > 0 ? out.data_ptr() : &no_recv;
  const int* c = cd->data();
  return enqueue(
      "alltoall", what, in.numel() * in.element_size(),
      [=](std::vector<MPI_Request>& r) {
        r.resize(1);
        check(MPI_Ialltoallv(sbuf, c, c + n, type, rbuf, c + 2 * n, c + 3 * n, type, comm_, &r[0]), what);
      },
      [cd, in, out] {  // holds the arrays and buffers until MPI is done with them
        (void)cd, (void)in, (void)out;
      },
      [=] { check(MPI_Alltoallv(sbuf, c, c + n, type, rbuf, c + 2 * n, c + 3 * n, type, comm_), what); });
}

WorkPtr MpiCommunicator::barrier_async() {
  auto what = "rank " + std::to_string(rank_) + ": barrier";
  verify(kOpBarrier, 0, nullptr, what);
  return enqueue(
      "barrier", what, 0,
      [=](std::vector<MPI_Request>& r) {
        r.resize(1);
        check(MPI_Ibarrier(comm_, &r[0]), what);
      },
      [] {}, [=] { check(MPI_Barrier(comm_), what); });
}

}  // namespace detail
}  // namespace tandem
