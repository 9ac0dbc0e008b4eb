// The consumer trusts nothing unverified: gaps, overlaps, wrong fingerprint, wrong shapes,
// a manifest that disagrees; and the assembled rows land where their tags say.
#include "bridge/assembler.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace hetero {

uint16_t tag(int64_t l, int a, int64_t h, int64_t t, int64_t d);
Segment make_segment(int64_t seq, int64_t pos0, int64_t n, int64_t layers, int64_t kvh, int64_t hd,
                     const std::string& fp);

namespace {
DecoderCacheLayout layout() {
  DecoderCacheLayout l;
  l.family = "llama", l.fingerprint = "fp", l.layers = 2, l.kv_heads = 2, l.head_dim = 4,
  l.hidden = 8;
  return l;
}
}  // namespace

TEST(Assembler, UnevenSegmentsAssembleInPlace) {
  CacheAssembler a(layout(), 10);
  ASSERT_TRUE(a.accept(make_segment(0, 0, 3, 2, 2, 4, "fp")).is_ok());
  ASSERT_TRUE(a.accept(make_segment(1, 3, 6, 2, 2, 4, "fp")).is_ok());
  ASSERT_TRUE(a.accept(make_segment(2, 9, 1, 2, 2, 4, "fp")).is_ok());
  ASSERT_TRUE(a.finish({"fp", 10, 10, 3, true, ""}).is_ok());
  TensorMap m = a.arrays(9).value();
  for (int64_t l = 0; l < 2; ++l)
    for (int k = 0; k < 2; ++k) {
      const Tensor& t = m.at("layers." + std::to_string(l) + (k ? ".values" : ".keys"));
      ASSERT_EQ(t.shape, (std::vector<int64_t>{2, 9, 4}));
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < 9; ++i)
          for (int64_t d = 0; d < 4; ++d)
            ASSERT_EQ(t.data<uint16_t>()[(h * 9 + i) * 4 + d], tag(l, k, h, i, d));
    }
}

TEST(Assembler, RefusesWhatDoesNotFit) {
  {
    CacheAssembler a(layout(), 10);
    EXPECT_EQ(a.accept(make_segment(0, 0, 3, 2, 2, 4, "other")).code(), Code::kFailedPrecondition);
  }
  {
    CacheAssembler a(layout(), 10);
    ASSERT_TRUE(a.accept(make_segment(0, 0, 3, 2, 2, 4, "fp")).is_ok());
    Status gap = a.accept(make_segment(1, 4, 3, 2, 2, 4, "fp"));
    EXPECT_EQ(gap.code(), Code::kDataLoss);
    EXPECT_NE(gap.message().find("gap"), std::string::npos);
    EXPECT_EQ(a.covered_tokens(), 3);  // nothing appended
  }
  {
    CacheAssembler a(layout(), 4);
    EXPECT_FALSE(a.accept(make_segment(0, 0, 5, 2, 2, 4, "fp")).is_ok());  // beyond T
  }
  {
    CacheAssembler a(layout(), 10);
    EXPECT_FALSE(a.accept(make_segment(0, 0, 3, 1, 2, 4, "fp")).is_ok());  // missing layer
    EXPECT_FALSE(a.accept(make_segment(0, 0, 3, 2, 1, 4, "fp")).is_ok());  // wrong kv heads
  }
  {
    CacheAssembler a(layout(), 10);
    ASSERT_TRUE(a.accept(make_segment(0, 0, 3, 2, 2, 4, "fp")).is_ok());
    EXPECT_FALSE(a.finish({"fp", 10, 10, 1, true, ""}).is_ok());        // claims rows not received
    EXPECT_FALSE(a.finish({"fp", 10, 3, 1, false, "killed"}).is_ok());  // incomplete
  }
}

TEST(Assembler, StoreEntryIsComplete) {
  CacheAssembler a(layout(), 5);
  ASSERT_TRUE(a.accept(make_segment(0, 0, 5, 2, 2, 4, "fp")).is_ok());
  const auto dir =
      std::filesystem::temp_directory_path() / ("hetero_store_" + std::to_string(::getpid()));
  std::vector<int32_t> ids = {5, 6, 7, 8, 9, 10};
  auto e = write_store_entry(dir.string(), layout(), ids, 5, 5, a.arrays(5).value());
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  std::ifstream in(std::filesystem::path(e->path) / "entry.json");
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["B"], 5);
  EXPECT_EQ(j["ids"].size(), 5u);
  EXPECT_EQ(j["fingerprint"], "fp");
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(e->path) / "cache.safetensors"));
  std::filesystem::remove_all(dir);
}

TEST(Assembler, AFailedStoreWriteLeavesNothingBehind) {
  // Regression (hardening issue): a full disk left "<entry>.partial" directories behind.
  CacheAssembler a(layout(), 5);
  ASSERT_TRUE(a.accept(make_segment(0, 0, 5, 2, 2, 4, "fp")).is_ok());
  const auto dir =
      std::filesystem::temp_directory_path() / ("hetero_store_full_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  // A file-size limit makes the cache file's write fail as a full disk would.
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* previous = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = 64;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  auto e =
      write_store_entry(dir.string(), layout(), {5, 6, 7, 8, 9, 10}, 5, 5, a.arrays(5).value());
  setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous);
  EXPECT_FALSE(e.is_ok());
  int64_t left = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir))
    left += f.is_directory() ? 0 : 1;
  EXPECT_EQ(left, 0) << "files left in " << dir;
  std::filesystem::remove_all(dir);
}

// Rows streamed into the store as they verify give the same entry, byte for byte in its arrays,
// as the in-memory assembler's, for the whole request and for a shorter verified prefix (the
// file shortened in place); an assembler that never publishes leaves nothing in the store.
TEST(Assembler, RowsWrittenIntoTheStoreGiveTheSameEntry) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("hetero_stream_" + std::to_string(::getpid()));
  const std::vector<int32_t> ids = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t b : {10, 9, 4, 1}) {
    SCOPED_TRACE("B = " + std::to_string(b));
    CacheAssembler memory(layout(), 10), streamed(layout(), 10, dir.string());
    for (CacheAssembler* a : {&memory, &streamed}) {
      ASSERT_TRUE(a->accept(make_segment(0, 0, 3, 2, 2, 4, "fp")).is_ok());
      ASSERT_TRUE(a->accept(make_segment(1, 3, 6, 2, 2, 4, "fp")).is_ok());
      ASSERT_TRUE(a->accept(make_segment(2, 9, 1, 2, 2, 4, "fp")).is_ok());
    }
    EXPECT_TRUE(fs::exists(dir / "fp"));
    const TensorMap want = memory.arrays(b).value();
    const TensorMap read_back = streamed.arrays(b).value();
    for (const auto& [name, t] : want) EXPECT_EQ(read_back.at(name).bytes, t.bytes) << name;
    auto e = streamed.store(dir.string(), layout(), ids, b, 10);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    auto got = read_safetensors((fs::path(e->path) / "cache.safetensors").string());
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    const TensorMap& arrays = got->tensors;
    ASSERT_EQ(arrays.size(), want.size());
    for (const auto& [name, t] : want) {
      ASSERT_TRUE(arrays.count(name)) << name;
      EXPECT_EQ(arrays.at(name).shape, t.shape) << name;
      EXPECT_EQ(arrays.at(name).bytes, t.bytes) << name;
    }
    std::ifstream in(fs::path(e->path) / "entry.json");
    EXPECT_EQ(nlohmann::json::parse(in)["B"], b);
    EXPECT_EQ(e->bytes,
              static_cast<int64_t>(fs::file_size(fs::path(e->path) / "cache.safetensors")));
  }
  {
    CacheAssembler abandoned(layout(), 10, dir.string());
    ASSERT_TRUE(abandoned.accept(make_segment(0, 0, 3, 2, 2, 4, "fp")).is_ok());
  }
  for (const auto& f : fs::directory_iterator(dir / "fp"))
    EXPECT_FALSE(f.path().filename().string().ends_with(kPartialSuffix)) << f.path();
  fs::remove_all(dir);
}

TEST(Assembler, PartialEntriesLeftByACrashAreRemovedAndNothingElse) {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("hetero_store_sweep_" + std::to_string(::getpid()));
  for (const char* d : {"fpA/abc.partial", "fpA/abc", "fpB/def.partial", "fpB/ghi"})
    fs::create_directories(dir / d / "inner");
  std::ofstream(dir / "fpA" / "abc.partial" / "cache.safetensors") << "half";
  std::ofstream(dir / "stray.partial") << "a file at the top is not an entry";
  EXPECT_EQ(remove_partial_store_entries(dir.string()), 2);
  EXPECT_FALSE(fs::exists(dir / "fpA" / "abc.partial"));
  EXPECT_FALSE(fs::exists(dir / "fpB" / "def.partial"));
  EXPECT_TRUE(fs::exists(dir / "fpA" / "abc" / "inner") && fs::exists(dir / "fpB" / "ghi"));
  EXPECT_TRUE(fs::exists(dir / "stray.partial"));
  EXPECT_EQ(remove_partial_store_entries((dir / "absent").string()), 0);
  fs::remove_all(dir);
}

}  // namespace hetero

#include "decode/prefill_client.h"

namespace hetero {
namespace {

TEST(StreamReceiver, AFrameLargerThanTheRequestCouldNeedIsRefusedBeforeBuffering) {
  // Regression (hardening issue, found by fuzz/wire_fuzz.cc): the receiver reserved whatever
  // a frame's prefix declared, up to 8 GiB, before any of it arrived.
  CacheAssembler assembler(layout(), 10);
  EXPECT_EQ(assembler.max_segment_bytes(), 2 * 2 * 2 * 10 * 4 * 2);
  StreamReceiver receiver(&assembler);
  std::string prefix = "HSG2";
  const uint32_t header_bytes = 2;
  const uint64_t payload_bytes = uint64_t{1} << 30;
  prefix.append(reinterpret_cast<const char*>(&header_bytes), 4);
  prefix.append(reinterpret_cast<const char*>(&payload_bytes), 8);
  EXPECT_FALSE(receiver.feed(prefix.data(), prefix.size()));
  EXPECT_EQ(receiver.status().code(), Code::kDataLoss);
  EXPECT_NE(receiver.status().message().find("exceeds the limit"), std::string::npos)
      << receiver.status().message();
}

}  // namespace
}  // namespace hetero
