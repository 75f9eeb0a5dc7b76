// Loom's performance options: choices between two ways of computing the same thing, one
// faster and one with a property a program may want more (results that repeat bit for bit,
// less memory, fewer moving parts). A program sets them through set_options, as a PyTorch
// program calls torch.use_deterministic_algorithms or sets torch.backends.cudnn flags; a
// test flips one inside an OptionsGuard and compares both ways in one process.
//
// Each op reads the options when it calls its kernel (a backward when it runs) and passes
// the choice down in the kernel's arguments (kernels/table.h); no kernel reads them, and a
// change applies from the next call on. Caches built under one setting (cuBLASLt's
// algorithm choices, cuDNN's plans) are kept and serve the other setting too, so flipping
// an option back and forth costs nothing after the first time. The options are
// process-wide, not per thread: set them before training starts or between steps, not
// while another thread runs ops.
//
// deterministic (default off). On: the CUDA attention backward on tensor cores (bf16/f16,
// head_dim 32 to 128) computes dQ in a kernel of its own, which recomputes the scores and
// their gradient per key tile (7 products a tile pair instead of 5) and sums in registers,
// so its result is the same bits from run to run, and it needs no f32 dQ accumulator in its
// workspace. Off: dQ is summed into that accumulator with atomics (on an H100 or H200 at
// head_dim 64, bulk reductions of whole tiles), in an order that varies from run to run (the
// differences are f32 rounding). On, too, convolutions run only cuDNN
// algorithms whose results repeat bit for bit (engines without cuDNN's nondeterministic note;
// off, cuDNN's first choice may sum with atomics, as some of its f32 weight-gradient engines
// do); their plans are kept per setting. Other paths are unaffected: the CPU kernels and the
// CUDA-core attention kernels are deterministic either way, while the CUDA index_add,
// scatter_add and the embedding's weight gradient keep their atomics, and products and
// convolutions chosen by timing can differ between runs (gemm_autotuning and
// conv_autotuning below; turn them off too for the same bits from run to run).
//
// hopper_attention (default on). On: on an H100 or H200 in a build whose cuda-arch lists 90,
// the attention on tensor cores (bf16/f16) runs the kernels built on Hopper's warpgroup
// products: the forward at head_dim 64 or 128 (kernels/cuda/attention_wgmma.cu), the
// backward's dK, dV and dQ at 64 and 128 when deterministic is off
// (attention_wgmma_backward.cu, attention_wgmma_backward128.cu).
// Off: the tensor-core kernels that every GPU from sm_80 on runs (attention_mma*.cu).
// Results agree within f32 rounding.
//
// gemm_autotuning (default on). On: the first single f32/bf16/f16 product of each shape and
// layout times up to eight of cuBLASLt's candidate algorithms on its own operands and keeps
// the fastest (a few milliseconds and a stream synchronisation per candidate, once per
// shape; the heuristic's first choice is often not the fastest, split-K for a weight
// gradient's long k for one). Off: the heuristic's first choice, the same algorithm from run to run, where
// timing may pick differently between runs. Either way the product's contract holds.
//
// cudnn_graph_api (default on). On: each convolution pass runs an execution plan of cuDNN's
// graph API, built once per shape, where the pointers are 16-byte aligned and a plan exists.
// Off: cuDNN's convolution API alone (cudnnConvolutionForward and its backward passes),
// which builds a plan inside every call and so costs more host time a call: a small
// network's step becomes bound by the host. Results agree within the algorithms' rounding.
//
// conv_autotuning (default on; with cudnn_graph_api), as PyTorch's cudnn.benchmark. On: the
// first convolution pass of each shape times up to eight of cuDNN's candidate plans on its
// own operands and keeps the fastest (once per shape and pass: a few milliseconds, a stream
// synchronisation per candidate, and for that call a workspace large enough for every
// candidate: the first plan's, or up to 256 MiB where that is more, which the caching
// allocator then keeps).
// Off: the heuristics' first choice, the same engine from run to run, where timing may pick
// differently between runs. Results agree within the engines' rounding.
//
// autocast_weight_copies (default on). On: products under autocast keep the 16-bit copy of
// each f32 parameter they read and reuse it while the parameter is unchanged; the
// optimizers write a fresh copy in the kernel that updates the parameter, so a training
// step makes no weight casts (engine/autocast.h). Cost: 2 bytes a parameter element for as
// long as the parameter lives. Off: a cast at every use, nothing kept. Values are the same.
//
// autocast_gradient_copies (default on). On: the LayerNorm backward whose f32 gradient a
// 16-bit product reads also writes it rounded, and the product takes that instead of a cast
// pass (two passes a block over (B T, C) f32 in a GPT). Cost: the rounded copy's memory
// until the product has read it. Off: the product casts. Values are the same.
//
// fused_bias_sums (default on). On: the backward that computes a linear layer's output
// gradient also sums it over the rows as it writes it, and the layer takes those sums as its
// bias gradient instead of a pass over the gradient of its own (engine/autograd.h:
// set_gradient_sums_read). LayerNorm's does so for the layers whose output it normalises (in
// a GPT block the attention and MLP outputs, through the residual stream); packed
// attention's for the qkv projection, its dq, dk and dv summed as its CUDA kernels store them
// where they can (kernels/table.h: AttentionArgs::column_sums). Under autocast LayerNorm's are sums of the rounded gradient the layer reads, so they
// need autocast_gradient_copies on. Off: the pass. Values agree within rounding: the same
// terms, summed in another order.
#pragma once

namespace loom {

struct Options {
  bool deterministic = false;
  bool hopper_attention = true;
  bool gemm_autotuning = true;
  bool cudnn_graph_api = true;
  bool conv_autotuning = true;
  bool autocast_weight_copies = true;
  bool autocast_gradient_copies = true;
  bool fused_bias_sums = true;
};

// The options in force.
Options options();
void set_options(const Options& options);

// Sets `options` for its scope, then restores the ones it found:
//   Options o = options();
//   o.deterministic = true;
//   OptionsGuard guard(o);
class OptionsGuard {
 public:
  explicit OptionsGuard(const Options& options);
  ~OptionsGuard();
  OptionsGuard(const OptionsGuard&) = delete;
  OptionsGuard& operator=(const OptionsGuard&) = delete;

 private:
  Options previous_;
};

}  // namespace loom
