// Engine micro-benchmarks on one GPU, each beside its reference in the same run:
//   matmul 4096^3 (f32 on TF32 tensor cores, and bf16) through loom::matmul vs cuBLAS
//   called directly with the same settings; elementwise add over 256M f32 vs the
//   device-to-device copy bandwidth; one training step of a small MLP (the PyTorch side
//   of that one is samples/bench_engine_torch.py, run by the same script).
// CUDA events, warm-up first, median of the timed repetitions. Prints a table and
// writes JSON (--json FILE).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "kernels/cuda/check.h"
#include "parallel/diagnostics/json.h"

using namespace loom;
using dist::diagnostics::Json;

namespace {

// Median milliseconds of `reps` runs of fn on the device's compute stream, after `warmup`.
double time_ms(const std::function<void()>& fn, int warmup, int reps) {
  StreamHandle s = compute_stream(Device::cuda(0));
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    Event start, stop;
    start.record(s);
    fn();
    stop.record(s);
    stop.synchronize();
    ms.push_back(stop.elapsed_ms_since(start));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Row {
  std::string name, unit;
  double loom, reference;
  std::string reference_name;
};

Row bench_matmul(DType dtype) {
  const int n = 4096;
  Device dev = Device::cuda(0);
  Tensor a = randn({n, n}, dtype, dev), b = randn({n, n}, dtype, dev);
  Tensor c = Tensor::empty({n, n}, dtype, dev);
  double loom_ms = time_ms([&] { c = matmul(a, b); }, 10, 50);

  cublasHandle_t h;
  LOOM_CUBLAS(cublasCreate(&h));
  LOOM_CUBLAS(cublasSetStream(h, static_cast<cudaStream_t>(compute_stream(dev))));
  void* workspace = memory::allocate(dev, 32 << 20);
  LOOM_CUBLAS(cublasSetWorkspace(h, workspace, 32 << 20));
  float alpha = 1, beta = 0;
  cudaDataType_t t = dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  cublasComputeType_t compute = dtype == DType::f32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  // Row-major C = A B is column-major C^T = B^T A^T.
  double ref_ms = time_ms(
      [&] {
        LOOM_CUBLAS(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, b.data_ptr(), t, n, a.data_ptr(), t, n,
                                 &beta, c.data_ptr(), t, n, compute, CUBLAS_GEMM_DEFAULT));
      },
      10, 50);
  cublasDestroy(h);
  memory::release(dev, workspace);
  double tflop = 2.0 * n * n * n / 1e12;
  return {std::string("matmul 4096^3 ") + (dtype == DType::f32 ? "f32 (TF32)" : "bf16"), "TFLOP/s",
          tflop / (loom_ms / 1e3), tflop / (ref_ms / 1e3), "cuBLAS direct"};
}

Row bench_add() {
  const int64_t n = int64_t(256) << 20;
  Device dev = Device::cuda(0);
  Tensor a = randn({n}, DType::f32, dev), b = randn({n}, DType::f32, dev), c;
  double add_ms = time_ms([&] { c = add(a, b); }, 5, 30);
  Tensor dst = Tensor::empty({n}, DType::f32, dev);
  auto s = static_cast<cudaStream_t>(compute_stream(dev));
  double copy_ms =
      time_ms([&] { LOOM_CUDA(cudaMemcpyAsync(dst.data_ptr(), a.data_ptr(), n * 4, cudaMemcpyDeviceToDevice, s)); },
              5, 30);
  // Bytes moved: add reads two and writes one; a copy reads one and writes one.
  return {"add 256M f32 (bandwidth)", "GB/s", 3.0 * n * 4 / (add_ms / 1e3) / 1e9, 2.0 * n * 4 / (copy_ms / 1e3) / 1e9,
          "D2D copy"};
}

// One step of a 784-2048-2048-10 MLP with ReLU, cross-entropy and SGD, batch 512.
double bench_mlp_step() {
  Device dev = Device::cuda(0);
  const std::vector<int64_t> sizes = {784, 2048, 2048, 10};
  const int64_t batch = 512;
  std::vector<Tensor> weights, biases;
  manual_seed(0);
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    double bound = 1.0 / std::sqrt(double(sizes[i]));
    Tensor w = Tensor::empty({sizes[i + 1], sizes[i]}, DType::f32, dev), bias = Tensor::empty({sizes[i + 1]}, DType::f32, dev);
    uniform_(w, -bound, bound);
    uniform_(bias, -bound, bound);
    weights.push_back(w.set_requires_grad());
    biases.push_back(bias.set_requires_grad());
  }
  Tensor x = randn({batch, sizes[0]}, DType::f32, dev);
  std::vector<int64_t> labels(batch);
  for (int64_t i = 0; i < batch; ++i) labels[i] = i % 10;
  Tensor y = from_vector(labels, {batch}, dev);
  auto run = [&] {
    Tensor h = x;
    for (size_t i = 0; i < weights.size(); ++i) {
      h = add(matmul(h, weights[i].t()), biases[i]);
      if (i + 1 < weights.size()) h = relu(h);
    }
    cross_entropy(h, y).backward();
    NoGradGuard no_grad;
    for (auto* group : {&weights, &biases})
      for (Tensor& p : *group) {
        add_(p, p.grad(), -0.01);
        p.zero_grad();
      }
  };
  return time_ms(run, 10, 50);
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, torch_mlp_ms;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (arg == "--torch-mlp-ms" && i + 1 < argc) torch_mlp_ms = argv[++i];
    else {
      std::fprintf(stderr, "bench_engine: unknown argument '%s'\nusage: bench_engine [--json FILE] [--torch-mlp-ms MS]\n",
                   arg.c_str());
      return 2;
    }
  }
  if (!cuda_available()) {
    std::fprintf(stderr, "bench_engine: no CUDA GPU visible; these benchmarks need one\n");
    return 1;
  }
  try {
    std::vector<Row> rows = {bench_matmul(DType::f32), bench_matmul(DType::bf16), bench_add()};
    double mlp = bench_mlp_step();
    double torch_ms = torch_mlp_ms.empty() ? 0 : std::stod(torch_mlp_ms);
    std::printf("%-28s %14s %14s %8s  %s\n", "benchmark", "Loom", "reference", "ratio", "reference is");
    for (const Row& r : rows)
      std::printf("%-28s %9.1f %-4s %9.1f %-4s %7.3f  %s\n", r.name.c_str(), r.loom, r.unit.c_str(), r.reference,
                  r.unit.c_str(), r.loom / r.reference, r.reference_name.c_str());
    std::printf("%-28s %11.3f ms %11.3f ms %7.3f  %s\n", "MLP step 784-2048-2048-10 b512", mlp, torch_ms,
                torch_ms > 0 ? torch_ms / mlp : 0.0, "PyTorch eager (ratio = speed-up)");
    if (!json_path.empty()) {
      auto entry = [](const std::string& name, const std::string& unit, double loom_figure, double reference,
                      const std::string& reference_name, double ratio) {
        return Json::object()
            .set("name", name)
            .set("unit", unit)
            .set("loom", loom_figure)
            .set("reference", reference)
            .set("reference_name", reference_name)
            .set("ratio", ratio);
      };
      Json benchmarks = Json::array();
      for (const Row& r : rows)
        benchmarks.push(entry(r.name, r.unit, r.loom, r.reference, r.reference_name, r.loom / r.reference));
      benchmarks.push(entry("mlp_step", "ms", mlp, torch_ms, "PyTorch eager", torch_ms > 0 ? torch_ms / mlp : 0));
      std::ofstream(json_path) << Json::object().set("benchmarks", std::move(benchmarks)).dump(2) << "\n";
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_engine: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // std::bad_alloc and the like: a message, not std::terminate
    std::fprintf(stderr, "bench_engine: %s\n", e.what());
    return 1;
  }
  return 0;
}
