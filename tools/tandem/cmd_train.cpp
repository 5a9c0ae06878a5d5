#include "commands.h"
#include <iostream>
namespace tandem::cli {
int cmd_train(int, char**) { std::cerr << "train: under construction\n"; return 1; }
}
