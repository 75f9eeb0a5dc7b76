// GPTStage: one stage of a GPT cut for a pipeline (parallel/pipeline.h), built alone, so that
// no process ever holds the whole model. It holds the blocks [first_block, end_block); the
// first stage also the token and position embeddings; the last stage also ln_f, the output
// layer and the loss. Parameter names are the whole GPT's ("transformer.h.7.attn.c_attn.weight"
// on the stage that holds block 7), so a stage's state dict is the matching part of GPT's.
//
// The output layer is tied to the token embedding in GPT. A stage that is both first and last
// ties them the same way; otherwise the last stage holds its own copy of the embedding as
// "lm_head.weight", which the pipeline sets equal to stage 0's and keeps equal by summing the
// two copies' gradients every step (Pipeline::tie).
#pragma once

#include <memory>
#include <vector>

#include "gpt.h"

namespace loom::nn {

class GPTStage : public Module {
 public:
  GPTStage(GPTConfig config, int64_t first_block, int64_t end_block, bool first, bool last);

  // The first stage takes token ids (B, T) i64, the others the residual stream (B, T, width).
  // A stage that is not last returns the residual stream after its blocks, (B, T, width).
  Tensor forward(const Tensor& x) override;
  // The last stage: the mean next-token cross-entropy against targets (B, T), as GPT::loss.
  Tensor loss(const Tensor& x, const Tensor& targets);
  std::string type_name() const override { return "GPTStage"; }

  bool is_first() const { return first_; }
  bool is_last() const { return last_; }
  int64_t first_block() const { return first_block_; }
  int64_t end_block() const { return end_block_; }

  std::shared_ptr<Embedding> wte, wpe;  // first stage only
  std::vector<std::shared_ptr<GPTBlock>> blocks;
  std::shared_ptr<LayerNorm> ln_f;  // last stage only
  Tensor lm_head;                   // last stage only: wte's weight, or its own copy

 private:
  Tensor run_blocks(Tensor x);
  GPTConfig config_;
  int64_t first_block_, end_block_;
  bool first_, last_;
};

}  // namespace loom::nn
