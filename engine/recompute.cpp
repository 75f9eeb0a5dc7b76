// recompute (engine/recompute.h): a forward under no-grad, then one node whose backward
// runs the forward again with a graph and back-propagates through it, a pass nested in the
// pass that reached the node (run_nested_backward, which splits it inside a split pass).
#include "engine/recompute.h"

#include <optional>
#include <utility>
#include <vector>

#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom {

namespace {
// Grad mode on for its scope: a node's backward runs under its pass's no-grad.
class EnableGradGuard {
 public:
  EnableGradGuard() : previous_(grad_enabled()) { set_grad_enabled(true); }
  ~EnableGradGuard() { set_grad_enabled(previous_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool previous_;
};

using RngState = std::pair<uint64_t, uint64_t>;  // (seed, offset)

// The generator at `state` for its scope, back where it was afterwards.
class RngStateGuard {
 public:
  explicit RngStateGuard(RngState state) : previous_(rng_state()) { set_rng_state(state.first, state.second); }
  ~RngStateGuard() { set_rng_state(previous_.first, previous_.second); }
  RngStateGuard(const RngStateGuard&) = delete;
  RngStateGuard& operator=(const RngStateGuard&) = delete;

 private:
  RngState previous_;
};
}  // namespace

Tensor recompute(const RecomputeFn& fn, const TensorList& inputs) {
  if (!grad_enabled()) return fn(inputs);
  const std::optional<DType> autocast = autocast_dtype();
  const RngState rng = rng_state();
  Tensor output;
  {
    NoGradGuard no_grad;
    output = fn(inputs);
  }
  LOOM_CHECK(output.defined(), "recompute: the function returned an undefined tensor");
  // A handle of its own: fn may return one of its inputs, which record() must not turn
  // into the node's output.
  output = output.detach();

  TensorList saved;
  std::vector<bool> wants_grad;
  for (const Tensor& in : inputs) {
    saved.push_back(in.defined() ? in.detach() : Tensor());
    wants_grad.push_back(in.defined() && in.requires_grad());
  }
  record("Recompute", inputs, {output}, [fn, saved, wants_grad, autocast, rng](const TensorList& dL_doutput) {
    // Fresh leaves each time: their .grad is this pass's gradient and nothing else's.
    TensorList leaves(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      if (!saved[i].defined()) continue;
      leaves[i] = saved[i].detach();
      if (wants_grad[i]) leaves[i].set_requires_grad();
    }
    Tensor again;
    {
      EnableGradGuard grad_on;
      AutocastGuard cast(autocast);
      RngStateGuard same_draws(rng);
      again = fn(leaves);
    }
    if (!again.requires_grad()) return TensorList(saved.size());  // nothing fn computed needs a gradient
    return run_nested_backward({again}, {dL_doutput[0]}, leaves);
  });
  return output;
}

}  // namespace loom
