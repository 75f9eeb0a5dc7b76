// cuDNN's graph (backend) API for one pass of one convolution shape: an execution plan
// built once and kept, so that a call costs a variant pack and cudnnBackendExecute. The
// convolution API of conv.cu rebuilds a plan inside cuDNN at every call; on a ResNet-18
// step that is about half of the host's time. Internal to kernels/cuda (conv.cu uses it).
//
// Plans are looked for among the heuristics' engine configurations (mode A, in their
// order), keeping those that finalize, fit the workspace limits below and whose numerical
// notes fit the dtype: no down-conversion of inputs and no reduced-precision reduction ever,
// no tensor cores for f32 when TF32 is not allowed, and no nondeterministic note when the
// call asks for deterministic results. The first such plan is the heuristics' choice; the
// later ones are candidates for timing (conv.cu's autotuning). Tensors are
// described as 16-byte aligned: conv.cu takes this path only for pointers that are.
// When no configuration qualifies, or cuDNN refuses the graph, there is no plan and
// conv.cu uses the convolution API. Both APIs take their cuDNN types from cudnn_types.
#pragma once

#include <cudnn.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "../table.h"

namespace loom::cuda {

// cuDNN's types for convolutions in `dtype`, through either API: the tensors' data type, the
// compute type, and the convolution API's math type (TF32 for f32 only when allowed).
struct CudnnTypes {
  cudnnDataType_t data, compute;
  cudnnMathType_t math;
};
CudnnTypes cudnn_types(DType dtype);

}  // namespace loom::cuda

namespace loom::cuda::conv_graph {

class Plan;

struct PlanDeleter {
  void operator()(Plan* p) const;
};
using PlanPtr = std::unique_ptr<Plan, PlanDeleter>;

// Up to `max_plans` plans for the pass at these shapes, in the heuristics' order; empty when
// there is none. The first needs at most `max_workspace` bytes of workspace, each later one
// at most the larger of the first's and `later_workspace` (and never more than
// `max_workspace`). `handle` is the device's cuDNN handle.
std::vector<PlanPtr> build(const Conv2dArgs& a, ConvPass pass, cudnnHandle_t handle, size_t max_workspace,
                           int max_plans = 1, size_t later_workspace = 0);

size_t workspace_size(const Plan& plan);

// Runs the pass on the handle's stream. The pointers are the convolution's three tensors
// (N, C_in, H, W), (C_out, C_in / groups, KH, KW), (N, C_out, OH, OW), or their gradients
// where the pass writes them: forward writes y, backward data dx (in x's place), backward
// filter dw (in w's place), and the backward passes read dy in y's place.
cudnnStatus_t execute(const Plan& plan, cudnnHandle_t handle, const void* x, const void* w, const void* y,
                      void* workspace);

}  // namespace loom::cuda::conv_graph
