// A small block-style YAML emitter for Kubernetes manifests held as JSON. Plain scalars only
// where no YAML 1.1 or 1.2 reader (PyYAML, go-yaml in kubectl) can take them for anything but
// a string; everything else is written as a JSON string, which is a valid YAML double-quoted
// scalar with the same escapes.
#include <cctype>
#include <stdexcept>
#include <string>

#include "tandem/k8s.h"

namespace tandem::k8s {
namespace {

bool plain_safe(const std::string& s) {
  if (s.empty()) return false;
  // Starts with a letter, '/' or '_', or with dashes then a letter ("--mca", "-De"; not "-1").
  const size_t dashes = s.find_first_not_of('-');
  if (dashes == std::string::npos) return false;
  const char c0 = s[dashes];
  if (!(std::isalpha(static_cast<unsigned char>(c0)) || (dashes == 0 && (c0 == '/' || c0 == '_')))) return false;
  // No spaces, '#', quotes or flow brackets; ':' only inside ("image:tag", never "key: ").
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '/' || c == '=' || c == '@' ||
          c == '+' || c == '-' || c == ',' || c == ':')) {
      return false;
    }
  }
  if (s.back() == ':') return false;
  std::string lower;
  for (char c : s) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* word : {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}) {
    if (lower == word) return false;  // YAML 1.1 booleans and null
  }
  return true;
}

std::string scalar(const Json& v) {
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    return plain_safe(s) ? s : v.dump();
  }
  if (v.is_object()) return "{}";  // only empty ones reach here
  if (v.is_array()) return "[]";
  return v.dump();  // null, true/false, numbers
}

bool inline_value(const Json& v) { return !(v.is_object() || v.is_array()) || v.empty(); }

void emit(std::string& out, const Json& v, int indent);

void emit_after_key(std::string& out, const Json& v, int indent) {
  if (inline_value(v)) {
    out += ' ' + scalar(v) + '\n';
  } else {
    out += '\n';
    emit(out, v, v.is_object() ? indent + 2 : indent);  // sequences at the key's indent, as kubectl writes them
  }
}

// A non-empty mapping or sequence, starting at the beginning of a line.
void emit(std::string& out, const Json& v, int indent) {
  const std::string pad(static_cast<size_t>(indent), ' ');
  if (v.is_object()) {
    for (const auto& [key, value] : v.items()) {
      out += pad + scalar(Json(key)) + ':';
      emit_after_key(out, value, indent);
    }
    return;
  }
  for (const auto& item : v) {
    if (inline_value(item)) {
      out += pad + "- " + scalar(item) + '\n';
    } else if (item.is_object()) {
      std::string block;
      emit(block, item, indent + 2);  // the first key goes on the dash's line
      out += pad + "- " + block.substr(static_cast<size_t>(indent) + 2);
    } else {
      out += pad + "-\n";
      emit(out, item, indent + 2);
    }
  }
}

}  // namespace

std::string to_yaml(const Json& doc) {
  if (inline_value(doc)) return scalar(doc) + '\n';
  std::string out;
  emit(out, doc, 0);
  return out;
}

std::string render(const std::vector<Json>& docs, const std::string& format) {
  if (format == "json") {
    if (docs.size() == 1) return docs[0].dump(2) + '\n';
    Json list = {{"apiVersion", "v1"}, {"kind", "List"}, {"items", docs}};
    return list.dump(2) + '\n';
  }
  if (format != "yaml") throw std::invalid_argument("--format '" + format + "': use yaml or json");
  std::string out;
  for (size_t i = 0; i < docs.size(); ++i) {
    if (i) out += "---\n";
    out += to_yaml(docs[i]);
  }
  return out;
}

}  // namespace tandem::k8s
