// The passes a matrix product gets beside cuBLAS: what cuBLASLt could not plan or has no
// epilogue for (GemmArgs in kernels/table.h says what each part is): the bias, GELU and its
// gradient in one elementwise pass over C, and the bias-gradient sums (column sums of C, row
// sums of op(A)) in deterministic passes. matmul.cu runs them after the product, on its
// stream, with the cuBLAS workspace as scratch (free then, in stream order).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/table.h"

namespace loom::cuda::gemm_passes {

// The parts of a product's extras that cuBLASLt already did; the passes skip them. The
// bias-gradient sums are always the passes' (matmul.cu says why).
struct Done {
  bool bias = false, epilogue = false;
};

// Runs every part of g's extras not in `done`; workspace is scratch of workspace_bytes.
void finish(const GemmArgs& g, Done done, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace loom::cuda::gemm_passes
