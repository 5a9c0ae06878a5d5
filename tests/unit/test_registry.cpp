// The model and dataset registry (tandem/registry.h) and plugin loading. The plugin files come
// from tests/e2e/plugin.cmake through TANDEM_TEST_PLUGIN_<kind> variables; without them the
// plugin tests are skipped. The registry is process-wide: every test registers its own names.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "tandem/data.h"
#include "tandem/models.h"
#include "tandem/registry.h"

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

tandem::DatasetSplits tiny_splits(int64_t n_train, int64_t n_test) {
  auto make = [](int64_t n) {
    tandem::data::Dataset d;
    d.images = torch::arange(n * 4, torch::kFloat).reshape({n, 1, 2, 2});
    d.labels = torch::arange(n, torch::kLong) % 3;
    return d;
  };
  return {make(n_train), make(n_test)};
}

// A static registration of the program itself.
torch::nn::Sequential unit_static_model() { return torch::nn::Sequential(torch::nn::Linear(3, 2)); }
TANDEM_REGISTER_MODEL("unit_static_model", unit_static_model, "registered by a static object", "unit_static_data");
TANDEM_REGISTER_DATASET(
    "unit_static_data", [](const std::string&) { return tiny_splits(6, 3); }, "registered by a static object");

}  // namespace

TEST(Registry, BuiltinsComeFirstInOrder) {
  const auto models = tandem::registered_models();
  ASSERT_GE(models.size(), 4u);
  const char* builtin[] = {"mlp", "cnn", "cnn_bn", "transformer_tiny"};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(models[i].name, builtin[i]);
    EXPECT_EQ(models[i].origin, "built into Tandem");
    EXPECT_FALSE(models[i].description.empty());
  }
  EXPECT_EQ(tandem::models::model_names()[1], "cnn");
  EXPECT_EQ(tandem::models::count_parameters(*tandem::make_registered_model("cnn")), 421642);
  EXPECT_EQ(tandem::default_dataset_for("cnn"), "fashion-mnist");
  EXPECT_EQ(tandem::registered_datasets().front().name, "fashion-mnist");
}

TEST(Registry, StaticRegistrationsOfTheProgram) {
  const auto info = tandem::model_info("unit_static_model");
  EXPECT_EQ(info.origin, "the program");
  EXPECT_EQ(tandem::default_dataset_for("unit_static_model"), "unit_static_data");
  EXPECT_EQ(tandem::models::make_model("unit_static_model")->size(), 1u);
  auto splits = tandem::load_registered_dataset("unit_static_data", "");
  EXPECT_EQ(splits.train.size(), 6);
  EXPECT_EQ(splits.test.size(), 3);
}

TEST(Registry, RegisterAndCreateAModel) {
  int calls = 0;
  tandem::register_model("unit_linear", tandem::model_factory([&calls] {
                           ++calls;
                           return torch::nn::Linear(5, 2).ptr();  // a module that is not a Sequential
                         }),
                         "a bare Linear");
  auto a = tandem::make_registered_model("unit_linear");
  auto b = tandem::make_registered_model("unit_linear");
  EXPECT_EQ(calls, 2);
  EXPECT_NE(a.get(), b.get());  // a new module each call
  auto out = std::dynamic_pointer_cast<torch::nn::LinearImpl>(a)->forward(torch::ones({3, 5}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(tandem::default_dataset_for("unit_linear"), "fashion-mnist");
  // make_model keeps returning a Sequential, and says why it cannot here.
  const auto msg = error_of([] { tandem::models::make_model("unit_linear"); });
  EXPECT_TRUE(contains(msg, "'unit_linear' is a torch::nn::Linear")) << msg;
  EXPECT_TRUE(contains(msg, "not a torch::nn::Sequential")) << msg;
  EXPECT_THROW(tandem::models::make_model("unit_linear"), std::invalid_argument);
}

TEST(Registry, RegisterAndLoadADataset) {
  std::string seen_dir;
  tandem::register_dataset(
      "unit_tiny",
      [&seen_dir](const std::string& dir) {
        seen_dir = dir;
        return tiny_splits(7, 2);
      },
      "seven samples");
  auto s = tandem::load_registered_dataset("unit_tiny", "/some/dir");
  EXPECT_EQ(seen_dir, "/some/dir");
  EXPECT_EQ(s.train.size(), 7);
  EXPECT_EQ(s.test.size(), 2);
  EXPECT_TRUE(torch::equal(s.train.labels, torch::arange(7, torch::kLong) % 3));
  EXPECT_EQ(tandem::dataset_info("unit_tiny").description, "seven samples");
}

TEST(Registry, ADatasetOfTheWrongShapeIsRefusedNamingTheSplit) {
  tandem::register_dataset(
      "unit_bad_labels",
      [](const std::string&) {
        auto s = tiny_splits(4, 2);
        s.test.labels = s.test.labels.to(torch::kInt);
        return s;
      },
      "int32 labels");
  auto msg = error_of([] { tandem::load_registered_dataset("unit_bad_labels", ""); });
  EXPECT_TRUE(contains(msg, "dataset 'unit_bad_labels', test split: labels must be int64 [N], got Int")) << msg;
  tandem::register_dataset(
      "unit_bad_count",
      [](const std::string&) {
        auto s = tiny_splits(4, 2);
        s.train.labels = s.train.labels.slice(0, 0, 3);
        return s;
      },
      "one label short");
  msg = error_of([] { tandem::load_registered_dataset("unit_bad_count", ""); });
  EXPECT_TRUE(contains(msg, "training split: 4 images but 3 labels")) << msg;
  tandem::register_dataset(
      "unit_empty", [](const std::string&) { return tiny_splits(0, 2); }, "no samples");
  msg = error_of([] { tandem::load_registered_dataset("unit_empty", ""); });
  EXPECT_TRUE(contains(msg, "training split: it is empty")) << msg;
}

TEST(Registry, UnknownNamesListTheKnownOnes) {
  auto msg = error_of([] { tandem::make_registered_model("resnet9000"); });
  EXPECT_TRUE(contains(msg, "unknown model 'resnet9000' (known: mlp, cnn, cnn_bn, transformer_tiny")) << msg;
  EXPECT_THROW(tandem::make_registered_model("resnet9000"), std::invalid_argument);
  EXPECT_THROW(tandem::default_dataset_for("resnet9000"), std::invalid_argument);
  msg = error_of([] { tandem::load_registered_dataset("imagenet", ""); });
  EXPECT_TRUE(contains(msg, "unknown dataset 'imagenet' (known: fashion-mnist")) << msg;
  EXPECT_THROW(tandem::dataset_info("imagenet"), std::invalid_argument);
}

TEST(Registry, DuplicateAndMalformedNamesAreErrors) {
  auto small = tandem::model_factory([] { return torch::nn::Sequential(torch::nn::Linear(2, 2)); });
  auto msg = error_of([&] { tandem::register_model("cnn", small, "again"); });
  EXPECT_TRUE(contains(msg, "model 'cnn' (the program) is already registered (built into Tandem)")) << msg;
  EXPECT_THROW(tandem::register_model("cnn", small, "again"), std::invalid_argument);
  tandem::register_model("unit_once", small, "first");
  EXPECT_THROW(tandem::register_model("unit_once", small, "second"), std::invalid_argument);
  EXPECT_EQ(tandem::model_info("unit_once").description, "first");  // the first stays
  EXPECT_THROW(tandem::register_dataset(
                   "fashion-mnist", [](const std::string&) { return tiny_splits(1, 1); }, ""),
               std::invalid_argument);
  for (const char* bad : {"", "a/b", "lib.so:x", "two words"}) {
    EXPECT_THROW(tandem::register_model(bad, small, ""), std::invalid_argument) << bad;
  }
  EXPECT_THROW(tandem::register_model("unit_no_factory", nullptr, ""), std::invalid_argument);
}

TEST(Registry, AFailedStaticRegistrationIsReportedByTheNextLookupOnce) {
  // What TANDEM_REGISTER_MODEL does at static-initialisation time, where it must not throw.
  tandem::detail::ModelRegistration clash(
      "mlp", [] { return torch::nn::Sequential(); }, "clashes");
  const auto msg = error_of([] { tandem::registered_models(); });
  EXPECT_TRUE(contains(msg, "a registration failed: model 'mlp' (the program) is already registered")) << msg;
  EXPECT_NO_THROW(tandem::registered_models());
}

TEST(Registry, FactoryFailuresNameTheModel) {
  tandem::register_model(
      "unit_throws",
      []() -> std::shared_ptr<torch::nn::Module> { throw std::invalid_argument("width must be positive"); }, "throws");
  auto msg = error_of([] { tandem::make_registered_model("unit_throws"); });
  EXPECT_TRUE(contains(msg, "model 'unit_throws' (the program): its factory failed: width must be positive")) << msg;
  tandem::register_model(
      "unit_null", [] { return std::shared_ptr<torch::nn::Module>(); }, "null");
  msg = error_of([] { tandem::make_registered_model("unit_null"); });
  EXPECT_TRUE(contains(msg, "its factory returned no module")) << msg;
}

TEST(Registry, FashionMnistIsTheBuiltinDataset) {
  ASSERT_EQ(access(tandem::data::kFashionMnistDir, R_OK), 0)
      << "no Fashion-MNIST installed (apt-get install dataset-fashion-mnist; scripts/setup.sh does)";
  auto s = tandem::load_registered_dataset("fashion-mnist", tandem::data::kFashionMnistDir);
  EXPECT_EQ(s.train.size(), 60000);
  EXPECT_EQ(s.test.size(), 10000);
  EXPECT_EQ(s.train.images.sizes(), (std::vector<int64_t>{60000, 1, 28, 28}));
  auto msg = error_of([] { tandem::load_registered_dataset("fashion-mnist", "/nonexistent"); });
  EXPECT_TRUE(contains(msg, "not found in '/nonexistent'")) << msg;
}

// ---- plugins

namespace {
std::string plugin_file(const char* kind) {
  const char* p = std::getenv((std::string("TANDEM_TEST_PLUGIN_") + kind).c_str());
  return p ? p : "";
}
#define PLUGIN_OR_SKIP(var, kind)            \
  const std::string var = plugin_file(kind); \
  if (var.empty()) GTEST_SKIP() << "TANDEM_TEST_PLUGIN_" kind " not set (tests/e2e/plugin.cmake)"
}  // namespace

TEST(Plugin, NamesPluginTellsPathsFromNames) {
  for (const char* p : {"./libx.so", "libx.so", "/a/b/libx.so.1", "libx.so:tiny", "../build/x", "dir/libx.so:m"})
    EXPECT_TRUE(tandem::names_plugin(p)) << p;
  for (const char* n : {"cnn", "tiny_mlp", "fashion-mnist", "so", "x.sox"}) EXPECT_FALSE(tandem::names_plugin(n)) << n;
  std::string option = "cnn";
  tandem::load_plugins_from_model_option(option);  // a registered name: nothing to load
  EXPECT_EQ(option, "cnn");
}

TEST(Plugin, TheExamplePluginRegistersItsModelAndDataset) {
  PLUGIN_OR_SKIP(path, "example");
  const auto p = tandem::load_plugin(path);
  EXPECT_EQ(p.models, std::vector<std::string>{"tiny_mlp"});
  EXPECT_EQ(p.datasets, std::vector<std::string>{"blobs"});
  EXPECT_EQ(p.tandem_version, tandem::version());
  EXPECT_EQ(p.torch_version, tandem::torch_version());
  EXPECT_EQ(tandem::load_plugin(path).path, p.path);  // loaded once
  EXPECT_TRUE(contains(tandem::model_info("tiny_mlp").origin, "plugin /")) << tandem::model_info("tiny_mlp").origin;

  std::string option = path;
  tandem::load_plugins_from_model_option(option);
  EXPECT_EQ(option, "tiny_mlp");
  option = path + ":tiny_mlp";
  tandem::load_plugins_from_model_option(option);
  EXPECT_EQ(option, "tiny_mlp");
  EXPECT_EQ(tandem::default_dataset_for("tiny_mlp"), "blobs");

  // Generated, the same every time; shaped like Fashion-MNIST.
  auto a = tandem::load_registered_dataset("blobs", "");
  auto b = tandem::load_registered_dataset("blobs", "/ignored");
  EXPECT_EQ(a.train.images.sizes(), (std::vector<int64_t>{2000, 1, 28, 28}));
  EXPECT_EQ(a.test.size(), 500);
  EXPECT_TRUE(torch::equal(a.train.images, b.train.images));
  EXPECT_TRUE(torch::equal(a.test.labels, b.test.labels));
  EXPECT_EQ(std::get<0>(at::_unique(a.train.labels)).numel(), 10);

  // The model learns it: 20 SGD steps of 64 samples take the loss well below chance's 2.30.
  torch::manual_seed(0);
  auto model = tandem::models::make_model("tiny_mlp");
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    auto x = a.train.images.slice(0, step * 64, (step + 1) * 64),
         y = a.train.labels.slice(0, step * 64, (step + 1) * 64);
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    opt.zero_grad();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_GT(first, 2.0);
  EXPECT_LT(last, 1.5);
}

TEST(Plugin, SeveralModelsNeedAName) {
  PLUGIN_OR_SKIP(path, "two_models");
  std::string option = path;
  auto msg = error_of([&] { tandem::load_plugins_from_model_option(option); });
  EXPECT_TRUE(contains(msg, "registers several models (twin_a, twin_b); choose one as " + path + ":twin_a")) << msg;
  option = path + ":twin_b";
  tandem::load_plugins_from_model_option(option);
  EXPECT_EQ(option, "twin_b");
  option = path + ":twin_c";
  msg = error_of([&] { tandem::load_plugins_from_model_option(option); });
  EXPECT_TRUE(contains(msg, "has no model 'twin_c' (its models: twin_a, twin_b)")) << msg;
}

TEST(Plugin, RefusedPluginsLeaveNothingRegistered) {
  PLUGIN_OR_SKIP(no_stamp, "no_stamp");
  PLUGIN_OR_SKIP(other_version, "other_version");
  PLUGIN_OR_SKIP(empty, "empty");
  PLUGIN_OR_SKIP(duplicate, "duplicate");
  auto msg = error_of([&] { tandem::load_plugin(no_stamp); });
  EXPECT_TRUE(contains(msg, "plugin '" + no_stamp + "' lacks the symbol tandem_plugin_stamp")) << msg;
  EXPECT_TRUE(contains(msg, "put TANDEM_PLUGIN()")) << msg;
  EXPECT_THROW(tandem::model_info("no_stamp_model"), std::invalid_argument);

  msg = error_of([&] { tandem::load_plugin(other_version); });
  EXPECT_TRUE(contains(msg, "was built against Tandem 0.0.1-other with LibTorch " + std::string(TORCH_VERSION))) << msg;
  EXPECT_TRUE(contains(msg, "but this is Tandem " + std::string(tandem::version()))) << msg;
  EXPECT_THROW(tandem::model_info("other_version_model"), std::invalid_argument);

  msg = error_of([&] { tandem::load_plugin(empty); });
  EXPECT_TRUE(contains(msg, "registers no model and no dataset")) << msg;

  msg = error_of([&] { tandem::load_plugin(duplicate); });
  EXPECT_TRUE(contains(msg, "failed to register: model 'cnn' (plugin ")) << msg;
  EXPECT_TRUE(contains(msg, "is already registered (built into Tandem)")) << msg;
  EXPECT_THROW(tandem::model_info("dup_extra"), std::invalid_argument);
  EXPECT_EQ(tandem::model_info("cnn").origin, "built into Tandem");
  EXPECT_NO_THROW(tandem::registered_models());  // the plugin's errors were reported, not left pending
  EXPECT_THROW(tandem::load_plugin(duplicate), std::runtime_error);  // and again, not cached
}

TEST(Plugin, FilesThatAreNoPluginsAreNamed) {
  auto msg = error_of([] { tandem::load_plugin("/nonexistent/libnothing.so"); });
  EXPECT_TRUE(contains(msg, "plugin '/nonexistent/libnothing.so' not found (No such file or directory)")) << msg;
  char dir[] = "/tmp/tandem-registry-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string text = std::string(dir) + "/libtext.so";
  std::ofstream(text) << "not a shared library\n";
  msg = error_of([&] { tandem::load_plugin(text); });
  EXPECT_TRUE(contains(msg, "plugin '" + text + "' is not a shared library (")) << msg;
  msg = error_of([&] { tandem::load_plugin(dir); });
  EXPECT_TRUE(contains(msg, "is a directory")) << msg;
  EXPECT_THROW(tandem::load_plugin(""), std::runtime_error);
  ::unlink(text.c_str());
  ::rmdir(dir);
}
