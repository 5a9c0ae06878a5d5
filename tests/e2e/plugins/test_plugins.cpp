// Plugins that the loader must refuse or treat specially, one per definition given by
// tests/e2e/plugin.cmake:
//   TANDEM_TEST_PLUGIN_NO_STAMP       registers a model, lacks TANDEM_PLUGIN()
//   TANDEM_TEST_PLUGIN_OTHER_VERSION  its stamp reports Tandem TANDEM_TEST_PLUGIN_VERSION
//   TANDEM_TEST_PLUGIN_EMPTY          TANDEM_PLUGIN() and nothing registered
//   TANDEM_TEST_PLUGIN_DUPLICATE      registers "cnn" (taken by a built-in) and "dup_extra"
//   TANDEM_TEST_PLUGIN_TWO_MODELS     registers "twin_a" and "twin_b" (default dataset "blobs")
#include <tandem/registry.h>
#include <torch/torch.h>

namespace {
[[maybe_unused]] torch::nn::Sequential small() {
  return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 10));
}
}  // namespace

#if defined(TANDEM_TEST_PLUGIN_NO_STAMP)
TANDEM_REGISTER_MODEL("no_stamp_model", small, "a model in a plugin without a stamp");
#elif defined(TANDEM_TEST_PLUGIN_OTHER_VERSION)
TANDEM_REGISTER_MODEL("other_version_model", small, "a model in a plugin of another Tandem version");
extern "C" __attribute__((visibility("default"))) const tandem::PluginStamp* tandem_plugin_stamp() {
  static const tandem::PluginStamp stamp{TANDEM_REGISTRY_ABI, TANDEM_TEST_PLUGIN_VERSION, TORCH_VERSION};
  return &stamp;
}
#elif defined(TANDEM_TEST_PLUGIN_EMPTY)
TANDEM_PLUGIN()
#elif defined(TANDEM_TEST_PLUGIN_DUPLICATE)
TANDEM_REGISTER_MODEL("cnn", small, "clashes with the built-in cnn");
TANDEM_REGISTER_MODEL("dup_extra", small, "registered beside the clash");
TANDEM_PLUGIN()
#elif defined(TANDEM_TEST_PLUGIN_TWO_MODELS)
TANDEM_REGISTER_MODEL("twin_a", small, "first of two models", "blobs");
TANDEM_REGISTER_MODEL("twin_b", small, "second of two models", "blobs");
TANDEM_PLUGIN()
#else
#error "define one TANDEM_TEST_PLUGIN_* (tests/e2e/plugin.cmake)"
#endif
