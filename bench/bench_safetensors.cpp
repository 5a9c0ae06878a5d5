// Read and write speed of tandem/safetensors.h on one file of float32 matrices:
//   bench_safetensors [--mb 256] [--tensors 16] [--parts 4] [--dir /tmp]
// Writes the file (save_file), then times, each the median of 5 runs: opening it (mapping and
// validating the header), reading every tensor whole (File::get, then a sum that touches every
// byte), and reading one of --parts row ranges of every tensor (File::read_rows: what one
// tensor-parallel rank reads). The file is in the page cache after the write, so the reads
// measure the mapping and copies, not the disk. Prints one JSON line; removes the file.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <torch/torch.h>
#include <vector>

#include "tandem/safetensors.h"

namespace {

template <typename F>
double median_ms(F f, int runs = 5) {
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t mb = 256, n = 16, parts = 4;
  std::string dir = "/tmp";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--mb") mb = std::stoll(v);
    else if (a == "--tensors") n = std::stoll(v);
    else if (a == "--parts") parts = std::stoll(v);
    else if (a == "--dir") dir = v;
    else {
      std::cerr << "bench_safetensors: unknown option " << a << " (--mb, --tensors, --parts, --dir)\n";
      return 2;
    }
  }
  torch::set_num_threads(1);
  const int64_t cols = 1024, rows = std::max<int64_t>(parts, (mb << 20) / n / cols / 4);
  namespace st = tandem::safetensors;
  st::TensorList tensors;
  for (int64_t i = 0; i < n; ++i) tensors.emplace_back("layer." + std::to_string(i), torch::randn({rows, cols}));
  const std::string path = dir + "/bench_safetensors_" + std::to_string(::getpid()) + ".safetensors";
  const double bytes = double(n * rows * cols * 4);
  const double write_ms = median_ms([&] { st::save_file(path, tensors); }, 3);
  const double open_ms = median_ms([&] { st::File f(path); });
  double sink = 0;
  const double whole_ms = median_ms([&] {
    st::File f(path);
    for (auto& name : f.names()) sink += f.get(name).sum().item<double>();
  });
  const double rows_ms = median_ms([&] {
    st::File f(path);
    for (auto& name : f.names()) sink += f.read_rows(name, rows / parts, 2 * (rows / parts)).sum().item<double>();
  });
  std::remove(path.c_str());
  nlohmann::json j = {{"mib", bytes / (1 << 20)},
                      {"tensors", n},
                      {"write_ms", write_ms},
                      {"write_gib_s", bytes / (1 << 30) / (write_ms / 1e3)},
                      {"open_ms", open_ms},
                      {"read_whole_ms", whole_ms},
                      {"read_whole_gib_s", bytes / (1 << 30) / (whole_ms / 1e3)},
                      {"read_rows_of_" + std::to_string(parts) + "_ms", rows_ms},
                      {"checksum_ignore", sink != 0}};
  std::cout << j.dump() << "\n";
}
