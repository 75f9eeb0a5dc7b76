// Fused attention on one GPU: scaled_dot_product_attention forward, and forward plus
// backward, at GPT-2 shapes (and a few neighbours), through the engine op as training
// calls it. FLOPs: forward 4 B H T^2 D (halved when causal), backward 2.5x the forward,
// as flash attention's papers count them. CUDA events, warm-up first, median of the timed
// repetitions. The PyTorch side is samples/bench_attention_torch.py: give its output file
// with --torch FILE and the table gains PyTorch's times and the speed-up (PyTorch ms /
// Loom ms). Prints a table and writes JSON (--json FILE). --deterministic times the
// backward that computes dQ without atomics (Options::deterministic, engine/options.h);
// --no-hopper-attention times the kernels of every target in place of the Hopper ones on an
// H100 or H200 (Options::hopper_attention: the forward, and the backward at head_dim 64 and
// 128).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/options.h"
#include "parallel/diagnostics/json.h"

using namespace loom;
using dist::diagnostics::Json;

namespace {

struct Workload {
  int64_t B, H, T, D;
  bool causal;
  DType dtype;
  std::string name() const {
    std::ostringstream os;
    os << "B" << B << " H" << H << " T" << T << " D" << D << (causal ? " causal " : " full ") << dtype_name(dtype);
    return os.str();
  }
  double forward_flop() const { return 4.0 * B * H * T * T * D * (causal ? 0.5 : 1.0); }
};

// The workloads; bench_attention_torch.py runs the same list, in the same order.
const Workload kWorkloads[] = {
    {16, 12, 1024, 64, true, DType::bf16},   // GPT-2 124M training
    {16, 12, 1024, 64, false, DType::bf16},
    {16, 12, 1024, 64, true, DType::f16},
    {8, 16, 2048, 64, true, DType::bf16},
    {4, 12, 4096, 64, true, DType::bf16},    // GPT-2 124M at T = 4096, 16,384 tokens as above
    {8, 16, 1024, 128, true, DType::bf16},
    {16, 12, 1024, 64, true, DType::f32},
};

// Median milliseconds of `reps` runs of fn on the compute stream, after `warmup`.
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
  Workload shape;
  double fwd_ms, train_ms;
};

Row bench(const Workload& s) {
  const Device dev = Device::cuda(0);
  manual_seed(0);
  Tensor q = randn({s.B, s.H, s.T, s.D}, s.dtype, dev).set_requires_grad();
  Tensor k = randn({s.B, s.H, s.T, s.D}, s.dtype, dev).set_requires_grad();
  Tensor v = randn({s.B, s.H, s.T, s.D}, s.dtype, dev).set_requires_grad();
  Tensor gout = randn({s.B, s.H, s.T, s.D}, s.dtype, dev);
  const int warmup = 10, reps = 50;
  const double fwd = time_ms(
      [&] {
        NoGradGuard no_grad;
        Tensor out = scaled_dot_product_attention(q, k, v, s.causal);
      },
      warmup, reps);
  const double train = time_ms(
      [&] {
        scaled_dot_product_attention(q, k, v, s.causal).backward(gout);
        for (Tensor* t : {&q, &k, &v}) t->zero_grad();
      },
      warmup, reps);
  return {s, fwd, train};
}

// "name|fwd_ms|train_ms" lines, as bench_attention_torch.py writes them.
std::map<std::string, std::pair<double, double>> read_torch(const std::string& path) {
  std::map<std::string, std::pair<double, double>> out;
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "bench_attention: cannot read %s (written by samples/bench_attention_torch.py)\n",
                 path.c_str());
    return out;
  }
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream is(line);
    std::string name, fwd, train;
    if (std::getline(is, name, '|') && std::getline(is, fwd, '|') && std::getline(is, train))
      out[name] = {std::stod(fwd), std::stod(train)};
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, torch_path;
  Options run_options = options();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (arg == "--torch" && i + 1 < argc) torch_path = argv[++i];
    else if (arg == "--deterministic") run_options.deterministic = true;
    else if (arg == "--no-hopper-attention") run_options.hopper_attention = false;
    else {
      std::fprintf(stderr,
                   "bench_attention: unknown argument '%s'\nusage: bench_attention [--json FILE] [--torch FILE] "
                   "[--deterministic] [--no-hopper-attention]\n",
                   arg.c_str());
      return 2;
    }
  }
  set_options(run_options);
  if (!cuda_available()) {
    std::fprintf(stderr, "bench_attention: no CUDA GPU visible; this benchmark needs one\n");
    return 1;
  }
  try {
    const auto torch = torch_path.empty() ? std::map<std::string, std::pair<double, double>>() : read_torch(torch_path);
    std::vector<Row> rows;
    std::printf("%-34s %10s %9s %12s %9s %12s %12s\n", "shape", "fwd ms", "TFLOP/s", "fwd+bwd ms", "TFLOP/s",
                "torch fwd", "torch f+b");
    for (const Workload& s : kWorkloads) {
      const Row r = bench(s);
      rows.push_back(r);
      const double f = s.forward_flop();
      std::printf("%-34s %10.3f %9.1f %12.3f %9.1f", s.name().c_str(), r.fwd_ms, f / (r.fwd_ms * 1e9), r.train_ms,
                  3.5 * f / (r.train_ms * 1e9));
      const auto it = torch.find(s.name());
      if (it != torch.end())
        std::printf(" %7.3f (%.2fx) %7.3f (%.2fx)", it->second.first, it->second.first / r.fwd_ms,
                    it->second.second, it->second.second / r.train_ms);
      std::printf("\n");
      std::fflush(stdout);
    }
    if (!torch.empty()) std::printf("(x): PyTorch ms / Loom ms, above 1 when Loom is faster\n");
    if (!json_path.empty()) {
      Json benchmarks = Json::array();
      for (const Row& r : rows) {
        Json row = Json::object()
                       .set("name", r.shape.name())
                       .set("fwd_ms", r.fwd_ms)
                       .set("fwd_tflops", r.shape.forward_flop() / (r.fwd_ms * 1e9))
                       .set("train_ms", r.train_ms)
                       .set("train_tflops", 3.5 * r.shape.forward_flop() / (r.train_ms * 1e9));
        if (const auto it = torch.find(r.shape.name()); it != torch.end())
          row.set("torch_fwd_ms", it->second.first).set("torch_train_ms", it->second.second);
        benchmarks.push(std::move(row));
      }
      std::ofstream(json_path) << Json::object().set("benchmarks", std::move(benchmarks)).dump(2) << "\n";
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // std::bad_alloc and the like: a message, not std::terminate
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
