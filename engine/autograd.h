// Autograd: a dynamic tape. Every differentiable op that sees an input requiring a
// gradient records a Node: the closure that maps its output gradients to its input
// gradients, plus an edge to each input's own node. backward() walks the nodes in
// reverse topological order, always running the most recently created ready node first
// (as PyTorch does), so the last layers' gradients are final first. A leaf's gradient is
// accumulated by its AccumulateGrad node, which runs as soon as every path into it is
// done and then fires the leaf's post-accumulate hooks: that is when DDP can start
// reducing that gradient while the rest of backward goes on. A hook may also queue a
// callback that runs once the whole pass is done (queue_callback): DDP finishes there.
// A node's backward may itself run a backward pass (engine/recompute.h does): see Nesting.
// A pipeline stage may split a pass in two, its input's gradient first and its parameters'
// later (run_backward_split, at the end).
//
// Saved tensors are captured detached (data only) so a node never keeps its own output
// alive through a cycle. Gradients of gradients are not supported: backward runs under
// no-grad.
//
// What an op saved lives in its node's closure. A pass frees the closure as soon as the node
// has run and sent its gradients on, so activations go during backward, last layer first, not
// when the graph's last owner (the loss) goes, after the optimizer step. The node itself stays
// (its name and edges) while the graph is owned: a second pass through it is an error naming
// it, unless the first ran with RetainGraph::yes (PyTorch's retain_graph), which keeps every
// closure. AccumulateGrad nodes save nothing and serve every pass. A split pass frees a node
// once the half that calls it last has run it.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensor.h"

namespace loom {

using BackwardFn = std::function<TensorList(const TensorList& grad_outputs)>;
// A backward that may add input i's gradient into into[i] in place (see record_accumulating)
// and then returns an undefined gradient for that input.
using AccumulatingBackwardFn = std::function<TensorList(const TensorList& grad_outputs, const TensorList& into)>;

struct Edge {
  std::shared_ptr<Node> node;  // null: this input needs no gradient
  int input_nr = 0;            // which output of `node` the gradient belongs to
};

// Shape, dtype and device of an output, to build a zero gradient for an output that
// received none (a multi-output node whose other outputs were unused).
struct OutputMeta {
  Shape shape;
  DType dtype;
  Device device;
  // Set when the node's backward casts this output's gradient to another dtype before
  // reading it (set_gradient_read_dtype).
  std::optional<DType> grad_read_as;
  // Set when the node's backward sums this output's gradient, read in this dtype, over its
  // rows (a bias gradient: set_gradient_sums_read).
  std::optional<DType> grad_sums_read_as;
};

struct Node {
  std::string name;
  uint64_t sequence_nr = 0;
  std::vector<Edge> next_edges;  // one per input of the op
  std::vector<OutputMeta> outputs;
  // Returns one gradient per input (an undefined Tensor where an input gets none). Empty once
  // a pass without RetainGraph::yes has run the node.
  BackwardFn backward;
  // Set instead of backward by record_accumulating.
  AccumulatingBackwardFn backward_into;
  // Set on AccumulateGrad nodes: the leaf whose .grad they accumulate into.
  std::shared_ptr<TensorImpl> leaf;
};

// Grad mode: on by default, per thread.
bool grad_enabled();
void set_grad_enabled(bool enabled);

// Disables recording for its scope (evaluation, optimizer steps, in-place updates).
class NoGradGuard {
 public:
  NoGradGuard() : previous_(grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// True when grad mode is on and any input requires a gradient: the op must record.
bool any_requires_grad(std::initializer_list<Tensor> inputs);
bool any_requires_grad(const TensorList& inputs);

// Records `backward` as the gradient of `outputs` with respect to `inputs`; marks the
// outputs as requiring grad. Ops call it only when any_requires_grad(inputs); recompute
// (engine/recompute.h) also records when no input requires a gradient, as the function it
// reruns may use parameters.
void record(const char* name, const TensorList& inputs, const TensorList& outputs, BackwardFn backward);

// record for ops whose gradient for an input is an addition into a large buffer (an
// embedding's: a few rows added into a table of zeros). When other ops have already sent
// input i a gradient of its shape, dtype and device that the pass alone holds, `backward`
// gets it as into[i] and may add into it in place, returning an undefined gradient for
// input i: a GPT's tied token embedding then adds its rows into the output layer's
// gradient, with no table of zeros and no sum of the two, and a convolution adds its input
// gradient into the one a residual shortcut sent. into[i] is undefined otherwise; it is
// dense in its own layout (row-major, or channels-last when 4-d), which the op checks.
// A backward that writes into into[i] other than through Loom's in-place ops calls
// into[i].bump_version(), so that no copy kept on that gradient (cast_or_kept) is reused.
void record_accumulating(const char* name, const TensorList& inputs, const TensorList& outputs,
                         AccumulatingBackwardFn backward);

// Declares that the backward of t's node reads t's gradient cast to `dtype`: an autocast
// product with an f32 output (its residual sum) reads that gradient in 16 bits. An op that
// computes the gradient may then write it rounded beside the f32 values, in the same pass,
// and keep the rounding on it (set_weight_copy, engine/autocast.h) for cast_or_kept to find:
// LayerNorm's backward does, and the cast pass between the two goes away.
void set_gradient_read_dtype(const Tensor& t, DType dtype);
// The dtype declared for t's gradient, if t has a node and one was declared.
std::optional<DType> gradient_read_dtype(const Tensor& t);

// Declares that the backward of t's node sums t's gradient, read in `dtype`, over all but its
// last dim (the bias gradient of the product that computed t). An op that computes that
// gradient may then take the sums in the pass that writes it and keep them on it
// (keep_column_sums), and the reader takes them (take_column_sums) instead of summing the
// gradient again: LayerNorm's backward does, for the product whose output it normalises
// (Options::fused_bias_sums).
void set_gradient_sums_read(const Tensor& t, DType dtype);
// The dtype declared so for t's gradient, if t has a node and one was declared.
std::optional<DType> gradient_sums_read(const Tensor& t);
// Keeps on g `sums`, its column sums over its last dim of g's values read in `read_as` (g
// itself, or g's kept rounding: set_gradient_read_dtype), valid while g's storage is
// unchanged.
void keep_column_sums(const Tensor& g, const Tensor& sums, DType read_as);
// The sums kept on g of its values read in `read_as`, if still valid, removed from g; else
// undefined.
Tensor take_column_sums(const Tensor& g, DType read_as);

// How a backward pass started while another runs on this thread (from a hook, or from a
// node's backward) relates to it. Either way the inner pass is complete on its own: its
// nodes run, its leaves accumulate and fire their hooks before it returns. What differs is
// where queue_callback puts the callbacks queued during it.
enum class Nesting {
  // An independent pass: its callbacks run when it ends, the enclosing pass's stay queued.
  separate,
  // A part of the enclosing pass (recompute's backward, engine/recompute.h): callbacks
  // queued during it join the enclosing pass's list and run when that pass ends, as they
  // would without recomputation. DDP's end-of-backward callback needs this when its first
  // hook fires inside a recomputed block. Outside any pass it is the same as `separate`.
  joined,
};

// Runs backward from `roots` seeded with `grads` (one per root, same shapes). May be called
// from a node's backward or a hook (see Nesting): a pass keeps its state on its own stack.
// With RetainGraph::yes the nodes keep what they saved, for another pass through them.
void run_backward(const TensorList& roots, const TensorList& grads, Nesting nesting = Nesting::separate,
                  RetainGraph retain = RetainGraph::no);

// Runs `callback` once the backward pass running on this thread has finished, after its
// last node, as PyTorch's Variable._execution_engine.queue_callback. Hooks use it to act
// on the pass as a whole: DDP queues the end of its gradient reduction from its first hook,
// and from there finds the parameters whose hooks never fired. Callbacks run in the order
// queued, under no-grad, and may queue more; when a node or a callback throws, those not yet
// run are dropped. Outside a backward pass it is an error.
void queue_callback(std::function<void()> callback);

// A split backward pass, for zero-bubble pipeline schedules (ZB-H1). A stage must send its
// input's gradient to the previous stage at once ("backward for the input", B) but may
// compute its parameters' gradients later, in the schedule's bubbles ("backward for the
// weights", W). run_backward_split runs B; it returns W as a DeferredGradients. Steps:
//  1. Schedule: the nodes reachable from the roots, in the order run_backward runs them.
//  2. Live nodes: those from which an edge path leads to the AccumulateGrad of a tensor in
//     `now`. B runs only these. A live node with an edge to a node that is not live (a linear
//     op's weight) is called with gradient_wanted(i) false for that edge: the op skips that
//     product. What the op computes for such an edge anyway (LayerNorm's weight gradient rides
//     in its input gradient's kernel) is kept for W; for what it declined (gradient_wanted
//     answered false, no gradient returned), W calls the same backward again on the same
//     output gradients, asking for those inputs only.
//  3. W walks the schedule of step 1 without the live nodes: where a live node stood, it adds
//     the gradients kept for it and computes those it declined; every other node runs there
//     as in run_backward. Each gradient is therefore summed in run_backward's order (a weight
//     shared by products B runs and products it does not included): B then W gives
//     run_backward's gradients, to the bit on the CPU, provided each op computes an input's
//     gradient the same way whichever others it is asked for.
// Until W runs, the DeferredGradients holds the output gradients of the nodes that declined
// (dy of each linear op) and what their backward saved, the gradients kept for W (apart, to be
// summed in order), and the nodes W runs; not the rest of B's graph. B frees what each node it
// ran saved (a declining node's closure moves to W), W what each node it runs saved, once run.
// A node whose backward runs a pass of its own over leaves standing for its inputs
// (engine/recompute.h) runs it through run_nested_backward: called by B, that pass is split in
// its turn, B asking of it only the gradients of the inputs B asks of the node, and its W half
// runs in W where the node stood (a recomputed block's weight products included); W keeps what
// the inner W half keeps.

// The weight half of a split backward pass: what run_backward_split left for later.
class DeferredGradients {
 public:
  DeferredGradients();
  ~DeferredGradients();
  DeferredGradients(DeferredGradients&&) noexcept;
  DeferredGradients& operator=(DeferredGradients&&) noexcept;
  DeferredGradients(const DeferredGradients&) = delete;
  DeferredGradients& operator=(const DeferredGradients&) = delete;

  bool empty() const;
  // Runs the deferred part: every parameter (any leaf not in `now`) gets its gradient
  // accumulated and its post-accumulate hooks fire, and the callbacks queued from those hooks
  // (queue_callback) go where `nesting` says, as for run_backward: by default they run when it
  // ends. Runs at most once: afterwards empty(), and run() does nothing.
  void run(Nesting nesting = Nesting::separate);

  struct Rest;  // engine/autograd.cpp

 private:
  explicit DeferredGradients(std::unique_ptr<Rest> rest);
  friend DeferredGradients run_backward_split(const TensorList&, const TensorList&, const TensorList&, Nesting);
  std::unique_ptr<Rest> rest_;
};

// Backward from `roots` seeded with `grads`, computing now only what leads to the leaves in
// `now` (their .grad is accumulated and their hooks fire before it returns; callbacks queued
// in it go where `nesting` says, by default run when it returns); every gradient that leads
// only to other leaves is left in the returned DeferredGradients. run_backward_split followed
// by DeferredGradients::run() accumulates the same gradients as one run_backward. `now` holds
// leaves requiring a gradient (the stage's input); an empty `now` defers everything.
DeferredGradients run_backward_split(const TensorList& roots, const TensorList& grads, const TensorList& now,
                                     Nesting nesting = Nesting::separate);

// For a node's backward that runs a backward pass of its own (engine/recompute.h): from `roots`
// seeded with `grads`, over fresh leaves standing for the node's inputs (`input_leaves`, one
// per input of the node, undefined or not requiring a gradient where none is needed). Runs that
// pass as a part of the one that called the node (Nesting::joined) and returns, per input, its
// leaf's gradient, for the node to return as its own. When a split pass's B half calls the
// node, the inner pass is a run_backward_split whose `now` is the leaves of the inputs B asks
// the node for: it returns only their gradients (undefined for the others), and the inner W
// half runs when the W half reaches the node, which then sends the other leaves' gradients
// along the node's edges. At most one such pass per call of a node's backward.
TensorList run_nested_backward(const TensorList& roots, const TensorList& grads, const TensorList& input_leaves);

// For an op's backward: false when the pass will not use the gradient of input i now (a split
// pass's B half asks only for what leads to `now`; its W half only for the rest), and the op
// may skip computing it. True outside a split pass, and for an input that needs no gradient.
bool gradient_wanted(size_t input);

}  // namespace loom
