#include "tandem/safetensors.h"

#include "tandem/engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "checkpoint/safetensors_header.h"
#include "checkpoint/shard_io.h"

namespace tandem::safetensors {
namespace {

using ckpt::StDtype;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");

struct DtypePair {
  StDtype st;
  at::ScalarType at;
};
constexpr DtypePair kDtypes[] = {{StDtype::kF64, at::kDouble}, {StDtype::kF32, at::kFloat},
                                 {StDtype::kF16, at::kHalf},   {StDtype::kBF16, at::kBFloat16},
                                 {StDtype::kI64, at::kLong},   {StDtype::kI32, at::kInt},
                                 {StDtype::kI16, at::kShort},  {StDtype::kI8, at::kChar},
                                 {StDtype::kU8, at::kByte},    {StDtype::kBool, at::kBool}};

at::ScalarType to_aten(StDtype d) {
  for (auto& p : kDtypes)
    if (p.st == d) return p.at;
  throw std::logic_error("safetensors: unmapped dtype");
}

StDtype to_st(at::ScalarType t, const std::string& name) {
  for (auto& p : kDtypes)
    if (p.at == t) return p.st;
  throw std::invalid_argument("safetensors: tensor '" + name + "' has dtype " + std::string(c10::toString(t)) +
                              ", which safetensors files here cannot hold (float64/32/16, bfloat16, int64/32/16/8, "
                              "uint8 and bool can); convert it first");
}

std::string sys_error(const std::string& what, const std::string& path) {
  return "safetensors: " + what + " '" + path + "': " + std::strerror(errno);
}

struct Mapping {
  uint8_t* addr = nullptr;
  size_t len = 0;
  ~Mapping() {
    if (addr) ::munmap(addr, len);
  }
};

// Private and writable: a tensor viewing the file may be modified in place (copy on write)
// without reaching the file or faulting.
std::shared_ptr<Mapping> map_file(int fd, size_t size, const std::string& path) {
  auto m = std::make_shared<Mapping>();
  m->len = size;
  if (m->len > 0) {
    void* p = ::mmap(nullptr, m->len, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) throw std::runtime_error(sys_error("cannot map", path));
    m->addr = static_cast<uint8_t*>(p);
  }
  return m;
}

// The 8-byte length and the JSON, read with pread rather than through the mapping: a page fault
// there would bring in a read-around window of the tensors' bytes too. Fewer bytes than the
// header claims are returned as they are, for the parser to report.
std::string read_header_bytes(int fd, uint64_t file_size, const std::string& path) {
  auto read_at = [&](std::string& buf, size_t n) {
    buf.resize(n);
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd, buf.data() + done, n - done, static_cast<off_t>(done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw std::runtime_error(sys_error("cannot read", path));
      if (r == 0) break;
      done += static_cast<size_t>(r);
    }
    buf.resize(done);
  };
  std::string buf;
  read_at(buf, static_cast<size_t>(std::min<uint64_t>(8, file_size)));
  if (buf.size() < 8) return buf;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(buf[i]);
  if (n <= ckpt::kStMaxHeaderBytes && n <= file_size - 8) read_at(buf, static_cast<size_t>(8 + n));
  return buf;
}

// Asks the kernel to read [p, p + n) ahead of the copy that follows: the pages of exactly that
// range, rather than the read-around window a page fault would bring in (8 MiB on some disks),
// so that a rank reading its slice of a cold file reads little beyond it. Advisory only.
void prefetch(const uint8_t* p, size_t n) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  ::madvise(reinterpret_cast<void*>(begin), reinterpret_cast<uintptr_t>(p) + n - begin, MADV_WILLNEED);
}

}  // namespace

// ---- File -----------------------------------------------------------------------------------

struct File::State {
  std::string path;
  std::shared_ptr<Mapping> map;
  std::vector<std::string> names;
  std::map<std::string, TensorInfo> infos;
  Metadata metadata;
  // Bytes of tensors and slices handed out; mutable: reading does not change the file.
  mutable std::atomic<int64_t> bytes_read{0};
};

File::File(const std::string& path) {
  auto s = std::make_shared<State>();
  s->path = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(sys_error("cannot open", path));
  ckpt::StHeader header;
  try {
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw std::runtime_error(sys_error("cannot stat", path));
    const auto size = static_cast<uint64_t>(st.st_size);
    const auto head = read_header_bytes(fd, size, path);
    header = ckpt::parse_st_header(reinterpret_cast<const uint8_t*>(head.data()), head.size(), size, path);
    s->map = map_file(fd, static_cast<size_t>(size), path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  for (auto& e : header.tensors) {
    TensorInfo info;
    info.dtype = to_aten(e.dtype);
    info.shape = e.shape;
    info.offset = static_cast<int64_t>(header.data_start + e.begin);
    info.bytes = static_cast<int64_t>(e.end - e.begin);
    s->names.push_back(e.name);
    s->infos.emplace(e.name, std::move(info));
  }
  s->metadata = std::move(header.metadata);
  state_ = std::move(s);
}

const std::string& File::path() const { return state_->path; }
const std::vector<std::string>& File::names() const { return state_->names; }
bool File::contains(const std::string& name) const { return state_->infos.count(name) > 0; }
const Metadata& File::metadata() const { return state_->metadata; }
int64_t File::bytes_read() const { return state_->bytes_read.load(); }

const TensorInfo& File::info(const std::string& name) const {
  auto it = state_->infos.find(name);
  if (it == state_->infos.end())
    throw std::out_of_range("safetensors file '" + state_->path + "' has no tensor '" + name + "' (it has " +
                            std::to_string(state_->names.size()) + ")");
  return it->second;
}

at::Tensor File::get(const std::string& name) const {
  const auto& in = info(name);
  const auto options = at::TensorOptions().dtype(in.dtype);
  uint8_t* ptr = state_->map->addr + in.offset;
  const size_t element = c10::elementSize(in.dtype);
  if (in.bytes == 0) return at::empty(in.shape, options);
  state_->bytes_read += in.bytes;
  if (reinterpret_cast<uintptr_t>(ptr) % element != 0) {
    auto out = at::empty(in.shape, options);
    std::memcpy(out.data_ptr(), ptr, static_cast<size_t>(in.bytes));
    return out;
  }
  auto keep = state_->map;
  return at::from_blob(
      ptr, in.shape, [keep](void*) {}, options);
}

at::Tensor File::read_slice(const std::string& name, int64_t dim, int64_t begin, int64_t end) const {
  const auto& in = info(name);
  const auto ndim = static_cast<int64_t>(in.shape.size());
  if (dim < 0 || dim >= ndim)
    throw std::out_of_range("safetensors: slice of '" + name + "' in '" + state_->path + "' along dim " +
                            std::to_string(dim) + ", but it has " + std::to_string(ndim) + " dims");
  if (begin < 0 || begin > end || end > in.shape[dim])
    throw std::out_of_range("safetensors: slice [" + std::to_string(begin) + ", " + std::to_string(end) + ") of '" +
                            name + "' in '" + state_->path + "' along dim " + std::to_string(dim) +
                            " is outside its extent " + std::to_string(in.shape[dim]));
  auto shape = in.shape;
  shape[dim] = end - begin;
  auto out = at::empty(shape, at::TensorOptions().dtype(in.dtype));
  int64_t outer = 1, inner = static_cast<int64_t>(c10::elementSize(in.dtype));
  for (int64_t d = 0; d < dim; ++d) outer *= in.shape[d];
  for (int64_t d = dim + 1; d < ndim; ++d) inner *= in.shape[d];
  const int64_t src_row = in.shape[dim] * inner, dst_row = (end - begin) * inner;
  const uint8_t* src = state_->map->addr + in.offset + begin * inner;
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  if (dim == 0 && dst_row > 0) prefetch(src, static_cast<size_t>(dst_row));
  state_->bytes_read += outer * dst_row;
  for (int64_t o = 0; o < outer && dst_row > 0; ++o)
    std::memcpy(dst + o * dst_row, src + o * src_row, static_cast<size_t>(dst_row));
  return out;
}

at::Tensor File::read_flat(const std::string& name, int64_t first, int64_t count) const {
  const auto& in = info(name);
  const auto element = static_cast<int64_t>(c10::elementSize(in.dtype));
  const int64_t numel = in.bytes / element;
  if (first < 0 || count < 0 || first > numel - count)
    throw std::out_of_range("safetensors: " + std::to_string(count) + " elements from element " +
                            std::to_string(first) + " of '" + name + "' in '" + state_->path + "' are outside its " +
                            std::to_string(numel) + " elements");
  auto out = at::empty({count}, at::TensorOptions().dtype(in.dtype));
  if (count == 0) return out;
  const uint8_t* src = state_->map->addr + in.offset + first * element;
  const auto bytes = static_cast<size_t>(count * element);
  prefetch(src, bytes);
  state_->bytes_read += count * element;
  std::memcpy(out.data_ptr(), src, bytes);
  return out;
}

TensorList load_file(const std::string& path, Metadata* metadata) {
  File f(path);
  TensorList out;
  for (auto& n : f.names()) out.emplace_back(n, f.get(n));
  if (metadata) *metadata = f.metadata();
  return out;
}

// ---- writing --------------------------------------------------------------------------------

void save_file(const std::string& path, const TensorList& tensors, const Metadata& metadata) {
  struct Item {
    std::string name;
    at::Tensor cpu;
    StDtype dtype;
  };
  std::vector<Item> items;
  std::set<std::string> seen;
  for (auto& [name, t] : tensors) {
    if (name.empty() || name == "__metadata__")
      throw std::invalid_argument("safetensors: cannot write a tensor named '" + name + "' to '" + path + "'");
    if (!seen.insert(name).second)
      throw std::invalid_argument("safetensors: tensor '" + name + "' is given twice for '" + path + "'");
    if (!t.defined()) throw std::invalid_argument("safetensors: tensor '" + name + "' is undefined");
    items.push_back({name, t.to(at::kCPU).contiguous(), to_st(t.scalar_type(), name)});
  }
  // Largest elements first, then by name: every tensor starts aligned to its element size, since
  // the data buffer starts 8-byte aligned.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    const auto sa = ckpt::st_dtype_size(a.dtype), sb = ckpt::st_dtype_size(b.dtype);
    return sa != sb ? sa > sb : a.name < b.name;
  });
  ckpt::StHeader header;
  header.metadata = metadata;
  uint64_t at = 0;
  for (auto& it : items) {
    ckpt::StEntry e;
    e.name = it.name;
    e.dtype = it.dtype;
    e.shape = it.cpu.sizes().vec();
    e.begin = at;
    e.end = at + static_cast<uint64_t>(it.cpu.nbytes());
    at = e.end;
    header.tensors.push_back(std::move(e));
  }
  const std::string head = ckpt::format_st_header(header);
  std::vector<std::string_view> pieces{head};
  for (auto& it : items)
    if (it.cpu.nbytes() > 0) pieces.emplace_back(static_cast<const char*>(it.cpu.data_ptr()), it.cpu.nbytes());
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  try {
    ckpt::write_synced(tmp, pieces);
    ckpt::rename_path(tmp, path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  const auto slash = path.rfind('/');
  ckpt::fsync_dir(slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash)));
}

namespace {

std::string shard_name(const std::string& base, size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", k, n);
  return base + buf;
}

}  // namespace

std::vector<std::string> save_checkpoint(const std::string& dir, const TensorList& tensors,
                                         const SaveOptions& options) {
  if (options.max_shard_bytes <= 0)
    throw std::invalid_argument("safetensors: max_shard_bytes must be positive, not " +
                                std::to_string(options.max_shard_bytes));
  if (options.base.empty() || options.base.find('/') != std::string::npos)
    throw std::invalid_argument("safetensors: the file base name '" + options.base + "' must be a plain name");
  ckpt::make_dirs(dir);
  // Shards in the order the tensors are given, as save_pretrained cuts them.
  std::vector<TensorList> shards(1);
  int64_t size = 0, total = 0;
  for (auto& nt : tensors) {
    const int64_t bytes = nt.second.defined() ? static_cast<int64_t>(nt.second.nbytes()) : 0;
    if (!shards.back().empty() && size + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      size = 0;
    }
    shards.back().push_back(nt);
    size += bytes;
    total += bytes;
  }
  std::vector<std::string> written;
  if (shards.size() == 1) {
    written.push_back(options.base + ".safetensors");
    save_file(dir + "/" + written.back(), tensors, options.metadata);
    return written;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    written.push_back(shard_name(options.base, k + 1, shards.size()));
    save_file(dir + "/" + written.back(), shards[k], options.metadata);
    for (auto& nt : shards[k]) weight_map[nt.first] = written.back();
  }
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  written.push_back(options.base + ".safetensors.index.json");
  const std::string path = dir + "/" + written.back(), tmp = path + ".tmp-" + std::to_string(::getpid());
  ckpt::write_synced(tmp, index.dump(2) + "\n");
  ckpt::rename_path(tmp, path);
  ckpt::fsync_dir(dir);
  return written;
}

// ---- Checkpoint -----------------------------------------------------------------------------

struct Checkpoint::State {
  std::string where;                         // what the user named, for messages
  std::string dir;                           // shards are relative to it
  std::map<std::string, std::string> shard;  // tensor -> file name
  std::vector<std::string> names;
  Metadata metadata;
  std::mutex mutex;
  std::map<std::string, std::unique_ptr<File>> files;  // mapped so far
};

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string dir_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

struct Index {
  std::map<std::string, std::string> shard;
  Metadata metadata;
};
Index read_index(const std::string& index_path);

}  // namespace

Checkpoint::Checkpoint(const std::string& path) : state_(std::make_shared<State>()) {
  auto& s = *state_;
  s.where = path;
  std::string index, single;
  if (ckpt::is_dir(path)) {
    if (ckpt::exists(path + "/model.safetensors.index.json")) index = path + "/model.safetensors.index.json";
    else if (ckpt::exists(path + "/model.safetensors")) single = path + "/model.safetensors";
    else
      throw std::runtime_error("safetensors: directory '" + path +
                               "' holds neither model.safetensors.index.json nor model.safetensors");
  } else if (ends_with(path, ".json")) {
    index = path;
  } else {
    single = path;
  }
  if (!index.empty()) {
    auto idx = read_index(index);
    s.dir = dir_of(index);
    s.shard = std::move(idx.shard);
    s.metadata = std::move(idx.metadata);
    for (auto& kv : s.shard) s.names.push_back(kv.first);
    return;
  }
  auto f = std::make_unique<File>(single);
  s.dir = dir_of(single);
  const auto file = single.substr(single.rfind('/') == std::string::npos ? 0 : single.rfind('/') + 1);
  for (auto& n : f->names()) s.shard[n] = file;
  s.metadata = f->metadata();
  s.files[file] = std::move(f);
  for (auto& kv : s.shard) s.names.push_back(kv.first);
}

namespace {

Index read_index(const std::string& index_path) {
  Index s;
  auto fail = [&](const std::string& what) {
    throw std::runtime_error("safetensors index '" + index_path + "': " + what);
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ckpt::read_all(index_path));
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    fail("needs an object \"weight_map\" mapping tensor names to shard files");
  for (auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) fail("weight_map['" + name + "'] must be a file name");
    const auto f = file.get<std::string>();
    if (f.empty() || f[0] == '/' || f.find("..") != std::string::npos)
      fail("weight_map['" + name + "'] = '" + f + "' must name a file inside the checkpoint's directory");
    s.shard[name] = f;
  }
  if (j.contains("metadata")) {
    if (!j["metadata"].is_object()) fail("\"metadata\" must be an object");
    for (auto& [k, v] : j["metadata"].items()) s.metadata[k] = v.is_string() ? v.get<std::string>() : v.dump();
  }
  return s;
}

}  // namespace

const std::vector<std::string>& Checkpoint::names() const { return state_->names; }
bool Checkpoint::contains(const std::string& name) const { return state_->shard.count(name) > 0; }
const Metadata& Checkpoint::metadata() const { return state_->metadata; }

int64_t Checkpoint::open_files() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return static_cast<int64_t>(state_->files.size());
}

int64_t Checkpoint::bytes_read() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  int64_t sum = 0;
  for (auto& [name, file] : state_->files) sum += file->bytes_read();
  return sum;
}

const File& Checkpoint::file_of(const std::string& name) const {
  auto& s = *state_;
  auto it = s.shard.find(name);
  if (it == s.shard.end())
    throw std::out_of_range("safetensors checkpoint '" + s.where + "' has no tensor '" + name + "'");
  std::lock_guard<std::mutex> lock(s.mutex);
  auto& slot = s.files[it->second];
  if (!slot) {
    try {
      slot = std::make_unique<File>(s.dir + "/" + it->second);
    } catch (const std::runtime_error& e) {
      s.files.erase(it->second);
      throw std::runtime_error("safetensors checkpoint '" + s.where + "': shard '" + it->second + "' of tensor '" +
                               name + "': " + e.what());
    }
  }
  if (!slot->contains(name))
    throw std::runtime_error("safetensors checkpoint '" + s.where + "': the index puts tensor '" + name +
                             "' in shard '" + it->second + "', which does not hold it");
  return *slot;
}

namespace {
class SafetensorsSource final : public ParameterSource {
 public:
  SafetensorsSource(Checkpoint c, std::function<std::string(const std::string&)> to_name, bool allow_missing)
      : c_(std::move(c)), to_name_(std::move(to_name)), allow_missing_(allow_missing) {}
  bool find(const std::string& name, std::vector<int64_t>* shape) const override {
    const auto file_name = mapped(name);
    if (file_name.empty()) return false;
    if (!c_.contains(file_name)) {
      if (allow_missing_) return false;
      throw std::runtime_error("safetensors: the checkpoint has no tensor '" + file_name + "' (for the parameter '" +
                               name + "')");
    }
    *shape = c_.info(file_name).shape;
    return true;
  }
  void read(const std::string& name, int64_t first, at::Tensor dest) const override {
    dest.copy_(c_.read_flat(mapped(name), first, dest.numel()));
  }

 private:
  std::string mapped(const std::string& name) const { return to_name_ ? to_name_(name) : name; }
  Checkpoint c_;
  std::function<std::string(const std::string&)> to_name_;
  bool allow_missing_;
};
}  // namespace

std::shared_ptr<const ParameterSource> parameter_source(Checkpoint checkpoint,
                                                        std::function<std::string(const std::string&)> to_name,
                                                        bool allow_missing) {
  return std::make_shared<SafetensorsSource>(std::move(checkpoint), std::move(to_name), allow_missing);
}

}  // namespace tandem::safetensors
