// Batch normalisation layers, PyTorch's nn.BatchNorm1d and nn.BatchNorm2d: per channel
// (axis 1),
//   y = (x - mean) / sqrt(var + eps) * weight + bias,
// with the batch's mean and biased variance in training mode and the running statistics in
// eval mode. Each training forward updates running = (1 - momentum) running + momentum
// batch (the variance unbiased) and adds one to num_batches_tracked. Without running
// statistics (TrackRunningStats::no) the batch's statistics normalise in both modes.
// Parameters and buffers carry PyTorch's state-dict names: weight, bias, running_mean,
// running_var, num_batches_tracked.
//
// Statistics and affine parameters are computed in the accumulation type (f32; f64 for f64
// input). A module converted with to(DType::bf16) holds bf16 tensors: forward then works on
// f32 copies of them (the parameters through the differentiable to(), so their gradients
// arrive in bf16) and writes the updated running statistics back, rounded to bf16.
#pragma once

#include <vector>

#include "layer_norm.h"  // Affine
#include "module.h"

namespace loom::nn {

enum class TrackRunningStats : bool { no = false, yes = true };

// What BatchNorm1d and BatchNorm2d share: they differ only in the input ranks they take.
class BatchNorm : public Module {
 public:
  Tensor forward(const Tensor& input) override;
  // relu(forward(input) + residual), residual undefined for none, in one kernel each way while
  // training (the engine's batch_norm_relu): what a ResNet block does after each BatchNorm.
  Tensor forward_relu(const Tensor& input, const Tensor& residual = Tensor());

  int64_t num_features() const { return num_features_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }

  Tensor weight;               // (C,), ones; undefined with Affine::no
  Tensor bias;                 // (C,), zeros; undefined with Affine::no
  Tensor running_mean;         // (C,), zeros; undefined with TrackRunningStats::no
  Tensor running_var;          // (C,), ones; likewise
  Tensor num_batches_tracked;  // i64 of shape (), training forwards so far; likewise

 protected:
  // ranks: the input ranks the layer takes; layout: how they read in messages, "(N, C, H, W)".
  BatchNorm(int64_t num_features, double eps, double momentum, Affine affine, TrackRunningStats track,
            std::vector<int> ranks, const char* layout);

 private:
  Tensor run(const Tensor& input, const Tensor* residual);  // residual null: no ReLU

  int64_t num_features_;
  double eps_, momentum_;
  std::vector<int> ranks_;
  const char* layout_;
};

// Over (N, C) or (N, C, L) input.
class BatchNorm1d : public BatchNorm {
 public:
  explicit BatchNorm1d(int64_t num_features, double eps = 1e-5, double momentum = 0.1, Affine affine = Affine::yes,
                       TrackRunningStats track = TrackRunningStats::yes);
  std::string type_name() const override { return "BatchNorm1d"; }
};

// Over (N, C, H, W) input.
class BatchNorm2d : public BatchNorm {
 public:
  explicit BatchNorm2d(int64_t num_features, double eps = 1e-5, double momentum = 0.1, Affine affine = Affine::yes,
                       TrackRunningStats track = TrackRunningStats::yes);
  std::string type_name() const override { return "BatchNorm2d"; }
};

}  // namespace loom::nn
