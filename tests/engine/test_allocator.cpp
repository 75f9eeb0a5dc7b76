// The allocator's rules that hold without a GPU: the size classes the CUDA cache bins by
// (512-byte steps below 1 MiB, quarter-power-of-two steps above, so slack stays under
// 25% and classes never overlap), and the CPU statistics that follow every allocation.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/ops.h"

namespace loom {
namespace {

constexpr size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

struct ClassCase {
  size_t request, expected;
};

TEST(AllocatorSizeClass, Table) {
  const std::vector<ClassCase> cases = {
      {0, 512},
      {1, 512},
      {511, 512},
      {512, 512},
      {513, 1024},
      {1000, 1024},
      {100 * KiB + 1, 100 * KiB + 512},
      {MiB - 1, MiB},
      {MiB, MiB},
      {MiB + 1, MiB + 256 * KiB},
      {MiB + 256 * KiB, MiB + 256 * KiB},
      {MiB + 256 * KiB + 1, MiB + 512 * KiB},
      {2 * MiB - 1, 2 * MiB},
      {2 * MiB, 2 * MiB},
      {2 * MiB + 1, 2 * MiB + 512 * KiB},
      {3 * MiB + 1, 3 * MiB + 512 * KiB},
      {7 * MiB, 7 * MiB},
      {GiB + 1, GiB + 256 * MiB},
  };
  for (const ClassCase& c : cases) EXPECT_EQ(memory::size_class(c.request), c.expected) << "request " << c.request;
}

// Requests from 1 byte to 4 GiB: every power of two and its neighbours, and a dense run
// of small sizes.
std::vector<size_t> sweep() {
  std::vector<size_t> sizes;
  for (size_t n = 1; n <= 8192; ++n) sizes.push_back(n);
  for (size_t p = 16 * KiB; p <= 4 * GiB; p *= 2)
    for (size_t n : {p - 1, p, p + 1, p + p / 8, p + p / 4 - 1, p + p / 4 + 1, p + p / 3, p + p / 2 + 7, 2 * p - 3})
      sizes.push_back(n);
  return sizes;
}

TEST(AllocatorSizeClass, NeverSmallerAndBoundedSlack) {
  for (size_t n : sweep()) {
    size_t c = memory::size_class(n);
    ASSERT_GE(c, n) << "request " << n;
    EXPECT_EQ(memory::size_class(c), c) << "a class is its own class; request " << n;
    if (n < MiB) {
      EXPECT_EQ(c % 512, 0u) << "request " << n;
      EXPECT_LT(c - n, 512u) << "request " << n;
    } else {
      EXPECT_LE(c - n, n / 4) << "more than 25% slack for request " << n;
      EXPECT_EQ(c % (std::bit_floor(n) / 4), 0u) << "request " << n;
    }
  }
}

TEST(AllocatorSizeClass, MonotonicWithFourClassesPerOctaveAboveOneMiB) {
  size_t previous = 0;
  for (size_t n = 1; n <= 64 * MiB; n += 4093) {
    size_t c = memory::size_class(n);
    ASSERT_GE(c, previous) << "request " << n;
    previous = c;
  }
  for (size_t p = MiB; p <= GiB; p *= 2) {
    std::vector<size_t> classes;
    for (size_t n = p; n < 2 * p; n += p / 64) {
      size_t c = memory::size_class(n);
      if (classes.empty() || classes.back() != c) classes.push_back(c);
    }
    EXPECT_EQ(classes, (std::vector<size_t>{p, p + p / 4, p + p / 2, p + 3 * p / 4, 2 * p})) << "octave " << p;
  }
}

TEST(AllocatorCpu, StatsFollowAllocateAndRelease) {
  const Device cpu = Device::cpu();
  MemoryStats before = memory::stats(cpu);
  void* p = memory::allocate(cpu, 1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << "CPU memory is 64-byte aligned";
  MemoryStats during = memory::stats(cpu);
  EXPECT_GE(during.allocated - before.allocated, 1000u);
  EXPECT_LT(during.allocated - before.allocated, 1000u + 64);
  EXPECT_EQ(during.num_allocs, before.num_allocs + 1);
  EXPECT_GE(during.peak_allocated, during.allocated);
  EXPECT_GE(during.reserved, during.allocated);
  memory::release(cpu, p);
  MemoryStats after = memory::stats(cpu);
  EXPECT_EQ(after.allocated, before.allocated);
  EXPECT_EQ(after.reserved, before.reserved);
  EXPECT_GE(after.peak_allocated, during.allocated) << "the peak remembers the high-water mark";
  memory::release(cpu, nullptr);  // a no-op
  EXPECT_EQ(memory::stats(cpu).allocated, before.allocated);
}

TEST(AllocatorCpu, TensorsMoveTheStatsAndResetPeakForgetsThem) {
  const Device cpu = Device::cpu();
  MemoryStats before = memory::stats(cpu);
  {
    Tensor t = Tensor::empty({256, 256}, DType::f32);
    Tensor view = t.t();  // views allocate nothing
    EXPECT_GE(memory::stats(cpu).allocated - before.allocated, 256u * 256 * 4);
    EXPECT_LT(memory::stats(cpu).allocated - before.allocated, 256u * 256 * 4 + 64);
  }
  MemoryStats after = memory::stats(cpu);
  EXPECT_EQ(after.allocated, before.allocated) << "dropping the last handle frees the storage";
  EXPECT_GE(after.peak_allocated, before.allocated + 256 * 256 * 4);
  memory::reset_peak(cpu);
  EXPECT_EQ(memory::stats(cpu).peak_allocated, memory::stats(cpu).allocated);
  {
    Tensor small = zeros({16});
    EXPECT_GT(memory::stats(cpu).peak_allocated, after.allocated);
  }
  EXPECT_EQ(memory::stats(cpu).allocated, before.allocated);
}

TEST(AllocatorCpu, AvailableBytesIsUnknownOnTheCpu) { EXPECT_EQ(memory::available_bytes(Device::cpu()), -1); }

TEST(AllocatorCpu, CudaDeviceWithoutGpuFailsClearly) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is visible: this checks the message on machines without one";
  try {
    Tensor::empty({4}, DType::f32, Device::cuda(0));
    ADD_FAILURE() << "allocating on cuda:0 without a GPU must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom
