// Plain text as byte-level tokens: every byte is one token (vocabulary 256), so any file —
// UTF-8 or not — is a corpus with no tokenizer to train or ship. A directory is read as the
// concatenation of its files in sorted path order, which suits Debian's fortunes
// (/usr/share/games/fortunes): its .dat index files, hidden files and the .u8 links that point
// back at files already read are skipped.
#pragma once

#include <string>
#include <vector>

#include "token_shard.h"

namespace loom::data {

inline constexpr int64_t kByteVocab = 256;
// Where Debian's fortunes packages put their text files.
inline constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

// The text files under `dir`, recursively, in sorted order; skips hidden files and folders,
// *.dat files, and any path whose target was already listed (symlinks to files seen earlier).
std::vector<std::string> list_text_files(const std::string& dir);
// A text file, or a directory of them, as tokens 0..255; throws when there is no byte to read.
TokenShard load_text(const std::string& path);

}  // namespace loom::data
