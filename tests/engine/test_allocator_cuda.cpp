// The CUDA caching allocator and device plumbing on a real GPU: freed blocks come back
// for the same size class without cudaMalloc, the statistics follow tensors, empty_cache
// returns everything unused, available_bytes counts the driver's free memory and the
// cache, record_stream holds a block back until the other stream's work is done, and tensors cross between host and device exactly (every dtype,
// non-contiguous either side). Each test skips where no GPU is visible.
//
// The record_stream test needs a stream that is provably still busy: a host function
// queued on it waits for the test to open a gate, so "not done yet" is a fact, not a
// race against a kernel's running time. The gate opens by itself after a few seconds so
// a broken allocator fails the test instead of hanging it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/allocator.h"
#include "engine/ops.h"
#include "kernels/cuda/check.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

constexpr size_t MiB = size_t(1) << 20;
const Device kGpu = Device::cuda(0);

// Waits for all work on the GPU and returns every cached block, so counts start clean.
void quiesce() {
  LOOM_CUDA(cudaDeviceSynchronize());
  memory::empty_cache(kGpu);
}

std::vector<double> host_values(const Tensor& t) { return t.to(Device::cpu()).to_vector<double>(); }

// Holds a stream busy until opened (or until a few seconds pass).
class Gate {
 public:
  explicit Gate(StreamHandle stream) : stream_(stream) {
    LOOM_CUDA(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), &Gate::wait, &open_));
  }
  ~Gate() {
    open();
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));  // the host function reads open_
  }
  void open() { open_.store(true); }

 private:
  static void wait(void* flag) {
    auto* open = static_cast<std::atomic<bool>*>(flag);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!open->load() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  StreamHandle stream_;
  std::atomic<bool> open_{false};
};

TEST(AllocatorCuda, FreedBlockIsReusedForTheSameSizeClass) {
  LOOM_REQUIRE_CUDA();
  quiesce();
  const size_t n = 3 * MiB + 12345;  // class 3.5 MiB
  MemoryStats s0 = memory::stats(kGpu);
  void* p = memory::allocate(kGpu, n);
  MemoryStats s1 = memory::stats(kGpu);
  EXPECT_EQ(s1.num_allocs, s0.num_allocs + 1);
  EXPECT_EQ(s1.allocated - s0.allocated, memory::size_class(n));
  EXPECT_EQ(s1.reserved - s0.reserved, memory::size_class(n));
  memory::release(kGpu, p);
  MemoryStats s2 = memory::stats(kGpu);
  EXPECT_EQ(s2.allocated, s0.allocated);
  EXPECT_EQ(s2.reserved, s1.reserved) << "a freed block stays cached";
  void* q = memory::allocate(kGpu, n - 1000);  // another request of the same class
  MemoryStats s3 = memory::stats(kGpu);
  EXPECT_EQ(q, p);
  EXPECT_EQ(s3.num_allocs, s2.num_allocs) << "a cache hit makes no cudaMalloc";
  EXPECT_EQ(s3.num_cache_hits, s2.num_cache_hits + 1);
  void* other = memory::allocate(kGpu, 5 * MiB);  // another class never takes it
  EXPECT_NE(other, p);
  EXPECT_EQ(memory::stats(kGpu).num_allocs, s3.num_allocs + 1);
  memory::release(kGpu, q);
  memory::release(kGpu, other);
  {
    Tensor t = Tensor::empty({int64_t(n / 4)}, DType::f32, kGpu);  // tensors go through the same cache
    EXPECT_EQ(t.data_ptr(), p);
  }
  quiesce();
}

TEST(AllocatorCuda, StatsFollowTensorsAndEmptyCacheReturnsTheRest) {
  LOOM_REQUIRE_CUDA();
  quiesce();
  MemoryStats s0 = memory::stats(kGpu);
  memory::reset_peak(kGpu);
  EXPECT_EQ(memory::stats(kGpu).peak_allocated, s0.allocated);
  MemoryStats s1;
  {
    Tensor a = Tensor::empty({int64_t(MiB)}, DType::f32, kGpu);    // 4 MiB
    Tensor b = Tensor::empty({int64_t(MiB / 4)}, DType::f32, kGpu);  // 1 MiB
    Tensor view = a.reshape({1024, -1}).t();                         // views allocate nothing
    s1 = memory::stats(kGpu);
    EXPECT_EQ(s1.allocated, s0.allocated + 5 * MiB);
    EXPECT_EQ(s1.peak_allocated, s1.allocated);
    EXPECT_EQ(s1.reserved, s0.reserved + 5 * MiB);
  }
  MemoryStats s2 = memory::stats(kGpu);
  EXPECT_EQ(s2.allocated, s0.allocated);
  EXPECT_EQ(s2.peak_allocated, s0.allocated + 5 * MiB) << "the peak remembers the high-water mark";
  EXPECT_EQ(s2.reserved, s1.reserved) << "freed tensors stay cached";
  memory::reset_peak(kGpu);
  EXPECT_EQ(memory::stats(kGpu).peak_allocated, s2.allocated);
  memory::empty_cache(kGpu);
  MemoryStats s3 = memory::stats(kGpu);
  EXPECT_EQ(s3.reserved, s3.allocated) << "only live blocks stay reserved (0 when nothing is live)";
  EXPECT_EQ(s3.reserved, s0.reserved);
}

TEST(AllocatorCuda, AvailableBytesCountsTheDriversFreeMemoryAndTheCache) {
  LOOM_REQUIRE_CUDA();
  quiesce();
  size_t free_b = 0, total_b = 0;
  LOOM_CUDA(cudaMemGetInfo(&free_b, &total_b));
  const int64_t before = memory::available_bytes(kGpu);
  EXPECT_GT(before, 0);
  EXPECT_LE(before, int64_t(total_b));
  const int64_t slack = int64_t(4 * MiB);  // the driver's own small allocations
  {
    Tensor t = Tensor::empty({int64_t(64 * MiB / 4)}, DType::f32, kGpu);  // 64 MiB, live
    const int64_t held = memory::available_bytes(kGpu);
    EXPECT_NEAR(double(held), double(before - int64_t(64 * MiB)), double(slack));
  }
  // Freed into the cache: unused, so available again without going back to the driver.
  EXPECT_GT(memory::stats(kGpu).reserved, memory::stats(kGpu).allocated);
  EXPECT_NEAR(double(memory::available_bytes(kGpu)), double(before), double(slack));
  quiesce();
  EXPECT_NEAR(double(memory::available_bytes(kGpu)), double(before), double(slack));
}

TEST(AllocatorCuda, RecordStreamDelaysReuseUntilTheOtherStreamIsDone) {
  LOOM_REQUIRE_CUDA();
  quiesce();
  const size_t n = 2 * MiB + 777;  // class 2.5 MiB
  Stream side(kGpu);
  void* p = nullptr;
  {
    Gate gate(side.handle());  // `side` is busy until the gate opens
    Event side_done;
    p = memory::allocate(kGpu, n);  // for the compute stream
    memory::record_stream(kGpu, p, side.handle());
    memory::release(kGpu, p);  // side may still be using p
    side_done.record(side.handle());
    MemoryStats s1 = memory::stats(kGpu);
    void* q = memory::allocate(kGpu, n);
    EXPECT_NE(q, p) << "a block must not be reused while another stream's work on it is pending";
    EXPECT_EQ(memory::stats(kGpu).num_allocs, s1.num_allocs + 1);
    EXPECT_FALSE(side_done.query()) << "the gate should hold the side stream";
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a not-ready query must leave no error for the next launch check";
    gate.open();
    side_done.synchronize();
    EXPECT_TRUE(side_done.query());
    MemoryStats s2 = memory::stats(kGpu);
    void* r = memory::allocate(kGpu, n);
    EXPECT_EQ(r, p) << "once the side stream is done the block is reusable";
    EXPECT_EQ(memory::stats(kGpu).num_allocs, s2.num_allocs);
    EXPECT_EQ(memory::stats(kGpu).num_cache_hits, s2.num_cache_hits + 1);
    memory::release(kGpu, q);
    memory::release(kGpu, r);
  }
  // Recording the block's own stream changes nothing: it is reusable at once.
  void* a = memory::allocate(kGpu, n);
  memory::record_stream(kGpu, a, compute_stream(kGpu));
  memory::release(kGpu, a);
  void* b = memory::allocate(kGpu, n);
  EXPECT_EQ(b, a);
  memory::release(kGpu, b);
  quiesce();
}

TEST(AllocatorCuda, EveryDtypeRoundTripsBitExactly) {
  LOOM_REQUIRE_CUDA();
  std::mt19937 rng(42);
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    Tensor host = Tensor::empty({3, 257}, dt);  // arbitrary bit patterns, NaNs included
    auto* bytes = static_cast<unsigned char*>(host.data_ptr());
    for (size_t i = 0; i < host.nbytes(); ++i) bytes[i] = static_cast<unsigned char>(rng());
    Tensor dev = host.to(kGpu);
    EXPECT_EQ(dev.device(), kGpu);
    EXPECT_EQ(dev.dtype(), dt);
    EXPECT_EQ(dev.shape(), host.shape());
    Tensor back = dev.to(Device::cpu());
    EXPECT_TRUE(back.device().is_cpu());
    ASSERT_EQ(back.nbytes(), host.nbytes());
    EXPECT_EQ(std::memcmp(back.data_ptr(), host.data_ptr(), host.nbytes()), 0);
  }
}

TEST(AllocatorCuda, NonContiguousCopiesAcrossDevices) {
  LOOM_REQUIRE_CUDA();
  Tensor x = arange(0, 12, 1, DType::f32).reshape({3, 4});
  const std::vector<double> xt = {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11};
  // Host view to device.
  Tensor d = x.t().to(kGpu);
  EXPECT_EQ(d.shape(), (Shape{4, 3}));
  EXPECT_EQ(host_values(d), xt);
  // Device view to host.
  EXPECT_EQ(host_values(x.to(kGpu).t()), xt);
  EXPECT_EQ(host_values(x.to(kGpu).slice(1, 1, 4, 2)), (std::vector<double>{1, 3, 5, 7, 9, 11}));
  // Into a non-contiguous device destination.
  Tensor dst = zeros({4, 3}, DType::f32, kGpu);
  copy_(dst.t(), x);
  EXPECT_EQ(host_values(dst), xt);
  // Converting dtype and broadcasting on the way.
  Tensor conv = zeros({3, 4}, DType::bf16, kGpu);
  copy_(conv, arange(0, 12).reshape({3, 4}));
  EXPECT_EQ(host_values(conv), host_values(x));
  Tensor rows = zeros({3, 4}, DType::f32, kGpu);
  copy_(rows, arange(0, 4, 1, DType::f32));
  EXPECT_EQ(host_values(rows), (std::vector<double>{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}));
  // Into a non-contiguous host destination from the device.
  Tensor host_dst = zeros({4, 3});
  copy_(host_dst.t(), x.to(kGpu));
  EXPECT_EQ(host_dst.to_vector<double>(), xt);
}

TEST(AllocatorCuda, ItemAndToVectorReadTheGpu) {
  LOOM_REQUIRE_CUDA();
  EXPECT_EQ(from_vector(std::vector<float>{2.5f}, {1}, kGpu).item(), 2.5);
  EXPECT_EQ(scalar_tensor(-3, DType::i64, kGpu).item(), -3.0);
  EXPECT_EQ(full({}, 0.75, DType::bf16, kGpu).item(), 0.75);
  EXPECT_EQ(from_vector(std::vector<float>{1, 2, 3}, {3}, kGpu).to_vector<float>(), (std::vector<float>{1, 2, 3}));
  std::string s = from_vector(std::vector<float>{1.5f}, {1}, kGpu).str();
  EXPECT_NE(s.find("device=cuda:0"), std::string::npos) << s;
  EXPECT_NE(s.find("1.5"), std::string::npos) << s;
}

TEST(AutogradCuda, ToDeviceIsDifferentiable) {
  LOOM_REQUIRE_CUDA();
  Tensor x = from_vector(std::vector<float>{1, 2, 3}, {3});
  x.set_requires_grad();
  Tensor y = x.to(kGpu);
  EXPECT_TRUE(y.requires_grad());
  sum(mul(y, y)).backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(x.grad().device().is_cpu());
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{2, 4, 6}));
}

TEST(AllocatorCuda, DeviceParse) {
  LOOM_REQUIRE_CUDA();
  struct Good {
    const char* text;
    Device device;
  };
  for (const Good& g : {Good{"cpu", Device::cpu()}, Good{"cuda", Device::cuda(0)}, Good{"cuda:0", Device::cuda(0)},
                        Good{"cuda:3", Device::cuda(3)}}) {
    EXPECT_EQ(Device::parse(g.text), g.device) << g.text;
    EXPECT_EQ(Device::parse(g.device.str()), g.device) << "str() parses back";
  }
  for (const char* bad : {"cuda:x", "cuda:", "cuda:-1", "cuda:1x", "gpu", "CPU", " cuda", "cuda0"}) {
    try {
      Device::parse(bad);
      ADD_FAILURE() << "'" << bad << "' parsed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(AllocatorCuda, EventTimingIsPositive) {
  LOOM_REQUIRE_CUDA();
  StreamHandle s = compute_stream(kGpu);
  Event start, stop;
  start.record(s);
  LOOM_CUDA(cudaLaunchHostFunc(
      static_cast<cudaStream_t>(s), [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(5)); },
      nullptr));
  Tensor work = zeros({int64_t(16 * MiB)}, DType::f32, kGpu);  // and some GPU work too
  stop.record(s);
  stop.synchronize();
  EXPECT_TRUE(stop.query());
  float ms = stop.elapsed_ms_since(start);
  EXPECT_GT(ms, 4.0f) << "the stream slept 5 ms between the events";
  EXPECT_LT(ms, 5000.0f);
}

}  // namespace
}  // namespace loom
