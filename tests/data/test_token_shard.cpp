// Token shard tests: round trip through write_token_shard, glob order, the vocabulary check,
// and every header/size failure naming the file.
#include <cstring>

#include "data/token_shard.h"
#include "tests/data/fixtures.h"

namespace loom::data::test {
namespace {

std::vector<uint8_t> shard_bytes(std::vector<int32_t> header_start, const std::vector<uint16_t>& tokens) {
  header_start.resize(kShardHeaderInts, 0);
  std::vector<uint8_t> b(kShardHeaderBytes + 2 * tokens.size());
  std::memcpy(b.data(), header_start.data(), kShardHeaderBytes);
  if (!tokens.empty()) std::memcpy(b.data() + kShardHeaderBytes, tokens.data(), 2 * tokens.size());
  return b;
}

TEST(TokenShard, RoundTrip) {
  TempDir t;
  const std::vector<uint16_t> tokens = {0, 50256, 17, 65535, 3};
  write_token_shard(t.file("s.bin"), tokens);
  EXPECT_EQ(read_bytes(t.file("s.bin")), shard_bytes({kShardMagic, 1, 5}, tokens));
  EXPECT_EQ(load_token_shard(t.file("s.bin")).tokens, tokens);
  write_token_shard(t.file("empty.bin"), {});
  EXPECT_TRUE(load_token_shard(t.file("empty.bin")).tokens.empty());
}

TEST(TokenShard, VocabCheckPassesBelowVocab) {
  TempDir t;
  write_token_shard(t.file("s.bin"), std::vector<uint16_t>{0, 50256});
  EXPECT_EQ(load_token_shard(t.file("s.bin"), 50257).tokens.size(), 2u);
}

TEST(TokenShard, GlobIsSorted) {
  TempDir t;
  for (const char* name : {"train_000002.bin", "train_000000.bin", "train_000001.bin", "val_000000.bin"})
    write_token_shard(t.file(name), std::vector<uint16_t>{1});
  EXPECT_EQ(glob_shards(t.path() + "/train_*.bin"),
            (std::vector<std::string>{t.file("train_000000.bin"), t.file("train_000001.bin"), t.file("train_000002.bin")}));
}

TEST(TokenShardErrors, MissingFile) {
  TempDir t;
  EXPECT_LOOM_ERROR(load_token_shard(t.file("none.bin")), t.file("none.bin"), "no such file");
}

TEST(TokenShardErrors, GlobMatchesNothing) {
  TempDir t;
  EXPECT_LOOM_ERROR(glob_shards(t.path() + "/*.bin"), t.path() + "/*.bin", "no files match");
}

TEST(TokenShardErrors, HeaderProblems) {
  struct Case {
    const char* name;
    std::vector<uint8_t> bytes;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"short", std::vector<uint8_t>(100), {"holds 100 bytes", "1024-byte token shard header"}},
      {"magic", shard_bytes({12345, 1, 0}, {}), {"magic is 12345", "expected 20240520"}},
      {"llama", shard_bytes({20240801, 7, 0}, {}), {"uint32 token shard", "20240801"}},
      {"version", shard_bytes({kShardMagic, 2, 0}, {}), {"version is 2", "expected 1"}},
      {"negative", shard_bytes({kShardMagic, 1, -5}, {}), {"-5 tokens"}},
      {"truncated", shard_bytes({kShardMagic, 1, 10}, {1, 2, 3}),
       {"header says 10 tokens (20 bytes) but the file holds 6 bytes after its 1024-byte header", "truncated"}},
      {"trailing", shard_bytes({kShardMagic, 1, 1}, {1, 2}), {"header says 1 tokens", "holds 4 bytes"}},
  };
  TempDir t;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    write_bytes(t.file(c.name), c.bytes);
    std::vector<std::string> parts = c.expect;
    parts.push_back(t.file(c.name));
    expect_error([&] { load_token_shard(t.file(c.name)); }, parts, __FILE__, __LINE__);
  }
}

TEST(TokenShardErrors, TokenAtOrAboveVocab) {
  TempDir t;
  write_token_shard(t.file("s.bin"), std::vector<uint16_t>{5, 50256, 50257, 9});
  EXPECT_LOOM_ERROR(load_token_shard(t.file("s.bin"), 50257), t.file("s.bin"), "token 50257 at position 2",
                    "vocab_size 50257");
}

TEST(TokenShardErrors, GzipShard) {
  TempDir t;
  write_gzip(t.file("s.bin.gz"), shard_bytes({kShardMagic, 1, 1}, {7}));
  EXPECT_LOOM_ERROR(load_token_shard(t.file("s.bin.gz")), t.file("s.bin.gz"), "gzip", "gunzip");
}

}  // namespace
}  // namespace loom::data::test
