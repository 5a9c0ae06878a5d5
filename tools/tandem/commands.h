// The subcommands of the `tandem` tool. Each parses its own flags and returns an exit code.
#pragma once

namespace tandem::cli {
int cmd_bench(int argc, char** argv);
int cmd_finetune(int argc, char** argv);
int cmd_launch(int argc, char** argv);
int cmd_plan(int argc, char** argv);
int cmd_pretrain(int argc, char** argv);
int cmd_selftest(int argc, char** argv);
int cmd_train(int argc, char** argv);
}  // namespace tandem::cli
