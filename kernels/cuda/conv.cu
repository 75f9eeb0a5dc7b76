// CUDA convolution: cuDNN's convolution API (cudnnConvolutionForward, ...BackwardData,
// ...BackwardFilter), which cuDNN 9 still ships beside its graph API and which covers
// every case Loom needs (NCHW, stride, padding, dilation, groups) in a few calls.
//
// Plans. For each (device, dtype, shapes, stride, padding, dilation, groups) a Plan holds
// the tensor, filter and convolution descriptors, built once. The algorithm of each pass
// is chosen the first time that pass's workspace size is asked for, with cuDNN's
// heuristics (cudnnGet*Algorithm_v7: no trial runs, so no memory of its own and no
// synchronisation, and capturable in a CUDA graph), and cached; the candidates are kept
// in the heuristics' order with their math type and workspace size.
//
// Workspace. Kernels never allocate device memory, so the engine asks
// conv2d_workspace_size for the pass, takes that many bytes from its caching allocator and
// passes them in Conv2dArgs. Candidates needing more than kMaxWorkspace are dropped.
//
// Precision. bf16 and f16 data compute in f32 (CUDNN_DATA_FLOAT) with tensor-core math;
// f32 uses CUDNN_DEFAULT_MATH, under which cuDNN runs TF32 tensor cores on Ampere and
// later, as PyTorch's allow_tf32 does, or CUDNN_FMA_MATH (plain f32) when
// kernels/core/precision.h says TF32 is not allowed. (CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION would convert
// f32 down to f16, which is not TF32: candidates with it are refused for f32.) cuDNN
// returns the math type each algorithm wants, and it is set on the descriptor before the
// algorithm runs (each pass has its own convolution descriptor for that reason).
//
// Robustness. The heuristics can name an algorithm that then refuses these shapes at run
// time (as PyTorch's "try_all" knows); a failing call moves on to the next candidate that
// fits the workspace given, and remembers the one that worked.
//
// One cuDNN handle per device, created on first use and kept for the process (like the
// cuBLAS handle); it is shared by host threads, so setting its stream, choosing an
// algorithm and issuing the call happen under a per-device lock.
//
// The graph API first. The convolution API above builds a cuDNN execution plan inside
// every call, which costs more host time than a small network's kernels take to run. So
// each pass of each plan also gets a graph API plan (conv_graph.h), built once, and a call
// whose pointers are 16-byte aligned runs that; the convolution API serves the rest, a
// shape the graph API builds no plan for, and any pass whose graph plan fails to run (it
// is then dropped). Conv2dArgs::graph_api false uses the convolution API alone: no graph
// plan is built or run for that call, while one built before stays for later calls.
//
// Autotuning (Conv2dArgs::autotune, Options::conv_autotuning), as PyTorch's
// cudnn.benchmark: the graph API's heuristics rank engines by a model of their speed, and
// their first choice is often not the fastest for small or odd shapes. So each pass gets up
// to kTunedPlans graph plans, and the first autotuned call of the pass whose workspace fits
// them all and whose stream is not being captured runs each on its own operands (one
// warm-up, three timed runs, the median) and keeps the fastest for later autotuned calls:
// once per shape, a few milliseconds and a stream synchronisation per candidate. Until then,
// and for calls that do not autotune, the heuristics' first choice runs. A later candidate
// may need at most kTrialWorkspace bytes (256 MiB) or the first's workspace, whichever is
// more: that first call may ask for up to that much, which the caching allocator then keeps.
// The timed runs write the pass's output only (alpha 1, beta 0), which the kept plan then
// writes again. Plans are never freed: a captured CUDA graph may hold their kernels. A plan
// that fails at run time sends the pass to the convolution API for good, whichever of the
// plans it was (graph_failed).
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/core/precision.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_graph.h"
#include "kernels/cuda/kernels.h"

namespace loom::cuda {
namespace {

constexpr int kMaxDevices = 64;
constexpr size_t kMaxWorkspace = size_t(1) << 30;
constexpr int kTunedPlans = 8;
constexpr size_t kTrialWorkspace = size_t(256) << 20;

struct Dnn {
  cudnnHandle_t handle = nullptr;
  std::mutex mu;
};

Dnn& dnn_for_device(int device) {
  LOOM_ASSERT(device >= 0 && device < kMaxDevices, "device ", device, " is past the ", kMaxDevices,
              " cuDNN handles Loom keeps");
  static std::once_flag created[kMaxDevices];
  static Dnn dnn[kMaxDevices];
  std::call_once(created[device], [&] { LOOM_CUDNN(cudnnCreate(&dnn[device].handle)); });
  return dnn[device];
}

const char* pass_name(ConvPass pass) {
  switch (pass) {
    case ConvPass::forward: return "forward";
    case ConvPass::backward_data: return "backward data";
    case ConvPass::backward_filter: return "backward filter";
  }
  return "?";
}

std::string describe(const Conv2dArgs& a) {
  return detail::str("x (", a.n, ", ", a.c_in, ", ", a.h, ", ", a.w, "), weight (", a.c_out, ", ", a.c_in / a.groups,
                     ", ", a.kh, ", ", a.kw, "), stride (", a.stride_h, ", ", a.stride_w, "), padding (", a.pad_h,
                     ", ", a.pad_w, "), dilation (", a.dilation_h, ", ", a.dilation_w, "), groups ", a.groups, ", ",
                     dtype_name(a.dtype));
}

struct Candidate {
  int algo;  // a cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t
  cudnnMathType_t math;
  size_t workspace;
};

struct Plan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  std::array<cudnnConvolutionDescriptor_t, 3> conv{};  // one per pass
  std::array<std::vector<Candidate>, 3> candidates;    // empty until the pass is first planned
  std::array<size_t, 3> current{};                      // index of the candidate in use
  // The graph API's plans, the heuristics' first choice first (empty: none), how many were
  // asked for (0: not yet built; 1 or kTunedPlans), the one timing chose (-1: not yet), and
  // whether the plan in use failed at run time (the convolution API from then on).
  std::array<std::vector<conv_graph::PlanPtr>, 3> graph;
  std::array<int, 3> graph_asked{};
  std::array<int, 3> graph_chosen{-1, -1, -1};
  std::array<bool, 3> graph_failed{};
  std::vector<conv_graph::PlanPtr> retired;  // plans replaced by a longer list, kept alive

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  // Runs only when building a plan fails part-way: plans in the cache live for the process.
  ~Plan() {
    if (x) cudnnDestroyTensorDescriptor(x);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (w) cudnnDestroyFilterDescriptor(w);
    for (auto c : conv)
      if (c) cudnnDestroyConvolutionDescriptor(c);
  }
};

int to_int(int64_t v) { return int(v); }

std::unique_ptr<Plan> make_plan(const Conv2dArgs& a) {
  const CudnnTypes t = cudnn_types(a.dtype);
  const cudnnTensorFormat_t format = a.layout == ChannelLayout::channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  auto p = std::make_unique<Plan>();
  LOOM_CUDNN(cudnnCreateTensorDescriptor(&p->x));
  LOOM_CUDNN(cudnnSetTensor4dDescriptor(p->x, format, t.data, to_int(a.n), to_int(a.c_in), to_int(a.h), to_int(a.w)));
  LOOM_CUDNN(cudnnCreateTensorDescriptor(&p->y));
  LOOM_CUDNN(cudnnSetTensor4dDescriptor(p->y, format, t.data, to_int(a.n), to_int(a.c_out), to_int(a.out_h),
                                        to_int(a.out_w)));
  LOOM_CUDNN(cudnnCreateFilterDescriptor(&p->w));
  LOOM_CUDNN(cudnnSetFilter4dDescriptor(p->w, t.data, format, to_int(a.c_out), to_int(a.c_in / a.groups),
                                        to_int(a.kh), to_int(a.kw)));
  for (auto& c : p->conv) {
    LOOM_CUDNN(cudnnCreateConvolutionDescriptor(&c));
    LOOM_CUDNN(cudnnSetConvolution2dDescriptor(c, to_int(a.pad_h), to_int(a.pad_w), to_int(a.stride_h),
                                               to_int(a.stride_w), to_int(a.dilation_h), to_int(a.dilation_w),
                                               CUDNN_CROSS_CORRELATION, t.compute));
    LOOM_CUDNN(cudnnSetConvolutionGroupCount(c, to_int(a.groups)));
    // The math type the heuristics may choose from (see the top of the file).
    LOOM_CUDNN(cudnnSetConvolutionMathType(c, t.math));
  }
  int n = 0, c = 0, h = 0, w = 0;
  LOOM_CUDNN(cudnnGetConvolution2dForwardOutputDim(p->conv[0], p->x, p->w, &n, &c, &h, &w));
  LOOM_ASSERT(n == a.n && c == a.c_out && h == a.out_h && w == a.out_w, "cuDNN's output shape (", n, ", ", c, ", ",
              h, ", ", w, ") differs from Loom's (", a.n, ", ", a.c_out, ", ", a.out_h, ", ", a.out_w,
              ") for ", describe(a));
  return p;
}

// The plan for these shapes on `device`, built on first use. Plans are never freed.
Plan& plan_for(const Conv2dArgs& a, int device) {
  using Key = std::array<int64_t, 22>;
  struct Cache {
    std::mutex mu;
    std::map<Key, std::unique_ptr<Plan>> plans;
  };
  static Cache* cache = new Cache;
  const Key key{device,     int64_t(a.dtype), a.n,        a.c_in,     a.h,        a.w,
                a.c_out,    a.kh,             a.kw,       a.out_h,    a.out_w,    a.stride_h,
                a.stride_w, a.pad_h,          a.pad_w,    a.dilation_h, a.dilation_w, a.groups,
                int64_t(a.dtype == DType::f32 && tf32_allowed()), int64_t(a.deterministic),
                int64_t(a.layout), int64_t(a.accumulate)};
  std::lock_guard lock(cache->mu);
  auto& slot = cache->plans[key];
  if (!slot) slot = make_plan(a);
  return *slot;
}

// The heuristics' ranking for one pass, each candidate with its workspace size for the
// math type it asks for. Called under the device lock.
template <class Perf, class GetAlgos, class GetWorkspace>
std::vector<Candidate> rank(const Conv2dArgs& a, cudnnConvolutionDescriptor_t conv, int max_count, GetAlgos get_algos,
                            GetWorkspace get_workspace) {
  std::vector<Perf> perf(size_t(std::max(max_count, 1)));
  int count = 0;
  LOOM_CUDNN(get_algos(int(perf.size()), &count, perf.data()));
  std::vector<Candidate> out;
  for (int i = 0; i < count; ++i) {
    const Perf& p = perf[size_t(i)];
    if (p.status != CUDNN_STATUS_SUCCESS) continue;
    if (a.deterministic && p.determinism != CUDNN_DETERMINISTIC) continue;
    if (a.dtype == DType::f32 && p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    if (a.dtype == DType::f32 && !tf32_allowed() && p.mathType != CUDNN_FMA_MATH) continue;
    size_t bytes = 0;
    if (cudnnSetConvolutionMathType(conv, p.mathType) != CUDNN_STATUS_SUCCESS) continue;
    if (get_workspace(p.algo, &bytes) != CUDNN_STATUS_SUCCESS) continue;
    bytes = std::max(bytes, p.memory);
    if (bytes > kMaxWorkspace) continue;
    out.push_back({int(p.algo), p.mathType, bytes});
  }
  return out;
}

// Plans one pass (once): fills plan.candidates[pass]. Called under the device lock.
void plan_pass(Plan& p, const Conv2dArgs& a, ConvPass pass, cudnnHandle_t h) {
  auto& list = p.candidates[size_t(pass)];
  if (!list.empty()) return;
  cudnnConvolutionDescriptor_t conv = p.conv[size_t(pass)];
  int max_count = 0;
  switch (pass) {
    case ConvPass::forward:
      LOOM_CUDNN(cudnnGetConvolutionForwardAlgorithmMaxCount(h, &max_count));
      list = rank<cudnnConvolutionFwdAlgoPerf_t>(
          a, conv, max_count,
          [&](int n, int* count, cudnnConvolutionFwdAlgoPerf_t* perf) {
            return cudnnGetConvolutionForwardAlgorithm_v7(h, p.x, p.w, conv, p.y, n, count, perf);
          },
          [&](cudnnConvolutionFwdAlgo_t algo, size_t* bytes) {
            return cudnnGetConvolutionForwardWorkspaceSize(h, p.x, p.w, conv, p.y, algo, bytes);
          });
      break;
    case ConvPass::backward_data:
      LOOM_CUDNN(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(h, &max_count));
      list = rank<cudnnConvolutionBwdDataAlgoPerf_t>(
          a, conv, max_count,
          [&](int n, int* count, cudnnConvolutionBwdDataAlgoPerf_t* perf) {
            return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p.w, p.y, conv, p.x, n, count, perf);
          },
          [&](cudnnConvolutionBwdDataAlgo_t algo, size_t* bytes) {
            return cudnnGetConvolutionBackwardDataWorkspaceSize(h, p.w, p.y, conv, p.x, algo, bytes);
          });
      break;
    case ConvPass::backward_filter:
      LOOM_CUDNN(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(h, &max_count));
      list = rank<cudnnConvolutionBwdFilterAlgoPerf_t>(
          a, conv, max_count,
          [&](int n, int* count, cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
            return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p.x, p.y, conv, p.w, n, count, perf);
          },
          [&](cudnnConvolutionBwdFilterAlgo_t algo, size_t* bytes) {
            return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, p.x, p.y, conv, p.w, algo, bytes);
          });
      break;
  }
  LOOM_CHECK(!list.empty(), "conv2d ", pass_name(pass), ": cuDNN offers no algorithm for ", describe(a),
             " within a ", kMaxWorkspace >> 20, " MiB workspace");
}

// The pass's graph API plans, built the first time a call asks for the graph API (and
// again, longer, the first time a call also autotunes); null when the call does not use the
// graph API, or when there is no usable plan. Called under the device lock.
const std::vector<conv_graph::PlanPtr>* graph_plans(Plan& p, const Conv2dArgs& a, ConvPass pass, cudnnHandle_t h) {
  if (!a.graph_api) return nullptr;
  const size_t i = size_t(pass);
  const int wanted = a.autotune ? kTunedPlans : 1;
  if (p.graph_asked[i] < wanted) {
    for (auto& plan : p.graph[i]) p.retired.push_back(std::move(plan));
    p.graph[i] = conv_graph::build(a, pass, h, kMaxWorkspace, wanted, kTrialWorkspace);
    p.graph_asked[i] = wanted;
    p.graph_chosen[i] = p.graph[i].size() == 1 ? 0 : -1;
  }
  if (p.graph_failed[i] || p.graph[i].empty()) return nullptr;
  return &p.graph[i];
}

// Which of the pass's graph plans a call runs: timing's choice when it autotunes and timing
// has chosen, else the heuristics' first.
size_t plan_in_use(const Plan& p, const Conv2dArgs& a, ConvPass pass) {
  const int chosen = p.graph_chosen[size_t(pass)];
  return a.autotune && chosen >= 0 ? size_t(chosen) : 0;
}

// An accumulating backward data pass (dx +=). Timing its plans on dx would add again and
// again, so they write into scratch that follows the plans' own workspace instead.
bool accumulates(const Conv2dArgs& a, ConvPass pass) { return pass == ConvPass::backward_data && a.accumulate; }
size_t scratch_offset(size_t plans_workspace) { return (plans_workspace + 255) / 256 * 256; }
size_t dx_bytes(const Conv2dArgs& a) { return size_t(a.n * a.c_in * a.h * a.w) * dtype_size(a.dtype); }

size_t most_workspace(const std::vector<conv_graph::PlanPtr>& plans) {
  size_t most = 0;
  for (const auto& plan : plans) most = std::max(most, conv_graph::workspace_size(*plan));
  return most;
}

// Whether the pass's plans may be timed: an accumulating pass whose scratch would take the
// workspace past kMaxWorkspace runs the heuristics' first plan instead.
bool can_time(const Conv2dArgs& a, ConvPass pass, const std::vector<conv_graph::PlanPtr>& plans) {
  return !accumulates(a, pass) || scratch_offset(most_workspace(plans)) + dx_bytes(a) <= kMaxWorkspace;
}

// An accumulating pass whose attempt failed once its kernels may have run (an execution
// error, not a refusal) may have added part of the gradient already: another attempt would
// add it again, so the call fails instead.
void check_no_partial_sum(const Conv2dArgs& a, ConvPass pass, cudnnStatus_t status) {
  const bool ran = status >= CUDNN_STATUS_EXECUTION_FAILED && status < CUDNN_STATUS_EXECUTION_FAILED + 1000;
  LOOM_CHECK(!(accumulates(a, pass) && ran), "conv2d ", pass_name(pass), ": cuDNN error ", int(status), " (",
             cudnnGetErrorString(status), ") for ", describe(a),
             " while adding into the input's gradient, which may now hold part of the sum; not retried");
}

// The workspace the pass's graph plans need for this call: the largest of them while an
// autotuned call has yet to time them (and the scratch it times in, for an accumulating
// pass), else that of the plan in use.
size_t graph_workspace(const Plan& p, const std::vector<conv_graph::PlanPtr>& plans, const Conv2dArgs& a,
                       ConvPass pass) {
  if (a.autotune && p.graph_chosen[size_t(pass)] < 0 && can_time(a, pass, plans)) {
    const size_t most = most_workspace(plans);
    return accumulates(a, pass) ? scratch_offset(most) + dx_bytes(a) : most;
  }
  return conv_graph::workspace_size(*plans[plan_in_use(p, a, pass)]);
}

// Times each of the pass's graph plans on this call's operands and keeps the fastest (see
// the top of the file); leaves the choice open when the stream is being captured. A plan
// that fails to run is passed over. Called under the device lock, the workspace fitting all.
void choose_plan(Plan& p, const Conv2dArgs& a, ConvPass pass, cudnnHandle_t h, cudaStream_t stream, const void* x,
                 const void* w, const void* y, void* workspace) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  LOOM_CUDA(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return;
  const auto& plans = p.graph[size_t(pass)];
  if (accumulates(a, pass)) {
    void* scratch = static_cast<char*>(workspace) + scratch_offset(most_workspace(plans));
    LOOM_CUDA(cudaMemsetAsync(scratch, 0, dx_bytes(a), stream));
    x = scratch;
  }
  struct Marks {  // destroyed however the timing ends
    cudaEvent_t e[4] = {};
    Marks() {
      for (auto& m : e) LOOM_CUDA(cudaEventCreate(&m));
    }
    ~Marks() {
      for (auto m : e)
        if (m) cudaEventDestroy(m);
    }
  } held;
  cudaEvent_t (&marks)[4] = held.e;
  float best = std::numeric_limits<float>::infinity();
  int chosen = -1;
  for (size_t k = 0; k < plans.size(); ++k) {
    const conv_graph::Plan& plan = *plans[k];
    void* ws = conv_graph::workspace_size(plan) ? workspace : nullptr;
    if (conv_graph::execute(plan, h, x, w, y, ws) != CUDNN_STATUS_SUCCESS) continue;  // warm-up
    LOOM_CUDA(cudaEventRecord(marks[0], stream));
    bool ran = true;
    for (int r = 1; r < 4 && ran; ++r) {
      ran = conv_graph::execute(plan, h, x, w, y, ws) == CUDNN_STATUS_SUCCESS;
      LOOM_CUDA(cudaEventRecord(marks[r], stream));
    }
    LOOM_CUDA(cudaEventSynchronize(marks[3]));
    if (!ran) continue;
    float runs[3];
    for (int r = 0; r < 3; ++r) LOOM_CUDA(cudaEventElapsedTime(&runs[r], marks[r], marks[r + 1]));
    std::sort(runs, runs + 3);
    if (runs[1] < best) best = runs[1], chosen = int(k);
  }
  if (chosen >= 0) p.graph_chosen[size_t(pass)] = chosen;
}

// The workspace a pass may use: its graph plans' (graph_workspace) or its convolution API
// candidate's, whichever is larger, since a call may end up on either. Called under the
// device lock.
size_t pass_workspace(Plan& p, const Conv2dArgs& a, ConvPass pass, cudnnHandle_t h) {
  plan_pass(p, a, pass, h);
  const size_t legacy = p.candidates[size_t(pass)][p.current[size_t(pass)]].workspace;
  const auto* plans = graph_plans(p, a, pass, h);
  return std::max(legacy, plans ? graph_workspace(p, *plans, a, pass) : size_t(0));
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Checks the sizes cuDNN's int-based descriptors can hold.
void check_sizes(const Conv2dArgs& a) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  const int64_t dims[] = {a.n,     a.c_in,  a.h,        a.w,        a.c_out,      a.kh,         a.kw,
                          a.out_h, a.out_w, a.stride_h, a.stride_w, a.dilation_h, a.dilation_w, a.groups};
  for (int64_t d : dims) LOOM_CHECK(d <= kMax, "conv2d: a size of ", describe(a), " is past cuDNN's 32-bit limit");
  LOOM_CHECK(a.n * a.c_in * a.h * a.w <= kMax && a.n * a.c_out * a.out_h * a.out_w <= kMax, "conv2d: ", describe(a),
             " has more than 2^31 elements in its input or output, past cuDNN's limit: split the batch");
}

int current_device() {
  int device = 0;
  LOOM_CUDA(cudaGetDevice(&device));
  return device;
}

// Runs one pass: its graph plan when the pointers x, w, y (the tensors of the pass's
// roles, conv_graph::execute) allow it, else `call(plan, handle, conv, algo, workspace,
// bytes)` with the convolution API, the candidate in use first, then any later one that
// fits the workspace given, remembering the first that succeeds.
template <class Call>
void run_pass(const Conv2dArgs& a, ConvPass pass, StreamHandle stream, const void* x, const void* w, const void* y,
              Call call) {
  check_sizes(a);
  const int device = current_device();
  Plan& p = plan_for(a, device);
  Dnn& dnn = dnn_for_device(device);
  std::lock_guard lock(dnn.mu);
  plan_pass(p, a, pass, dnn.handle);
  LOOM_CUDNN(cudnnSetStream(dnn.handle, as_cuda(stream)));
  if (const auto* plans = graph_plans(p, a, pass, dnn.handle);
      plans && aligned16(x) && aligned16(w) && aligned16(y) && aligned16(a.workspace)) {
    if (a.autotune && p.graph_chosen[size_t(pass)] < 0 && can_time(a, pass, *plans) &&
        a.workspace_bytes >= graph_workspace(p, *plans, a, pass))
      choose_plan(p, a, pass, dnn.handle, as_cuda(stream), x, w, y, a.workspace);
    const conv_graph::Plan& g = *(*plans)[plan_in_use(p, a, pass)];
    const size_t need = conv_graph::workspace_size(g);
    if (a.workspace_bytes >= need) {
      const cudnnStatus_t status = conv_graph::execute(g, dnn.handle, x, w, y, need ? a.workspace : nullptr);
      if (status == CUDNN_STATUS_SUCCESS) return;
      check_no_partial_sum(a, pass, status);
      p.graph_failed[size_t(pass)] = true;  // refused at run time: the convolution API from now on
    }
  }
  const auto& list = p.candidates[size_t(pass)];
  size_t& current = p.current[size_t(pass)];
  LOOM_ASSERT(a.workspace_bytes >= list[current].workspace, "conv2d ", pass_name(pass), ": workspace of ",
              a.workspace_bytes, " bytes given, ", list[current].workspace, " needed (ask conv2d_workspace_size)");
  cudnnConvolutionDescriptor_t conv = p.conv[size_t(pass)];
  void* workspace = a.workspace_bytes ? a.workspace : nullptr;
  cudnnStatus_t first_error = CUDNN_STATUS_SUCCESS;
  for (size_t i = current; i < list.size(); ++i) {
    if (list[i].workspace > a.workspace_bytes) continue;
    LOOM_CUDNN(cudnnSetConvolutionMathType(conv, list[i].math));
    const cudnnStatus_t status = call(p, dnn.handle, conv, list[i].algo, workspace, a.workspace_bytes);
    if (status == CUDNN_STATUS_SUCCESS) {
      current = i;
      return;
    }
    check_no_partial_sum(a, pass, status);
    if (first_error == CUDNN_STATUS_SUCCESS) first_error = status;
  }
  LOOM_FAIL("conv2d ", pass_name(pass), ": cuDNN error ", int(first_error), " (", cudnnGetErrorString(first_error),
            ") for ", describe(a), ", and no other algorithm fitting the workspace ran either");
}

// The scaling factors cuDNN reads: double for f64 data, float otherwise.
struct Scale {
  float f1 = 1.f, f0 = 0.f;
  double d1 = 1.0, d0 = 0.0;
  const void* one(DType t) const { return t == DType::f64 ? static_cast<const void*>(&d1) : &f1; }
  const void* zero(DType t) const { return t == DType::f64 ? static_cast<const void*>(&d0) : &f0; }
};

}  // namespace

size_t conv2d_workspace_size(const Conv2dArgs& a, ConvPass pass) {
  if (a.n == 0) return 0;
  check_sizes(a);
  const int device = current_device();
  Plan& p = plan_for(a, device);
  Dnn& dnn = dnn_for_device(device);
  std::lock_guard lock(dnn.mu);
  return pass_workspace(p, a, pass, dnn.handle);
}

void conv2d_forward(const Conv2dArgs& a, void* y, const void* x, const void* w, StreamHandle stream) {
  if (a.n == 0) return;
  const Scale s;
  run_pass(a, ConvPass::forward, stream, x, w, y,
           [&](const Plan& p, cudnnHandle_t h, cudnnConvolutionDescriptor_t conv, int algo, void* ws, size_t bytes) {
             return cudnnConvolutionForward(h, s.one(a.dtype), p.x, x, p.w, w, conv, cudnnConvolutionFwdAlgo_t(algo),
                                            ws, bytes, s.zero(a.dtype), p.y, y);
           });
}

void conv2d_backward_data(const Conv2dArgs& a, void* dx, const void* dy, const void* w, StreamHandle stream) {
  if (a.n == 0) return;
  const Scale s;
  const void* beta = a.accumulate ? s.one(a.dtype) : s.zero(a.dtype);
  run_pass(a, ConvPass::backward_data, stream, dx, w, dy,
           [&](const Plan& p, cudnnHandle_t h, cudnnConvolutionDescriptor_t conv, int algo, void* ws, size_t bytes) {
             return cudnnConvolutionBackwardData(h, s.one(a.dtype), p.w, w, p.y, dy, conv,
                                                 cudnnConvolutionBwdDataAlgo_t(algo), ws, bytes, beta, p.x, dx);
           });
}

void conv2d_backward_filter(const Conv2dArgs& a, void* dw, const void* x, const void* dy, StreamHandle stream) {
  if (a.n == 0) {  // nothing to sum: the gradient is zero
    const size_t bytes = size_t(a.c_out * (a.c_in / a.groups) * a.kh * a.kw) * dtype_size(a.dtype);
    if (bytes) LOOM_CUDA(cudaMemsetAsync(dw, 0, bytes, as_cuda(stream)));
    return;
  }
  const Scale s;
  run_pass(a, ConvPass::backward_filter, stream, x, dw, dy,
           [&](const Plan& p, cudnnHandle_t h, cudnnConvolutionDescriptor_t conv, int algo, void* ws, size_t bytes) {
             return cudnnConvolutionBackwardFilter(h, s.one(a.dtype), p.x, x, p.y, dy, conv,
                                                   cudnnConvolutionBwdFilterAlgo_t(algo), ws, bytes, s.zero(a.dtype),
                                                   p.w, dw);
           });
}

}  // namespace loom::cuda
