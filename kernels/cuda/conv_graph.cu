// cuDNN graph API plans for convolutions (conv_graph.h says what and why). The descriptors
// follow cuDNN's backend reference: three tensors (x, w, y, or their gradients) with unique
// ids 1, 2, 3, a convolution descriptor, one convolution operation, its operation graph,
// the heuristics' engine configurations, and an execution plan per configuration tried.
#include "kernels/cuda/conv_graph.h"

#include <algorithm>
#include <array>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/core/precision.h"

namespace loom::cuda {

CudnnTypes cudnn_types(DType dtype) {
  switch (dtype) {
    case DType::f32: return {CUDNN_DATA_FLOAT, CUDNN_DATA_FLOAT, tf32_allowed() ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH};
    case DType::f64: return {CUDNN_DATA_DOUBLE, CUDNN_DATA_DOUBLE, CUDNN_DEFAULT_MATH};
    case DType::bf16: return {CUDNN_DATA_BFLOAT16, CUDNN_DATA_FLOAT, CUDNN_TENSOR_OP_MATH};
    case DType::f16: return {CUDNN_DATA_HALF, CUDNN_DATA_FLOAT, CUDNN_TENSOR_OP_MATH};
    default: LOOM_FAIL("conv2d needs a floating-point dtype, got ", dtype_name(dtype));
  }
}

}  // namespace loom::cuda

namespace loom::cuda::conv_graph {
namespace {

constexpr int64_t kX = 1, kW = 2, kY = 3;  // unique ids: input, filter, output
constexpr int64_t kAlignment = 16;

// One backend descriptor, destroyed with its owner; `ok` turns false at the first call
// that does not succeed, and every later call is skipped.
struct Desc {
  cudnnBackendDescriptor_t d = nullptr;
  bool ok = true;

  explicit Desc(cudnnBackendDescriptorType_t type) {
    ok = cudnnBackendCreateDescriptor(type, &d) == CUDNN_STATUS_SUCCESS;
  }
  ~Desc() {
    if (d) cudnnBackendDestroyDescriptor(d);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  Desc(Desc&& o) noexcept : d(o.d), ok(o.ok) { o.d = nullptr; }

  template <class V>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const V* value) {
    if (ok) ok = cudnnBackendSetAttribute(d, name, type, count, value) == CUDNN_STATUS_SUCCESS;
    return *this;
  }
  Desc& set_desc(cudnnBackendAttributeName_t name, const Desc& other) {
    ok = ok && other.ok;
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &other.d);
  }
  bool finalize() {
    if (ok) ok = cudnnBackendFinalize(d) == CUDNN_STATUS_SUCCESS;
    return ok;
  }
};

// A 4-d tensor of logical dims (N, C, H, W), laid out NCHW or, channels-last, NHWC.
Desc tensor(int64_t uid, cudnnDataType_t type, std::array<int64_t, 4> dims, bool channels_last) {
  const std::array<int64_t, 4> strides =
      channels_last ? std::array<int64_t, 4>{dims[1] * dims[2] * dims[3], 1, dims[3] * dims[1], dims[1]}
                    : std::array<int64_t, 4>{dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1};
  Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type)
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data())
      .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data())
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid)
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &kAlignment)
      .finalize();
  return t;
}

// Whether an engine's numerical notes suit the dtype (conv_graph.h).
bool notes_allowed(const Desc& cfg, DType dtype, bool deterministic) {
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  int64_t got = 0;
  if (!engine.ok || cudnnBackendGetAttribute(cfg.d, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got,
                                             &engine.d) != CUDNN_STATUS_SUCCESS)
    return false;
  std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
  int64_t count = 0;
  if (cudnnBackendGetAttribute(engine.d, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               int64_t(notes.size()), &count, notes.data()) != CUDNN_STATUS_SUCCESS)
    return false;
  for (int64_t i = 0; i < count; ++i) {
    const cudnnBackendNumericalNote_t n = notes[size_t(i)];
    if (n == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS || n == CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION)
      return false;
    if (n == CUDNN_NUMERICAL_NOTE_TENSOR_CORE && dtype == DType::f32 && !tf32_allowed()) return false;
    if (n == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC && deterministic) return false;
  }
  return true;
}

// A pass's operation descriptor and the names of its attributes: the tensor in x's place (x
// or dx), in w's (w or dw), in y's (y or dy), the convolution, alpha and beta.
struct OperationAttributes {
  cudnnBackendDescriptorType_t type;
  cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
};

const OperationAttributes& operation_attributes(ConvPass pass) {
  static const OperationAttributes kForward{
      CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,             CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
      CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA};
  static const OperationAttributes kBackwardData{
      CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,                  CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,          CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA};
  static const OperationAttributes kBackwardFilter{
      CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,                 CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,          CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
      CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA};
  return pass == ConvPass::forward ? kForward : pass == ConvPass::backward_data ? kBackwardData : kBackwardFilter;
}

}  // namespace

// The finalized plan, and every descriptor it was made from (shared by the plans of one
// pass), kept for as long as it is.
class Plan {
 public:
  Plan(Desc plan, size_t workspace, std::shared_ptr<const std::vector<Desc>> sources)
      : plan_(std::move(plan)), workspace_(workspace), sources_(std::move(sources)) {}
  const Desc& desc() const { return plan_; }
  size_t workspace() const { return workspace_; }

 private:
  Desc plan_;
  size_t workspace_;
  std::shared_ptr<const std::vector<Desc>> sources_;
};

void PlanDeleter::operator()(Plan* p) const { delete p; }

std::vector<PlanPtr> build(const Conv2dArgs& a, ConvPass pass, cudnnHandle_t handle, size_t max_workspace,
                           int max_plans, size_t later_workspace) {
  const CudnnTypes types = cudnn_types(a.dtype);
  Desc x = tensor(kX, types.data, {a.n, a.c_in, a.h, a.w}, a.layout == ChannelLayout::channels_last);
  Desc w = tensor(kW, types.data, {a.c_out, a.c_in / a.groups, a.kh, a.kw}, a.layout == ChannelLayout::channels_last);
  Desc y = tensor(kY, types.data, {a.n, a.c_out, a.out_h, a.out_w}, a.layout == ChannelLayout::channels_last);

  const cudnnDataType_t compute = types.compute;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const int64_t spatial = 2;
  const std::array<int64_t, 2> dilation{a.dilation_h, a.dilation_w}, stride{a.stride_h, a.stride_w},
      padding{a.pad_h, a.pad_w};
  Desc conv(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  conv.set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &spatial)
      .set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute)
      .set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode)
      .set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dilation.data())
      .set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, stride.data())
      .set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, padding.data())
      .set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, padding.data())
      .finalize();

  // alpha 1, beta 0 (1 for an accumulating backward data pass), in the compute type.
  const float f1 = 1.f, f0 = 0.f;
  const double d1 = 1.0, d0 = 0.0;
  const bool dbl = compute == CUDNN_DATA_DOUBLE;
  const cudnnBackendAttributeType_t scale_type = dbl ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT;
  const void* one = dbl ? static_cast<const void*>(&d1) : &f1;
  const void* zero = dbl ? static_cast<const void*>(&d0) : &f0;

  const OperationAttributes& names = operation_attributes(pass);
  Desc op(names.type);
  op.set_desc(names.x, x)
      .set_desc(names.w, w)
      .set_desc(names.y, y)
      .set_desc(names.conv, conv)
      .set(names.alpha, scale_type, 1, one)
      .set(names.beta, scale_type, 1, pass == ConvPass::backward_data && a.accumulate ? one : zero);
  op.finalize();

  Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  graph.set_desc(CUDNN_ATTR_OPERATIONGRAPH_OPS, op)
      .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  if (!graph.finalize()) return {};

  const cudnnBackendHeurMode_t heur_mode = CUDNN_HEUR_MODE_A;
  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &heur_mode);
  if (!heur.finalize()) return {};
  int64_t count = 0;
  if (cudnnBackendGetAttribute(heur.d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                               nullptr) != CUDNN_STATUS_SUCCESS ||
      count <= 0)
    return {};
  std::vector<Desc> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    if (!configs.back().ok) return {};
    raw.push_back(configs.back().d);
  }
  int64_t returned = 0;
  if (cudnnBackendGetAttribute(heur.d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned,
                               raw.data()) != CUDNN_STATUS_SUCCESS)
    return {};

  std::vector<std::pair<Desc, size_t>> found;  // finalized plans and their workspace sizes
  for (int64_t i = 0; i < returned && int(found.size()) < max_plans; ++i) {
    const Desc& cfg = configs[size_t(i)];
    if (!notes_allowed(cfg, a.dtype, a.deterministic)) continue;
    Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle)
        .set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg);
    if (!plan.finalize()) continue;
    int64_t bytes = 0, got = 0;
    const size_t limit = found.empty() ? max_workspace : std::min(max_workspace, std::max(later_workspace, found[0].second));
    if (cudnnBackendGetAttribute(plan.d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got, &bytes) !=
            CUDNN_STATUS_SUCCESS ||
        bytes < 0 || size_t(bytes) > limit)
      continue;
    found.emplace_back(std::move(plan), size_t(bytes));
  }
  std::vector<PlanPtr> plans;
  if (found.empty()) return plans;
  auto sources = std::make_shared<std::vector<Desc>>();
  for (Desc* d : {&x, &w, &y, &conv, &op, &graph, &heur}) sources->push_back(std::move(*d));
  for (Desc& c : configs) sources->push_back(std::move(c));
  for (auto& [plan, bytes] : found) plans.push_back(PlanPtr(new Plan(std::move(plan), bytes, sources)));
  return plans;
}

size_t workspace_size(const Plan& plan) { return plan.workspace(); }

cudnnStatus_t execute(const Plan& plan, cudnnHandle_t handle, const void* x, const void* w, const void* y,
                      void* workspace) {
  const std::array<int64_t, 3> uids{kX, kW, kY};
  const std::array<void*, 3> ptrs{const_cast<void*>(x), const_cast<void*>(w), const_cast<void*>(y)};
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids.data())
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, ptrs.data())
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  if (!pack.finalize()) return CUDNN_STATUS_BAD_PARAM;
  return cudnnBackendExecute(handle, plan.desc().d, pack.d);
}

}  // namespace loom::cuda::conv_graph
