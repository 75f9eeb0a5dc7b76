// Built instead of kernels/cuda when Loom is configured without CUDA.
#include "kernels/table.h"
#include "kernels/core/error.h"

namespace loom {

const KernelTable& cuda_kernel_table() {
  LOOM_FAIL("this build of Loom has no CUDA support (configured with -Dcuda=disabled or no CUDA toolkit found); "
            "use device cpu, or rebuild with the CUDA toolkit installed");
}

}  // namespace loom
