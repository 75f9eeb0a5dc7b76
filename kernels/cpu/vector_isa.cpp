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
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
#else
  return false;
#endif
}

bool avx2_copies_on() { return enabled().load(std::memory_order_relaxed); }

void use_avx2(bool on) { enabled().store(on && cpu_has_avx2(), std::memory_order_relaxed); }

}  // namespace loom::cpu::vector_isa
