// A seeded mutation loop over every reader: a valid file of each format is damaged in many
// ways (bits flipped, bytes overwritten with boundary values, cut short, grown, header words
// replaced by huge or negative counts) and read back. Each read must either succeed or
// throw loom::Error; any other exception, a crash, or (under -Db_sanitize=address,undefined)
// a memory error fails the suite. The seed is fixed, so a failure is reproduced by the case
// number in the trace; files that once failed belong in the readers' own tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <typeinfo>
#include <vector>

#include "data/cifar.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "data/token_shard.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "tests/data/fixtures.h"

namespace loom::data::test {
namespace {

constexpr int kMutationsPerFormat = 300;

// One damaged copy of `bytes`, chosen by `rng`.
std::vector<uint8_t> mutate(std::vector<uint8_t> bytes, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return n == 0 ? size_t(0) : size_t(rng() % n); };
  const int edits = 1 + int(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 6) {
      case 0:  // flip one bit
        if (!bytes.empty()) bytes[pick(bytes.size())] ^= uint8_t(1u << (rng() % 8));
        break;
      case 1: {  // a boundary value over one byte
        static constexpr uint8_t kValues[] = {0x00, 0x01, 0x7f, 0x80, 0xff};
        if (!bytes.empty()) bytes[pick(bytes.size())] = kValues[rng() % 5];
        break;
      }
      case 2:  // cut short
        bytes.resize(pick(bytes.size() + 1));
        break;
      case 3:  // grow by junk
        for (size_t n = 1 + pick(64); n > 0; --n) bytes.push_back(uint8_t(rng()));
        break;
      case 4: {  // a 4-byte word in the first 64 bytes (where headers live) made huge or negative
        static constexpr uint32_t kWords[] = {0xffffffffu, 0x80000000u, 0x7fffffffu, 0, 1, 0x10000000u};
        if (bytes.size() >= 4) {
          const size_t at = pick(std::min<size_t>(bytes.size() - 3, 64));
          const uint32_t w = kWords[rng() % 6];
          for (int i = 0; i < 4; ++i) bytes[at + size_t(i)] = uint8_t(w >> (8 * (rng() % 2 ? i : 3 - i)));
        }
        break;
      }
      default: {  // one run of bytes copied over another place
        if (bytes.size() >= 2) {
          const size_t from = pick(bytes.size()), to = pick(bytes.size());
          const size_t n = std::min({pick(32) + 1, bytes.size() - from, bytes.size() - to});
          std::copy_n(bytes.begin() + int64_t(from), n, bytes.begin() + int64_t(to));
        }
        break;
      }
    }
  }
  return bytes;
}

// Reads `valid` damaged kMutationsPerFormat times through `read`; returns the reads that
// succeeded (the rest threw loom::Error, as they may).
int fuzz(const std::string& name, const std::vector<uint8_t>& valid, const std::function<void(const std::string&)>& read,
         uint64_t seed) {
  TempDir t;
  const std::string path = t.file(name);
  write_bytes(path, valid);
  read(path);  // the valid file reads
  std::mt19937_64 rng(seed);
  int succeeded = 0;
  for (int i = 0; i < kMutationsPerFormat; ++i) {
    SCOPED_TRACE(name + " mutation " + std::to_string(i) + " (seed " + std::to_string(seed) + ")");
    write_bytes(path, mutate(valid, rng));
    try {
      read(path);
      ++succeeded;
    } catch (const Error&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw " << typeid(e).name() << " instead of loom::Error: " << e.what();
    }
  }
  return succeeded;
}

TEST(ReaderMutations, IdxPlainAndGzip) {
  const std::vector<uint8_t> plain = idx_bytes({6, 5, 4}, pattern(120));
  fuzz("images-idx3-ubyte", plain, [](const std::string& p) { load_idx_images(p); }, 1);
  fuzz("labels-idx1-ubyte", idx_bytes({7}, pattern(7)), [](const std::string& p) { load_idx_labels(p); }, 2);
  TempDir t;
  write_gzip(t.file("g.gz"), plain);
  fuzz("images-idx3-ubyte.gz", read_bytes(t.file("g.gz")), [](const std::string& p) { load_idx(p); }, 3);
}

TEST(ReaderMutations, CifarBatch) {
  std::vector<uint8_t> records;
  for (int r = 0; r < 3; ++r) {
    records.push_back(uint8_t(r));      // coarse label
    records.push_back(uint8_t(r * 7));  // fine label
    const std::vector<uint8_t> pixels = pattern(3 * 32 * 32, 5 + r, r);
    records.insert(records.end(), pixels.begin(), pixels.end());
  }
  fuzz("train.bin", records, [](const std::string& p) { load_cifar100_file(p); }, 4);
}

TEST(ReaderMutations, TokenShard) {
  std::vector<uint16_t> tokens;
  for (int i = 0; i < 50; ++i) tokens.push_back(uint16_t(i * 31 % 256));
  TempDir t;
  write_token_shard(t.file("s.bin"), tokens);
  fuzz("shard.bin", read_bytes(t.file("s.bin")), [](const std::string& p) { load_token_shard(p, 256); }, 5);
}

TEST(ReaderMutations, SafetensorsCheckpoint) {
  TempDir t;
  save_safetensors(t.file("ck.safetensors"),
                   {{"w", ones({3, 4})}, {"b", zeros({4}, DType::bf16)}, {"n", from_vector(std::vector<int64_t>{1, 2}, {2})}},
                   {{"format", "loom-training-checkpoint"}, {"user.epoch", "3"}});
  fuzz("ck.safetensors", read_bytes(t.file("ck.safetensors")), [](const std::string& p) { load_safetensors(p); }, 6);
  fuzz("meta.safetensors", read_bytes(t.file("ck.safetensors")),
       [](const std::string& p) { load_safetensors_metadata(p); }, 7);
}

TEST(ReaderMutations, ImageFolderPng) {
  if (!kCanWriteImages) GTEST_SKIP() << "built without stb_image_write";
  TempDir t;
  ASSERT_TRUE(write_image(t.file("one.png"), 6, 5, 3, pattern(6 * 5 * 3)));
  const std::vector<uint8_t> png = read_bytes(t.file("one.png"));
  fuzz("root/cls/a.png", png, [&](const std::string& p) {
    load_image_folder(p.substr(0, p.rfind("/cls/")));
  }, 8);
}

}  // namespace
}  // namespace loom::data::test
