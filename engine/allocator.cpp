#include "engine/allocator.h"

#include <bit>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <thread>
#include <unordered_set>
#include <vector>

#include "kernels/config.h"
#include "kernels/core/error.h"

#if LOOM_WITH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/check.h"
#endif

namespace loom::memory {

size_t size_class(size_t nbytes) {
  constexpr size_t kSmall = 512, kLarge = size_t(1) << 20;
  if (nbytes == 0) nbytes = 1;
  if (nbytes < kLarge) return (nbytes + kSmall - 1) / kSmall * kSmall;
  size_t step = std::bit_floor(nbytes) / 4;
  return (nbytes + step - 1) / step * step;
}

namespace {

std::string human(size_t bytes) {
  char buf[32];
  if (bytes >= (size_t(1) << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(size_t(1) << 30));
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", double(bytes) / double(1 << 20));
  return buf;
}

#if LOOM_WITH_CUDA

struct Block {
  size_t size;
  StreamHandle stream;
  std::vector<StreamHandle> other_streams;
  int pool = 0;  // 0: the ordinary cache; else a CUDA graph's (begin_capture)
};

struct Pending {  // released, waiting for other streams' events
  void* ptr;
  std::vector<cudaEvent_t> events;
};

class DeviceCache {
 public:
  explicit DeviceCache(int index) : index_(index) {}

  void* allocate(size_t nbytes, StreamHandle stream) {
    size_t size = size_class(nbytes);
    std::lock_guard lock(mu_);
    reclaim_pending();
    // Only the capturing thread allocates from the pool: another thread's tensor (a data
    // loader's next batch) must never get a block the graph writes at its replays.
    const int pool = capture_pool_ != 0 && std::this_thread::get_id() == capture_thread_ ? capture_pool_ : 0;
    auto& bin = free_[key(size, stream, pool)];
    void* ptr = nullptr;
    if (!bin.empty()) {
      ptr = bin.back();
      bin.pop_back();
      stats_.num_cache_hits++;
    } else {
      cudaError_t err = cudaMalloc(&ptr, size);
      // Freeing the cache synchronizes the device, which a capture cannot do.
      if (err == cudaErrorMemoryAllocation && pool == 0) {
        cudaGetLastError();
        release_cached();
        err = cudaMalloc(&ptr, size);
      }
      if (err != cudaSuccess) {
        cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        LOOM_FAIL("CUDA out of memory on cuda:", index_, " allocating ", human(size), ": Loom holds ",
                  human(stats_.allocated), " in tensors and ", human(stats_.reserved),
                  " reserved; the GPU has ", human(free_b), " free of ", human(total_b),
                  ". Reduce the batch size, use bf16, or free tensors you no longer need.");
      }
      stats_.reserved += size;
      stats_.num_allocs++;
    }
    live_[ptr] = Block{size, stream, {}, pool};
    stats_.allocated += size;
    stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
    return ptr;
  }

  void release(void* ptr) {
    std::lock_guard lock(mu_);
    auto it = live_.find(ptr);
    LOOM_ASSERT(it != live_.end(), "release of a pointer the allocator does not own");
    Block block = std::move(it->second);
    live_.erase(it);
    stats_.allocated -= block.size;
    if (capture_pool_ != 0) block.pool = capture_pool_;  // the graph may use it: it stays the graph's
    else if (block.pool != 0 && !live_pools_.count(block.pool)) block.pool = 0;
    if (block.other_streams.empty()) {
      free_[key(block.size, block.stream, block.pool)].push_back(ptr);
      return;
    }
    Pending p{ptr, {}};
    for (StreamHandle s : block.other_streams) {
      cudaEvent_t ev;
      LOOM_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      LOOM_CUDA(cudaEventRecord(ev, static_cast<cudaStream_t>(s)));
      p.events.push_back(ev);
    }
    pending_blocks_[ptr] = std::move(block);
    pending_.push_back(std::move(p));
  }

  void record_stream(void* ptr, StreamHandle stream) {
    std::lock_guard lock(mu_);
    auto it = live_.find(ptr);
    LOOM_ASSERT(it != live_.end(), "record_stream on a pointer the allocator does not own");
    if (stream != it->second.stream) it->second.other_streams.push_back(stream);
  }

  MemoryStats stats() {
    std::lock_guard lock(mu_);
    return stats_;
  }
  void begin_capture(int pool) {
    std::lock_guard lock(mu_);
    LOOM_CHECK(capture_pool_ == 0, "cuda:", index_, " is already being captured (pool ", capture_pool_,
               "); one capture at a time a device");
    LOOM_ASSERT(pool != 0, "pool 0 is the ordinary cache");
    capture_pool_ = pool;
    capture_thread_ = std::this_thread::get_id();
    live_pools_.insert(pool);
  }
  void end_capture() {
    std::lock_guard lock(mu_);
    capture_pool_ = 0;
  }
  void release_pool(int pool) {
    std::lock_guard lock(mu_);
    live_pools_.erase(pool);
    // Taken out first: inserting into free_ while walking it could rehash it under the walk.
    std::vector<std::pair<Key, std::vector<void*>>> moved;
    for (auto it = free_.begin(); it != free_.end();) {
      if (it->first.pool != pool) {
        ++it;
        continue;
      }
      moved.emplace_back(it->first, std::move(it->second));
      it = free_.erase(it);
    }
    for (auto& [k, ptrs] : moved) {
      auto& to = free_[key(k.size, k.stream, 0)];
      to.insert(to.end(), ptrs.begin(), ptrs.end());
    }
  }
  size_t pool_bytes(int pool) {
    std::lock_guard lock(mu_);
    size_t bytes = 0;
    for (const auto& [ptr, block] : live_)
      if (block.pool == pool) bytes += block.size;
    for (const auto& [k, ptrs] : free_)
      if (k.pool == pool) bytes += k.size * ptrs.size();
    return bytes;
  }

  void reset_peak() {
    std::lock_guard lock(mu_);
    stats_.peak_allocated = stats_.allocated;
  }
  void empty_cache() {
    std::lock_guard lock(mu_);
    reclaim_pending();
    release_cached();
  }

 private:
  struct Key {
    size_t size;
    StreamHandle stream;
    int pool;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<size_t>()(k.size) ^ std::hash<void*>()(k.stream) ^ (std::hash<int>()(k.pool) << 1);
    }
  };
  static Key key(size_t size, StreamHandle stream, int pool) { return {size, stream, pool}; }

  void reclaim_pending() {
    for (size_t i = 0; i < pending_.size();) {
      bool done = true;
      for (cudaEvent_t ev : pending_[i].events) done = done && cudaEventQuery(ev) == cudaSuccess;
      if (!done) {
        cudaGetLastError();  // cudaErrorNotReady is not an error here
        ++i;
        continue;
      }
      for (cudaEvent_t ev : pending_[i].events) cudaEventDestroy(ev);
      auto node = pending_blocks_.extract(pending_[i].ptr);
      int pool = node.mapped().pool;
      if (pool != 0 && !live_pools_.count(pool)) pool = 0;
      free_[key(node.mapped().size, node.mapped().stream, pool)].push_back(pending_[i].ptr);
      pending_[i] = std::move(pending_.back());
      pending_.pop_back();
    }
  }

  // The ordinary cache's free blocks go back to the driver; a graph's pool keeps its own.
  void release_cached() {
    for (auto it = free_.begin(); it != free_.end();) {
      if (it->first.pool != 0) {
        ++it;
        continue;
      }
      for (void* p : it->second) {
        cudaFree(p);
        stats_.reserved -= it->first.size;
      }
      it = free_.erase(it);
    }
  }

  int index_;
  std::mutex mu_;
  std::unordered_map<Key, std::vector<void*>, KeyHash> free_;
  std::unordered_map<void*, Block> live_;
  std::unordered_map<void*, Block> pending_blocks_;
  std::vector<Pending> pending_;
  MemoryStats stats_;
  int capture_pool_ = 0;          // the pool of the capture under way, 0 when none
  std::thread::id capture_thread_;  // the thread capturing
  std::unordered_set<int> live_pools_;
};

DeviceCache& cache(Device device) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<DeviceCache>> caches;
  std::lock_guard lock(mu);
  if (caches.empty()) caches.resize(std::max(1, cuda_device_count()));
  LOOM_CHECK(device.index < int(caches.size()), "device ", device.str(), " does not exist");
  auto& c = caches[device.index];
  if (!c) c = std::make_unique<DeviceCache>(device.index);
  return *c;
}

#endif

struct CpuStats {
  std::mutex mu;
  MemoryStats stats;
  std::unordered_map<void*, size_t> sizes;
};
CpuStats& cpu_stats() {
  static CpuStats s;
  return s;
}

}  // namespace

void* allocate(Device device, size_t nbytes, StreamHandle stream) {
  if (device.is_cpu()) {
    size_t size = (std::max<size_t>(nbytes, 1) + 63) / 64 * 64;
    void* ptr = std::aligned_alloc(64, size);
    LOOM_CHECK(ptr, "out of host memory allocating ", human(size));
    auto& s = cpu_stats();
    std::lock_guard lock(s.mu);
    s.sizes[ptr] = size;
    s.stats.allocated += size;
    s.stats.reserved += size;
    s.stats.num_allocs++;
    s.stats.peak_allocated = std::max(s.stats.peak_allocated, s.stats.allocated);
    return ptr;
  }
#if LOOM_WITH_CUDA
  set_current_device(device);
  if (!stream) stream = compute_stream(device);
  return cache(device).allocate(nbytes, stream);
#else
  LOOM_FAIL("cannot allocate on ", device.str(), ": this build of Loom has no CUDA");
#endif
}

void release(Device device, void* ptr) {
  if (!ptr) return;
  if (device.is_cpu()) {
    auto& s = cpu_stats();
    {
      std::lock_guard lock(s.mu);
      auto it = s.sizes.find(ptr);
      if (it != s.sizes.end()) {
        s.stats.allocated -= it->second;
        s.stats.reserved -= it->second;
        s.sizes.erase(it);
      }
    }
    std::free(ptr);
    return;
  }
#if LOOM_WITH_CUDA
  cache(device).release(ptr);
#endif
}

void record_stream(Device device, void* ptr, StreamHandle stream) {
#if LOOM_WITH_CUDA
  if (device.is_cuda()) cache(device).record_stream(ptr, stream);
#endif
}

MemoryStats stats(Device device) {
  if (device.is_cpu()) {
    std::lock_guard lock(cpu_stats().mu);
    return cpu_stats().stats;
  }
#if LOOM_WITH_CUDA
  return cache(device).stats();
#else
  return {};
#endif
}

void reset_peak(Device device) {
  if (device.is_cpu()) {
    std::lock_guard lock(cpu_stats().mu);
    cpu_stats().stats.peak_allocated = cpu_stats().stats.allocated;
    return;
  }
#if LOOM_WITH_CUDA
  cache(device).reset_peak();
#endif
}

void empty_cache(Device device) {
#if LOOM_WITH_CUDA
  if (device.is_cuda()) cache(device).empty_cache();
#endif
}

void begin_capture(Device device, int pool) {
  LOOM_CHECK(device.is_cuda(), "a capture pool needs a CUDA device, got ", device.str());
#if LOOM_WITH_CUDA
  cache(device).begin_capture(pool);
#else
  (void)pool;
#endif
}

void end_capture(Device device) {
#if LOOM_WITH_CUDA
  if (device.is_cuda()) cache(device).end_capture();
#endif
}

void release_pool(Device device, int pool) {
#if LOOM_WITH_CUDA
  if (device.is_cuda()) cache(device).release_pool(pool);
#else
  (void)pool;
#endif
}

size_t pool_bytes(Device device, int pool) {
#if LOOM_WITH_CUDA
  if (device.is_cuda()) return cache(device).pool_bytes(pool);
#endif
  (void)device;
  (void)pool;
  return 0;
}

int64_t available_bytes(Device device) {
#if LOOM_WITH_CUDA
  if (device.is_cuda()) {
    set_current_device(device);
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
      cudaGetLastError();
      return -1;
    }
    const MemoryStats s = cache(device).stats();
    return int64_t(free_b + (s.reserved - s.allocated));
  }
#endif
  (void)device;
  return -1;
}

}  // namespace loom::memory
