// Activation recomputation ("gradient checkpointing"): trade compute for memory. Backward
// needs the activations a forward made; a long stack of blocks keeps every one of them alive
// until backward reaches it. recompute(fn, inputs) runs fn with no graph, so fn's
// intermediate activations are freed as soon as fn returns, and records one node that keeps
// only `inputs`. When backward reaches that node, it runs fn again (now recording) on
// detached copies of the inputs and back-propagates the incoming gradient through the
// fresh graph. A model whose blocks are each wrapped this way holds one tensor per block
// (its input) instead of all of the block's activations, at the price of a second forward
// of every block. This is PyTorch's torch.utils.checkpoint.checkpoint(use_reentrant=True).
// It is named recompute, not checkpoint, because layers/checkpoint.h is about checkpoint
// files (saved training state).
//
// The second run must compute what the first did:
// - Autocast: fn runs again under the autocast dtype (or none) of the forward, whatever the
//   caller of backward has set.
// - Randomness: the generator (engine/ops.h, rng_state) is set back to where it stood when
//   fn first ran, so dropout draws the same masks, then restored to where backward found it:
//   the random stream after a step is the same with and without recomputation. The
//   generator is one per process, so another thread drawing random numbers while a
//   recomputation runs would shift its draws; keep random draws on the training thread.
// - Inputs: `inputs` are saved as they are (data, not copies): they must not be modified in
//   place before backward, as for any tensor an op saves.
//
// Parameters fn uses (not among `inputs`) get their gradients from the inner backward,
// accumulated into .grad as usual, with their post-accumulate hooks firing there; the inner
// pass joins the outer one (Nesting::joined in engine/autograd.h), so callbacks queued from
// those hooks (DDP's end of backward) run when the whole backward ends. A parameter used in
// two recomputed calls (or in one and outside) is accumulated, and its hooks fire, once per
// pass that reaches it, which DDP refuses: share no parameters across recomputed blocks there.
// A tensor fn captures that has a history of its own (computed, not a leaf) is
// back-propagated through by the inner pass, which frees what its nodes saved (backward frees
// as it goes, engine/autograd.h). Where the outer pass reaches those nodes too (the tensor is
// also used outside fn, or shares its history with `inputs`), it stops with an error naming
// one. Pass such a tensor among `inputs` instead.
//
// Inside a split backward pass (run_backward_split, engine/autograd.h) the inner pass is split
// too: the B half reruns fn and computes only the gradients of the inputs it asks for, and the
// weight products inside (a recomputed block's parameters) wait for the W half. Until then the
// W half keeps what they read: fn's recomputed activations that feed them, and their output
// gradients, as it does for a block that was not recomputed.
//
// Because fn may use parameters, the node is recorded whenever grad mode is on, even if no
// input requires a gradient (PyTorch's reentrant checkpoint warns and drops those
// gradients instead). With grad mode off, recompute is just fn(inputs).
#pragma once

#include <functional>

#include "tensor.h"

namespace loom {

using RecomputeFn = std::function<Tensor(const TensorList& inputs)>;

// fn(inputs), without keeping fn's intermediate activations: backward runs fn a second time.
// fn must be a function of `inputs` and of parameters alone (it is stored in the graph and
// called again later), returning one tensor.
Tensor recompute(const RecomputeFn& fn, const TensorList& inputs);

}  // namespace loom
