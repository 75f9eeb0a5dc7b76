// CUDA random kernels: uniform and normal samples from Philox4x32-10. The generator and
// the maps from words to samples are kernels/core/philox.h, the same code the CPU kernels
// run, so both devices give the same numbers for the same (seed, offset). Each thread
// computes one Philox block and writes its four elements; nothing is stored between
// calls, the caller advances the offset.
#include <cstdint>
#include <type_traits>

#include "kernels/core/philox.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;

// lo + (hi - lo) u, in [lo, hi): a value that rounds onto hi is replaced by lo, as on the CPU.
template <class T>
struct UniformSample {
  double lo, hi, span;  // f64 outputs
  float lo_f, span_f;   // f32, bf16 and f16 outputs
  __device__ T operator()(const philox::Block& w, int j) const {
    if constexpr (std::is_same_v<T, double>) {
      const double x = philox::uniform_f64(w.w[j], lo, span);
      return x < hi ? x : lo;
    } else {
      const T x = from_acc<T>(philox::uniform_f32(w.w[j], lo_f, span_f));
      return double(to_acc(x)) < hi ? x : from_acc<T>(lo_f);
    }
  }
};

// mean + std z, with z from Box-Muller; the FMA is explicit so it rounds as on the CPU.
template <class T>
struct NormalSample {
  double mean, std;
  __device__ T operator()(const philox::Block& w, int j) const {
    const double x = fma(std, philox::normal01(w, j), mean);
    if constexpr (std::is_same_v<T, double>) return x;
    else return from_acc<T>(float(x));
  }
};

// Element i of out (n, contiguous) is sample(block(seed, offset + i / 4), i % 4).
template <class T, class Sample>
__global__ void philox_kernel(T* out, int64_t n, uint64_t seed, uint64_t offset, Sample sample) {
  const int64_t blocks = (n + 3) / 4;
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    const philox::Block words = philox::block(seed, offset + uint64_t(b));
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (4 * b + j < n) out[4 * b + j] = sample(words, j);
  }
}

template <class T, class Sample>
void launch(const Strided& out, uint64_t seed, uint64_t offset, Sample sample, StreamHandle stream) {
  LOOM_ASSERT(out.is_contiguous(), "random kernels write a contiguous output");
  const int64_t n = out.numel();
  if (n == 0) return;
  philox_kernel<T><<<blocks_for((n + 3) / 4, kThreads), kThreads, 0, as_cuda(stream)>>>(static_cast<T*>(out.data),
                                                                                         n, seed, offset, sample);
  LOOM_CUDA_LAUNCH();
}

}  // namespace

void uniform(const Strided& out, uint64_t seed, uint64_t offset, double lo, double hi, StreamHandle stream) {
  dispatch_floating(out.dtype, "uniform", [&](auto tag) {
    using T = decltype(tag);
    launch<T>(out, seed, offset, UniformSample<T>{lo, hi, hi - lo, float(lo), float(hi - lo)}, stream);
  });
}

void normal(const Strided& out, uint64_t seed, uint64_t offset, double mean, double std, StreamHandle stream) {
  dispatch_floating(out.dtype, "normal", [&](auto tag) {
    using T = decltype(tag);
    launch<T>(out, seed, offset, NormalSample<T>{mean, std}, stream);
  });
}

}  // namespace loom::cuda
