// The CUDA layer-norm kernels against the CPU kernels on the same inputs, for f32, bf16 and
// f16 x with f32 and bf16 y (and f32 or 16-bit parameters), and f64, over row lengths that
// take every launch path: the warp kernels with 1 to 4 vectors per lane (64, 200, 512, 768
// as GPT-2, 1000, 1024), single values per lane (1, 7, 100), a block per row (3000 in vectors;
// 1030 and 4097 in single values), buffers that are not 16-byte aligned, and GPT-2's full
// 16384 rows so that every warp runs several rows. Also: no affine, weight only, dx not
// wanted, dx rounded beside it, dx's column sums (LayerNormArgs::dx_sums) on every path,
// bitwise-identical repeated runs, a large common offset, and no rows.
//
// Tolerances: statistics and sums are f32 on the GPU and pairwise f64 on the CPU, so they
// agree to a few f32 roundings of the sum of magnitudes; outputs may differ by an ulp of
// their dtype on top.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/cuda/kernels.h"
#include "tests/common/device_buffer.h"
#include "tests/common/float_bytes.h"
#include "tests/common/gpu.h"

namespace loom {
namespace {

using test::decode;
using test::DeviceBuffer;
using test::encode;

struct Case {
  const char* name;
  int64_t rows, dim;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> table = {
      {"one_value_rows", 37, 1},       {"warp_single_values_7", 19, 7}, {"warp_single_values_100", 50, 100},
      {"warp_vectors_64", 9, 64},      {"warp_vectors_200", 70, 200},   {"warp_vectors_512", 20, 512},
      {"gpt2_width_768", 300, 768},
      {"warp_vectors_1000", 33, 1000}, {"warp_vectors_1024", 40, 1024}, {"block_single_values_1030", 21, 1030},
      {"block_vectors_3000", 17, 3000}, {"block_single_values_4097", 5, 4097},
  };
  return table;
}

struct Dtypes {
  DType x, out, param;
};

std::string name_of(const Dtypes& d) {
  return std::string("x ") + std::string(dtype_name(d.x)) + ", y " + std::string(dtype_name(d.out)) + ", params " +
         std::string(dtype_name(d.param));
}

const std::vector<Dtypes>& dtype_table() {
  static const std::vector<Dtypes> table = {
      {DType::f32, DType::f32, DType::f32},  {DType::f32, DType::bf16, DType::f32},
      {DType::bf16, DType::bf16, DType::f32}, {DType::bf16, DType::f32, DType::bf16},
      {DType::bf16, DType::bf16, DType::bf16}, {DType::f16, DType::f32, DType::f32},
      {DType::f16, DType::bf16, DType::f16},  {DType::f64, DType::f64, DType::f64},
  };
  return table;
}

DType acc_of(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

double output_tol(DType t) {
  switch (t) {
    case DType::f64: return 1e-12;
    case DType::f32: return 2e-5;
    case DType::f16: return 2e-3;
    default: return 1e-2;
  }
}
double sum_tol(DType x) { return x == DType::f64 ? 1e-12 : 5e-5; }

std::vector<double> values(int64_t rows, int64_t dim, double spread, double centre_step, double offset, DType t,
                           std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(size_t(rows * dim));
  for (size_t i = 0; i < v.size(); ++i) v[i] = spread * u(rng) + centre_step * double(int64_t(i) / dim % 7) + offset;
  return decode(encode(v, t), t);
}

// A buffer on both devices, `pad` elements into its GPU allocation (pad 1: not 16-byte aligned).
struct Both {
  DType dtype;
  size_t n, pad;
  std::vector<uint8_t> host;
  DeviceBuffer<uint8_t> dev;
  Both(const std::vector<double>& v, DType t, size_t pad_ = 0)
      : dtype(t), n(v.size()), pad(pad_), host(encode(v, t)), dev(padded(host, pad * dtype_size(t))) {}
  Both(size_t count, DType t, size_t pad_ = 0)
      : dtype(t), n(count), pad(pad_), host(count * dtype_size(t)), dev((count + pad) * dtype_size(t)) {}
  static std::vector<uint8_t> padded(const std::vector<uint8_t>& b, size_t bytes) {
    std::vector<uint8_t> p(bytes, 0);
    p.insert(p.end(), b.begin(), b.end());
    return p;
  }
  void* cpu() { return host.data(); }
  void* gpu() { return dev.get() + pad * dtype_size(dtype); }
  std::vector<double> cpu_values() const { return decode(host, dtype); }
  std::vector<double> gpu_values() const {
    std::vector<uint8_t> all = dev.to_host();
    return decode(std::vector<uint8_t>(all.begin() + long(pad * dtype_size(dtype)), all.end()), dtype);
  }
};

void expect_close(const std::vector<double>& got, const std::vector<double>& want, const std::vector<double>& scale,
                  double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tol * scale[i]) << what << ", element " << i;
}

std::vector<double> one_plus_abs(const std::vector<double>& v) {
  std::vector<double> s(v.size());
  for (size_t i = 0; i < v.size(); ++i) s[i] = 1 + std::abs(v[i]);
  return s;
}

enum class Params { none, weight_only, both };
enum class WantDx { no, yes };

struct Options {
  Params params = Params::both;
  size_t misalign = 0;
  WantDx want_dx = WantDx::yes;
  double offset = -0.3;
  double tol_scale = 1;  // on the tolerances of y and dx
  bool rounded_dx = false;  // also dx rounded to out (f32 x, 16-bit out): bitwise dx's rounding
  bool dx_sums = false;     // also dx's column sums as stored (needs dx)
};

// Column sums over the rows of a (rows, dim) matrix, in double; with `absolute`, of |v|.
std::vector<double> column_sums(const std::vector<double>& v, int64_t dim, bool absolute) {
  std::vector<double> s(size_t(dim), 0.0);
  for (size_t i = 0; i < v.size(); ++i) s[i % size_t(dim)] += absolute ? std::abs(v[i]) : v[i];
  return s;
}

// Runs forward and backward on both devices and compares everything; the GPU backward reads
// the CPU's saved statistics, so it is compared on its own.
void check_case(const Case& k, const Dtypes& d, const Options& o = {}) {
  SCOPED_TRACE(std::string(k.name) + ", " + name_of(d) + (o.misalign ? ", misaligned" : "") +
               (o.params == Params::none ? ", no affine" : o.params == Params::weight_only ? ", weight only" : "") +
               (o.want_dx == WantDx::no ? ", no dx" : "") + (o.rounded_dx ? ", rounded dx" : "") +
               (o.dx_sums ? ", dx sums" : ""));
  std::mt19937 rng(19);
  const int64_t rows = k.rows, dim = k.dim;
  const size_t n = size_t(rows * dim), m = o.misalign;
  const bool has_w = o.params != Params::none, has_b = o.params == Params::both, want_dx = o.want_dx == WantDx::yes;
  LayerNormArgs a;
  a.dtype = d.x, a.out_dtype = d.out, a.param_dtype = d.param, a.rows = rows, a.dim = dim, a.eps = 1e-5;
  const DType acc = acc_of(d.x);

  Both x(values(rows, dim, 2.0, 0.4, o.offset, d.x, rng), d.x, m);
  Both dy(values(rows, dim, 1.0, 0.05, -0.1, d.out, rng), d.out, m);
  Both w(values(1, dim, 0.5, 0, 1.0, d.param, rng), d.param), b(values(1, dim, 1.0, 0, 0, d.param, rng), d.param);
  Both rounded(n, d.out, m), sums(size_t(dim), acc);
  Both y(n, d.out, m), mean(size_t(rows), acc), rstd(size_t(rows), acc), dx(n, d.x, m), dw(size_t(dim), d.param),
      db(size_t(dim), d.param);
  DeviceBuffer<uint8_t> gmean(size_t(rows) * dtype_size(acc)), grstd(size_t(rows) * dtype_size(acc));

  cpu::layer_norm_forward(a, y.cpu(), mean.cpu(), rstd.cpu(), x.cpu(), has_w ? w.cpu() : nullptr,
                          has_b ? b.cpu() : nullptr, nullptr);
  a.dx_rounded = o.rounded_dx ? rounded.cpu() : nullptr;
  a.dx_sums = o.dx_sums ? sums.cpu() : nullptr;
  cpu::layer_norm_backward(a, dx.cpu(), has_w ? dw.cpu() : nullptr, has_b ? db.cpu() : nullptr, dy.cpu(), x.cpu(),
                           mean.cpu(), rstd.cpu(), has_w ? w.cpu() : nullptr, nullptr, nullptr);

  cuda::layer_norm_forward(a, y.gpu(), gmean.get(), grstd.get(), x.gpu(), has_w ? w.gpu() : nullptr,
                           has_b ? b.gpu() : nullptr, nullptr);
  // The backward from the CPU's statistics, with scratch as the engine sizes it.
  Both saved_mean(mean.cpu_values(), acc), saved_rstd(rstd.cpu_values(), acc);
  a.dx_rounded = o.rounded_dx ? rounded.gpu() : nullptr;
  a.dx_sums = o.dx_sums ? sums.gpu() : nullptr;
  DeviceBuffer<uint8_t> ws(std::max<size_t>(cuda::layer_norm_workspace_size(a), 1));
  cuda::layer_norm_backward(a, want_dx ? dx.gpu() : nullptr, has_w ? dw.gpu() : nullptr, has_b ? db.gpu() : nullptr,
                            dy.gpu(), x.gpu(), saved_mean.gpu(), saved_rstd.gpu(), has_w ? w.gpu() : nullptr, ws.get(),
                            nullptr);

  auto gpu_stat = [&](const DeviceBuffer<uint8_t>& buf) { return decode(buf.to_host(), acc); };
  const std::vector<double> cm = mean.cpu_values(), cr = rstd.cpu_values();
  expect_close(gpu_stat(gmean), cm, one_plus_abs(cm), sum_tol(d.x), "mean");
  expect_close(gpu_stat(grstd), cr, one_plus_abs(cr), sum_tol(d.x), "rstd");
  const std::vector<double> cy = y.cpu_values();
  expect_close(y.gpu_values(), cy, one_plus_abs(cy), o.tol_scale * output_tol(d.out), "y");

  // Gradient scales: sums of magnitudes bound any summation order's rounding.
  const std::vector<double> xs = x.cpu_values(), gys = dy.cpu_values(), ws_ = w.cpu_values();
  std::vector<double> dx_scale(n), dw_scale(size_t(dim), 0.0), db_scale(size_t(dim), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double amg = 0, amgx = 0;
    auto at = [&](int64_t j) { return size_t(r * dim + j); };
    auto xhat = [&](int64_t j) { return (xs[at(j)] - cm[size_t(r)]) * cr[size_t(r)]; };
    auto g = [&](int64_t j) { return gys[at(j)] * (has_w ? ws_[size_t(j)] : 1.0); };
    for (int64_t j = 0; j < dim; ++j) {
      amg += std::abs(g(j)) / double(dim), amgx += std::abs(g(j) * xhat(j)) / double(dim);
      dw_scale[size_t(j)] += std::abs(gys[at(j)] * xhat(j)), db_scale[size_t(j)] += std::abs(gys[at(j)]);
    }
    for (int64_t j = 0; j < dim; ++j)
      dx_scale[at(j)] = cr[size_t(r)] * (std::abs(g(j)) + amg + std::abs(xhat(j)) * amgx) + 1e-30;
  }
  if (want_dx) expect_close(dx.gpu_values(), dx.cpu_values(), dx_scale, o.tol_scale * output_tol(d.x), "dx");
  if (o.rounded_dx) {  // each device's copy is its own dx rounded
    EXPECT_EQ(encode(rounded.cpu_values(), d.out), encode(dx.cpu_values(), d.out)) << "CPU rounded dx";
    EXPECT_EQ(encode(rounded.gpu_values(), d.out), encode(dx.gpu_values(), d.out)) << "CUDA rounded dx";
  }
  if (o.dx_sums) {  // each device's sums against its own stored dx summed here in double
    const std::vector<double> cpu_stored = o.rounded_dx ? rounded.cpu_values() : dx.cpu_values();
    const std::vector<double> gpu_stored = o.rounded_dx ? rounded.gpu_values() : dx.gpu_values();
    const std::vector<double> scale = one_plus_abs(column_sums(cpu_stored, dim, true));
    expect_close(sums.cpu_values(), column_sums(cpu_stored, dim, false), scale, sum_tol(d.x), "CPU dx sums");
    expect_close(sums.gpu_values(), column_sums(gpu_stored, dim, false), scale, sum_tol(d.x), "CUDA dx sums");
  }
  const double pt = std::max(sum_tol(d.x), output_tol(d.param));
  if (has_w) expect_close(dw.gpu_values(), dw.cpu_values(), one_plus_abs(dw_scale), pt, "dweight");
  if (has_b) expect_close(db.gpu_values(), db.cpu_values(), one_plus_abs(db_scale), pt, "dbias");
}

TEST(LayerNormCuda, MatchesCpuForEveryPathAndDtypePairing) {
  LOOM_REQUIRE_CUDA();
  for (const Dtypes& d : dtype_table())
    for (const Case& k : cases()) check_case(k, d);
}

// More rows than the grids have warps (or blocks): each runs several rows.
TEST(LayerNormCuda, MatchesCpuWithManyRowsPerWarpOrBlock) {
  LOOM_REQUIRE_CUDA();
  for (const Dtypes& d : {dtype_table()[0], dtype_table()[2]}) {
    check_case({"gpt2", 16384, 768}, d);
    check_case({"block_many_rows", 1200, 3000}, d);
  }
}

TEST(LayerNormCuda, MatchesCpuWithoutAffineWithWeightOnlyAndWithoutDx) {
  LOOM_REQUIRE_CUDA();
  for (const Dtypes& d : {dtype_table()[0], dtype_table()[2]})
    for (const Case& k : cases()) {
      check_case(k, d, {.params = Params::none});
      check_case(k, d, {.params = Params::weight_only});
      check_case(k, d, {.want_dx = WantDx::no});
    }
}

// dx rounded beside dx (LayerNormArgs::dx_rounded) on every launch path, aligned and not.
TEST(LayerNormCuda, RoundedDxIsDxRoundedOnEveryPath) {
  LOOM_REQUIRE_CUDA();
  for (const DType out : {DType::bf16, DType::f16})
    for (const Case& k : cases())
      for (const size_t misalign : {0, 1})
        check_case(k, {DType::f32, out, DType::f32}, {.misalign = misalign, .rounded_dx = true});
  check_case({"gpt2", 16384, 768}, {DType::f32, DType::bf16, DType::f32}, {.rounded_dx = true});
}

// dx's column sums (LayerNormArgs::dx_sums) on every launch path and dtype pairing, of dx
// or of its rounding, with and without the parameters' sums, aligned and not, over GPT-2's
// rows; the other outputs as without them.
TEST(LayerNormCuda, DxSumsAreTheColumnSumsOfDxAsStored) {
  LOOM_REQUIRE_CUDA();
  for (const Dtypes& d : dtype_table())
    for (const Case& k : cases()) check_case(k, d, {.dx_sums = true});
  for (const DType out : {DType::bf16, DType::f16})
    for (const Case& k : cases())
      for (const size_t misalign : {0, 1})
        check_case(k, {DType::f32, out, DType::f32}, {.misalign = misalign, .rounded_dx = true, .dx_sums = true});
  for (const Case& k : cases()) check_case(k, dtype_table()[0], {.params = Params::none, .dx_sums = true});
  check_case({"gpt2", 16384, 768}, {DType::f32, DType::bf16, DType::f32}, {.rounded_dx = true, .dx_sums = true});
  check_case({"block_many_rows", 1200, 3000}, dtype_table()[0], {.dx_sums = true});
}

TEST(LayerNormCuda, UnalignedBuffersTakeTheSingleValuePaths) {
  LOOM_REQUIRE_CUDA();
  for (const Case& k : cases()) {
    check_case(k, dtype_table()[0], {.misalign = 1});
    check_case(k, dtype_table()[2], {.misalign = 1});
  }
}

// x = 1000 + U(-2, 2): a sum-of-squares variance in f32 would lose every digit. The f32 mean
// itself is off by about 1e-7 of 1000 on either device, which y and dx inherit.
TEST(LayerNormCuda, LargeMeanKeepsTheVariance) {
  LOOM_REQUIRE_CUDA();
  for (const Case& k : {Case{"warp", 64, 768}, Case{"block", 8, 3000}, Case{"single_values", 8, 100}})
    check_case(k, dtype_table()[0], {.offset = 1000, .tol_scale = 50});
}

TEST(LayerNormCuda, RepeatedRunsGiveIdenticalBits) {
  LOOM_REQUIRE_CUDA();
  for (const Case& k : {Case{"warp", 5000, 768}, Case{"block", 600, 3000}}) {
    SCOPED_TRACE(k.name);
    std::mt19937 rng(23);
    LayerNormArgs a;
    a.rows = k.rows, a.dim = k.dim;
    const size_t n = size_t(k.rows * k.dim), rows = size_t(k.rows), dim = size_t(k.dim);
    std::vector<float> xv(n), dyv(n), wv(dim);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (auto* v : {&xv, &dyv, &wv})
      for (float& e : *v) e = u(rng);
    DeviceBuffer<float> x(xv), dy(dyv), w(wv), y(n), mean(rows), rstd(rows), dx(n), dw(dim), db(dim);
    DeviceBuffer<uint8_t> ws(cuda::layer_norm_workspace_size(a));
    std::vector<std::vector<float>> runs;
    for (int rep = 0; rep < 2; ++rep) {
      cuda::layer_norm_forward(a, y.get(), mean.get(), rstd.get(), x.get(), w.get(), w.get(), nullptr);
      cuda::layer_norm_backward(a, dx.get(), dw.get(), db.get(), dy.get(), x.get(), mean.get(), rstd.get(), w.get(),
                                ws.get(), nullptr);
      std::vector<float> all = y.to_host();
      for (const auto& part : {mean.to_host(), rstd.to_host(), dx.to_host(), dw.to_host(), db.to_host()})
        all.insert(all.end(), part.begin(), part.end());
      runs.push_back(std::move(all));
    }
    ASSERT_EQ(runs[0].size(), runs[1].size());
    EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(float)), 0);
  }
}

TEST(LayerNormCuda, NoRowsGiveZeroParameterGradients) {
  LOOM_REQUIRE_CUDA();
  LayerNormArgs a;
  a.rows = 0, a.dim = 3;
  DeviceBuffer<float> dw(std::vector<float>(3, 7.f)), db(std::vector<float>(3, 7.f)), sums(std::vector<float>(3, 7.f));
  DeviceBuffer<float> dx(1);
  a.dx_sums = sums.get();
  cuda::layer_norm_backward(a, dx.get(), dw.get(), db.get(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                            nullptr);
  EXPECT_EQ(dw.to_host(), std::vector<float>(3, 0.f));
  EXPECT_EQ(db.to_host(), std::vector<float>(3, 0.f));
  EXPECT_EQ(sums.to_host(), std::vector<float>(3, 0.f));
}

}  // namespace
}  // namespace loom
