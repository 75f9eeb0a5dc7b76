// The loader's GPU paths, against the CPU loader: pinned staging and its cache, copies on the
// upload stream, and GPU-resident batches. Every test skips where no GPU is visible.
#include <cuda_runtime.h>

#include <chrono>
#include <thread>

#include "data/loader.h"
#include "engine/ops.h"
#include "tests/common/gpu.h"
#include "tests/data/fixtures.h"

namespace loom::data {
namespace {

using test::synthetic_images;

std::shared_ptr<ImageDataset> augmented_dataset(int64_t count) {
  return std::make_shared<ImageDataset>(
      synthetic_images(count, 3, 8, 8),
      ImageTransforms{{random_crop(8, 2), random_horizontal_flip()}, cifar10_normalization(), 5});
}

// Every batch of an epoch, copied to the host.
struct HostBatches {
  std::vector<Shape> shapes;
  std::vector<std::vector<float>> inputs;
  std::vector<std::vector<int64_t>> targets;
};

HostBatches collect(const DataLoader& loader, int64_t epoch, Device expected_device) {
  HostBatches out;
  for (Batch& b : loader.epoch(epoch)) {
    EXPECT_EQ(b.inputs.device(), expected_device);
    EXPECT_EQ(b.targets.device(), expected_device);
    out.shapes.push_back(b.inputs.shape());
    out.inputs.push_back(b.inputs.to_vector<float>());
    out.targets.push_back(b.targets.to_vector<int64_t>());
  }
  return out;
}

TEST(PinnedMemory, IsPageLockedAndItsBlocksAreReused) {
  LOOM_REQUIRE_CUDA();
  ASSERT_TRUE(pinned_memory_available());
  const Shape shape{1000, 3};
  void* first = nullptr;
  {
    const Tensor t = pinned_empty(shape, DType::f32);
    EXPECT_TRUE(is_pinned(t));
    EXPECT_TRUE(t.device().is_cpu());
    EXPECT_EQ(t.shape(), shape);
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, t.data_ptr()), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);
    first = t.data_ptr();
  }
  const PinnedStats before = pinned_stats();
  const Tensor again = pinned_empty(shape, DType::f32);
  EXPECT_EQ(again.data_ptr(), first);
  EXPECT_EQ(pinned_stats().num_cache_hits, before.num_cache_hits + 1);
  EXPECT_EQ(pinned_stats().num_allocs, before.num_allocs);
  EXPECT_FALSE(is_pinned(Tensor::empty(shape)));
}

TEST(PinnedMemory, CopiesToTheDeviceAndBack) {
  LOOM_REQUIRE_CUDA();
  std::vector<float> values(4096);
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i) * 0.5f;
  for (bool pinned : {true, false}) {
    const Tensor host = pinned ? pinned_empty({64, 64}, DType::f32) : Tensor::empty({64, 64});
    std::copy(values.begin(), values.end(), host.data<float>());
    const Tensor dev = copy_to_device_async(host, Device::cuda(0)).finish();
    EXPECT_EQ(dev.device(), Device::cuda(0));
    EXPECT_EQ(dev.shape(), (Shape{64, 64}));
    EXPECT_EQ(mul(dev, 2.0).to_vector<float>()[4095], values[4095] * 2);
    EXPECT_EQ(dev.to_vector<float>(), values);
  }
  const Tensor host = pinned_empty({4, 4}, DType::f32);
  EXPECT_LOOM_ERROR(copy_to_device_async(host.t(), Device::cuda(0)), "contiguous");
  EXPECT_LOOM_ERROR(copy_to_device_async(host, Device::cpu()), "CUDA device");
}

void CUDART_CB sleep_200ms(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }

TEST(PinnedMemory, ABlockIsNotReusedWhileACopyStillReadsIt) {
  LOOM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  const auto stream = static_cast<cudaStream_t>(upload_stream(gpu));
  void* first = nullptr;
  Tensor dev;
  {
    const Tensor host = pinned_empty({256}, DType::i64);
    for (int64_t i = 0; i < 256; ++i) host.data<int64_t>()[i] = i;
    first = host.data_ptr();
    ASSERT_EQ(cudaLaunchHostFunc(stream, sleep_200ms, nullptr), cudaSuccess);  // holds the copy back
    dev = copy_to_device_async(host, gpu).finish();
  }
  const Tensor reused_early = pinned_empty({256}, DType::i64);
  EXPECT_NE(reused_early.data_ptr(), first) << "a block was handed out while a copy still read it";
  for (int64_t i = 0; i < 256; ++i) reused_early.data<int64_t>()[i] = -1;
  EXPECT_EQ(dev.to_vector<int64_t>()[255], 255);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(pinned_empty({256}, DType::i64).data_ptr(), first);  // free again once the copy is done
}

TEST(DataLoaderCuda, BatchesEqualTheCpuLoader) {
  LOOM_REQUIRE_CUDA();
  const auto ds = augmented_dataset(37);
  const auto sampler = std::make_shared<RandomSampler>(37, 2);
  const DataLoader cpu(ds, sampler, {.batch_size = 8, .num_workers = 2});
  for (int workers : {0, 1, 3}) {
    for (PinMemory pin : {PinMemory::yes, PinMemory::no}) {
      SCOPED_TRACE(testing::Message() << workers << " workers, pinned " << bool(pin));
      const DataLoader gpu(ds, sampler,
                           {.batch_size = 8, .num_workers = workers, .device = Device::cuda(0), .pin_memory = pin});
      for (int64_t e : {0, 1}) {
        const HostBatches want = collect(cpu, e, Device::cpu()), got = collect(gpu, e, Device::cuda(0));
        EXPECT_EQ(got.shapes, want.shapes);
        EXPECT_EQ(got.inputs, want.inputs);
        EXPECT_EQ(got.targets, want.targets);
      }
    }
  }
}

TEST(DataLoaderCuda, BatchesHeldWhileLaterOnesArriveStayIntact) {
  LOOM_REQUIRE_CUDA();
  const auto ds = augmented_dataset(64);
  const auto sampler = std::make_shared<RandomSampler>(64, 6);
  const DataLoader gpu(ds, sampler, {.batch_size = 4, .num_workers = 3, .prefetch = 6, .device = Device::cuda(0)});
  const HostBatches want = collect(DataLoader(ds, sampler, {.batch_size = 4, .num_workers = 0}), 0, Device::cpu());
  std::vector<Batch> held;
  std::vector<Tensor> sums;
  for (Batch& b : gpu.epoch(0)) {
    sums.push_back(sum(mul(b.inputs, b.inputs)));  // compute on each batch as it arrives
    held.push_back(b);
  }
  ASSERT_EQ(held.size(), want.inputs.size());
  for (size_t k = 0; k < held.size(); ++k) {
    EXPECT_EQ(held[k].inputs.to_vector<float>(), want.inputs[k]) << "batch " << k;
    double expected = 0;
    for (float v : want.inputs[k]) expected += double(v) * v;
    EXPECT_NEAR(sums[k].item(), expected, 1e-3 * expected) << "batch " << k;
  }
}

TEST(DataLoaderCuda, ResidentBatchesEqualTheCpuLoader) {
  LOOM_REQUIRE_CUDA();
  const auto ds = std::make_shared<ImageDataset>(synthetic_images(45, 3, 8, 8),
                                                 ImageTransforms{{}, cifar10_normalization(), 0});
  const auto sampler = std::make_shared<RandomSampler>(45, 1);
  const DataLoader cpu(ds, sampler, {.batch_size = 16, .num_workers = 2});
  const DataLoader resident(ds, sampler,
                            {.batch_size = 16, .device = Device::cuda(0), .gpu_resident = GpuResident::yes});
  for (int64_t e : {0, 3}) {
    const HostBatches want = collect(cpu, e, Device::cpu()), got = collect(resident, e, Device::cuda(0));
    ASSERT_EQ(got.shapes, want.shapes);
    EXPECT_EQ(got.targets, want.targets);
    for (size_t k = 0; k < want.inputs.size(); ++k)
      for (size_t i = 0; i < want.inputs[k].size(); ++i)
        ASSERT_NEAR(got.inputs[k][i], want.inputs[k][i], 1e-6) << "batch " << k << ", element " << i;
  }
  EXPECT_LOOM_ERROR(DataLoader(augmented_dataset(4), std::make_shared<SequentialSampler>(4),
                               {.device = Device::cuda(0), .gpu_resident = GpuResident::yes}),
                    "augmentation");
}

}  // namespace
}  // namespace loom::data
