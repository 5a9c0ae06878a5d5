#include "checkpoint/safetensors_header.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

namespace tandem::ckpt {
namespace {

using nlohmann::json;

struct DtypeName {
  StDtype dtype;
  const char* name;
  size_t size;
};
constexpr DtypeName kDtypes[] = {{StDtype::kF64, "F64", 8},   {StDtype::kF32, "F32", 4}, {StDtype::kF16, "F16", 2},
                                 {StDtype::kBF16, "BF16", 2}, {StDtype::kI64, "I64", 8}, {StDtype::kI32, "I32", 4},
                                 {StDtype::kI16, "I16", 2},   {StDtype::kI8, "I8", 1},   {StDtype::kU8, "U8", 1},
                                 {StDtype::kBool, "BOOL", 1}};

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw std::runtime_error("safetensors file '" + file + "': " + what);
}

[[noreturn]] void fail_tensor(const std::string& file, const std::string& name, const std::string& what) {
  fail(file, "tensor '" + name + "': " + what);
}

// A JSON number that is a non-negative integer, as uint64.
bool as_u64(const json& v, uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

StDtype parse_dtype(const json& v, const std::string& file, const std::string& name) {
  if (!v.is_string()) fail_tensor(file, name, "\"dtype\" must be a string");
  const auto s = v.get<std::string>();
  for (auto& d : kDtypes)
    if (s == d.name) return d.dtype;
  fail_tensor(file, name, "dtype '" + s + "' is not supported (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL are)");
}

StEntry parse_entry(const std::string& name, const json& v, const std::string& file) {
  if (!v.is_object()) fail_tensor(file, name, "the entry must be an object with dtype, shape and data_offsets");
  for (auto& [key, unused] : v.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      fail_tensor(file, name, "unknown field '" + key + "' (dtype, shape and data_offsets are allowed)");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) fail_tensor(file, name, std::string("missing field \"") + key + "\"");
  StEntry e;
  e.name = name;
  e.dtype = parse_dtype(v["dtype"], file, name);
  const json& shape = v["shape"];
  if (!shape.is_array()) fail_tensor(file, name, "\"shape\" must be an array of non-negative integers");
  // Bytes are bounded by 2^62, so the running product never overflows once checked per step.
  uint64_t bytes = st_dtype_size(e.dtype);
  for (auto& s : shape) {
    uint64_t extent = 0;
    if (!as_u64(s, extent))
      fail_tensor(file, name, "shape " + shape.dump() + " has an entry that is not a non-negative integer");
    if (extent != 0 && bytes > (uint64_t{1} << 62) / extent)
      fail_tensor(file, name, "shape " + shape.dump() + " is too large");
    bytes *= extent;
    e.shape.push_back(static_cast<int64_t>(extent));
  }
  const json& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !as_u64(off[0], e.begin) || !as_u64(off[1], e.end))
    fail_tensor(file, name, "\"data_offsets\" must be [begin, end], two non-negative integers");
  if (e.end < e.begin) fail_tensor(file, name, "data_offsets " + off.dump() + " end before they begin");
  if (e.end - e.begin != bytes)
    fail_tensor(file, name,
                "data_offsets " + off.dump() + " span " + std::to_string(e.end - e.begin) + " bytes but dtype " +
                    st_dtype_name(e.dtype) + " and shape " + shape.dump() + " need " + std::to_string(bytes));
  return e;
}

std::map<std::string, std::string> parse_metadata(const json& v, const std::string& file) {
  if (!v.is_object()) fail(file, "\"__metadata__\" must be an object of strings");
  std::map<std::string, std::string> out;
  for (auto& [key, value] : v.items()) {
    if (!value.is_string()) fail(file, "\"__metadata__\" value of '" + key + "' must be a string, not " + value.dump());
    out[key] = value.get<std::string>();
  }
  return out;
}

// nlohmann keeps the last of repeated keys silently; the format forbids them, so the parse
// callback records the names at the top level (depth 1) and refuses a second one.
json parse_json_unique(const std::string& text, const std::string& file) {
  std::set<std::string> seen;
  auto cb = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      const auto key = parsed.get<std::string>();
      if (!seen.insert(key).second) fail(file, "the header names '" + key + "' twice");
    }
    return true;
  };
  try {
    return json::parse(text, cb);
  } catch (const json::exception& e) {
    fail(file, std::string("the header is not valid JSON: ") + e.what());
  }
}

}  // namespace

size_t st_dtype_size(StDtype d) {
  for (auto& x : kDtypes)
    if (x.dtype == d) return x.size;
  return 0;
}

const char* st_dtype_name(StDtype d) {
  for (auto& x : kDtypes)
    if (x.dtype == d) return x.name;
  return "?";
}

StHeader parse_st_header(const uint8_t* data, size_t available, uint64_t file_size, const std::string& file) {
  if (file_size < 8 || available < 8)
    fail(file, "is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
  if (n > kStMaxHeaderBytes)
    fail(file, "header length " + std::to_string(n) + " exceeds the limit of " + std::to_string(kStMaxHeaderBytes) +
                   " bytes (not a safetensors file?)");
  if (n > file_size - 8 || n > available - 8)
    fail(file, "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(file_size) +
                   " bytes): truncated?");
  if (n < 2 || data[8] != '{') fail(file, "the header must be a JSON object starting with '{'");
  const json j = parse_json_unique(std::string(reinterpret_cast<const char*>(data) + 8, n), file);
  if (!j.is_object()) fail(file, "the header must be a JSON object");

  StHeader h;
  h.data_start = 8 + n;
  for (auto& [name, value] : j.items()) {
    if (name == "__metadata__") h.metadata = parse_metadata(value, file);
    else h.tensors.push_back(parse_entry(name, value, file));
  }
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const StEntry& a, const StEntry& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  uint64_t at = 0;
  for (auto& e : h.tensors) {
    if (e.begin != at)
      fail_tensor(file, e.name,
                  "data_offsets begin at " + std::to_string(e.begin) + " but the previous tensor ends at " +
                      std::to_string(at) + " (tensors must tile the data buffer, without hole or overlap)");
    at = e.end;
  }
  const uint64_t buffer = file_size - h.data_start;
  if (at != buffer)
    fail(file, "the tensors cover " + std::to_string(at) + " bytes of data but the file holds " +
                   std::to_string(buffer) + " after the header (truncated, or trailing bytes)");
  return h;
}

std::string format_st_header(const StHeader& header) {
  json j = json::object();
  if (!header.metadata.empty()) j["__metadata__"] = header.metadata;
  for (auto& e : header.tensors)
    j[e.name] = {{"dtype", st_dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  std::string text = j.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace tandem::ckpt
