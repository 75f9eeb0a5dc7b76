#include "kernels/cpu/vector_isa.h"

#include <atomic>

namespace loom::cpu::vector_isa {
namespace {
std::atomic<bool>& enabled() {
  static std::atomic<bool> on{cpu_has_avx2()};
  return on;
}
}  // namespace

bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

bool avx2() { return enabled().load(std::memory_order_relaxed); }

void use_avx2(bool on) { enabled().store(on && cpu_has_avx2(), std::memory_order_relaxed); }

}  // namespace loom::cpu::vector_isa
