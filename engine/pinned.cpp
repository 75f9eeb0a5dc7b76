#include "engine/pinned.h"

#include "engine/allocator.h"
#include "kernels/config.h"
#include "kernels/core/error.h"

#if LOOM_WITH_CUDA
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/check.h"
#endif

namespace loom {

namespace {

void check_shape(const Shape& shape) {
  for (int64_t d : shape) LOOM_CHECK(d >= 0, "pinned_empty: negative dimension in shape ", shape_str(shape));
}

}  // namespace

#if LOOM_WITH_CUDA

namespace {

// Freed blocks wait in `idle_` by size class; a block goes back out only when every copy
// that read it (its `uses`) has completed.
class PinnedCache {
 public:
  void* allocate(size_t nbytes) {
    const size_t size = memory::size_class(nbytes);
    std::lock_guard lock(mu_);
    auto [lo, hi] = idle_.equal_range(size);
    for (auto it = lo; it != hi; ++it) {
      Block& block = blocks_.at(it->second);
      if (!copies_done(block)) continue;
      void* ptr = it->second;
      idle_.erase(it);
      block.in_use = true;
      stats_.cached -= size;
      stats_.in_use += size;
      stats_.num_cache_hits++;
      return ptr;
    }
    void* ptr = nullptr;
    cudaError_t err = cudaHostAlloc(&ptr, size, cudaHostAllocPortable);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      free_idle();
      err = cudaHostAlloc(&ptr, size, cudaHostAllocPortable);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      LOOM_FAIL("cannot allocate ", size, " bytes of pinned host memory (", cudaGetErrorString(err), "); ",
                stats_.in_use, " bytes are held by tensors: lower the loader's prefetch or batch size");
    }
    blocks_[ptr] = Block{size, true, {}};
    stats_.in_use += size;
    stats_.num_allocs++;
    return ptr;
  }

  // Runs from a Storage deleter, so it must not throw for a pointer it knows.
  void release(void* ptr) {
    std::lock_guard lock(mu_);
    auto it = blocks_.find(ptr);
    if (it == blocks_.end()) return;
    it->second.in_use = false;
    stats_.in_use -= it->second.size;
    stats_.cached += it->second.size;
    idle_.emplace(it->second.size, ptr);
  }

  void record_use(void* ptr, std::shared_ptr<Event> copy_done) {
    std::lock_guard lock(mu_);
    auto it = blocks_.find(ptr);
    if (it == blocks_.end()) return;  // not a pinned block: a pageable copy needs no tracking
    auto& uses = it->second.uses;
    std::erase_if(uses, [](const std::shared_ptr<Event>& e) { return e->query(); });
    uses.push_back(std::move(copy_done));
  }

  bool owns(void* ptr) {
    std::lock_guard lock(mu_);
    return blocks_.contains(ptr);
  }

  PinnedStats stats() {
    std::lock_guard lock(mu_);
    return stats_;
  }

  void empty_cache() {
    std::lock_guard lock(mu_);
    free_idle();
  }

 private:
  struct Block {
    size_t size = 0;
    bool in_use = false;
    std::vector<std::shared_ptr<Event>> uses;  // copies that read the block
  };

  static bool copies_done(Block& block) {
    for (const auto& e : block.uses)
      if (!e->query()) return false;
    block.uses.clear();
    return true;
  }

  void free_idle() {
    for (auto it = idle_.begin(); it != idle_.end();) {
      Block& block = blocks_.at(it->second);
      if (!copies_done(block)) {
        ++it;
        continue;
      }
      cudaFreeHost(it->second);
      stats_.cached -= block.size;
      blocks_.erase(it->second);
      it = idle_.erase(it);
    }
  }

  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;  // every block, in use or idle
  std::multimap<size_t, void*> idle_;        // size class -> idle block
  PinnedStats stats_;
};

PinnedCache& cache() {
  static PinnedCache* c = new PinnedCache;  // never destroyed: see pinned.h
  return *c;
}

}  // namespace

bool pinned_memory_available() { return cuda_available(); }

Tensor pinned_empty(const Shape& shape, DType dtype) {
  check_shape(shape);
  if (!pinned_memory_available()) return Tensor::empty(shape, dtype, Device::cpu());
  const size_t nbytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  void* ptr = cache().allocate(nbytes);
  auto storage = std::make_shared<Storage>(Device::cpu(), ptr, nbytes, [](void* p) { cache().release(p); });
  return Tensor::from_storage(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

bool is_pinned(const Tensor& t) {
  return t.defined() && t.device().is_cpu() && pinned_memory_available() && cache().owns(t.storage()->data());
}

PinnedStats pinned_stats() { return pinned_memory_available() ? cache().stats() : PinnedStats{}; }

void pinned_empty_cache() {
  if (pinned_memory_available()) cache().empty_cache();
}

StreamHandle upload_stream(Device device) {
  LOOM_CHECK(device.is_cuda(), "upload_stream: ", device.str(), " is not a CUDA device");
  set_current_device(device);
  static std::mutex mu;
  static std::vector<cudaStream_t> streams;
  std::lock_guard lock(mu);
  if (streams.empty()) streams.resize(cuda_device_count(), nullptr);
  cudaStream_t& s = streams[device.index];
  if (!s) LOOM_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

Tensor PendingCopy::finish() const {
  done_->wait_on(compute_stream(tensor_.device()));
  return tensor_;
}

PendingCopy copy_to_device_async(const Tensor& host, Device device, StreamHandle stream) {
  LOOM_CHECK(host.defined(), "copy_to_device_async: the host tensor is undefined");
  LOOM_CHECK(host.device().is_cpu(), "copy_to_device_async copies from the CPU, got a tensor on ", host.device().str());
  LOOM_CHECK(host.is_contiguous(), "copy_to_device_async needs a contiguous host tensor, got shape ",
             shape_str(host.shape()), " with strides ", shape_str(host.strides()), ": call contiguous() first");
  LOOM_CHECK(device.is_cuda(), "copy_to_device_async copies to a CUDA device, got ", device.str());
  if (!stream) stream = upload_stream(device);
  set_current_device(device);
  const size_t nbytes = host.nbytes();
  // Stream-ordered for the copy stream, then released only after compute's uses as well.
  auto storage = std::make_shared<Storage>(device, nbytes, stream);
  memory::record_stream(device, storage->data(), compute_stream(device));
  Tensor out = Tensor::from_storage(std::move(storage), host.shape(), contiguous_strides(host.shape()), 0, host.dtype());
  if (nbytes > 0)
    LOOM_CUDA(cudaMemcpyAsync(out.data_ptr(), host.data_ptr(), nbytes, cudaMemcpyHostToDevice,
                              static_cast<cudaStream_t>(stream)));
  auto done = std::make_shared<Event>();
  done->record(stream);
  cache().record_use(host.storage()->data(), done);
  return PendingCopy(std::move(out), std::move(done));
}

#else  // built without CUDA: pinned memory is ordinary memory and there is no device to copy to

bool pinned_memory_available() { return false; }

Tensor pinned_empty(const Shape& shape, DType dtype) {
  check_shape(shape);
  return Tensor::empty(shape, dtype, Device::cpu());
}

bool is_pinned(const Tensor&) { return false; }
PinnedStats pinned_stats() { return {}; }
void pinned_empty_cache() {}

StreamHandle upload_stream(Device device) {
  LOOM_FAIL("upload_stream(", device.str(), ") needs a build of Loom with CUDA");
}

Tensor PendingCopy::finish() const { return tensor_; }

PendingCopy copy_to_device_async(const Tensor&, Device device, StreamHandle) {
  LOOM_FAIL("copy_to_device_async to ", device.str(), " needs a build of Loom with CUDA");
}

#endif

}  // namespace loom
