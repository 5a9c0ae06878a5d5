// Shared pieces of every backend: counters, error text, completed work, and the
// world-size-1 "self" communicator.
#include <ATen/ATen.h>

#include <cstring>
#include <sstream>
#include <stdexcept>

#include "comm/backends.h"
#include "tandem/comm.h"

namespace tandem {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

std::map<std::string, OpStats> Communicator::stats() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return stats_;
}

void Communicator::reset_stats() {
  std::lock_guard<std::mutex> lk(stats_mu_);
  stats_.clear();
}

void Communicator::record(const std::string& op, int64_t bytes) {
  std::lock_guard<std::mutex> lk(stats_mu_);
  auto& s = stats_[op];
  s.calls += 1;
  s.bytes += bytes;
}

void Communicator::record_seconds(const std::string& op, double seconds) {
  std::lock_guard<std::mutex> lk(stats_mu_);
  stats_[op].seconds += seconds;
}

std::vector<std::string> allgather_strings(Communicator& comm, const std::string& mine) {
  const int world = comm.size();
  auto len = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
  auto lens = at::empty({world}, at::kLong);
  comm.allgather(lens, len);
  const int64_t longest = std::max<int64_t>(1, lens.max().item<int64_t>());
  auto buf = at::zeros({longest}, at::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  auto all = at::empty({world * longest}, at::kByte);
  comm.allgather(all, buf);
  std::vector<std::string> out;
  for (int r = 0; r < world; ++r) {
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * longest, lens[r].item<int64_t>());
  }
  return out;
}

#ifndef TANDEM_WITH_MPI
bool has_mpi_backend() { return false; }
#endif
#ifndef TANDEM_WITH_NCCL
bool has_nccl_backend() { return false; }
#endif

at::Tensor symmetric_empty(Communicator& comm, int64_t numel, const at::TensorOptions& opts) {
#ifdef TANDEM_WITH_MPI
  if (auto t = detail::mpi_symmetric_empty(comm, numel, opts); t.defined()) return t;
#endif
  return at::empty({numel}, opts);
}

namespace detail {

std::string describe(int rank, const std::string& op, const at::Tensor& t) {
  std::ostringstream os;
  os << "rank " << rank << ": " << op;
  if (t.defined()) {
    os << " of " << c10::toString(t.scalar_type()) << t.sizes() << " (" << t.numel() * t.element_size() << " bytes)";
  }
  return os.str();
}

namespace {

// "[2, 0, 1]"
std::string list_text(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << c10::IntArrayRef(v);
  return os.str();
}

// One side's splits against its tensor: one per rank, none negative, summing to its rows.
void check_splits(const std::string& what, int size, const char* name, const std::vector<int64_t>& splits,
                  const char* tensor, int64_t rows) {
  if (static_cast<int64_t>(splits.size()) != size) {
    throw std::invalid_argument(what + ": " + name + " " + list_text(splits) + " has " + std::to_string(splits.size()) +
                                " entries, expected one per rank (" + std::to_string(size) + ")");
  }
  int64_t sum = 0;
  for (int64_t n : splits) {
    if (n < 0) throw std::invalid_argument(what + ": " + name + " " + list_text(splits) + " has a negative count");
    sum += n;
  }
  if (sum != rows) {
    throw std::invalid_argument(what + ": " + name + " " + list_text(splits) + " sum to " + std::to_string(sum) +
                                " rows but the " + tensor + " has " + std::to_string(rows));
  }
}

class CompletedWork : public Work {
 public:
  explicit CompletedWork(std::exception_ptr e) : error_(std::move(e)) {}
  void wait() override {
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() override { return true; }

 private:
  std::exception_ptr error_;
};

void check_same_device(int rank, const char* op, const at::Tensor& a, const at::Tensor& b) {
  if (a.device() != b.device() || a.scalar_type() != b.scalar_type()) {
    throw CommError(describe(rank, op, a) + ": input and output differ in device or dtype (" +
                    c10::toString(a.scalar_type()) + " on " + a.device().str() + " vs " +
                    c10::toString(b.scalar_type()) + " on " + b.device().str() + ")");
  }
}

// World size 1: every operation is a local copy, completed on return.
class SelfCommunicator : public Communicator {
 public:
  explicit SelfCommunicator(const CommOptions& o) : Communicator(o) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "self"; }

  WorkPtr allreduce_async(at::Tensor t, ReduceOp) override {
    record("allreduce", t.numel() * t.element_size());
    return completed_work();
  }
  WorkPtr reduce_scatter_async(at::Tensor out, at::Tensor in, ReduceOp) override {
    return copy_op("reduce_scatter", out, in);
  }
  WorkPtr allgather_async(at::Tensor out, at::Tensor in) override { return copy_op("allgather", out, in); }
  WorkPtr broadcast_async(at::Tensor t, int root) override {
    if (root != 0)
      throw CommError(describe(0, "broadcast", t) + ": root " + std::to_string(root) +
                      " out of range for world size 1");
    record("broadcast", t.numel() * t.element_size());
    return completed_work();
  }
  WorkPtr send_async(at::Tensor t, int dst, int) override {
    throw CommError(describe(0, "send", t) + ": no peer " + std::to_string(dst) + " in a world of size 1");
  }
  WorkPtr recv_async(at::Tensor t, int src, int) override {
    throw CommError(describe(0, "recv", t) + ": no peer " + std::to_string(src) + " in a world of size 1");
  }
  WorkPtr barrier_async() override { return completed_work(); }
  WorkPtr alltoall_async(at::Tensor out, at::Tensor in, std::vector<int64_t> out_splits,
                         std::vector<int64_t> in_splits) override {
    check_alltoall(0, 1, out, in, out_splits, in_splits);
    if (out_splits[0] != in_splits[0]) {
      throw std::invalid_argument(describe(0, "alltoall", in) + ": sends " + std::to_string(in_splits[0]) +
                                  " rows to itself but expects " + std::to_string(out_splits[0]));
    }
    record("alltoall", in.numel() * in.element_size());
    out.copy_(in);
    return completed_work();
  }
  CommPtr split(int color, int) override {
    if (color < 0) return nullptr;
    return std::make_shared<SelfCommunicator>(CommOptions{timeout()});
  }

 private:
  WorkPtr copy_op(const char* op, at::Tensor& out, at::Tensor& in) {
    check_same_device(0, op, in, out);
    if (in.numel() != out.numel()) {
      throw CommError(describe(0, op, in) + ": output has " + std::to_string(out.numel()) + " elements, expected " +
                      std::to_string(in.numel()));
    }
    record(op, in.numel() * in.element_size());
    out.copy_(in.reshape(out.sizes()));
    return completed_work();
  }
};

}  // namespace

WorkPtr completed_work(std::exception_ptr error) { return std::make_shared<CompletedWork>(std::move(error)); }

int64_t check_alltoall(int rank, int size, const at::Tensor& out, const at::Tensor& in,
                       const std::vector<int64_t>& out_splits, const std::vector<int64_t>& in_splits) {
  const std::string what = describe(rank, "alltoall", in);
  if (!in.defined() || !out.defined()) throw std::invalid_argument(what + ": undefined input or output tensor");
  std::ostringstream shapes;
  shapes << "input " << c10::toString(in.scalar_type()) << in.sizes() << " on " << in.device() << ", output "
         << c10::toString(out.scalar_type()) << out.sizes() << " on " << out.device();
  if (in.dim() < 1 || out.dim() != in.dim() || in.sizes().slice(1) != out.sizes().slice(1)) {
    throw std::invalid_argument(what + ": input and output must be rows (dim 0) of one shape: " + shapes.str());
  }
  if (in.scalar_type() != out.scalar_type() || in.device() != out.device()) {
    throw std::invalid_argument(what + ": input and output differ in dtype or device: " + shapes.str());
  }
  if (!in.is_contiguous() || !out.is_contiguous()) {
    throw std::invalid_argument(what + ": input and output must be contiguous (" + shapes.str() +
                                "); call .contiguous() first");
  }
  if (in.numel() > 0 && out.numel() > 0 && out.is_alias_of(in)) {
    throw std::invalid_argument(what + ": output shares memory with the input; give it a buffer of its own");
  }
  check_splits(what, size, "input_splits", in_splits, "input", in.size(0));
  check_splits(what, size, "output_splits", out_splits, "output", out.size(0));
  int64_t row = 1;
  for (auto d : in.sizes().slice(1)) row *= d;
  return row;
}

std::vector<int64_t> split_offsets(const std::vector<int64_t>& splits) {
  std::vector<int64_t> off(splits.size(), 0);
  for (size_t j = 1; j < splits.size(); ++j) off[j] = off[j - 1] + splits[j - 1];
  return off;
}

}  // namespace detail

CommPtr make_self_communicator(const CommOptions& opts) { return std::make_shared<detail::SelfCommunicator>(opts); }
}  // namespace tandem
