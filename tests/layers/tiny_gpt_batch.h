// A fixed batch for the tiny GPT (nn::GPTConfig::named("tiny"), vocabulary 256) that the
// layer tests train for a few steps: (2, 16) token ids and their targets on `device`.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/ops.h"

namespace loom::test {

inline std::pair<Tensor, Tensor> tiny_gpt_batch(Device device) {
  std::vector<int64_t> in, out;
  for (int64_t i = 0; i < 2 * 16; ++i) in.push_back((i * 37 + 11) % 256), out.push_back((i * 53 + 5) % 256);
  return {from_vector(in, {2, 16}).to(device), from_vector(out, {2, 16}).to(device)};
}

}  // namespace loom::test
