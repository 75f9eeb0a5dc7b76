// CounterRng: the data layer's random numbers, a pure function of (seed, epoch, index).
//
// A loader builds examples on whichever worker thread is free, and a resumed run starts an
// epoch in the middle; a generator whose state advances with each draw would make an
// example's augmentation depend on both. Philox4x32-10 is counter based: every block is a
// function of its key and counter, so an example's draws are fixed by (seed, epoch, index)
// alone. Key: the seed. Counter: (index low, index high, epoch, domain << 28 | block), where
// `domain` keeps the sampler's and the transforms' streams apart for the same seed.
#pragma once

#include <cstdint>

#include "../kernels/core/error.h"
#include "../kernels/core/philox.h"

namespace loom::data {

enum class RngDomain : uint32_t { augment = 1, sampler = 2 };

class CounterRng {
 public:
  CounterRng(uint64_t seed, int64_t epoch, int64_t index, RngDomain domain)
      : seed_(seed), index_(uint64_t(index)), epoch_(uint32_t(epoch)), domain_(uint32_t(domain) << 28) {}

  uint32_t next_u32() {
    if (used_ == 4) refill();
    return words_.w[used_++];
  }
  uint64_t next_u64() {
    const uint64_t hi = next_u32();  // two statements: the order of the draws is fixed
    return hi << 32 | next_u32();
  }
  // Uniform in [0, n) for n >= 1 (64-bit modulo: the bias, under n / 2^64, is negligible).
  int64_t below(int64_t n) {
    LOOM_ASSERT(n >= 1, "CounterRng::below needs n >= 1, got ", n);
    return int64_t(next_u64() % uint64_t(n));
  }
  // Uniform in [0, 1), 24 bits.
  double uniform() { return philox::unit24(next_u32()); }

 private:
  void refill() {
    LOOM_CHECK(block_ < (1u << 28), "CounterRng: more than 2^30 draws for one (seed, epoch, index)");
    words_ = philox::philox4x32_10(
        philox::Block{{uint32_t(index_), uint32_t(index_ >> 32), epoch_, domain_ | block_++}}, uint32_t(seed_),
        uint32_t(seed_ >> 32));
    used_ = 0;
  }

  uint64_t seed_, index_;
  uint32_t epoch_, domain_;
  uint32_t block_ = 0;
  philox::Block words_{};
  int used_ = 4;
};

}  // namespace loom::data
