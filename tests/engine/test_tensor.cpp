// Tensor as a handle over shared storage: views and their strides, copies only where
// they must happen, dtype conversions, printing, shape errors, joins, creation and the
// random generator's reproducibility. Numeric gradient checks of the ops live elsewhere;
// these tests pin down what the layers above rely on.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom {
namespace {

std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

// Expects `text` to hold every one of `parts`.
void expect_contains(const std::string& text, std::initializer_list<std::string> parts) {
  for (const std::string& p : parts)
    EXPECT_NE(text.find(p), std::string::npos) << "'" << p << "' missing from: " << text;
}

// Expects `fn` to throw a loom::Error whose message holds every one of `parts`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a loom::Error";
  } catch (const Error& e) {
    expect_contains(e.what(), parts);
  }
}

// (3, 4) holding 0..11, strides (4, 1).
Tensor base34() { return arange(0, 12, 1, DType::f32).reshape({3, 4}); }

using Base = const Tensor&;

struct ViewCase {
  const char* name;
  std::function<Tensor(const Tensor&)> make;
  Shape shape, strides;
  int64_t offset;
  std::vector<double> values;
};

const std::vector<double> kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
const std::vector<double> kTransposed = {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11};

const std::vector<ViewCase> kViews = {
    {"reshape", [](Base b) { return b.reshape({2, 6}); }, {2, 6}, {6, 1}, 0, kIota},
    {"reshape_infer", [](Base b) { return b.reshape({-1, 3}); }, {4, 3}, {3, 1}, 0, kIota},
    {"view", [](Base b) { return b.view({12}); }, {12}, {1}, 0, kIota},
    {"transpose", [](Base b) { return b.transpose(0, 1); }, {4, 3}, {1, 4}, 0, kTransposed},
    {"t", [](Base b) { return b.t(); }, {4, 3}, {1, 4}, 0, kTransposed},
    {"permute", [](Base b) { return b.unsqueeze(0).permute({2, 0, 1}); }, {4, 1, 3}, {1, 12, 4}, 0, kTransposed},
    {"slice_step", [](Base b) { return b.slice(1, 1, 4, 2); }, {3, 2}, {4, 2}, 1, {1, 3, 5, 7, 9, 11}},
    {"slice_negative_start", [](Base b) { return b.slice(0, -2, 3); }, {2, 4}, {4, 1}, 4, {4, 5, 6, 7, 8, 9, 10, 11}},
    {"slice_negative_both", [](Base b) { return b.slice(-1, -3, -1); }, {3, 2}, {4, 1}, 1, {1, 2, 5, 6, 9, 10}},
    {"slice_end_clamped", [](Base b) { return b.slice(1, 0, 100, 3); }, {3, 2}, {4, 3}, 0, {0, 3, 4, 7, 8, 11}},
    {"slice_empty", [](Base b) { return b.slice(0, 2, 1); }, {0, 4}, {4, 1}, 8, {}},
    {"select_row", [](Base b) { return b.select(0, 1); }, {4}, {1}, 4, {4, 5, 6, 7}},
    {"select_negative", [](Base b) { return b.select(1, -1); }, {3}, {4}, 3, {3, 7, 11}},
    {"expand_row", [](Base b) { return b.slice(0, 0, 1).expand({3, 4}); }, {3, 4}, {0, 1}, 0,
     {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}},
    {"expand_column", [](Base b) { return b.select(1, 0).unsqueeze(1).expand({3, 2}); }, {3, 2}, {4, 0}, 0,
     {0, 0, 4, 4, 8, 8}},
    {"expand_new_dim", [](Base b) { return b.slice(0, 2, 3).expand({2, -1, 4}); }, {2, 1, 4}, {0, 4, 1}, 8,
     {8, 9, 10, 11, 8, 9, 10, 11}},
    {"unsqueeze_front", [](Base b) { return b.unsqueeze(0); }, {1, 3, 4}, {12, 4, 1}, 0, kIota},
    {"unsqueeze_middle", [](Base b) { return b.unsqueeze(1); }, {3, 1, 4}, {4, 4, 1}, 0, kIota},
    {"unsqueeze_last", [](Base b) { return b.unsqueeze(-1); }, {3, 4, 1}, {4, 1, 1}, 0, kIota},
    {"squeeze", [](Base b) { return b.unsqueeze(1).squeeze(1); }, {3, 4}, {4, 1}, 0, kIota},
    {"squeeze_not_one_is_noop", [](Base b) { return b.squeeze(0); }, {3, 4}, {4, 1}, 0, kIota},
    {"flatten", [](Base b) { return b.flatten(); }, {12}, {1}, 0, kIota},
    {"flatten_range", [](Base b) { return b.unsqueeze(0).flatten(0, 1); }, {3, 4}, {4, 1}, 0, kIota},
};

TEST(TensorView, ShapeStridesOffsetAndSharedStorage) {
  for (const ViewCase& c : kViews) {
    SCOPED_TRACE(c.name);
    Tensor b = base34();
    Tensor v = c.make(b);
    EXPECT_EQ(v.shape(), c.shape);
    EXPECT_EQ(v.strides(), c.strides);
    EXPECT_EQ(v.offset(), c.offset);
    EXPECT_EQ(values(v), c.values);
    EXPECT_EQ(v.storage(), b.storage()) << "a view must share its base's storage";
  }
}

struct WriteCase {
  const char* name;
  std::function<void(const Tensor&)> write;
  std::vector<double> base_after;
};

const std::vector<WriteCase> kWrites = {
    {"fill_strided_slice", [](Base b) { fill_(b.slice(1, 1, 4, 2), -1); },
     {0, -1, 2, -1, 4, -1, 6, -1, 8, -1, 10, -1}},
    {"copy_into_row", [](Base b) { copy_(b.select(0, 2), from_vector(std::vector<float>{20, 21, 22, 23}, {4})); },
     {0, 1, 2, 3, 4, 5, 6, 7, 20, 21, 22, 23}},
    {"fill_column_of_transpose", [](Base b) { fill_(b.t().select(1, 1), 9); },
     {0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11}},
    {"fill_through_view_chain", [](Base b) { fill_(b.view({12}).slice(0, 0, 12, 5), -5); },
     {-5, 1, 2, 3, 4, -5, 6, 7, 8, 9, -5, 11}},
    {"copy_broadcast_into_permuted", [](Base b) { copy_(b.permute({1, 0}).slice(0, 0, 1), full({1}, 7)); },
     {7, 1, 2, 3, 7, 5, 6, 7, 7, 9, 10, 11}},
};

TEST(TensorView, WritesThroughAViewReachTheBase) {
  for (const WriteCase& c : kWrites) {
    SCOPED_TRACE(c.name);
    Tensor b = base34();
    c.write(b);
    EXPECT_EQ(values(b), c.base_after);
  }
}

TEST(TensorView, ViewOfNonContiguousSuggestsReshape) {
  Tensor t = base34().t();
  expect_error([&] { t.view({12}); }, {"non-contiguous", "reshape"});
  Tensor r = t.reshape({12});  // reshape copies instead
  EXPECT_NE(r.storage(), t.storage());
  EXPECT_EQ(values(r), kTransposed);
}

TEST(TensorView, BadShapesAreRejected) {
  Tensor b = base34();
  expect_error([&] { b.reshape({5, -1}); }, {"(3, 4)", "(5, -1)"});
  expect_error([&] { b.reshape({-1, -1}); }, {"only one dimension can be -1"});
  expect_error([&] { b.select(0, 3); }, {"out of range"});
  expect_error([&] { b.expand({3, 5}); }, {"cannot become 5"});
  expect_error([&] { b.permute({0, 0}); }, {"appears twice"});
  expect_error([&] { b.slice(0, 0, 2, 0); }, {"step must be positive"});
}

TEST(TensorCopy, ContiguousCopiesOnlyWhenNeeded) {
  Tensor b = base34();
  EXPECT_TRUE(b.contiguous().same(b));
  Tensor t = b.t(), c = t.contiguous();
  EXPECT_TRUE(!t.is_contiguous() && c.is_contiguous());
  EXPECT_NE(c.storage(), b.storage());
  EXPECT_EQ(values(c), values(t));
  fill_(c, 0);
  EXPECT_EQ(values(b)[1], 1) << "the copy must not alias the base";
  EXPECT_EQ(b.reshape({12}).storage(), b.storage()) << "reshape of a contiguous tensor is a view";
}

TEST(TensorCopy, CloneIsIndependentAndContiguous) {
  Tensor b = base34();
  Tensor c = b.slice(1, 0, 4, 2).clone();
  EXPECT_NE(c.storage(), b.storage());
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.dtype(), b.dtype());
  EXPECT_EQ(values(c), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  fill_(c, -1);
  EXPECT_EQ(values(b), values(base34()));
}

TEST(TensorConvert, DTypeConversionsRoundAndTruncate) {
  auto f32 = [](std::vector<float> v) { return from_vector(v, {int64_t(v.size())}); };
  const struct {
    const char* name;
    Tensor in;
    DType to;
    std::vector<double> expected;
  } cases[] = {
      // bf16 keeps 8 significant bits and rounds to nearest, ties to even.
      {"f32_to_bf16", f32({1.0f, 1.00390625f, 1.01171875f, 3.14159274f, 1.0f / 3, 300.5f, -2.5f}), DType::bf16,
       {1.0, 1.0, 1.015625, 3.140625, 0.333984375, 300.0, -2.5}},
      {"f32_to_bf16_to_f32", f32({1.01171875f, -65.3f}).to(DType::bf16), DType::f32, {1.015625, -65.5}},
      {"f32_to_f16", f32({0.1f, 2048.5f, -1.5f}), DType::f16, {0.0999755859375, 2048.0, -1.5}},
      {"f32_to_i64_truncates", f32({2.7f, -2.7f, 0.5f, -0.5f, 1e9f}), DType::i64, {2, -2, 0, 0, 1e9}},
      {"f32_to_i32_truncates", f32({-7.9f, 7.9f}), DType::i32, {-7, 7}},
      {"f32_to_u8", f32({0.0f, 1.9f, 255.0f, 17.0f}), DType::u8, {0, 1, 255, 17}},
      {"i64_to_f32_rounds", from_vector(std::vector<int64_t>{16777217, -3}, {2}), DType::f32, {16777216, -3}},
      {"f64_to_f32", from_vector(std::vector<double>{0.1}, {1}), DType::f32, {double(0.1f)}},
      {"u8_to_f32", f32({200.0f, 3.0f}).to(DType::u8), DType::f32, {200, 3}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    Tensor out = c.in.to(c.to);
    EXPECT_EQ(out.dtype(), c.to);
    EXPECT_EQ(out.shape(), c.in.shape());
    EXPECT_EQ(values(out), c.expected);
    EXPECT_TRUE(out.to(c.to).same(out)) << "to() its own dtype is the tensor itself";
  }
}

TEST(TensorConvert, ItemAndToVector) {
  EXPECT_EQ(scalar_tensor(2.5).item(), 2.5);
  EXPECT_EQ(from_vector(std::vector<int64_t>{7}, {1, 1}).item(), 7.0);
  EXPECT_EQ(full({}, -1.25, DType::bf16).item(), -1.25);
  expect_error([] { zeros({2}).item(); }, {"one element", "(2,)"});
  Tensor t = base34().t();  // non-contiguous: row-major order of the view
  EXPECT_EQ(t.to_vector<int64_t>(), (std::vector<int64_t>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  EXPECT_EQ(from_vector(std::vector<float>{1.5f, 2.0f}, {2}).to_vector<uint8_t>(), (std::vector<uint8_t>{1, 2}));
  EXPECT_TRUE(zeros({0, 3}).to_vector<float>().empty());
}

TEST(TensorConvert, FromVectorChecksTheCount) {
  expect_error([] { from_vector(std::vector<float>{1, 2, 3}, {2, 2}); }, {"3 values", "(2, 2)"});
  EXPECT_EQ(from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {3, 2}).dtype(), DType::f64);
}

TEST(TensorPrint, SmallTensorShowsValuesShapeAndDtype) {
  Tensor t = from_vector(std::vector<float>{1, 2.5f, -3, 4}, {2, 2});
  std::string s = t.str();
  expect_contains(s, {"2.5", "-3", "shape=(2, 2)", "dtype=f32", "device=cpu"});
  EXPECT_EQ(s.find("..."), std::string::npos) << s;
  std::ostringstream os;
  os << t;
  EXPECT_EQ(os.str(), s);
  expect_contains(zeros({0, 3}).str(), {"shape=(0, 3)"});
  expect_contains(scalar_tensor(1.5).str(), {"1.5", "shape=()"});
}

TEST(TensorPrint, LargeTensorIsAbbreviated) {
  std::string s = arange(0, 100).str();
  expect_contains(s, {"...", "0, 1, 2", "97, 98, 99", "shape=(100,)", "dtype=i64"});
  EXPECT_EQ(s.find("50"), std::string::npos) << s;
  std::string m = zeros({40, 40}).str();
  expect_contains(m, {"..."});
  EXPECT_LT(m.size(), 1000u) << "a 40x40 tensor should print a few rows and columns";
}

TEST(TensorShape, BroadcastShapes) {
  const struct {
    Shape a, b, out;
  } cases[] = {{{3, 1}, {1, 4}, {3, 4}}, {{5, 1, 3}, {4, 1}, {5, 4, 3}}, {{}, {2}, {2}}, {{2, 3}, {2, 3}, {2, 3}},
               {{0, 1}, {1, 5}, {0, 5}}};
  for (const auto& c : cases) {
    EXPECT_EQ(broadcast_shapes(c.a, c.b), c.out) << shape_str(c.a) << " with " << shape_str(c.b);
    EXPECT_EQ(broadcast_shapes(c.b, c.a), c.out) << shape_str(c.b) << " with " << shape_str(c.a);
  }
  expect_error([] { broadcast_shapes({2, 3}, {4, 3}); }, {"(2, 3)", "(4, 3)"});
  expect_error([] { add(zeros({2, 3}), zeros({4})); }, {"(2, 3)", "(4,)"});
}

TEST(TensorShape, WrapDim) {
  const struct {
    int dim, ndim, expected;  // expected -1: an error
  } cases[] = {{0, 3, 0},   {2, 3, 2}, {-1, 3, 2}, {-3, 3, 0}, {3, 3, -1},
               {-4, 3, -1}, {0, 0, 0}, {-1, 0, 0}, {1, 0, -1}};
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "dim " << c.dim << " of " << c.ndim);
    if (c.expected >= 0) {
      EXPECT_EQ(wrap_dim(c.dim, c.ndim, "op"), c.expected);
    } else {
      expect_error([&] { wrap_dim(c.dim, c.ndim, "frobnicate"); }, {"frobnicate", "out of range"});
    }
  }
  Tensor b = base34();
  EXPECT_EQ(b.size(-1), 4);
  expect_error([&] { b.size(2); }, {"out of range"});
  expect_error([&] { b.transpose(0, 2); }, {"transpose", "out of range"});
}

// A 0-d tensor has no dimension to index: every op taking a dim must answer with an
// error (or, for squeeze and transpose, the scalar itself, as PyTorch does), never read
// past the empty shape. Each case runs in a child process so a crash fails only it.
TEST(TensorScalarDeathTest, DimArgumentsOnZeroDimTensorsNeverCrash) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const struct {
    const char* name;
    std::function<Tensor(const Tensor&)> op;
    bool throws;  // false: returns a 0-d tensor
  } cases[] = {
      {"size", [](const Tensor& s) { s.size(0); return s; }, true},
      {"stride", [](const Tensor& s) { s.stride(-1); return s; }, true},
      {"select", [](const Tensor& s) { return s.select(0, 0); }, true},
      {"slice", [](const Tensor& s) { return s.slice(0, 0, 1); }, true},
      {"cat", [](const Tensor& s) { return cat({s, s}, 0); }, true},
      {"split", [](const Tensor& s) { return split(s, 1, 0).at(0); }, true},
      {"squeeze", [](const Tensor& s) { return s.squeeze(0); }, false},
      {"transpose", [](const Tensor& s) { return s.transpose(0, -1); }, false},
  };
  for (const auto& c : cases) {
    EXPECT_EXIT(
        {
          Tensor s = scalar_tensor(5);
          try {
            bool scalar = c.op(s).dim() == 0;
            std::_Exit(!c.throws && scalar ? 0 : 1);
          } catch (const Error&) {
            std::_Exit(c.throws ? 0 : 2);
          }
        },
        testing::ExitedWithCode(0), "")
        << c.name << (c.throws ? " should throw loom::Error" : " should return the 0-d tensor");
  }
}

TEST(TensorJoin, CatAlongEachDim) {
  Tensor a = arange(0, 6, 1, DType::f32).reshape({2, 3});
  Tensor rows = cat({a, from_vector(std::vector<float>{6, 7, 8}, {1, 3})}, 0);
  EXPECT_EQ(rows.shape(), (Shape{3, 3}));
  EXPECT_EQ(values(rows), (std::vector<double>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  Tensor cols = cat({a, from_vector(std::vector<float>{-1, -2}, {2, 1})}, -1);
  EXPECT_EQ(cols.shape(), (Shape{2, 4}));
  EXPECT_EQ(values(cols), (std::vector<double>{0, 1, 2, -1, 3, 4, 5, -2}));
  Tensor mixed = cat({arange(0, 2), from_vector(std::vector<float>{0.5f}, {1})}, 0);
  EXPECT_EQ(mixed.dtype(), DType::f32);
  EXPECT_EQ(values(mixed), (std::vector<double>{0, 1, 0.5}));
  expect_error([&] { cat({a, zeros({3, 2})}, 0); }, {"(3, 2)", "(2, 3)"});
}

TEST(TensorJoin, StackAddsADim) {
  TensorList parts = split(arange(1, 7, 1, DType::f32), 2, 0);  // (1, 2), (3, 4), (5, 6)
  EXPECT_EQ(stack(parts, 0).shape(), (Shape{3, 2}));
  EXPECT_EQ(values(stack(parts, 0)), (std::vector<double>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(stack(parts, -1).shape(), (Shape{2, 3}));
  EXPECT_EQ(values(stack(parts, -1)), (std::vector<double>{1, 3, 5, 2, 4, 6}));
  expect_error([&] { stack({parts[0], zeros({3})}, 0); }, {"(3,)", "(2,)"});
}

TEST(TensorJoin, SplitGivesViewsWithAShorterLastPart) {
  Tensor x = arange(0, 7);
  TensorList parts = split(x, 3, 0);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(values(parts[0]), (std::vector<double>{0, 1, 2}));
  EXPECT_EQ(values(parts[1]), (std::vector<double>{3, 4, 5}));
  EXPECT_EQ(values(parts[2]), (std::vector<double>{6}));
  for (const Tensor& p : parts) EXPECT_EQ(p.storage(), x.storage());
  TensorList cols = split(zeros({2, 5}), 2, 1);
  ASSERT_EQ(cols.size(), 3u);
  EXPECT_EQ(cols[0].shape(), (Shape{2, 2}));
  EXPECT_EQ(cols[2].shape(), (Shape{2, 1}));
  EXPECT_EQ(values(cat(split(base34(), 2, 0), 0)), values(base34()));
}

TEST(TensorCreate, Arange) {
  const struct {
    double start, end, step;
    DType dtype;
    std::vector<double> expected;
  } cases[] = {{0, 5, 1, DType::i64, {0, 1, 2, 3, 4}}, {1, 2, 0.25, DType::f32, {1, 1.25, 1.5, 1.75}},
               {5, 0, -2, DType::i64, {5, 3, 1}},     {0, 1, 0.3, DType::f64, {0, 0.3, 0.6, 0.3 * 3}},
               {0, 0, 1, DType::i64, {}},             {3, 1, 1, DType::f32, {}}};
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << c.start << ".." << c.end << " step " << c.step);
    Tensor t = arange(c.start, c.end, c.step, c.dtype);
    EXPECT_EQ(t.dtype(), c.dtype);
    EXPECT_EQ(t.shape(), (Shape{int64_t(c.expected.size())}));
    std::vector<double> v = values(t);
    ASSERT_EQ(v.size(), c.expected.size());
    for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(v[i], c.expected[i], 1e-12);
  }
  expect_error([] { arange(0, 1, 0); }, {"step"});
}

TEST(TensorCreate, ZerosOnesFullInEveryDtype) {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    EXPECT_EQ(values(zeros({2, 3}, dt)), std::vector<double>(6, 0));
    EXPECT_EQ(values(ones({4}, dt)), std::vector<double>(4, 1));
    Tensor f = full({3, 1}, 7, dt);
    EXPECT_TRUE(f.dtype() == dt && f.shape() == (Shape{3, 1}));
    EXPECT_EQ(values(f), std::vector<double>(3, 7));
    EXPECT_EQ(values(zeros_like(f)), std::vector<double>(3, 0));
    EXPECT_EQ(ones_like(f).dtype(), dt);
  }
  EXPECT_EQ(zeros({}).numel(), 1);
  EXPECT_EQ(zeros({2, 0}).numel(), 0);
  expect_error([] { zeros({2, -1}); }, {"negative", "(2, -1)"});
}

TEST(TensorRandom, ManualSeedReproducesRandAndRandn) {
  manual_seed(7);
  std::vector<double> u1 = values(rand({100})), n1 = values(randn({3, 33}));
  manual_seed(7);
  EXPECT_EQ(values(rand({100})), u1);
  EXPECT_EQ(values(randn({3, 33})), n1);
  EXPECT_NE(values(rand({100})), u1) << "the next draw must differ";
  manual_seed(8);
  EXPECT_NE(values(rand({100})), u1) << "another seed must give other numbers";
  for (double v : u1) EXPECT_TRUE(v >= 0 && v < 1) << v;
}

TEST(TensorRandom, RngStateResumesTheSameStream) {
  manual_seed(5);
  EXPECT_EQ(rng_state(), (std::pair<uint64_t, uint64_t>{5, 0}));
  rand({10});
  auto state = rng_state();
  EXPECT_EQ(state.first, 5u);
  EXPECT_GT(state.second, 0u) << "a draw must advance the offset";
  std::vector<double> a = values(randn({17})), b = values(rand({4, 5}));
  manual_seed(99);
  rand({3});
  set_rng_state(state.first, state.second);
  EXPECT_EQ(values(randn({17})), a);
  EXPECT_EQ(values(rand({4, 5})), b);
}

TEST(TensorRandom, RandnLooksStandardNormal) {
  manual_seed(3);
  std::vector<double> v = values(randn({20000}));
  double mean = 0, sq = 0;
  for (double x : v) mean += x / double(v.size()), sq += x * x / double(v.size());
  EXPECT_NEAR(mean, 0.0, 0.03);
  EXPECT_NEAR(sq - mean * mean, 1.0, 0.05);
  EXPECT_EQ(rand({2, 2}, DType::bf16).dtype(), DType::bf16);
  expect_error([] { rand({2}, DType::i64); }, {"floating", "i64"});
}

}  // namespace
}  // namespace loom
