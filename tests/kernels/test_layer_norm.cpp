// The CPU layer-norm kernels against the formulas written out here in double: forward
// (y, mean, rstd) and backward (dx, dweight, dbias), for every pairing of x, y and parameter
// dtypes the engine uses, over odd row lengths (1, 7, 33, 768, 1000, 3000) and with weight
// and bias absent. The backward formula itself is checked against finite differences of the
// forward in f64, so the reference written here cannot share a mistake with the kernel.
// Inputs are rounded to their dtypes first, so the reference sees the same numbers and the
// tolerances cover only the outputs' own rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "tests/common/float_bytes.h"

namespace loom {
namespace {

using test::decode;
using test::encode;

struct Case {
  const char* name;
  int64_t rows, dim;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> table = {
      {"one_value_rows", 4, 1}, {"dim_7", 5, 7},         {"many_rows_dim_33", 300, 33},
      {"gpt2_dim_768", 6, 768}, {"dim_1000", 3, 1000}, {"dim_3000", 2, 3000},
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
      {DType::f32, DType::f32, DType::f32},   {DType::f64, DType::f64, DType::f64},
      {DType::bf16, DType::bf16, DType::f32}, {DType::bf16, DType::f32, DType::bf16},
      {DType::f32, DType::bf16, DType::f32},  {DType::f16, DType::f16, DType::f16},
  };
  return table;
}

DType acc_of(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

// The tolerance of a value rounded once to `t`, relative to 1 + |value|.
double rounding_tol(DType t) {
  switch (t) {
    case DType::f64: return 1e-12;
    case DType::f32: return 2e-6;
    case DType::f16: return 1e-3;
    default: return 8e-3;
  }
}

// n values in dtype t (returned as the rounded doubles): spread * U(-1, 1) + centre of the row.
std::vector<double> values(int64_t rows, int64_t dim, double spread, double centre_step, DType t, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(size_t(rows * dim));
  for (size_t i = 0; i < v.size(); ++i) v[i] = spread * u(rng) + centre_step * double(int64_t(i) / dim % 5) - 0.3;
  return decode(encode(v, t), t);
}

// A kernel's buffer: the values' bytes in a dtype, and back.
struct Buffer {
  DType dtype;
  std::vector<uint8_t> bytes;
  Buffer(const std::vector<double>& v, DType t) : dtype(t), bytes(encode(v, t)) {}
  Buffer(size_t n, DType t) : dtype(t), bytes(n * dtype_size(t)) {}
  void* data() { return bytes.data(); }
  std::vector<double> values() const { return decode(bytes, dtype); }
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

void check_case(const Case& k, const Dtypes& d, Params params) {
  SCOPED_TRACE(std::string(k.name) + ", " + name_of(d) +
               (params == Params::none ? ", no affine" : params == Params::weight_only ? ", weight only" : ""));
  std::mt19937 rng(17);
  const int64_t rows = k.rows, dim = k.dim;
  const size_t n = size_t(rows * dim);
  const std::vector<double> x = values(rows, dim, 2.0, 0.7, d.x, rng), dy = values(rows, dim, 1.0, 0.1, d.out, rng);
  const std::vector<double> w = values(1, dim, 0.5, 0, d.param, rng), b = values(1, dim, 1.0, 0, d.param, rng);
  const bool has_w = params != Params::none, has_b = params == Params::both;
  const double eps = 1e-5;
  LayerNormArgs a;
  a.dtype = d.x, a.out_dtype = d.out, a.param_dtype = d.param, a.rows = rows, a.dim = dim, a.eps = eps;

  Buffer bx(x, d.x), bdy(dy, d.out), bw(w, d.param), bb(b, d.param);
  Buffer by(n, d.out), bmean(size_t(rows), acc_of(d.x)), brstd(size_t(rows), acc_of(d.x));
  Buffer bdx(n, d.x), bdw(size_t(dim), d.param), bdb(size_t(dim), d.param);
  cpu::layer_norm_forward(a, by.data(), bmean.data(), brstd.data(), bx.data(), has_w ? bw.data() : nullptr,
                          has_b ? bb.data() : nullptr, nullptr);
  cpu::layer_norm_backward(a, bdx.data(), has_w ? bdw.data() : nullptr, has_b ? bdb.data() : nullptr, bdy.data(),
                           bx.data(), bmean.data(), brstd.data(), has_w ? bw.data() : nullptr, nullptr, nullptr);

  // The forward in double.
  std::vector<double> mean(static_cast<size_t>(rows)), rstd(static_cast<size_t>(rows)), y(n);
  auto wt = [&](int64_t j) { return has_w ? w[size_t(j)] : 1.0; };
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0, v = 0;
    for (int64_t j = 0; j < dim; ++j) m += x[size_t(r * dim + j)] / double(dim);
    for (int64_t j = 0; j < dim; ++j) v += std::pow(x[size_t(r * dim + j)] - m, 2) / double(dim);
    mean[size_t(r)] = m, rstd[size_t(r)] = 1 / std::sqrt(v + eps);
    for (int64_t j = 0; j < dim; ++j)
      y[size_t(r * dim + j)] = (x[size_t(r * dim + j)] - m) * rstd[size_t(r)] * wt(j) + (has_b ? b[size_t(j)] : 0.0);
  }
  const double st = rounding_tol(acc_of(d.x));
  expect_close(bmean.values(), mean, one_plus_abs(mean), st, "mean");
  expect_close(brstd.values(), rstd, one_plus_abs(rstd), st, "rstd");
  expect_close(by.values(), y, one_plus_abs(y), rounding_tol(d.out), "y");

  // The backward in double, from the statistics the kernel saved (as the engine passes them).
  const std::vector<double> km = bmean.values(), kr = brstd.values();
  std::vector<double> dx(n), dx_scale(n), dw(size_t(dim), 0.0), db(size_t(dim), 0.0), dw_scale(size_t(dim), 0.0),
      db_scale(size_t(dim), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    auto at = [&](int64_t j) { return size_t(r * dim + j); };
    auto xhat = [&](int64_t j) { return (x[at(j)] - km[size_t(r)]) * kr[size_t(r)]; };
    double mg = 0, mgx = 0, amg = 0, amgx = 0;
    for (int64_t j = 0; j < dim; ++j) {
      const double g = dy[at(j)] * wt(j);
      mg += g / double(dim), mgx += g * xhat(j) / double(dim);
      amg += std::abs(g) / double(dim), amgx += std::abs(g * xhat(j)) / double(dim);
      dw[size_t(j)] += dy[at(j)] * xhat(j), db[size_t(j)] += dy[at(j)];
      dw_scale[size_t(j)] += std::abs(dy[at(j)] * xhat(j)), db_scale[size_t(j)] += std::abs(dy[at(j)]);
    }
    for (int64_t j = 0; j < dim; ++j) {
      const double g = dy[at(j)] * wt(j);
      dx[at(j)] = kr[size_t(r)] * (g - mg - xhat(j) * mgx);
      dx_scale[at(j)] = kr[size_t(r)] * (std::abs(g) + amg + std::abs(xhat(j)) * amgx) + 1e-30;
    }
  }
  expect_close(bdx.values(), dx, dx_scale, rounding_tol(d.x), "dx");
  if (has_w) expect_close(bdw.values(), dw, one_plus_abs(dw_scale), rounding_tol(d.param), "dweight");
  if (has_b) expect_close(bdb.values(), db, one_plus_abs(db_scale), rounding_tol(d.param), "dbias");
}

TEST(LayerNormCpu, MatchesFormulaForEveryDtypePairing) {
  for (const Dtypes& d : dtype_table())
    for (const Case& k : cases()) check_case(k, d, Params::both);
}

TEST(LayerNormCpu, MatchesFormulaWithoutAffineOrWithWeightOnly) {
  for (const Dtypes& d : {dtype_table()[0], dtype_table()[2]})
    for (const Case& k : cases()) {
      check_case(k, d, Params::none);
      check_case(k, d, Params::weight_only);
    }
}

// x = 1000 + U(-1, 1): a sum-of-squares variance would lose every digit; two passes keep it.
TEST(LayerNormCpu, LargeMeanKeepsTheVariance) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int64_t dim = 768;
  std::vector<float> x(static_cast<size_t>(dim)), y(static_cast<size_t>(dim));
  for (float& v : x) v = 1000.f + u(rng);
  LayerNormArgs a;
  a.rows = 1, a.dim = dim;
  float mean = 0, rstd = 0;
  cpu::layer_norm_forward(a, y.data(), &mean, &rstd, x.data(), nullptr, nullptr, nullptr);
  double m = 0, v = 0;
  for (float xi : x) m += double(xi) / double(dim);
  for (float xi : x) v += (double(xi) - m) * (double(xi) - m) / double(dim);
  EXPECT_NEAR(rstd, 1 / std::sqrt(v + 1e-5), 1e-5 / std::sqrt(v));
  EXPECT_NEAR(y[0], (double(x[0]) - m) / std::sqrt(v + 1e-5), 1e-4);
}

// L = sum(y * dy) in f64: dL/dx, dL/dweight and dL/dbias from the backward against central
// differences of the forward.
TEST(LayerNormCpu, BackwardMatchesFiniteDifferencesOfForward) {
  for (const int64_t dim : {1, 7, 20}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    const int64_t rows = 3;
    const size_t n = size_t(rows * dim);
    std::mt19937 rng(31);
    std::vector<double> x = values(rows, dim, 2.0, 0.5, DType::f64, rng), dy = values(rows, dim, 1, 0, DType::f64, rng);
    std::vector<double> w = values(1, dim, 0.5, 0, DType::f64, rng), b = values(1, dim, 1, 0, DType::f64, rng);
    for (double& v : w) v += 1;
    LayerNormArgs a;
    a.dtype = a.out_dtype = a.param_dtype = DType::f64;
    a.rows = rows, a.dim = dim, a.eps = 1e-3;
    std::vector<double> y(n), mean(static_cast<size_t>(rows)), rstd(static_cast<size_t>(rows));
    auto loss = [&] {
      cpu::layer_norm_forward(a, y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), nullptr);
      double l = 0;
      for (size_t i = 0; i < n; ++i) l += y[i] * dy[i];
      return l;
    };
    loss();
    std::vector<double> dx(n), dw(static_cast<size_t>(dim)), db(static_cast<size_t>(dim));
    cpu::layer_norm_backward(a, dx.data(), dw.data(), db.data(), dy.data(), x.data(), mean.data(), rstd.data(),
                             w.data(), nullptr, nullptr);
    for (auto [what, v, grad] :
         {std::tuple{"x", &x, &dx}, std::tuple{"weight", &w, &dw}, std::tuple{"bias", &b, &db}}) {
      for (size_t i = 0; i < v->size(); ++i) {
        const double saved = (*v)[i], h = 1e-6;
        (*v)[i] = saved + h;
        const double up = loss();
        (*v)[i] = saved - h;
        const double down = loss();
        (*v)[i] = saved;
        const double numeric = (up - down) / (2 * h);
        EXPECT_NEAR((*grad)[i], numeric, 1e-6 + 1e-5 * std::abs(numeric)) << what << ", element " << i;
      }
    }
  }
}

// dx_rounded is the stored f32 dx rounded to the 16-bit out_dtype, element for element, with
// or without a gradient to add in (dx_add), and dx itself is as without it.
TEST(LayerNormCpu, RoundedDxIsTheStoredDxRounded) {
  for (const DType out : {DType::bf16, DType::f16})
    for (const bool add : {false, true})
      for (const Case& k : cases()) {
        SCOPED_TRACE(std::string(k.name) + ", " + std::string(dtype_name(out)) + (add ? ", dx_add" : ""));
        std::mt19937 rng(41);
        const size_t n = size_t(k.rows * k.dim);
        LayerNormArgs a;
        a.dtype = a.param_dtype = DType::f32, a.out_dtype = out, a.rows = k.rows, a.dim = k.dim;
        Buffer x(values(k.rows, k.dim, 2.0, 0.7, DType::f32, rng), DType::f32);
        Buffer dy(values(k.rows, k.dim, 1.0, 0.1, out, rng), out);
        Buffer w(values(1, k.dim, 0.5, 1, DType::f32, rng), DType::f32);
        Buffer extra(values(k.rows, k.dim, 3.0, 0, DType::f32, rng), DType::f32);
        Buffer y(n, out), mean(size_t(k.rows), DType::f32), rstd(size_t(k.rows), DType::f32);
        Buffer dx(n, DType::f32), dx_alone(n, DType::f32), rounded(n, out);
        cpu::layer_norm_forward(a, y.data(), mean.data(), rstd.data(), x.data(), w.data(), nullptr, nullptr);
        a.dx_add = add ? extra.data() : nullptr;
        cpu::layer_norm_backward(a, dx_alone.data(), nullptr, nullptr, dy.data(), x.data(), mean.data(), rstd.data(),
                                 w.data(), nullptr, nullptr);
        a.dx_rounded = rounded.data();
        cpu::layer_norm_backward(a, dx.data(), nullptr, nullptr, dy.data(), x.data(), mean.data(), rstd.data(),
                                 w.data(), nullptr, nullptr);
        EXPECT_EQ(dx.bytes, dx_alone.bytes);
        EXPECT_EQ(rounded.bytes, encode(dx.values(), out));
      }
}

// dx_sums are the column sums of dx as stored (its rounding when dx_rounded is written), in
// the accumulation type, with and without the parameters' sums and dx_add; dx, dweight and
// dbias are the bits they are without them.
TEST(LayerNormCpu, DxSumsAreTheColumnSumsOfDxAsStored) {
  for (const Dtypes& d : {Dtypes{DType::f32, DType::f32, DType::f32}, Dtypes{DType::f64, DType::f64, DType::f64},
                          Dtypes{DType::bf16, DType::bf16, DType::f32}, Dtypes{DType::f32, DType::bf16, DType::f32},
                          Dtypes{DType::f32, DType::f16, DType::f32}})
    for (const bool round : {false, true})
      for (const bool params : {false, true})
        for (const Case& k : cases()) {
          if (round && (d.x != DType::f32 || d.out == DType::f32)) continue;
          SCOPED_TRACE(std::string(k.name) + ", " + name_of(d) + (round ? ", rounded" : "") +
                       (params ? ", params" : ""));
          std::mt19937 rng(43);
          const size_t n = size_t(k.rows * k.dim), dim = size_t(k.dim);
          const DType acc = acc_of(d.x);
          LayerNormArgs a;
          a.dtype = d.x, a.out_dtype = d.out, a.param_dtype = d.param, a.rows = k.rows, a.dim = k.dim;
          Buffer x(values(k.rows, k.dim, 2.0, 0.7, d.x, rng), d.x);
          Buffer dy(values(k.rows, k.dim, 1.0, 0.1, d.out, rng), d.out);
          Buffer w(values(1, k.dim, 0.5, 1, d.param, rng), d.param);
          Buffer extra(values(k.rows, k.dim, 3.0, 0, d.x, rng), d.x);
          Buffer y(n, d.out), mean(size_t(k.rows), acc), rstd(size_t(k.rows), acc);
          Buffer dx(n, d.x), dx_alone(n, d.x), rounded(n, d.out), dw(dim, d.param), dw_alone(dim, d.param),
              db(dim, d.param), db_alone(dim, d.param), sums(dim, acc);
          cpu::layer_norm_forward(a, y.data(), mean.data(), rstd.data(), x.data(), w.data(), nullptr, nullptr);
          a.dx_add = extra.data();
          a.dx_rounded = round ? rounded.data() : nullptr;
          cpu::layer_norm_backward(a, dx_alone.data(), params ? dw_alone.data() : nullptr,
                                   params ? db_alone.data() : nullptr, dy.data(), x.data(), mean.data(), rstd.data(),
                                   w.data(), nullptr, nullptr);
          a.dx_sums = sums.data();
          cpu::layer_norm_backward(a, dx.data(), params ? dw.data() : nullptr, params ? db.data() : nullptr, dy.data(),
                                   x.data(), mean.data(), rstd.data(), w.data(), nullptr, nullptr);
          EXPECT_EQ(dx.bytes, dx_alone.bytes);
          EXPECT_EQ(dw.bytes, dw_alone.bytes);
          EXPECT_EQ(db.bytes, db_alone.bytes);
          const std::vector<double> stored = round ? rounded.values() : dx.values();
          std::vector<double> want(dim, 0.0), scale(dim, 1.0);
          for (size_t i = 0; i < n; ++i) want[i % dim] += stored[i], scale[i % dim] += std::abs(stored[i]);
          expect_close(sums.values(), want, scale, rounding_tol(acc), "dx sums");
        }
}

TEST(LayerNormCpu, NoRowsGiveZeroParameterGradients) {
  LayerNormArgs a;
  a.rows = 0, a.dim = 3;
  std::vector<float> dw(3, 7.f), db(3, 7.f), sums(3, 7.f), dx(1);
  a.dx_sums = sums.data();
  cpu::layer_norm_backward(a, dx.data(), dw.data(), db.data(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                           nullptr);
  EXPECT_EQ(dw, std::vector<float>(3, 0.f));
  EXPECT_EQ(db, std::vector<float>(3, 0.f));
  EXPECT_EQ(sums, std::vector<float>(3, 0.f));
}

}  // namespace
}  // namespace loom
