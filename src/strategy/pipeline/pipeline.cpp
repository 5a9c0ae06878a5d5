// Pipeline parallelism: partitions, the GPipe, 1F1B, interleaved 1F1B and zero-bubble schedules,
// activation/gradient transfer between stages, the split backward's deferred weight gradients,
// and the CPU memory meter used to measure activation memory.
//
// Transfers. Receives block (the data is needed); sends are asynchronous and kept in a pending
// list until they complete, so that two neighbours each sending before receiving (1F1B's steady
// state) cannot deadlock on a rendezvous-size message. Shapes are agreed per step: the first
// micro-batch's activation is preceded by a small header (dtype, rank, sizes, whether it requires
// a gradient); the others must have the same shape (equal micro-batches), which the sender
// checks. Each virtual stage's messages have tags of their own (a rank with several chunks
// receives from the same neighbour for each); a link between two chunks of the same rank (zb-v's
// turn on the last rank) hands the tensors over in process. Gradients go back only for activations that require one: a
// stage whose output does not depend on any trainable parameter (a leading Flatten or a frozen embedding) gets no
// gradient, and the next stage neither computes nor sends one for its input.
#include "tandem/pipeline.h"

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>

namespace tandem {

bool splits_backward(PipelineSchedule s) { return s == PipelineSchedule::kZBH1 || s == PipelineSchedule::kZBV; }

int pipeline_chunks(PipelineSchedule s, int virtual_stages) { return s == PipelineSchedule::kZBV ? 2 : virtual_stages; }

// ---------------------------------------------------------------- deferred weight gradients

namespace {
// Process-wide rather than thread-local: autograd runs a CUDA backward on its device thread.
std::atomic<bool> g_recording{false};
std::atomic<WeightGradStore*> g_capture{nullptr};

// at::linear whose backward queues the weight and bias gradients in the capturing store. The
// bias is an input only when there is one (a custom function takes no undefined inputs).
torch::autograd::variable_list deferred_linear_backward(torch::autograd::AutogradContext* ctx,
                                                        const torch::autograd::variable_list& grads) {
  auto saved = ctx->get_saved_variables();
  const at::Tensor &x = saved[0], &w = saved[1];
  const at::Tensor b = saved.size() > 2 ? saved[2] : at::Tensor();
  const at::Tensor& go = grads[0];
  at::Tensor gx, gw, gb;
  if (ctx->needs_input_grad(0)) gx = at::matmul(go, w);
  if (WeightGradStore* store = g_capture.load()) {
    store->add(go, x, w, b);
  } else {
    const auto g2 = go.reshape({-1, go.size(-1)});
    gw = g2.t().mm(x.reshape({-1, x.size(-1)}));
    if (b.defined()) gb = g2.sum(0);
  }
  if (saved.size() > 2) return {gx, gw, gb};
  return {gx, gw};
}

struct DeferredLinear : public torch::autograd::Function<DeferredLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b) {
    ctx->save_for_backward({x, w, b});
    return at::linear(x, w, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return deferred_linear_backward(ctx, grads);
  }
};

struct DeferredLinearNoBias : public torch::autograd::Function<DeferredLinearNoBias> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    return at::linear(x, w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return deferred_linear_backward(ctx, grads);
  }
};

bool deferrable(const at::Tensor& p) { return !p.defined() || (p.is_leaf() && p.requires_grad()); }
}  // namespace

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  if (!g_recording.load() || !torch::GradMode::is_enabled() || !weight.requires_grad() || !deferrable(weight) ||
      !deferrable(bias)) {
    return at::linear(input, weight, bias);
  }
  return bias.defined() ? DeferredLinear::apply(input, weight, bias) : DeferredLinearNoBias::apply(input, weight);
}

WeightGradStore::Recording::Recording() {
  if (g_recording.exchange(true)) throw std::logic_error("tandem::WeightGradStore: nested recordings");
}
WeightGradStore::Recording::~Recording() { g_recording = false; }

WeightGradStore::Capture::Capture(WeightGradStore& store) {
  WeightGradStore* none = nullptr;
  if (!g_capture.compare_exchange_strong(none, &store))
    throw std::logic_error("tandem::WeightGradStore: nested captures");
}
WeightGradStore::Capture::~Capture() { g_capture = nullptr; }

void WeightGradStore::add(at::Tensor grad_output, at::Tensor input, at::Tensor weight, at::Tensor bias) {
  entries_.push_back({std::move(grad_output), std::move(input), std::move(weight), std::move(bias)});
}

bool WeightGradStore::flush() {
  if (entries_.empty()) return false;
  // One gradient per parameter (a weight used twice sums its uses), accumulated in one backward.
  std::vector<at::Tensor> params, grads;
  auto add_grad = [&](const at::Tensor& p, const at::Tensor& g) {
    for (size_t k = 0; k < params.size(); ++k) {
      if (params[k].is_same(p)) {
        grads[k] = grads[k] + g;
        return;
      }
    }
    params.push_back(p);
    grads.push_back(g);
  };
  {
    torch::NoGradGuard ng;
    for (const auto& e : entries_) {
      const auto g2 = e.grad_output.reshape({-1, e.grad_output.size(-1)});
      add_grad(e.weight, g2.t().mm(e.input.reshape({-1, e.input.size(-1)})));
      if (e.bias.defined() && e.bias.requires_grad()) add_grad(e.bias, g2.sum(0));
    }
  }
  entries_.clear();
  torch::autograd::backward(params, grads);
  return true;
}

// ---------------------------------------------------------------- partitions

void validate_partition(const std::vector<int64_t>& parts, int64_t layers, int stages) {
  const std::string L = std::to_string(layers), S = std::to_string(stages);
  if (stages < 1) throw std::invalid_argument("tandem::Pipeline: need at least one stage, got " + S);
  if (stages > layers) {
    throw std::invalid_argument("tandem::Pipeline: " + S + " pipeline stages for a model of " + L +
                                " layers (children of the Sequential); use at most " + L +
                                " stages or a model with more layers");
  }
  if (static_cast<int64_t>(parts.size()) != stages) {
    throw std::invalid_argument("tandem::Pipeline: the partition has " + std::to_string(parts.size()) +
                                " entries for " + S + " stages; give one layer count per stage");
  }
  int64_t sum = 0;
  for (size_t s = 0; s < parts.size(); ++s) {
    if (parts[s] < 1) {
      throw std::invalid_argument("tandem::Pipeline: the partition gives stage " + std::to_string(s) + " " +
                                  std::to_string(parts[s]) + " layers; every stage needs at least one layer");
    }
    sum += parts[s];
  }
  if (sum != layers) {
    throw std::invalid_argument("tandem::Pipeline: the partition covers " + std::to_string(sum) +
                                " layers but the model has " + L +
                                " (children of the Sequential); the layer counts must add up to " + L);
  }
}

namespace {
torch::nn::AnyModule& child(torch::nn::Sequential& model, int64_t i) { return *(model->begin() + i); }

int64_t numel_of(const std::vector<at::Tensor>& ps) {
  int64_t n = 0;
  for (auto& p : ps) n += p.numel();
  return n;
}
}  // namespace

std::vector<int64_t> partition_by_parameters(torch::nn::Sequential& model, int stages) {
  std::vector<double> costs;
  for (auto it = model->begin(); it != model->end(); ++it) {
    costs.push_back(static_cast<double>(std::max<int64_t>(1, numel_of(it->ptr()->parameters()))));
  }
  if (stages > static_cast<int64_t>(costs.size())) validate_partition({}, static_cast<int64_t>(costs.size()), stages);
  return balance_partition(costs, stages);
}

std::vector<int64_t> partition_by_time(torch::nn::Sequential& model, const at::Tensor& sample_input, int stages,
                                       Communicator& comm, int reps) {
  const int64_t n = static_cast<int64_t>(model->size());
  if (stages > n) validate_partition({}, n, stages);
  std::vector<int64_t> parts(stages, 0);
  if (comm.rank() == 0) {
    // Timing runs the model in training mode: keep its buffers (batch norm's running statistics)
    // as they were, so that rank 0 does not start from different ones than the others.
    std::vector<at::Tensor> buffers, saved;
    for (auto& b : model->buffers()) {
      buffers.push_back(b);
      saved.push_back(b.clone());
    }
    std::vector<double> costs;
    at::Tensor x = sample_input;
    for (int64_t i = 0; i < n; ++i) {
      auto& m = child(model, i);
      at::Tensor xi = x.detach();
      if (at::isFloatingType(xi.scalar_type())) xi.requires_grad_(true);
      double best = std::numeric_limits<double>::infinity();
      at::Tensor y;
      for (int r = 0; r < std::max(1, reps); ++r) {
        auto t0 = std::chrono::steady_clock::now();
        y = m.forward(xi);
        if (y.requires_grad()) y.backward(at::ones_like(y));
        if (y.is_cuda()) y.cpu();  // synchronizes
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      costs.push_back(best);
      x = y.detach();
    }
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    {
      at::NoGradGuard ng;
      for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(saved[k]);
    }
    parts = balance_partition(costs, stages);
  }
  if (comm.size() > 1) {
    auto t = at::tensor(parts, at::kLong).to(sample_input.device());
    comm.broadcast(t, 0);
    t = t.cpu();
    for (int s = 0; s < stages; ++s) parts[s] = t[s].item<int64_t>();
  }
  return parts;
}

std::vector<int64_t> partition_for_option(const std::string& option, torch::nn::Sequential& model,
                                          const at::Tensor& samples, int64_t micro_batch, c10::Device device,
                                          int stages, Communicator& comm) {
  if (option != "time") return parse_partition_option(option, stages);
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(micro_batch, samples.size(0)));
  return partition_by_time(model, samples.narrow(0, 0, rows).to(device), stages, comm);
}

// ---------------------------------------------------------------- memory meter

namespace {
std::atomic<int64_t> g_current{0}, g_peak{0};
std::atomic<bool> g_installed{false};
c10::Allocator* g_base = nullptr;
c10::DeleterFnPtr g_base_deleter = nullptr;
constexpr size_t kHeaderBytes = 64;  // keeps c10's 64-byte alignment

void counting_delete(void* p) {
  if (!p) return;
  char* raw = static_cast<char*>(p) - kHeaderBytes;
  g_current.fetch_sub(*reinterpret_cast<int64_t*>(raw));
  g_base_deleter(raw);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* raw = g_base->raw_allocate(n + kHeaderBytes);
    *reinterpret_cast<int64_t*>(raw) = static_cast<int64_t>(n);
    const int64_t cur = g_current.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t prev = g_peak.load();
    while (cur > prev && !g_peak.compare_exchange_weak(prev, cur)) {
    }
    void* p = static_cast<char*>(raw) + kHeaderBytes;
    return {p, p, &counting_delete, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};
CountingAllocator g_counting;
std::mutex g_install_mu;
}  // namespace

void MemoryMeter::install() {
  std::lock_guard<std::mutex> lk(g_install_mu);
  if (g_installed) return;
  g_base = c10::GetCPUAllocator();
  g_base_deleter = g_base->raw_deleter();
  if (!g_base_deleter)
    throw std::runtime_error("tandem::MemoryMeter: the CPU allocator has no raw deleter; cannot wrap it");
  c10::SetCPUAllocator(&g_counting, /*priority=*/100);
  if (c10::GetCPUAllocator() != &g_counting) {
    throw std::runtime_error("tandem::MemoryMeter: another CPU allocator with a higher priority is installed");
  }
  g_installed = true;
}
bool MemoryMeter::installed() { return g_installed; }
int64_t MemoryMeter::current_bytes() { return g_current.load(); }
int64_t MemoryMeter::peak_bytes() { return g_peak.load(); }
void MemoryMeter::reset_peak() { g_peak.store(g_current.load()); }

// ---------------------------------------------------------------- stats

double PipelineStats::bubble_fraction() const {
  return step_seconds > 0 ? std::max(0.0, step_seconds - compute_seconds) / step_seconds : 0.0;
}
double PipelineStats::bubble_ratio() const {
  return compute_seconds > 0 ? std::max(0.0, step_seconds - compute_seconds) / compute_seconds : 0.0;
}

// ---------------------------------------------------------------- the pipeline

namespace {
constexpr int kTagHeader = 71, kTagActivation = 72, kTagGradient = 73;
// Header: dtype, dims, sizes, whether the activation requires a gradient.
constexpr int64_t kMaxDims = 8, kHeaderLen = 3 + kMaxDims;

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

Pipeline::Pipeline(torch::nn::Sequential model, CommPtr stage_comm, PipelineOptions opts)
    : comm_(std::move(stage_comm)), opts_(std::move(opts)) {
  if (!model) throw std::invalid_argument("tandem::Pipeline: no model given");
  if (!comm_) throw std::invalid_argument("tandem::Pipeline: no stage communicator given");
  stages_ = comm_->size();
  stage_ = comm_->rank();
  const int64_t layers = static_cast<int64_t>(model->size());
  if (opts_.micro_batches < 1) {
    throw std::invalid_argument("tandem::Pipeline: micro_batches must be >= 1, got " +
                                std::to_string(opts_.micro_batches));
  }
  if (opts_.virtual_stages < 1) {
    throw std::invalid_argument("tandem::Pipeline: virtual_stages (--virtual-stages) must be at least 1, got " +
                                std::to_string(opts_.virtual_stages));
  }
  const bool zbv = opts_.schedule == PipelineSchedule::kZBV;
  if (zbv && opts_.virtual_stages > 2) {
    throw std::invalid_argument("tandem::Pipeline: zb-v runs two chunks per rank in a V, not " +
                                std::to_string(opts_.virtual_stages) +
                                "; use --virtual-stages 2 (or leave it out) with --pipeline-schedule zb-v");
  }
  if (zbv && stages_ < 2) {
    throw std::invalid_argument("tandem::Pipeline: zb-v's V needs 2 or more pipeline stages (--pp), got " +
                                std::to_string(stages_));
  }
  if (opts_.virtual_stages > 1 && opts_.schedule != PipelineSchedule::kInterleaved && !zbv) {
    throw std::invalid_argument(std::string("tandem::Pipeline: ") + std::to_string(opts_.virtual_stages) +
                                " virtual stages per rank need the interleaved schedule, not " +
                                to_string(opts_.schedule) +
                                "; use --pipeline-schedule interleaved or --virtual-stages 1");
  }
  chunks_ = pipeline_chunks(opts_.schedule, opts_.virtual_stages);
  v_shape_ = zbv;
  split_ = splits_backward(opts_.schedule);
  const int virtual_stages = stages_ * chunks_;
  if (virtual_stages > layers) {
    if (chunks_ == 1) validate_partition({}, layers, stages_);  // names the problem
    throw std::invalid_argument("tandem::Pipeline: --pp " + std::to_string(stages_) + " x --virtual-stages " +
                                std::to_string(chunks_) + " = " + std::to_string(virtual_stages) +
                                " virtual stages for a model of " + std::to_string(layers) +
                                " layers (children of the Sequential); each needs a layer: use fewer virtual stages");
  }
  partition_ = opts_.partition.empty() ? partition_by_parameters(model, virtual_stages) : opts_.partition;
  validate_partition(partition_, layers, virtual_stages);
  std::vector<int64_t> begin(virtual_stages + 1, 0);
  for (int v = 0; v < virtual_stages; ++v) begin[v + 1] = begin[v] + partition_[v];
  for (int c = 0; c < chunks_; ++c) {
    const auto v = virtual_stage(c);
    ranges_.emplace_back(begin[v], begin[v + 1]);
    torch::nn::Sequential chunk;
    for (int64_t i = begin[v]; i < begin[v + 1]; ++i) {
      chunk->push_back(std::to_string(i), child(model, i));
      stage_module_->push_back(std::to_string(i), child(model, i));
    }
    chunk_modules_.push_back(chunk);
  }
  auto params = stage_module_->parameters();
  device_ = params.empty() ? opts_.device : params.front().device();
}

// With a split schedule the chunk's Linear children run through tandem::linear, which defers
// their weight gradients to W. Layers run by run_layers (ZeRO-3 gathers each layer around its
// forward and backward and frees it after) are left to it and get all their gradients in B.
at::Tensor Pipeline::run_chunk(int chunk, const at::Tensor& x) {
  if (opts_.run_layers) return opts_.run_layers(ranges_[chunk].first, ranges_[chunk].second, x);
  if (!split_) return chunk_modules_[chunk]->forward(x);
  WeightGradStore::Recording rec;
  at::Tensor y = x;
  for (auto& layer : *chunk_modules_[chunk]) {
    if (auto* lin = layer.ptr()->as<torch::nn::LinearImpl>()) {
      y = linear(y, lin->weight, lin->bias);
    } else {
      y = layer.forward(y);
    }
  }
  return y;
}

int64_t Pipeline::first_layer() const {
  if (chunks_ != 1) {
    throw std::logic_error("tandem::Pipeline: a rank with " + std::to_string(chunks_) +
                           " chunks holds several layer ranges; use layer_ranges()");
  }
  return ranges_.front().first;
}

int64_t Pipeline::end_layer() const {
  (void)first_layer();  // the same check
  return ranges_.front().second;
}

std::vector<int> Pipeline::layer_owners() const {
  std::vector<int> owner;
  for (size_t v = 0; v < partition_.size(); ++v)
    owner.insert(owner.end(), partition_[v], pipeline_stage_owner(static_cast<int64_t>(v), stages_, v_shape_).first);
  return owner;
}

std::vector<at::Tensor> Pipeline::parameters() const { return stage_module_->parameters(); }

void Pipeline::reset_stats() { stats_ = PipelineStats(); }

std::vector<PipelineOp> Pipeline::schedule_for(PipelineSchedule s, int stage, int stages, int64_t m, int chunks) {
  if (s == PipelineSchedule::kInterleaved) return interleaved_order(stage, stages, chunks, m);
  if (s == PipelineSchedule::kZBH1) return zb_h1_order(stage, stages, m);
  if (s == PipelineSchedule::kZBV) return zb_v_order(stage, stages, m);
  std::vector<PipelineOp> ops;
  for (auto [forward, i] : pipeline_order(s == PipelineSchedule::kGPipe, stage, stages, m))
    ops.push_back({forward ? PipelineOpKind::kForward : PipelineOpKind::kBackward, 0, i});
  return ops;
}

namespace {

// What a link between two virtual stages agreed in one step: the shape, dtype and whether a
// gradient goes back, from the header sent with its first activation.
struct Link {
  bool have_header = false;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  bool grad = false;  // the activations need their gradient sent back
};

// Tags of the messages into virtual stage v (activations and headers from v - 1, gradients from v + 1).
int tag_into(int base, int64_t v) { return base + 4 * static_cast<int>(v); }

// Activation transfer state of one step on one stage.
struct Transfer {
  Transfer(Communicator& c, c10::Device d, PipelineStats& s, int chunks)
      : comm(c), device(d), stats(s), in(chunks), out(chunks) {}
  Communicator& comm;
  c10::Device device;
  PipelineStats& stats;
  std::vector<std::pair<WorkPtr, at::Tensor>> pending;
  std::vector<Link> in, out;  // per chunk: its input from the previous virtual stage, its output to the next

  void poll() {
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [](const std::pair<WorkPtr, at::Tensor>& p) { return p.first->is_completed(); }),
                  pending.end());
  }
  void drain() {
    for (auto& p : pending) p.first->wait();
    pending.clear();
  }
  // Messages between two chunks of this rank, per tag, in the order sent.
  std::map<int, std::deque<at::Tensor>> local;

  void send(at::Tensor t, int dst, int tag) {
    t = t.contiguous();
    if (dst == comm.rank()) {
      local[tag].push_back(t);
      return;
    }
    stats.bytes_sent += static_cast<int64_t>(t.numel() * t.element_size());
    pending.emplace_back(comm.send_async(t, dst, tag), t);
  }
  void recv(const at::Tensor& buf, int src, int tag, bool host) {
    if (src == comm.rank()) {
      auto& q = local[tag];
      if (q.empty()) throw std::logic_error("tandem::Pipeline: a chunk receives from this rank before it sent");
      at::NoGradGuard ng;
      buf.copy_(q.front());
      q.pop_front();
      return;
    }
    auto t0 = std::chrono::steady_clock::now();
    auto w = comm.recv_async(buf, src, tag);
    if (host) {
      w->synchronize();
    } else {
      w->wait();
    }
    stats.wait_seconds += since(t0);
    stats.bytes_received += static_cast<int64_t>(buf.numel() * buf.element_size());
  }

  // Virtual stage v's output of one micro-batch, to rank dst (its chunk `chunk`'s output link).
  void send_activation(const at::Tensor& y, int dst, int64_t v, int chunk) {
    Link& l = out[chunk];
    const bool wants_grad = y.requires_grad() && at::isFloatingType(y.scalar_type());
    const std::string who = "tandem::Pipeline: virtual stage " + std::to_string(v);
    if (!l.have_header) {
      if (y.dim() > kMaxDims) {
        throw std::invalid_argument(who + " outputs a tensor of " + std::to_string(y.dim()) + " dimensions; at most " +
                                    std::to_string(kMaxDims) + " can cross a stage boundary");
      }
      std::vector<int64_t> h(kHeaderLen, 0);
      h[0] = static_cast<int64_t>(y.scalar_type());
      h[1] = y.dim();
      for (int64_t d = 0; d < y.dim(); ++d) h[2 + d] = y.size(d);
      l.grad = wants_grad;
      h[2 + kMaxDims] = l.grad ? 1 : 0;
      send(at::tensor(h, at::kLong).to(device), dst, tag_into(kTagHeader, v + 1));
      l.shape = y.sizes().vec();
      l.have_header = true;
    } else if (y.sizes().vec() != l.shape) {
      throw std::runtime_error(who + " produced micro-batch outputs of different shapes in one step (" +
                               c10::str(y.sizes()) + " after " + c10::str(c10::IntArrayRef(l.shape)) +
                               "); every micro-batch must have the same shape");
    } else if (wants_grad != l.grad) {
      throw std::runtime_error(who + " produced micro-batch outputs that differ in requiring a gradient in one step; "
                                     "every micro-batch must take the same path through the stage");
    }
    send(y.detach(), dst, tag_into(kTagActivation, v + 1));
  }

  // Virtual stage v's input of one micro-batch, from rank src.
  at::Tensor recv_activation(int src, int64_t v, int chunk) {
    Link& l = in[chunk];
    if (!l.have_header) {
      auto h = at::empty({kHeaderLen}, at::TensorOptions().dtype(at::kLong).device(device));
      recv(h, src, tag_into(kTagHeader, v), /*host=*/true);
      auto hc = h.cpu();
      auto* p = hc.data_ptr<int64_t>();
      l.dtype = static_cast<at::ScalarType>(p[0]);
      l.shape.assign(p + 2, p + 2 + p[1]);
      l.grad = p[2 + kMaxDims] != 0;
      l.have_header = true;
    }
    auto x = at::empty(l.shape, at::TensorOptions().dtype(l.dtype).device(device));
    recv(x, src, tag_into(kTagActivation, v), /*host=*/false);
    return x;
  }
};

struct Slot {
  at::Tensor input, output, loss;
};

}  // namespace

at::Tensor Pipeline::train_step(const at::Tensor& inputs, const at::Tensor& targets, const PipelineLossFn& loss_fn) {
  const int64_t m = opts_.micro_batches;
  auto check = [&](const at::Tensor& t, const char* what) {
    if (!t.defined()) return;
    if (t.dim() == 0 || t.size(0) % m != 0) {
      throw std::invalid_argument("tandem::Pipeline: a batch of " + std::to_string(t.dim() ? t.size(0) : 0) + " " +
                                  what + " is not divisible into " + std::to_string(m) +
                                  " micro-batches; use a batch size that is a multiple of micro_batches");
    }
  };
  check(inputs, "inputs");
  check(targets, "targets");
  if (is_first() && !inputs.defined()) throw std::invalid_argument("tandem::Pipeline: stage 0 needs the inputs");
  if (is_last() && !targets.defined()) {
    throw std::invalid_argument("tandem::Pipeline: the last stage needs the targets");
  }
  if (is_last() && !loss_fn) throw std::invalid_argument("tandem::Pipeline: the last stage needs a loss function");
  if (inputs.defined() && targets.defined() && inputs.size(0) != targets.size(0)) {
    throw std::invalid_argument("tandem::Pipeline: " + std::to_string(inputs.size(0)) + " inputs but " +
                                std::to_string(targets.size(0)) + " targets");
  }
  const auto ops = schedule_for(opts_.schedule, stage_, stages_, m, chunks_);

  const auto t_step = std::chrono::steady_clock::now();
  const int64_t meter_base = MemoryMeter::installed() ? MemoryMeter::current_bytes() : 0;
  if (MemoryMeter::installed()) MemoryMeter::reset_peak();
  stats_.compute_seconds = stats_.wait_seconds = 0.0;
  stats_.bytes_sent = stats_.bytes_received = 0;
  stats_.peak_live_micro_batches = 0;
  stats_.weight_passes = 0;

  Transfer tr{*comm_, device_, stats_, chunks_};
  std::vector<Slot> slots(m * chunks_);
  int64_t live = 0;
  at::Tensor loss_sum;
  const int64_t mb_in = inputs.defined() ? inputs.size(0) / m : 0;
  const int64_t mb_tg = targets.defined() ? targets.size(0) / m : 0;
  // Backwards through autograd in the step (B and W), for before_backward's "last".
  int64_t backwards_left = 0;
  for (const auto& op : ops) backwards_left += op.forward() ? 0 : 1;
  std::vector<WeightGradStore> deferred(split_ ? m * chunks_ : 0);
  auto owner = [&](int64_t v) { return pipeline_stage_owner(v, stages_, v_shape_).first; };

  for (const PipelineOp& op : ops) {
    const int64_t i = op.micro_batch, v = virtual_stage(op.chunk);
    const bool first = v == 0, last = v == last_virtual();
    const int prev = first ? -1 : owner(v - 1), next = last ? -1 : owner(v + 1);
    const int64_t slot = op.chunk * m + i;
    Slot& s = slots[slot];
    if (op.kind == PipelineOpKind::kForward) {
      at::Tensor x = first ? inputs.narrow(0, i * mb_in, mb_in) : tr.recv_activation(prev, v, op.chunk);
      // Track the input only where the previous stage wants its gradient: a stage fed by one
      // without parameters (the MLP's leading Flatten on a stage of its own) skips computing it.
      if (!first && tr.in[op.chunk].grad) x.requires_grad_(true);
      auto t0 = std::chrono::steady_clock::now();
      at::Tensor y = run_chunk(op.chunk, x);
      if (last) {
        s.loss = loss_fn(y, targets.narrow(0, i * mb_tg, mb_tg));
        if (s.loss.numel() != 1) {
          throw std::invalid_argument("tandem::Pipeline: the loss function returned " + std::to_string(s.loss.numel()) +
                                      " values; it must return the scalar mean loss of the micro-batch");
        }
      } else {
        s.output = y;
      }
      stats_.compute_seconds += since(t0);
      if (!last) tr.send_activation(y, next, v, op.chunk);
      s.input = x;
      stats_.peak_live_micro_batches = std::max(stats_.peak_live_micro_batches, ++live);
    } else if (op.kind == PipelineOpKind::kBackward) {
      if (opts_.before_backward) opts_.before_backward(i, --backwards_left == 0);
      // A split schedule's B leaves the deferrable weight gradients to this micro-batch's W.
      std::optional<WeightGradStore::Capture> capture;
      if (split_) capture.emplace(deferred[slot]);
      if (last) {
        auto t0 = std::chrono::steady_clock::now();
        auto scaled = s.loss / static_cast<double>(m);
        if (scaled.requires_grad()) scaled.backward();
        stats_.compute_seconds += since(t0);
        auto l = s.loss.detach().to(at::kDouble).reshape({});
        loss_sum = loss_sum.defined() ? loss_sum + l : l;
      } else if (tr.out[op.chunk].grad) {
        auto g = at::empty(s.output.sizes(), s.output.options().memory_format(at::MemoryFormat::Contiguous));
        tr.recv(g, next, tag_into(kTagGradient, v), /*host=*/false);
        auto t0 = std::chrono::steady_clock::now();
        s.output.backward(g);
        stats_.compute_seconds += since(t0);
      }
      capture.reset();
      if (!first && tr.in[op.chunk].grad) {
        auto gx = s.input.grad();
        tr.send(gx.defined() ? gx : at::zeros_like(s.input), prev, tag_into(kTagGradient, v - 1));
      }
      s = Slot();
      --live;
    } else {
      if (opts_.before_backward) opts_.before_backward(i, --backwards_left == 0);
      auto t0 = std::chrono::steady_clock::now();
      if (deferred[slot].flush()) ++stats_.weight_passes;
      stats_.compute_seconds += since(t0);
    }
    tr.poll();
  }
  tr.drain();

  at::Tensor loss;
  if (is_last()) loss = loss_sum / static_cast<double>(m);
  if (opts_.broadcast_loss && stages_ > 1) {
    auto buf = is_last() ? loss.reshape({1}).to(device_)
                         : at::empty({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
    comm_->broadcast(buf, pipeline_stage_owner(last_virtual(), stages_, v_shape_).first);
    loss = buf.reshape({});
  }
  stats_.step_seconds = since(t_step);
  stats_.peak_activation_bytes = MemoryMeter::installed() ? MemoryMeter::peak_bytes() - meter_base : -1;
  stats_.micro_batches += m;
  stats_.steps += 1;
  return loss;
}

// Forward only: micro-batch by micro-batch, each through this rank's chunks in order; every
// rank takes the (micro-batch, chunk) pairs in the same order, so messages match.
at::Tensor Pipeline::forward(const at::Tensor& inputs) {
  const int64_t m = opts_.micro_batches;
  if (inputs.defined() && (inputs.dim() == 0 || inputs.size(0) % m != 0)) {
    throw std::invalid_argument("tandem::Pipeline: a batch of " + std::to_string(inputs.dim() ? inputs.size(0) : 0) +
                                " inputs is not divisible into " + std::to_string(m) +
                                " micro-batches; use a batch size that is a multiple of micro_batches");
  }
  if (is_first() && !inputs.defined()) throw std::invalid_argument("tandem::Pipeline: stage 0 needs the inputs");
  torch::NoGradGuard ng;
  PipelineStats scratch;
  Transfer tr{*comm_, device_, scratch, chunks_};
  std::vector<at::Tensor> outs;
  const int64_t mb = inputs.defined() ? inputs.size(0) / m : 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int c = 0; c < chunks_; ++c) {
      const int64_t v = virtual_stage(c);
      at::Tensor x = v == 0 ? inputs.narrow(0, i * mb, mb)
                            : tr.recv_activation(pipeline_stage_owner(v - 1, stages_, v_shape_).first, v, c);
      at::Tensor y = run_chunk(c, x);
      if (v == last_virtual()) {
        outs.push_back(y);
      } else {
        tr.send_activation(y, pipeline_stage_owner(v + 1, stages_, v_shape_).first, v, c);
      }
      tr.poll();
    }
  }
  tr.drain();
  return is_last() ? at::cat(outs) : at::Tensor();
}

}  // namespace tandem
