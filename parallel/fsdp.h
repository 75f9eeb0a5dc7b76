// Fully sharded data parallel (FSDP), modelled on PyTorch's FSDP2 (fully_shard). As in DDP
// (ddp.h) every rank trains on its own rows of the global batch and the ranks take the
// same optimizer step; unlike DDP no rank keeps a whole copy of the model between uses.
// Each parameter is cut along dim 0 into one shard per rank, and a rank keeps only its shard,
// its shard's gradient and its shard's optimizer state: W ranks hold 1/W of all three each.
// The full values of a group of parameters (a unit: a GPT block, a ResNet stage) exist only
// while the unit computes, in forward and in backward.
//
// The algorithm, in the order it runs:
//
// 1. Construction. Rank 0's parameters and buffers are broadcast (all ranks then start
//    equal), the parameters are split into units (options.units by hand, or the size policy
//    min_num_params, PyTorch's size_based_auto_wrap_policy: bottom-up, a module whose
//    not-yet-claimed parameters number at least min_num_params becomes a unit; what no unit
//    claims forms the root unit). A parameter tied to two modules (GPT's token embedding
//    and output layer) belongs to the unit that claims it first.
//
// 2. Shards. A parameter of n rows gets c = ceil(n / W) rows per rank: rank r holds rows
//    [r c, min(n, (r + 1) c)), so the last ranks may hold fewer rows or none (torch.chunk's
//    split). Each shard becomes a new leaf tensor, the one the optimizer steps on
//    (parameters()); the module's parameter keeps its shape, its identity and its hooks,
//    and its Storage is released (engine/storage.h): its memory goes back to the allocator.
//    A unit lays its shards end to end in one flat buffer of S elements per rank, every
//    shard padded to c rows, so that rank r's shard of every parameter sits at the same
//    offset in every rank's buffer:
//
//      parameter a (5 rows), b (2 rows), W = 2:  c_a = 3, c_b = 1,  S = 3 a-rows + 1 b-row
//      rank 0's flat shard: a0 a1 a2 | b0        rank 1's: a3 a4 -- | b1
//      all_gather:          [a0 a1 a2 b0 | a3 a4 -- b1]  -> copied out into a's and b's storage
//
// 3. Gather on first use. The first read of a released parameter's data inside a step (by
//    whichever op needs it, in forward or in backward) runs its storage's acquire hook,
//    which gathers the parameter's whole unit: one all_gather of the flat buffers (in place:
//    each rank's shards are cast or copied straight into its slice of the gathered buffer),
//    then the rows copied out into every parameter's re-acquired storage (one copy_many_
//    launch for the unit). Every rank runs the same
//    program, so every rank reads the units in the same order and issues the same
//    all_gathers. Gathering on use rather than from module hooks needs nothing of the
//    model: Loom's models call their children and read their weights directly, and a
//    tied weight read again by the output layer is simply gathered again.
//    Prefetch (options.prefetch): the first step records the order in which each of its
//    passes gathers the units (forward: the embeddings, block 0, block 1, ...; backward: the
//    blocks in reverse, and not the units whose backward reads no weight). From the second
//    step on, once a unit is first gathered in a pass, the all_gather of the unit that came
//    after it in that pass is issued without waiting. On a GPU it runs on the communication
//    stream while the current unit computes, and the unit's first read only makes the compute
//    stream wait for it. The op that made the current unit gather may still be reading the
//    unit before it, so the prefetch waits for that op to end (engine/op_boundary.h: where it
//    records its autograd node, or, in backward, where its node has run). Then, under ZeRO-3,
//    every other unit is released (one read again is gathered again, on demand) and the
//    prefetch issued: at most two units are unsharded, the current one and the one arriving;
//    when there is nothing to prefetch, nothing is released early. Under NoGradGuard
//    (evaluation) no op marks a boundary, so the prefetch is issued at once and a third unit
//    may be arriving while two are held. A unit gathered again in the same pass (GPT's tied
//    embedding, read again by the output layer) prefetches nothing; a step that reads another
//    unit first drops the prefetch (waited for, then freed) and gathers on demand.
//    Prefetching issues the same all_gathers as gathering on demand, only earlier (FSDPMemory
//    counts both).
//
// 4. Free after use (reshard_after_forward). ZeRO-3 (ReshardAfterForward::yes): at most
//    two units are held at once; gathering a third releases the one gathered earliest (with
//    prefetch, the unit before goes when the next one's all_gather is issued: step 3). As
//    units run one after the other this frees a unit's full values once the next but one
//    starts, and backward gathers them again when it reads the weights its ops saved (those
//    saved copies share the parameter's storage, so they see the re-acquired values).
//    ZeRO-2 (ReshardAfterForward::no): a unit gathered in forward stays until its backward
//    has ended, which saves the second all_gather and holds every unit at the turn.
//
// 5. Gradients. Every parameter has a post-accumulate-grad hook (engine/autograd.h). When
//    the last trainable parameter of a unit has its gradient, the unit's backward is over:
//    its full gradients are laid out like the gathered buffer (padding zero), reduce-
//    scattered with ReduceOp::avg so that each rank receives the average of its own rows
//    (a group of one reduces in place),
//    the full gradients are dropped and the unit's full values released. A callback queued
//    at the first hook runs at the end of backward: it waits for the reduce-scatters, adds
//    each shard's slice to its shard's grad, names the parameters that got no gradient (an
//    error, as in DDP; freeze them with set_requires_grad(false) before wrapping) and
//    releases whatever is still gathered.
//
// 6. Optimizer, clipping, accumulation. The optimizer (SGD, Adam, AdamW unchanged) is built
//    on parameters(): it steps on shards, with shard-sized state. clip_grad_norm_ sums the
//    squares of the local shards' gradients and all_reduces the sum, so every rank scales
//    by the same global norm. Under no_sync() a backward keeps each unit's full gradients
//    (the next backward adds to them) and communicates nothing; the first synchronised
//    backward reduce-scatters the sums.
//
// 7. Mixed precision (options.param_dtype = bf16, reduce_dtype = f32). The module's parameters
//    are turned into bf16 tensors (released at once); a gather casts each shard to bf16 into
//    the flat buffer, so the all_gather moves half the bytes and the model computes in bf16.
//    Their gradients arrive in bf16, are laid out in f32 and reduce-scattered in f32, and the
//    f32 shards (the master weights) with their f32 optimizer state take the step. A full
//    state dict gathers the f32 shards. This is PyTorch's MixedPrecisionPolicy.
//
// One unit's life through a ZeRO-3 step (S: elements of its flat shard, W ranks):
//
//   forward   a weight read -> all_gather -> [full, W S]  compute  .. released when the unit
//             after next is gathered, or, with prefetch, once the next one's first op has
//             ended -> [shard, S]
//   backward  a saved weight read -> all_gather -> [full, W S]  compute
//             last gradient -> [full grads, W S] -reduce_scatter(avg)-> [shard grad, S]
//             full values and full gradients released
//   step      AdamW on [shard, S] with [shard grad, S] and [state, 2 S]
//
// ZeRO-2 keeps [full, W S] from the unit's forward to the end of its backward.
//
// 8. HSDP (hybrid sharding, options.replicate_group). The ranks form a mesh (replicate,
//    shard): each row of the mesh shards the model as above, and the rows are replicas of one
//    another, as DDP's ranks are. The group given to the constructor is this rank's shard
//    group; options.replicate_group holds the ranks at the same shard position in every row.
//    Construction broadcasts rank 0's values along both; after each reduce-scatter (the
//    average over the row) an all_reduce averages the shard's gradient over the replicas, so
//    every rank steps on the average over the whole world. Gathers stay inside a row: with
//    rows on nodes, the all_gathers and reduce-scatters use the fast links within a node and
//    only shard-sized gradients cross between nodes. A sharded checkpoint is written by the
//    first row alone and loads into any layout.
//
//      DeviceMesh({2, 4}, {"replicate", "shard"}) on 8 ranks:   shard=0  1  2  3
//                                               replicate=0         0  1  2  3   <- one model
//                                               replicate=1         4  5  6  7   <- its replica
//
// 9. Inside pipeline stages (parallel/pipeline.h, PipelineOptions::shard). Each stage's
//    module is wrapped over the stage's data-parallel group, and a stage runs several
//    micro-batches' forwards before their backwards (1F1B: F0 F1 B0 F2 B1 ...). Every forward
//    run with gradients on counts a backward due; a backward that ends while another is due
//    leaves the units gatherable and counts the gradients afresh, so each micro-batch's
//    backward gathers what it reads as in a step of its own. The executor calls
//    set_gradient_sync(false) before every backward of a stage but its last in the step:
//    those keep the full gradients, and the last one reduce-scatters their sum, once per
//    step, as no_sync() does for accumulation. The memory this costs is the full gradients of
//    the stage between its first and its last backward. Under ZeRO-2 the units a backward
//    still due will read stay gathered through the next micro-batch's forward; each unit goes
//    when its backward for one micro-batch has ended, so ZeRO-2 gathers once a micro-batch
//    and ZeRO-3 twice. HSDP inside stages: each stage is sharded over
//    PipelineOptions::shard_group and replicated over options.replicate_group, the pipeline's
//    data-parallel group holding both (DeviceMesh::flatten); its gradient norm sums the
//    shards over the shard group alone, since the replicas hold the same ones.
//
// Devices. CPU tensors over a Gloo group, CUDA tensors over an NCCL group. On CUDA every copy
// into and out of the flat buffers is an engine op on the compute stream and Work::wait()
// makes the compute stream wait for the collective (nccl_group.cpp), so the host does not
// block in a step. Gloo's collectives run when issued, so on CPU ranks a prefetch moves the
// communication earlier but overlaps nothing.
//
// Buffers (BatchNorm's running statistics) are replicated, broadcast from rank 0 at
// construction; with options.average_buffers the ranks' statistics are averaged after each
// synchronised backward (over the replicas too under HSDP), so that every rank evaluates
// with the same ones. Not offered: using the module on its own after wrapping
// (its parameters' storages stay released; load full_state_dict() into a fresh model).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../layers/module.h"
#include "process_group.h"

namespace loom::dist {

// Whether a unit's full parameters are freed after its forward (ZeRO-3) or kept until its
// backward has ended (ZeRO-2).
enum class ReshardAfterForward : bool { no = false, yes = true };

struct FSDPOptions {
  ReshardAfterForward reshard_after_forward = ReshardAfterForward::yes;
  // Units by hand, in order: the parameters of each list's modules that no earlier unit
  // claimed form one unit (a GPT's {wte, wpe}, then one list per block). Empty: the size
  // policy below decides.
  std::vector<std::vector<std::shared_ptr<nn::Module>>> units;
  // The size policy (see the header comment, step 1); 0 makes the whole model one unit.
  int64_t min_num_params = 0;
  // Mixed precision (step 7): the dtype the full parameters are gathered in and compute in
  // (bf16), and the dtype gradients are reduce-scattered in (f32); unset, both are the
  // parameters' own. The shards and their optimizer state keep the parameters' dtype.
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  // Step 3's prefetch: each unit's all_gather issued while the unit before it computes.
  bool prefetch = true;
  // Buffers (BatchNorm's running statistics): averaged over every rank at the end of each
  // synchronised backward, integer ones taken from rank 0, as DDP's sync_buffers_average;
  // false keeps each rank's own after the broadcast at construction.
  bool average_buffers = false;
  // HSDP (step 8): the ranks holding the same shards in the other replicas, this rank among
  // them; null for plain FSDP. hybrid_shard() below builds both groups from a mesh.
  std::shared_ptr<ProcessGroup> replicate_group;
};

// Bytes of full (gathered) parameters this rank holds, now and at most since the last reset;
// the shards' bytes for comparison.
struct FSDPMemory {
  size_t full_parameter_bytes = 0;
  size_t peak_full_parameter_bytes = 0;
  size_t shard_parameter_bytes = 0;
  int64_t gathers = 0;     // all_gathers of units issued in all
  int64_t prefetches = 0;  // of those, issued ahead of their unit's first read (step 3)
  int64_t reduce_scatters = 0;  // of units' gradients, in all (none under no_sync)
};

// The rows [start, start + count) of a parameter of `rows` rows (dim 0) that rank `rank` of
// `world` holds: ceil(rows / world) per rank, fewer or none on the last ranks (step 2).
struct RowRange {
  int64_t start = 0, count = 0;
};
RowRange shard_rows(int64_t rows, int world, int rank);

struct FSDPState;

class FullyShardedDataParallel {
 public:
  // Shards `module` across `group` (see the header comment). Every rank of the group must
  // call this with the same model: it communicates.
  FullyShardedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> group,
                           FSDPOptions options = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // Runs the module's one-input forward inside a step (step 3 gathers as it goes).
  Tensor forward(const Tensor& input);
  // For any other forward:  Tensor loss = fsdp.call([&] { return gpt->loss(ids, targets); });
  // Under NoGradGuard (evaluation) every unit is released again when `run` returns.
  template <class F>
  decltype(auto) call(F&& run) {
    ForwardScope scope(*this);
    return run();
  }

  // The shards, in the module's parameter order: build the optimizer on these.
  TensorList parameters() const;
  // The shards under the module's parameter names ("transformer.h.0.attn.c_attn.weight").
  nn::NamedTensors named_parameters() const;
  // The shard of one of the module's parameters (a tied one's: the shard of the tensor).
  Tensor shard_of(const Tensor& parameter) const;
  // Drops every shard's gradient.
  void zero_grad();
  // Clips the shards' gradients by the global norm over all ranks (step 6); returns that norm.
  double clip_grad_norm_(double max_norm);

  // Gradient accumulation: backwards of forwards run while a NoSync lives keep the full
  // gradients and communicate nothing; the next synchronised backward reduces their sum.
  class NoSync {
   public:
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    friend class FullyShardedDataParallel;
    explicit NoSync(FullyShardedDataParallel& fsdp);
    FullyShardedDataParallel& fsdp_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }
  // The same switch without a scope, as a pipeline's executor sets it before each backward
  // (step 9): false keeps the full gradients of the backwards that follow, true reduces.
  void set_gradient_sync(bool on);

  // Every parameter's full value and every buffer, under the module's names, on every rank
  // (one all_gather per unit: a collective). Tied parameters appear under each name.
  nn::NamedTensors full_state_dict();
  // Takes this rank's rows of every parameter in `state` (full tensors under the module's
  // names) into the shards, and the buffers as they are. Local: no communication.
  void load_full_state_dict(const nn::NamedTensors& state);

  // The units, each as its parameters' names; the root unit ("" in unit_names()) last.
  std::vector<std::vector<std::string>> unit_assignment() const;
  // Each unit's name: the module path ("transformer.h.0"), several joined by '+', "" for the root.
  std::vector<std::string> unit_names() const;
  FSDPMemory memory() const;
  void reset_peak_memory();
  // Each unit's full parameters in bytes (in the dtype they are gathered in), as
  // unit_names() lists the units.
  std::vector<size_t> unit_bytes() const;
  const FSDPOptions& options() const;

  const std::shared_ptr<nn::Module>& module() const { return module_; }
  // The shard group, and HSDP's replicate group (null for plain FSDP).
  ProcessGroup& group() const { return *group_; }
  ProcessGroup* replicate_group() const { return replicate_group_.get(); }

 private:
  class ForwardScope {
   public:
    explicit ForwardScope(FullyShardedDataParallel& fsdp);
    ~ForwardScope() noexcept(false);
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;

   private:
    FullyShardedDataParallel& fsdp_;
  };

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<ProcessGroup> replicate_group_;
  // Shared with the storages' acquire hooks and the gradient hooks, which hold it weakly.
  std::shared_ptr<FSDPState> state_;
};

// FSDP2's spelling: shards `module` and returns the wrapper that runs it.
std::unique_ptr<FullyShardedDataParallel> fully_shard(std::shared_ptr<nn::Module> module,
                                                      std::shared_ptr<ProcessGroup> group, FSDPOptions options = {});

class DeviceMesh;
// HSDP on a mesh with dimensions "replicate" and "shard" (step 8): shards along "shard",
// replicates along "replicate". Every rank of the mesh calls it.
std::unique_ptr<FullyShardedDataParallel> hybrid_shard(std::shared_ptr<nn::Module> module, const DeviceMesh& mesh,
                                                       FSDPOptions options = {});

}  // namespace loom::dist
