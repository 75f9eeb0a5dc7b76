// GuideTransformer: the transformer of the guide's model_parallel.py, block for block, with
// the guide's module names, and its blocks placed on a list of devices (layers/placement.h).
//
//   input (B, T, C) floats: the guide feeds random vectors, there is no embedding
//   6 x GuideBlock, post-norm, non-causal:
//       x = norm1(x + attention(x, x, x))
//       x = norm2(x + feed_forward(x)),  feed_forward = Linear(C, 4C), GELU, Linear(4C, C)
//   output = Linear(C, classes) at every position -> logits (B, T, classes)
//
// Where Loom differs from the guide's PyTorch, and why:
// - Attention runs over T within each sequence, as the guide's comment "(batch, seq_len,
//   embed_dim)" means. The guide's nn.MultiheadAttention is built without batch_first, so
//   PyTorch itself attends over the first dimension of its (32, 10, 256) demo input; with
//   batch_first=True the two agree.
// - attention is CausalSelfAttention with causal off: c_attn holds PyTorch's in_proj (q, k, v
//   stacked the same way) and c_proj its out_proj, initialised as PyTorch initialises them
//   (Xavier-uniform in_proj, zero biases).
// - GELU is the tanh form (the engine's gelu); the guide's nn.GELU() uses erf, within about
//   1e-3 of it.
//
// Blocks go on devices round-robin as in the guide, or in contiguous ranges; the output
// layer goes on the last device of the list, as in the guide. For a pipeline over processes,
// GuideTransformerStage holds one contiguous range of blocks alone.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../attention.h"
#include "../layer_norm.h"
#include "../placement.h"
#include "../sequential.h"

namespace loom::nn {

struct GuideTransformerConfig {
  int64_t width = 512;   // the guide's embed_dim (its demo uses 256)
  int64_t heads = 8;
  int64_t layers = 6;
  int64_t classes = 10;  // the output layer's width
};

class GuideBlock : public Module {
 public:
  GuideBlock(int64_t width, int64_t heads);
  Tensor forward(const Tensor& x) override;  // (B, T, C) -> (B, T, C)
  std::string type_name() const override { return "TransformerBlock"; }

  std::shared_ptr<CausalSelfAttention> attention;  // causal off
  std::shared_ptr<LayerNorm> norm1, norm2;
  std::shared_ptr<Sequential> feed_forward;  // Linear(C, 4C), GELU, Linear(4C, C)
  std::shared_ptr<Linear> fc1, fc2;          // feed_forward's two Linears
};

class GuideTransformer : public Module {
 public:
  explicit GuideTransformer(GuideTransformerConfig config = {});

  // Places the blocks on `devices` by `policy` and the output layer on devices.back()
  // (moving their parameters in place: build optimizers after placing, or keep their
  // handles, which stay valid either way). A new model sits on the CPU, unsplit.
  void place(const std::vector<Device>& devices, PlacementPolicy policy = PlacementPolicy::round_robin);
  // (B, T, C) floats on any device -> logits (B, T, classes) on the output layer's device;
  // each block's input is moved to the block's device first.
  Tensor forward(const Tensor& x) override;
  // Mean cross-entropy of the logits at every position against targets (B, T) of i64
  // classes (moved to the output layer's device): one label a position.
  Tensor loss(const Tensor& x, const Tensor& targets);
  std::string type_name() const override { return "ModelParallelTransformer"; }

  const GuideTransformerConfig& config() const { return config_; }
  // The blocks and the output layer with their devices (BlockPlacement::table prints it).
  const BlockPlacement& placement() const { return placement_; }

  std::vector<std::shared_ptr<GuideBlock>> blocks;  // registered as "blocks.0", ...
  std::shared_ptr<Linear> output;

 private:
  GuideTransformerConfig config_;
  BlockPlacement placement_;
};

// One stage of GuideTransformer cut for a pipeline (parallel/guide_pipeline.h), built alone
// so that no process holds the whole model: the blocks [first_block, end_block) and, on the
// last stage, the output layer and the loss. Its parameters have the whole model's names
// ("blocks.4.norm1.weight", "output.bias"), so a stage's named parameters are the matching
// subset of GuideTransformer's. There is no embedding: every stage takes (B, T, C) floats.
class GuideTransformerStage : public Module {
 public:
  GuideTransformerStage(GuideTransformerConfig config, int64_t first_block, int64_t end_block, bool last);

  // (B, T, C) floats, moved to the stage's device -> (B, T, C) after its blocks; on the last
  // stage, the logits (B, T, classes).
  Tensor forward(const Tensor& x) override;
  // The last stage: GuideTransformer::loss of the stage's input, the same mean cross-entropy.
  Tensor loss(const Tensor& x, const Tensor& targets);
  std::string type_name() const override { return "ModelParallelTransformerStage"; }

  bool is_last() const { return output != nullptr; }
  int64_t first_block() const { return first_block_; }
  int64_t end_block() const { return end_block_; }

  std::vector<std::shared_ptr<GuideBlock>> blocks;  // registered as "blocks.<first_block>", ...
  std::shared_ptr<Linear> output;                   // last stage only

 private:
  GuideTransformerConfig config_;
  int64_t first_block_, end_block_;
};

// A synthetic task the guide's transformer can learn, where the guide trains on random input
// with no target: inputs are N(0, 1) vectors (B, T, C), and the label of position t is
//   argmax over classes of P (x_t + mean over s of x_s),
// P a fixed random (classes, C) projection. Each label depends on its own vector and on the
// whole sequence, so attention has something to do, and the loss falls from log(classes).
class GuideSyntheticTask {
 public:
  // P is drawn from `seed` (the global generator is left as it was).
  GuideSyntheticTask(int64_t width, int64_t classes, uint64_t seed = 1234);
  struct Batch {
    Tensor inputs;   // (B, T, C) f32 on the CPU
    Tensor targets;  // (B, T) i64 on the CPU
  };
  // A fresh batch, its inputs drawn from the global generator.
  Batch sample(int64_t batch, int64_t tokens) const;

 private:
  Tensor projection_;  // (classes, C)
};

}  // namespace loom::nn
