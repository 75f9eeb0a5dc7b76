// Built instead of kernels/cuda/conv.cu when Loom is configured with CUDA but without
// cuDNN: the CUDA convolution entries exist (the table is complete) and say why they
// cannot run. Pooling does not need cuDNN and is unaffected.
#include "kernels/core/error.h"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

[[noreturn]] void no_cudnn() {
  LOOM_FAIL("conv2d on CUDA needs cuDNN, and this build of Loom has none (configured with -Dcudnn=disabled or "
            "no libcudnn/cudnn.h found): install cuDNN 9 and reconfigure, or run the convolution on the CPU");
}

}  // namespace

size_t conv2d_workspace_size(const Conv2dArgs&, ConvPass) { no_cudnn(); }
void conv2d_forward(const Conv2dArgs&, void*, const void*, const void*, StreamHandle) { no_cudnn(); }
void conv2d_backward_data(const Conv2dArgs&, void*, const void*, const void*, StreamHandle) { no_cudnn(); }
void conv2d_backward_filter(const Conv2dArgs&, void*, const void*, const void*, StreamHandle) { no_cudnn(); }

}  // namespace loom::cuda
