#include "engine/autocast.h"

#include "kernels/core/error.h"

namespace loom {
namespace {
thread_local std::optional<DType> current;
}  // namespace

AutocastGuard::AutocastGuard(std::optional<DType> dtype) : previous_(current) {
  LOOM_CHECK(!dtype || *dtype == DType::bf16 || *dtype == DType::f16, "autocast computes in bf16 or f16, not ",
             dtype_name(*dtype));
  current = dtype;
}

AutocastGuard::~AutocastGuard() { current = previous_; }

std::optional<DType> autocast_dtype() { return current; }

DType autocast_compute_dtype(DType t) { return current && t == DType::f32 ? *current : t; }

}  // namespace loom
