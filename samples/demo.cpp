// Loom's first program: trains a small MLP (2-64-64-3, tanh) to separate three
// interleaved spirals, on the GPU when one is visible and on the CPU otherwise, printing
// the loss as it falls and the final training accuracy. Everything it uses is the
// engine: tensors, autograd, matmul, cross-entropy and a hand-written SGD step.
//   demo [--device cpu|cuda[:N]] [--steps N] [--lr X] [--seed N]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"

using namespace loom;

namespace {

struct Options {
  Device device = default_device();
  int steps = 600;
  double lr = 0.5;
  uint64_t seed = 0;
};

constexpr const char* kUsage =
    "usage: demo [--device cpu|cuda|cuda:N] [--steps N] [--lr X] [--seed N]\n"
    "  trains a small MLP on three spirals and prints its loss\n";

[[noreturn]] void usage(const std::string& problem) {
  std::fprintf(stderr, "demo: %s\n%s", problem.c_str(), kUsage);
  std::exit(2);
}

long parse_int(const std::string& flag, const char* text) {
  char* end = nullptr;
  long v = std::strtol(text, &end, 10);
  if (!*text || *end || v <= 0) usage(flag + " expects a positive integer, got '" + text + "'");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) usage(flag + " needs a value");
    const char* value = argv[++i];
    if (flag == "--device") o.device = Device::parse(value);
    else if (flag == "--steps") o.steps = int(parse_int(flag, value));
    else if (flag == "--seed") o.seed = uint64_t(parse_int(flag, value));
    else if (flag == "--lr") {
      char* end = nullptr;
      o.lr = std::strtod(value, &end);
      if (!*value || *end || !(o.lr > 0)) usage("--lr expects a positive number, got '" + std::string(value) + "'");
    } else {
      usage("unknown flag " + flag);
    }
  }
  return o;
}

// Three spirals of n points each in the plane, with a little noise.
void spirals(int n, std::vector<float>* xy, std::vector<int64_t>* labels) {
  uint64_t state = 12345;
  auto noise = [&] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double(state >> 11) / double(1ULL << 53) - 0.5) * 0.2;
  };
  for (int c = 0; c < 3; ++c)
    for (int i = 0; i < n; ++i) {
      double r = double(i) / n, angle = c * 2.094 + r * 4.0 + noise();
      xy->push_back(float(r * std::sin(angle)));
      xy->push_back(float(r * std::cos(angle)));
      labels->push_back(c);
    }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options opt = parse(argc, argv);
    manual_seed(opt.seed);
    std::vector<float> xy;
    std::vector<int64_t> labels;
    spirals(300, &xy, &labels);
    int64_t n = int64_t(labels.size());
    Tensor x = from_vector(xy, {n, 2}, opt.device), y = from_vector(labels, {n}, opt.device);

    const std::vector<int64_t> sizes = {2, 64, 64, 3};
    TensorList params;
    for (size_t i = 0; i + 1 < sizes.size(); ++i) {
      double bound = 1.0 / std::sqrt(double(sizes[i]));
      Tensor w = Tensor::empty({sizes[i], sizes[i + 1]}, DType::f32, opt.device);
      Tensor b = zeros({sizes[i + 1]}, DType::f32, opt.device);
      uniform_(w, -bound, bound);
      params.push_back(w.set_requires_grad());
      params.push_back(b.set_requires_grad());
    }
    auto forward = [&](const Tensor& input) {
      Tensor h = input;
      for (size_t i = 0; i < params.size(); i += 2) {
        h = add(matmul(h, params[i]), params[i + 1]);
        if (i + 2 < params.size()) h = tanh(h);
      }
      return h;
    };

    std::printf("training a 2-64-64-3 MLP on %lld points (three spirals) on %s\n", (long long)n,
                opt.device.str().c_str());
    for (int step = 1; step <= opt.steps; ++step) {
      Tensor loss = cross_entropy(forward(x), y);
      loss.backward();
      {
        NoGradGuard no_grad;
        for (Tensor& p : params) {
          add_(p, p.grad(), -opt.lr);
          p.zero_grad();
        }
      }
      if (step == 1 || step % 100 == 0) std::printf("step %4d  loss %.4f\n", step, loss.item());
    }
    NoGradGuard no_grad;
    Tensor predicted = argmax(forward(x), 1);
    double accuracy = mean(eq(predicted, y).to(DType::f32)).item();
    std::printf("training accuracy %.1f%%\n", accuracy * 100);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "demo: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // std::bad_alloc and the like: a message, not std::terminate
    std::fprintf(stderr, "demo: %s\n", e.what());
    return 1;
  }
}
