// Tests for tandem/safetensors.h: bitwise round trips of every dtype, files written by hand
// read back, each header rule enforced with a message naming the file and tensor, slices,
// sharded checkpoints, and (in .venv-hf, scripts/setup-hf-venv.sh) files exchanged with the
// Python reference implementation.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tandem/safetensors.h"
#include "temp_dir.h"

namespace st = tandem::safetensors;
using tandem::test::TempDir;

namespace {

// Bit-level equality: dtype, shape and every byte (NaNs and signed zeros included).
::testing::AssertionResult same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes())
    return ::testing::AssertionFailure() << a.scalar_type() << a.sizes() << " vs " << b.scalar_type() << b.sizes();
  auto ca = a.contiguous(), cb = b.contiguous();
  if (ca.nbytes() != cb.nbytes() || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) != 0)
    return ::testing::AssertionFailure() << "bytes differ";
  return ::testing::AssertionSuccess();
}

st::TensorList every_dtype() {
  torch::manual_seed(7);
  st::TensorList t = {
      {"f64", torch::randn({3, 5}, torch::kDouble)},
      {"f32", torch::randn({7, 3, 2})},
      {"f16", torch::randn({5, 9}).to(torch::kHalf)},
      {"bf16", torch::randn({11}).to(torch::kBFloat16)},
      {"i64", torch::randint(-(int64_t{1} << 62), int64_t{1} << 62, {4, 3}, torch::kLong)},
      {"i32", torch::randint(-(int64_t{1} << 31), (int64_t{1} << 31) - 1, {13}, torch::kInt)},
      {"i16", torch::randint(-32768, 32767, {3, 3}, torch::kShort)},
      {"i8", torch::randint(-128, 127, {17}, torch::kChar)},
      {"u8", torch::randint(0, 255, {2, 7}, torch::kByte)},
      {"bool", torch::rand({9}) > 0.5},
      {"scalar", torch::tensor(2.5)},
      {"empty", torch::zeros({0, 4})},
  };
  t[1].second.index_put_({0, 0, 0}, std::nan(""));
  t[2].second.index_put_({0, 0}, -std::numeric_limits<float>::infinity());
  return t;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f << bytes;
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A file by hand: u64 little-endian length, the header text exactly as given, then the data.
std::string hand_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((uint64_t(header.size()) >> (8 * i)) & 0xff);
  return out + header + data;
}

// torch's Python name of a dtype, as str(tensor.dtype) prints it.
std::string python_dtype(at::ScalarType t) {
  static const std::map<at::ScalarType, std::string> names = {{at::kDouble, "float64"}, {at::kFloat, "float32"},
                                                              {at::kHalf, "float16"},   {at::kBFloat16, "bfloat16"},
                                                              {at::kLong, "int64"},     {at::kInt, "int32"},
                                                              {at::kShort, "int16"},    {at::kChar, "int8"},
                                                              {at::kByte, "uint8"},     {at::kBool, "bool"}};
  return "torch." + names.at(t);
}

}  // namespace

TEST(Safetensors, RoundTripEveryDtypeBitwise) {
  TempDir d;
  const auto tensors = every_dtype();
  const st::Metadata meta = {{"format", "pt"}, {"note", "ünïcode ✓"}};
  st::save_file(d.file("a.safetensors"), tensors, meta);
  st::Metadata got_meta;
  const auto got = st::load_file(d.file("a.safetensors"), &got_meta);
  EXPECT_EQ(got_meta, meta);
  ASSERT_EQ(got.size(), tensors.size());
  std::map<std::string, at::Tensor> by_name(got.begin(), got.end());
  for (auto& [name, t] : tensors) {
    ASSERT_TRUE(by_name.count(name)) << name;
    EXPECT_TRUE(same_bits(by_name[name], t)) << name;
  }
  // Tensor -> file -> tensor -> file: the same bytes.
  st::save_file(d.file("b.safetensors"), got, meta);
  EXPECT_EQ(read_bytes(d.file("a.safetensors")), read_bytes(d.file("b.safetensors")));
}

TEST(Safetensors, ReadsAHandWrittenFile) {
  TempDir d;
  // Two F32 [2] tensors and one I16 [3], data laid out by hand, with trailing header spaces.
  const float a[2] = {1.5f, -2.0f}, b[2] = {3.25f, 0.0f};
  const int16_t c[3] = {-7, 300, 32767};
  std::string data(reinterpret_cast<const char*>(b), 8);
  data += std::string(reinterpret_cast<const char*>(a), 8) + std::string(reinterpret_cast<const char*>(c), 6);
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("c":{"dtype":"I16","shape":[3,1],"data_offsets":[16,22]},"__metadata__":{"k":"v"}}   )";
  write_bytes(d.file("h.safetensors"), hand_file(header, data));
  st::File f(d.file("h.safetensors"));
  EXPECT_EQ(f.names(), (std::vector<std::string>{"b", "a", "c"}));
  EXPECT_EQ(f.metadata(), (st::Metadata{{"k", "v"}}));
  EXPECT_EQ(f.info("c").dtype, at::kShort);
  EXPECT_EQ(f.info("c").shape, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(f.info("a").offset, int64_t(8 + header.size() + 8));
  EXPECT_EQ(f.get("a")[0].item<float>(), 1.5f);
  EXPECT_EQ(f.get("a")[1].item<float>(), -2.0f);
  EXPECT_EQ(f.get("b")[0].item<float>(), 3.25f);
  // c starts at an even offset only if the header length is even; either way the values hold.
  EXPECT_EQ(f.get("c")[1][0].item<int16_t>(), 300);
  EXPECT_EQ(f.get("c")[2][0].item<int16_t>(), 32767);
  EXPECT_THROW(f.get("nope"), std::out_of_range);
}

TEST(Safetensors, ViewsAreCopyOnWriteAndOutliveTheFileObject) {
  TempDir d;
  st::save_file(d.file("v.safetensors"), {{"w", torch::arange(12, torch::kFloat).reshape({3, 4})}});
  at::Tensor w;
  {
    st::File f(d.file("v.safetensors"));
    w = f.get("w");
  }
  EXPECT_EQ(w[2][3].item<float>(), 11.0f);  // the mapping outlives the File
  w.mul_(2);                                // writes to the private mapping
  EXPECT_EQ(w[2][3].item<float>(), 22.0f);
  EXPECT_EQ(st::File(d.file("v.safetensors")).get("w")[2][3].item<float>(), 11.0f);
}

TEST(Safetensors, SlicesAlongEachDimEqualTheWholeTensorNarrowed) {
  TempDir d;
  torch::manual_seed(3);
  const auto w = torch::randn({7, 5, 3}), h = torch::randn({9, 6}).to(torch::kBFloat16);
  st::save_file(d.file("s.safetensors"), {{"w", w}, {"h", h}});
  st::File f(d.file("s.safetensors"));
  for (int64_t dim = 0; dim < 3; ++dim)
    for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 1}, {1, 3}, {2, 2}, {0, w.size(dim)}}) {
      auto s = f.read_slice("w", dim, b, e);
      EXPECT_TRUE(same_bits(s, w.narrow(dim, b, e - b))) << dim << " " << b << " " << e;
      EXPECT_TRUE(s.is_contiguous());
    }
  EXPECT_TRUE(same_bits(f.read_rows("h", 4, 9), h.narrow(0, 4, 5)));
  EXPECT_TRUE(same_bits(f.read_slice("h", 1, 3, 6), h.narrow(1, 3, 3)));
  EXPECT_THROW(f.read_rows("h", 5, 10), std::out_of_range);
  EXPECT_THROW(f.read_rows("h", 3, 2), std::out_of_range);
  EXPECT_THROW(f.read_slice("h", 2, 0, 1), std::out_of_range);
}

// bytes_read counts what was handed out: a slice its own bytes (for a column slice, its piece of
// every row), a whole tensor all of its bytes, and every copy of a File or Checkpoint the same
// total; opening a file and reading infos count nothing.
TEST(Safetensors, BytesReadCountsOnlyTheSlicesRead) {
  TempDir d;
  const auto w = torch::randn({6, 10}), b = torch::randn({4}).to(torch::kBFloat16);
  st::save_checkpoint(d.path, {{"w", w}, {"b", b}});
  st::Checkpoint c(d.path);
  EXPECT_EQ(c.bytes_read(), 0);
  EXPECT_EQ(c.info("w").bytes, 6 * 10 * 4);
  EXPECT_EQ(c.bytes_read(), 0);
  c.read_slice("w", 0, 2, 5);  // rows 2-4
  EXPECT_EQ(c.bytes_read(), 3 * 10 * 4);
  const st::Checkpoint copy = c;
  copy.read_slice("w", 1, 4, 6);  // columns 4-5 of every row
  EXPECT_EQ(c.bytes_read(), 3 * 10 * 4 + 6 * 2 * 4);
  c.get("b");
  EXPECT_EQ(copy.bytes_read(), 3 * 10 * 4 + 6 * 2 * 4 + 4 * 2);
  c.read_slice("w", 1, 3, 3);  // empty
  EXPECT_EQ(c.file_of("w").bytes_read(), c.bytes_read());
}

// A flat element range of any tensor is the flattened tensor's range, in the file's dtype (F16
// and BF16 bitwise, converting only where the caller copies), counted by its own bytes; a range
// outside the tensor is refused naming the tensor and the file.
TEST(Safetensors, FlatRangesEqualTheFlattenedTensorAndCountTheirBytes) {
  TempDir d;
  torch::manual_seed(5);
  const auto w = torch::randn({4, 3, 5}), h = torch::randn({6, 7}).to(torch::kHalf),
             b = torch::randn({3, 9}).to(torch::kBFloat16);
  st::save_checkpoint(d.path, {{"w", w}, {"h", h}, {"b", b}});
  st::Checkpoint c(d.path);
  int64_t want = 0;
  for (auto& [name, t] : st::TensorList{{"w", w}, {"h", h}, {"b", b}}) {
    SCOPED_TRACE(name);
    for (auto [first, count] : {std::pair<int64_t, int64_t>{0, t.numel()}, {7, 11}, {t.numel() - 1, 1}, {3, 0}}) {
      const auto got = c.read_flat(name, first, count);
      EXPECT_TRUE(same_bits(got, t.reshape({-1}).narrow(0, first, count))) << first << " " << count;
      want += count * static_cast<int64_t>(t.element_size());
      EXPECT_EQ(c.bytes_read(), want);
    }
  }
  auto as_float = torch::zeros({5});
  as_float.copy_(c.read_flat("b", 20, 5));
  want += 5 * 2;
  EXPECT_TRUE(as_float.equal(b.reshape({-1}).narrow(0, 20, 5).to(torch::kFloat)));
  for (auto [first, count] : {std::pair<int64_t, int64_t>{-1, 2}, {40, 3}, {0, 43}, {2, -1}}) {
    try {
      c.read_flat("h", first, count);
      ADD_FAILURE() << "expected std::out_of_range for " << first << " " << count;
    } catch (const std::out_of_range& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("'h'"), std::string::npos) << m;
      EXPECT_NE(m.find("model.safetensors'"), std::string::npos) << m;
      EXPECT_NE(m.find("42 elements"), std::string::npos) << m;
    }
  }
  EXPECT_EQ(c.bytes_read(), want);
  EXPECT_THROW(c.read_flat("missing", 0, 1), std::out_of_range);
}

// A rank reading its rows of a cold file brings little more than those rows into memory: the
// page cache's residency of the file (mincore over a mapping of our own) is counted after the
// file is evicted and one eighth of a 64 MiB tensor is read. Skips where eviction does not work.
TEST(Safetensors, ReadRowsOfAColdFileReadsLittleBeyondTheRows) {
  TempDir d;
  const auto path = d.file("cold.safetensors");
  const int64_t rows = 16384, cols = 1024;  // 64 MiB of float32
  torch::manual_seed(9);
  const auto w = torch::randn({rows, cols});
  st::save_file(path, {{"w", w}});
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  struct stat sb {};
  ASSERT_EQ(::fstat(fd, &sb), 0);
  const size_t size = static_cast<size_t>(sb.st_size), page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  std::vector<unsigned char> vec((size + page - 1) / page);
  auto resident_mib = [&] {
    EXPECT_EQ(::mincore(m, size, vec.data()), 0);
    size_t n = 0;
    for (auto v : vec) n += v & 1;
    return double(n * page) / (1 << 20);
  };
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  const double before = resident_mib();
  if (before > 4) {
    ::munmap(m, size);
    ::close(fd);
    GTEST_SKIP() << before << " MiB of the file stayed in the page cache after POSIX_FADV_DONTNEED";
  }
  const auto part = st::File(path).read_rows("w", 5 * rows / 8, 6 * rows / 8);  // 8 MiB
  const double after = resident_mib();
  ::munmap(m, size);
  ::close(fd);
  EXPECT_TRUE(same_bits(part, w.narrow(0, 5 * rows / 8, rows / 8)));
  EXPECT_GE(after, 8.0);
  EXPECT_LE(after, 8.0 + 8.0) << "reading 8 MiB of rows brought " << after << " MiB of the 64 MiB file in";
  std::cout << "read_rows of 8 MiB from a cold 64 MiB file: " << after << " MiB resident\n";
}

TEST(Safetensors, WriteRefusesBadInputAndLeavesTheOldFile) {
  TempDir d;
  const auto path = d.file("x.safetensors");
  st::save_file(path, {{"a", torch::ones({2})}});
  const auto before = read_bytes(path);
  EXPECT_THROW(st::save_file(path, {{"a", torch::ones({2})}, {"a", torch::ones({1})}}), std::invalid_argument);
  EXPECT_THROW(st::save_file(path, {{"", torch::ones({2})}}), std::invalid_argument);
  try {
    st::save_file(path, {{"c", torch::ones({2}, torch::kComplexFloat)}});
    FAIL() << "complex accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'c'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_THROW(st::save_file(d.file("missing/dir/y.safetensors"), {{"a", torch::ones({2})}}), std::runtime_error);
}

// Each broken file is refused with a message naming the file and (where there is one) the tensor.
TEST(Safetensors, CorruptHeadersAreRefusedClearly) {
  TempDir d;
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, '\x01');
  struct Case {
    const char* what;
    std::string bytes;
    std::string expect;  // in the message
  };
  std::string huge_len(8, '\0');
  huge_len[6] = 1;  // 2^48
  std::string past_end = hand_file("{}", "");
  past_end[0] = 100;
  const std::vector<Case> cases = {
      {"short", "abc", "shorter than the 8-byte"},
      {"huge header", huge_len + "{}", "exceeds the limit"},
      {"past end", past_end, "runs past the end"},
      {"not json", hand_file("{\"t\":", ""), "not valid JSON"},
      {"not an object", hand_file("[1,2]", ""), "JSON object"},
      {"duplicate", hand_file("{" + ok_entry + "," + ok_entry + "}", eight + eight), "names 't' twice"},
      {"dtype", hand_file(R"({"t":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", "ab"),
       "tensor 't': dtype 'F8_E4M3' is not supported"},
      {"negative shape", hand_file(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight),
       "tensor 't': shape [-2]"},
      {"float shape", hand_file(R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", eight),
       "tensor 't': shape"},
      {"overflowing shape",
       hand_file(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", eight), "too large"},
      {"size mismatch", hand_file(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       "tensor 't': data_offsets [0,8] span 8 bytes but dtype F32 and shape [3] need 12"},
      {"reversed", hand_file(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", eight),
       "end before they begin"},
      {"missing field", hand_file(R"({"t":{"dtype":"F32","shape":[2]}})", eight), "missing field \"data_offsets\""},
      {"unknown field", hand_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", eight),
       "unknown field 'x'"},
      {"overlap",
       hand_file("{" + ok_entry + R"(,"u":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", eight + "1234"),
       "tensor 'u': data_offsets begin at 4 but the previous tensor ends at 8"},
      {"hole", hand_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", eight + "1234"),
       "tensor 't': data_offsets begin at 4"},
      {"truncated data", hand_file("{" + ok_entry + "}", "1234"), "cover 8 bytes of data but the file holds 4"},
      {"trailing data", hand_file("{" + ok_entry + "}", eight + "x"), "trailing bytes"},
      {"metadata", hand_file(R"({"__metadata__":{"k":3}})", ""), "\"__metadata__\" value of 'k' must be a string"},
      {"bad utf8", hand_file("{\"\xff\":1}", ""), "not valid JSON"},
  };
  for (auto& c : cases) {
    const auto path = d.file(std::string("bad-") + c.what + ".safetensors");
    write_bytes(path, c.bytes);
    try {
      st::File f(path);
      ADD_FAILURE() << c.what << ": accepted";
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(c.expect), std::string::npos) << c.what << ": " << msg;
      EXPECT_NE(msg.find(path), std::string::npos) << c.what << ": " << msg;
    }
  }
  EXPECT_THROW(st::File(d.file("absent.safetensors")), std::runtime_error);
}

TEST(Safetensors, ShardedCheckpointRoundTripOpensShardsLazily) {
  TempDir d;
  torch::manual_seed(11);
  st::TensorList tensors;
  for (int i = 0; i < 6; ++i) tensors.emplace_back("layer." + std::to_string(i) + ".w", torch::randn({10, 10}));
  st::SaveOptions opt;
  opt.max_shard_bytes = 1000;  // 400 bytes per tensor: two per shard
  const auto files = st::save_checkpoint(d.path, tensors, opt);
  EXPECT_EQ(files, (std::vector<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                             "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));
  const auto index = nlohmann::json::parse(read_bytes(d.file("model.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), 6 * 400);
  EXPECT_EQ(index["weight_map"]["layer.4.w"], "model-00003-of-00003.safetensors");

  st::Checkpoint c(d.path);
  EXPECT_EQ(c.open_files(), 0);
  EXPECT_EQ(c.names().size(), 6u);
  EXPECT_TRUE(same_bits(c.get("layer.5.w"), tensors[5].second));
  EXPECT_EQ(c.open_files(), 1);
  EXPECT_TRUE(same_bits(c.read_slice("layer.0.w", 0, 2, 5), tensors[0].second.narrow(0, 2, 3)));
  EXPECT_EQ(c.open_files(), 2);
  for (auto& [name, t] : tensors) EXPECT_TRUE(same_bits(c.get(name), t)) << name;
  EXPECT_EQ(c.metadata().at("total_size"), "2400");
  EXPECT_EQ(c.file_of("layer.2.w").metadata().at("format"), "pt");
  EXPECT_THROW(c.get("nope"), std::out_of_range);

  // Below the limit: one model.safetensors and no index, as save_pretrained does.
  TempDir one;
  EXPECT_EQ(st::save_checkpoint(one.path, tensors), (std::vector<std::string>{"model.safetensors"}));
  st::Checkpoint c1(one.path);
  for (auto& [name, t] : tensors) EXPECT_TRUE(same_bits(c1.get(name), t)) << name;
}

TEST(Safetensors, BrokenShardedCheckpointsNameTheProblem) {
  TempDir d;
  auto expect_error = [](const std::string& path, const std::string& tensor, const std::string& expect) {
    try {
      st::Checkpoint c(path);
      if (!tensor.empty()) c.get(tensor);
      ADD_FAILURE() << expect << ": accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
  };
  expect_error(d.path, "", "holds neither model.safetensors.index.json nor model.safetensors");
  write_bytes(d.file("model.safetensors.index.json"), R"({"weight_map":{"a":"gone.safetensors"}})");
  expect_error(d.path, "a", "shard 'gone.safetensors' of tensor 'a'");
  write_bytes(d.file("model.safetensors.index.json"), R"({"weight_map":{"a":"../x.safetensors"}})");
  expect_error(d.path, "", "must name a file inside");
  write_bytes(d.file("model.safetensors.index.json"), R"({"weights":{}})");
  expect_error(d.path, "", "needs an object \"weight_map\"");
  st::save_file(d.file("s.safetensors"), {{"b", torch::ones({1})}});
  write_bytes(d.file("model.safetensors.index.json"), R"({"weight_map":{"a":"s.safetensors"}})");
  expect_error(d.path, "a", "which does not hold it");
}

// Python's safetensors and huggingface_hub (in .venv-hf) write; Tandem reads and compares with
// the raw bytes Python dumped beside them. Tandem writes; Python reads and compares.
TEST(Safetensors, ExchangesFilesWithThePythonReference) {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "TANDEM_SOURCE_DIR unset (ctest sets it)";
  const std::string python = std::string(src) + "/.venv-hf/bin/python";
  ASSERT_EQ(::access(python.c_str(), X_OK), 0) << python << " missing: run scripts/setup-hf-venv.sh";
  const std::string script = std::string(src) + "/tests/hf/st_crosscheck.py";
  TempDir d;
  ASSERT_EQ(std::system((python + " " + script + " make " + d.path).c_str()), 0);

  const auto shapes = nlohmann::json::parse(read_bytes(d.file("raw/shapes.json")));
  st::File py(d.file("py.safetensors"));
  st::Checkpoint py_sharded(d.file("py_sharded"));
  EXPECT_EQ(py.metadata().at("origin"), "python");
  EXPECT_EQ(py.metadata().at("note"), "ünïcode ✓");
  EXPECT_EQ(py.names().size(), shapes.size());
  st::TensorList all;
  for (auto& [name, desc] : shapes.items()) {
    const auto raw = read_bytes(d.file("raw/" + name + ".bin"));
    for (auto t : {py.get(name), py_sharded.get(name)}) {
      EXPECT_EQ(t.sizes().vec(), desc["shape"].get<std::vector<int64_t>>()) << name;
      EXPECT_EQ(python_dtype(t.scalar_type()), desc["dtype"].get<std::string>()) << name;
      ASSERT_EQ(t.nbytes(), raw.size()) << name;
      EXPECT_EQ(std::memcmp(t.contiguous().data_ptr(), raw.data(), raw.size()), 0) << name;
    }
    all.emplace_back(name, py.get(name));
  }
  EXPECT_GE(py_sharded.open_files(), 2);

  st::save_file(d.file("cc.safetensors"), all, py.metadata());
  st::SaveOptions opt;
  opt.max_shard_bytes = 2000;
  st::save_checkpoint(d.file("cc_sharded"), all, opt);
  EXPECT_EQ(std::system((python + " " + script + " check " + d.path).c_str()), 0);
}
