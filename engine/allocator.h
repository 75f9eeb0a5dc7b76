// Memory for tensors. CPU memory is 64-byte aligned heap memory. CUDA memory comes from
// a caching allocator: cudaMalloc is slow and synchronises, so freed blocks are kept in
// size classes and handed out again, without ever returning to the driver during training.
//
// Size classes: requests round up to 512 bytes below 1 MiB, and above that to a quarter
// of their power of two (at most 25% slack, no splitting, no fragmentation across
// classes). A block is reused only by allocations on the stream it was made for; a
// block that another stream used (record_stream) goes back to the pool only once events
// on those streams show that their work on it is done. This is the rule that lets copy
// and communication streams share memory with compute without device-wide syncs.
// Managed (unified) memory is never used.
#pragma once

#include <cstddef>
#include <cstdint>

#include "device.h"

namespace loom {

struct MemoryStats {
  size_t allocated = 0;       // bytes held by live tensors (rounded to size classes)
  size_t peak_allocated = 0;  // high-water mark of `allocated` since the last reset
  size_t reserved = 0;        // bytes obtained from cudaMalloc and not yet released
  size_t num_allocs = 0;      // cudaMalloc calls made
  size_t num_cache_hits = 0;  // allocations served from the cache
};

namespace memory {

// Allocates nbytes on `device` for use on `stream` (the device's compute stream when
// null). Throws loom::Error on exhaustion, with the statistics in the message.
void* allocate(Device device, size_t nbytes, StreamHandle stream = nullptr);
void release(Device device, void* ptr);
// Marks ptr (from allocate) as used by `stream` too: it is not reused before the work
// queued on `stream` at the time of its release has finished.
void record_stream(Device device, void* ptr, StreamHandle stream);

MemoryStats stats(Device device);
void reset_peak(Device device);
// Returns every cached, unused block of `device` to the driver.
void empty_cache(Device device);
// Bytes that allocations on a GPU could still obtain: the driver's free memory plus the
// blocks this allocator caches unused. -1 for the CPU, and in a build without CUDA.
int64_t available_bytes(Device device);

// CUDA graph capture (engine/cuda_graph.h). Between begin_capture and end_capture every
// allocation on `device` by the thread that called begin_capture comes from pool `pool` (a
// number the graph owns, not 0; other threads allocate as before), and every block released
// meanwhile joins that pool, wherever it was allocated: the graph may read
// or write it at each replay, so nothing outside the graph may get it again. Pool blocks
// released after the capture go back to the pool; allocations outside a capture never take
// them. release_pool hands the pool's free blocks to the ordinary cache (the graph is gone,
// its work done) and sends its live ones there when they are released.
void begin_capture(Device device, int pool);
void end_capture(Device device);
void release_pool(Device device, int pool);
// Bytes in pool `pool`: held by live tensors plus kept free for the graph's replays.
size_t pool_bytes(Device device, int pool);

// Rounded size the allocator serves for a request of nbytes (exposed for tests).
size_t size_class(size_t nbytes);

}  // namespace memory

}  // namespace loom
