#include "kernels/core/precision.h"

#include <atomic>

namespace loom {
namespace {
std::atomic<bool> allowed{true};
}  // namespace

void set_tf32_allowed(bool on) { allowed.store(on, std::memory_order_relaxed); }
bool tf32_allowed() { return allowed.load(std::memory_order_relaxed); }

}  // namespace loom
