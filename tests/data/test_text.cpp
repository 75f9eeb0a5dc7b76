// Byte-level text tests: a file's bytes become tokens unchanged; a directory contributes its
// files in sorted order, skipping hidden files, .dat indexes and links to files already read —
// the shape of Debian's fortunes, which is also read for real when installed.
#include <filesystem>

#include "data/text.h"
#include "tests/data/fixtures.h"

namespace loom::data::test {
namespace {

std::vector<uint16_t> tokens_of(const std::string& s) {
  std::vector<uint16_t> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

TEST(Text, FileBytesAreTokens) {
  TempDir t;
  write_text(t.file("a.txt"), "h\xc3\xa9llo\n\xff");
  EXPECT_EQ(load_text(t.file("a.txt")).tokens, (std::vector<uint16_t>{'h', 0xc3, 0xa9, 'l', 'l', 'o', '\n', 0xff}));
}

TEST(Text, DirectoryLikeFortunes) {
  TempDir t;
  write_text(t.file("zen"), "Z\n");
  write_text(t.file("art"), "A\n");
  write_text(t.file("art.dat"), "binary index");
  write_text(t.file(".hidden"), "no");
  write_text(t.file(".git/config"), "no");
  write_text(t.file("off/b"), "B\n");
  std::filesystem::create_symlink("art", t.file("art.u8"));
  EXPECT_EQ(list_text_files(t.path()), (std::vector<std::string>{t.file("art"), t.file("off/b"), t.file("zen")}));
  EXPECT_EQ(load_text(t.path()).tokens, tokens_of("A\nB\nZ\n"));
}

TEST(TextErrors, MissingPath) {
  TempDir t;
  EXPECT_LOOM_ERROR(load_text(t.file("nothing")), t.file("nothing"), "no such file or directory");
}

TEST(TextErrors, DirectoryWithoutTextFiles) {
  TempDir t;
  write_text(t.file("only.dat"), "x");
  EXPECT_LOOM_ERROR(load_text(t.path()), t.path(), "holds no text files");
}

TEST(TextErrors, EmptyFile) {
  TempDir t;
  write_text(t.file("e.txt"), "");
  EXPECT_LOOM_ERROR(load_text(t.file("e.txt")), t.file("e.txt"), "is empty");
}

TEST(Text, RealFortunesWhenInstalled) {
  if (!std::filesystem::exists(std::string(kFortunesDir) + "/fortunes"))
    GTEST_SKIP() << kFortunesDir << "/fortunes not found; apt-get install fortunes to run this test";
  const std::vector<std::string> files = list_text_files(kFortunesDir);
  for (const std::string& f : files) {
    EXPECT_NE(f.substr(f.size() - 4), ".dat") << f;
    EXPECT_NE(f.substr(f.size() - 3), ".u8") << f;  // Debian's .u8 files are links to files read already
  }
  const TokenShard shard = load_text(kFortunesDir);
  EXPECT_GT(shard.tokens.size(), 100000u);
  for (uint16_t tok : shard.tokens) ASSERT_LT(tok, kByteVocab);
}

}  // namespace
}  // namespace loom::data::test
