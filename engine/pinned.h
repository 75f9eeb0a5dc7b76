// Pinned (page-locked) host memory, and host-to-device copies that overlap compute.
//
// cudaMemcpyAsync from ordinary (pageable) memory is staged through a driver buffer by the
// CPU before it returns, so it neither runs at the link's full speed nor lets the host move
// on; from page-locked memory the copy engine reads the buffer itself while the host and the
// compute stream carry on. A data loader therefore assembles each batch in pinned memory and
// copies it on a stream of its own.
//
// cudaHostAlloc is slow (it maps and locks pages), so freed pinned blocks are cached by the
// allocator's size classes and handed out again. A block may be freed on the host while a
// copy still reads it, so each copy made here records an event against its source block,
// and a cached block is handed out again only once those events have completed.
//
// The cache is never destroyed: tensors may outlive static destruction, and cudaFreeHost
// after the CUDA runtime has shut down fails. pinned_empty_cache() returns idle blocks.
#pragma once

#include <cstddef>
#include <memory>

#include "device.h"
#include "tensor.h"

namespace loom {

// True when pinned_empty gives page-locked memory: Loom was built with CUDA and a GPU is visible.
bool pinned_memory_available();

// A contiguous CPU tensor in page-locked memory, or in ordinary host memory where pinned
// memory is not available. Allocated portable (usable by every device) under the calling
// thread's current device: a worker thread should set_current_device() first, so that it
// does not create a context on cuda:0 in a process that drives another GPU.
Tensor pinned_empty(const Shape& shape, DType dtype);
// True when `t`'s storage is a block from pinned_empty's cache.
bool is_pinned(const Tensor& t);

struct PinnedStats {
  size_t in_use = 0;          // bytes of blocks held by tensors (rounded to size classes)
  size_t cached = 0;          // bytes of freed blocks kept for reuse
  size_t num_allocs = 0;      // cudaHostAlloc calls made
  size_t num_cache_hits = 0;  // blocks served from the cache
};
PinnedStats pinned_stats();
// Frees every cached block whose copies have finished.
void pinned_empty_cache();

// The stream host-to-device copies of `device` run on (one per device, shared by every
// loader; never destroyed). Makes `device` current on this thread.
StreamHandle upload_stream(Device device);

// A host-to-device copy enqueued on a side stream and not yet ordered before compute.
class PendingCopy {
 public:
  PendingCopy(Tensor device_tensor, std::shared_ptr<Event> done)
      : tensor_(std::move(device_tensor)), done_(std::move(done)) {}
  // Makes the device's compute stream wait for the copy (the host does not wait) and
  // returns the device tensor, from then on safe to use in ops.
  Tensor finish() const;

 private:
  Tensor tensor_;
  std::shared_ptr<Event> done_;  // recorded on the copy stream right after the copy
};

// Enqueues the copy of a contiguous CPU tensor (pinned for a truly asynchronous copy) to
// `device` on `stream` (upload_stream(device) when null). The device memory is allocated
// for `stream` and marked as used by the compute stream too (memory::record_stream), so
// the caching allocator does not hand it out again before compute is done with it.
PendingCopy copy_to_device_async(const Tensor& host, Device device, StreamHandle stream = nullptr);

}  // namespace loom
