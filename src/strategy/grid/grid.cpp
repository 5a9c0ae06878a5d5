// ProcessGrid: three Communicator::split calls; gradient averaging and parameter broadcast helpers.
#include "tandem/grid.h"

#include <torch/torch.h>

#include <stdexcept>

namespace tandem {

ProcessGrid::ProcessGrid(CommPtr world, int tp, int pp, int cp) : world_(std::move(world)), tp_(tp), pp_(pp), cp_(cp) {
  if (!world_) throw std::invalid_argument("tandem::ProcessGrid: no world communicator given");
  const int n = world_->size();
  if (tp < 1 || pp < 1 || cp < 1) {
    throw std::invalid_argument("tandem::ProcessGrid: tp, pp and cp must be >= 1, got tp " + std::to_string(tp) +
                                ", pp " + std::to_string(pp) + ", cp " + std::to_string(cp));
  }
  if (n % (tp * pp * cp) != 0) {
    throw std::invalid_argument("tandem::ProcessGrid: tp " + std::to_string(tp) + " x pp " + std::to_string(pp) +
                                " x cp " + std::to_string(cp) + " does not divide the " + std::to_string(n) +
                                " ranks; choose sizes whose product divides the number of workers");
  }
  dp_ = n / (tp * pp * cp);
  const int r = world_->rank();
  tp_rank_ = r % tp;
  cp_rank_ = (r / tp) % cp;
  dp_rank_ = (r / (tp * cp)) % dp_;
  pp_rank_ = r / (tp * cp * dp_);
  // Same split order on every rank. Colors identify the group (the other coordinates), keys order it.
  tp_comm_ = world_->split(/*color=*/(pp_rank_ * dp_ + dp_rank_) * cp + cp_rank_, /*key=*/tp_rank_);
  pp_comm_ = world_->split(/*color=*/(dp_rank_ * cp + cp_rank_) * tp + tp_rank_, /*key=*/pp_rank_);
  dp_comm_ = world_->split(/*color=*/(pp_rank_ * cp + cp_rank_) * tp + tp_rank_, /*key=*/dp_rank_);
  if (cp > 1) {
    cp_comm_ = world_->split(/*color=*/(pp_rank_ * dp_ + dp_rank_) * tp + tp_rank_, /*key=*/cp_rank_);
    dp_cp_comm_ = world_->split(/*color=*/pp_rank_ * tp + tp_rank_, /*key=*/dp_rank_ * cp + cp_rank_);
  } else {
    dp_cp_comm_ = dp_comm_;
  }
  const bool cp_ok = cp == 1 || (cp_comm_ && cp_comm_->size() == cp && cp_comm_->rank() == cp_rank_ && dp_cp_comm_ &&
                                 dp_cp_comm_->size() == dp_ * cp && dp_cp_comm_->rank() == dp_rank_ * cp + cp_rank_);
  if (!tp_comm_ || !pp_comm_ || !dp_comm_ || tp_comm_->size() != tp || pp_comm_->size() != pp ||
      dp_comm_->size() != dp_ || tp_comm_->rank() != tp_rank_ || pp_comm_->rank() != pp_rank_ ||
      dp_comm_->rank() != dp_rank_ || !cp_ok) {
    throw CommError("rank " + std::to_string(r) +
                    ": tandem::ProcessGrid: split gave groups of unexpected size or rank (" + describe() +
                    "); is every rank building the same grid?");
  }
}

int ProcessGrid::world_rank_of(int dp_rank, int pp_rank, int tp_rank, int cp_rank) const {
  return tp_rank + tp_ * (cp_rank + cp_ * (dp_rank + dp_ * pp_rank));
}

std::string ProcessGrid::describe() const {
  return "dp " + std::to_string(dp_rank_) + "/" + std::to_string(dp_) +
         (cp_ > 1 ? ", cp " + std::to_string(cp_rank_) + "/" + std::to_string(cp_) : std::string()) + ", pp " +
         std::to_string(pp_rank_) + "/" + std::to_string(pp_) + ", tp " + std::to_string(tp_rank_) + "/" +
         std::to_string(tp_);
}

namespace {
// Parameters grouped by dtype and device, so that each group goes out as one flat buffer.
std::vector<std::vector<size_t>> groups_of(const std::vector<at::Tensor>& params) {
  std::vector<std::vector<size_t>> groups;
  std::vector<bool> done(params.size(), false);
  for (size_t i = 0; i < params.size(); ++i) {
    if (done[i]) continue;
    std::vector<size_t> group;
    for (size_t j = i; j < params.size(); ++j) {
      if (!done[j] && params[j].scalar_type() == params[i].scalar_type() && params[j].device() == params[i].device()) {
        group.push_back(j);
        done[j] = true;
      }
    }
    groups.push_back(std::move(group));
  }
  return groups;
}

template <typename F>
void for_each_group(const std::vector<at::Tensor>& params, F&& f) {
  for (const auto& g : groups_of(params)) f(g);
}

// The gradients of `group` (zeros where a parameter has none, which then gets them) flattened.
std::vector<at::Tensor> flat_grads(const std::vector<at::Tensor>& params, const std::vector<size_t>& group) {
  std::vector<at::Tensor> flat;
  for (size_t i : group) {
    auto p = params[i];
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    flat.push_back(p.grad().reshape({-1}));
  }
  return flat;
}

void copy_back(const std::vector<at::Tensor>& params, const std::vector<size_t>& group, const at::Tensor& buf) {
  int64_t off = 0;
  for (size_t i : group) {
    auto g = params[i].grad();
    g.copy_(buf.narrow(0, off, g.numel()).view_as(g));
    off += g.numel();
  }
}
}  // namespace

void average_gradients(const std::vector<at::Tensor>& params, Communicator& comm) {
  if (comm.size() == 1) return;
  torch::NoGradGuard ng;
  for_each_group(params, [&](const std::vector<size_t>& group) {
    auto buf = at::cat(flat_grads(params, group));
    comm.allreduce(buf, ReduceOp::kAvg);
    copy_back(params, group, buf);
  });
}

GradientAverager::GradientAverager(std::vector<at::Tensor> params, CommPtr comm)
    : params_(std::move(params)), comm_(std::move(comm)) {
  if (!comm_) throw std::invalid_argument("tandem::GradientAverager: no communicator");
}

void GradientAverager::average() {
  if (comm_->size() == 1) return;
  torch::NoGradGuard ng;
  const bool first = buffers_.empty();
  if (first) groups_ = groups_of(params_);  // the dtypes now (a model may be converted after construction)
  for (size_t k = 0; k < groups_.size(); ++k) {
    auto flat = flat_grads(params_, groups_[k]);
    if (first) {
      int64_t total = 0;
      for (const auto& f : flat) total += f.numel();
      buffers_.push_back(symmetric_empty(*comm_, total, flat.front().options()));
    }
    at::cat_out(buffers_[k], flat);
    comm_->allreduce(buffers_[k], ReduceOp::kAvg);
    copy_back(params_, groups_[k], buffers_[k]);
  }
}

void broadcast_parameters(const std::vector<at::Tensor>& params, Communicator& comm, int root) {
  if (comm.size() == 1) return;
  torch::NoGradGuard ng;
  for_each_group(params, [&](const std::vector<size_t>& group) {
    std::vector<at::Tensor> flat;
    for (size_t i : group) flat.push_back(params[i].detach().reshape({-1}));
    auto buf = at::cat(flat);
    comm.broadcast(buf, root);
    int64_t off = 0;
    for (size_t i : group) {
      auto p = params[i].detach();
      p.copy_(buf.narrow(0, off, p.numel()).view_as(p));
      off += p.numel();
    }
  });
}

}  // namespace tandem
