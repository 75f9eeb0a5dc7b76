// DistributedDataParallel (DDP): data-parallel training, modelled on PyTorch's
// torch.nn.parallel.DistributedDataParallel. Every rank holds a whole replica of the model
// and trains on its own slice of the global batch; after each backward the gradients are
// averaged over the ranks, so every replica takes the same optimizer step and the replicas
// stay equal: W ranks on B/W rows each train exactly like one process on B rows.
//
// The algorithm, in the order it runs:
//
// 1. Construction. Every rank checks that the model's parameters sit on one device and are
//    contiguous, and that they match rank 0's in number, shape, dtype and requires_grad
//    (an all_gather of a checksum). Rank 0's parameters and buffers are broadcast, so all
//    replicas start equal whatever each rank's random initialisation was.
//
// 2. Buckets. Averaging each gradient on its own would cost one collective per parameter;
//    averaging them all at once would wait for the whole backward. So the parameters that
//    require a gradient are packed into buckets of about bucket_cap_mb (25 MiB), each with one
//    flat gradient buffer, and each bucket's all-reduce starts as soon as all its gradients
//    are ready, while backward goes on computing the earlier layers' gradients.
//    Backward produces gradients roughly in reverse registration order (the last layer
//    first), so buckets are filled in that order: bucket 0 holds the last parameters. A
//    bucket holds one dtype (one all-reduce per buffer). The first bucket is smaller
//    (first_bucket_cap_mb, 1 MiB) so the first all-reduce starts early.
//
//      registration:  conv1.w conv1.b | conv2.w conv2.b | fc1.w fc1.b | fc2.w fc2.b
//      buckets:       bucket 0 = [fc2.b fc2.w fc1.b fc1.w]  bucket 1 = [conv2.b ... conv1.w]
//
// 3. Backward. Each parameter has a post-accumulate-grad hook (engine/autograd.h), which
//    fires once its gradient is final. The hook counts the bucket down; a bucket whose count
//    reaches zero has its gradients copied into their slots of the bucket buffer (one
//    multi-tensor launch, copy_many_) and the buffer all-reduced (ReduceOp::avg)
//    asynchronously. Collectives must be issued in the
//    same order on every rank, and the order in which gradients become ready can differ
//    between ranks, so bucket i is launched only after buckets 0..i-1: a bucket that is
//    complete early waits for its predecessors. The first hook of a pass also queues a
//    callback for the end of backward (queue_callback). There every Work is waited for and
//    the averaged values are copied back into each parameter's grad (one launch for all the
//    buckets of a dtype), so when loss.backward() returns the gradients are averaged. With
//    gradient_as_bucket_view, grad is instead left as a view into the bucket buffer (no copy
//    back; the next backward accumulates into the buffer directly); such a grad is
//    overwritten by the next synchronised backward.
//
// 4. Unused parameters. A parameter that gets no gradient keeps its bucket, and every bucket
//    after it, from ever being launched. The end-of-backward callback notices and throws,
//    naming the parameters. PyTorch's find_unused_parameters (a graph search every step) is
//    not offered: freeze such parameters with set_requires_grad(false) before wrapping.
//
// 5. no_sync(). Gradient accumulation: forwards run under the guard do not arm the hooks, so
//    their backward only accumulates local gradients into grad (no communication). The
//    first synchronised backward after it averages the accumulated sums. With the loss of
//    each of k micro-batches scaled by 1/k, k-1 of them under no_sync and the last outside
//    equal one step on the whole batch. As in PyTorch, what counts is where the forward ran.
//
// 6. Buffers (BatchNorm's running statistics are not trained, so no gradient keeps them
//    equal). With broadcast_buffers, each forward that may be followed by a synchronised
//    backward (grad mode on, not under no_sync) first broadcasts rank 0's buffers, as
//    PyTorch does. With sync_buffers_average, floating buffers are instead averaged across
//    ranks at the end of each synchronised backward (integer ones, such as
//    num_batches_tracked, taken from rank 0), so every replica ends each step with the mean
//    of the ranks' statistics.
//
// Devices. CPU tensors over a Gloo group, CUDA tensors over an NCCL group. On CUDA every
// copy into and out of the buckets is an engine op on the compute stream, and Work::wait()
// makes the compute stream wait for the all-reduce, so the host never blocks in a step.
//
// Not offered: PyTorch's rebuilding of buckets in the order gradients arrived during the
// first iteration, static graphs, communication hooks (fp16 compression), and moving or
// converting the model after wrapping it (to() the module first; forward() checks).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../layers/module.h"
#include "process_group.h"

namespace loom::dist {

struct DDPOptions {
  // Bucket size in MiB (2^20 bytes): a bucket is closed once its gradients reach this.
  // Fractions are allowed (0.1: 100 KiB), as PyTorch's bucket_cap_mb.
  double bucket_cap_mb = 25;
  // Cap of each dtype's first bucket (the last layers), so communication starts early.
  // PyTorch's is 1 MiB; set it to bucket_cap_mb for equal buckets.
  double first_bucket_cap_mb = 1;
  // Broadcast rank 0's buffers before each synchronised forward (PyTorch's default).
  bool broadcast_buffers = true;
  // Average floating buffers across ranks after each synchronised backward instead of
  // broadcasting rank 0's before each forward (it replaces broadcast_buffers).
  bool sync_buffers_average = false;
  // Leave each parameter's grad as a view into its bucket buffer after the reduction
  // (PyTorch's gradient_as_bucket_view): no copy back and no second copy of the gradients.
  bool gradient_as_bucket_view = false;
};

struct Reducer;

class DistributedDataParallel : public nn::Module {
 public:
  // Wraps `module` (registered as the child "module", so state_dict() keys read
  // "module.features.0.weight" as in PyTorch). Every rank of `group` must call this
  // with the same model: it communicates (see the header comment).
  DistributedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> group,
                          DDPOptions options = {});
  ~DistributedDataParallel() override;

  // Syncs buffers and arms the gradient hooks (see the header comment), then runs the module.
  Tensor forward(const Tensor& input) override;
  // For a module whose forward takes something other than one tensor: does what forward()
  // does before the module runs, then returns run(), e.g.
  //   Tensor loss = ddp.call([&] { return gpt->forward(ids, targets); });
  template <class F>
  decltype(auto) call(F&& run) {
    prepare_forward();
    return run();
  }
  std::string type_name() const override { return "DistributedDataParallel"; }

  // The wrapped module (PyTorch's ddp.module).
  const std::shared_ptr<nn::Module>& module() const { return module_; }
  ProcessGroup& group() const { return *group_; }
  const DDPOptions& options() const { return options_; }

  // Gradient accumulation: while a NoSync lives, forwards do not arm the reduction, so
  // their backward only accumulates local gradients. Use as
  //   { auto guard = ddp.no_sync(); loss(ddp.forward(x1)).backward(); }
  //   loss(ddp.forward(x2)).backward();  // averages the sum of both
  class NoSync {
   public:
    ~NoSync() { ddp_.require_backward_grad_sync_ = previous_; }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    friend class DistributedDataParallel;
    explicit NoSync(DistributedDataParallel& ddp) : ddp_(ddp), previous_(ddp.require_backward_grad_sync_) {
      ddp_.require_backward_grad_sync_ = false;
    }
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // The buckets in launch order, each as its parameters' names ("module.fc.bias"), in the
  // order their gradients are laid out in the bucket buffer.
  std::vector<std::vector<std::string>> bucket_assignment() const;

 private:
  // Checks the parameters still sit where the buckets expect, syncs buffers, arms the hooks.
  void prepare_forward();

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  DDPOptions options_;
  bool require_backward_grad_sync_ = true;
  // Shared with the gradient hooks, which hold it weakly: hooks of a module that outlives
  // its DDP wrapper do nothing.
  std::shared_ptr<Reducer> reducer_;
};

}  // namespace loom::dist
