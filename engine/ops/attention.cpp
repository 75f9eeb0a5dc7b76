// Fused scaled-dot-product attention, PyTorch's F.scaled_dot_product_attention without a
// mask tensor or dropout: softmax(q k^T * scale [+ causal mask]) v over (B, H, T, D); and
// packed_self_attention, the same over the (B, T, 3C) output of a qkv projection.
//
// One node per call. The forward keeps only out and the per-row log-sum-exp (B, H, T_q) in
// the accumulation type; backward recomputes the probabilities from them (flash attention),
// so memory stays linear in T. Like matmul, it runs in the autocast dtype (bf16 under the
// guard), since on CUDA that is what the tensor-core kernels take.
//
// The kernels address every operand through its strides (kernels/table.h), so neither op
// copies to change layout: sdpa takes any view whose head_dim is stride 1 as it is and
// writes its output in (B, T, H, D) order; the packed op reads q, k and v as column slices
// of qkv, writes a (B, T, C) output, and its backward writes dq, dk and dv straight into
// the slices of one (B, T, 3C) gradient. When the projection that made qkv reads that
// gradient's column sums for its bias (set_gradient_sums_read, Options::fused_bias_sums),
// the backward asks the kernels for them (AttentionArgs::column_sums) and keeps them on it
// (keep_column_sums).
#include <array>
#include <cmath>

#include "engine/autocast.h"
#include "engine/ops/dispatch.h"
#include "engine/options.h"

namespace loom {

using ops::kernels;

namespace {

// An operand as the kernels see it: sizes (B, H, T, D) and element strides.
struct Operand {
  std::array<int64_t, 4> size, stride;
};

Operand bhtd(const Tensor& t) {
  return {{t.size(0), t.size(1), t.size(2), t.size(3)}, {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}};
}

// Columns [0, heads * D) of a (B, T, W) tensor as (B, heads, T, D): the packed op's q (k and
// v start C and 2C columns on), its output and their gradients.
Operand packed(const Tensor& t, int64_t heads, int64_t D) {
  return {{t.size(0), heads, t.size(1), D}, {t.stride(0), D * t.stride(2), t.stride(1), t.stride(2)}};
}

// True when the kernels can read the operand where it lies: its head_dim is stride 1, and
// its batch, head and sequence strides are not all zero (one row broadcast everywhere,
// which the kernels would take for their contiguous default). Otherwise it needs a copy.
bool in_place(const Operand& o) {
  return (o.size[3] == 1 || o.stride[3] == 1) && (o.stride[0] != 0 || o.stride[1] != 0 || o.stride[2] != 0);
}

AttentionStrides strides_of(const Operand& o) { return {o.stride[0], o.stride[1], o.stride[2]}; }

// A (B, H, T, D) tensor the kernels can read: t itself, or a contiguous copy.
Tensor readable(const Tensor& t) { return in_place(bhtd(t)) ? t : t.contiguous(); }

// The forward kernel into out and lse (laid out as a.strides says), under the options in
// force as the forward runs, on the stream of `on`.
void run_forward(AttentionArgs a, Device dev, const Tensor& out, const Tensor& lse, const void* q, const void* k,
                 const void* v, const Tensor& on) {
  a.hopper = options().hopper_attention;
  kernels(dev).attention_forward(a, out.data_ptr(), lse.data_ptr(), q, k, v, ops::stream(on));
}

// The backward kernels into dq, dk and dv (in buffers the caller allocated, laid out as
// a.strides says), with their scratch, under the options in force as the backward runs.
void run_backward(AttentionArgs a, Device dev, void* dq, void* dk, void* dv, const Tensor& gout,
                  const Tensor& q, const void* k, const void* v, const Tensor& out, const Tensor& lse) {
  a.deterministic = options().deterministic;
  a.hopper = options().hopper_attention;
  // Scratch lives until the kernels are queued; the allocator reuses it in stream order.
  const size_t bytes = kernels(dev).attention_workspace_size(a);
  Tensor ws = bytes ? Tensor::empty({int64_t(bytes)}, DType::u8, dev) : Tensor();
  kernels(dev).attention_backward(a, dq, dk, dv, gout.data_ptr(), q.data_ptr(), k, v, out.data_ptr(),
                                  lse.data_ptr(), bytes ? ws.data_ptr() : nullptr, ops::stream(gout));
}

DType acc_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

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
  Tensor q = readable(q0.to(t)), k = readable(k0.to(t)), v = readable(v0.to(t));
  AttentionArgs a;
  a.dtype = t;
  a.batch = q.size(0), a.heads = q.size(1), a.q_len = q.size(2), a.kv_len = k.size(2), a.head_dim = q.size(3);
  a.causal = causal;
  a.scale = s;
  a.strides.q = strides_of(bhtd(q));
  a.strides.k = strides_of(bhtd(k));
  a.strides.v = strides_of(bhtd(v));

  const Device dev = q.device();
  // Written in (B, T_q, H, D) order, so out.transpose(1, 2) is contiguous: (B, T_q, H * D)
  // for an output projection without a copy.
  Tensor out = Tensor::empty({a.batch, a.q_len, a.heads, a.head_dim}, t, dev).transpose(1, 2);
  a.strides.out = strides_of(bhtd(out));
  Tensor lse = Tensor::empty({a.batch, a.heads, a.q_len}, acc_dtype(t), dev);
  if (out.numel() > 0)
    run_forward(a, dev, out, lse, q.data_ptr(), k.data_ptr(), v.data_ptr(), q);

  if (any_requires_grad({q, k, v})) {
    Tensor sq = q.detach(), sk = k.detach(), sv = v.detach(), so = out.detach();
    record(op, {q, k, v}, {out}, [a, sq, sk, sv, so, lse, dev](const TensorList& g) {
      Tensor gout = readable(g[0].to(a.dtype));
      AttentionArgs b = a;  // dq, dk and dv keep the default: contiguous (B, H, T, D)
      b.strides.dout = strides_of(bhtd(gout));
      Tensor dq = Tensor::empty(sq.shape(), a.dtype, dev), dk = Tensor::empty(sk.shape(), a.dtype, dev),
             dv = Tensor::empty(sv.shape(), a.dtype, dev);
      if (dq.numel() + dk.numel() > 0)
        run_backward(b, dev, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), gout, sq, sk.data_ptr(), sv.data_ptr(),
                     so, lse);
      return TensorList{dq, dk, dv};
    });
  }
  return out;
}

Tensor packed_self_attention(const Tensor& qkv0, int64_t heads, bool causal, double scale) {
  const char* op = "packed_self_attention";
  ops::check_defined(qkv0, op, "qkv");
  ops::check_floating(qkv0, op);
  LOOM_CHECK(qkv0.dim() == 3, op, " expects qkv of shape (B, T, 3C), the output of a C -> 3C linear layer, got ",
             shape_str(qkv0.shape()),
             qkv0.dim() == 4 ? ": for separate (B, H, T, D) queries, keys and values call scaled_dot_product_attention"
                             : "");
  LOOM_CHECK(heads > 0, op, ": heads must be positive, got ", heads);
  const int64_t B = qkv0.size(0), T = qkv0.size(1), W = qkv0.size(2);
  LOOM_CHECK(W > 0 && W % (3 * heads) == 0, op, ": the last dim of qkv ", shape_str(qkv0.shape()),
             " must be 3C, C = heads * head_dim, so a positive multiple of 3 * heads = ", 3 * heads,
             ": is qkv the output of a C -> 3C linear layer, and heads right?");
  const int64_t C = W / 3, D = C / heads;
  LOOM_CHECK(std::isfinite(scale), op, ": scale must be finite (0 for 1 / sqrt(head_dim)), got ", scale);

  const DType t = autocast_compute_dtype(qkv0.dtype());
  Tensor qkv = qkv0.to(t);
  if (!in_place(packed(qkv, heads, D))) qkv = qkv.contiguous();
  AttentionArgs a;
  a.dtype = t;
  a.batch = B, a.heads = heads, a.q_len = T, a.kv_len = T, a.head_dim = D;
  a.causal = causal;
  a.scale = scale != 0 ? scale : 1.0 / std::sqrt(double(D));
  a.strides.q = a.strides.k = a.strides.v = strides_of(packed(qkv, heads, D));

  const Device dev = qkv.device();
  // (B, T, C) with C = (H, D): the heads side by side, as an output projection takes them.
  Tensor out = Tensor::empty({B, T, C}, t, dev);
  a.strides.out = strides_of(packed(out, heads, D));
  Tensor lse = Tensor::empty({B, heads, T}, acc_dtype(t), dev);
  // k and v are the same rows C and 2C columns on.
  const int64_t column = C * qkv.stride(2) * int64_t(qkv.element_size());
  const char* q_ptr = static_cast<const char*>(qkv.data_ptr());
  if (out.numel() > 0)
    run_forward(a, dev, out, lse, q_ptr, q_ptr + column, q_ptr + 2 * column, qkv);

  if (any_requires_grad({qkv})) {
    Tensor sqkv = qkv.detach(), so = out.detach();
    const bool sum_dqkv = options().fused_bias_sums && gradient_sums_read(qkv) == t;
    record(op, {qkv}, {out}, [a, sqkv, so, lse, dev, column, sum_dqkv](const TensorList& g) {
      const int64_t B = a.batch, T = a.q_len, C = a.heads * a.head_dim;
      Tensor gout = g[0].to(a.dtype);
      if (!in_place(packed(gout, a.heads, a.head_dim))) gout = gout.contiguous();
      // One (B, T, 3C) gradient, dq | dk | dv along its rows, as qkv holds q | k | v.
      Tensor dqkv = Tensor::empty({B, T, 3 * C}, a.dtype, dev);
      AttentionArgs b = a;
      b.strides.dout = strides_of(packed(gout, a.heads, a.head_dim));
      b.strides.dq = b.strides.dk = b.strides.dv = strides_of(packed(dqkv, a.heads, a.head_dim));
      if (dqkv.numel() > 0) {
        Tensor sums = sum_dqkv ? Tensor::empty({3 * C}, acc_dtype(a.dtype), dev) : Tensor();
        b.column_sums = ops::ptr_or_null(sums);
        char* d = static_cast<char*>(dqkv.data_ptr());
        const int64_t d_column = C * int64_t(dqkv.element_size());
        const char* q = static_cast<const char*>(sqkv.data_ptr());
        run_backward(b, dev, d, d + d_column, d + 2 * d_column, gout, sqkv, q + column, q + 2 * column, so, lse);
        if (sum_dqkv) keep_column_sums(dqkv, sums, a.dtype);
      }
      return TensorList{dqkv};
    });
  }
  return out;
}

}  // namespace loom
