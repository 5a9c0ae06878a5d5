// Runs one function per rank of a group of thread communicators (tandem/backends.h), each on its
// own thread, and rethrows the first exception any of them threw once all have joined.
#pragma once

#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "tandem/comm.h"

namespace tandem::test {

inline void on_threads(const std::vector<CommPtr>& comms, const std::function<void(const CommPtr&, int)>& fn) {
  std::vector<std::thread> ts;
  std::vector<std::exception_ptr> errors(comms.size());
  for (size_t r = 0; r < comms.size(); ++r) {
    ts.emplace_back([&, r] {
      try {
        fn(comms[r], static_cast<int>(r));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace tandem::test
