// packed_self_attention and strided scaled_dot_product_attention on the GPU against the CPU,
// outputs and gradients: bf16 and f16 with D = 64 (the tensor-core kernels, reading q, k and
// v inside the (B, T, 3C) projection and writing dq, dk and dv into its one gradient), f32
// (the CUDA-core kernels), a length (77) that leaves partial tiles, and qkv as a column slice
// of a wider buffer: 8 columns in keeps its rows 16-byte aligned (tensor cores through the
// strides), 4 columns in does not for 16-bit types (the CUDA-core kernels). The CPU reference is
// scaled_dot_product_attention in f64 on contiguous permuted copies of the same (rounded)
// inputs, as CausalSelfAttention computed before it used the packed op.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "tests/common/gpu.h"
#include "tests/common/tensor_checks.h"

namespace loom {
namespace {

// Error allowed relative to the tensor's largest magnitude (at least 1), as the kernel tests;
// twice that for gradients, which go through one more rounded product.
double tolerance(DType dt) { return dt == DType::bf16 ? 2e-2 : dt == DType::f16 ? 4e-3 : 2e-4; }

// q, k, v permuted out of qkv (B, T, 3C) into contiguous (B, H, T, D) copies, attention, and
// the heads put back side by side: (B, T, C).
Tensor sdpa_on_permuted_copies(const Tensor& qkv, int64_t H, bool causal) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
  TensorList q_k_v = unbind(qkv.reshape({B, T, 3, H, C / H}).permute({2, 0, 3, 1, 4}).contiguous(), 0);
  return scaled_dot_product_attention(q_k_v[0], q_k_v[1], q_k_v[2], causal).transpose(1, 2).reshape({B, T, C});
}

struct Case {
  int64_t B, T, H, D;
  int64_t pad;  // qkv is columns [pad, pad + 3C) of a (B, T, 3C + 2 pad) buffer
  std::string str() const {
    return "(B " + std::to_string(B) + ", T " + std::to_string(T) + ", H " + std::to_string(H) + ", D " +
           std::to_string(D) + ", qkv " + std::to_string(pad) + " columns in)";
  }
};

TEST(AttentionOpsCuda, PackedMatchesSdpaOnPermutedCopiesOnTheCpu) {
  LOOM_REQUIRE_CUDA();
  for (const Case& c : {Case{2, 77, 2, 64, 0}, Case{1, 130, 3, 64, 8}, Case{2, 77, 2, 64, 4}, Case{1, 65, 2, 32, 0}})
    for (DType dt : {DType::bf16, DType::f16, DType::f32})
      for (bool causal : {true, false}) {
        SCOPED_TRACE(c.str() + " " + std::string(dtype_name(dt)) + (causal ? " causal" : ""));
        const int64_t C = c.H * c.D, W = 3 * C + 2 * c.pad;
        manual_seed(21);
        const Tensor base = randn({c.B, c.T, W}).to(dt), w = randn({c.B, c.T, C}).to(dt);

        Tensor buffer = base.to(Device::cuda(0)).set_requires_grad();
        Tensor out = packed_self_attention(buffer.slice(2, c.pad, c.pad + 3 * C), c.H, causal);
        EXPECT_EQ(out.dtype(), dt);
        out.backward(w.to(Device::cuda(0)));

        Tensor ref_buffer = base.to(DType::f64).set_requires_grad();
        Tensor ref = sdpa_on_permuted_copies(ref_buffer.slice(2, c.pad, c.pad + 3 * C), c.H, causal);
        ref.backward(w.to(DType::f64));

        const double tol = tolerance(dt);
        test::expect_close_to_scale(out, ref, tol, "out");
        // The whole buffer's gradient: zeros outside qkv's columns.
        test::expect_close_to_scale(buffer.grad(), ref_buffer.grad(), 2 * tol, "grad of qkv");
      }
}

TEST(AttentionOpsCuda, SdpaReadsStridedViewsAsTheCpuDoes) {
  LOOM_REQUIRE_CUDA();
  // q, k, v as (B, H, T, D) views of one (B, T, 3, H, D) tensor: 16-byte rows, so bf16 runs
  // the tensor cores through the strides; the upstream gradient a transposed view.
  for (DType dt : {DType::bf16, DType::f32})
    for (bool causal : {true, false}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (causal ? " causal" : ""));
      const int64_t B = 2, T = 77, H = 2, D = 64;
      manual_seed(22);
      const Tensor base = randn({B, T, 3, H, D}).to(dt), g = randn({B, T, H, D}).to(dt);
      auto head = [](const Tensor& x, int i) { return x.select(2, i).transpose(1, 2); };

      Tensor x = base.to(Device::cuda(0)).set_requires_grad();
      Tensor out = scaled_dot_product_attention(head(x, 0), head(x, 1), head(x, 2), causal);
      EXPECT_TRUE(out.transpose(1, 2).is_contiguous());
      out.backward(g.to(Device::cuda(0)).transpose(1, 2));

      Tensor xr = base.to(DType::f64).set_requires_grad();
      Tensor ref = scaled_dot_product_attention(head(xr, 0).contiguous(), head(xr, 1).contiguous(),
                                                head(xr, 2).contiguous(), causal);
      ref.backward(g.to(DType::f64).transpose(1, 2).contiguous());

      const double tol = tolerance(dt);
      test::expect_close_to_scale(out, ref, tol, "out");
      test::expect_close_to_scale(x.grad(), xr.grad(), 2 * tol, "grad of q | k | v");
    }
}

}  // namespace
}  // namespace loom
