// A fresh directory under $TMPDIR (or /tmp) for one test, removed with its contents at scope
// exit. POSIX calls, not std::filesystem: pip torch's libtorch.so exports a copy of
// std::filesystem whose remove_all crashes (null weak symbol) and interposes libstdc++'s.
#pragma once

#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <stdexcept>
#include <string>

namespace tandem::test {

struct TempDir {
  std::string path;
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/tandem_test_XXXXXX";
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path = tmpl;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    ::nftw(
        path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

}  // namespace tandem::test
