// Token shard reader and writer. The header is read on its own and checked (magic, version,
// ntok against the file size) before the token buffer is allocated; the format is little-endian,
// which Loom's hosts (x86-64, AArch64) are, and the static_assert says so where it matters.
#include "data/token_shard.h"

#include <glob.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "data/file_io.h"
#include "kernels/core/error.h"

namespace loom::data {

static_assert(std::endian::native == std::endian::little,
              "token shards are little-endian; this host needs a byte swap in token_shard.cpp");

namespace {

// llm.c's uint32 variant for larger vocabularies (Llama 3): named in the error so the cause is plain.
constexpr int32_t kLlama3ShardMagic = 20240801;

int32_t le32(const uint8_t* p) {
  return static_cast<int32_t>(uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24));
}

}  // namespace

TokenShard load_token_shard(const std::string& path, int64_t vocab_size) {
  InputFile in(path);
  LOOM_CHECK(!in.is_gzip(), path, ": is gzip-compressed; token shards are read uncompressed "
             "(gunzip it first)");
  const uint64_t size = in.file_bytes();
  LOOM_CHECK(size >= kShardHeaderBytes, path, ": holds ", size, " bytes, less than the ",
             kShardHeaderBytes, "-byte token shard header: truncated, or not a token shard?");
  uint8_t header[kShardHeaderBytes];
  in.read(header, sizeof header, "the token shard header");
  const int32_t magic = le32(header), version = le32(header + 4), ntok = le32(header + 8);
  LOOM_CHECK(magic != kLlama3ShardMagic, path, ": is an llm.c uint32 token shard (magic ",
             kLlama3ShardMagic, ", Llama 3 tokens); Loom reads the uint16 format (magic ", kShardMagic, ")");
  LOOM_CHECK(magic == kShardMagic, path, ": magic is ", magic, " (bytes ", hex_bytes(header, 4),
             "), expected ", kShardMagic, ": not an llm.c/nanoGPT uint16 token shard");
  LOOM_CHECK(version == kShardVersion, path, ": token shard version is ", version, ", expected ",
             kShardVersion, " (uint16 tokens)");
  LOOM_CHECK(ntok >= 0, path, ": header says ", ntok, " tokens; expected a count >= 0: corrupt header");
  const uint64_t body = size - kShardHeaderBytes;
  const uint64_t want = 2 * static_cast<uint64_t>(ntok);
  LOOM_CHECK(want == body, path, ": header says ", ntok, " tokens (", want, " bytes) but the file holds ",
             body, " bytes after its ", kShardHeaderBytes, "-byte header",
             want > body ? ": truncated download?" : ": wrong token count in the header?");

  TokenShard shard;
  shard.tokens.resize(static_cast<size_t>(ntok));
  in.read(shard.tokens.data(), want, "the token ids");
  if (vocab_size > 0) {
    for (size_t i = 0; i < shard.tokens.size(); ++i) {
      LOOM_CHECK(shard.tokens[i] < vocab_size, path, ": token ", shard.tokens[i], " at position ", i,
                 " is not below vocab_size ", vocab_size, ": shard made with a different tokenizer?");
    }
  }
  return shard;
}

void write_token_shard(const std::string& path, std::span<const uint16_t> tokens) {
  LOOM_CHECK(tokens.size() <= static_cast<size_t>(INT32_MAX), path, ": ", tokens.size(),
             " tokens do not fit one shard (the header's count is int32); split them");
  int32_t header[kShardHeaderInts] = {kShardMagic, kShardVersion, static_cast<int32_t>(tokens.size())};
  std::FILE* f = std::fopen(path.c_str(), "wb");
  LOOM_CHECK(f != nullptr, path, ": cannot create (", std::strerror(errno), ")");
  bool ok = std::fwrite(header, sizeof header, 1, f) == 1;
  ok = ok && (tokens.empty() || std::fwrite(tokens.data(), 2, tokens.size(), f) == tokens.size());
  ok = (std::fclose(f) == 0) && ok;
  LOOM_CHECK(ok, path, ": write failed (", std::strerror(errno), "): disk full?");
}

std::vector<std::string> glob_shards(const std::string& pattern) {
  glob_t g{};
  const int rc = glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> paths;
  if (rc == 0) paths.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  globfree(&g);
  LOOM_CHECK(rc != GLOB_NOMATCH, pattern, ": no files match this pattern; expected token shards (*.bin)");
  LOOM_CHECK(rc == 0, pattern, ": glob failed (", rc == GLOB_NOSPACE ? "out of memory" : "read error", ")");
  return paths;
}

}  // namespace loom::data
