#include "engine/autocast.h"

#include "engine/autograd.h"
#include "engine/options.h"
#include "engine/tensor.h"
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

Tensor cast_or_kept(const Tensor& x, DType dtype) {
  if (x.dtype() != dtype && !any_requires_grad({x}))
    if (Tensor kept = kept_weight_copy(x); kept.defined() && kept.dtype() == dtype) return kept;
  return x.to(dtype);
}

Tensor weight_copy(const Tensor& p, DType dtype) {
  if (dtype == p.dtype()) return p;  // an f32 bias beside an f32 residual, say: no copy to keep
  const bool keep = options().autocast_weight_copies && p.is_leaf() && p.requires_grad();
  if (keep)
    if (Tensor kept = kept_weight_copy(p); kept.defined() && kept.dtype() == dtype) return kept;
  NoGradGuard no_grad;
  Tensor copy = p.to(dtype);
  if (keep) set_weight_copy(p, copy);
  else p.impl()->cast_copy.reset();
  return copy;
}

Tensor kept_weight_copy(const Tensor& p) {
  const TensorImpl* impl = p.impl();
  if (!impl->cast_copy || impl->cast_version != p.storage()->version()) return Tensor();
  return Tensor(impl->cast_copy);
}

std::optional<DType> weight_copy_dtype(const Tensor& p) {
  if (!p.impl()->cast_copy || !options().autocast_weight_copies) return std::nullopt;
  return p.impl()->cast_copy->dtype;
}

void set_weight_copy(const Tensor& p, const Tensor& copy) {
  LOOM_ASSERT(copy.shape() == p.shape() && copy.is_contiguous(p.memory_format()),
              "a weight copy has its parameter's shape and layout");
  LOOM_ASSERT((copy.dtype() == DType::bf16 || copy.dtype() == DType::f16) && copy.storage() != p.storage(),
              "a weight copy is a 16-bit tensor of its own, not ", dtype_name(copy.dtype()));
  p.impl()->cast_copy = copy.impl_ptr();
  p.impl()->cast_version = p.storage()->version();
}

}  // namespace loom
