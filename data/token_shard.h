// The uint16 token shard of llm.c and nanoGPT-style pipelines (llm.c's dev/data/*.py write it):
// a header of 256 little-endian int32 — [20240520 (magic), 1 (version), ntok, 0...] — then ntok
// little-endian uint16 token ids. 1024 + 2 * ntok must be the file's exact size.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace loom::data {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersion = 1;
inline constexpr int64_t kShardHeaderInts = 256;
inline constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;

struct TokenShard {
  std::vector<uint16_t> tokens;  // (ntok,)
};

// Reads one shard. With vocab_size > 0, every token id must be < vocab_size (50257 for GPT-2):
// a shard written by another tokenizer fails here rather than as an out-of-range embedding.
TokenShard load_token_shard(const std::string& path, int64_t vocab_size = 0);
// Writes `tokens` as a shard (for preprocessing, and for tests).
void write_token_shard(const std::string& path, std::span<const uint16_t> tokens);
// Paths matching a glob(3) pattern (e.g. "fineweb_train_*.bin"), sorted; throws when none match.
std::vector<std::string> glob_shards(const std::string& pattern);

}  // namespace loom::data
