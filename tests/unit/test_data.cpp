// Tests for tandem/data.h: IDX reading (raw and gzip, every error path), DistributedSampler
// semantics, batching helpers, and the real Fashion-MNIST files when installed.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include "tandem/data.h"
#include "temp_dir.h"

using tandem::data::DistributedSampler;

namespace {

using Bytes = std::vector<uint8_t>;

using tandem::test::TempDir;

void put_be32(Bytes& b, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
}

Bytes idx_images(uint32_t n, uint32_t h, uint32_t w, const Bytes& pixels) {
  Bytes b;
  put_be32(b, 0x00000803);
  put_be32(b, n);
  put_be32(b, h);
  put_be32(b, w);
  b.insert(b.end(), pixels.begin(), pixels.end());
  return b;
}

Bytes idx_labels(const Bytes& labels) {
  Bytes b;
  put_be32(b, 0x00000801);
  put_be32(b, static_cast<uint32_t>(labels.size()));
  b.insert(b.end(), labels.begin(), labels.end());
  return b;
}

// CRC-32 (IEEE), written out here so the gzip files below do not depend on zlib.
uint32_t crc32_ieee(const Bytes& data) {
  uint32_t crc = 0xffffffffu;
  for (uint8_t byte : data) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

// A valid gzip file made of "stored" (uncompressed) deflate blocks: built by hand, so the
// reader is tested against the format, not against the library it uses.
Bytes gzip_stored(const Bytes& data) {
  Bytes g = {0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0, 0x00, 0xff};
  size_t pos = 0;
  do {
    const size_t len = std::min<size_t>(65535, data.size() - pos);
    const bool final = pos + len == data.size();
    g.push_back(final ? 0x01 : 0x00);
    g.push_back(len & 0xff);
    g.push_back(len >> 8);
    g.push_back(~len & 0xff);
    g.push_back((~len >> 8) & 0xff);
    g.insert(g.end(), data.begin() + pos, data.begin() + pos + len);
    pos += len;
  } while (pos < data.size());
  const uint32_t crc = crc32_ieee(data), size = static_cast<uint32_t>(data.size());
  for (int s = 0; s < 32; s += 8) g.push_back((crc >> s) & 0xff);
  for (int s = 0; s < 32; s += 8) g.push_back((size >> s) & 0xff);
  return g;
}

void write_file(const std::string& path, const Bytes& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

Bytes random_bytes(size_t n, uint32_t seed, int mod = 256) {
  std::mt19937 gen(seed);
  Bytes b(n);
  for (auto& x : b) x = static_cast<uint8_t>(gen() % mod);
  return b;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}

// Checks a loaded dataset element by element against the bytes, normalized in double here.
void expect_matches(const tandem::data::Dataset& ds, uint32_t n, uint32_t h, uint32_t w, const Bytes& pixels,
                    const Bytes& labels, double mean, double std) {
  ASSERT_EQ(ds.size(), n);
  ASSERT_EQ(ds.images.sizes(), (std::vector<int64_t>{n, 1, h, w}));
  ASSERT_EQ(ds.images.scalar_type(), torch::kFloat);
  ASSERT_EQ(ds.labels.scalar_type(), torch::kLong);
  ASSERT_TRUE(ds.images.is_contiguous());
  const float* img = ds.images.data_ptr<float>();
  for (size_t i = 0; i < pixels.size(); ++i) {
    const double expected = (pixels[i] / 255.0 - mean) / std;
    ASSERT_NEAR(img[i], expected, 1e-5) << "pixel " << i;
  }
  const int64_t* lab = ds.labels.data_ptr<int64_t>();
  for (size_t i = 0; i < labels.size(); ++i) ASSERT_EQ(lab[i], labels[i]) << "label " << i;
}

}  // namespace

// ---------------------------------------------------------------- IDX reading

TEST(Idx, RawRoundTrip) {
  TempDir d;
  const uint32_t n = 7, h = 5, w = 3;
  Bytes px = random_bytes(n * h * w, 1), lb = random_bytes(n, 2, 10);
  write_file(d.file("img"), idx_images(n, h, w, px));
  write_file(d.file("lab"), idx_labels(lb));
  auto ds = tandem::data::load_idx(d.file("img"), d.file("lab"));
  expect_matches(ds, n, h, w, px, lb, 0.2860, 0.3530);
}

TEST(Idx, GzipRoundTripMultiBlockAndCustomNormalization) {
  TempDir d;
  const uint32_t n = 100, h = 28, w = 28;  // 78400 pixel bytes: two stored blocks
  Bytes px = random_bytes(n * h * w, 3), lb = random_bytes(n, 4, 10);
  write_file(d.file("img.gz"), gzip_stored(idx_images(n, h, w, px)));
  write_file(d.file("lab.gz"), gzip_stored(idx_labels(lb)));
  tandem::data::LoadOptions opt;
  opt.mean = 0.0;
  opt.std = 1.0;
  auto ds = tandem::data::load_idx(d.file("img.gz"), d.file("lab.gz"), opt);
  expect_matches(ds, n, h, w, px, lb, 0.0, 1.0);
  // Mixed: gzip images with raw labels, default normalization.
  write_file(d.file("lab"), idx_labels(lb));
  auto ds2 = tandem::data::load_idx(d.file("img.gz"), d.file("lab"));
  expect_matches(ds2, n, h, w, px, lb, 0.2860, 0.3530);
}

TEST(Idx, MissingFileNamesPathAndPackage) {
  TempDir d;
  write_file(d.file("lab"), idx_labels({1, 2}));
  const std::string missing = d.file("does-not-exist-idx3-ubyte");
  auto msg = error_of([&] { tandem::data::load_idx(missing, d.file("lab")); });
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  EXPECT_NE(msg.find("apt-get install dataset-fashion-mnist"), std::string::npos) << msg;
}

TEST(Idx, WrongMagicAndSwappedFiles) {
  TempDir d;
  Bytes bad = idx_images(2, 2, 2, Bytes(8, 0));
  bad[2] = 0x0d;  // float instead of ubyte
  write_file(d.file("bad"), bad);
  write_file(d.file("img"), idx_images(2, 2, 2, Bytes(8, 0)));
  write_file(d.file("lab"), idx_labels({1, 2}));
  auto msg = error_of([&] { tandem::data::load_idx(d.file("bad"), d.file("lab")); });
  EXPECT_NE(msg.find(d.file("bad")), std::string::npos) << msg;
  EXPECT_NE(msg.find("magic"), std::string::npos) << msg;
  msg = error_of([&] { tandem::data::load_idx(d.file("lab"), d.file("img")); });
  EXPECT_NE(msg.find("swapped"), std::string::npos) << msg;
  // A non-IDX, non-gzip text file.
  write_file(d.file("text"), Bytes{'h', 'e', 'l', 'l', 'o', '\n'});
  msg = error_of([&] { tandem::data::load_idx(d.file("img"), d.file("text")); });
  EXPECT_NE(msg.find(d.file("text")), std::string::npos) << msg;
  EXPECT_NE(msg.find("magic"), std::string::npos) << msg;
}

TEST(Idx, TruncatedRawGzipAndHeader) {
  TempDir d;
  Bytes img = idx_images(3, 4, 4, random_bytes(48, 5));
  write_file(d.file("lab"), idx_labels({0, 1, 2}));
  // Data cut short.
  write_file(d.file("short"), Bytes(img.begin(), img.end() - 1));
  auto msg = error_of([&] { tandem::data::load_idx(d.file("short"), d.file("lab")); });
  EXPECT_NE(msg.find(d.file("short")), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  // Header cut short.
  write_file(d.file("hdr"), Bytes(img.begin(), img.begin() + 10));
  msg = error_of([&] { tandem::data::load_idx(d.file("hdr"), d.file("lab")); });
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  // Empty file.
  write_file(d.file("empty"), Bytes{});
  msg = error_of([&] { tandem::data::load_idx(d.file("empty"), d.file("lab")); });
  EXPECT_NE(msg.find(d.file("empty")), std::string::npos) << msg;
  // Gzip stream cut in the middle.
  Bytes gz = gzip_stored(img);
  write_file(d.file("cut.gz"), Bytes(gz.begin(), gz.begin() + gz.size() / 2));
  msg = error_of([&] { tandem::data::load_idx(d.file("cut.gz"), d.file("lab")); });
  EXPECT_NE(msg.find(d.file("cut.gz")), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  // Complete gzip stream whose content is truncated IDX.
  write_file(d.file("short.gz"), gzip_stored(Bytes(img.begin(), img.end() - 5)));
  msg = error_of([&] { tandem::data::load_idx(d.file("short.gz"), d.file("lab")); });
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  // Corrupt gzip (bad CRC).
  Bytes corrupt = gz;
  corrupt[corrupt.size() - 6] ^= 0xff;
  write_file(d.file("crc.gz"), corrupt);
  msg = error_of([&] { tandem::data::load_idx(d.file("crc.gz"), d.file("lab")); });
  EXPECT_NE(msg.find(d.file("crc.gz")), std::string::npos) << msg;
  // Extra bytes after the data.
  Bytes longer = img;
  longer.push_back(7);
  write_file(d.file("long"), longer);
  msg = error_of([&] { tandem::data::load_idx(d.file("long"), d.file("lab")); });
  EXPECT_NE(msg.find(d.file("long")), std::string::npos) << msg;
}

TEST(Idx, CountMismatchAndLabelRange) {
  TempDir d;
  write_file(d.file("img"), idx_images(3, 2, 2, Bytes(12, 9)));
  write_file(d.file("lab2"), idx_labels({0, 1}));
  write_file(d.file("lab_bad"), idx_labels({0, 10, 3}));
  auto msg = error_of([&] { tandem::data::load_idx(d.file("img"), d.file("lab2")); });
  EXPECT_NE(msg.find("mismatch"), std::string::npos) << msg;
  EXPECT_NE(msg.find(d.file("img")), std::string::npos) << msg;
  EXPECT_NE(msg.find(d.file("lab2")), std::string::npos) << msg;
  msg = error_of([&] { tandem::data::load_idx(d.file("img"), d.file("lab_bad")); });
  EXPECT_NE(msg.find(d.file("lab_bad")), std::string::npos) << msg;
  EXPECT_NE(msg.find("label 10 at index 1"), std::string::npos) << msg;
  // num_classes = 0 accepts any label; a larger num_classes accepts 10.
  tandem::data::LoadOptions any;
  any.num_classes = 0;
  EXPECT_EQ(tandem::data::load_idx(d.file("img"), d.file("lab_bad"), any).labels[1].item<int64_t>(), 10);
  tandem::data::LoadOptions bad_std;
  bad_std.std = 0.0;
  EXPECT_THROW(tandem::data::load_idx(d.file("img"), d.file("lab_bad"), bad_std), std::invalid_argument);
}

TEST(Idx, FashionMnistLayoutAcceptsRawNamesAndReportsMissing) {
  TempDir d;
  Bytes px = random_bytes(2 * 28 * 28, 6), lb = {3, 9};
  write_file(d.file("t10k-images-idx3-ubyte"), idx_images(2, 28, 28, px));
  write_file(d.file("t10k-labels-idx1-ubyte.gz"), gzip_stored(idx_labels(lb)));
  auto ds = tandem::data::load_fashion_mnist(d.path, /*train=*/false);
  expect_matches(ds, 2, 28, 28, px, lb, 0.2860, 0.3530);
  auto msg = error_of([&] { tandem::data::load_fashion_mnist(d.path, /*train=*/true); });
  EXPECT_NE(msg.find("train-images-idx3-ubyte"), std::string::npos) << msg;
  EXPECT_NE(msg.find(d.path), std::string::npos) << msg;
  EXPECT_NE(msg.find("dataset-fashion-mnist"), std::string::npos) << msg;
}

TEST(FashionMnist, RealFilesLoadWithExpectedStatistics) {
  struct stat st {};
  ASSERT_EQ(::stat(tandem::data::kFashionMnistDir, &st), 0)
      << tandem::data::kFashionMnistDir << " missing (apt-get install dataset-fashion-mnist; scripts/setup.sh does)";
  auto train = tandem::data::load_fashion_mnist();
  auto test = tandem::data::load_fashion_mnist(tandem::data::kFashionMnistDir, false);
  ASSERT_EQ(train.size(), 60000);
  ASSERT_EQ(test.size(), 10000);
  EXPECT_EQ(train.images.sizes(), (std::vector<int64_t>{60000, 1, 28, 28}));
  EXPECT_EQ(test.images.sizes(), (std::vector<int64_t>{10000, 1, 28, 28}));
  // Fashion-MNIST is balanced: 6000 / 1000 images per class, 10 classes.
  auto tc = torch::bincount(train.labels), ec = torch::bincount(test.labels);
  ASSERT_EQ(tc.numel(), 10);
  ASSERT_EQ(ec.numel(), 10);
  EXPECT_TRUE(torch::all(tc == 6000).item<bool>()) << tc;
  EXPECT_TRUE(torch::all(ec == 1000).item<bool>()) << ec;
  // The default normalization uses the training set's own statistics.
  auto x = train.images.to(torch::kDouble);
  EXPECT_NEAR(x.mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(x.std().item<double>(), 1.0, 0.01);
  EXPECT_NEAR(x.min().item<double>(), (0.0 - 0.2860) / 0.3530, 1e-5);
  EXPECT_NEAR(x.max().item<double>(), (1.0 - 0.2860) / 0.3530, 1e-5);
}

// ---------------------------------------------------------------- sampler

TEST(Permutation, IsAPermutationGoldenAndUniform) {
  for (int64_t n : {0, 1, 2, 17, 1000}) {
    auto p = tandem::data::permutation(n, 123);
    std::vector<int64_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i);
  }
  // The order must be the same on every machine. Reference computed by an independent Python
  // implementation of MT19937-64 (checked against the standard's 10000th-output value) with
  // the same Fisher-Yates + rejection draw: for i = n-1..1, j = r % (i+1) for the first
  // 64-bit output r >= 2^64 mod (i+1), swap p[i], p[j].
  EXPECT_EQ(tandem::data::permutation(10, 42), (std::vector<int64_t>{1, 7, 9, 0, 3, 8, 4, 2, 5, 6}));
  // Each of the 6 orders of 3 elements appears about 1/6 of the time over 6000 seeds.
  std::map<std::vector<int64_t>, int> counts;
  for (uint64_t s = 0; s < 6000; ++s) counts[tandem::data::permutation(3, s)]++;
  ASSERT_EQ(counts.size(), 6u);
  for (auto& [perm, c] : counts) EXPECT_NEAR(c, 1000, 150);
}

TEST(DistributedSampler, CoversDatasetWithEqualCountsAndPyTorchPadding) {
  for (int w : {1, 2, 3, 4, 5, 7}) {
    for (int64_t n : {1, 2, 10, 17, 101, 1000}) {
      std::map<int64_t, int> seen;
      const int64_t per_rank = (n + w - 1) / w;
      for (int r = 0; r < w; ++r) {
        DistributedSampler s(n, r, w, true, 5);
        s.set_epoch(2);
        auto idx = s.indices();
        ASSERT_EQ(static_cast<int64_t>(idx.size()), per_rank) << "n=" << n << " w=" << w;
        ASSERT_EQ(s.num_samples(), per_rank);
        for (auto i : idx) {
          ASSERT_GE(i, 0);
          ASSERT_LT(i, n);
          seen[i]++;
        }
      }
      // Every sample is used; the only repeats are the padding, which is the start of the
      // epoch's order (PyTorch: indices += indices[:padding]).
      ASSERT_EQ(static_cast<int64_t>(seen.size()), n) << "n=" << n << " w=" << w;
      const int64_t total = per_rank * w;
      auto order = tandem::data::permutation(n, 5 + 2);
      std::map<int64_t, int> expected;
      for (int64_t k = 0; k < total; ++k) expected[order[k % n]]++;
      ASSERT_EQ(seen, expected) << "n=" << n << " w=" << w;
      if (n % w == 0) {
        for (auto& [i, c] : seen) ASSERT_EQ(c, 1);
      }
    }
  }
}

TEST(DistributedSampler, DropLastIsDisjointAndTruncates) {
  for (int w : {1, 2, 3, 4, 7}) {
    for (int64_t n : {7, 10, 17, 101}) {
      std::set<int64_t> seen;
      for (int r = 0; r < w; ++r) {
        DistributedSampler s(n, r, w, true, 9, /*drop_last=*/true);
        auto idx = s.indices();
        ASSERT_EQ(static_cast<int64_t>(idx.size()), n / w);
        for (auto i : idx) ASSERT_TRUE(seen.insert(i).second) << "duplicate " << i;
      }
      ASSERT_EQ(static_cast<int64_t>(seen.size()), (n / w) * w);
    }
  }
}

TEST(DistributedSampler, IndicesFromContinuesTheEpochAtAnyLayout) {
  const int64_t n = 101;
  const auto order = tandem::data::permutation(n, 3 + 1);
  // Same layout: the rest of indices() after the batches already taken.
  for (int r = 0; r < 2; ++r) {
    DistributedSampler s(n, r, 2, true, 3);
    s.set_epoch(1);
    auto all = s.indices();
    EXPECT_EQ(s.indices_from(3 * 8), std::vector<int64_t>(all.begin() + 12, all.end())) << "rank " << r;
    EXPECT_EQ(s.indices_from(0), all);
  }
  // 25 samples taken (not a multiple of the new world size), then 3 ranks with 2 samples each:
  // step k's global batch is the order's positions [25 + 6k, 31 + 6k), padded from its start.
  std::vector<std::vector<int64_t>> per_rank;
  for (int r = 0; r < 3; ++r) {
    DistributedSampler s(n, r, 3, true, 3);
    s.set_epoch(1);
    per_rank.push_back(s.indices_from(25));
    ASSERT_EQ(per_rank.back().size(), 26u);  // ceil(76 / 3)
  }
  for (size_t k = 0; k * 2 < per_rank[0].size(); ++k) {
    std::multiset<int64_t> got, want;
    for (auto& idx : per_rank) got.insert(idx.begin() + 2 * k, idx.begin() + std::min(idx.size(), 2 * k + 2));
    for (int64_t p = 25 + 6 * k; p < 25 + 6 * static_cast<int64_t>(k) + 6; ++p) want.insert(order[p % n]);
    EXPECT_EQ(got, want) << "step " << k;
  }
  DistributedSampler done(n, 0, 3, true, 3);
  EXPECT_TRUE(done.indices_from(n).empty());
  EXPECT_THROW(done.indices_from(-1), std::invalid_argument);
}

TEST(DistributedSampler, UnshuffledMatchesPyTorchExactly) {
  // torch.utils.data.DistributedSampler(range(10), num_replicas=4, rank=r, shuffle=False):
  std::vector<std::vector<int64_t>> pad = {{0, 4, 8}, {1, 5, 9}, {2, 6, 0}, {3, 7, 1}};
  std::vector<std::vector<int64_t>> drop = {{0, 4}, {1, 5}, {2, 6}, {3, 7}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(DistributedSampler(10, r, 4, false).indices(), pad[r]);
    EXPECT_EQ(DistributedSampler(10, r, 4, false, 0, true).indices(), drop[r]);
  }
  // Dataset smaller than the world: padding repeats the dataset (range(2), 5 replicas).
  std::vector<int64_t> small;
  for (int r = 0; r < 5; ++r) small.push_back(DistributedSampler(2, r, 5, false).indices().at(0));
  EXPECT_EQ(small, (std::vector<int64_t>{0, 1, 0, 1, 0}));
}

TEST(DistributedSampler, DeterministicPerEpochAndSeed) {
  DistributedSampler a(1000, 1, 3, true, 17), b(1000, 1, 3, true, 17), c(1000, 1, 3, true, 18);
  EXPECT_EQ(a.indices(), b.indices());
  EXPECT_NE(a.indices(), c.indices());
  auto e0 = a.indices();
  a.set_epoch(1);
  EXPECT_EQ(a.epoch(), 1);
  auto e1 = a.indices();
  EXPECT_NE(e0, e1);
  b.set_epoch(1);
  EXPECT_EQ(e1, b.indices());
  a.set_epoch(0);
  EXPECT_EQ(a.indices(), e0);
  // Shuffled order is not the identity.
  std::vector<int64_t> identity;
  for (int64_t i = 1; i < 1000; i += 3) identity.push_back(i);
  EXPECT_NE(e0, identity);
}

TEST(DistributedSampler, GlobalBatchIsTheSameSetAsSingleWorkerBatch) {
  const int64_t n = 103, b = 4;
  for (int w : {2, 3, 4}) {
    DistributedSampler single(n, 0, 1, true, 7);
    single.set_epoch(3);
    auto global = tandem::data::batches(single.indices(), w * b, false);
    std::vector<std::vector<std::vector<int64_t>>> per_rank;
    for (int r = 0; r < w; ++r) {
      DistributedSampler s(n, r, w, true, 7);
      s.set_epoch(3);
      per_rank.push_back(tandem::data::batches(s.indices(), b, false));
    }
    int64_t checked = 0;
    for (size_t step = 0; (step + 1) * w * b <= static_cast<size_t>(n); ++step) {
      std::multiset<int64_t> u;
      for (int r = 0; r < w; ++r) u.insert(per_rank[r][step].begin(), per_rank[r][step].end());
      std::multiset<int64_t> g(global[step].begin(), global[step].end());
      ASSERT_EQ(u, g) << "w=" << w << " step=" << step;
      ++checked;
    }
    EXPECT_EQ(checked, n / (w * b));
  }
}

TEST(DistributedSampler, RejectsBadArguments) {
  EXPECT_THROW(DistributedSampler(10, 0, 0), std::invalid_argument);
  EXPECT_THROW(DistributedSampler(10, -1, 2), std::invalid_argument);
  EXPECT_THROW(DistributedSampler(10, 2, 2), std::invalid_argument);
  EXPECT_THROW(DistributedSampler(-1, 0, 2), std::invalid_argument);
  auto msg = error_of([] { DistributedSampler(3, 0, 4, true, 0, /*drop_last=*/true); });
  EXPECT_NE(msg.find("smaller than the world size"), std::string::npos) << msg;
  EXPECT_NO_THROW(DistributedSampler(3, 3, 4, true, 0, false));
  EXPECT_EQ(DistributedSampler(0, 0, 2).indices().size(), 0u);
}

// ---------------------------------------------------------------- batching

TEST(Batches, ChunksAndDropsLast) {
  std::vector<int64_t> idx = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0};
  auto b = tandem::data::batches(idx, 3, false);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0], (std::vector<int64_t>{9, 8, 7}));
  EXPECT_EQ(b[3], (std::vector<int64_t>{0}));
  auto d = tandem::data::batches(idx, 3, true);
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[2], (std::vector<int64_t>{3, 2, 1}));
  EXPECT_EQ(tandem::data::batches(idx, 10, true).size(), 1u);
  EXPECT_EQ(tandem::data::batches(idx, 11, true).size(), 0u);
  EXPECT_THROW(tandem::data::batches(idx, 0, false), std::invalid_argument);
}

TEST(Batches, GatherBatchSelectsRows) {
  tandem::data::Dataset ds;
  ds.images = torch::arange(5 * 4, torch::kFloat).view({5, 1, 2, 2});
  ds.labels = torch::tensor({10, 11, 12, 13, 14}, torch::kLong);
  auto [x, y] = tandem::data::gather_batch(ds, {3, 1, 3});
  ASSERT_EQ(x.sizes(), (std::vector<int64_t>{3, 1, 2, 2}));
  EXPECT_EQ(x[0][0][0][0].item<float>(), 12.0f);
  EXPECT_EQ(x[1][0][1][1].item<float>(), 7.0f);
  EXPECT_EQ(x[2][0][0][1].item<float>(), 13.0f);
  EXPECT_TRUE(torch::equal(y, torch::tensor({13, 11, 13}, torch::kLong)));
  auto msg = error_of([&] { tandem::data::gather_batch(ds, {0, 5}); });
  EXPECT_NE(msg.find("index 5"), std::string::npos) << msg;
  EXPECT_THROW(tandem::data::gather_batch(ds, {-1}), std::out_of_range);
}
