// Fused scaled-dot-product attention, PyTorch's F.scaled_dot_product_attention without a
// mask tensor or dropout: softmax(q k^T * scale [+ causal mask]) v over (B, H, T, D).
//
// One node for (q, k, v). The forward keeps only out and the per-row log-sum-exp (B, H, T_q)
// in the accumulation type; backward recomputes the probabilities from them (flash
// attention), so memory stays linear in T. Like matmul, it runs in the autocast dtype
// (bf16 under the guard), since on CUDA that is what the tensor-core kernels take.
#include <cmath>

#include "engine/autocast.h"
#include "engine/ops/dispatch.h"

namespace loom {

using ops::kernels;

namespace {

void check_bhtd(const Tensor& t, const char* arg) {
  LOOM_CHECK(t.dim() == 4, "scaled_dot_product_attention expects ", arg, " of shape (B, H, T, D), got ",
             shape_str(t.shape()),
             t.dim() == 3 ? ": add the heads dim, e.g. x.view({B, T, H, D}).permute({0, 2, 1, 3})" : "");
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q0, const Tensor& k0, const Tensor& v0, bool causal,
                                    std::optional<double> scale) {
  const char* op = "scaled_dot_product_attention";
  ops::check_defined(q0, op, "q");
  ops::check_defined(k0, op, "k");
  ops::check_defined(v0, op, "v");
  for (const Tensor* t : {&q0, &k0, &v0}) ops::check_floating(*t, op);
  ops::check_same_device(q0, k0, op);
  ops::check_same_device(q0, v0, op);
  check_bhtd(q0, "q");
  check_bhtd(k0, "k");
  check_bhtd(v0, "v");
  LOOM_CHECK(k0.shape() == v0.shape(), op, ": k ", shape_str(k0.shape()), " and v ", shape_str(v0.shape()),
             " must have the same shape (B, H, T_kv, D); a value width other than the key width is not supported");
  LOOM_CHECK(q0.size(0) == k0.size(0) && q0.size(1) == k0.size(1) && q0.size(3) == k0.size(3), op, ": q ",
             shape_str(q0.shape()), " and k ", shape_str(k0.shape()),
             " must agree on batch, heads and head_dim (B, H, *, D); grouped or multi-query keys are not supported: "
             "repeat them over the heads first");
  LOOM_CHECK(q0.size(3) > 0, op, ": head_dim (the last dim) must be positive, got ", shape_str(q0.shape()));
  const double s = scale.value_or(1.0 / std::sqrt(double(q0.size(3))));
  LOOM_CHECK(std::isfinite(s), op, ": scale must be finite, got ", s);

  const DType t = autocast_compute_dtype(ops::promote(ops::promote(q0.dtype(), k0.dtype()), v0.dtype()));
  Tensor q = q0.to(t).contiguous(), k = k0.to(t).contiguous(), v = v0.to(t).contiguous();
  AttentionArgs a;
  a.dtype = t;
  a.batch = q.size(0), a.heads = q.size(1), a.q_len = q.size(2), a.kv_len = k.size(2), a.head_dim = q.size(3);
  a.causal = causal;
  a.scale = s;

  const Device dev = q.device();
  StreamHandle st = ops::stream(q);
  const DType acc = t == DType::f64 ? DType::f64 : DType::f32;
  Tensor out = Tensor::empty(q.shape(), t, dev);
  Tensor lse = Tensor::empty({a.batch, a.heads, a.q_len}, acc, dev);
  if (out.numel() > 0)
    kernels(dev).attention_forward(a, out.data_ptr(), lse.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), st);

  if (any_requires_grad({q, k, v})) {
    Tensor sq = q.detach(), sk = k.detach(), sv = v.detach(), so = out.detach();
    record(op, {q, k, v}, {out}, [a, sq, sk, sv, so, lse, dev](const TensorList& g) {
      Tensor gout = g[0].to(a.dtype).contiguous();
      StreamHandle gst = ops::stream(gout);
      Tensor dq = Tensor::empty(sq.shape(), a.dtype, dev), dk = Tensor::empty(sk.shape(), a.dtype, dev),
             dv = Tensor::empty(sv.shape(), a.dtype, dev);
      if (dq.numel() + dk.numel() > 0) {
        // Scratch lives until the kernels are queued; the allocator reuses it in stream order.
        const size_t bytes = kernels(dev).attention_workspace_size(a);
        Tensor ws = bytes ? Tensor::empty({int64_t(bytes)}, DType::u8, dev) : Tensor();
        kernels(dev).attention_backward(a, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), gout.data_ptr(),
                                        sq.data_ptr(), sk.data_ptr(), sv.data_ptr(), so.data_ptr(), lse.data_ptr(),
                                        bytes ? ws.data_ptr() : nullptr, gst);
      }
      return TensorList{dq, dk, dv};
    });
  }
  return out;
}

}  // namespace loom
