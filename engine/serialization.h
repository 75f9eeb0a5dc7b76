// Checkpoints as safetensors files (https://huggingface.co/docs/safetensors), so that
// PyTorch users load Loom's weights with `safetensors.torch.load_file` and Loom loads
// theirs. Layout: an 8-byte little-endian header length N, N bytes of JSON (padded with
// spaces to a multiple of 8) naming each tensor's dtype, shape and byte range, then the
// tensors' bytes, contiguous, little-endian, row-major.
//
// Saving is atomic: the file is written to "<target>.tmp-<pid>", fsynced and renamed over
// the target, so a crash leaves either the old checkpoint or the new one, never half of one.
// The target is what `path` names once symlinks are followed, so a linked checkpoint keeps
// its link; a path that exists and is not a regular file (a device, a directory, a fifo) is
// refused before anything is written; the new file keeps the old one's permissions. A
// temporary file left by a process that was killed mid-save (its pid no longer runs) is
// removed by the next save to the same target, which says so on stderr.
// Loading trusts nothing in the file before checking it against the file's size; every
// failure is a loom::Error that names the file, the problem and what was expected.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tensor.h"

namespace loom {

// Writes `tensors` (any device, any strides; written contiguous, in the given order) and
// `metadata` to `path`. Names must be non-empty, unique and not "__metadata__"; every
// tensor must be defined. Nothing is written when a check fails.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Replaces a file atomically (see above); save_safetensors and the programs' chart writer
// use it. The constructor resolves and checks the target, removes dead processes' leftover
// temporary files and creates this process's; write() appends; commit() fsyncs, renames and
// fsyncs the directory. Destroyed without commit() (an error, an exception), the temporary
// file is removed and the target is untouched. Every error names the path and the cause.
class AtomicFile {
 public:
  // `where` starts every error message; empty: "'<path>': ".
  explicit AtomicFile(const std::string& path, std::string where = "");
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  void commit();
  // The file that is replaced: `path` with its symlinks followed.
  const std::string& target() const { return target_; }

 private:
  std::string where_, target_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

// `path` with every symlink in its last component followed (a missing final file is fine:
// it is created). Throws loom::Error naming `path` when what is there is not a regular file,
// or when the links loop.
std::string resolve_output_path(const std::string& path);

// Checks before any work that a file can be written at `path`: the target is a regular file
// or absent, and a probe file can be created (then removed) beside it, so a missing or
// read-only directory fails now rather than at the first save. `flag` names the option the
// path came from in the message ("--save"); empty for none.
void check_output_path(const std::string& path, const std::string& flag = "");

struct SafetensorsFile {
  std::vector<std::pair<std::string, Tensor>> tensors;  // in the header's order
  std::map<std::string, std::string> metadata;
};

// Reads a safetensors file; the tensors are placed on `device`. Supported dtypes: F32,
// F64, BF16, F16, I32, I64, U8.
SafetensorsFile load_safetensors(const std::string& path, Device device = Device::cpu());

// The metadata of a safetensors file alone (its header is read, not its tensors), checked as
// load_safetensors checks it: cheap enough to look at a checkpoint before loading it.
std::map<std::string, std::string> load_safetensors_metadata(const std::string& path);

// The tensors of a safetensors file by name (the metadata is dropped).
std::map<std::string, Tensor> load_safetensors_map(const std::string& path, Device device = Device::cpu());

}  // namespace loom
