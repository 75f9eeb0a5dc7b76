// CUDA graphs: the work one call queues on a device's compute stream, recorded once and
// replayed by a single launch. A training step of static shapes issues hundreds of small
// kernels whose launch costs the host more time than the GPU spends on them (SimpleCNN at
// batch 64); replayed as a graph, the whole step is one launch.
//
//   CudaGraph graph(device);
//   graph.capture([&] { step(); });  // runs the host code, records the GPU work: nothing executes
//   graph.replay();                   // executes it; as many times as wanted
//
// What capture asks of the captured code, and how Loom keeps to it:
// - Every kernel reads and writes the same addresses at each replay. Memory allocated while
//   capturing comes from the graph's own pool (engine/allocator.h), which nothing outside the
//   graph is handed again while the graph lives, and a block released while capturing joins
//   that pool too, so an address the graph uses is never another tensor's. Tensors made
//   before the capture and used by it (parameters, optimizer state, the static input the
//   caller copies each batch into) must outlive the graph.
// - State kept from one step to the next is updated in place: momentum buffers already are,
//   and while capturing the optimizers write autocast's weight copies into the copies the
//   forward reads (engine/ops/optim.cpp). Gradients are set to none at the start of the
//   step, so backward writes fresh ones, from the pool, at the same addresses every replay.
// - Nothing waits for the GPU or reads it from the host. synchronize() and copies between
//   host and device refuse to run inside a capture, naming it; so do random ops, whose
//   offsets would be frozen into the graph. Values a host decides per step (the learning
//   rate under a schedule, Adam's bias corrections) are read by the kernels from the device
//   (ParamGroup::hyper_at, layers/optim/optimizer.h),
//   written before each replay.
// Capture uses cudaStreamCaptureModeRelaxed: the allocator may call cudaMalloc while
// capturing (the pool grows on the first capture only).
#pragma once

#include <functional>

#include "device.h"

namespace loom {

class CudaGraph {
 public:
  explicit CudaGraph(Device device);
  // Waits for the device, then frees the graph and hands its pool to the ordinary cache.
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Records what `work` queues on the compute stream (nothing runs on the GPU). Once a
  // graph. If `work` throws (an op that cannot be captured says which), the capture is
  // abandoned, the error passes on, and the graph stays empty.
  void capture(const std::function<void()>& work);
  // Queues the recorded work on the compute stream.
  void replay();
  bool captured() const { return exec_ != nullptr; }
  Device device() const { return device_; }
  // Bytes in the graph's pool: what its replays use beyond the tensors made before capture.
  size_t pool_bytes() const;

 private:
  Device device_;
  int pool_;
  void* graph_ = nullptr;  // cudaGraph_t
  void* exec_ = nullptr;   // cudaGraphExec_t
};

}  // namespace loom
