// Matrix products, as torch.matmul: (..., m, k) @ (..., k, n) with broadcast batch dims,
// 1-d operands promoted to a row or column and the extra dim removed again. The gemm
// kernel reads transposed operands through its trans flags, so a transposed view (as in
// every backward) costs no copy; only operands whose last two dims are both strided are
// packed first.
#include "engine/autocast.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/product.h"
#include "engine/options.h"

namespace loom {

namespace {

// Batch stride of an operand already expanded to the batch shape: the batch dims must
// collapse to one stride (contiguous batch or fully broadcast), else it is packed.
bool batch_stride(const Tensor& t, int64_t* stride) {
  int nb = t.dim() - 2;
  int64_t expected = -1;  // a fully broadcast batch (all strides 0) collapses to stride 0
  *stride = 0;
  for (int i = nb - 1; i >= 0; --i) {
    if (t.shape()[i] == 1) continue;
    if (expected < 0) {
      *stride = t.strides()[i];
      expected = t.strides()[i] * t.shape()[i];
    } else if (t.strides()[i] != expected) {
      return false;
    } else {
      expected *= t.shape()[i];
    }
  }
  return true;
}

}  // namespace

namespace ops {

Operand as_operand(const Tensor& t) {
  int n = t.dim();
  int64_t rows = t.shape()[n - 2], cols = t.shape()[n - 1];
  int64_t rs = t.strides()[n - 2], cs = t.strides()[n - 1];
  if ((cs == 1 || cols == 1) && (rows == 1 || rs >= std::max<int64_t>(cols, 1)))
    return {t, false, rows == 1 ? std::max<int64_t>(cols, 1) : rs};
  if ((rs == 1 || rows == 1) && (cols == 1 || cs >= std::max<int64_t>(rows, 1)))
    return {t, true, cols == 1 ? std::max<int64_t>(rows, 1) : cs};
  Tensor packed = t.contiguous();
  return {packed, false, std::max<int64_t>(cols, 1)};
}

void product_2d_into(const Tensor& c, const Tensor& a, const Tensor& b, const std::function<void(GemmArgs&)>& extras) {
  LOOM_ASSERT(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) && a.dtype() == b.dtype(),
              "product_2d: shapes ", shape_str(a.shape()), " and ", shape_str(b.shape()));
  LOOM_ASSERT(c.dim() == 2 && c.size(0) == a.size(0) && c.size(1) == b.size(1) &&
                  (c.size(1) < 2 || c.stride(1) == 1) && (c.size(0) < 2 || c.stride(0) >= c.size(1)),
              "product_2d: C of shape ", shape_str(c.shape()), " and strides for ", shape_str(a.shape()), " @ ",
              shape_str(b.shape()));
  const bool c_f32 = c.dtype() != a.dtype();
  LOOM_ASSERT(!c_f32 || (c.dtype() == DType::f32 && (a.dtype() == DType::bf16 || a.dtype() == DType::f16)),
              "product_2d: C of ", dtype_name(c.dtype()), " for ", dtype_name(a.dtype()), " operands");
  Operand oa = as_operand(a), ob = as_operand(b);
  GemmArgs g;
  g.dtype = a.dtype();
  g.c_f32 = c_f32;
  g.trans_a = oa.trans, g.trans_b = ob.trans;
  g.m = a.size(0), g.n = b.size(1), g.k = a.size(1);
  g.a = oa.t.data_ptr(), g.lda = oa.ld;
  g.b = ob.t.data_ptr(), g.ldb = ob.ld;
  g.c = c.data_ptr(), g.ldc = std::max<int64_t>(c.size(0) > 1 ? c.stride(0) : g.n, 1);
  g.autotune = options().gemm_autotuning;
  if (extras) extras(g);
  kernels(a.device()).gemm(g, stream(a));
}

Tensor product_2d(const Tensor& a, const Tensor& b, const std::function<void(GemmArgs&)>& extras, bool c_f32) {
  Tensor c = Tensor::empty({a.size(0), b.size(1)}, c_f32 ? DType::f32 : a.dtype(), a.device());
  product_2d_into(c, a, b, extras);
  return c;
}

bool f32_params(DType t, std::initializer_list<Tensor> params) {
  if (t != DType::bf16 && t != DType::f16) return false;
  for (const Tensor& p : params)
    if (p.defined() && p.dtype() != DType::f32) return false;
  return true;
}

Param param(const Tensor& p, DType dtype, bool f32) {
  if (!p.defined()) return {};
  if (!f32) {
    Tensor c = p.to(dtype);
    return {c, c};
  }
  return {weight_copy(p, dtype), p};
}

}  // namespace ops

namespace {
using ops::as_operand;
using ops::Operand;

// Packs t when gemm cannot address it: the batch dims must collapse to one stride.
Operand batched_operand(const Tensor& t, int64_t* stride) {
  Operand o = as_operand(t);
  if (!batch_stride(o.t, stride)) {
    o = as_operand(t.contiguous());
    batch_stride(o.t, stride);
  }
  return o;
}

Tensor matmul_nd(const Tensor& a, const Tensor& b) {
  // a (..., m, k), b (..., k, n), both >= 2-d, same dtype and device.
  int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  LOOM_CHECK(b.size(-2) == k, "matmul: shapes ", shape_str(a.shape()), " and ", shape_str(b.shape()),
             " cannot be multiplied (", k, " columns vs ", b.size(-2), " rows)");
  Shape ba(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  Shape batch = broadcast_shapes(ba, bb);
  Shape a_full = batch, b_full = batch, out_shape = batch;
  a_full.insert(a_full.end(), {m, k});
  b_full.insert(b_full.end(), {k, n});
  out_shape.insert(out_shape.end(), {m, n});
  int64_t sa = 0, sb = 0;
  Operand oa = batched_operand(a.expand(a_full), &sa), ob = batched_operand(b.expand(b_full), &sb);

  Tensor out = Tensor::empty(out_shape, a.dtype(), a.device());
  if (out.numel() == 0) return out;
  if (k == 0) {
    zero_(out);
    return out;
  }
  GemmArgs g;
  g.dtype = a.dtype();
  g.trans_a = oa.trans;
  g.trans_b = ob.trans;
  g.m = m, g.n = n, g.k = k;
  g.batch = shape_numel(batch);
  g.a = oa.t.data_ptr(), g.lda = oa.ld, g.stride_a = sa;
  g.b = ob.t.data_ptr(), g.ldb = ob.ld, g.stride_b = sb;
  g.c = out.data_ptr(), g.ldc = n, g.stride_c = m * n;
  g.autotune = options().gemm_autotuning;
  ops::kernels(a.device()).gemm(g, ops::stream(a));
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a0, const Tensor& b0) {
  ops::check_defined(a0, "matmul", "a");
  ops::check_defined(b0, "matmul", "b");
  ops::check_same_device(a0, b0, "matmul");
  LOOM_CHECK(a0.dim() >= 1 && b0.dim() >= 1, "matmul needs tensors of at least one dimension, got shapes ",
             shape_str(a0.shape()), " and ", shape_str(b0.shape()));
  DType t = ops::promote(a0.dtype(), b0.dtype());
  LOOM_CHECK(is_floating(t), "matmul needs floating-point tensors, got ", dtype_name(t));
  t = autocast_compute_dtype(t);
  Tensor a = a0.to(t), b = b0.to(t);
  // (..., m, k) @ (k, n), as every linear layer does: the leading dims fold into the rows, so
  // the product is one large GEMM, and so is each of its gradients (the weight's would
  // otherwise be a batch of products summed afterwards). reshape is differentiable, and
  // copies only when a's leading dims cannot be merged.
  if (a.dim() > 2 && b.dim() == 2 && a.size(-1) > 0 && a.numel() > 0) {
    Shape out_shape(a.shape().begin(), a.shape().end() - 1);
    out_shape.push_back(b.size(1));
    LOOM_CHECK(b.size(0) == a.size(-1), "matmul: shapes ", shape_str(a.shape()), " and ", shape_str(b.shape()),
               " cannot be multiplied (", a.size(-1), " columns vs ", b.size(0), " rows)");
    return matmul(a.reshape({-1, a.size(-1)}), b).reshape(out_shape);
  }
  // 1-d operands: a vector on the left is a row, on the right a column; dropped after.
  bool a_vec = a.dim() == 1, b_vec = b.dim() == 1;
  if (a_vec) a = a.unsqueeze(0);
  if (b_vec) b = b.unsqueeze(1);
  Tensor out;
  {
    NoGradGuard no_grad;
    out = matmul_nd(a, b);
  }
  if (any_requires_grad({a, b})) {
    Tensor sa = a.detach(), sb = b.detach();
    Shape as = a.shape(), bs = b.shape();
    const bool need_a = a.requires_grad(), need_b = b.requires_grad();
    record("matmul", {a, b}, {out}, [sa, sb, as, bs, need_a, need_b](const TensorList& g) {
      // dA = dC @ B^T, dB = A^T @ dC, summed over broadcast batch dims; only those wanted (a
      // split pass may want one now and the other later: gradient_wanted).
      Tensor ga = need_a && gradient_wanted(0) ? sum_to(matmul(g[0], sb.transpose(-1, -2)), as) : Tensor();
      Tensor gb = need_b && gradient_wanted(1) ? sum_to(matmul(sa.transpose(-1, -2), g[0]), bs) : Tensor();
      return TensorList{ga, gb};
    });
  }
  if (a_vec) out = out.squeeze(-2);
  if (b_vec) out = out.squeeze(-1);
  return out;
}


}  // namespace loom
