// TensorBoard event files: TFRecords framed here with Boost.CRC's CRC-32C around Event messages
// that the codec module encodes with protobuf (src/engine/tensorboard/event_codec.h).
//
// Why a module, loaded with RTLD_DEEPBIND: Debian's libsentencepiece (linked into the text
// commands) carries its own protobuf-lite and exports its symbols, so the calls of messages
// compiled against libprotobuf-lite would bind to that other version (a crash in
// MessageLite::SerializeAsString); protobuf's static archive is not position-independent, so it
// cannot be kept private inside libtandem either. Deep binding resolves the module's and
// libprotobuf-lite's own references inside that group first.
#include "tandem/tensorboard.h"

#include <dlfcn.h>
#include <unistd.h>

#include <boost/crc.hpp>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <system_error>

#include "engine/tensorboard/event_codec.h"

namespace tandem::tensorboard {
namespace fs = std::filesystem;

namespace {

constexpr const char* kCodecFile = "libtandem_tensorboard_events.so";

struct Codec {
  decltype(&tandem_tb_encode_event) encode = nullptr;
  decltype(&tandem_tb_decode_event) decode = nullptr;
};

// The codec module beside this library (the build directory, or the installed lib directory).
const Codec& codec() {
  static Codec c;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    Dl_info info{};
    if (::dladdr(reinterpret_cast<void*>(&frame_record), &info) == 0 || !info.dli_fname) {
      error = "cannot locate libtandem to find " + std::string(kCodecFile);
      return;
    }
    const std::string path = (fs::path(info.dli_fname).parent_path() / kCodecFile).string();
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!h) {
      error = "cannot load " + path + " (" + ::dlerror() + "); reinstall Tandem, or build its target " +
              "tandem_tensorboard_events";
      return;
    }
    c.encode = reinterpret_cast<decltype(c.encode)>(::dlsym(h, "tandem_tb_encode_event"));
    c.decode = reinterpret_cast<decltype(c.decode)>(::dlsym(h, "tandem_tb_decode_event"));
    if (!c.encode || !c.decode) error = path + " lacks the TensorBoard codec's functions; reinstall Tandem";
  });
  if (!error.empty()) throw std::runtime_error("--tensorboard: " + error);
  return c;
}

std::string encode(double wall_time, int64_t step, const char* file_version, const char* tag, float value) {
  std::string out(128, '\0');
  size_t n = codec().encode(wall_time, step, file_version, tag, value, out.data(), out.size());
  if (n > out.size()) {
    out.resize(n);
    n = codec().encode(wall_time, step, file_version, tag, value, out.data(), out.size());
  }
  out.resize(n);
  return out;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

// events.out.tfevents.<seconds>.<host>, as TensorFlow's writers name them; a second file of the
// same second in the same directory (a quick relaunch) gets a suffix.
fs::path new_event_file(const fs::path& dir) {
  const auto secs = static_cast<int64_t>(now_seconds());
  const std::string base = "events.out.tfevents." + std::to_string(secs) + "." + host_name();
  fs::path p = dir / base;
  for (int i = 1; fs::exists(p); ++i) p = dir / (base + "." + std::to_string(i));
  return p;
}

void put_le(std::string& s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t get_le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data, n);
  return crc.checksum();
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string frame_record(const std::string& payload) {
  std::string rec;
  put_le(rec, payload.size(), 8);
  put_le(rec, masked_crc32c(rec.data(), 8), 4);
  rec += payload;
  put_le(rec, masked_crc32c(payload.data(), payload.size()), 4);
  return rec;
}

std::vector<Event> read_events(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read TensorBoard events '" + path + "'");
  const std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<Event> events;
  for (size_t at = 0; at < all.size();) {
    const std::string where = "TensorBoard events '" + path + "', record at byte " + std::to_string(at);
    if (all.size() - at < 12) throw std::runtime_error(where + ": cut short");
    const uint64_t len = get_le(all, at, 8);
    if (get_le(all, at + 8, 4) != masked_crc32c(all.data() + at, 8)) throw std::runtime_error(where + ": bad CRC");
    if (all.size() - at - 12 < len + 4) throw std::runtime_error(where + ": cut short");
    const char* data = all.data() + at + 12;
    if (get_le(all, at + 12 + len, 4) != masked_crc32c(data, len)) throw std::runtime_error(where + ": bad CRC");
    Event e;
    char text[1024] = {};
    const int kind = codec().decode(data, len, &e.wall_time, &e.step, text, sizeof(text), &e.value);
    if (kind == 0) throw std::runtime_error(where + ": not an Event of a file version or a scalar");
    (kind == 1 ? e.file_version : e.tag) = text;
    events.push_back(e);
    at += 12 + len + 4;
  }
  return events;
}

void check_dir(const std::string& dir) {
  if (dir.empty()) throw std::invalid_argument("--tensorboard needs a directory");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    throw std::invalid_argument("--tensorboard " + dir + ": cannot create the directory (" +
                                (ec ? ec.message() : std::string("a file of that name exists")) +
                                "); pass a directory you can write to");
  }
  const fs::path probe = fs::path(dir) / (".tandem-write-check." + std::to_string(::getpid()));
  {
    std::ofstream f(probe);
    if (!f) {
      throw std::invalid_argument("--tensorboard " + dir +
                                  ": the directory is not writable; pass a directory you can write to");
    }
  }
  fs::remove(probe, ec);
  (void)codec();  // a missing codec module fails here too, before training
}

Writer::Writer(const std::string& dir) {
  check_dir(dir);
  path_ = new_event_file(dir).string();
  out_.open(path_, std::ios::binary);
  if (!out_) throw std::invalid_argument("--tensorboard: cannot create '" + path_ + "'");
  write_event(encode(now_seconds(), 0, "brain.Event:2", nullptr, 0.0f));
  flush();
}

void Writer::write_event(const std::string& event) { out_ << frame_record(event); }

void Writer::scalar(const std::string& tag, double value, int64_t step) {
  write_event(encode(now_seconds(), step, nullptr, tag.c_str(), static_cast<float>(value)));
}

void Writer::flush() {
  out_.flush();
  if (!out_) throw std::runtime_error("writing TensorBoard events to '" + path_ + "' failed (disk full?)");
}

Log::Log(const std::string& dir, bool writer) {
  if (writer && !dir.empty()) writer_ = std::make_unique<Writer>(dir);
}

Log::~Log() = default;

void Log::step(int64_t step, double loss, const StepFigures& f) {
  if (!writer_) return;
  Writer& w = *writer_;
  w.scalar("train/loss", loss, step);
  w.scalar("train/lr", f.lr, step);
  w.scalar("train/samples_per_second", f.samples_per_second, step);
  if (f.grad_norm >= 0) w.scalar("train/grad_norm", f.grad_norm, step);
  w.scalar("train/loss_scale", f.loss_scale, step);
  w.scalar("train/peak_rss_bytes", static_cast<double>(f.peak_rss_bytes), step);
  w.scalar("train/comm_share", f.comm_share, step);
  if (f.aux_loss >= 0) w.scalar("train/aux_loss", f.aux_loss, step);
  if (f.z_loss >= 0) w.scalar("train/z_loss", f.z_loss, step);
  w.flush();
}

void Log::finish(const Report& rep) {
  if (!writer_) return;
  const int64_t last = rep.first_step + static_cast<int64_t>(rep.losses.size());
  writer_->scalar("final/samples_per_second", rep.samples_per_second, last);
  if (rep.test_accuracy >= 0) writer_->scalar("final/test_accuracy", rep.test_accuracy, last);
  if (rep.eval_loss >= 0) writer_->scalar("final/eval_loss", rep.eval_loss, last);
  writer_->flush();
}

}  // namespace tandem::tensorboard
