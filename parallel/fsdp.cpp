// FullyShardedDataParallel: units and shards (fsdp.h, steps 1-2), gathering on first use
// (step 3), releasing (step 4), reduce-scattering gradients (step 5), the shards' optimizer
// support (step 6), mixed precision (step 7), HSDP's replicas (step 8) and full state dicts. rows_on(r) below is
// shard_rows(rows, W, r).count, kept per parameter with its chunk size.
#include "parallel/fsdp.h"

#include <algorithm>
#include <deque>
#include <exception>
#include <functional>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "engine/autograd.h"
#include "engine/op_boundary.h"
#include "engine/ops.h"
#include "layers/optim/clip.h"
#include "parallel/device_mesh.h"
#include "parallel/fsdp_units.h"
#include "parallel/sync_tensors.h"
#include "parallel/trace.h"

namespace loom::dist {

namespace {

enum class Phase { idle, forward, backward };

// One parameter and its shard. The full parameter is seen as (rows, row_numel).
struct ShardedParam {
  std::string name;
  Tensor full;   // the module's parameter; its storage is released between uses
  Tensor shard;  // (rows_on(rank), ...): the leaf the optimizer steps on
  int64_t rows = 0, chunk_rows = 0, row_numel = 0;
  int64_t offset = 0;  // of this parameter's padded shard in the unit's flat buffer (elements)

  int64_t rows_on(int rank) const { return std::clamp<int64_t>(rows - rank * chunk_rows, 0, chunk_rows); }
  // Rows [r c, r c + rows_on(r)) of a full tensor laid out like this parameter.
  Tensor rows_of(const Tensor& full_like, int rank) const {
    return full_like.reshape({rows, row_numel}).slice(0, rank * chunk_rows, rank * chunk_rows + rows_on(rank));
  }
  // Rank r's rows of this parameter in one rank's flat shard...
  Tensor in_shard(const Tensor& flat, int rank) const { return segment(flat, offset, rows_on(rank)); }
  // ... and in a gathered buffer of W flat shards of `unit_numel` elements each.
  Tensor in_gathered(const Tensor& buffer, int rank, int64_t unit_numel) const {
    return segment(buffer, rank * unit_numel + offset, rows_on(rank));
  }
  Tensor segment(const Tensor& buffer, int64_t start, int64_t n_rows) const {
    return buffer.slice(0, start, start + n_rows * row_numel).view({n_rows, row_numel});
  }
};

struct Unit {
  std::string name;
  std::vector<ShardedParam> params;
  int64_t flat_numel = 0;  // S: elements of one rank's flat shard
  DType dtype = DType::f32;          // of the shards (the master weights)
  DType compute_dtype = DType::f32;  // of the full parameters and the gathers (step 7)
  DType reduce_dtype = DType::f32;   // of the reduce-scatters
  Device device = Device::cpu();
  size_t full_bytes = 0;
  bool gathered = false;
  bool padded = false;    // some rank's flat shard ends a parameter's rows with padding
  int trainable = 0;      // parameters that require a gradient
  int grads_pending = 0;  // of those, how many have not had their gradient this backward
};

// A prefetched all_gather in flight: `gathered` receives every rank's flat shard of `unit`.
struct PendingGather {
  size_t unit;
  Tensor gathered;
  WorkPtr work;
};

// A reduce-scatter in flight: its output holds this rank's averaged rows of `unit`.
struct PendingReduction {
  size_t unit;
  Tensor output, input;
  WorkPtr work;
};

// into[i] = from[i] for every pair: the pairs of one floating dtype, contiguous on both sides,
// in one copy_many_ (one launch on CUDA), the others (casts) one copy_ each.
void copy_all(const TensorList& into, const TensorList& from) {
  TensorList many_into, many_from;
  for (size_t i = 0; i < into.size(); ++i) {
    const bool batched = into[i].dtype() == from[i].dtype() && into[i].dtype() == into.front().dtype() &&
                         is_floating(into[i].dtype()) && into[i].is_contiguous() && from[i].is_contiguous();
    if (batched) {
      many_into.push_back(into[i]);
      many_from.push_back(from[i]);
    } else {
      copy_(into[i], from[i]);
    }
  }
  copy_many_(many_into, many_from);
}

}  // namespace

RowRange shard_rows(int64_t rows, int world, int rank) {
  const int64_t chunk = (rows + world - 1) / world;
  return {rank * chunk, std::clamp<int64_t>(rows - rank * chunk, 0, chunk)};
}

struct FSDPState {
  std::shared_ptr<ProcessGroup> group;      // the shard group
  std::shared_ptr<ProcessGroup> replicas;  // HSDP's replicate group, or null (step 8)
  FSDPOptions options;
  TensorList float_buffers, other_buffers;  // the module's, for options.average_buffers
  std::vector<Unit> units;  // the root unit last
  Phase phase = Phase::idle;
  bool sync_gradients = true;
  bool callback_queued = false;
  // Forwards run with gradients on whose backward has not run yet: a pipeline's stage runs
  // several micro-batches' forwards before their backwards (fsdp.h, step 9).
  int backwards_due = 0;
  std::deque<size_t> held;  // gathered units, earliest first
  std::vector<PendingReduction> reductions;
  FSDPMemory memory;
  // Prefetch (step 3): the units in the order the first step gathered them, in its forward
  // and in its backward; the units gathered so far in this pass; the one all_gather issued
  // ahead of its unit's first read.
  std::vector<size_t> forward_order, backward_order;
  bool forward_known = false, backward_known = false;
  std::vector<bool> gathered_in_pass;
  std::optional<PendingGather> prefetched;
  // A prefetch asked for in a training pass, waiting for the op that gathered its unit to end
  // (prefetch_at_op_end): that unit, and the pass.
  std::optional<size_t> prefetch_pending;
  Phase pending_phase = Phase::idle;
  bool boundary_asked = false;
  // This forward runs with gradients on, so its ops that record a node mark their ends.
  bool forward_marks_ends = false;
  std::weak_ptr<FSDPState> self;  // for the op-boundary callback, which may outlive the state

  int rank() const { return group->rank(); }
  int world() const { return group->size(); }

  // Tracing (parallel/trace.h): each collective's span runs from its issue until it is first
  // seen complete, as DDP's all-reduces do: polled at every gather and gradient, waited for at
  // the end of backward and of a forward without one. Over Gloo a collective runs when issued,
  // so its span is its exact duration.
  struct Traced {
    std::string name;
    trace::Category category;
    int64_t start_ns;
    WorkPtr work;
    int64_t bytes;
  };
  std::vector<Traced> traced;
  void trace_issued(std::string name, trace::Category category, int64_t start_ns, const WorkPtr& work,
                    int64_t bytes) {
    traced.push_back({std::move(name), category, start_ns, work, bytes});
    trace_completed(false);
  }
  void trace_completed(bool wait) {
    for (auto it = traced.begin(); it != traced.end();) {
      if (wait)
        while (!it->work->is_completed()) std::this_thread::yield();
      else if (!it->work->is_completed()) {
        ++it;
        continue;
      }
      trace::record(it->name, it->category, it->start_ns, trace::now_ns(), {.bytes = it->bytes});
      it = traced.erase(it);
    }
  }

  void release(size_t u) {
    Unit& unit = units[u];
    if (!unit.gathered) return;
    for (ShardedParam& p : unit.params) {
      p.full.storage()->release();
      p.full.impl()->cast_copy.reset();  // autocast's copy of the full values goes with them
    }
    unit.gathered = false;
    memory.full_parameter_bytes -= unit.full_bytes;
    held.erase(std::find(held.begin(), held.end(), u));
  }

  void release_all() {
    while (!held.empty()) release(held.front());
    drop_prefetch();
    prefetch_pending.reset();
  }

  // A prefetch that will not be used: its all_gather is waited for (so that the streams stay
  // ordered before its buffer goes back to the allocator) and its buffer dropped.
  void drop_prefetch() {
    if (!prefetched) return;
    prefetched->work->wait();
    memory.full_parameter_bytes -= units[prefetched->unit].full_bytes;
    prefetched.reset();
  }

  // Full units at once: the held ones and a prefetch in flight.
  size_t units_unsharded() const { return held.size() + (prefetched ? 1 : 0); }

  // Records u's first gather in this pass of the first step, and says whether this is u's
  // first gather in the pass.
  bool note_gather(size_t u) {
    std::vector<size_t>& order = phase == Phase::forward ? forward_order : backward_order;
    const bool known = phase == Phase::forward ? forward_known : backward_known;
    if (!known && std::find(order.begin(), order.end(), u) == order.end()) order.push_back(u);
    const bool first = !gathered_in_pass[u];
    gathered_in_pass[u] = true;
    return first;
  }

  // A new pass (forward, or the backward after it) starts.
  void begin_pass(Phase next) {
    phase = next;
    gathered_in_pass.assign(units.size(), false);
  }

  // Step 3's prefetch, asked for when unit u is first gathered in a pass. The op that made u
  // gather may still be reading the unit gathered before it (one kernel reads the token and
  // the position embeddings), so the prefetch waits for that op to end (engine/op_boundary.h):
  // in backward, where each node's end is one, and in a forward run with gradients on, where
  // an op's recording of its node is (ops whose inputs need no gradient record none, and the
  // prefetch then waits for the next op that does). Then, under ZeRO-3, every other unit is
  // released and the prefetch issued: u and the unit arriving are all that is unsharded (a
  // released unit read again is gathered again, on demand). A forward under NoGradGuard marks
  // no ends: its prefetch is issued at once, and the earliest unit goes when the prefetched
  // one is gathered.
  void ask_prefetch_after(size_t u) {
    if (!options.prefetch || !(phase == Phase::forward ? forward_known : backward_known)) return;
    if (phase == Phase::forward && !forward_marks_ends) {
      prefetch_after(u);
      return;
    }
    prefetch_pending = u;
    pending_phase = phase;
    ask_boundary();
  }
  void ask_boundary() {
    if (boundary_asked) return;
    boundary_asked = true;
    after_current_op([weak = self] {
      if (auto state = weak.lock()) state->prefetch_at_op_end();
    });
  }
  void prefetch_at_op_end() {
    boundary_asked = false;
    if (!prefetch_pending) return;
    const size_t u = *prefetch_pending;
    if (phase != pending_phase || !units[u].gathered) {  // the pass ended, or u went
      prefetch_pending.reset();
      return;
    }
    prefetch_pending.reset();
    // Nothing to prefetch (u is last, or the next is here or on its way): nothing goes either,
    // so that the units held stay as the first step recorded them.
    const std::optional<size_t> next = next_to_prefetch(u);
    if (!next) return;
    if (options.reshard_after_forward == ReshardAfterForward::yes) {
      const std::deque<size_t> others = held;
      for (size_t other : others)
        if (other != u) release(other);
    }
    prefetch(*next);
  }

  // The prefetch itself: the all_gather of the unit the first step gathered after u in the
  // same pass, issued without waiting, so that on a GPU it runs on the communication stream
  // while u computes. A unit gathered again in the same pass (a tied weight read by a later
  // layer) prefetches nothing.
  void prefetch_after(size_t u) {
    if (const std::optional<size_t> next = next_to_prefetch(u)) prefetch(*next);
  }
  // The unit to prefetch after u: the one after it in this pass's recorded order, unless it
  // is gathered or a prefetch is in flight already.
  std::optional<size_t> next_to_prefetch(size_t u) const {
    const bool forward = phase == Phase::forward;
    const std::vector<size_t>& order = forward ? forward_order : backward_order;
    if (!options.prefetch || !(forward ? forward_known : backward_known) || prefetched) return std::nullopt;
    auto pos = std::find(order.begin(), order.end(), u);
    if (pos == order.end() || pos + 1 == order.end()) return std::nullopt;
    const size_t v = *(pos + 1);
    if (units[v].gathered) return std::nullopt;
    return v;
  }
  void prefetch(size_t v) {
    NoGradGuard no_grad;
    WorkPtr work;
    Tensor gathered = issue_gather(units[v], units[v].compute_dtype, &work, true);
    prefetched = PendingGather{v, gathered, work};
    memory.full_parameter_bytes += units[v].full_bytes;
    memory.peak_full_parameter_bytes = std::max(memory.peak_full_parameter_bytes, memory.full_parameter_bytes);
    ++memory.prefetches;
  }

  // Every rank's flat shard of `unit`, in `dtype`, one after the other (W S elements): the
  // all_gather is issued, and `work` says when its result is ready.
  // The all_gather runs in place: this rank's flat shard is written straight into its slice
  // of the gathered buffer.
  Tensor issue_gather(const Unit& unit, DType dtype, WorkPtr* work, bool prefetch = false) {
    Tensor gathered = Tensor::empty({world() * unit.flat_numel}, dtype, unit.device);
    Tensor flat = gathered.slice(0, rank() * unit.flat_numel, (rank() + 1) * unit.flat_numel);
    TensorList into, from;
    for (const ShardedParam& p : unit.params) {
      if (p.rows_on(rank()) == 0) continue;
      into.push_back(p.in_shard(flat, rank()));
      from.push_back(p.shard.reshape({p.rows_on(rank()), p.row_numel}));
    }
    copy_all(into, from);
    const int64_t start = trace::enabled() ? trace::now_ns() : -1;
    *work = group->all_gather(gathered, flat);
    ++memory.gathers;
    if (start >= 0)
      trace_issued("all_gather " + unit.name + (prefetch ? " (prefetch)" : ""), trace::Category::allgather, start,
                   *work, int64_t(gathered.nbytes()));
    return gathered;
  }
  Tensor gather_flat(const Unit& unit, DType dtype) {
    WorkPtr work;
    Tensor gathered = issue_gather(unit, dtype, &work);
    work->wait();
    return gathered;
  }

  // fsdp.h, step 3: one all_gather of the flat shards, then the rows copied out.
  void gather(size_t u) {
    Unit& unit = units[u];
    LOOM_CHECK(phase != Phase::idle, "FSDP: the parameters of unit '", unit.name, "' (", unit.params.front().name,
               ", ...) were read outside a step; their full values exist only inside fsdp.forward()/call() and "
               "the backward that follows (read full_state_dict() instead)");
    const bool first_in_pass = note_gather(u);
    NoGradGuard no_grad;
    Tensor gathered;
    // fsdp.h, step 4: ZeRO-3 holds at most two units, so the earliest goes first.
    if (options.reshard_after_forward == ReshardAfterForward::yes)
      while (held.size() >= 2) release(held.front());
    if (prefetched && prefetched->unit == u) {
      prefetched->work->wait();  // on a GPU: the compute stream waits, not the host
      gathered = prefetched->gathered;
      prefetched.reset();  // its bytes were counted when it was issued
    } else {
      drop_prefetch();  // the order changed: this step reads another unit first
      gathered = gather_flat(unit, unit.compute_dtype);
      memory.full_parameter_bytes += unit.full_bytes;
    }
    TensorList into, from;
    for (ShardedParam& p : unit.params) {
      p.full.storage()->acquire();
      for (int r = 0; r < world(); ++r) {
        if (p.rows_on(r) == 0) continue;
        into.push_back(p.rows_of(p.full.detach(), r));
        from.push_back(p.in_gathered(gathered, r, unit.flat_numel));
      }
    }
    copy_all(into, from);
    unit.gathered = true;
    memory.peak_full_parameter_bytes = std::max(memory.peak_full_parameter_bytes, memory.full_parameter_bytes);
    held.push_back(u);
    if (first_in_pass) ask_prefetch_after(u);
    if (!traced.empty()) trace_completed(false);
  }

  // fsdp.h, step 5: the last gradient of unit u has been accumulated.
  void end_unit_backward(size_t u) {
    Unit& unit = units[u];
    if (sync_gradients) {
      NoGradGuard no_grad;
      // Every element is written below unless the unit has padding or a parameter without a
      // gradient: only then does the input start from zeros.
      bool covered = !unit.padded;
      for (ShardedParam& p : unit.params) covered = covered && p.full.grad().defined();
      const Shape shape{world() * unit.flat_numel};
      Tensor input = covered ? Tensor::empty(shape, unit.reduce_dtype, unit.device)
                             : zeros(shape, unit.reduce_dtype, unit.device);
      TensorList into, from;
      for (ShardedParam& p : unit.params) {
        Tensor g = p.full.grad();
        if (!g.defined()) continue;
        for (int r = 0; r < world(); ++r) {
          if (p.rows_on(r) == 0) continue;
          into.push_back(p.in_gathered(input, r, unit.flat_numel));
          from.push_back(p.rows_of(g, r));
        }
      }
      copy_all(into, from);
      for (ShardedParam& p : unit.params) p.full.zero_grad();
      // A group of one reduces in place (its output is all of the input, kept anyway); a larger
      // group writes a buffer of its own, so the shard gradients do not hold the whole input.
      Tensor output = world() == 1 ? input : Tensor::empty({unit.flat_numel}, unit.reduce_dtype, unit.device);
      const int64_t start = trace::enabled() ? trace::now_ns() : -1;
      WorkPtr work = group->reduce_scatter(output, input, ReduceOp::avg);
      ++memory.reduce_scatters;
      if (start >= 0)
        trace_issued("reduce_scatter " + unit.name, trace::Category::reduce_scatter, start, work,
                     int64_t(input.nbytes()));
      reductions.push_back({u, output, input, work});
    }
    release(u);
  }

  // fsdp.h, step 5: the end of backward (and step 8: the replicas' average of each shard).
  void finish_backward() {
    callback_queued = false;
    for (PendingReduction& r : reductions) {
      r.work->wait();
      if (!replicas) continue;
      const int64_t start = trace::enabled() ? trace::now_ns() : -1;
      r.work = replicas->all_reduce(r.output, ReduceOp::avg);
      if (start >= 0)
        trace_issued("all_reduce " + units[r.unit].name + " (replicas)", trace::Category::allreduce, start, r.work,
                     int64_t(r.output.nbytes()));
    }
    for (PendingReduction& r : reductions) {
      if (replicas) r.work->wait();
      for (ShardedParam& p : units[r.unit].params) {
        if (!p.shard.requires_grad()) continue;
        // A view of the reduce-scatter's output (one buffer of the unit's S elements, which
        // the unit's shard gradients share, as DDP's gradients share a bucket), or its cast.
        Tensor g = p.in_shard(r.output, rank()).view(p.shard.shape()).to(p.shard.dtype());
        if (p.shard.grad().defined()) add_(p.shard.grad(), g);
        else p.shard.set_grad(g);
      }
    }
    reductions.clear();
    // Buffers averaged over every rank: along the shard group, then the replicas.
    if (options.average_buffers && sync_gradients) {
      for (ProcessGroup* g : {group.get(), replicas.get()}) {
        if (!g) continue;
        sync_tensors(*g, float_buffers, SyncOp::average);
        sync_tensors(*g, other_buffers, SyncOp::broadcast_from_rank0);
      }
    }
    // A unit still waiting for gradients names its parameters that have none.
    std::string unused;
    for (Unit& unit : units) {
      if (unit.grads_pending == 0) continue;
      for (ShardedParam& p : unit.params)
        if (p.full.requires_grad() && !p.full.grad().defined()) unused += (unused.empty() ? "" : ", ") + p.name;
    }
    release_all();
    if (!traced.empty()) trace_completed(true);
    // Another micro-batch's backward still to come reads its weights again, and counts its
    // gradients afresh. A synchronised backward is the last of its step: none is due after it
    // (a forward whose backward never ran is forgotten here).
    backwards_due = sync_gradients ? 0 : std::max(0, backwards_due - 1);
    if (backwards_due > 0) {
      begin_pass(Phase::backward);
      for (Unit& unit : units) unit.grads_pending = unit.trainable;
    } else {
      phase = Phase::idle;
    }
    backward_known = forward_known;  // the first step's backward has been recorded
    LOOM_CHECK(unused.empty(), "FSDP: parameters that did not receive a gradient in this backward: ", unused,
               ". Every unit's gradients are reduced once all of them have arrived; freeze parameters a step does "
               "not use with set_requires_grad(false) before wrapping");
  }

  static void on_gradient(const std::shared_ptr<FSDPState>& self, size_t u) {
    self->count_gradient(self, u);
  }
  void count_gradient(const std::shared_ptr<FSDPState>& self, size_t u) {
    if (phase == Phase::idle) return;
    if (phase != Phase::backward) begin_pass(Phase::backward);
    if (!callback_queued) {
      callback_queued = true;
      queue_callback([self] { self->finish_backward(); });
    }
    if (--units[u].grads_pending == 0) end_unit_backward(u);
    if (!traced.empty()) trace_completed(false);
  }

  void begin_forward() {
    // A forward not followed by backward left units gathered; but under ZeRO-2 the units a
    // backward still due will read stay (a pipeline's next micro-batch runs its forward first).
    if (backwards_due > 0 && options.reshard_after_forward == ReshardAfterForward::no) drop_prefetch();
    else release_all();
    reductions.clear();
    callback_queued = false;  // a backward that failed never ran its end
    for (Unit& unit : units) unit.grads_pending = unit.trainable;
    begin_pass(Phase::forward);
    forward_marks_ends = grad_enabled();
  }
};

namespace {

// The sizes of a parameter as (rows, row_numel) and its shard's rows per rank.
ShardedParam describe(const std::string& name, const Tensor& p, int world) {
  ShardedParam sp;
  sp.name = name;
  sp.full = p;
  sp.rows = p.dim() == 0 ? 1 : p.size(0);
  sp.row_numel = sp.rows == 0 ? 0 : p.numel() / sp.rows;
  sp.chunk_rows = (sp.rows + world - 1) / world;
  return sp;
}

// Checks that every rank of `group` wraps the same model (a count and a size sum compared),
// then gives them all the values of the group's rank 0.
void start_equal(nn::Module& module, ProcessGroup& group, Device device, const char* which) {
  const nn::NamedTensors all = module.named_parameters();
  int64_t numel = 0;
  for (const auto& [_, t] : all) numel += t.numel();
  const int world = group.size();
  Tensor mine = from_vector(std::vector<int64_t>{int64_t(all.size()), numel}, {2}).to(device);
  Tensor every = Tensor::empty({2 * world}, DType::i64, device);
  group.all_gather(every, mine)->wait();
  std::vector<int64_t> counts = every.to_vector<int64_t>();
  for (int r = 1; r < world; ++r)
    LOOM_CHECK(counts[2 * r] == counts[0] && counts[2 * r + 1] == counts[1], "FSDP: rank ", r, which,
               " has a model of ", counts[2 * r], " parameters (", counts[2 * r + 1], " elements), rank 0 one of ",
               counts[0], " (", counts[1], "): every rank must wrap the same model");
  for (const auto& [_, t] : all) group.broadcast(t, 0)->wait();
  for (auto& [_, b] : module.named_buffers()) group.broadcast(b, 0)->wait();
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<nn::Module> module,
                                                   std::shared_ptr<ProcessGroup> group, FSDPOptions options)
    : module_(std::move(module)),
      group_(std::move(group)),
      replicate_group_(options.replicate_group),
      state_(std::make_shared<FSDPState>()) {
  LOOM_CHECK(module_ && group_, "FullyShardedDataParallel needs a module and a process group");
  state_->group = group_;
  state_->self = state_;
  state_->replicas = options.replicate_group;
  state_->options = options;
  NoGradGuard no_grad;
  const int world = group_->size(), rank = group_->rank();

  // Step 1: the same model everywhere, then rank 0's values (step 8: along both groups).
  nn::NamedTensors all = module_->named_parameters();
  const Device device = all.empty() ? Device::cpu() : all.front().second.device();
  for (auto& [name, t] : all) {
    LOOM_CHECK(t.device() == device, "FSDP: parameter ", name, " is on ", t.device().str(), ", the first on ",
               device.str(), ": move the module to one device before wrapping");
    LOOM_CHECK(t.is_contiguous(), "FSDP: parameter ", name, " is not row-major (laid out channels-last by ",
               "Module::to(MemoryFormat)?): FSDP shards row-major parameters, so leave the module's ",
               "parameters row-major (a channels-last batch still runs as it lies)");
    LOOM_CHECK(t.offset() == 0 && t.storage()->nbytes() == t.nbytes(), "FSDP: parameter ", name,
               " does not own its storage (a view of a larger tensor); its storage is released between uses");
  }
  start_equal(*module_, *group_, device, "");
  for (auto& [_, b] : module_->named_buffers())
    (is_floating(b.dtype()) ? state_->float_buffers : state_->other_buffers).push_back(b);
  if (state_->replicas) start_equal(*module_, *state_->replicas, device, " of the replicate group");

  // Step 2: shards and flat layouts; the full storages released.
  for (auto& [unit_name, params] : assign_fsdp_units(*module_, options)) {
    Unit unit;
    unit.name = unit_name.empty() ? "(root)" : unit_name;
    unit.dtype = params.front().second.dtype();
    unit.compute_dtype = options.param_dtype.value_or(unit.dtype);
    unit.reduce_dtype = options.reduce_dtype.value_or(unit.dtype);
    LOOM_CHECK(is_floating(unit.compute_dtype) && is_floating(unit.reduce_dtype),
               "FSDP: param_dtype and reduce_dtype must be floating-point dtypes");
    unit.device = device;
    for (auto& [name, t] : params) {
      LOOM_CHECK(t.dtype() == unit.dtype, "FSDP: unit '", unit.name, "' mixes ", dtype_name(unit.dtype), " and ",
                 dtype_name(t.dtype()), " (", name, "); a unit is gathered through one flat buffer of one dtype");
      ShardedParam p = describe(name, t, world);
      p.offset = unit.flat_numel;
      unit.flat_numel += p.chunk_rows * p.row_numel;
      if (p.rows != world * p.chunk_rows) unit.padded = true;
      Shape shard_shape = t.dim() == 0 ? Shape{p.rows_on(rank)} : t.shape();
      shard_shape[0] = p.rows_on(rank);
      p.shard = p.rows_of(t, rank).contiguous().clone().reshape(shard_shape);
      if (t.requires_grad()) {
        p.shard.set_requires_grad(true);
        ++unit.trainable;
      }
      // Step 7: the module computes in compute_dtype; these bytes are released below.
      if (t.dtype() != unit.compute_dtype) t.set_data(Tensor::empty(t.shape(), unit.compute_dtype, device));
      unit.full_bytes += t.nbytes();
      state_->memory.shard_parameter_bytes += p.shard.nbytes();
      unit.params.push_back(std::move(p));
    }
    state_->units.push_back(std::move(unit));
  }
  std::weak_ptr<FSDPState> weak = state_;
  for (size_t u = 0; u < state_->units.size(); ++u)
    for (ShardedParam& p : state_->units[u].params) {
      p.full.storage()->release();
      p.full.storage()->set_acquire_hook([weak, u] {
        auto state = weak.lock();
        LOOM_CHECK(state != nullptr, "FSDP: a parameter of a model whose FullyShardedDataParallel was destroyed was "
                   "read; its full values are gone (load a full state dict into a fresh model)");
        state->gather(u);
      });
      if (p.full.requires_grad())
        p.full.register_post_accumulate_grad_hook([weak, u](Tensor&) {
          if (auto state = weak.lock()) FSDPState::on_gradient(state, u);
        });
    }
}

FullyShardedDataParallel::~FullyShardedDataParallel() = default;

FullyShardedDataParallel::ForwardScope::ForwardScope(FullyShardedDataParallel& fsdp) : fsdp_(fsdp) {
  fsdp_.state_->begin_forward();
}

FullyShardedDataParallel::ForwardScope::~ForwardScope() noexcept(false) {
  FSDPState& state = *fsdp_.state_;
  state.forward_known = true;  // the first forward has shown the order of its gathers
  const bool trains = std::any_of(state.units.begin(), state.units.end(), [](const Unit& u) { return u.trainable > 0; });
  if (grad_enabled()) {
    // What reads weights from now on is the backward (none comes for a forward that failed).
    state.begin_pass(Phase::backward);
    if (trains) {
      if (std::uncaught_exceptions() == 0) ++state.backwards_due;
      return;
    }
    // Nothing trains (every parameter frozen): no gradient hook would end a backward, so none
    // is owed and the units go now, as after an evaluation. A backward that still runs
    // through them (to an input that requires a gradient) gathers what it reads again.
  } else {
    // Without a backward to come, nothing releases the units: do it here. A backward of an
    // earlier forward may still be due (an evaluation between a pipeline's micro-batches): it
    // gathers what it reads again.
    if (state.backwards_due > 0) state.begin_pass(Phase::backward);
    else state.phase = Phase::idle;
  }
  // Waiting for a prefetch can fail (a collective that timed out); while a failed forward
  // unwinds, its own error is the one reported.
  if (std::uncaught_exceptions() > 0) {
    try {
      state.release_all();
    } catch (...) {
    }
  } else {
    state.release_all();
    if (!state.traced.empty()) state.trace_completed(true);
  }
}

Tensor FullyShardedDataParallel::forward(const Tensor& input) {
  return call([&] { return module_->forward(input); });
}

FullyShardedDataParallel::NoSync::NoSync(FullyShardedDataParallel& fsdp)
    : fsdp_(fsdp), previous_(fsdp.state_->sync_gradients) {
  fsdp_.state_->sync_gradients = false;
}

FullyShardedDataParallel::NoSync::~NoSync() { fsdp_.state_->sync_gradients = previous_; }

void FullyShardedDataParallel::set_gradient_sync(bool on) { state_->sync_gradients = on; }

TensorList FullyShardedDataParallel::parameters() const {
  TensorList out;
  for (const auto& [_, t] : named_parameters()) out.push_back(t);
  return out;
}

nn::NamedTensors FullyShardedDataParallel::named_parameters() const {
  // In the module's order, whatever the units' order.
  std::unordered_map<const TensorImpl*, const ShardedParam*> by_full;
  for (const Unit& unit : state_->units)
    for (const ShardedParam& p : unit.params) by_full.emplace(p.full.impl(), &p);
  nn::NamedTensors out;
  for (const auto& [name, t] : module_->named_parameters()) out.emplace_back(name, by_full.at(t.impl())->shard);
  return out;
}

std::vector<size_t> FullyShardedDataParallel::unit_bytes() const {
  std::vector<size_t> out;
  for (const Unit& unit : state_->units) out.push_back(unit.full_bytes);
  return out;
}

const FSDPOptions& FullyShardedDataParallel::options() const { return state_->options; }

Tensor FullyShardedDataParallel::shard_of(const Tensor& parameter) const {
  for (const Unit& unit : state_->units)
    for (const ShardedParam& p : unit.params)
      if (p.full.impl() == parameter.impl()) return p.shard;
  LOOM_FAIL("FSDP: shard_of was given a tensor of shape ", shape_str(parameter.shape()),
            " that is not a parameter of the wrapped module");
}

void FullyShardedDataParallel::zero_grad() {
  for (Tensor& t : parameters()) t.zero_grad();
  // And the full gradients that backwards without synchronisation kept (a step that stopped
  // before its synchronised backward).
  for (Unit& unit : state_->units)
    for (ShardedParam& p : unit.params) p.full.zero_grad();
}

double FullyShardedDataParallel::clip_grad_norm_(double max_norm) {
  LOOM_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm must not be negative, got ", max_norm);
  const Device device = state_->units.empty() ? Device::cpu() : state_->units.front().device;
  const TensorList shards = parameters();
  Tensor total = optim::grad_squared_sum(shards, device);
  group_->all_reduce(total, ReduceOp::sum)->wait();
  const Tensor norm = sqrt(total);
  optim::scale_grads_to_norm(shards, norm, max_norm);
  return norm.item();
}

nn::NamedTensors FullyShardedDataParallel::full_state_dict() {
  LOOM_CHECK(state_->phase == Phase::idle, "FSDP: full_state_dict() inside a step; call it between steps");
  NoGradGuard no_grad;
  // The shards' values (the master weights under mixed precision), gathered unit by unit;
  // state_dict() detaches, so its parameters are found by their storage.
  std::unordered_map<const Storage*, Tensor> full;
  for (const Unit& unit : state_->units) {
    Tensor gathered = state_->gather_flat(unit, unit.dtype);
    for (const ShardedParam& p : unit.params) {
      Tensor value = Tensor::empty(p.full.shape(), unit.dtype, unit.device);
      for (int r = 0; r < group_->size(); ++r)
        if (p.rows_on(r) > 0) copy_(p.rows_of(value, r), p.in_gathered(gathered, r, unit.flat_numel));
      full.emplace(p.full.storage().get(), value);
    }
  }
  nn::NamedTensors out;
  for (auto& [name, t] : module_->state_dict()) {
    auto it = full.find(t.storage().get());
    out.emplace_back(name, it == full.end() ? t.clone() : it->second);
  }
  return out;
}

void FullyShardedDataParallel::load_full_state_dict(const nn::NamedTensors& state) {
  NoGradGuard no_grad;
  std::unordered_map<std::string, Tensor> by_name(state.begin(), state.end());
  for (Unit& unit : state_->units)
    for (ShardedParam& p : unit.params) {
      auto it = by_name.find(p.name);
      LOOM_CHECK(it != by_name.end(), "FSDP: load_full_state_dict: ", p.name, " is missing from the state dict");
      LOOM_CHECK(it->second.shape() == p.full.shape(), "FSDP: load_full_state_dict: ", p.name, " has shape ",
                 shape_str(it->second.shape()), " in the state dict but ", shape_str(p.full.shape()), " in the model");
      if (p.rows_on(group_->rank()) > 0)
        copy_(p.shard, p.rows_of(it->second.to(p.shard.device()), group_->rank()).reshape(p.shard.shape()));
    }
  for (auto& [name, b] : module_->named_buffers()) {
    auto it = by_name.find(name);
    LOOM_CHECK(it != by_name.end(), "FSDP: load_full_state_dict: buffer ", name, " is missing from the state dict");
    copy_(b, it->second);
  }
}

std::vector<std::vector<std::string>> FullyShardedDataParallel::unit_assignment() const {
  std::vector<std::vector<std::string>> out;
  for (const Unit& unit : state_->units) {
    out.emplace_back();
    for (const ShardedParam& p : unit.params) out.back().push_back(p.name);
  }
  return out;
}

std::vector<std::string> FullyShardedDataParallel::unit_names() const {
  std::vector<std::string> out;
  for (const Unit& unit : state_->units) out.push_back(unit.name == "(root)" ? "" : unit.name);
  return out;
}

FSDPMemory FullyShardedDataParallel::memory() const { return state_->memory; }

void FullyShardedDataParallel::reset_peak_memory() {
  state_->memory.peak_full_parameter_bytes = state_->memory.full_parameter_bytes;
}

std::unique_ptr<FullyShardedDataParallel> fully_shard(std::shared_ptr<nn::Module> module,
                                                      std::shared_ptr<ProcessGroup> group, FSDPOptions options) {
  return std::make_unique<FullyShardedDataParallel>(std::move(module), std::move(group), std::move(options));
}

std::unique_ptr<FullyShardedDataParallel> hybrid_shard(std::shared_ptr<nn::Module> module, const DeviceMesh& mesh,
                                                       FSDPOptions options) {
  LOOM_CHECK(mesh.ndim() == 2, "hybrid_shard: the mesh has ", mesh.ndim(),
             " dimensions; HSDP takes two, \"replicate\" and \"shard\"");
  options.replicate_group = mesh.group("replicate");
  return std::make_unique<FullyShardedDataParallel>(std::move(module), mesh.group("shard"), std::move(options));
}

}  // namespace loom::dist
