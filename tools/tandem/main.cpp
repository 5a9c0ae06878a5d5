// tandem: train, launch and check distributed jobs. Thin: flags in, library calls out.
#include <cstring>
#include <exception>
#include <iostream>
#include <string>

#include "commands.h"
#include "tandem/pipeline.h"
#include "tandem/runtime.h"

int main(int argc, char** argv) {
  tandem::tune_allocator();        // before anything allocates (the calibration times compute in this process)
  tandem::MemoryMeter::install();  // counts CPU tensor bytes for the report's activation peak
  if (argc < 2) {
    // The main job: training with its defaults.
    return tandem::cli::cmd_train(argc, argv);
  }
  std::string cmd = argv[1];
  try {
    for (const auto& c : tandem::cli::command_table()) {
      if (c.name == cmd) return c.run(argc - 1, argv + 1);
    }
    if (cmd == "-h" || cmd == "--help" || cmd == "help") {
      // `tandem help --markdown` writes docs/CLI.md (scripts/cli-doc.sh).
      if (argc == 3 && std::strcmp(argv[2], "--markdown") == 0) {
        std::cout << tandem::cli::cli_reference_markdown();
        return 0;
      }
      std::cout << tandem::cli::usage();
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "tandem " << cmd << ": " << e.what() << '\n';
    return 1;
  }
  std::cerr << "tandem: unknown command '" << cmd << "'\n\n" << tandem::cli::usage();
  return 2;
}
