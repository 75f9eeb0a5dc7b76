// The memory plan (see memory_plan.h): sums over the model's tensors, and a probe forward.
#include "parallel/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <sstream>

#include "engine/allocator.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "parallel/ddp.h"
#include "parallel/fsdp.h"
#include "parallel/pipeline.h"

namespace loom::dist {

namespace {

std::string megabytes(size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f MB", double(bytes) / 1e6);
  return text;
}

// The trainable parameters' bytes and all parameters' bytes, each tensor once (a tied one
// is one tensor).
std::pair<size_t, size_t> parameter_bytes(const nn::Module& model) {
  std::set<const TensorImpl*> seen;
  size_t trained = 0, all = 0;
  for (const Tensor& p : model.parameters()) {
    if (!seen.insert(p.impl()).second) continue;
    all += p.nbytes();
    if (p.requires_grad()) trained += p.nbytes();
  }
  return {trained, all};
}

}  // namespace

std::string MemoryPlan::table(std::optional<size_t> measured_peak) const {
  std::ostringstream out;
  out << "memory plan per rank (" << strategy << "):";
  auto line = [&](const char* name, size_t bytes, bool always) {
    if (bytes > 0 || always) out << "\n  " << name << std::string(14 - std::string(name).size(), ' ') << megabytes(bytes);
  };
  line("parameters", parameters, true);
  line("gradients", gradients, true);
  line("optimizer", optimizer_state, true);
  line("buckets", buckets, false);
  line("gathered", gathered, false);
  line("activations", activations, true);
  line("total", total(), true);
  if (measured_peak) {
    char ratio[64];
    std::snprintf(ratio, sizeof ratio, " (%.0f%% of the plan)", total() ? 100.0 * double(*measured_peak) / double(total()) : 0.0);
    out << "\n  measured peak " << megabytes(*measured_peak) << ratio;
  }
  return out.str();
}

std::string MemoryPlan::measured_line(Device device, size_t allocated_before, int64_t steps) const {
  const size_t now = memory::stats(device).peak_allocated;
  const size_t peak = now > allocated_before ? now - allocated_before : 0;
  char text[160];
  std::snprintf(text, sizeof text, "memory after %lld steps: peak %.3f MB on this rank, %.0f%% of the plan's %.3f MB",
                (long long)steps, double(peak) / 1e6, total() ? 100.0 * double(peak) / double(total()) : 0.0,
                double(total()) / 1e6);
  return text;
}

size_t activation_bytes(nn::Module& module, Device device, int64_t rows,
                        const std::function<Tensor(int64_t rows)>& forward) {
  LOOM_CHECK(rows >= 1, "activation_bytes: ", rows, " rows; expected 1 or more");
  // What the probe could change: the buffers (a BatchNorm's running statistics and counter),
  // the generator (dropout) and the parameters' gradients.
  nn::NamedTensors buffers = module.named_buffers();
  TensorList params = module.parameters();
  std::vector<Tensor> kept_buffers, kept_grads;  // the gradients themselves: views stay views
  {
    NoGradGuard no_grad;
    for (const auto& [_, b] : buffers) kept_buffers.push_back(b.clone());
    for (const Tensor& p : params) kept_grads.push_back(p.grad());
  }
  const auto [seed, offset] = rng_state();
  // The most the step held beyond what it started with and the gradients it made.
  auto step_peak = [&](int64_t r) {
    for (Tensor& p : params) p.zero_grad();
    synchronize(device);
    const size_t before = memory::stats(device).allocated;
    memory::reset_peak(device);
    {
      Tensor loss = forward(r);
      LOOM_CHECK(loss.numel() == 1, "activation_bytes: the probe returned ", shape_str(loss.shape()),
                 "; expected a scalar to run backward from");
      loss.backward();
    }
    synchronize(device);
    const size_t peak = memory::stats(device).peak_allocated;
    size_t grads = 0;
    std::set<const TensorImpl*> seen;
    for (const Tensor& p : params)
      if (p.grad().defined() && seen.insert(p.impl()).second) grads += p.grad().nbytes();
    return peak > before + grads ? peak - before - grads : 0;
  };
  // Put back whether the probe returns or throws.
  struct Restore {
    std::function<void()> run;
    ~Restore() { run(); }
  } restore{[&] {
    set_rng_state(seed, offset);
    NoGradGuard no_grad;
    for (size_t i = 0; i < buffers.size(); ++i) copy_(buffers[i].second, kept_buffers[i]);
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].zero_grad();
      if (kept_grads[i].defined()) params[i].set_grad(kept_grads[i]);
      params[i].impl()->cast_copy.reset();  // autocast's weight copies made by the probe
    }
  }};
  const size_t one = step_peak(1);
  const size_t two = step_peak(2);
  const size_t per_row = two > one ? two - one : 0;
  return one + per_row * size_t(rows - 1);
}

MemoryPlan plan_replicated(const nn::Module& model, const optim::Optimizer& optimizer, size_t activations,
                           const DistributedDataParallel* ddp) {
  MemoryPlan plan;
  plan.strategy = ddp ? "DDP" : "plain";
  const auto [trained, all] = parameter_bytes(model);
  plan.parameters = all;
  plan.gradients = trained;
  plan.optimizer_state = optimizer.planned_state_bytes();
  if (ddp && !ddp->options().gradient_as_bucket_view) plan.buckets = trained;
  plan.activations = activations;
  return plan;
}

namespace {

// FSDP's full parameters held at once at most, and the largest unit's full gradients with
// the buffer they are reduce-scattered from (memory_plan.h).
// What a sharded model holds unsharded: the units gathered at once (every unit under ZeRO-2;
// under ZeRO-3 two, a prefetch included: fsdp.h, step 3), all units' bytes (what its full
// gradients take when they are kept over micro-batches), the largest unit's, and the buffer the largest unit's
// gradients are reduce-scattered from (in the reduce dtype, the parameters' own when unset).
struct Unsharded {
  size_t held = 0, all = 0, largest = 0, reduce_buffer = 0;
};

Unsharded unsharded_bytes(const FullyShardedDataParallel& fsdp) {
  const FSDPOptions& o = fsdp.options();
  const bool zero3 = o.reshard_after_forward == ReshardAfterForward::yes;
  std::vector<size_t> units = fsdp.unit_bytes();
  std::sort(units.rbegin(), units.rend());
  Unsharded out;
  for (size_t b : units) out.all += b;
  if (!zero3) {
    out.held = out.all;
  } else {
    const size_t at_once = std::min(units.size(), size_t(2));
    for (size_t i = 0; i < at_once; ++i) out.held += units[i];
  }
  out.largest = units.empty() ? 0 : units.front();
  const Tensor first = fsdp.parameters().empty() ? Tensor() : fsdp.parameters().front();
  const size_t param_size = first.defined() ? dtype_size(o.param_dtype.value_or(first.dtype())) : 1;
  const size_t reduce_size = first.defined() ? dtype_size(o.reduce_dtype.value_or(first.dtype())) : 1;
  out.reduce_buffer = out.largest / param_size * reduce_size;
  return out;
}

// A step of one sharded model: its gathered units, and the largest unit's full gradients
// beside its reduce buffer at the end of that unit's backward.
size_t gathered_bytes(const FullyShardedDataParallel& fsdp) {
  const Unsharded u = unsharded_bytes(fsdp);
  return u.held + u.largest + u.reduce_buffer;
}

// The shards' bytes and their gradients', each tensor once.
void add_shards(const FullyShardedDataParallel& fsdp, std::set<const TensorImpl*>& seen, MemoryPlan& plan) {
  for (const Tensor& s : fsdp.parameters()) {
    if (!seen.insert(s.impl()).second) continue;
    plan.parameters += s.nbytes();
    if (s.requires_grad()) plan.gradients += s.nbytes();
  }
}

}  // namespace

MemoryPlan plan_sharded(const FullyShardedDataParallel& fsdp, const optim::Optimizer& optimizer,
                        size_t activations) {
  MemoryPlan plan;
  const FSDPOptions& o = fsdp.options();
  plan.strategy = std::string("FSDP ") +
                  (o.reshard_after_forward == ReshardAfterForward::yes ? "ZeRO-3" : "ZeRO-2") + " over " +
                  std::to_string(fsdp.group().size()) + " ranks" +
                  (fsdp.replicate_group() ? " x " + std::to_string(fsdp.replicate_group()->size()) + " replicas" : "");
  std::set<const TensorImpl*> seen;
  add_shards(fsdp, seen, plan);
  plan.optimizer_state = optimizer.planned_state_bytes();
  plan.gathered = gathered_bytes(fsdp);
  plan.activations = activations;
  return plan;
}

MemoryPlan plan_pipeline(const pipeline::Pipeline& pipe, const optim::Optimizer& optimizer,
                         size_t microbatch_activations) {
  MemoryPlan plan;
  const pipeline::Schedule& schedule = pipe.schedule();
  std::string stages;
  for (const pipeline::Stage& s : pipe.stages()) stages += (stages.empty() ? "" : ", ") + std::to_string(s.index);
  const bool sharded = !pipe.stages().empty() && pipe.stages().front().sharded;
  plan.strategy = std::string("pipeline stage") + (pipe.stages().size() > 1 ? "s " : " ") + stages + " of " +
                  std::to_string(schedule.stages) + ", " + pipeline::schedule_name(schedule.kind) +
                  (sharded ? ", FSDP" : "");
  std::set<const TensorImpl*> seen;
  // Sharded stages: a stage whose backward is still due keeps what it gathered (ZeRO-3: up to
  // its two units; ZeRO-2: all of them) while the rank's other stages run, so each
  // stage's gathered units count; and every backward of a stage before its last in the step
  // keeps the stage's full gradients (fsdp.h, step 9), so with several micro-batches those of
  // all this rank's stages are held together until their last backwards reduce them.
  size_t held = 0, full_gradients = 0, largest = 0, reduce_buffer = 0;
  for (const pipeline::Stage& s : pipe.stages()) {
    if (s.sharded) {
      add_shards(*s.sharded, seen, plan);
      const Unsharded u = unsharded_bytes(*s.sharded);
      held += u.held;
      full_gradients += u.all;
      largest = std::max(largest, u.largest);
      reduce_buffer = std::max(reduce_buffer, u.reduce_buffer);
      continue;
    }
    for (const Tensor& p : s.module->parameters()) {
      if (!seen.insert(p.impl()).second) continue;
      plan.parameters += p.nbytes();
      if (p.requires_grad()) plan.gradients += p.nbytes();
    }
  }
  if (sharded) plan.gathered = held + (schedule.microbatches > 1 ? full_gradients : largest) + reduce_buffer;
  plan.optimizer_state = optimizer.planned_state_bytes();
  plan.activations = microbatch_activations * size_t(pipe.simulation().peak_in_flight[size_t(pipe.rank())]);
  return plan;
}

}  // namespace loom::dist
