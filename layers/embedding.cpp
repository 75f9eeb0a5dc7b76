// Embedding: initialisation and the engine's embedding op (whose backward scatters the
// upstream gradient into the rows that were read).
#include "layers/embedding.h"

#include "engine/ops.h"

namespace loom::nn {

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim) {
  LOOM_CHECK(num_embeddings > 0 && embedding_dim > 0, "Embedding(", num_embeddings, ", ", embedding_dim,
             "): both sizes must be positive");
  weight = Tensor::empty({num_embeddings, embedding_dim});
  normal_(weight, 0.0, 1.0);
  register_parameter("weight", weight);
}

Tensor Embedding::forward(const Tensor& ids) {
  LOOM_CHECK(ids.dtype() == DType::i64 || ids.dtype() == DType::i32, "Embedding: expected integer ids, got ",
             dtype_name(ids.dtype()), " (convert with .to(DType::i64))");
  return embedding(weight, ids);
}

}  // namespace loom::nn
