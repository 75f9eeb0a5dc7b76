// Text reader: byte-level tokens, so the only things to get right are which files a directory
// contributes (see text.h) and that an empty corpus fails loudly rather than training on nothing.
#include "data/text.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "data/file_io.h"
#include "kernels/core/error.h"

namespace loom::data {

namespace fs = std::filesystem;

std::vector<std::string> list_text_files(const std::string& dir) {
  require_directory(dir, "expected a text file or a directory of text files");
  std::vector<std::string> found;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end;
  LOOM_CHECK(!ec, dir, ": cannot list (", ec.message(), ")");
  for (; it != end; it.increment(ec)) {
    LOOM_CHECK(!ec, dir, ": cannot list (", ec.message(), ")");
    const fs::path& p = it->path();
    if (is_hidden(p.filename().string())) {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (p.extension() == ".dat" || !it->is_regular_file(ec)) continue;
    found.push_back(p.string());
  }
  std::sort(found.begin(), found.end());
  std::set<fs::path> seen;
  std::vector<std::string> files;
  for (const std::string& f : found) {
    fs::path real = fs::canonical(f, ec);
    if (ec) real = f;
    if (seen.insert(real).second) files.push_back(f);
  }
  return files;
}

TokenShard load_text(const std::string& path) {
  std::error_code ec;
  LOOM_CHECK(fs::exists(path, ec), path, ": no such file or directory; expected a text file or a "
             "directory of text files (e.g. apt-get install fortunes for ", kFortunesDir, ")");
  const bool is_dir = fs::is_directory(path, ec);
  const std::vector<std::string> files = is_dir ? list_text_files(path) : std::vector<std::string>{path};
  LOOM_CHECK(!files.empty(), path, ": holds no text files (hidden and .dat files are skipped)");
  TokenShard shard;
  for (const std::string& f : files) {
    const std::vector<uint8_t> bytes = read_whole_file(f);
    shard.tokens.insert(shard.tokens.end(), bytes.begin(), bytes.end());
  }
  LOOM_CHECK(!shard.tokens.empty(), path, is_dir ? ": its text files are all empty" : ": is empty",
             "; expected at least one byte of text");
  return shard;
}

}  // namespace loom::data
