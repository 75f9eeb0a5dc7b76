// What every backend shares: the argument checks of the public collectives, the sequence
// numbers, the messages that name a call, and the debug ledger.
//
// The ledger: before collective number s, every rank sets "ledger/<backend>/<s>/<rank>" to
// its description of the call (the backend in the key lets one Gloo and one NCCL group
// share a store). Rank 0 waits for every rank's entry and compares each with its own;
// every other rank reads rank 0's entry and compares. So a mismatch is reported on rank 0
// and on the rank that differs, each naming both calls, instead of a hang inside the
// backend. Once rank 0 has every entry of call s, every rank has finished reading rank 0's
// entry of call s - 1, so rank 0 deletes the entries of s - 1: the store holds at most two
// calls' worth of ledger keys.
//
// Point-to-point calls (send, recv) are not collectives: ranks that do not take part never
// see them, so they take no sequence number and are not in the ledger.
#include "parallel/process_group.h"

#include <string_view>

#include "kernels/core/env.h"
#include "kernels/core/error.h"

namespace loom::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

namespace {

enum class AllowBytes { no, yes };

bool supported(DType dtype, AllowBytes bytes) {
  switch (dtype) {
    case DType::f32:
    case DType::f64:
    case DType::bf16:
    case DType::f16:
    case DType::i32:
    case DType::i64: return true;
    case DType::u8: return bytes == AllowBytes::yes;
  }
  return false;
}

bool is_point_to_point(std::string_view op) { return op == "send" || op == "recv"; }

std::string ledger_key(const std::string& backend, int64_t seq, int rank) {
  return "ledger/" + backend + "/" + std::to_string(seq) + "/" + std::to_string(rank);
}

std::string text(const Bytes& bytes) { return std::string(bytes.begin(), bytes.end()); }

}  // namespace

ProcessGroup::ProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
    : store_(std::move(store)), rank_(rank), size_(size), options_(options) {
  LOOM_CHECK(store_ != nullptr, "ProcessGroup: the store is null; pass the store the ranks met through");
  LOOM_CHECK(size_ >= 1, "ProcessGroup: size must be at least 1, got ", size_);
  LOOM_CHECK(rank_ >= 0 && rank_ < size_, "ProcessGroup: rank ", rank_, " is out of range for a group of size ",
             size_, " (expected 0 <= rank < ", size_, ")");
  LOOM_CHECK(options_.timeout > Duration::zero(), "ProcessGroup: the timeout must be positive, got ",
             options_.timeout.count(), " ms");
  if (env_is("LOOM_DIST_DEBUG", "1")) options_.debug = true;
  for (int r = 0; r < size_; ++r) world_ranks_.push_back(r);
}

// ---- argument checks ---------------------------------------------------------------------

namespace {

// Which device kind a backend's tensors live on; the NCCL backend also checks the index.
DeviceKind served_kind(const std::string& backend) {
  return backend == "nccl" ? DeviceKind::cuda : DeviceKind::cpu;
}

void check_tensor(const char* op, const char* name, const Tensor& t, AllowBytes bytes, const std::string& backend) {
  LOOM_CHECK(t.defined(), op, ": `", name, "` is undefined; expected a tensor");
  LOOM_CHECK(supported(t.dtype(), bytes), op, ": `", name, "` has dtype ", dtype_name(t.dtype()),
             "; expected f32, f64, bf16, f16, i32 or i64", bytes == AllowBytes::yes ? " (or u8)" : "",
             ": convert it with .to(DType::...) first");
  LOOM_CHECK(t.is_contiguous(), op, ": `", name, "` must be contiguous (shape ", shape_str(t.shape()), ", strides ",
             shape_str(t.strides()), "): pass .contiguous() and copy the result back");
  DeviceKind kind = served_kind(backend);
  LOOM_CHECK(t.device().kind == kind, op, ": `", name, "` is on ", t.device().str(), " but the ", backend,
             " backend serves ", kind == DeviceKind::cpu ? "CPU" : "CUDA", " tensors: move it with .to(",
             kind == DeviceKind::cpu ? "Device::cpu()" : "the group's device", ")");
}

void check_pair(const char* op, const Tensor& out, const Tensor& in) {
  LOOM_CHECK(out.dtype() == in.dtype(), op, ": `out` and `in` must have the same dtype, got ",
             dtype_name(out.dtype()), " and ", dtype_name(in.dtype()));
  LOOM_CHECK(out.device() == in.device(), op, ": `out` and `in` must be on the same device, got ",
             out.device().str(), " and ", in.device().str());
}

// all_gather's `in` may be this rank's slice of `out` (reduce_scatter's `out` this rank's
// slice of `in`): the in-place form, which both backends run without a copy. Any other
// overlap would read what the collective has already overwritten.
void check_in_place_or_apart(const char* op, const Tensor& whole, const Tensor& part, int rank) {
  auto w = static_cast<const char*>(whole.data_ptr()), p = static_cast<const char*>(part.data_ptr());
  const bool in_place = p == w + int64_t(rank) * part.nbytes();
  const bool apart = p + part.nbytes() <= w || w + whole.nbytes() <= p;
  LOOM_CHECK(in_place || apart, op, ": `out` and `in` overlap other than as slice ", rank,
             " (this rank's) of the larger one: give them separate memory, or make the smaller that slice");
}

void check_peer(const char* op, const char* name, int peer, int rank, int size) {
  LOOM_CHECK(peer >= 0 && peer < size, op, ": `", name, "` = ", peer, " is out of range for a group of size ", size,
             " (expected 0 <= ", name, " < ", size, ")");
  LOOM_CHECK(peer != rank, op, ": `", name, "` = ", peer, " is this rank; name another rank");
}

}  // namespace

WorkPtr ProcessGroup::all_reduce(const Tensor& t, ReduceOp op) {
  check_tensor("all_reduce", "t", t, AllowBytes::no, backend());
  begin_call("all_reduce", t, reduce_op_name(op));
  t.bump_version();  // the result lands in t (Storage::version)
  return all_reduce_impl(t, op);
}

WorkPtr ProcessGroup::broadcast(const Tensor& t, int root) {
  check_tensor("broadcast", "t", t, AllowBytes::yes, backend());
  LOOM_CHECK(root >= 0 && root < size_, "broadcast: `root` = ", root, " is out of range for a group of size ", size_,
             " (expected 0 <= root < ", size_, ")");
  begin_call("broadcast", t, "root " + std::to_string(root));
  t.bump_version();
  return broadcast_impl(t, root);
}

WorkPtr ProcessGroup::all_gather(const Tensor& out, const Tensor& in) {
  check_tensor("all_gather", "out", out, AllowBytes::no, backend());
  check_tensor("all_gather", "in", in, AllowBytes::no, backend());
  check_pair("all_gather", out, in);
  LOOM_CHECK(out.numel() == size_ * in.numel(), "all_gather: `out` must hold size() * in.numel() = ", size_, " * ",
             in.numel(), " = ", size_ * in.numel(), " elements, got ", out.numel(), " (shape ", shape_str(out.shape()),
             ")");
  check_in_place_or_apart("all_gather", out, in, rank_);
  begin_call("all_gather", in, "");
  out.bump_version();
  return all_gather_impl(out, in);
}

WorkPtr ProcessGroup::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) {
  check_tensor("reduce_scatter", "out", out, AllowBytes::no, backend());
  check_tensor("reduce_scatter", "in", in, AllowBytes::no, backend());
  check_pair("reduce_scatter", out, in);
  LOOM_CHECK(in.numel() == size_ * out.numel(), "reduce_scatter: `in` must hold size() * out.numel() = ", size_,
             " * ", out.numel(), " = ", size_ * out.numel(), " elements, got ", in.numel(), " (shape ",
             shape_str(in.shape()), ")");
  check_in_place_or_apart("reduce_scatter", in, out, rank_);
  begin_call("reduce_scatter", in, reduce_op_name(op));
  out.bump_version();
  return reduce_scatter_impl(out, in, op);
}

WorkPtr ProcessGroup::send(const Tensor& t, int dst, int tag) {
  check_tensor("send", "t", t, AllowBytes::yes, backend());
  LOOM_CHECK(tag >= 0, "send: `tag` = ", tag, " must be >= 0");
  check_peer("send", "dst", dst, rank_, size_);
  return send_impl(t, dst, tag);
}

WorkPtr ProcessGroup::recv(const Tensor& t, int src, int tag) {
  check_tensor("recv", "t", t, AllowBytes::yes, backend());
  LOOM_CHECK(tag >= 0, "recv: `tag` = ", tag, " must be >= 0");
  check_peer("recv", "src", src, rank_, size_);
  t.bump_version();
  return recv_impl(t, src, tag);
}

std::vector<WorkPtr> ProcessGroup::batch_isend_irecv(const std::vector<P2POp>& ops) {
  for (const P2POp& op : ops) {
    bool sending = op.kind == P2POp::Kind::send;
    const char* name = sending ? "batch_isend_irecv (send)" : "batch_isend_irecv (recv)";
    check_tensor(name, "tensor", op.tensor, AllowBytes::yes, backend());
    LOOM_CHECK(op.tag >= 0, name, ": `tag` = ", op.tag, " must be >= 0");
    check_peer(name, "peer", op.peer, rank_, size_);
    if (!sending) op.tensor.bump_version();
  }
  if (ops.empty()) return {};
  return batch_impl(ops);
}

std::vector<WorkPtr> ProcessGroup::batch_impl(const std::vector<P2POp>& ops) {
  std::vector<WorkPtr> works;
  works.reserve(ops.size());
  for (const P2POp& op : ops)
    works.push_back(op.kind == P2POp::Kind::send ? send_impl(op.tensor, op.peer, op.tag)
                                                 : recv_impl(op.tensor, op.peer, op.tag));
  return works;
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks) {
  return new_group(ranks, options_);
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks, ProcessGroupOptions options) {
  std::string listed;
  for (int r : ranks) listed += (listed.empty() ? "" : ",") + std::to_string(r);
  listed = "[" + listed + "]";
  LOOM_CHECK(!ranks.empty(), "new_group: the list of ranks is empty; expected the ranks of the new group");
  std::vector<bool> seen(size_, false);
  int mine = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    int r = ranks[i];
    LOOM_CHECK(r >= 0 && r < size_, "new_group: rank ", r, " in ", listed, " is out of range for a group of size ",
               size_, " (expected 0 <= rank < ", size_, ")");
    LOOM_CHECK(!seen[r], "new_group: rank ", r, " appears twice in ", listed);
    seen[r] = true;
    if (r == rank_) mine = int(i);
  }
  const int number = subgroups_made_++;  // counted on every rank, member or not
  if (mine < 0) return nullptr;
  auto sub_store = std::make_shared<PrefixStore>(store_, "group/" + std::to_string(number) + "/");
  // Every member must have passed the same list, or the members would wait for each other
  // in different groups: the first member publishes its list, the others compare.
  if (mine == 0) {
    sub_store->set("ranks", listed);
  } else {
    std::string first;
    try {
      first = text(sub_store->get("ranks", options.timeout));
    } catch (const StoreTimeout&) {
      LOOM_FAIL("new_group #", number, ": rank ", ranks[0], " (the first of ", listed, ") did not make the group within ",
                options.timeout.count(), " ms: every rank must call new_group in the same order");
    }
    LOOM_CHECK(first == listed, "new_group #", number, ": rank ", rank_, " asked for ranks ", listed, " but rank ",
               ranks[0], " asked for ", first, ": every rank must call new_group in the same order with the same list");
  }
  auto group = make_subgroup(sub_store, mine, int(ranks.size()), options);
  for (size_t i = 0; i < ranks.size(); ++i) group->world_ranks_[i] = world_ranks_[ranks[i]];
  return group;
}

WorkPtr ProcessGroup::barrier() {
  begin_call("barrier", Tensor(), "");
  return barrier_impl();
}

// ---- naming calls and the ledger ---------------------------------------------------------

std::string ProcessGroup::describe_call(const char* op, const Tensor& t, const std::string& detail) const {
  std::string out = op;
  if (!is_point_to_point(op)) out += " #" + std::to_string(seq_);
  std::string inside = detail;
  if (t.defined()) {
    if (!inside.empty()) inside += ", ";
    inside += std::string(dtype_name(t.dtype())) + ", " + shape_str(t.shape());
  }
  if (!inside.empty()) out += " (" + inside + ")";
  return out;
}

void ProcessGroup::begin_call(const char* op, const Tensor& t, const std::string& detail) {
  ++seq_;
  if (!options_.debug) return;
  const std::string mine = describe_call(op, t, detail);
  store_->set(ledger_key(backend(), seq_, rank_), mine);

  // Rank 0 compares with every rank, every other rank with rank 0: both sides report
  // "rank r called X but rank 0 called Y".
  auto mismatch = [&](int r, const std::string& called_by_r, const std::string& called_by_0) {
    LOOM_FAIL("collective mismatch (debug ledger): rank ", r, " called ", called_by_r, " but rank 0 called ",
              called_by_0, ": every rank must call the same collectives in the same order, with the same dtype",
              " and shape");
  };
  auto fetch = [&](int other) {
    try {
      return text(store_->get(ledger_key(backend(), seq_, other), options_.timeout));
    } catch (const StoreTimeout&) {
      LOOM_FAIL("debug ledger: rank ", other, " did not reach collective #", seq_, " within ",
                options_.timeout.count(), " ms while rank ", rank_, " called ", mine,
                ": did rank ", other, " stop, hang, or call fewer collectives?");
    }
  };

  if (rank_ != 0) {
    std::string root = fetch(0);
    if (root != mine) mismatch(rank_, mine, root);
    return;
  }
  for (int r = 1; r < size_; ++r) {
    std::string theirs = fetch(r);
    if (theirs != mine) mismatch(r, theirs, mine);
  }
  if (seq_ > 1)
    for (int r = 0; r < size_; ++r) store_->delete_key(ledger_key(backend(), seq_ - 1, r));
}

}  // namespace loom::dist
