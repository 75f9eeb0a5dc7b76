// Random token ids and next-token targets for the GPT tests on CPU ranks: the same on every
// rank for a seed, so each rank can take its rows of one global batch.
#pragma once

#include <cstdint>
#include <random>
#include <utility>

#include "engine/tensor.h"

namespace loom::dist::testing {

// (rows, T) ids and targets in [0, vocab), drawn in turn from one mt19937 seeded with `seed`.
inline std::pair<Tensor, Tensor> token_batch(int64_t rows, int64_t T, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensor ids = Tensor::empty({rows, T}, DType::i64), targets = Tensor::empty({rows, T}, DType::i64);
  for (int64_t i = 0; i < rows * T; ++i) {
    ids.data<int64_t>()[i] = int64_t(rng() % uint64_t(vocab));
    targets.data<int64_t>()[i] = int64_t(rng() % uint64_t(vocab));
  }
  return {ids, targets};
}

}  // namespace loom::dist::testing
