// Checkpoints as safetensors files (https://huggingface.co/docs/safetensors), so that
// PyTorch users load Loom's weights with `safetensors.torch.load_file` and Loom loads
// theirs. Layout: an 8-byte little-endian header length N, N bytes of JSON (padded with
// spaces to a multiple of 8) naming each tensor's dtype, shape and byte range, then the
// tensors' bytes, contiguous, little-endian, row-major.
//
// Saving is atomic: the file is written to "<path>.tmp-<pid>", fsynced and renamed over
// `path`, so a crash leaves either the old checkpoint or the new one, never half of one.
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

struct SafetensorsFile {
  std::vector<std::pair<std::string, Tensor>> tensors;  // in the header's order
  std::map<std::string, std::string> metadata;
};

// Reads a safetensors file; the tensors are placed on `device`. Supported dtypes: F32,
// F64, BF16, F16, I32, I64, U8.
SafetensorsFile load_safetensors(const std::string& path, Device device = Device::cpu());

// The tensors of a safetensors file by name (the metadata is dropped).
std::map<std::string, Tensor> load_safetensors_map(const std::string& path, Device device = Device::cpu());

}  // namespace loom
