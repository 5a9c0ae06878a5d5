// How every command reads its command line, and the record of a command's flags that
// docs/CLI.md is generated from (`tandem help --markdown`): the reference walks the same
// CLI::App that parses, so a flag cannot be added without its line in the reference.
#pragma once

#include <CLI/CLI.hpp>

#include <optional>
#include <string>
#include <vector>

namespace tandem::cli {

// One option or positional of a command, as its CLI::App defines it.
struct OptionDoc {
  std::string names;        // "-n, --nprocs"; a positional's name
  std::string type;         // CLI11's type with its checks, "INT:1 to 4096"; "" for a flag
  std::string default_str;  // "" when none is shown
  std::string description;
  bool required = false;
  bool repeatable = false;            // takes any number of values, or may be given again
  char delimiter = '\0';              // the separator of a list in one value (',' for "1,2,4")
  std::vector<std::string> excludes;  // names of the options it cannot be given with, sorted
  std::vector<std::string> needs;     // names of the options it needs, sorted
};

// A command's description, options (without --help and the internal ones, as --help lists
// them) and footer (its examples).
struct CommandDoc {
  std::string description;
  std::string footer;
  std::vector<OptionDoc> options;
};

CommandDoc describe(const CLI::App& app);

// Parses argc/argv into the app's options: std::nullopt when the command goes on, else the
// exit code to return (0 after --help, CLI11's code after printing a parse error). While a
// CommandCapture is alive on this thread it parses nothing: it records describe(app) into the
// capture and returns 0, so the command returns before doing anything.
std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv);

class CommandCapture {
 public:
  CommandCapture();
  ~CommandCapture();
  CommandCapture(const CommandCapture&) = delete;
  CommandCapture& operator=(const CommandCapture&) = delete;
  // The command's record; std::logic_error when the command did not reach parse_command_line.
  const CommandDoc& doc() const;

 private:
  friend std::optional<int> parse_command_line(CLI::App&, int, char**);
  std::optional<CommandDoc> doc_;
};

// A footer of examples: "Examples:" then each example's commands, after its comment line when it
// has one.
struct Example {
  std::string comment;                // "" for none
  std::vector<std::string> commands;  // {"tandem train -n 4 --strategy zero2"}, one line each
};
std::string examples_footer(const std::vector<Example>& examples);

}  // namespace tandem::cli
