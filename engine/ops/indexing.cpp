// Indexing by integer tensors: index_select (and embedding, its 2-d case), gather and
// scatter_add. Each runs over the canonical (outer, R, inner) view around the indexed
// dim; the gradient of a selection is an index_add / scatter_add of the output gradient.
#include "engine/ops/dispatch.h"

namespace loom {

using ops::kernels;

namespace {

Tensor as_index(const Tensor& index, const Tensor& like, const char* op) {
  ops::check_defined(index, op, "index");
  ops::check_same_device(like, index, op);
  LOOM_CHECK(index.dtype() == DType::i64 || index.dtype() == DType::i32, op,
             ": index must be an integer tensor (i64), got ", dtype_name(index.dtype()));
  return index.to(DType::i64).contiguous();
}

void check_gather_shapes(const Tensor& x, const Tensor& index, int d, const char* op) {
  LOOM_CHECK(index.dim() == x.dim(), op, ": index of shape ", shape_str(index.shape()), " needs as many dims as ",
             shape_str(x.shape()));
  for (int i = 0; i < x.dim(); ++i)
    LOOM_CHECK(i == d || index.shape()[i] == x.shape()[i], op, ": index of shape ", shape_str(index.shape()),
               " must match ", shape_str(x.shape()), " in every dim but ", d);
}

}  // namespace

Tensor index_select(const Tensor& x0, int dim, const Tensor& index0) {
  ops::check_defined(x0, "index_select", "x");
  int d = wrap_dim(dim, x0.dim(), "index_select");
  Tensor index = as_index(index0, x0, "index_select");
  LOOM_CHECK(index.dim() == 1, "index_select: index must be 1-d, got shape ", shape_str(index.shape()));
  Tensor x = x0.contiguous();
  ops::OuterRInner s = ops::around_dim(x.shape(), d);
  Shape out_shape = x.shape();
  out_shape[d] = index.numel();
  Tensor out = Tensor::empty(out_shape, x.dtype(), x.device());
  if (out.numel() > 0)
    kernels(x.device()).index_select(out.data_ptr(), x.data_ptr(), index.data<int64_t>(), index.numel(), x.dtype(),
                                     s.outer, s.R, s.inner, ops::stream(x));
  if (any_requires_grad({x})) {
    Shape in_shape = x.shape();
    record("index_select", {x}, {out}, [in_shape, index, s](const TensorList& g) {
      Tensor go = g[0].contiguous();
      Tensor gi = zeros(in_shape, go.dtype(), go.device());
      if (go.numel() > 0)
        kernels(go.device()).index_add(gi.data_ptr(), go.data_ptr(), index.data<int64_t>(), index.numel(), go.dtype(),
                                       s.outer, s.R, s.inner, ops::stream(go));
      return TensorList{gi};
    });
  }
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& ids) {
  ops::check_defined(weight, "embedding", "weight");
  LOOM_CHECK(weight.dim() == 2, "embedding: weight must be (num_embeddings, dim), got ", shape_str(weight.shape()));
  Tensor flat = index_select(weight, 0, ids.reshape({-1}));
  Shape shape = ids.shape();
  shape.push_back(weight.size(1));
  return flat.reshape(shape);
}

Tensor gather(const Tensor& x0, int dim, const Tensor& index0) {
  ops::check_defined(x0, "gather", "x");
  int d = wrap_dim(dim, x0.dim(), "gather");
  Tensor index = as_index(index0, x0, "gather");
  check_gather_shapes(x0, index, d, "gather");
  Tensor x = x0.contiguous();
  ops::OuterRInner s = ops::around_dim(x.shape(), d);
  int64_t J = index.shape()[d];
  Tensor out = Tensor::empty(index.shape(), x.dtype(), x.device());
  if (out.numel() > 0)
    kernels(x.device()).gather(out.data_ptr(), x.data_ptr(), index.data<int64_t>(), J, x.dtype(), s.outer, s.R,
                               s.inner, ops::stream(x));
  if (any_requires_grad({x})) {
    Shape in_shape = x.shape();
    record("gather", {x}, {out}, [in_shape, index, s, J](const TensorList& g) {
      Tensor go = g[0].contiguous();
      Tensor gi = zeros(in_shape, go.dtype(), go.device());
      if (go.numel() > 0)
        kernels(go.device()).scatter_add(gi.data_ptr(), go.data_ptr(), index.data<int64_t>(), J, go.dtype(), s.outer,
                                         s.R, s.inner, ops::stream(go));
      return TensorList{gi};
    });
  }
  return out;
}

Tensor scatter_add(const Tensor& x0, int dim, const Tensor& index0, const Tensor& src0) {
  ops::check_defined(x0, "scatter_add", "x");
  ops::check_defined(src0, "scatter_add", "src");
  ops::check_same_device(x0, src0, "scatter_add");
  int d = wrap_dim(dim, x0.dim(), "scatter_add");
  Tensor index = as_index(index0, x0, "scatter_add");
  check_gather_shapes(x0, index, d, "scatter_add");
  LOOM_CHECK(src0.shape() == index.shape(), "scatter_add: src of shape ", shape_str(src0.shape()),
             " must match index of shape ", shape_str(index.shape()));
  Tensor src = src0.to(x0.dtype()).contiguous();
  Tensor out;
  {
    NoGradGuard no_grad;
    out = x0.clone();
  }
  ops::OuterRInner s = ops::around_dim(out.shape(), d);
  int64_t J = index.shape()[d];
  if (src.numel() > 0)
    kernels(out.device()).scatter_add(out.data_ptr(), src.data_ptr(), index.data<int64_t>(), J, out.dtype(), s.outer,
                                      s.R, s.inner, ops::stream(out));
  if (any_requires_grad({x0, src})) {
    record("scatter_add", {x0, src}, {out}, [index, d](const TensorList& g) {
      return TensorList{g[0], gather(g[0], d, index)};
    });
  }
  return out;
}

Tensor token_position_embedding(const Tensor& wte0, const Tensor& wpe0, const Tensor& ids0) {
  const char* op = "token_position_embedding";
  ops::check_defined(wte0, op, "wte");
  ops::check_defined(wpe0, op, "wpe");
  ops::check_same_device(wte0, wpe0, op);
  ops::check_floating(wte0, op);
  LOOM_CHECK(wte0.dim() == 2 && wpe0.dim() == 2 && wte0.size(1) == wpe0.size(1), op,
             ": wte (vocabulary, dim) and wpe (positions, dim) must share dim, got ", shape_str(wte0.shape()), " and ",
             shape_str(wpe0.shape()));
  LOOM_CHECK(wte0.dtype() == wpe0.dtype(), op, ": wte is ", dtype_name(wte0.dtype()), " but wpe is ",
             dtype_name(wpe0.dtype()), ": give both the same dtype");
  Tensor ids = as_index(ids0, wte0, op);
  LOOM_CHECK(ids.dim() == 2, op, ": expected token ids (B, T), got shape ", shape_str(ids.shape()));
  const int64_t B = ids.size(0), T = ids.size(1), C = wte0.size(1), V = wte0.size(0);
  LOOM_CHECK(T <= wpe0.size(0), op, ": a sequence of ", T, " tokens is longer than the ", wpe0.size(0),
             " positions of wpe");
  Tensor wte = wte0.contiguous(), wpe = wpe0.contiguous();
  const Device dev = wte.device();
  Tensor out = Tensor::empty({B, T, C}, wte.dtype(), dev);
  kernels(dev).embedding_sum(out.data_ptr(), wte.data_ptr(), wpe.data_ptr(), ids.data<int64_t>(), B, T, C, V,
                             wte.dtype(), ops::stream(wte));
  if (any_requires_grad({wte, wpe})) {
    const bool need_wte = wte.requires_grad(), need_wpe = wpe.requires_grad();
    const Shape wte_shape = wte.shape(), wpe_shape = wpe.shape();
    const DType dtype = wte.dtype();
    // The token rows are added into wte's gradient so far when the pass allows it (a tied
    // output layer's, record_accumulating), else into zeros; the position rows are written
    // (zeros past T).
    auto backward = [ids, B, T, C, V, need_wte, need_wpe, wte_shape, wpe_shape, dtype](const TensorList& g,
                                                                                     const TensorList& into) {
      Tensor go = g[0].to(dtype).contiguous();
      const Device d = go.device();
      const bool add_into = need_wte && into[0].defined() && into[0].dtype() == go.dtype() && into[0].is_contiguous();
      Tensor d_wte = add_into ? into[0] : need_wte ? zeros(wte_shape, go.dtype(), d) : Tensor();
      Tensor d_wpe = need_wpe ? (wpe_shape[0] == T ? Tensor::empty(wpe_shape, go.dtype(), d)
                                                   : zeros(wpe_shape, go.dtype(), d))
                              : Tensor();
      kernels(d).embedding_sum_backward(ops::ptr_or_null(d_wte), ops::ptr_or_null(d_wpe), go.data_ptr(),
                                        ids.data<int64_t>(), B, T, C, V, go.dtype(), ops::stream(go));
      if (add_into) d_wte.bump_version();  // a copy kept on the gradient so far is stale now
      return TensorList{add_into ? Tensor() : d_wte, d_wpe};
    };
    record_accumulating(op, {wte, wpe}, {out}, backward);
  }
  return out;
}

}  // namespace loom
