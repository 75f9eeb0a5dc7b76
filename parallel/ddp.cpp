// DistributedDataParallel: the checks and broadcasts of construction, the buckets, the
// gradient hooks that launch the all-reduces, and the end-of-backward step that waits for
// them (ddp.h describes the algorithm). The Reducer holds the per-step state; the hooks
// reach it through a weak pointer.
#include "parallel/ddp.h"

#include <algorithm>
#include <bit>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "parallel/sync_tensors.h"
#include "parallel/trace.h"

namespace loom::dist {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// Whether `a` is the view `b` (same storage, same first element).
bool aliases(const Tensor& a, const Tensor& b) {
  return a.defined() && a.storage() == b.storage() && a.offset() == b.offset();
}

// FNV-1a over the parameters' count, shapes, dtypes and requires_grad: equal on two ranks
// when their models are built alike.
int64_t layout_checksum(const TensorList& params) {
  uint64_t h = 14695981039346656037ull;
  auto mix = [&h](int64_t v) {
    for (int byte = 0; byte < 8; ++byte) {
      h ^= (uint64_t(v) >> (8 * byte)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(int64_t(params.size()));
  for (const Tensor& p : params) {
    mix(p.dim());
    for (int64_t d : p.shape()) mix(d);
    mix(int64_t(p.dtype()));
    mix(p.requires_grad());
  }
  return std::bit_cast<int64_t>(h);
}

}  // namespace

// The per-step state of the gradient reduction (the header comment's steps 2 to 4).
struct Reducer : std::enable_shared_from_this<Reducer> {
  struct Param {
    Tensor tensor;
    std::string name;  // "module.fc.weight"
    size_t bucket = 0;
    Tensor slot;  // its gradient's place in the bucket buffer, of the parameter's shape
    bool ready = false;  // its hook fired in this backward
  };
  struct Bucket {
    std::vector<size_t> params;  // indices into Reducer::params, in buffer order
    Tensor buffer;               // (numel,) flat gradients, on the parameters' device
    size_t pending = 0;          // parameters whose hook has not fired yet
    WorkPtr work;                // the all-reduce in flight
    int64_t trace_start_ns = -1;  // tracing: its launch, while its span is not yet recorded
  };

  std::shared_ptr<ProcessGroup> group;
  DDPOptions options;
  Device device;
  std::vector<Param> params;  // requiring a gradient, in reverse registration order
  std::vector<Bucket> buckets;
  TensorList float_buffers, other_buffers;

  size_t next_bucket = 0;      // buckets 0 .. next_bucket-1 are launched
  bool armed = false;          // the last forward asked for a synchronised backward
  bool finish_queued = false;  // this backward's end-of-pass callback is queued

  // Packs params into buckets (ddp.h, step 2) and allocates their buffers.
  void build_buckets() {
    std::map<DType, size_t> open;  // dtype -> its bucket still taking parameters
    std::set<DType> had_first;     // dtypes whose first bucket is closed
    std::map<size_t, int64_t> numel;
    for (size_t i = 0; i < params.size(); ++i) {
      DType dtype = params[i].tensor.dtype();
      auto it = open.find(dtype);
      if (it == open.end()) {
        it = open.emplace(dtype, buckets.size()).first;
        buckets.emplace_back();
      }
      size_t b = it->second;
      params[i].bucket = b;
      buckets[b].params.push_back(i);
      numel[b] += params[i].tensor.numel();
      double cap_mb = had_first.count(dtype) ? options.bucket_cap_mb : options.first_bucket_cap_mb;
      if (double(numel[b]) * double(dtype_size(dtype)) >= cap_mb * kMiB) {
        open.erase(it);
        had_first.insert(dtype);
      }
    }
    for (size_t b = 0; b < buckets.size(); ++b) {
      Bucket& bucket = buckets[b];
      bucket.buffer = zeros({numel[b]}, params[bucket.params[0]].tensor.dtype(), device);
      int64_t offset = 0;
      for (size_t i : bucket.params) {
        Param& p = params[i];
        p.slot = bucket.buffer.slice(0, offset, offset + p.tensor.numel()).view(p.tensor.shape());
        offset += p.tensor.numel();
      }
    }
    reset();
  }

  void reset() {
    next_bucket = 0;
    finish_queued = false;
    for (Bucket& b : buckets) {
      b.pending = b.params.size();
      b.work.reset();
      b.trace_start_ns = -1;
    }
    for (Param& p : params) p.ready = false;
  }

  // Called by forward: a backward pass that failed halfway left state behind; drop it.
  void prepare(bool sync) {
    if (finish_queued || next_bucket > 0) reset();
    armed = sync;
  }

  // The hook of params[i] (ddp.h, step 3).
  void mark_ready(size_t i) {
    if (!armed) return;
    Param& p = params[i];
    LOOM_CHECK(!p.ready, "DistributedDataParallel: ", p.name,
               " received its gradient twice after one forward; run the wrapped model through the "
               "DistributedDataParallel's forward() before each backward");
    if (!finish_queued) {
      queue_callback([self = shared_from_this()] { self->finish(); });
      finish_queued = true;
    }
    p.ready = true;
    if (trace::enabled()) trace_completed(false);
    if (--buckets[p.bucket].pending > 0) return;
    // Launch in bucket order only, so every rank issues the same collectives in turn.
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
      Bucket& b = buckets[next_bucket++];
      const int64_t launched = trace::enabled() ? trace::now_ns() : -1;
      gather(b);
      b.work = group->all_reduce(b.buffer, ReduceOp::avg);
      b.trace_start_ns = launched;
    }
    if (trace::enabled()) trace_completed(false);
  }

  // Tracing (trace.h): records the span of every launched bucket whose all-reduce is seen
  // complete, from its launch to now; with `wait`, first waits on the host for all of them.
  void trace_completed(bool wait) {
    for (size_t i = 0; i < next_bucket; ++i) {
      Bucket& b = buckets[i];
      if (b.trace_start_ns < 0) continue;
      if (wait)
        while (!b.work->is_completed()) std::this_thread::yield();
      else if (!b.work->is_completed())
        continue;
      trace::record("all_reduce bucket " + std::to_string(i), trace::Category::allreduce, b.trace_start_ns,
                    trace::now_ns(), {.bytes = int64_t(b.buffer.nbytes())});
      b.trace_start_ns = -1;
    }
  }

  // Copies a full bucket's gradients into its buffer, those that are not views of it already,
  // in one multi-tensor launch (a copy per parameter would cost a launch and the host's
  // dispatch each: on a small CNN that is what DDP's overhead is made of).
  void gather(const Bucket& b) {
    TensorList slots, grads;
    for (size_t i : b.params) {
      const Param& p = params[i];
      Tensor grad = p.tensor.grad();
      if (aliases(grad, p.slot)) continue;
      if (grad.is_contiguous() && grad.dtype() == p.slot.dtype()) {
        slots.push_back(p.slot);
        grads.push_back(grad);
      } else {
        copy_(p.slot, grad);
      }
    }
    copy_many_(slots, grads);
  }

  // The end-of-backward callback (ddp.h, steps 3, 4 and 6).
  void finish() {
    armed = false;
    if (next_bucket < buckets.size()) {
      // Every rank launched the same buckets when the same parameters went unused: wait for
      // them so the group stays usable, then name the parameters.
      for (size_t b = 0; b < next_bucket; ++b) buckets[b].work->wait();
      std::string missing;
      for (size_t i = params.size(); i-- > 0;)
        if (!params[i].ready) missing += (missing.empty() ? "" : ", ") + params[i].name;
      reset();
      LOOM_FAIL("DistributedDataParallel: parameters that did not receive a gradient: ", missing,
                "; find_unused_parameters is not supported, make every parameter take part in the loss or "
                "freeze it with set_requires_grad(false) before wrapping the module");
    }
    if (trace::enabled()) trace_completed(true);
    for (Bucket& b : buckets) b.work->wait();
    // Copied back in one launch per dtype, not per bucket: each launch costs the host several
    // microseconds, and a CNN step on a fast GPU (ResNet-18 on an H200) is nearly host-bound.
    struct CopyBack {
      DType dtype;
      TensorList grads, slots;
    };
    std::vector<CopyBack> copies;
    for (Param& p : params) {
      Tensor grad = p.tensor.grad();
      if (options.gradient_as_bucket_view) {
        if (!aliases(grad, p.slot)) p.tensor.set_grad(p.slot.detach());
      } else if (grad.is_contiguous() && grad.dtype() == p.slot.dtype()) {
        auto it = std::find_if(copies.begin(), copies.end(), [&](const CopyBack& c) { return c.dtype == grad.dtype(); });
        if (it == copies.end()) it = copies.insert(copies.end(), CopyBack{grad.dtype(), {}, {}});
        it->grads.push_back(grad);
        it->slots.push_back(p.slot);
      } else {
        copy_(grad, p.slot);
      }
    }
    for (const CopyBack& c : copies) copy_many_(c.grads, c.slots);
    reset();
    if (options.sync_buffers_average) {
      sync_tensors(*group, float_buffers, SyncOp::average);
      sync_tensors(*group, other_buffers, SyncOp::broadcast_from_rank0);
    }
  }
};

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group, DDPOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  LOOM_CHECK(module_ != nullptr, "DistributedDataParallel: the module is null");
  LOOM_CHECK(group_ != nullptr, "DistributedDataParallel: the process group is null");
  LOOM_CHECK(options_.bucket_cap_mb > 0 && options_.first_bucket_cap_mb > 0,
             "DistributedDataParallel: bucket_cap_mb and first_bucket_cap_mb must be positive, got ",
             options_.bucket_cap_mb, " and ", options_.first_bucket_cap_mb);
  register_module("module", module_);

  nn::NamedTensors named = named_parameters();
  nn::NamedTensors named_buffers = this->named_buffers();
  Device device = !named.empty() ? named[0].second.device()
                  : !named_buffers.empty() ? named_buffers[0].second.device()
                                           : Device::cpu();
  for (const auto& [name, t] : named) {
    LOOM_CHECK(t.device() == device, "DistributedDataParallel: ", named[0].first, " is on ", device.str(), " but ",
               name, " is on ", t.device().str(), ": a replica must live on one device");
    LOOM_CHECK(t.is_contiguous(), "DistributedDataParallel: parameter ", name,
               " is not row-major (laid out channels-last by Module::to(MemoryFormat)?): DDP's buckets hold ",
               "row-major parameters, so leave the module's parameters row-major (a channels-last batch still ",
               "runs as it lies)");
  }
  for (const auto& [name, t] : named_buffers) {
    LOOM_CHECK(t.device() == device, "DistributedDataParallel: buffer ", name, " is on ", t.device().str(),
               " but the parameters are on ", device.str(), ": a replica must live on one device");
    LOOM_CHECK(t.is_contiguous(), "DistributedDataParallel: buffer ", name, " is not contiguous");
  }
  const std::string backend = group_->backend();
  LOOM_CHECK(backend != "gloo" || device.is_cpu(), "DistributedDataParallel: the model is on ", device.str(),
             " but the group is Gloo, which serves CPU tensors; use an NCCL group for CUDA models");
  LOOM_CHECK(backend != "nccl" || device.is_cuda(), "DistributedDataParallel: the model is on ", device.str(),
             " but the group is NCCL, which serves CUDA tensors; move the model to its GPU first, or use Gloo");

  // Same model on every rank? Compare a checksum of the parameters' layout with rank 0's.
  TensorList all_params;
  for (const auto& [name, t] : named) all_params.push_back(t);
  const int world = group_->size();
  Tensor mine = from_vector(std::vector<int64_t>{int64_t(named.size()), layout_checksum(all_params)}, {2}, device);
  Tensor everyone = Tensor::empty({2 * int64_t(world)}, DType::i64, device);
  group_->all_gather(everyone, mine)->wait();
  std::vector<int64_t> layouts = everyone.to_vector<int64_t>();
  std::ostringstream differ;
  for (int r = 1; r < world; ++r)
    if (layouts[2 * r] != layouts[0] || layouts[2 * r + 1] != layouts[1])
      differ << (differ.tellp() > 0 ? ", " : "") << "rank " << r << " (" << layouts[2 * r] << " parameters)";
  LOOM_CHECK(differ.tellp() == 0, "DistributedDataParallel: the model differs from rank 0's (", layouts[0],
             " parameters) on ", differ.str(),
             ": the number, shapes, dtypes or requires_grad of the parameters differ; every rank must build "
             "the same model before wrapping it");

  // Every replica starts from rank 0's parameters and buffers.
  TensorList buffers;
  for (const auto& [name, t] : named_buffers) buffers.push_back(t);
  TensorList start = all_params;
  start.insert(start.end(), buffers.begin(), buffers.end());
  sync_tensors(*group_, start, SyncOp::broadcast_from_rank0);

  reducer_ = std::make_shared<Reducer>();
  reducer_->group = group_;
  reducer_->options = options_;
  reducer_->device = device;
  for (const Tensor& b : buffers)
    (is_floating(b.dtype()) ? reducer_->float_buffers : reducer_->other_buffers).push_back(b);
  for (size_t i = named.size(); i-- > 0;) {
    if (!named[i].second.requires_grad()) continue;
    Reducer::Param& p = reducer_->params.emplace_back();
    p.tensor = named[i].second;
    p.name = named[i].first;
  }
  reducer_->build_buckets();
  std::weak_ptr<Reducer> weak = reducer_;
  for (size_t i = 0; i < reducer_->params.size(); ++i)
    reducer_->params[i].tensor.register_post_accumulate_grad_hook([weak, i](Tensor&) {
      if (auto reducer = weak.lock()) reducer->mark_ready(i);
    });
}

DistributedDataParallel::~DistributedDataParallel() = default;

void DistributedDataParallel::prepare_forward() {
  for (const Reducer::Param& p : reducer_->params) {
    const Tensor& bucket = reducer_->buckets[p.bucket].buffer;
    LOOM_CHECK(p.tensor.device() == bucket.device() && p.tensor.dtype() == bucket.dtype(), "DistributedDataParallel: ",
               p.name, " is now ", dtype_name(p.tensor.dtype()), " on ", p.tensor.device().str(),
               " but was wrapped as ", dtype_name(bucket.dtype()), " on ", bucket.device().str(),
               ": move or convert the module before wrapping it");
  }
  const bool sync = require_backward_grad_sync_ && grad_enabled();
  // With one rank, rank 0's buffers are already this rank's: nothing to broadcast.
  if (sync && options_.broadcast_buffers && !options_.sync_buffers_average && group_->size() > 1) {
    TensorList buffers = reducer_->float_buffers;
    buffers.insert(buffers.end(), reducer_->other_buffers.begin(), reducer_->other_buffers.end());
    sync_tensors(*group_, buffers, SyncOp::broadcast_from_rank0);
  }
  reducer_->prepare(sync);
}

Tensor DistributedDataParallel::forward(const Tensor& input) {
  prepare_forward();
  return module_->forward(input);
}

std::vector<std::vector<std::string>> DistributedDataParallel::bucket_assignment() const {
  std::vector<std::vector<std::string>> out;
  for (const Reducer::Bucket& b : reducer_->buckets) {
    out.emplace_back();
    for (size_t i : b.params) out.back().push_back(reducer_->params[i].name);
  }
  return out;
}

}  // namespace loom::dist
