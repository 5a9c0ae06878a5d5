#include "strategy/model_sync.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <climits>
#include <sstream>

namespace tandem::detail {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << t.sizes();
  return os.str();
}

}  // namespace

void check_same_model(Communicator& comm, const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                      const std::vector<std::pair<std::string, at::Tensor>>& buffers, const std::string& who) {
  const at::Device device = params.empty() ? at::Device(at::kCPU) : params[0].device();
  std::ostringstream sig;
  std::vector<std::string> lines;
  for (size_t i = 0; i < params.size(); ++i) lines.push_back("parameter '" + names[i] + "' " + shape_str(params[i]));
  for (auto& b : buffers) lines.push_back("buffer '" + b.first + "' " + shape_str(b.second));
  for (auto& l : lines) sig << l << '\n';
  std::string mine = sig.str();

  auto opts_u8 = at::TensorOptions().dtype(at::kByte).device(device);
  auto opts_i64 = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), opts_i64);
  comm.broadcast(len, 0);
  int64_t n = len.cpu().item<int64_t>();
  at::Tensor bytes = at::zeros({std::max<int64_t>(n, 1)}, opts_u8);
  if (comm.rank() == 0 && n > 0) bytes.copy_(at::from_blob(mine.data(), {n}, at::kByte));
  comm.broadcast(bytes, 0);
  at::Tensor host = bytes.cpu();
  std::string root(reinterpret_cast<const char*>(host.data_ptr<uint8_t>()), static_cast<size_t>(n));

  std::vector<std::string> root_lines;
  std::istringstream is(root);
  for (std::string l; std::getline(is, l);) root_lines.push_back(l);
  int64_t first_diff = INT64_MAX;
  for (size_t i = 0; i < std::max(lines.size(), root_lines.size()); ++i) {
    if (i >= lines.size() || i >= root_lines.size() || lines[i] != root_lines[i]) {
      first_diff = static_cast<int64_t>(i);
      break;
    }
  }
  at::Tensor diff = at::full({1}, first_diff == INT64_MAX ? -1 : first_diff, opts_i64);
  at::Tensor all = at::empty({comm.size()}, opts_i64);
  comm.allgather(all, diff);
  auto all_cpu = all.cpu();
  std::vector<int> bad;
  for (int r = 0; r < comm.size(); ++r)
    if (all_cpu[r].item<int64_t>() >= 0) bad.push_back(r);
  if (bad.empty()) return;
  std::ostringstream msg;
  msg << "rank " << comm.rank() << ": " << who << " needs the same model on every rank; ";
  if (first_diff != INT64_MAX) {
    auto i = static_cast<size_t>(first_diff);
    msg << "entry #" << i << " here is " << (i < lines.size() ? lines[i] : std::string("missing"))
        << " but on rank 0 it is " << (i < root_lines.size() ? root_lines[i] : std::string("missing"));
  } else {
    msg << "rank(s)";
    for (int r : bad) msg << ' ' << r;
    msg << " hold a model different from rank 0's (see their errors)";
  }
  msg << ". Build the model identically on every rank.";
  throw std::invalid_argument(msg.str());
}

void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& params,
                          const std::vector<std::pair<std::string, at::Tensor>>& buffers, bool include_params) {
  torch::NoGradGuard ng;
  std::vector<WorkPtr> works;
  if (include_params)
    for (auto& p : params) works.push_back(comm.broadcast_async(p.detach(), 0));
  for (auto& b : buffers)
    if (b.second.defined()) works.push_back(comm.broadcast_async(b.second.detach(), 0));
  for (auto& w : works) w->wait();
}

}  // namespace tandem::detail
