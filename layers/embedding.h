// Embedding: a (num_embeddings, embedding_dim) table of learned rows looked up by integer
// id, PyTorch's nn.Embedding with its N(0, 1) initialisation.
#pragma once

#include "module.h"

namespace loom::nn {

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim);

  // i64 ids of any shape -> ids.shape + (embedding_dim)
  Tensor forward(const Tensor& ids) override;
  std::string type_name() const override { return "Embedding"; }

  Tensor weight;  // (num_embeddings, embedding_dim)
};

}  // namespace loom::nn
