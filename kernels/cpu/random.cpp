// CPU random kernels: uniform and normal samples from Philox4x32-10. The generator and
// the maps from words to samples live in kernels/core/philox.h, shared with the CUDA
// kernels, so both devices give the same numbers; here we only split the Philox blocks
// (four elements each) over threads and store in the output dtype.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/core/philox.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/parallel_for.h"

namespace loom::cpu {
namespace {

// Runs sample(block, word) for every element of out: element i is word i % 4 of the block
// at counter offset + i / 4.
template <class T, class Sample>
void for_each_block(const Strided& out, uint64_t seed, uint64_t offset, Sample sample) {
  LOOM_ASSERT(out.is_contiguous(), "random kernels write a contiguous output");
  T* data = static_cast<T*>(out.data);
  const int64_t n = out.numel(), blocks = (n + 3) / 4;
  parallel_for(blocks, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const philox::Block words = philox::block(seed, offset + uint64_t(b));
      const int valid = int(std::min<int64_t>(4, n - 4 * b));
      for (int j = 0; j < valid; ++j) data[4 * b + j] = sample(words, j);
    }
  });
}

template <class T>
void uniform_typed(const Strided& out, uint64_t seed, uint64_t offset, double lo, double hi) {
  if constexpr (std::is_same_v<T, double>) {
    const double span = hi - lo;
    for_each_block<T>(out, seed, offset, [&](const philox::Block& w, int j) {
      const double x = philox::uniform_f64(w.w[j], lo, span);
      return x < hi ? x : lo;  // rounding up onto hi: keep the interval half-open
    });
  } else {
    const float lo_f = float(lo), span_f = float(hi - lo);
    for_each_block<T>(out, seed, offset, [&](const philox::Block& w, int j) {
      const T x = T(philox::uniform_f32(w.w[j], lo_f, span_f));
      return double(float(x)) < hi ? x : T(lo_f);
    });
  }
}

template <class T>
void normal_typed(const Strided& out, uint64_t seed, uint64_t offset, double mean, double std) {
  for_each_block<T>(out, seed, offset, [&](const philox::Block& w, int j) {
    const double x = std::fma(std, philox::normal01(w, j), mean);
    if constexpr (std::is_same_v<T, double>) return x;
    else return T(float(x));
  });
}

}  // namespace

void uniform(const Strided& out, uint64_t seed, uint64_t offset, double lo, double hi, StreamHandle) {
  dispatch_floating(out.dtype, "uniform", [&](auto tag) { uniform_typed<decltype(tag)>(out, seed, offset, lo, hi); });
}

void normal(const Strided& out, uint64_t seed, uint64_t offset, double mean, double std, StreamHandle) {
  dispatch_floating(out.dtype, "normal", [&](auto tag) { normal_typed<decltype(tag)>(out, seed, offset, mean, std); });
}

}  // namespace loom::cpu
