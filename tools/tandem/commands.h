// The subcommands of the `tandem` tool. Each parses its own flags and returns an exit code.
#pragma once

#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

namespace tandem::cli {
// `v` with `digits` digits after the point, for tables and messages.
inline std::string fixed(double v, int digits) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}
// Index of the first "--" in argv (argc when there is none): what follows it is another program's
// arguments (tandem launch, tandem k8s).
inline int dashdash_index(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-' && argv[i][1] == '-' && argv[i][2] == '\0') return i;
  }
  return argc;
}
// A command of `tandem`, or a form of one that a flag selects ("finetune --init-from DIR"). Its
// run reads the command line with parse_command_line and lists examples with examples_footer
// (cli_app.h): that is how docs/CLI.md describes it (scripts/cli-doc.sh regenerates the file).
struct Command {
  std::string name;                   // as typed after `tandem`; placeholders in capitals
  int (*run)(int argc, char** argv);  // argv[0] is the name's first word
  std::string summary;                // its line in `tandem help`
  std::string notes;                  // docs/CLI.md's prose about it (markdown), before its flags
};
// Every command, in `tandem help`'s order; main dispatches on the names without a space.
const std::vector<Command>& command_table();
// `tandem help`.
std::string usage();
// docs/CLI.md: every command's description, notes, flags (from the CLI::App that parses them)
// and examples (its footer). std::logic_error when a command does not describe itself.
std::string cli_reference_markdown();

int cmd_bench(int argc, char** argv);
int cmd_export(int argc, char** argv);
int cmd_finetune(int argc, char** argv);
// tandem finetune --init-from HF_DIR: cmd_finetune hands over when it sees --init-from.
int cmd_finetune_hf(int argc, char** argv);
int cmd_k8s(int argc, char** argv);
int cmd_launch(int argc, char** argv);
int cmd_plan(int argc, char** argv);
int cmd_pretrain(int argc, char** argv);
int cmd_preprocess(int argc, char** argv);
int cmd_selftest(int argc, char** argv);
int cmd_train(int argc, char** argv);
}  // namespace tandem::cli
