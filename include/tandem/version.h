// Tandem's version: compiled into every program and plugin from this header, and into the
// library itself (tandem::version()). A plugin reports the one it was compiled against and is
// refused by a library of another version (tandem/registry.h). Keep it equal to the VERSION of
// project(tandem ...) in the top-level CMakeLists.txt.
#pragma once

#define TANDEM_VERSION_MAJOR 0
#define TANDEM_VERSION_MINOR 1
#define TANDEM_VERSION_PATCH 0
#define TANDEM_VERSION "0.1.0"

namespace tandem {

// The version of the loaded library (TANDEM_VERSION as libtandem was compiled), and the
// LibTorch version it was compiled against (TORCH_VERSION then): what plugins must match.
const char* version();
const char* torch_version();

}  // namespace tandem
