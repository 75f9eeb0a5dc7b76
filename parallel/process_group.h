// Process groups: the collectives data-parallel training is made of, modelled on PyTorch
// c10d's ProcessGroup so that what users learn here carries over. A group is `size` ranks
// that met through a Store; each collective is called by every rank in the same order with
// tensors of the same dtype and shape, and returns a Work handle.
//
//   all_reduce      t = op over ranks of t                       (in place)
//   broadcast       t = root's t                                 (in place)
//   all_gather      out = cat over ranks r of in_r               (out: size * in.numel())
//   reduce_scatter  out = slice `rank` of op over ranks of in    (in: size * out.numel())
//   send / recv     point to point, matched by (peer, tag)
//   batch_isend_irecv  several sends and receives posted together (see below)
//   barrier         returns when every rank has reached it
//
// Sub-groups. new_group(ranks) makes a group of some of this group's ranks, as c10d's
// dist.new_group: every rank of the parent calls it, in the same order, with the same list;
// members get the new group (their rank in it is their index in the list), the others get
// null. The new group keeps all its store keys under "group/<n>/" (a PrefixStore; n counts
// the parent's new_group calls), so its bootstrap, its debug ledger and its watchdog entries
// never meet another group's, and several groups run collectives at once on one store. The
// NCCL backend makes one communicator per group; Gloo one context per group. A DeviceMesh
// (parallel/device_mesh.h) builds the groups of a pp x dp layout from these.
//
// Batched point to point. batch_isend_irecv({P2POp::send(t, 1), P2POp::recv(u, 1)}) posts
// every transfer before any is waited for, so two neighbours can each send to the other
// at once. On NCCL the transfers are issued as one group call (ncclGroupStart/End); on Gloo
// sends and receives are posted without blocking anyway. It returns one Work per op.
//
// Backends: NCCL for CUDA tensors (one process per GPU; collectives run on the group's own
// stream, ordered after the work already queued on the compute stream by an event), Gloo for
// CPU tensors (Debian's libgloo-dev). Both are bootstrapped from the same Store.
//
// Work::wait() means "the result is ready for what comes next": for Gloo the host blocks
// until the collective is done; for NCCL the compute stream is made to wait for it (the host
// does not), exactly as c10d's work.wait(). Work::is_completed() never blocks.
//
// Failure: every collective has a timeout (ProcessGroupOptions::timeout, default 10 minutes).
// When a peer dies or hangs, the survivors report which rank stopped answering and in which
// collective (its sequence number, op, dtype and shape), abort the communicator, and the
// error reaches the caller (Gloo) or ends the process with status 1 (NCCL's watchdog, since
// an aborted communicator cannot be recovered), within the timeout plus a few seconds.
//
// Debug mode (ProcessGroupOptions::debug, or LOOM_DIST_DEBUG=1): before each collective every
// rank writes (sequence number, op, dtype, shape) to the store and checks it against rank
// 0's, so ranks that call different collectives, or the same one on different shapes, get
// an error naming both calls instead of a hang. It costs a store round trip per collective.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../engine/tensor.h"
#include "store.h"

namespace loom::dist {

enum class ReduceOp { sum, avg, max, min };
const char* reduce_op_name(ReduceOp op);

class Work {
 public:
  virtual ~Work() = default;
  // See the header comment; throws loom::Error when the collective failed or timed out.
  virtual void wait() = 0;
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

struct ProcessGroupOptions {
  Duration timeout = std::chrono::minutes(10);
  bool debug = false;  // also turned on by LOOM_DIST_DEBUG=1 in the environment
};

// One transfer of a batch_isend_irecv.
struct P2POp {
  enum class Kind { send, recv };
  Kind kind;
  Tensor tensor;
  int peer;
  int tag = 0;
  static P2POp send(Tensor t, int dst, int tag = 0) { return {Kind::send, std::move(t), dst, tag}; }
  static P2POp recv(Tensor t, int src, int tag = 0) { return {Kind::recv, std::move(t), src, tag}; }
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // "gloo" or "nccl".
  virtual std::string backend() const = 0;
  const ProcessGroupOptions& options() const { return options_; }

  // The collectives (see the header comment). Tensors must be contiguous, of dtype f32, f64,
  // bf16, f16, i32 or i64 (u8 too for broadcast, send and recv), on the device the backend
  // serves. Each checks its arguments, records the call in the debug ledger, and calls the
  // backend's *_impl. avg divides the sum by size() (integers: rounding toward zero).
  WorkPtr all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum);
  WorkPtr broadcast(const Tensor& t, int root);
  WorkPtr all_gather(const Tensor& out, const Tensor& in);
  WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::sum);
  WorkPtr send(const Tensor& t, int dst, int tag = 0);
  WorkPtr recv(const Tensor& t, int src, int tag = 0);
  WorkPtr barrier();

  // The transfers posted together (see the header comment); one Work per op, in order.
  std::vector<WorkPtr> batch_isend_irecv(const std::vector<P2POp>& ops);

  // A group of the ranks listed (see the header comment): called by every rank of this
  // group, with the same list; null on the ranks not in it. `options` default to this
  // group's.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks);
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, ProcessGroupOptions options);

  // The ranks of the world group that make up this group, in this group's rank order (the
  // world group's own are 0..size-1): what messages use to name a member.
  const std::vector<int>& world_ranks() const { return world_ranks_; }

  // How many collectives this rank has issued (the ledger's sequence number).
  int64_t sequence_number() const { return seq_; }

 protected:
  ProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options);

  virtual WorkPtr all_reduce_impl(const Tensor& t, ReduceOp op) = 0;
  virtual WorkPtr broadcast_impl(const Tensor& t, int root) = 0;
  virtual WorkPtr all_gather_impl(const Tensor& out, const Tensor& in) = 0;
  virtual WorkPtr reduce_scatter_impl(const Tensor& out, const Tensor& in, ReduceOp op) = 0;
  virtual WorkPtr send_impl(const Tensor& t, int dst, int tag) = 0;
  virtual WorkPtr recv_impl(const Tensor& t, int src, int tag) = 0;
  virtual WorkPtr barrier_impl() = 0;
  // Posts every op before waiting for any. The default posts them one by one through
  // send_impl and recv_impl, which is right for backends whose sends never block the host.
  virtual std::vector<WorkPtr> batch_impl(const std::vector<P2POp>& ops);
  // The same backend over `store` (a PrefixStore of this group's), for new_group.
  virtual std::shared_ptr<ProcessGroup> make_subgroup(std::shared_ptr<Store> store, int rank, int size,
                                                      ProcessGroupOptions options) = 0;

  // "all_reduce #12 (sum, f32, (1024,))": what messages name.
  std::string describe_call(const char* op, const Tensor& t, const std::string& detail = "") const;
  Store& store() { return *store_; }
  std::shared_ptr<Store> store_ptr() const { return store_; }

 private:
  // Counts the call and, in debug mode, checks it against rank 0's through the store.
  void begin_call(const char* op, const Tensor& t, const std::string& detail);

  std::shared_ptr<Store> store_;
  int rank_, size_;
  ProcessGroupOptions options_;
  int64_t seq_ = 0;
  int subgroups_made_ = 0;
  std::vector<int> world_ranks_;
};

// A Gloo group over CPU tensors, bootstrapped through `store` (keys under "gloo/"). Throws
// when Loom was built without Gloo, saying how to get it.
std::shared_ptr<ProcessGroup> new_gloo_group(std::shared_ptr<Store> store, int rank, int size,
                                             ProcessGroupOptions options = {});
// An NCCL group over tensors on `device` (normally cuda:LOCAL_RANK), bootstrapped through
// `store` (rank 0 publishes the unique id under "nccl/"). Throws when Loom was built without
// NCCL.
std::shared_ptr<ProcessGroup> new_nccl_group(std::shared_ptr<Store> store, int rank, int size, Device device,
                                             ProcessGroupOptions options = {});

}  // namespace loom::dist
