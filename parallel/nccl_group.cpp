// The NCCL process group: collectives over CUDA tensors, one process per GPU, as c10d's
// ProcessGroupNCCL. Written against NCCL 2.28; needs 2.14 or later (non-blocking
// communicators, ncclCommFinalize, ncclAvg).
//
// Bootstrap. Rank 0 asks NCCL for a unique id and sets it in the store under
// "nccl/<n>/id", n counting the NCCL groups this process has made on that store (every
// rank makes its groups in the same order, so the numbers agree; a sub-group has a store of
// its own, new_group); the others get it, and every rank calls ncclCommInitRankConfig on
// its device.
//
// Streams. Each group owns a stream. A collective records an event on the device's compute
// stream and makes the group's stream wait for it, so NCCL reads what the compute stream
// wrote before the call; NCCL runs there, and an end event is recorded after it.
// Work::wait() makes the compute stream wait for that end event; the host does not block
// (barrier excepted: it waits on the host, as its name promises). The group holds the
// storages a collective touches until its end event has completed, so the caching
// allocator cannot hand their memory to new tensors while NCCL still reads or writes it,
// even when the caller drops every handle right after the call.
//
// Point to point. NCCL has no tags: the sends from one rank to another are matched with
// that rank's receives in the order both were issued, and `tag` only reaches the debug
// ledger. A send finishes once the peer has posted the matching receive, so two ranks that
// exchange must not both send first: one sends then receives, the other the reverse; or
// both post the pair in one batch_isend_irecv, one NCCL group call.
//
// Failure. The communicator is non-blocking (ncclConfig_t::blocking = 0): no NCCL call holds
// the host, so initialisation, connection set-up and teardown all run against the deadline
// of ProcessGroupOptions::timeout and can be aborted. A watchdog thread per group polls the
// end events and ncclCommGetAsyncError. When the oldest collective has been outstanding
// longer than the timeout (counted from the host's call, as in c10d), or NCCL reports an
// error, it prints this rank, the call and the time waited, names the ranks that have not
// reached the call (nccl_group.h), aborts the communicator and ends the process with status
// 1; so does a call that NCCL fails. No error is handed back instead: an aborted
// communicator cannot be used again, and the streams hold work (the collective, and
// whatever the compute stream queued behind Work::wait()) that will never finish, so the
// process cannot go on; the launcher sees the exit and stops the other ranks. Should
// ncclCommAbort itself hang, the process exits anyway after kAbortLimit. Initialisation is
// the exception: nothing is queued yet, so a failure or timeout there throws loom::Error.
//
// Threads. Every NCCL call on the communicator is made under nccl_mutex_, so the watchdog's
// queries and its abort never overlap the caller's calls (NCCL is not thread-safe on one
// communicator). Progress entries are written by a thread of their own: a store request can
// queue behind a slow one, and the watchdog must never wait.
#include "parallel/nccl_group.h"

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "kernels/config.h"
#include "kernels/core/error.h"
#include "parallel/process_group.h"
#include "parallel/rendezvous.h"

#if LOOM_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "engine/ops.h"
#include "engine/storage.h"
#include "kernels/cuda/check.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "Loom's NCCL group needs NCCL 2.14 or later (non-blocking communicators)"
#endif
#endif

namespace loom::dist {

#if LOOM_WITH_NCCL

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr auto kWatchInterval = 100ms;    // how often the watchdog looks at the outstanding work
constexpr auto kPublishInterval = 1s;     // progress entries are written at most this often
constexpr auto kStoreReadLimit = 5s;      // reading the other ranks' progress after a timeout
constexpr auto kNcclLockLimit = 2s;       // the watchdog's wait for the caller to leave an NCCL call
constexpr auto kAbortLimit = 10s;         // the process exits even if ncclCommAbort has not returned
constexpr auto kPublisherStopLimit = 2s;  // the destructor's wait for the last progress write

// Set by the first thread that ends the process, so two failing groups print one story.
std::atomic<bool> g_ending{false};
// Set when the process exits normally with a group still alive: the CUDA runtime is being
// torn down, and the watchdog must stop watching rather than report its errors.
std::atomic<bool> g_exiting{false};

std::string seconds(Clock::duration d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", std::chrono::duration<double>(d).count());
  return text;
}

std::string version_text(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." + std::to_string(code % 100);
}

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
  }
  LOOM_ASSERT(false, "no NCCL type for dtype ", dtype_name(dtype));
}

// ncclAvg divides the sum by the number of ranks; on integers it truncates toward zero,
// which is the contract's rounding. Over one rank the mean is the rank's own value, so avg
// is asked of NCCL as sum: its one-rank avg is a scaling kernel over the whole buffer (a
// read and a write of every element, about 40 us a step for DDP's ResNet-18 buckets on an
// H200, plus 5 us of host time a call), where its in-place one-rank sum moves nothing.
ncclRedOp_t nccl_op(ReduceOp op, int ranks) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ranks == 1 ? ncclSum : ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  LOOM_ASSERT(false, "unknown ReduceOp ", static_cast<int>(op));
}

class CudaEvent {
 public:
  CudaEvent() { LOOM_CUDA(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~CudaEvent() { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }
  // Whether the work queued before the last record has finished; throws on a CUDA error.
  bool done() const {
    cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      cudaGetLastError();  // "not ready" is an answer, not an error to leave behind
      return false;
    }
    LOOM_CUDA(status);
    return true;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

// What the watchdog's message says about a call.
struct CallInfo {
  std::string what;        // describe_call's text
  int64_t collective = 0;  // the collective's sequence number; 0 for send and recv
  std::string waits_for;   // send and recv: the peer that must issue the matching call
};

// One NCCL call in flight.
struct Pending {
  CallInfo info;
  Clock::time_point issued_at;
  CudaEvent done;  // recorded on the group's stream after the NCCL call
  // Guarded by NcclGroup::mutex_: whether `done` has been recorded (an event never recorded
  // reads as complete), and the storages held until it completes.
  bool recorded = false;
  std::vector<std::shared_ptr<Storage>> storages;
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<Pending> pending, Device device) : pending_(std::move(pending)), device_(device) {}
  void wait() override {
    auto compute = static_cast<cudaStream_t>(compute_stream(device_));
    LOOM_CUDA(cudaStreamWaitEvent(compute, pending_->done.get(), 0));
  }
  bool is_completed() override { return pending_->done.done(); }

 private:
  std::shared_ptr<Pending> pending_;
  Device device_;
};

// What the progress thread shares with its group; shared, so the thread may outlive a
// group whose store stopped answering.
struct Progress {
  std::atomic<int64_t> completed{0}, issued{0};
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false;      // guarded by mutex
  bool finished = false;  // the thread has returned; guarded by mutex
};

// Writes `progress` under `key` whenever it changed, at most once per kPublishInterval,
// until told to stop (after one last write) or until the store fails (rank 0 gone).
void publish_progress(std::shared_ptr<Store> store, std::string key, std::shared_ptr<Progress> progress) {
  std::string last = detail::nccl_progress_value(0, 0);  // written by the constructor
  for (bool stopping = false; !stopping;) {
    {
      std::unique_lock lock(progress->mutex);
      progress->wake.wait_for(lock, kPublishInterval, [&] { return progress->stop; });
      stopping = progress->stop;
    }
    std::string value = detail::nccl_progress_value(progress->completed, progress->issued);
    if (value == last) continue;
    try {
      store->set(key, value);
      last = value;
    } catch (const std::exception&) {
      break;  // nobody is left to read it
    }
  }
  {
    std::lock_guard lock(progress->mutex);
    progress->finished = true;
  }
  progress->wake.notify_all();
}

// set_current_device, for use in a member initialiser list.
Device made_current(Device device) {
  LOOM_CHECK(device.is_cuda(), "an NCCL group serves a CUDA device, got ", device.str(),
             ": pass Device::cuda(LOCAL_RANK), or use new_gloo_group for CPU ranks");
  set_current_device(device);
  return device;
}

class NcclGroup final : public ProcessGroup {
 public:
  NcclGroup(std::shared_ptr<Store> store, int rank, int size, Device device, ProcessGroupOptions options, int group);
  ~NcclGroup() override;
  std::string backend() const override { return "nccl"; }

 protected:
  WorkPtr all_reduce_impl(const Tensor& t, ReduceOp op) override;
  WorkPtr broadcast_impl(const Tensor& t, int root) override;
  WorkPtr all_gather_impl(const Tensor& out, const Tensor& in) override;
  WorkPtr reduce_scatter_impl(const Tensor& out, const Tensor& in, ReduceOp op) override;
  WorkPtr send_impl(const Tensor& t, int dst, int tag) override;
  WorkPtr recv_impl(const Tensor& t, int src, int tag) override;
  WorkPtr barrier_impl() override;
  std::vector<WorkPtr> batch_impl(const std::vector<P2POp>& ops) override;
  std::shared_ptr<ProcessGroup> make_subgroup(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options) override {
    return new_nccl_group(std::move(store), rank, size, device_, options);
  }

 private:
  void init_communicator(const ncclUniqueId& id);
  CallInfo collective(const char* op, const Tensor& t, const std::string& detail = "") const;
  template <class Call>
  WorkPtr enqueue(CallInfo info, const std::vector<Tensor>& tensors, size_t count, Call call);
  ncclResult_t settle(Clock::time_point deadline);
  std::string error_text(ncclResult_t result);
  void reap_locked();
  void watch();
  void stop_threads();
  void release_communicator(bool drained);
  [[noreturn]] void fail(const std::string& why, const CallInfo& call);
  std::string others_progress(int64_t call);
  void check_device(const char* op, const Tensor& t) const;
  std::string where() const;
  cudaStream_t nccl_stream() const { return static_cast<cudaStream_t>(stream_.handle()); }

  Device device_;
  int group_;
  Duration timeout_;
  std::string comm_name_;
  Stream stream_;    // where NCCL runs
  CudaEvent ready_;  // recorded on the compute stream before each collective
  Tensor barrier_buffer_;

  std::timed_mutex nccl_mutex_;  // held for every NCCL call on comm_
  ncclComm_t comm_ = nullptr;

  std::mutex issue_mutex_;  // one call issued at a time, so pending_ is in stream order

  std::mutex mutex_;  // guards pending_ (and the storages they hold) and stop_
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Pending>> pending_;
  bool stop_ = false;

  std::shared_ptr<Progress> progress_ = std::make_shared<Progress>();
  std::thread watchdog_, publisher_;
};

NcclGroup::NcclGroup(std::shared_ptr<Store> store, int rank, int size, Device device, ProcessGroupOptions options,
                     int group)
    : ProcessGroup(std::move(store), rank, size, options),
      device_(made_current(device)),
      group_(group),
      timeout_(Store::bounded(options.timeout)),
      comm_name_("loom-nccl-" + std::to_string(group)),
      stream_(device_) {
  // Registered once CUDA is up, so it runs before the CUDA runtime's own exit handlers.
  static const bool on_exit = std::atexit([] { g_exiting = true; }) == 0;
  (void)on_exit;
  barrier_buffer_ = zeros({1}, DType::f32, device_);
  // The entry that tells the others this rank has joined (read when a peer times out).
  this->store().set(detail::nccl_progress_key(group_, rank), detail::nccl_progress_value(0, 0));
  std::string id_key = "nccl/" + std::to_string(group_) + "/id";
  ncclUniqueId id;
  if (rank == 0) {
    LOOM_NCCL(ncclGetUniqueId(&id));
    this->store().set(id_key, Bytes(reinterpret_cast<const uint8_t*>(&id), reinterpret_cast<const uint8_t*>(&id + 1)));
  } else {
    Bytes bytes;
    try {
      bytes = this->store().get(id_key, timeout_);
    } catch (const StoreTimeout& e) {
      LOOM_FAIL(where(), ": rank 0 did not publish the NCCL id (", id_key, ") within the timeout: did rank 0 start, ",
                "and has it made as many NCCL groups as this rank? (", e.what(), ")");
    }
    LOOM_CHECK(bytes.size() == sizeof id, where(), ": the store holds ", bytes.size(), " bytes under ", id_key,
               " where an NCCL id of ", sizeof id, " was expected: does something else write there?");
    std::memcpy(&id, bytes.data(), sizeof id);
  }
  init_communicator(id);
  try {
    watchdog_ = std::thread([this] { watch(); });
    publisher_ = std::thread(publish_progress, store_ptr(), detail::nccl_progress_key(group_, rank), progress_);
  } catch (...) {
    stop_threads();
    release_communicator(false);
    throw;
  }
}

NcclGroup::~NcclGroup() {
  bool drained = false;
  try {
    set_current_device(device_);
    // Let the outstanding work finish; the watchdog still ends the process if it hangs.
    while (!drained) {
      {
        std::lock_guard lock(mutex_);
        reap_locked();
        drained = pending_.empty();
      }
      if (!drained) std::this_thread::sleep_for(1ms);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom: NCCL %s: %s; aborting the communicator\n", where().c_str(), e.what());
  }
  stop_threads();
  release_communicator(drained);
}

void NcclGroup::init_communicator(const ncclUniqueId& id) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = comm_name_.c_str();
  LOOM_CUDA(cudaSetDevice(device_.index));  // NCCL binds the communicator to the current device
  auto start = Clock::now();
  ncclResult_t result;
  {
    std::lock_guard lock(nccl_mutex_);
    result = ncclCommInitRankConfig(&comm_, size(), id, rank(), &config);
  }
  if (result == ncclInProgress && comm_) result = settle(start + timeout_);
  if (result == ncclSuccess) return;
  std::string why = result == ncclInProgress
                        ? "NCCL initialisation did not finish within " + seconds(timeout_) + ": " + others_progress(0)
                        : "NCCL initialisation failed: " + error_text(result);
  if (comm_) {
    std::lock_guard lock(nccl_mutex_);
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  LOOM_FAIL(where(), ": ", why);
}

// Polls the communicator while NCCL works in the background and returns its state once
// settled, or ncclInProgress when `deadline` came first.
ncclResult_t NcclGroup::settle(Clock::time_point deadline) {
  for (int polls = 0;; ++polls) {
    ncclResult_t state = ncclSuccess, result;
    {
      std::lock_guard lock(nccl_mutex_);
      result = ncclCommGetAsyncError(comm_, &state);
    }
    if (result != ncclSuccess) return result;
    if (state != ncclInProgress) return state;
    if (Clock::now() >= deadline) return ncclInProgress;
    if (polls < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(1ms);
  }
}

// NCCL's words for `result`, and its last error message when the communicator is free to ask.
std::string NcclGroup::error_text(ncclResult_t result) {
  std::string text = ncclGetErrorString(result);
  if (!comm_ || !nccl_mutex_.try_lock_for(kWatchInterval)) return text;
  const char* last = ncclGetLastError(comm_);
  if (last && *last) text += std::string(" (") + last + ")";
  nccl_mutex_.unlock();
  return text;
}

// Issues one NCCL call on the group's stream, ordered after the compute stream's work.
template <class Call>
WorkPtr NcclGroup::enqueue(CallInfo info, const std::vector<Tensor>& tensors, size_t count, Call call) {
  std::lock_guard issue(issue_mutex_);
  auto compute = static_cast<cudaStream_t>(compute_stream(device_));  // also makes device_ current
  auto pending = std::make_shared<Pending>();
  pending->info = std::move(info);
  const CallInfo& what = pending->info;
  for (const Tensor& t : tensors) pending->storages.push_back(t.storage());
  LOOM_CUDA(cudaEventRecord(ready_.get(), compute));
  LOOM_CUDA(cudaStreamWaitEvent(nccl_stream(), ready_.get(), 0));
  pending->issued_at = Clock::now();
  {
    // Watched from here on, so a call that never returns from NCCL times out as well.
    std::lock_guard lock(mutex_);
    pending_.push_back(pending);
  }
  try {
    if (count > 0) {  // else NCCL has nothing to move; the events still order the streams
      ncclResult_t result;
      {
        std::lock_guard lock(nccl_mutex_);
        result = call(nccl_stream());
      }
      if (result == ncclInProgress) result = settle(pending->issued_at + timeout_);
      // Every error is fatal: a non-blocking communicator keeps even an argument error as
      // its state, and the base class has already checked what a caller can get wrong.
      if (result == ncclInProgress)
        fail(what.what + " could not be issued within the timeout of " + seconds(timeout_) +
                 " (NCCL was still connecting to its peers)",
             what);
      if (result != ncclSuccess) fail("NCCL failed to issue " + what.what + ": " + error_text(result), what);
    }
    LOOM_CUDA(cudaEventRecord(pending->done.get(), nccl_stream()));
  } catch (...) {
    std::lock_guard lock(mutex_);
    pending_.pop_back();  // still the last: calls are issued one at a time, and it was never recorded
    throw;
  }
  if (what.collective > 0) progress_->issued = what.collective;
  std::lock_guard lock(mutex_);
  pending->recorded = true;
  reap_locked();  // frees what finished since the last call without waiting for the watchdog
  return std::make_shared<NcclWork>(pending, device_);
}

// Drops the finished collectives (in stream order, so from the front) and their storages.
void NcclGroup::reap_locked() {
  while (!pending_.empty() && pending_.front()->recorded && pending_.front()->done.done()) {
    if (int64_t n = pending_.front()->info.collective; n > 0) progress_->completed = n;
    pending_.front()->storages.clear();
    pending_.pop_front();
  }
}

void NcclGroup::watch() {
  try {
    set_current_device(device_);
    std::unique_lock lock(mutex_);
    while (!wake_.wait_for(lock, kWatchInterval, [this] { return stop_; }) && !g_exiting) {
      reap_locked();
      CallInfo oldest;
      if (!pending_.empty()) {
        oldest = pending_.front()->info;
        auto waited = Clock::now() - pending_.front()->issued_at;
        if (waited > timeout_) {
          lock.unlock();
          fail(oldest.what + " did not finish within the timeout of " + seconds(timeout_) + " (issued " +
                   seconds(waited) + " ago)",
               oldest);
        }
      }
      lock.unlock();
      // A caller inside a long NCCL call skips this round; the timeout above still applies.
      ncclResult_t state = ncclSuccess, result = ncclSuccess;
      if (nccl_mutex_.try_lock_for(kWatchInterval)) {
        result = ncclCommGetAsyncError(comm_, &state);
        nccl_mutex_.unlock();
      }
      if (result != ncclSuccess) state = result;
      if (state != ncclSuccess && state != ncclInProgress)
        fail("NCCL reported an error: " + error_text(state) +
                 (oldest.what.empty() ? std::string("; no call was in flight")
                                      : "; the oldest call in flight is " + oldest.what),
             oldest);
      lock.lock();
    }
  } catch (const std::exception& e) {
    if (!g_exiting) fail(std::string("the watchdog could not watch the outstanding work: ") + e.what(), CallInfo());
  }
}

void NcclGroup::stop_threads() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (!publisher_.joinable()) return;
  bool finished;
  {
    std::unique_lock lock(progress_->mutex);
    progress_->stop = true;
    progress_->wake.notify_all();
    finished = progress_->wake.wait_for(lock, kPublisherStopLimit, [this] { return progress_->finished; });
  }
  // A store that does not answer must not hold up the destructor; the thread owns what it uses.
  if (finished)
    publisher_.join();
  else
    publisher_.detach();
}

// Finalizes and destroys the communicator once its work has drained, or aborts it.
void NcclGroup::release_communicator(bool drained) {
  if (!comm_) return;
  ncclResult_t result = ncclInternalError;
  if (drained) {
    {
      std::lock_guard lock(nccl_mutex_);
      result = ncclCommFinalize(comm_);
    }
    if (result == ncclSuccess || result == ncclInProgress) result = settle(Clock::now() + timeout_);
    if (result != ncclSuccess)
      std::fprintf(stderr, "loom: NCCL %s: finalizing the communicator failed (%s); aborting it instead\n",
                   where().c_str(), result == ncclInProgress ? "timed out" : error_text(result).c_str());
  }
  std::lock_guard lock(nccl_mutex_);
  if (result == ncclSuccess) {
    result = ncclCommDestroy(comm_);
    if (result != ncclSuccess && result != ncclInProgress)
      std::fprintf(stderr, "loom: NCCL %s: ncclCommDestroy failed: %s\n", where().c_str(), ncclGetErrorString(result));
  } else {
    ncclCommAbort(comm_);
  }
  comm_ = nullptr;
}

void NcclGroup::fail(const std::string& why, const CallInfo& call) {
  if (g_ending.exchange(true)) {
    for (;;) std::this_thread::sleep_for(1h);  // another thread is ending the process
  }
  std::string text = "loom: NCCL " + where() + ": " + why + ".\n";
  if (call.collective > 0) text += "  " + others_progress(call.collective) + ".\n";
  if (!call.waits_for.empty()) text += "  It needs " + call.waits_for + ".\n";
  text +=
      "  Aborting the communicator and exiting with status 1: an aborted NCCL communicator cannot be used "
      "again, and the GPU streams hold work that will never finish.\n";
  std::fputs(text.c_str(), stderr);
  std::fflush(stderr);
  try {
    std::thread([] {
      std::this_thread::sleep_for(kAbortLimit);
      std::fputs("loom: ncclCommAbort did not return in time; exiting without it\n", stderr);
      std::_Exit(1);
    }).detach();
  } catch (...) {
    std::_Exit(1);
  }
  // The caller may be inside an NCCL call on this communicator (non-blocking calls return
  // quickly); aborting alongside it would be a race, so skip the abort if it does not leave.
  if (nccl_mutex_.try_lock_for(kNcclLockLimit) && comm_) ncclCommAbort(comm_);
  std::_Exit(1);
}

// The other ranks' progress, read in a thread of its own so that a store that does not
// answer (rank 0 gone, or the connection busy with a long request) costs kStoreReadLimit.
std::string NcclGroup::others_progress(int64_t call) {
  struct Reading {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    std::string text;
  };
  auto reading = std::make_shared<Reading>();
  auto read = [reading, store = store_ptr(), group = group_, self = rank(), n = size(), call] {
    std::string text;
    try {
      std::vector<std::optional<std::string>> progress(n);
      for (int r = 0; r < n; ++r) {
        std::string key = detail::nccl_progress_key(group, r);
        if (r == self || !store->check({key})) continue;
        Bytes value = store->get(key);
        progress[r] = std::string(value.begin(), value.end());
      }
      text = detail::nccl_ranks_behind(self, call, progress);
    } catch (const std::exception& e) {
      text = std::string("cannot tell which ranks are behind: the store failed (") + e.what() +
             "); rank 0, which serves a TcpStore, may have exited";
    }
    {
      std::lock_guard lock(reading->mutex);
      reading->text = std::move(text);
      reading->done = true;
    }
    reading->done_cv.notify_all();
  };
  try {
    std::thread(read).detach();
  } catch (...) {
    return "cannot tell which ranks are behind (no thread to read the store)";
  }
  std::unique_lock lock(reading->mutex);
  if (!reading->done_cv.wait_for(lock, kStoreReadLimit, [&] { return reading->done; }))
    return "cannot tell which ranks are behind: the store did not answer within " + seconds(kStoreReadLimit) +
           " (rank 0, which serves a TcpStore, may have exited)";
  return reading->text;
}

void NcclGroup::check_device(const char* op, const Tensor& t) const {
  LOOM_CHECK(t.device() == device_, op, ": the tensor is on ", t.device().str(), ", but this NCCL group serves ",
             device_.str(), " (one GPU per process): move it there with .to(Device::cuda(", device_.index, "))");
}

std::string NcclGroup::where() const {
  return "rank " + std::to_string(rank()) + " of " + std::to_string(size()) + " on " + device_.str();
}

// A collective is numbered as the base class numbers it (the "#n" in its description), so
// every rank counts the same calls, and the sends and receives between some ranks only
// do not throw the counts out of step.
CallInfo NcclGroup::collective(const char* op, const Tensor& t, const std::string& detail) const {
  return {describe_call(op, t, detail), sequence_number(), ""};
}

// ---- the collectives (the base class has checked dtypes, shapes, peers and contiguity) ----

struct Buffer {
  void* data;
  size_t count;
  ncclDataType_t type;
};
Buffer buffer(const Tensor& t) { return {t.data_ptr(), static_cast<size_t>(t.numel()), nccl_dtype(t.dtype())}; }

WorkPtr NcclGroup::all_reduce_impl(const Tensor& t, ReduceOp op) {
  check_device("all_reduce", t);
  Buffer b = buffer(t);
  ncclRedOp_t red = nccl_op(op, size());
  return enqueue(collective("all_reduce", t, reduce_op_name(op)), {t}, b.count,
                 [&](cudaStream_t s) { return ncclAllReduce(b.data, b.data, b.count, b.type, red, comm_, s); });
}

WorkPtr NcclGroup::broadcast_impl(const Tensor& t, int root) {
  check_device("broadcast", t);
  Buffer b = buffer(t);
  return enqueue(collective("broadcast", t, "root " + std::to_string(root)), {t}, b.count,
                 [&](cudaStream_t s) { return ncclBroadcast(b.data, b.data, b.count, b.type, root, comm_, s); });
}

// NCCL runs the in-place forms ProcessGroup lets through (all_gather's `in` this rank's
// slice of `out`, reduce_scatter's `out` this rank's slice of `in`) as they are.
WorkPtr NcclGroup::all_gather_impl(const Tensor& out, const Tensor& in) {
  check_device("all_gather", out);
  Buffer send = buffer(in), recv = buffer(out);
  return enqueue(collective("all_gather", in), {out, in}, send.count,
                 [&](cudaStream_t s) { return ncclAllGather(send.data, recv.data, send.count, send.type, comm_, s); });
}

WorkPtr NcclGroup::reduce_scatter_impl(const Tensor& out, const Tensor& in, ReduceOp op) {
  check_device("reduce_scatter", out);
  Buffer send = buffer(in), recv = buffer(out);
  return enqueue(collective("reduce_scatter", in, reduce_op_name(op)), {out, in}, recv.count, [&](cudaStream_t s) {
    return ncclReduceScatter(send.data, recv.data, recv.count, send.type, nccl_op(op, size()), comm_, s);
  });
}

WorkPtr NcclGroup::send_impl(const Tensor& t, int dst, int tag) {
  check_device("send", t);
  Buffer b = buffer(t);
  CallInfo info{describe_call("send", t, "to rank " + std::to_string(dst) + ", tag " + std::to_string(tag)), 0,
                "rank " + std::to_string(dst) + " to issue the matching recv"};
  return enqueue(std::move(info), {t}, b.count,
                 [&](cudaStream_t s) { return ncclSend(b.data, b.count, b.type, dst, comm_, s); });
}

WorkPtr NcclGroup::recv_impl(const Tensor& t, int src, int tag) {
  check_device("recv", t);
  Buffer b = buffer(t);
  CallInfo info{describe_call("recv", t, "from rank " + std::to_string(src) + ", tag " + std::to_string(tag)), 0,
                "rank " + std::to_string(src) + " to issue the matching send"};
  return enqueue(std::move(info), {t}, b.count,
                 [&](cudaStream_t s) { return ncclRecv(b.data, b.count, b.type, src, comm_, s); });
}

// The sends and receives issued as one NCCL group call, so that NCCL may run them in any
// order: one Work (the group's end event) serves them all.
std::vector<WorkPtr> NcclGroup::batch_impl(const std::vector<P2POp>& ops) {
  std::vector<Tensor> tensors;
  std::string what;
  size_t count = 0;
  for (const P2POp& op : ops) {
    bool sending = op.kind == P2POp::Kind::send;
    check_device(sending ? "send" : "recv", op.tensor);
    tensors.push_back(op.tensor);
    count += size_t(op.tensor.numel());
    what += (what.empty() ? "" : ", ") + std::string(sending ? "send to rank " : "recv from rank ") +
            std::to_string(op.peer) + " (tag " + std::to_string(op.tag) + ", " + shape_str(op.tensor.shape()) + ")";
  }
  CallInfo info{"batch_isend_irecv [" + what + "]", 0, "the peers to issue the matching transfers"};
  WorkPtr work = enqueue(std::move(info), tensors, count, [&](cudaStream_t s) {
    ncclResult_t result = ncclGroupStart();
    for (const P2POp& op : ops) {
      if (result != ncclSuccess) break;
      Buffer b = buffer(op.tensor);
      result = op.kind == P2POp::Kind::send ? ncclSend(b.data, b.count, b.type, op.peer, comm_, s)
                                            : ncclRecv(b.data, b.count, b.type, op.peer, comm_, s);
    }
    ncclResult_t ended = ncclGroupEnd();
    return result != ncclSuccess ? result : ended;
  });
  return std::vector<WorkPtr>(ops.size(), work);
}

// An all-reduce of one element that the host waits for: it completes only once every rank
// has issued it, and after all the work this rank queued on the compute stream before it.
WorkPtr NcclGroup::barrier_impl() {
  Buffer b = buffer(barrier_buffer_);
  WorkPtr work = enqueue(collective("barrier", Tensor()), {barrier_buffer_}, 1,
                         [&](cudaStream_t s) { return ncclAllReduce(b.data, b.data, 1, b.type, ncclSum, comm_, s); });
  // Polled rather than cudaEventSynchronize: a barrier can wait minutes for a slow rank,
  // and the watchdog ends the process if it waits past the timeout.
  for (auto nap = 50us; !work->is_completed(); nap = std::min(nap * 2, std::chrono::microseconds(5000)))
    std::this_thread::sleep_for(nap);
  return work;
}

void check_nccl_version() {
  int version = 0;
  LOOM_NCCL(ncclGetVersion(&version));
  LOOM_CHECK(version >= NCCL_VERSION(2, 14, 0), "the NCCL library loaded is ", version_text(version),
             ", but Loom's NCCL group needs 2.14 or later (it was built with ", version_text(NCCL_VERSION_CODE),
             "): put a newer libnccl.so.2 first on LD_LIBRARY_PATH");
}

}  // namespace

std::shared_ptr<ProcessGroup> new_nccl_group(std::shared_ptr<Store> store, int rank, int size, Device device,
                                             ProcessGroupOptions options) {
  check_nccl_version();  // the rest is checked by ProcessGroup's constructor
  LOOM_CHECK(store != nullptr, "new_nccl_group: the store is null; pass the store the ranks met through");
  int number = store->take_group_number("nccl");  // every rank makes its groups in the same order
  return std::make_shared<NcclGroup>(std::move(store), rank, size, device, options, number);
}

#else  // built without NCCL

std::shared_ptr<ProcessGroup> new_nccl_group(std::shared_ptr<Store>, int, int, Device, ProcessGroupOptions) {
  LOOM_FAIL(
      "new_nccl_group: this build of Loom has no NCCL. Install NCCL (the CUDA toolkit's, or libnccl-dev) "
      "and reconfigure with `meson setup --reconfigure -Dnccl=enabled`; CPU ranks can use new_gloo_group");
}

#endif

}  // namespace loom::dist
