// The cuDNN convolution and the CUDA pooling kernels against the CPU kernels on the same
// inputs. Convolution errors are measured against sum |a||b| (the CPU convolution of the
// magnitudes, in f64), which bounds rounding in any summation order: TF32 keeps 10 bits
// of each f32 input, bf16 and f16 round their outputs to 8 and 11 bits. Every convolution
// runs with cuDNN's graph API on, with and without autotuning, and off (Conv2dArgs::graph_api,
// ::autotune) in one process. Pooling must
// agree exactly on values and argmax indices, and closely on gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/config.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cuda/kernels.h"
#if LOOM_WITH_CUDNN
#include "kernels/cuda/conv_graph.h"
#endif
#include "tests/common/device_buffer.h"
#include "tests/common/gpu.h"
#include "tests/kernels/conv_reference.h"

namespace loom {
namespace {

using test::ConvCase;
using test::DeviceBuffer;
using test::PoolCase;

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <> constexpr DType dtype_of<f16>() { return DType::f16; }

template <class T>
double as_double(T v) {
  if constexpr (std::is_same_v<T, double>) return v;
  else return double(float(v));
}

template <class T>
std::vector<T> random_values(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<T> v(static_cast<size_t>(n));
  for (auto& x : v) x = T(dist(rng));
  return v;
}

template <class T>
std::vector<double> magnitudes(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = std::abs(as_double(v[i]));
  return out;
}

template <class T>
void expect_near_scaled(const std::vector<T>& got, const std::vector<T>& want, const std::vector<double>& scale,
                        double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(as_double(got[i]), as_double(want[i]), tol * scale[i] + 1e-30) << what << " element " << i;
}

const std::vector<ConvCase>& conv_cases() {
  static const std::vector<ConvCase> table = {
      {"3x3_pad1", 2, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1},
      {"3x3_stride2", 3, 4, 9, 7, 6, 3, 3, 2, 2, 1, 1},
      {"3x3_dilation2", 2, 3, 9, 9, 5, 3, 3, 1, 1, 2, 2, 2, 2},
      {"groups2", 2, 4, 6, 6, 6, 3, 3, 1, 1, 1, 1, 1, 1, 2},
      {"depthwise", 2, 8, 6, 6, 8, 3, 3, 1, 1, 1, 1, 1, 1, 8},
      {"1x1", 3, 5, 4, 4, 7, 1, 1},
      {"rect_kernel_stride", 1, 2, 5, 9, 3, 2, 3, 1, 2, 0, 1},
      // The guide's SimpleCNN, first and second layers, at training batch size.
      {"simple_cnn_conv1_batch64", 64, 3, 32, 32, 32, 3, 3, 1, 1, 1, 1},
      {"simple_cnn_conv2", 16, 32, 16, 16, 64, 3, 3, 1, 1, 1, 1},
      // ResNet-18 for 32x32: a strided 3x3 and its 1x1 downsample shortcut.
      {"resnet_stride2", 8, 64, 16, 16, 128, 3, 3, 2, 2, 1, 1},
      {"resnet_downsample_1x1", 8, 64, 16, 16, 128, 1, 1, 2, 2},
  };
  return table;
}

// Device scratch for one pass, as the engine gets it from its allocator.
std::unique_ptr<DeviceBuffer<uint8_t>> workspace(Conv2dArgs& a, ConvPass pass) {
  auto ws = std::make_unique<DeviceBuffer<uint8_t>>(cuda::conv2d_workspace_size(a, pass));
  a.workspace = ws->size() ? ws->get() : nullptr;
  a.workspace_bytes = ws->size();
  return ws;
}

template <class T>
void check_conv(const ConvCase& c, double tol) {
  SCOPED_TRACE(c.name);
  std::mt19937 rng(23);
  Conv2dArgs a = test::conv_args(c, dtype_of<T>());
  const auto x = random_values<T>(test::x_numel(a), rng);
  const auto w = random_values<T>(test::w_numel(a), rng);
  const auto dy = random_values<T>(test::y_numel(a), rng);

  // The CPU kernels give the expected values; the f64 CPU convolution of magnitudes the scale.
  std::vector<T> y(size_t(test::y_numel(a))), dx(size_t(test::x_numel(a))), dw(size_t(test::w_numel(a)));
  cpu::conv2d_forward(a, y.data(), x.data(), w.data(), nullptr);
  cpu::conv2d_backward_data(a, dx.data(), dy.data(), w.data(), nullptr);
  cpu::conv2d_backward_filter(a, dw.data(), x.data(), dy.data(), nullptr);
  Conv2dArgs sa = a;
  sa.dtype = DType::f64;
  const auto ax = magnitudes(x), aw = magnitudes(w), ady = magnitudes(dy);
  std::vector<double> sy(y.size()), sdx(dx.size()), sdw(dw.size());
  cpu::conv2d_forward(sa, sy.data(), ax.data(), aw.data(), nullptr);
  cpu::conv2d_backward_data(sa, sdx.data(), ady.data(), aw.data(), nullptr);
  cpu::conv2d_backward_filter(sa, sdw.data(), ax.data(), ady.data(), nullptr);

  // Tensors at the start of their allocations run on cuDNN's graph API plans; one element
  // further on they are not 16-byte aligned, which sends the call to the convolution API.
  // With graph_api off every call takes the convolution API, the graph plans built in the
  // first rounds notwithstanding. With autotune on, the first aligned call of each pass
  // times cuDNN's candidate plans and the rest run the fastest; off, the heuristics' first.
  struct Mode {
    bool graph_api, autotune;
    const char* name;
  };
  for (const Mode mode : {Mode{true, true, "graph API on, autotuned, "}, Mode{true, false, "graph API on, "},
                          Mode{false, false, "graph API off, "}}) {
    a.graph_api = mode.graph_api;
    a.autotune = mode.autotune;
    for (size_t shift : {size_t(0), size_t(1)}) {
      SCOPED_TRACE(std::string(mode.name) + (shift ? "one element past 16-byte alignment" : "16-byte aligned"));
      auto padded = [shift](const std::vector<T>& v) {
        std::vector<T> out(shift);
        out.insert(out.end(), v.begin(), v.end());
        return out;
      };
      auto unpadded = [shift](const std::vector<T>& v) { return std::vector<T>(v.begin() + long(shift), v.end()); };
      DeviceBuffer<T> gx(padded(x)), gw(padded(w)), gdy(padded(dy));
      DeviceBuffer<T> gy(y.size() + shift), gdx(dx.size() + shift), gdw(dw.size() + shift);
      for (int rep = 0; rep < 2; ++rep) {  // the second round runs on the cached plans
        {
          auto ws = workspace(a, ConvPass::forward);
          cuda::conv2d_forward(a, gy.get() + shift, gx.get() + shift, gw.get() + shift, nullptr);
          expect_near_scaled(unpadded(gy.to_host()), y, sy, tol, "y");
        }
        {
          auto ws = workspace(a, ConvPass::backward_data);
          cuda::conv2d_backward_data(a, gdx.get() + shift, gdy.get() + shift, gw.get() + shift, nullptr);
          expect_near_scaled(unpadded(gdx.to_host()), dx, sdx, tol, "dx");
        }
        {
          // Accumulating into what dx holds: once, however the pass's plans were timed.
          Conv2dArgs acc = a;
          acc.accumulate = true;
          auto ws = workspace(acc, ConvPass::backward_data);
          const std::vector<T> prior = unpadded(gdx.to_host());
          cuda::conv2d_backward_data(acc, gdx.get() + shift, gdy.get() + shift, gw.get() + shift, nullptr);
          const std::vector<T> got = unpadded(gdx.to_host());
          for (size_t i = 0; i < got.size(); ++i)
            ASSERT_NEAR(as_double(got[i]), as_double(prior[i]) + as_double(dx[i]),
                        2 * tol * (sdx[i] + std::abs(as_double(prior[i]))) + 1e-30)
                << "accumulated dx element " << i;
        }
        {
          auto ws = workspace(a, ConvPass::backward_filter);
          cuda::conv2d_backward_filter(a, gdw.get() + shift, gx.get() + shift, gdy.get() + shift, nullptr);
          expect_near_scaled(unpadded(gdw.to_host()), dw, sdw, tol, "dw");
        }
      }
    }
  }
}

#if LOOM_WITH_CUDNN

TEST(ConvCuda, CudnnMatchesCpuF32OnTf32) {
  LOOM_REQUIRE_CUDA();
  for (const auto& c : conv_cases()) check_conv<float>(c, 5e-3);
}
TEST(ConvCuda, CudnnMatchesCpuBf16) {
  LOOM_REQUIRE_CUDA();
  for (const auto& c : conv_cases()) check_conv<bf16>(c, 2e-2);
}
TEST(ConvCuda, CudnnMatchesCpuF16) {
  LOOM_REQUIRE_CUDA();
  for (const auto& c : conv_cases()) check_conv<f16>(c, 5e-3);
}
TEST(ConvCuda, CudnnMatchesCpuF64) {
  LOOM_REQUIRE_CUDA();
  for (const auto& c : conv_cases()) check_conv<double>(c, 1e-10);
}

// The graph API makes a plan for every pass of every case in the training dtypes, so the
// aligned calls above ran on it (a shape it refuses would silently take the convolution
// API instead).
TEST(ConvCuda, GraphApiPlansEveryPassOfEveryCase) {
  LOOM_REQUIRE_CUDA();
  cudnnHandle_t handle = nullptr;
  ASSERT_EQ(cudnnCreate(&handle), CUDNN_STATUS_SUCCESS);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16})
    for (const auto& c : conv_cases())
      for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter}) {
        const Conv2dArgs a = test::conv_args(c, dtype);
        EXPECT_FALSE(cuda::conv_graph::build(a, pass, handle, size_t(1) << 30).empty())
            << c.name << ", " << dtype_name(dtype) << ", pass " << int(pass);
      }
  cudnnDestroy(handle);
}

// Autotuning has plans to choose from: at a shape of SimpleCNN's second layer, f32 on
// TF32, cuDNN's heuristics give every pass more than one plan within autotuning's limits.
TEST(ConvCuda, AutotuningHasSeveralPlansToTime) {
  LOOM_REQUIRE_CUDA();
  cudnnHandle_t handle = nullptr;
  ASSERT_EQ(cudnnCreate(&handle), CUDNN_STATUS_SUCCESS);
  for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter}) {
    const Conv2dArgs a = test::conv_args({"simple_cnn_conv2_batch64", 64, 32, 15, 15, 64, 3, 3}, DType::f32);
    EXPECT_GT(cuda::conv_graph::build(a, pass, handle, size_t(1) << 30, 8, size_t(256) << 20).size(), size_t(1))
        << "pass " << int(pass);
  }
  cudnnDestroy(handle);
}

#else

TEST(ConvCuda, WithoutCudnnSaysSo) {
  LOOM_REQUIRE_CUDA();
  Conv2dArgs a = test::conv_args({"any", 1, 1, 3, 3, 1, 3, 3}, DType::f32);
  try {
    cuda::conv2d_workspace_size(a, ConvPass::forward);
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuDNN"), std::string::npos) << e.what();
  }
}

#endif

// ---- pooling --------------------------------------------------------------------------

const std::vector<PoolCase>& pool_cases() {
  static const std::vector<PoolCase> table = {
      {"2x2", 64, 32, 32, 32, 2, 2, 2, 2},
      {"3x3_stride2_pad1", 4, 8, 33, 30, 3, 3, 2, 2, 1, 1},
      {"3x3_stride1_pad1", 2, 3, 9, 10, 3, 3, 1, 1, 1, 1},
      {"rect_2x3_pad", 2, 2, 7, 9, 2, 3, 1, 2, 1, 1},
      {"stride_past_kernel", 1, 2, 10, 10, 2, 2, 3, 3},
      {"odd_extents", 3, 7, 37, 29, 3, 3, 3, 3, 1, 1},
      // Windows that tile the input: max pooling's backward writes a window a thread.
      {"3x3_tiles", 2, 5, 9, 12, 3, 3, 3, 3},
      {"rect_2x4_tiles", 3, 4, 8, 12, 2, 4, 2, 4},
  };
  return table;
}

template <class T>
void check_pools(const PoolCase& p, ChannelLayout layout, double tol) {
  SCOPED_TRACE(p.name + (layout == ChannelLayout::channels_last ? " channels-last" : " NCHW"));
  std::mt19937 rng(29);
  Pool2dArgs a = test::pool_args(p, dtype_of<T>());
  a.layout = layout;
  const int64_t nx = a.n * a.c * a.h * a.w, ny = a.n * a.c * a.out_h * a.out_w;
  const auto x = random_values<T>(nx, rng), dy = random_values<T>(ny, rng);
  const std::vector<double> ones_y(static_cast<size_t>(ny), 1.0), ones_x(static_cast<size_t>(nx), 1.0);
  std::vector<T> y(static_cast<size_t>(ny)), dx(static_cast<size_t>(nx));
  std::vector<int64_t> idx(static_cast<size_t>(ny));
  DeviceBuffer<T> gx(x), gdy(dy), gy(static_cast<size_t>(ny)), gdx(static_cast<size_t>(nx));
  DeviceBuffer<int64_t> gidx(static_cast<size_t>(ny));

  cpu::max_pool2d_forward(a, y.data(), idx.data(), x.data(), nullptr);
  cpu::max_pool2d_backward(a, dx.data(), dy.data(), idx.data(), nullptr);
  cuda::max_pool2d_forward(a, gy.get(), gidx.get(), gx.get(), nullptr);
  cuda::max_pool2d_backward(a, gdx.get(), gdy.get(), gidx.get(), nullptr);
  EXPECT_EQ(gidx.to_host(), idx);
  expect_near_scaled(gy.to_host(), y, ones_y, 0.0, "max y");
  expect_near_scaled(gdx.to_host(), dx, ones_x, tol, "max dx");

  cpu::avg_pool2d_forward(a, y.data(), x.data(), nullptr);
  cpu::avg_pool2d_backward(a, dx.data(), dy.data(), nullptr);
  cuda::avg_pool2d_forward(a, gy.get(), gx.get(), nullptr);
  cuda::avg_pool2d_backward(a, gdx.get(), gdy.get(), nullptr);
  expect_near_scaled(gy.to_host(), y, ones_y, tol, "avg y");
  expect_near_scaled(gdx.to_host(), dx, ones_x, tol, "avg dx");
}

template <class T> void check_pools(const PoolCase& p, double tol) {
  for (ChannelLayout layout : {ChannelLayout::channels_first, ChannelLayout::channels_last})
    check_pools<T>(p, layout, tol);
}

TEST(PoolCuda, MatchesCpuF32) {
  LOOM_REQUIRE_CUDA();
  for (const auto& p : pool_cases()) check_pools<float>(p, 1e-6);
}
TEST(PoolCuda, MatchesCpuBf16) {
  LOOM_REQUIRE_CUDA();
  for (const auto& p : pool_cases()) check_pools<bf16>(p, 1e-2);
}
TEST(PoolCuda, MatchesCpuF16) {
  LOOM_REQUIRE_CUDA();
  for (const auto& p : pool_cases()) check_pools<f16>(p, 2e-3);
}
// The tests above run the kernels' 32-bit index copy; this one the 64-bit copy that
// buffers of 2^30 elements or more take.
TEST(PoolCuda, The64BitIndexCopyMatchesCpu) {
  LOOM_REQUIRE_CUDA();
  const int64_t limit = cuda::set_pool_index32_limit(0);
  for (const auto& p : pool_cases()) check_pools<float>(p, 1e-6);
  for (const auto& p : pool_cases()) check_pools<bf16>(p, 1e-2);
  cuda::set_pool_index32_limit(limit);
}

}  // namespace
}  // namespace loom
