#include "engine/cuda_graph.h"

#include <atomic>

#include "engine/allocator.h"
#include "kernels/config.h"
#include "kernels/core/error.h"

#if LOOM_WITH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/check.h"
#endif

namespace loom {

namespace {
int next_pool() {
  static std::atomic<int> next{1};
  return next++;
}
}  // namespace

CudaGraph::CudaGraph(Device device) : device_(device), pool_(next_pool()) {
  LOOM_CHECK(device.is_cuda(), "CudaGraph: graphs capture GPU work; got device ", device.str());
  set_current_device(device);
}

#if LOOM_WITH_CUDA

CudaGraph::~CudaGraph() {
  if (exec_ || graph_) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(compute_stream(device_)));  // replays done
    if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    if (graph_) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
  }
  memory::release_pool(device_, pool_);
}

void CudaGraph::capture(const std::function<void()>& work) {
  LOOM_CHECK(!captured(), "CudaGraph::capture: this graph is already captured; make another one");
  auto stream = static_cast<cudaStream_t>(compute_stream(device_));
  // Work queued before the capture finishes first: blocks released by it are then free.
  LOOM_CUDA(cudaStreamSynchronize(stream));
  memory::begin_capture(device_, pool_);
  LOOM_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  cudaGraph_t graph = nullptr;
  try {
    work();
  } catch (...) {
    // The capture is void: end it, drop what was recorded, clear the sticky status.
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    memory::end_capture(device_);
    throw;
  }
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  memory::end_capture(device_);
  if (ended != cudaSuccess) {
    cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    LOOM_FAIL("CudaGraph::capture on ", device_.str(), ": the capture failed (", cudaGetErrorString(ended),
              "); the captured work used something a graph cannot hold, such as another stream it did not "
              "join back or a wait for the host");
  }
  graph_ = graph;
  cudaGraphExec_t exec = nullptr;
  LOOM_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  exec_ = exec;
}

void CudaGraph::replay() {
  LOOM_CHECK(captured(), "CudaGraph::replay: nothing captured yet; call capture first");
  set_current_device(device_);
  LOOM_CUDA(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(compute_stream(device_))));
}

#else

CudaGraph::~CudaGraph() {}
void CudaGraph::capture(const std::function<void()>&) { LOOM_FAIL("CudaGraph needs a build of Loom with CUDA"); }
void CudaGraph::replay() { LOOM_FAIL("CudaGraph needs a build of Loom with CUDA"); }

#endif

size_t CudaGraph::pool_bytes() const { return memory::pool_bytes(device_, pool_); }

}  // namespace loom
