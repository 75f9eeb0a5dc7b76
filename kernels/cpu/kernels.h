// Declarations of the CPU kernels, one block per family; each family's definitions live in
// kernels/cpu/<family>.cpp. Contracts are documented once, on the KernelTable entries in
// kernels/table.h.
#pragma once

#include "../table.h"

namespace loom::cpu {

// elementwise.cpp
void fill(const Strided& out, double value, StreamHandle stream);
void copy(const Strided& out, const Strided& in, StreamHandle stream);
void arange(const Strided& out, double start, double step, StreamHandle stream);
void unary(UnaryOp op, const Strided& out, const Strided& in, double param, StreamHandle stream);
void unary_backward(UnaryOp op, const Strided& grad_in, const Strided& grad_out, const Strided& in,
                    const Strided& out, double param, StreamHandle stream);
void binary(BinaryOp op, const Strided& out, const Strided& a, const Strided& b, StreamHandle stream);
void where(const Strided& out, const Strided& cond, const Strided& a, const Strided& b, StreamHandle stream);

// reduce.cpp
void reduce(ReduceOp op, void* out, const void* in, DType dtype, int64_t outer, int64_t R, int64_t inner,
            StreamHandle stream);

// softmax.cpp
void softmax(void* out, const void* in, DType dtype, int64_t outer, int64_t R, int64_t inner, bool log,
             StreamHandle stream);
void softmax_backward(void* grad_in, const void* grad_out, const void* out, DType dtype, int64_t outer,
                      int64_t R, int64_t inner, bool log, StreamHandle stream);
void cross_entropy(void* loss, void* lse, const void* logits, DType dtype, const int64_t* target, int64_t N,
                   int64_t C, int64_t ignore_index, double label_smoothing, void* grad_logits, int64_t row_base,
                   StreamHandle stream);
void cross_entropy_backward(void* grad_logits, const void* logits, const void* lse, const int64_t* target,
                            const void* grad_row, DType dtype, int64_t N, int64_t C, int64_t ignore_index,
                            double label_smoothing, StreamHandle stream);

// matmul.cpp
void gemm(const GemmArgs& args, StreamHandle stream);

// indexing.cpp
void index_select(void* out, const void* in, const int64_t* index, int64_t n_index, DType dtype, int64_t outer,
                  int64_t R, int64_t inner, StreamHandle stream);
void index_add(void* out, const void* src, const int64_t* index, int64_t n_index, DType dtype, int64_t outer,
               int64_t R, int64_t inner, StreamHandle stream);
void embedding_sum(void* out, const void* wte, const void* wpe, const int64_t* ids, int64_t B, int64_t T, int64_t C,
                   int64_t V, DType dtype, StreamHandle stream);
void embedding_sum_backward(void* d_wte, void* d_wpe, const void* grad, const int64_t* ids, int64_t B, int64_t T,
                            int64_t C, int64_t V, DType dtype, StreamHandle stream);
void gather(void* out, const void* in, const int64_t* index, int64_t J, DType dtype, int64_t outer, int64_t R,
            int64_t inner, StreamHandle stream);
void scatter_add(void* out, const void* src, const int64_t* index, int64_t J, DType dtype, int64_t outer,
                 int64_t R, int64_t inner, StreamHandle stream);

// random.cpp
void uniform(const Strided& out, uint64_t seed, uint64_t offset, double lo, double hi, StreamHandle stream);
void normal(const Strided& out, uint64_t seed, uint64_t offset, double mean, double std, StreamHandle stream);

// conv.cpp (im2col + gemm), pool.cpp
size_t conv2d_workspace_size(const Conv2dArgs& args, ConvPass pass);
void conv2d_forward(const Conv2dArgs& args, void* y, const void* x, const void* w, StreamHandle stream);
void conv2d_backward_data(const Conv2dArgs& args, void* dx, const void* dy, const void* w, StreamHandle stream);
void conv2d_backward_filter(const Conv2dArgs& args, void* dw, const void* x, const void* dy, StreamHandle stream);
void max_pool2d_forward(const Pool2dArgs& args, void* y, int64_t* indices, const void* x, StreamHandle stream);
void max_pool2d_backward(const Pool2dArgs& args, void* dx, const void* dy, const int64_t* indices,
                         StreamHandle stream);
void avg_pool2d_forward(const Pool2dArgs& args, void* y, const void* x, StreamHandle stream);
void avg_pool2d_backward(const Pool2dArgs& args, void* dx, const void* dy, StreamHandle stream);


// batch_norm.cpp
void batch_norm_forward_train(const BatchNormArgs& args, void* y, void* save_mean, void* save_invstd,
                              void* running_mean, void* running_var, const void* x, const void* gamma,
                              const void* beta, const void* residual, StreamHandle stream);
void batch_norm_forward_eval(const BatchNormArgs& args, void* y, const void* x, const void* gamma, const void* beta,
                             const void* running_mean, const void* running_var, StreamHandle stream);
void batch_norm_backward(const BatchNormArgs& args, void* dx, void* dgamma, void* dbeta, const void* dy,
                         const void* x, const void* gamma, const void* save_mean, const void* save_invstd,
                         const void* y, void* dresidual, StreamHandle stream);

// layer_norm.cpp
void layer_norm_forward(const LayerNormArgs& args, void* y, void* mean, void* rstd, const void* x, const void* weight,
                        const void* bias, StreamHandle stream);
size_t layer_norm_workspace_size(const LayerNormArgs& args);
void layer_norm_backward(const LayerNormArgs& args, void* dx, void* dweight, void* dbias, const void* dy, const void* x,
                         const void* mean, const void* rstd, const void* weight, void* workspace, StreamHandle stream);

// optim.cpp
void sgd_step(const MultiTensorArgs& args, const SgdHyper& hyper, StreamHandle stream);
void adam_step(const MultiTensorArgs& args, const AdamHyper& hyper, StreamHandle stream);
void multi_tensor_copy(const MultiTensorArgs& args, StreamHandle stream);

// attention.cpp
size_t attention_workspace_size(const AttentionArgs& args);
void attention_forward(const AttentionArgs& args, void* out, void* lse, const void* q, const void* k, const void* v,
                       StreamHandle stream);
void attention_backward(const AttentionArgs& args, void* dq, void* dk, void* dv, const void* dout, const void* q,
                        const void* k, const void* v, const void* out, const void* lse, void* workspace,
                        StreamHandle stream);

}  // namespace loom::cpu
