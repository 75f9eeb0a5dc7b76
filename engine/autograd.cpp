#include "engine/autograd.h"

#include <limits>
#include <queue>
#include <unordered_map>
#include <unordered_set>

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
// when nothing else can see it, copied otherwise; later ones are added in place.
void accumulate(Node& node, const Tensor& g) {
  Tensor leaf(node.leaf);
  Tensor grad = g;
  if (grad.dtype() != leaf.dtype()) grad = grad.to(leaf.dtype());
  if (grad.shape() != leaf.shape()) grad = sum_to(grad, leaf.shape());
  if (!leaf.grad().defined()) {
    bool exclusive = grad.impl_ptr().use_count() <= 2 && grad.storage().use_count() == 1 && grad.is_contiguous();
    leaf.set_grad(exclusive ? grad.detach() : grad.clone());
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

void record(const char* name, const TensorList& inputs, const TensorList& outputs, BackwardFn backward) {
  new_node(name, inputs, outputs)->backward = std::move(backward);
}

void record_accumulating(const char* name, const TensorList& inputs, const TensorList& outputs,
                         AccumulatingBackwardFn backward) {
  new_node(name, inputs, outputs)->backward_into = std::move(backward);
}

void queue_callback(std::function<void()> callback) {
  LOOM_CHECK(g_callbacks != nullptr,
             "queue_callback: no backward pass is running on this thread; call it from a gradient hook");
  g_callbacks->push_back(std::move(callback));
}

void run_backward(const TensorList& roots, const TensorList& grads, Nesting nesting) {
  LOOM_ASSERT(roots.size() == grads.size(), "one gradient per root");
  NoGradGuard no_grad;
  // A joined pass queues into the enclosing pass's list, so its own stays empty and the loop
  // at the end runs nothing: the enclosing pass runs those callbacks when it ends.
  std::vector<std::function<void()>> callbacks;
  const bool joined = nesting == Nesting::joined && g_callbacks != nullptr;
  CallbackScope callback_scope(joined ? g_callbacks : &callbacks);

  struct Pending {
    TensorList grads;
  };
  std::unordered_map<Node*, Pending> buffers;
  std::unordered_map<Node*, int> dependencies;
  std::unordered_map<Node*, std::shared_ptr<Node>> keep;

  auto add_grad = [&](const Edge& edge, const Tensor& g) {
    auto& buf = buffers[edge.node.get()].grads;
    if (buf.size() < edge.node->outputs.size()) buf.resize(edge.node->outputs.size());
    Tensor& slot = buf[edge.input_nr];
    slot = slot.defined() ? add(slot, g) : g;
  };

  // For an accumulating node: per input, the gradient already sent there when nothing but
  // this pass holds it (record_accumulating may then add into it in place).
  auto gradients_so_far = [&](const Node& node) {
    TensorList into(node.next_edges.size());
    for (size_t i = 0; i < into.size(); ++i) {
      const Edge& e = node.next_edges[i];
      if (!e.node) continue;
      auto it = buffers.find(e.node.get());
      if (it == buffers.end() || it->second.grads.size() <= size_t(e.input_nr)) continue;
      const Tensor& slot = it->second.grads[size_t(e.input_nr)];
      const OutputMeta& m = e.node->outputs[size_t(e.input_nr)];
      const bool alone = slot.defined() && slot.impl_ptr().use_count() == 1 && slot.storage().use_count() == 1;
      const bool fits = slot.is_contiguous() && slot.shape() == m.shape && slot.dtype() == m.dtype;
      if (alone && fits && slot.device() == m.device) into[i] = slot;
    }
    return into;
  };

  std::vector<Node*> stack;
  for (size_t i = 0; i < roots.size(); ++i) {
    LOOM_CHECK(roots[i].requires_grad(),
               "backward() on a tensor that does not require a gradient: nothing it depends on has "
               "requires_grad set (or it was computed under NoGradGuard)");
    Edge e = gradient_edge(roots[i]);
    if (!keep.count(e.node.get())) {
      keep[e.node.get()] = e.node;
      stack.push_back(e.node.get());
    }
    add_grad(e, grads[i]);
  }
  // Count, for every reachable node, how many edges lead into it.
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges) {
      if (!e.node) continue;
      dependencies[e.node.get()]++;
      if (keep.emplace(e.node.get(), e.node).second) stack.push_back(e.node.get());
    }
  }

  auto later_first = [](Node* a, Node* b) { return a->sequence_nr < b->sequence_nr; };
  std::priority_queue<Node*, std::vector<Node*>, decltype(later_first)> ready(later_first);
  for (auto& [n, _] : keep)
    if (dependencies[n] == 0) ready.push(n);

  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    TensorList grads_in = std::move(buffers[node].grads);
    buffers.erase(node);
    grads_in.resize(node->outputs.size());
    for (size_t i = 0; i < grads_in.size(); ++i) {
      if (!grads_in[i].defined()) {
        const OutputMeta& m = node->outputs[i];
        grads_in[i] = zeros(m.shape, m.dtype, m.device);
      }
    }
    if (node->leaf) {
      accumulate(*node, grads_in[0]);
      continue;
    }
    TensorList grads_out =
        node->backward_into ? node->backward_into(grads_in, gradients_so_far(*node)) : node->backward(grads_in);
    LOOM_ASSERT(grads_out.size() == node->next_edges.size(), node->name, " returned ", grads_out.size(),
                " gradients for ", node->next_edges.size(), " inputs");
    for (size_t i = 0; i < grads_out.size(); ++i) {
      const Edge& e = node->next_edges[i];
      if (!e.node) continue;
      if (grads_out[i].defined()) add_grad(e, grads_out[i]);
      if (--dependencies[e.node.get()] == 0) ready.push(e.node.get());
    }
  }
  // By index: a callback may queue another, which reallocates the list.
  for (size_t i = 0; i < callbacks.size(); ++i) {
    std::function<void()> callback = std::move(callbacks[i]);
    callback();
  }
}

}  // namespace loom
