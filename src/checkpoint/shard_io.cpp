#include "checkpoint/shard_io.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace tandem::ckpt {
namespace {

constexpr char kMagic[8] = {'T', 'A', 'N', 'D', 'E', 'M', 'S', 'H'};
constexpr uint32_t kShardVersion = 1;

std::string sys_error(const std::string& what, const std::string& path) {
  return what + " '" + path + "': " + std::strerror(errno);
}

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

struct Reader {
  const std::string& buf;
  const std::string& path;
  size_t pos = 0;
  void need(size_t n, const char* what) {
    if (n > buf.size() - pos) {
      throw std::runtime_error("checkpoint shard '" + path + "' is malformed: it ends inside " + what);
    }
  }
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, buf.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
};

}  // namespace

uint64_t fnv1a64(const void* data, size_t n, uint64_t h) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

Digest write_shard(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& entries) {
  std::string out;
  out.append(kMagic, sizeof kMagic);
  put<uint32_t>(out, kShardVersion);
  put<uint32_t>(out, static_cast<uint32_t>(entries.size()));
  for (auto& [name, t0] : entries) {
    auto t = t0.detach().to(at::kCPU).contiguous();
    put<uint32_t>(out, static_cast<uint32_t>(name.size()));
    out.append(name);
    put<int32_t>(out, static_cast<int32_t>(t.scalar_type()));
    put<uint32_t>(out, static_cast<uint32_t>(t.dim()));
    for (auto s : t.sizes()) put<int64_t>(out, s);
    const uint64_t n = static_cast<uint64_t>(t.numel()) * t.element_size();
    put<uint64_t>(out, n);
    if (n) out.append(static_cast<const char*>(t.data_ptr()), n);
  }
  write_synced(path, out);
  return Digest{static_cast<int64_t>(out.size()), fnv1a64(out.data(), out.size())};
}

std::map<std::string, at::Tensor> read_shard(const std::string& path, const Digest& expect) {
  const std::string buf = read_all(path);
  if (static_cast<int64_t>(buf.size()) != expect.bytes) {
    throw std::runtime_error("checkpoint shard '" + path + "' has " + std::to_string(buf.size()) +
                             " bytes, the manifest says " + std::to_string(expect.bytes) +
                             (static_cast<int64_t>(buf.size()) < expect.bytes ? " (truncated)" : "") +
                             "; the checkpoint is damaged, use an older one");
  }
  const uint64_t h = fnv1a64(buf.data(), buf.size());
  if (h != expect.fnv1a64) {
    throw std::runtime_error("checkpoint shard '" + path + "' is corrupted: its FNV-1a checksum is " + hex64(h) +
                             ", the manifest says " + hex64(expect.fnv1a64) + "; use an older checkpoint");
  }
  Reader r{buf, path};
  r.need(sizeof kMagic, "the header");
  if (std::memcmp(buf.data(), kMagic, sizeof kMagic) != 0) {
    throw std::runtime_error("'" + path + "' is not a Tandem checkpoint shard (bad magic)");
  }
  r.pos = sizeof kMagic;
  const auto version = r.get<uint32_t>("the header");
  if (version != kShardVersion) {
    throw std::runtime_error("checkpoint shard '" + path + "' has format version " + std::to_string(version) +
                             "; this build reads version " + std::to_string(kShardVersion));
  }
  const auto count = r.get<uint32_t>("the header");
  std::map<std::string, at::Tensor> out;
  for (uint32_t e = 0; e < count; ++e) {
    const auto len = r.get<uint32_t>("an entry name");
    r.need(len, "an entry name");
    std::string name = buf.substr(r.pos, len);
    r.pos += len;
    const auto dt = r.get<int32_t>("an entry header");
    if (dt < 0 || dt >= static_cast<int32_t>(c10::ScalarType::NumOptions)) {
      throw std::runtime_error("checkpoint shard '" + path + "': entry '" + name + "' has an unknown dtype");
    }
    const auto ndim = r.get<uint32_t>("an entry header");
    if (ndim > 64)
      throw std::runtime_error("checkpoint shard '" + path + "': entry '" + name + "' has " + std::to_string(ndim) +
                               " dimensions");
    std::vector<int64_t> sizes(ndim);
    int64_t numel = 1;
    for (auto& s : sizes) {
      s = r.get<int64_t>("an entry header");
      if (s < 0 || (s > 0 && numel > (int64_t{1} << 56) / s)) {
        throw std::runtime_error("checkpoint shard '" + path + "': entry '" + name + "' has an impossible size");
      }
      numel *= s;
    }
    const auto nbytes = r.get<uint64_t>("an entry header");
    const auto type = static_cast<c10::ScalarType>(dt);
    if (nbytes != static_cast<uint64_t>(numel) * c10::elementSize(type)) {
      throw std::runtime_error("checkpoint shard '" + path + "': entry '" + name + "' has " + std::to_string(nbytes) +
                               " bytes for its shape");
    }
    r.need(nbytes, "tensor data");
    auto t = at::empty(sizes, at::TensorOptions().dtype(type));
    if (nbytes) std::memcpy(t.data_ptr(), buf.data() + r.pos, nbytes);
    r.pos += nbytes;
    if (!out.emplace(name, t).second) {
      throw std::runtime_error("checkpoint shard '" + path + "': entry '" + name + "' appears twice");
    }
  }
  if (r.pos != buf.size()) throw std::runtime_error("checkpoint shard '" + path + "' has trailing bytes");
  return out;
}

void write_synced(const std::string& path, const std::string& data) {
  write_synced(path, std::vector<std::string_view>{data});
}

void write_synced(const std::string& path, const std::vector<std::string_view>& pieces) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(sys_error("cannot create", path));
  for (auto data : pieces) {
    size_t done = 0;
    while (done < data.size()) {
      ssize_t w = ::write(fd, data.data() + done, data.size() - done);
      if (w < 0) {
        if (errno == EINTR) continue;
        auto msg = sys_error("writing", path) + " (disk full?)";
        ::close(fd);
        throw std::runtime_error(msg);
      }
      done += static_cast<size_t>(w);
    }
  }
  if (::fsync(fd) != 0) {
    auto msg = sys_error("fsync of", path);
    ::close(fd);
    throw std::runtime_error(msg);
  }
  if (::close(fd) != 0) throw std::runtime_error(sys_error("closing", path));
}

std::string read_all(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(sys_error("cannot open checkpoint file", path));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      auto msg = sys_error("reading", path);
      ::close(fd);
      throw std::runtime_error(msg);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

void fsync_dir(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(sys_error("cannot open directory", path));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) {
    errno = err;
    throw std::runtime_error(sys_error("fsync of directory", path));
  }
}

void make_dirs(const std::string& path) {
  if (path.empty() || is_dir(path)) return;
  auto slash = path.find_last_of('/');
  if (slash != std::string::npos && slash > 0) make_dirs(path.substr(0, slash));
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST)
    throw std::runtime_error(sys_error("cannot create directory", path));
}

void remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (auto& n : list_dir(path)) remove_tree(path + "/" + n);
    if (::rmdir(path.c_str()) != 0) throw std::runtime_error(sys_error("cannot remove directory", path));
  } else if (::unlink(path.c_str()) != 0) {
    throw std::runtime_error(sys_error("cannot remove", path));
  }
}

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> out;
  DIR* d = ::opendir(path.c_str());
  if (!d) return out;
  while (auto* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw std::runtime_error(sys_error("cannot rename '" + from + "' to", to));
}

}  // namespace tandem::ckpt
