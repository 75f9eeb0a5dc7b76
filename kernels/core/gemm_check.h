// The checks a product's epilogue and sums must pass on every device (GemmArgs in
// kernels/table.h): the CPU and CUDA gemm both call check_gemm_extras before any work.
#pragma once

#include "error.h"
#include "../table.h"

namespace loom {

inline void check_gemm_extras(const GemmArgs& g) {
  const bool single = g.batch == 1;
  LOOM_CHECK(g.epilogue == GemmEpilogue::none || (single && g.aux && g.ld_aux >= g.n),
             "gemm: a gelu/dgelu epilogue needs a single product and an aux buffer of row stride >= n (", g.n,
             "), got batch ", g.batch, " and row stride ", g.ld_aux);
  LOOM_CHECK(!g.column_sums || (single && g.beta == 0.f && !g.bias),
             "gemm: column sums need a single product with beta == 0 and no bias");
  LOOM_CHECK(!g.row_sums_a || single, "gemm: row sums of A need a single product, got a batch of ", g.batch);
  LOOM_CHECK(!g.c_f32 || (single && g.epilogue == GemmEpilogue::none && !g.column_sums &&
                          (g.dtype == DType::bf16 || g.dtype == DType::f16)),
             "gemm: an f32 C needs a single bf16/f16 product without epilogue or column sums");
  LOOM_CHECK(!g.c_in || single, "gemm: c_in needs a single product, got a batch of ", g.batch);
  LOOM_CHECK(!g.alpha_ptr || (g.beta == 0.f && !g.bias && g.epilogue == GemmEpilogue::none && !g.column_sums &&
                              !g.row_sums_a),
             "gemm: alpha read from memory (alpha_ptr) needs beta == 0 and no bias, epilogue or sums");
}

}  // namespace loom
