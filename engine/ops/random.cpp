// Random tensors from one Philox generator per process. The generator is a (seed, offset)
// pair: each draw of n numbers uses counters [offset, offset + ceil(n/4)) and advances
// the offset, so the same seed gives the same tensors on the CPU and on any GPU, and a
// checkpoint that stores (seed, offset) resumes the exact stream.
#include <mutex>

#include "engine/ops/dispatch.h"

namespace loom {

namespace {
std::mutex g_mu;
uint64_t g_seed = 0x853c49e6748fea9bULL, g_offset = 0;

uint64_t claim(int64_t n, uint64_t* seed) {
  std::lock_guard lock(g_mu);
  *seed = g_seed;
  uint64_t start = g_offset;
  g_offset += uint64_t((n + 3) / 4);
  return start;
}

void check_random_target(const Tensor& t, const char* op) {
  ops::check_floating(t, op);
  LOOM_CHECK(!(grad_enabled() && t.requires_grad()), op, " on a tensor that requires a gradient: wrap it in NoGradGuard");
  LOOM_CHECK(!capturing(t.device()), op, " on ", t.device().str(), " inside a captured step (engine/cuda_graph.h): "
             "its Philox offset would be frozen into the graph and every replay would draw the same numbers; run "
             "steps with random ops (dropout) eagerly");
}
}  // namespace

void manual_seed(uint64_t seed) {
  std::lock_guard lock(g_mu);
  g_seed = seed;
  g_offset = 0;
}

std::pair<uint64_t, uint64_t> rng_state() {
  std::lock_guard lock(g_mu);
  return {g_seed, g_offset};
}

void set_rng_state(uint64_t seed, uint64_t offset) {
  std::lock_guard lock(g_mu);
  g_seed = seed;
  g_offset = offset;
}

void uniform_(const Tensor& t, double lo, double hi) {
  check_random_target(t, "uniform_");
  t.bump_version();
  if (t.numel() == 0) return;
  Tensor target = t.is_contiguous() ? t : Tensor::empty(t.shape(), t.dtype(), t.device());
  uint64_t seed;
  uint64_t offset = claim(t.numel(), &seed);
  ops::kernels(t.device()).uniform(ops::strided(target), seed, offset, lo, hi, ops::stream(t));
  if (!target.same(t)) copy_(t, target);
}

void normal_(const Tensor& t, double mean, double std) {
  check_random_target(t, "normal_");
  t.bump_version();
  if (t.numel() == 0) return;
  Tensor target = t.is_contiguous() ? t : Tensor::empty(t.shape(), t.dtype(), t.device());
  uint64_t seed;
  uint64_t offset = claim(t.numel(), &seed);
  ops::kernels(t.device()).normal(ops::strided(target), seed, offset, mean, std, ops::stream(t));
  if (!target.same(t)) copy_(t, target);
}

Tensor rand(const Shape& shape, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  uniform_(t, 0.0, 1.0);
  return t;
}

Tensor randn(const Shape& shape, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  normal_(t, 0.0, 1.0);
  return t;
}

}  // namespace loom
