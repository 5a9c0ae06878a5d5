// The built-in datasets in the registry (tandem/registry.h).
#include "registry/builtins.h"
#include "tandem/data.h"
#include "tandem/registry.h"

namespace tandem::data {

void register_builtin_datasets() {
  register_dataset(
      "fashion-mnist",
      [](const std::string& dir) {
        const std::string d = dir.empty() ? kFashionMnistDir : dir;
        return DatasetSplits{load_fashion_mnist(d, /*train=*/true), load_fashion_mnist(d, /*train=*/false)};
      },
      "Zalando's Fashion-MNIST, 60000 + 10000 28x28 grey images, 10 classes (IDX files in --data)");
}

}  // namespace tandem::data
