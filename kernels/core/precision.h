// Whether f32 matrix products and convolutions on CUDA may run on TF32 tensor cores (10-bit
// mantissa inputs, f32 accumulation). On by default, as PyTorch's cuDNN convolutions are;
// turning it off gives full f32 arithmetic, which comparisons against float64 references
// need. The setting is process-wide and read at each call.
#pragma once

namespace loom {

void set_tf32_allowed(bool allowed);
bool tf32_allowed();

}  // namespace loom
