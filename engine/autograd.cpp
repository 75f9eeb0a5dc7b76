#include "engine/autograd.h"

#include <limits>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "engine/op_boundary.h"
#include "engine/ops.h"

namespace loom {

namespace {
thread_local bool g_grad_enabled = true;
std::atomic<uint64_t> g_sequence{0};
// The callbacks of the backward pass running on this thread (null outside one).
thread_local std::vector<std::function<void()>>* g_callbacks = nullptr;

// Points g_callbacks at one pass's list for its scope; a nested pass gets its own list (or,
// joined, keeps the enclosing one) and restores the outer one.
class CallbackScope {
 public:
  explicit CallbackScope(std::vector<std::function<void()>>* list) : previous_(g_callbacks) { g_callbacks = list; }
  ~CallbackScope() { g_callbacks = previous_; }
  CallbackScope(const CallbackScope&) = delete;
  CallbackScope& operator=(const CallbackScope&) = delete;

 private:
  std::vector<std::function<void()>>* previous_;
};

std::shared_ptr<Node> accumulator_for(const Tensor& leaf) {
  TensorImpl* impl = leaf.impl();
  if (auto node = impl->grad_accumulator.lock()) return node;
  auto node = std::make_shared<Node>();
  node->name = "AccumulateGrad";
  node->sequence_nr = std::numeric_limits<uint64_t>::max();  // runs as soon as it is ready
  node->outputs.push_back({leaf.shape(), leaf.dtype(), leaf.device(), std::nullopt});
  node->leaf = leaf.impl_ptr();
  impl->grad_accumulator = node;
  return node;
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  if (t.grad_fn()) return {t.grad_fn(), t.impl()->output_nr};
  return {accumulator_for(t), 0};
}

// Adds g into the leaf's gradient and fires its hooks. The first gradient is adopted
// when nothing else can see it, copied otherwise; later ones are added in place. A leaf's
// gradient has the leaf's layout: row-major, or channels-last for a channels-last 4-d leaf
// (Module::to(MemoryFormat)), as PyTorch's AccumulateGrad gives it its parameter's strides.
// One whose memory the other layout describes as well (a dim of size 1) is re-strided by
// contiguous(format), without a copy.
void accumulate(const Node& node, const Tensor& g) {
  Tensor leaf(node.leaf);
  Tensor grad = g;
  if (grad.dtype() != leaf.dtype()) grad = grad.to(leaf.dtype());
  if (grad.shape() != leaf.shape()) grad = sum_to(grad, leaf.shape());
  if (!leaf.grad().defined()) {
    const MemoryFormat format = leaf.memory_format();
    bool exclusive =
        grad.impl_ptr().use_count() <= 2 && grad.storage().use_count() == 1 && grad.is_contiguous(format);
    leaf.set_grad(exclusive ? grad.detach().contiguous(format) : grad.clone(format));
  } else {
    add_(leaf.grad(), grad);
  }
  for (auto& hook : node.leaf->post_accumulate_hooks) hook(leaf);
}
}  // namespace

bool grad_enabled() { return g_grad_enabled; }
void set_grad_enabled(bool enabled) { g_grad_enabled = enabled; }

bool any_requires_grad(std::initializer_list<Tensor> inputs) {
  if (!g_grad_enabled) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

bool any_requires_grad(const TensorList& inputs) {
  if (!g_grad_enabled) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

namespace {
std::shared_ptr<Node> new_node(const char* name, const TensorList& inputs, const TensorList& outputs) {
  auto node = std::make_shared<Node>();
  node->name = name;
  node->sequence_nr = g_sequence.fetch_add(1);
  node->next_edges.reserve(inputs.size());
  for (const Tensor& in : inputs) node->next_edges.push_back(gradient_edge(in));
  for (size_t i = 0; i < outputs.size(); ++i) {
    TensorImpl* out = outputs[i].impl();
    node->outputs.push_back({out->shape, out->dtype, outputs[i].device(), std::nullopt});
    out->requires_grad = true;
    out->grad_fn = node;
    out->output_nr = int(i);
  }
  return node;
}
}  // namespace

void set_gradient_read_dtype(const Tensor& t, DType dtype) {
  LOOM_ASSERT(t.grad_fn() != nullptr, "set_gradient_read_dtype on a tensor without a node");
  t.grad_fn()->outputs[size_t(t.impl()->output_nr)].grad_read_as = dtype;
}

std::optional<DType> gradient_read_dtype(const Tensor& t) {
  if (!t.grad_fn()) return std::nullopt;
  return t.grad_fn()->outputs[size_t(t.impl()->output_nr)].grad_read_as;
}

void set_gradient_sums_read(const Tensor& t, DType dtype) {
  LOOM_ASSERT(t.grad_fn() != nullptr, "set_gradient_sums_read on a tensor without a node");
  t.grad_fn()->outputs[size_t(t.impl()->output_nr)].grad_sums_read_as = dtype;
}

std::optional<DType> gradient_sums_read(const Tensor& t) {
  if (!t.grad_fn()) return std::nullopt;
  return t.grad_fn()->outputs[size_t(t.impl()->output_nr)].grad_sums_read_as;
}

void keep_column_sums(const Tensor& g, const Tensor& sums, DType read_as) {
  LOOM_ASSERT(g.dim() >= 1 && sums.dim() == 1 && sums.size(0) == g.size(-1) && sums.storage() != g.storage(),
              "column sums kept on a gradient are a vector of its own over its last dim");
  TensorImpl* impl = g.impl();
  impl->column_sums = sums.impl_ptr();
  impl->column_sums_of = read_as;
  impl->column_sums_version = g.storage()->version();
}

Tensor take_column_sums(const Tensor& g, DType read_as) {
  TensorImpl* impl = g.impl();
  if (!impl->column_sums) return Tensor();
  Tensor sums(std::move(impl->column_sums));
  impl->column_sums.reset();
  const bool valid = impl->column_sums_of == read_as && impl->column_sums_version == g.storage()->version();
  return valid ? sums : Tensor();
}

namespace {
thread_local std::vector<std::function<void()>> g_after_op;
}  // namespace

void after_current_op(std::function<void()> callback) { g_after_op.push_back(std::move(callback)); }

void run_op_boundary() {
  if (g_after_op.empty()) return;
  std::vector<std::function<void()>> now;
  now.swap(g_after_op);  // what these ask for goes to the next boundary
  for (size_t i = 0; i < now.size(); ++i) {
    try {
      now[i]();
    } catch (...) {
      // The callbacks not run yet wait for the next boundary, before any asked for since.
      g_after_op.insert(g_after_op.begin(), std::make_move_iterator(now.begin() + ptrdiff_t(i) + 1),
                        std::make_move_iterator(now.end()));
      throw;
    }
  }
}

void record(const char* name, const TensorList& inputs, const TensorList& outputs, BackwardFn backward) {
  new_node(name, inputs, outputs)->backward = std::move(backward);
  run_op_boundary();
}

void record_accumulating(const char* name, const TensorList& inputs, const TensorList& outputs,
                         AccumulatingBackwardFn backward) {
  new_node(name, inputs, outputs)->backward_into = std::move(backward);
  run_op_boundary();
}

void queue_callback(std::function<void()> callback) {
  LOOM_CHECK(g_callbacks != nullptr,
             "queue_callback: no backward pass is running on this thread; call it from a gradient hook");
  g_callbacks->push_back(std::move(callback));
}

namespace {
// What a pass run inside a node's backward (run_nested_backward) leaves to the W half of the
// split pass whose B half called the node.
struct NestedWeightHalf {
  DeferredGradients rest;  // the inner pass's W half
  TensorList leaves;       // per input of the node: the leaf whose gradient W sends along its edge
};

// What a split pass asks of the node it is running (gradient_wanted); null on this thread
// otherwise, including inside a pass nested in that node's backward.
struct WantedInputs {
  std::vector<bool> wanted;    // per input
  std::vector<bool> declined;  // per input: asked about through gradient_wanted, answered false
  // Set when B calls the node: a pass inside its backward is split too (run_nested_backward),
  // and leaves its W half in `nested`.
  bool b_half = false;
  std::optional<NestedWeightHalf> nested;
};
thread_local WantedInputs* g_wanted = nullptr;

class WantedScope {
 public:
  explicit WantedScope(WantedInputs* wanted) : previous_(g_wanted) { g_wanted = wanted; }
  ~WantedScope() { g_wanted = previous_; }
  WantedScope(const WantedScope&) = delete;
  WantedScope& operator=(const WantedScope&) = delete;

 private:
  WantedInputs* previous_;
};

// The gradients a pass has sent to nodes that have not run yet, one slot per node output.
class GradientBuffers {
 public:
  void add(const Edge& edge, Tensor g) {
    TensorList& buf = grads_[edge.node.get()];
    if (buf.size() < edge.node->outputs.size()) buf.resize(edge.node->outputs.size());
    Tensor& slot = buf[size_t(edge.input_nr)];
    slot = slot.defined() ? loom::add(slot, g) : std::move(g);
  }

  // The node's output gradients, zeros for an output that received none; they leave the buffers.
  TensorList take(const Node& node) {
    TensorList grads;
    if (auto it = grads_.find(&node); it != grads_.end()) {
      grads = std::move(it->second);
      grads_.erase(it);
    }
    grads.resize(node.outputs.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined()) continue;
      const OutputMeta& m = node.outputs[i];
      grads[i] = zeros(m.shape, m.dtype, m.device);
    }
    return grads;
  }

  // For an accumulating node: per input (of those `wanted` asks for, if set), the gradient
  // already sent there when nothing but these buffers hold it (record_accumulating may then
  // add into it in place).
  TensorList offered(const Node& node, const WantedInputs* wanted) const {
    TensorList into(node.next_edges.size());
    for (size_t i = 0; i < into.size(); ++i) {
      const Edge& e = node.next_edges[i];
      if (!e.node || (wanted && !wanted->wanted[i])) continue;
      auto it = grads_.find(e.node.get());
      if (it == grads_.end() || it->second.size() <= size_t(e.input_nr)) continue;
      const Tensor& slot = it->second[size_t(e.input_nr)];
      const OutputMeta& m = e.node->outputs[size_t(e.input_nr)];
      const bool alone = slot.defined() && slot.impl_ptr().use_count() == 1 && slot.storage().use_count() == 1;
      // Dense in its own layout (row-major, or channels-last for a 4-d gradient): the
      // accumulating op checks the layout it writes.
      const bool fits = slot.is_contiguous(slot.memory_format()) && slot.shape() == m.shape && slot.dtype() == m.dtype;
      if (alone && fits && slot.device() == m.device) into[i] = slot;
    }
    return into;
  }

 private:
  std::unordered_map<const Node*, TensorList> grads_;
};

// The root tensors' edges, one per root.
std::vector<Edge> root_edges(const TensorList& roots) {
  std::vector<Edge> edges;
  for (const Tensor& root : roots) {
    LOOM_CHECK(root.requires_grad(),
               "backward() on a tensor that does not require a gradient: nothing it depends on has "
               "requires_grad set (or it was computed under NoGradGuard)");
    edges.push_back(gradient_edge(root));
  }
  return edges;
}

// The nodes reachable from the roots, in the order a pass runs them: a node once every edge
// into it has been followed, the most recently created ready node first (so every node comes
// before the nodes its edges lead to). The order depends on the graph alone, not on values.
std::vector<std::shared_ptr<Node>> schedule(const std::vector<Edge>& roots) {
  std::unordered_map<Node*, int> dependencies;
  std::unordered_map<Node*, std::shared_ptr<Node>> reached;
  std::vector<Node*> stack;
  for (const Edge& e : roots)
    if (reached.emplace(e.node.get(), e.node).second) stack.push_back(e.node.get());
  // Count, for every reachable node, how many edges lead into it.
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges) {
      if (!e.node) continue;
      dependencies[e.node.get()]++;
      if (reached.emplace(e.node.get(), e.node).second) stack.push_back(e.node.get());
    }
  }
  auto later_first = [](Node* a, Node* b) { return a->sequence_nr < b->sequence_nr; };
  std::priority_queue<Node*, std::vector<Node*>, decltype(later_first)> ready(later_first);
  for (auto& [n, _] : reached)
    if (dependencies[n] == 0) ready.push(n);
  std::vector<std::shared_ptr<Node>> order;
  order.reserve(reached.size());
  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    order.push_back(reached.at(node));
    for (const Edge& e : node->next_edges)
      if (e.node && --dependencies[e.node.get()] == 0) ready.push(e.node.get());
  }
  return order;
}

// Calls node's backward on its output gradients, asking for the inputs `wanted` names (null:
// all), and returns one gradient per input.
TensorList call_backward(const Node& node, const TensorList& grads_in, const GradientBuffers& buffers,
                         WantedInputs* wanted) {
  LOOM_CHECK(node.backward || node.backward_into, "backward through ", node.name,
             " a second time: its saved tensors were freed when the first backward ran through it; pass "
             "RetainGraph::yes to the first backward() (or run_backward) to go through the graph again");
  TensorList grads_out;
  if (node.backward_into) {
    const TensorList into = buffers.offered(node, wanted);
    WantedScope scope(wanted);
    grads_out = node.backward_into(grads_in, into);
  } else {
    WantedScope scope(wanted);
    grads_out = node.backward(grads_in);
  }
  LOOM_ASSERT(grads_out.size() == node.next_edges.size(), node.name, " returned ", grads_out.size(),
              " gradients for ", node.next_edges.size(), " inputs");
  return grads_out;
}

// Drops what the node's op saved for its gradient: the closure that holds it (autograd.h).
void free_saved(Node& node) {
  node.backward = nullptr;
  node.backward_into = nullptr;
}

// Runs a node as run_backward does: accumulates a leaf's gradient, or sends every input its own
// and then, unless `retain`, frees what the node saved.
void run_node(Node& node, GradientBuffers& buffers, RetainGraph retain) {
  TensorList grads_in = buffers.take(node);
  if (node.leaf) {
    accumulate(node, grads_in[0]);
    run_op_boundary();
    return;
  }
  const TensorList grads_out = call_backward(node, grads_in, buffers, nullptr);
  for (size_t i = 0; i < grads_out.size(); ++i) {
    const Edge& e = node.next_edges[i];
    if (e.node && grads_out[i].defined()) buffers.add(e, grads_out[i]);
  }
  if (retain == RetainGraph::no) free_saved(node);
  run_op_boundary();
}

// A pass's callbacks, in the order queued. By index: a callback may queue another, which
// reallocates the list.
void run_callbacks(std::vector<std::function<void()>>& callbacks) {
  for (size_t i = 0; i < callbacks.size(); ++i) {
    std::function<void()> callback = std::move(callbacks[i]);
    callback();
  }
}

// The list a pass queues its callbacks into: its own, or, joined, the enclosing pass's. A joined
// pass's own list then stays empty and running it at the end runs nothing: the enclosing pass
// runs those callbacks when it ends.
std::vector<std::function<void()>>* callback_list(Nesting nesting, std::vector<std::function<void()>>& own) {
  return nesting == Nesting::joined && g_callbacks != nullptr ? g_callbacks : &own;
}
}  // namespace

void run_backward(const TensorList& roots, const TensorList& grads, Nesting nesting, RetainGraph retain) {
  LOOM_ASSERT(roots.size() == grads.size(), "one gradient per root");
  NoGradGuard no_grad;
  WantedScope every_input(nullptr);  // a pass nested in a split pass's node is whole
  std::vector<std::function<void()>> callbacks;
  CallbackScope callback_scope(callback_list(nesting, callbacks));

  const std::vector<Edge> edges = root_edges(roots);
  GradientBuffers buffers;
  for (size_t i = 0; i < edges.size(); ++i) buffers.add(edges[i], grads[i]);
  for (const std::shared_ptr<Node>& node : schedule(edges)) run_node(*node, buffers, retain);
  run_callbacks(callbacks);
}

// What a split pass's B half left to its W half (autograd.h, step 3).
struct DeferredGradients::Rest {
  // One step of W, in the schedule's order: a node B did not run, run whole; or the part of a
  // live node that B left.
  struct Step {
    // The node; for a part, a copy of the live node's name and edges, those to live nodes
    // cleared (W must not keep B's graph alive), and of its backward when `asked` names an input.
    std::shared_ptr<Node> node;
    bool part = false;
    TensorList computed;       // per input: the gradient B computed for a node it did not run
    std::vector<bool> asked;   // per input: declined in B, computed here
    TensorList grads_in;       // the node's output gradients, when `asked` names an input
    std::optional<NestedWeightHalf> nested;  // the W half of the pass its backward ran in B
  };
  std::vector<Step> steps;
  GradientBuffers buffers;  // W's: the roots' gradients for nodes B did not run, then what W sends
};

namespace {
using Step = DeferredGradients::Rest::Step;

// The nodes that lead to the AccumulateGrad of a leaf in `now` (autograd.h, step 2). Walked
// backwards, the schedule settles the nodes an edge leads to before the node it leaves.
std::unordered_set<const Node*> live_nodes(const std::vector<std::shared_ptr<Node>>& order, const TensorList& now) {
  std::unordered_set<const Node*> live;
  for (size_t i = 0; i < now.size(); ++i) {
    const Tensor& t = now[i];
    LOOM_CHECK(t.defined() && t.requires_grad() && !t.grad_fn(), "run_backward_split: now[", i,
               "] is not a leaf that requires a gradient: pass the stage's input, a tensor made with detach() "
               "and set_requires_grad()");
    if (auto accumulator = t.impl()->grad_accumulator.lock()) live.insert(accumulator.get());
  }
  for (auto it = order.rbegin(); it != order.rend(); ++it)
    for (const Edge& e : (*it)->next_edges)
      if (e.node && live.count(e.node.get())) {
        live.insert(it->get());
        break;
      }
  return live;
}

// W's part of a live node that B ran with `ask` (which declined some input, or holds the W half
// of a nested pass) on grads_in, after it returned grads_out.
Step part_left(const Node& node, WantedInputs& ask, const TensorList& grads_out, TensorList& grads_in) {
  Step step{nullptr, true, TensorList(grads_out.size()), std::vector<bool>(grads_out.size()), {},
            std::move(ask.nested)};
  bool again = false;
  for (size_t i = 0; i < grads_out.size(); ++i) {
    if (!node.next_edges[i].node || ask.wanted[i]) continue;
    if (grads_out[i].defined()) {
      step.computed[i] = grads_out[i];
    } else if (ask.declined[i]) {
      step.asked[i] = again = true;
    }
  }
  auto part = std::make_shared<Node>();
  part->name = node.name;
  part->next_edges = node.next_edges;
  for (size_t i = 0; i < ask.wanted.size(); ++i)
    if (ask.wanted[i]) part->next_edges[i] = {};
  if (again) {
    part->backward = node.backward;
    part->backward_into = node.backward_into;
    step.grads_in = std::move(grads_in);
  }
  step.node = std::move(part);
  return step;
}

// Runs W's part of a live node: the W half of the pass its backward ran in B, first, as that
// pass ran before the backward returned; then adds what B computed for it, what it declined,
// asked again, and its nested pass's leaves' gradients, in input order as run_backward adds them.
void run_part(Step& step, GradientBuffers& buffers) {
  const Node& node = *step.node;
  if (step.nested) step.nested->rest.run(Nesting::joined);
  TensorList again;
  if (node.backward || node.backward_into) {
    WantedInputs ask{step.asked, std::vector<bool>(step.asked.size())};
    again = call_backward(node, step.grads_in, buffers, &ask);
  }
  for (size_t i = 0; i < node.next_edges.size(); ++i) {
    const Edge& e = node.next_edges[i];
    if (!e.node) continue;
    if (step.computed[i].defined()) {
      buffers.add(e, std::move(step.computed[i]));
    } else if (step.asked[i] && again[i].defined()) {
      buffers.add(e, again[i]);
    } else if (step.nested && step.nested->leaves[i].defined() && step.nested->leaves[i].grad().defined()) {
      buffers.add(e, step.nested->leaves[i].grad());
    }
  }
  run_op_boundary();
}
}  // namespace

DeferredGradients::DeferredGradients() = default;
DeferredGradients::~DeferredGradients() = default;
DeferredGradients::DeferredGradients(DeferredGradients&&) noexcept = default;
DeferredGradients& DeferredGradients::operator=(DeferredGradients&&) noexcept = default;
DeferredGradients::DeferredGradients(std::unique_ptr<Rest> rest) : rest_(std::move(rest)) {}

bool DeferredGradients::empty() const { return !rest_ || rest_->steps.empty(); }

void DeferredGradients::run(Nesting nesting) {
  if (!rest_) return;
  const std::unique_ptr<Rest> rest = std::move(rest_);  // once, even when a node throws
  NoGradGuard no_grad;
  WantedScope every_input(nullptr);
  std::vector<std::function<void()>> callbacks;
  CallbackScope callback_scope(callback_list(nesting, callbacks));
  for (Step& step : rest->steps) {
    if (step.part) {
      run_part(step, rest->buffers);
    } else {
      run_node(*step.node, rest->buffers, RetainGraph::no);
    }
    step = Step{};  // what it held is no longer needed
  }
  run_callbacks(callbacks);
}

DeferredGradients run_backward_split(const TensorList& roots, const TensorList& grads, const TensorList& now,
                                     Nesting nesting) {
  LOOM_ASSERT(roots.size() == grads.size(), "one gradient per root");
  NoGradGuard no_grad;
  WantedScope every_input(nullptr);
  std::vector<std::function<void()>> callbacks;
  CallbackScope callback_scope(callback_list(nesting, callbacks));

  const std::vector<Edge> edges = root_edges(roots);
  const std::vector<std::shared_ptr<Node>> order = schedule(edges);  // step 1
  const std::unordered_set<const Node*> live = live_nodes(order, now);  // step 2
  auto rest = std::make_unique<DeferredGradients::Rest>();
  GradientBuffers buffers;  // B's, for live nodes only
  for (size_t i = 0; i < edges.size(); ++i)
    (live.count(edges[i].node.get()) ? buffers : rest->buffers).add(edges[i], grads[i]);
  for (const std::shared_ptr<Node>& node : order) {
    if (!live.count(node.get())) {
      Step whole;
      whole.node = node;
      rest->steps.push_back(std::move(whole));
      continue;
    }
    TensorList grads_in = buffers.take(*node);
    if (node->leaf) {
      accumulate(*node, grads_in[0]);
      continue;
    }
    const size_t n = node->next_edges.size();
    WantedInputs ask{std::vector<bool>(n), std::vector<bool>(n), true, std::nullopt};
    bool mixed = false;
    for (size_t i = 0; i < n; ++i) {
      const Edge& e = node->next_edges[i];
      ask.wanted[i] = !e.node || live.count(e.node.get());
      mixed = mixed || !ask.wanted[i];
    }
    const TensorList grads_out = call_backward(*node, grads_in, buffers, &ask);
    for (size_t i = 0; i < n; ++i) {
      const Edge& e = node->next_edges[i];
      if (e.node && ask.wanted[i] && grads_out[i].defined()) buffers.add(e, grads_out[i]);
    }
    if (mixed || ask.nested) rest->steps.push_back(part_left(*node, ask, grads_out, grads_in));
    free_saved(*node);  // part_left copied the closure where W calls it again
  }
  run_callbacks(callbacks);
  return DeferredGradients(std::move(rest));
}

TensorList run_nested_backward(const TensorList& roots, const TensorList& grads, const TensorList& input_leaves) {
  WantedInputs* const asked = g_wanted;  // the question to the node: the pass below replaces it
  auto needs_gradient = [&](size_t i) { return input_leaves[i].defined() && input_leaves[i].requires_grad(); };
  TensorList dL_dinputs(input_leaves.size());
  if (!asked || !asked->b_half) {
    run_backward(roots, grads, Nesting::joined);
    for (size_t i = 0; i < input_leaves.size(); ++i)
      if (needs_gradient(i)) dL_dinputs[i] = input_leaves[i].grad();
    return dL_dinputs;
  }
  LOOM_ASSERT(input_leaves.size() == asked->wanted.size(), "run_nested_backward: ", input_leaves.size(),
              " leaves for a node of ", asked->wanted.size(), " inputs");
  LOOM_ASSERT(!asked->nested, "run_nested_backward: one nested pass per call of a node's backward");
  TensorList now, later(input_leaves.size());
  for (size_t i = 0; i < input_leaves.size(); ++i) {
    if (!needs_gradient(i)) continue;
    if (asked->wanted[i]) {
      now.push_back(input_leaves[i]);
    } else {
      later[i] = input_leaves[i];
    }
  }
  DeferredGradients rest = run_backward_split(roots, grads, now, Nesting::joined);
  for (size_t i = 0; i < input_leaves.size(); ++i)
    if (needs_gradient(i) && asked->wanted[i]) dL_dinputs[i] = input_leaves[i].grad();
  if (!rest.empty()) asked->nested = NestedWeightHalf{std::move(rest), std::move(later)};
  return dL_dinputs;
}

bool gradient_wanted(size_t input) {
  if (!g_wanted || input >= g_wanted->wanted.size() || g_wanted->wanted[input]) return true;
  g_wanted->declined[input] = true;
  return false;
}

}  // namespace loom
