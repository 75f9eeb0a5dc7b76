// Philox4x32-10 (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011)
// and the maps from its words to uniform and normal samples. It lives in one header,
// compiled for the host and for the device, so the CPU and CUDA random kernels cannot
// drift apart: the same (seed, offset) gives the same numbers on both.
//
// A counter-based generator has no state to carry: block c under key k is a pure
// function, so any thread can produce any element, and a stream is resumed by handing
// out a fresh counter range (offset) rather than by saving a state.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace loom::philox {

struct Block {
  uint32_t w[4];
};

// Ten rounds of Philox4x32 on counter `ctr` with key (k0, k1), as in Random123.
LOOM_HOST_DEVICE Block philox4x32_10(Block ctr, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = uint64_t(0xD2511F53u) * ctr.w[0];
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * ctr.w[2];
    ctr = Block{{uint32_t(p1 >> 32) ^ ctr.w[1] ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ ctr.w[3] ^ k1,
                 uint32_t(p0)}};
  }
  return ctr;
}

// The block at 128-bit counter (counter, 0) under key = seed (low word first).
LOOM_HOST_DEVICE Block block(uint64_t seed, uint64_t counter) {
  return philox4x32_10(Block{{uint32_t(counter), uint32_t(counter >> 32), 0u, 0u}}, uint32_t(seed),
                       uint32_t(seed >> 32));
}

// The top 24 bits of a word as a fraction in [0, 1), exact in float and double.
LOOM_HOST_DEVICE double unit24(uint32_t word) { return double(word >> 8) * 0x1p-24; }

// Uniform sample for f32, bf16 and f16 outputs: lo + span * u in double, then rounded to
// float. span and lo are floats and u has 24 bits, so span * u is exact in double and
// the sum is rounded once whether or not the compiler fuses it into an FMA: the host and
// the device agree to the bit.
LOOM_HOST_DEVICE float uniform_f32(uint32_t word, float lo, float span) {
  return float(double(lo) + double(span) * unit24(word));
}

// Uniform sample for f64 outputs, from the same 24 bits: one explicit FMA, so the
// rounding does not depend on what the compiler contracts.
LOOM_HOST_DEVICE double uniform_f64(uint32_t word, double lo, double span) { return ::fma(span, unit24(word), lo); }

// Standard normal sample for element j of a block, by Box-Muller on the word pair
// (2p, 2p + 1) with p = j / 2: u1 = ((w[2p] >> 8) + 1) 2^-24 in (0, 1], so the log stays
// finite, u2 = (w[2p + 1] >> 8) 2^-24, r = sqrt(-2 ln u1); even j takes r cos(2 pi u2),
// odd j takes r sin(2 pi u2). In double, which keeps the host and the device within an
// ulp of each other, so they agree to the bit once rounded to f32 but for rare ties.
LOOM_HOST_DEVICE double normal01(const Block& words, int j) {
  const int p = j / 2;
  const double u1 = double((words.w[2 * p] >> 8) + 1u) * 0x1p-24;
  const double r = ::sqrt(-2.0 * ::log(u1));  // the global functions, whatever the includer declares
  const double theta = 6.283185307179586 * unit24(words.w[2 * p + 1]);
  return r * (j % 2 == 0 ? ::cos(theta) : ::sin(theta));
}

}  // namespace loom::philox
