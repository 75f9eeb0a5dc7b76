// Safetensors from and to the GPU: tensors saved from cuda:0 (non-contiguous ones too)
// come back on cuda:0 with the same bytes, and a file saved from the GPU loads on the CPU.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "engine/ops.h"
#include "engine/serialization.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

struct TempDir {
  std::string path;
  TempDir() {
    char name[] = "/tmp/loom_safetensors_cuda_XXXXXX";
    EXPECT_NE(::mkdtemp(name), nullptr);
    path = name;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

std::vector<std::pair<std::string, Tensor>> gpu_tensors() {
  manual_seed(7);
  Device gpu = Device::cuda(0);
  Tensor base = randn({6, 5}, DType::f32, gpu);
  return {{"f32", base},
          {"transposed", base.t()},
          {"bf16_stepped", base.to(DType::bf16).slice(0, 1, 6, 2)},
          {"f16", base.to(DType::f16)},
          {"i64", arange(0, 10, 1, DType::i64, gpu).reshape({2, 5})},
          {"u8_scalar", scalar_tensor(7, DType::u8, gpu)},
          {"empty", zeros({0, 3}, DType::f32, gpu)}};
}

TEST(SafetensorsCuda, SavedFromGpuLoadsOnGpu) {
  LOOM_REQUIRE_CUDA();
  TempDir dir;
  std::string path = dir.path + "/gpu.safetensors";
  auto saved = gpu_tensors();
  save_safetensors(path, saved, {{"device", "cuda:0"}});
  SafetensorsFile loaded = load_safetensors(path, Device::cuda(0));
  EXPECT_EQ(loaded.metadata.at("device"), "cuda:0");
  ASSERT_EQ(loaded.tensors.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    SCOPED_TRACE(saved[i].first);
    const Tensor& got = loaded.tensors[i].second;
    EXPECT_EQ(loaded.tensors[i].first, saved[i].first);
    EXPECT_EQ(got.device(), Device::cuda(0));
    EXPECT_EQ(got.dtype(), saved[i].second.dtype());
    EXPECT_EQ(got.shape(), saved[i].second.shape());
    EXPECT_EQ(got.to_vector<double>(), saved[i].second.to_vector<double>());
  }
}

TEST(SafetensorsCuda, SavedFromGpuLoadsOnCpu) {
  LOOM_REQUIRE_CUDA();
  TempDir dir;
  std::string path = dir.path + "/gpu.safetensors";
  auto saved = gpu_tensors();
  save_safetensors(path, saved);
  auto loaded = load_safetensors_map(path);
  for (const auto& [name, t] : saved) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(loaded.at(name).device().is_cpu());
    EXPECT_EQ(loaded.at(name).to_vector<double>(), t.to_vector<double>());
  }
}

}  // namespace
}  // namespace loom
