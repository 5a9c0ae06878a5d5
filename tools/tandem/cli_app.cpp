#include "cli_app.h"

#include <algorithm>
#include <stdexcept>

namespace tandem::cli {
namespace {

thread_local CommandCapture* active_capture = nullptr;

std::vector<std::string> sorted_names(const std::set<CLI::Option*>& options) {
  std::vector<std::string> names;
  for (const CLI::Option* o : options) names.push_back(o->get_name());
  std::sort(names.begin(), names.end());
  return names;
}

std::string joined_names(const CLI::Option& o) {
  if (o.get_positional() && !o.nonpositional()) return o.get_name(true);
  std::string names;
  for (const auto& s : o.get_snames()) names += (names.empty() ? "-" : ", -") + s;
  for (const auto& l : o.get_lnames()) names += (names.empty() ? "--" : ", --") + l;
  return names;
}

}  // namespace

CommandDoc describe(const CLI::App& app) {
  CommandDoc doc;
  doc.description = app.get_description();
  doc.footer = app.get_footer();
  const CLI::Option* help = app.get_help_ptr();
  for (const CLI::Option* o : app.get_options()) {
    if (o == help || o->get_group().empty()) continue;  // --help, and the launcher's internal flags
    OptionDoc d;
    d.names = joined_names(*o);
    d.description = o->get_description();
    d.required = o->get_required();
    d.repeatable = o->get_expected_max() > 1 || o->get_multi_option_policy() == CLI::MultiOptionPolicy::TakeAll;
    d.delimiter = o->get_delimiter();
    if (o->get_type_size() != 0) {
      d.type = o->get_type_name();
      d.default_str = o->get_default_str();
      // CLI11 shows a list's default with spaces; written as it is typed instead.
      if (d.repeatable && d.delimiter != '\0')
        std::replace(d.default_str.begin(), d.default_str.end(), ' ', d.delimiter);
    }
    d.excludes = sorted_names(o->get_excludes());
    d.needs = sorted_names(o->get_needs());
    doc.options.push_back(std::move(d));
  }
  return doc;
}

std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  if (active_capture != nullptr) {
    active_capture->doc_ = describe(app);
    return 0;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return std::nullopt;
}

CommandCapture::CommandCapture() {
  if (active_capture != nullptr) throw std::logic_error("CommandCapture: one is already recording on this thread");
  active_capture = this;
}

CommandCapture::~CommandCapture() { active_capture = nullptr; }

const CommandDoc& CommandCapture::doc() const {
  if (!doc_) throw std::logic_error("CommandCapture: the command returned before reading its command line");
  return *doc_;
}

std::string examples_footer(const std::vector<Example>& examples) {
  std::string out = "Examples:";
  for (const auto& e : examples) {
    if (!e.comment.empty()) out += "\n  # " + e.comment;
    for (const auto& c : e.commands) out += "\n  " + c;
  }
  return out;
}

}  // namespace tandem::cli
