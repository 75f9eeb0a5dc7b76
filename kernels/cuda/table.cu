// The CUDA kernel table: one line per entry, in the order of KernelTable.
#include "kernels/cuda/kernels.h"

namespace loom {

const KernelTable& cuda_kernel_table() {
  static const KernelTable table{
      .fill = cuda::fill,
      .copy = cuda::copy,
      .arange = cuda::arange,
      .unary = cuda::unary,
      .unary_backward = cuda::unary_backward,
      .binary = cuda::binary,
      .where = cuda::where,
      .reduce = cuda::reduce,
      .softmax = cuda::softmax,
      .softmax_backward = cuda::softmax_backward,
      .cross_entropy = cuda::cross_entropy,
      .cross_entropy_backward = cuda::cross_entropy_backward,
      .gemm = cuda::gemm,
      .index_select = cuda::index_select,
      .index_add = cuda::index_add,
      .gather = cuda::gather,
      .scatter_add = cuda::scatter_add,
      .embedding_sum = cuda::embedding_sum,
      .embedding_sum_backward = cuda::embedding_sum_backward,
      .uniform = cuda::uniform,
      .normal = cuda::normal,
      .conv2d_workspace_size = cuda::conv2d_workspace_size,
      .conv2d_forward = cuda::conv2d_forward,
      .conv2d_backward_data = cuda::conv2d_backward_data,
      .conv2d_backward_filter = cuda::conv2d_backward_filter,
      .max_pool2d_forward = cuda::max_pool2d_forward,
      .max_pool2d_backward = cuda::max_pool2d_backward,
      .avg_pool2d_forward = cuda::avg_pool2d_forward,
      .avg_pool2d_backward = cuda::avg_pool2d_backward,
      .batch_norm_forward_train = cuda::batch_norm_forward_train,
      .batch_norm_forward_eval = cuda::batch_norm_forward_eval,
      .batch_norm_backward = cuda::batch_norm_backward,
      .layer_norm_forward = cuda::layer_norm_forward,
      .layer_norm_workspace_size = cuda::layer_norm_workspace_size,
      .layer_norm_backward = cuda::layer_norm_backward,
      .sgd_step = cuda::sgd_step,
      .adam_step = cuda::adam_step,
      .multi_tensor_copy = cuda::multi_tensor_copy,
      .attention_workspace_size = cuda::attention_workspace_size,
      .attention_forward = cuda::attention_forward,
      .attention_backward = cuda::attention_backward,
  };
  return table;
}

}  // namespace loom
