// Convolution and pooling over NCHW tensors: the shape rules and their messages, the
// kernel calls, and the backward closures beside the forwards.
//
// conv2d records one node for (x, weight): dx through conv2d_backward_data, dW through
// conv2d_backward_filter, each computed only when its input wants a gradient (the images
// entering the first layer do not). The bias is a broadcast add after the node, so its
// gradient is the add's: the sum of dy over N, H and W.
//
// The CUDA kernels need device scratch (cuDNN workspaces) and may not allocate it, so the
// op asks the kernel table how much each pass needs and takes it from the caching
// allocator as a byte tensor that lives until the pass is queued: the allocator reuses
// memory in stream order, so freeing it right after the launch is safe.
//
// max_pool2d saves its argmax indices for backward; avg_pool2d saves nothing.
// max_pool2d_bias is max_pool2d(x + bias) in one pass over x: the kernel adds each
// channel's bias while searching the windows, rounding each sum as add does, so the values,
// the indices and both gradients are the bits of the add and the pooling run one after
// the other, without writing and reading back x + bias (a convolution's output).
// adaptive_avg_pool2d is a composite (a mean, or an avg_pool2d) with no backward of its own.
#include <string>

#include "engine/autocast.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/product.h"
#include "engine/options.h"

namespace loom {

using ops::kernels;

namespace {

std::string pair_str(std::array<int, 2> v) { return "(" + std::to_string(v[0]) + ", " + std::to_string(v[1]) + ")"; }

// Scratch for one pass, recorded in `a` with the options the pass runs under; the returned
// tensor owns it (undefined when none).
Tensor workspace_for(Conv2dArgs& a, ConvPass pass, Device device) {
  a.graph_api = options().cudnn_graph_api;
  a.deterministic = options().deterministic;
  a.autotune = options().conv_autotuning;
  const size_t bytes = kernels(device).conv2d_workspace_size(a, pass);
  Tensor ws = bytes ? Tensor::empty({int64_t(bytes)}, DType::u8, device) : Tensor();
  a.workspace = bytes ? ws.data_ptr() : nullptr;
  a.workspace_bytes = bytes;
  return ws;
}

// Output extent along one axis, or a clear error when the (dilated) kernel does not fit.
int64_t conv_extent(const char* op, const char* axis, int64_t size, int kernel, int stride, int pad, int dilation) {
  const int64_t span = int64_t(dilation) * (kernel - 1) + 1;
  LOOM_CHECK(size + 2 * int64_t(pad) >= span, op, ": the kernel spans ", span, " along ", axis, " (kernel ", kernel,
             ", dilation ", dilation, ") but the padded input is only ", size + 2 * int64_t(pad), " (", size,
             " + 2 x padding ", pad, "): use a smaller kernel or more padding");
  return (size + 2 * int64_t(pad) - span) / stride + 1;
}

void check_positive(const char* op, const char* what, std::array<int, 2> v, int min) {
  LOOM_CHECK(v[0] >= min && v[1] >= min, op, ": ", what, " must be at least ", min, ", got ", pair_str(v));
}

void check_nchw(const char* op, const Tensor& x) {
  LOOM_CHECK(x.dim() == 4, op, " expects input (N, C, H, W), got ", shape_str(x.shape()),
             x.dim() == 3 ? ": add the batch dim with x.unsqueeze(0)" : "");
}

// ---- pooling ------------------------------------------------------------------------

Pool2dArgs pool_args(const char* op, const Tensor& x, std::array<int, 2> kernel, std::array<int, 2> stride,
                     std::array<int, 2> padding) {
  check_nchw(op, x);
  check_positive(op, "kernel", kernel, 1);
  check_positive(op, "stride", stride, 1);
  check_positive(op, "padding", padding, 0);
  LOOM_CHECK(padding[0] <= kernel[0] / 2 && padding[1] <= kernel[1] / 2, op, ": padding ", pair_str(padding),
             " must be at most half the kernel ", pair_str(kernel), " (as in PyTorch), so no window is all padding");
  LOOM_CHECK(x.size(2) > 0 && x.size(3) > 0, op, " expects input (N, C, H, W) with H and W at least 1 (as in PyTorch), got ",
             shape_str(x.shape()));
  Pool2dArgs a;
  a.dtype = x.dtype();
  a.n = x.size(0), a.c = x.size(1), a.h = x.size(2), a.w = x.size(3);
  a.kh = kernel[0], a.kw = kernel[1], a.stride_h = stride[0], a.stride_w = stride[1];
  a.pad_h = padding[0], a.pad_w = padding[1];
  a.out_h = conv_extent(op, "H", a.h, kernel[0], stride[0], padding[0], 1);
  a.out_w = conv_extent(op, "W", a.w, kernel[1], stride[1], padding[1], 1);
  return a;
}

// max_pool2d (is_max) or avg_pool2d of x; max_pool2d of x + bias when bias is defined
// (max_pool2d_bias), its gradient the sum of dx over N, H and W, as add's would be.
Tensor pool_impl(const char* op, bool is_max, const Tensor& x0, const Tensor& bias0, std::array<int, 2> kernel,
                 std::array<int, 2> stride, std::array<int, 2> padding) {
  ops::check_defined(x0, op, "x");
  ops::check_floating(x0, op);
  const MemoryFormat format = x0.memory_format();
  Tensor x = x0.contiguous(format);
  Pool2dArgs a = pool_args(op, x, kernel, stride, padding);
  a.layout = ops::channel_layout(format);
  Tensor bias;
  if (bias0.defined()) {
    ops::check_same_device(x0, bias0, op);
    LOOM_CHECK(bias0.dim() == 1 && bias0.size(0) == a.c, op, " expects bias (C) = (", a.c, ") for input ",
               shape_str(x0.shape()), ", got ", shape_str(bias0.shape()));
    LOOM_CHECK(bias0.dtype() == x0.dtype(), op, ": bias is ", dtype_name(bias0.dtype()), " and x ",
               dtype_name(x0.dtype()), "; pass them in one dtype (bias.to(x.dtype()))");
    bias = bias0.contiguous();
  }
  const Device dev = x.device();
  Tensor y = Tensor::empty({a.n, a.c, a.out_h, a.out_w}, x.dtype(), dev, format);
  Tensor indices = is_max ? Tensor::empty(y.shape(), DType::i64, dev, format) : Tensor();
  if (y.numel() > 0) {
    Pool2dArgs fa = a;
    fa.bias = bias.defined() ? bias.data_ptr() : nullptr;
    if (is_max) kernels(dev).max_pool2d_forward(fa, y.data_ptr(), indices.data<int64_t>(), x.data_ptr(), ops::stream(x));
    else kernels(dev).avg_pool2d_forward(a, y.data_ptr(), x.data_ptr(), ops::stream(x));
  }
  const TensorList inputs = bias.defined() ? TensorList{x, bias} : TensorList{x};
  if (any_requires_grad(inputs)) {
    const bool has_bias = bias.defined(), need_dbias = has_bias && bias.requires_grad();
    record(op, inputs, {y}, [a, indices, is_max, has_bias, need_dbias, dev, format](const TensorList& g) {
      Tensor gy = g[0].to(a.dtype).contiguous(format);
      Tensor gx = Tensor::empty({a.n, a.c, a.h, a.w}, a.dtype, dev, format);
      if (gx.numel() > 0) {
        if (is_max)
          kernels(dev).max_pool2d_backward(a, gx.data_ptr(), gy.data_ptr(), indices.data<int64_t>(), ops::stream(gx));
        else
          kernels(dev).avg_pool2d_backward(a, gx.data_ptr(), gy.data_ptr(), ops::stream(gx));
      }
      if (!has_bias) return TensorList{gx};
      if (!need_dbias) return TensorList{gx, Tensor()};
      return TensorList{gx, sum_to(gx, {1, a.c, 1, 1}).reshape({a.c})};
    });
  }
  return y;
}

}  // namespace

Tensor conv2d(const Tensor& x0, const Tensor& w0, const Tensor& bias, std::array<int, 2> stride,
              std::array<int, 2> padding, std::array<int, 2> dilation, int groups) {
  const char* op = "conv2d";
  ops::check_defined(x0, op, "x");
  ops::check_defined(w0, op, "weight");
  ops::check_floating(x0, op);
  ops::check_floating(w0, op);
  ops::check_same_device(x0, w0, op);
  LOOM_CHECK(w0.dim() == 4, "conv2d expects weight (C_out, C_in / groups, KH, KW), got ", shape_str(w0.shape()));
  check_nchw(op, x0);
  check_positive(op, "stride", stride, 1);
  check_positive(op, "dilation", dilation, 1);
  check_positive(op, "padding", padding, 0);
  LOOM_CHECK(groups >= 1, "conv2d: groups must be at least 1, got ", groups);
  const int64_t c_out = w0.size(0), c_in = w0.size(1) * groups;
  LOOM_CHECK(c_out % groups == 0, "conv2d: weight ", shape_str(w0.shape()), " has ", c_out,
             " output channels, which groups = ", groups, " does not divide");
  if (x0.size(1) != c_in) {
    const bool channels_last = x0.size(3) == c_in;
    LOOM_FAIL("conv2d expects input (N, C, H, W) with C = ", c_in, " for weight ", shape_str(w0.shape()),
              groups > 1 ? " and groups = " + std::to_string(groups) : std::string(), ", got ", shape_str(x0.shape()),
              channels_last ? ": is the input (N, H, W, C)? x.permute({0, 3, 1, 2}) is its (N, C, H, W) view, "
                              "which the CNN ops keep channels-last in memory"
                            : "");
  }
  DType t = ops::promote(x0.dtype(), w0.dtype());
  if (bias.defined()) {
    ops::check_same_device(x0, bias, op);
    ops::check_floating(bias, op);
    LOOM_CHECK(bias.dim() == 1 && bias.size(0) == c_out, "conv2d expects bias (", c_out, ") for weight ",
               shape_str(w0.shape()), ", got ", shape_str(bias.shape()));
    t = ops::promote(t, bias.dtype());
  }
  t = autocast_compute_dtype(t);
  const MemoryFormat format = x0.memory_format();
  // cuDNN's NHWC kernels want the weight laid out (C_out, KH, KW, C_in / groups) too; the
  // CPU's read it row-major in either layout.
  const MemoryFormat weight_format = x0.device().is_cuda() ? format : MemoryFormat::contiguous;
  // An f32 weight under autocast is read through its kept 16-bit copy (engine/autocast.h),
  // which the optimizer's step rewrites, and its gradient is cast back to f32 here: the
  // bits of w0.to(t)'s node either way, without a cast pass at every forward.
  const bool f32_weight = ops::f32_params(t, {w0});
  const ops::Param wp = ops::param(w0, t, f32_weight);
  Tensor x = x0.to(t).contiguous(format), w = wp.used.contiguous(weight_format);

  Conv2dArgs a;
  a.dtype = t;
  a.n = x.size(0), a.c_in = c_in, a.h = x.size(2), a.w = x.size(3);
  a.c_out = c_out, a.kh = w.size(2), a.kw = w.size(3);
  a.stride_h = stride[0], a.stride_w = stride[1], a.pad_h = padding[0], a.pad_w = padding[1];
  a.dilation_h = dilation[0], a.dilation_w = dilation[1], a.groups = groups;
  a.layout = ops::channel_layout(format);
  a.out_h = conv_extent(op, "H", a.h, int(a.kh), stride[0], padding[0], dilation[0]);
  a.out_w = conv_extent(op, "W", a.w, int(a.kw), stride[1], padding[1], dilation[1]);

  const Device dev = x.device();
  StreamHandle st = ops::stream(x);  // also makes x's device current for the workspace query
  Tensor y = Tensor::empty({a.n, a.c_out, a.out_h, a.out_w}, t, dev, format);
  if (y.numel() > 0) {
    Conv2dArgs fa = a;
    Tensor ws = workspace_for(fa, ConvPass::forward, dev);
    kernels(dev).conv2d_forward(fa, y.data_ptr(), x.data_ptr(), w.data_ptr(), st);
  }
  const Tensor w_input = f32_weight ? wp.input : w;
  if (any_requires_grad({x, w_input})) {
    const bool need_dx = x.requires_grad(), need_dw = w_input.requires_grad();
    Tensor sx = need_dw ? x.detach() : Tensor(), sw = need_dx ? w.detach() : Tensor();
    // x's gradient is added into the one x already has when the pass offers it (a residual
    // block's shortcut sent it first, record_accumulating): the sum in the convolution's
    // own epilogue rather than in a pass of its own.
    auto backward = [a, sx, sw, need_dx, need_dw, dev, format, weight_format, f32_weight](const TensorList& g,
                                                                                          const TensorList& into) {
      Tensor gy = g[0].to(a.dtype).contiguous(format);
      StreamHandle gst = ops::stream(gy);
      Tensor gx, gw;
      bool added = false;
      if (need_dx) {
        Conv2dArgs da = a;
        added = into[0].defined() && into[0].dtype() == a.dtype && into[0].is_contiguous(format) &&
                into[0].numel() > 0;
        da.accumulate = added;
        gx = added ? into[0] : Tensor::empty({a.n, a.c_in, a.h, a.w}, a.dtype, dev, format);
        Tensor ws = workspace_for(da, ConvPass::backward_data, dev);
        if (gx.numel() > 0) kernels(dev).conv2d_backward_data(da, gx.data_ptr(), gy.data_ptr(), sw.data_ptr(), gst);
        if (added) gx.bump_version();  // a copy kept on the gradient so far is stale now
      }
      if (need_dw) {
        gw = Tensor::empty({a.c_out, a.c_in / a.groups, a.kh, a.kw}, a.dtype, dev, weight_format);
        Conv2dArgs fa = a;
        Tensor ws = workspace_for(fa, ConvPass::backward_filter, dev);
        if (gw.numel() > 0)
          kernels(dev).conv2d_backward_filter(fa, gw.data_ptr(), sx.data_ptr(), gy.data_ptr(), gst);
        if (f32_weight) gw = gw.to(DType::f32);
      }
      return TensorList{added ? Tensor() : gx, gw};
    };
    record_accumulating(op, {x, w_input}, {y}, backward);
  }
  if (bias.defined()) y = add(y, bias.to(t).reshape({1, c_out, 1, 1}));
  return y;
}

Tensor max_pool2d(const Tensor& x, std::array<int, 2> kernel, std::array<int, 2> stride,
                  std::array<int, 2> padding) {
  return pool_impl("max_pool2d", true, x, Tensor(), kernel, stride, padding);
}
Tensor max_pool2d(const Tensor& x, std::array<int, 2> kernel) { return max_pool2d(x, kernel, kernel); }

Tensor max_pool2d_bias(const Tensor& x, const Tensor& bias, std::array<int, 2> kernel, std::array<int, 2> stride,
                       std::array<int, 2> padding) {
  ops::check_defined(bias, "max_pool2d_bias", "bias");
  return pool_impl("max_pool2d_bias", true, x, bias, kernel, stride, padding);
}

Tensor avg_pool2d(const Tensor& x, std::array<int, 2> kernel, std::array<int, 2> stride,
                  std::array<int, 2> padding) {
  return pool_impl("avg_pool2d", false, x, Tensor(), kernel, stride, padding);
}
Tensor avg_pool2d(const Tensor& x, std::array<int, 2> kernel) { return avg_pool2d(x, kernel, kernel); }

Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int, 2> output_size) {
  const char* op = "adaptive_avg_pool2d";
  ops::check_defined(x, op, "x");
  ops::check_floating(x, op);
  check_nchw(op, x);
  check_positive(op, "output size", output_size, 1);
  if (output_size[0] == 1 && output_size[1] == 1) return mean(x, {2, 3}, true);
  const int64_t h = x.size(2), w = x.size(3);
  LOOM_CHECK(h % output_size[0] == 0 && w % output_size[1] == 0, op, ": output size ", pair_str(output_size),
             " does not divide the input's (H, W) = (", h, ", ", w,
             "); Loom pools in equal windows only: pick an output size that divides it, or (1, 1)");
  const std::array<int, 2> k{int(h / output_size[0]), int(w / output_size[1])};
  return avg_pool2d(x, k);
}

}  // namespace loom
