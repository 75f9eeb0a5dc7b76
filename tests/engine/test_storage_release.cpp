// Storage::release / acquire: the memory goes and comes back in the same Storage object, so
// every view, every handle and every copy an op saved for backward sees what was written
// after the acquire; the allocator's count drops while it is released; reading a released
// storage runs its acquire hook or is an error naming what to do.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom {
namespace {

std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    return;
  }
  ADD_FAILURE() << "expected a loom::Error";
}

TEST(StorageRelease, ViewsAndHandlesSeeTheValuesWrittenAfterTheAcquire) {
  Tensor t = from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor handle = t;
  Tensor row = t.select(0, 1);
  Tensor detached = t.detach();
  const Storage* storage = t.storage().get();
  const uint64_t version = storage->version();
  t.storage()->release();
  EXPECT_TRUE(t.storage()->is_released());
  EXPECT_EQ(t.storage()->nbytes(), 6 * sizeof(float));
  t.storage()->acquire();
  EXPECT_NE(storage->version(), version) << "an acquire is a write";
  copy_(t, from_vector(std::vector<float>{7, 8, 9, 10, 11, 12}, {2, 3}));
  EXPECT_EQ(t.storage().get(), storage);
  EXPECT_EQ(values(handle), (std::vector<double>{7, 8, 9, 10, 11, 12}));
  EXPECT_EQ(values(row), (std::vector<double>{10, 11, 12}));
  EXPECT_EQ(values(detached), (std::vector<double>{7, 8, 9, 10, 11, 12}));
}

TEST(StorageRelease, TheAllocatorGetsTheBytesBackWhileReleased) {
  Tensor t = zeros({1 << 16});  // 256 KiB
  const size_t before = memory::stats(Device::cpu()).allocated;
  t.storage()->release();
  EXPECT_EQ(memory::stats(Device::cpu()).allocated, before - memory::size_class(t.nbytes()));
  t.storage()->release();  // a second release does nothing
  EXPECT_EQ(memory::stats(Device::cpu()).allocated, before - memory::size_class(t.nbytes()));
  t.storage()->acquire();
  t.storage()->acquire();  // nor does a second acquire
  EXPECT_EQ(memory::stats(Device::cpu()).allocated, before);
}

TEST(StorageRelease, ABackwardReadsTheWeightItSavedAsReacquired) {
  // mul saves its inputs detached: the saved weight shares p's storage.
  Tensor p = from_vector(std::vector<float>{1, 2, 3}, {3}).set_requires_grad();
  Tensor x = from_vector(std::vector<float>{4, 5, 6}, {3}).set_requires_grad();
  Tensor y = sum(mul(p, x));
  p.storage()->release();  // freed after forward
  p.storage()->acquire();  // gathered again before backward, with other values
  {
    NoGradGuard no_grad;
    copy_(p, from_vector(std::vector<float>{10, 20, 30}, {3}));
  }
  y.backward();
  EXPECT_EQ(values(x.grad()), (std::vector<double>{10, 20, 30}));
  EXPECT_EQ(values(p.grad()), (std::vector<double>{4, 5, 6}));
}

TEST(StorageRelease, ReadingAReleasedStorageRunsItsAcquireHook) {
  Tensor p = from_vector(std::vector<float>{1, 2}, {2});
  Storage* storage = p.storage().get();
  int calls = 0;
  storage->set_acquire_hook([storage, &calls] {
    ++calls;
    storage->acquire();
    std::vector<float> v{3, 4};
    std::copy(v.begin(), v.end(), static_cast<float*>(storage->data()));
  });
  storage->release();
  EXPECT_EQ(values(add(p, 1.0)), (std::vector<double>{4, 5}));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(values(p), (std::vector<double>{3, 4}));
  EXPECT_EQ(calls, 1) << "a held storage runs no hook";
}

TEST(StorageRelease, ReadingAReleasedStorageWithoutHookIsAnError) {
  Tensor p = zeros({4});
  p.storage()->release();
  expect_error([&] { (void)p.data_ptr(); }, {"released storage", "16 bytes", "full state dict"});
  Storage* storage = p.storage().get();
  storage->set_acquire_hook([] {});
  expect_error([&] { (void)p.data_ptr(); }, {"acquire hook returned without acquiring"});
}

TEST(StorageRelease, WrappedMemoryCannotBeReleased) {
  float data[2] = {1, 2};
  auto storage = std::make_shared<Storage>(Device::cpu(), data, sizeof(data), nullptr);
  expect_error([&] { storage->release(); }, {"only memory Loom allocated", "does not own"});
}

}  // namespace
}  // namespace loom
