// TensorBoard's Event messages, encoded and parsed by protobuf's lite runtime (the messages are
// generated from tensorboard_event.proto).
#include "event_codec.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "tensorboard_event.pb.h"

namespace {

void copy_text(const std::string& s, char* text, size_t cap) {
  if (cap == 0) return;
  const size_t n = std::min(s.size(), cap - 1);
  std::memcpy(text, s.data(), n);
  text[n] = '\0';
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) size_t tandem_tb_encode_event(double wall_time, int64_t step,
                                                                     const char* file_version, const char* tag,
                                                                     float value, char* out, size_t cap) {
  tandem_tensorboard_proto::Event e;
  e.set_wall_time(wall_time);
  if (file_version) {
    e.set_file_version(file_version);
  } else {
    e.set_step(step);
    auto* v = e.mutable_summary()->add_value();
    v->set_tag(tag ? tag : "");
    v->set_simple_value(value);
  }
  const std::string bytes = e.SerializeAsString();
  if (bytes.size() <= cap) std::memcpy(out, bytes.data(), bytes.size());
  return bytes.size();
}

__attribute__((visibility("default"))) int tandem_tb_decode_event(const char* data, size_t n, double* wall_time,
                                                                  int64_t* step, char* text, size_t text_cap,
                                                                  float* value) {
  tandem_tensorboard_proto::Event e;
  if (!e.ParseFromArray(data, static_cast<int>(n))) return 0;
  *wall_time = e.wall_time();
  *step = e.step();
  if (e.what_case() == tandem_tensorboard_proto::Event::kFileVersion) {
    copy_text(e.file_version(), text, text_cap);
    return 1;
  }
  if (e.what_case() != tandem_tensorboard_proto::Event::kSummary || e.summary().value_size() == 0) return 0;
  const auto& v = e.summary().value(0);
  if (v.value_case() != tandem_tensorboard_proto::Summary::Value::kSimpleValue) return 0;
  copy_text(v.tag(), text, text_cap);
  *value = v.simple_value();
  return 2;
}
}
