// The CPU kernel table: one line per entry, in the order of KernelTable.
#include "kernels/cpu/kernels.h"

namespace loom {

const KernelTable& cpu_kernel_table() {
  static const KernelTable table{
      .fill = cpu::fill,
      .copy = cpu::copy,
      .arange = cpu::arange,
      .unary = cpu::unary,
      .unary_backward = cpu::unary_backward,
      .binary = cpu::binary,
      .where = cpu::where,
      .reduce = cpu::reduce,
      .softmax = cpu::softmax,
      .softmax_backward = cpu::softmax_backward,
      .cross_entropy = cpu::cross_entropy,
      .cross_entropy_backward = cpu::cross_entropy_backward,
      .gemm = cpu::gemm,
      .index_select = cpu::index_select,
      .index_add = cpu::index_add,
      .gather = cpu::gather,
      .scatter_add = cpu::scatter_add,
      .embedding_sum = cpu::embedding_sum,
      .embedding_sum_backward = cpu::embedding_sum_backward,
      .uniform = cpu::uniform,
      .normal = cpu::normal,
      .conv2d_workspace_size = cpu::conv2d_workspace_size,
      .conv2d_forward = cpu::conv2d_forward,
      .conv2d_backward_data = cpu::conv2d_backward_data,
      .conv2d_backward_filter = cpu::conv2d_backward_filter,
      .max_pool2d_forward = cpu::max_pool2d_forward,
      .max_pool2d_backward = cpu::max_pool2d_backward,
      .avg_pool2d_forward = cpu::avg_pool2d_forward,
      .avg_pool2d_backward = cpu::avg_pool2d_backward,
      .batch_norm_forward_train = cpu::batch_norm_forward_train,
      .batch_norm_forward_eval = cpu::batch_norm_forward_eval,
      .batch_norm_backward = cpu::batch_norm_backward,
      .layer_norm_forward = cpu::layer_norm_forward,
      .layer_norm_workspace_size = cpu::layer_norm_workspace_size,
      .layer_norm_backward = cpu::layer_norm_backward,
      .sgd_step = cpu::sgd_step,
      .adam_step = cpu::adam_step,
      .multi_tensor_copy = cpu::multi_tensor_copy,
      .attention_workspace_size = cpu::attention_workspace_size,
      .attention_forward = cpu::attention_forward,
      .attention_backward = cpu::attention_backward,
  };
  return table;
}

}  // namespace loom
