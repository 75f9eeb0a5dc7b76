// The step timeline: what each rank did when, recorded as spans and merged across ranks into
// one Chrome-trace JSON file, which Perfetto (ui.perfetto.dev) and chrome://tracing open. It
// shows where a step's time goes: a pipeline's bubbles, DDP's all-reduces beside backward.
//
// Recording. A process has one recorder, off until set_enabled(true). A span is a name, a
// category (forward, backward, backward-weight, optimizer, send, recv, allreduce, ...), a
// start and an end on the process's steady_clock, and optional arguments (micro-batch, stage,
// bytes). An RAII Span records from its construction to its end() or destruction:
//
//   { trace::Span span("forward", trace::Category::forward, {.microbatch = m, .stage = s});
//     y = stage->forward(x); }
//
// Disabled, a Span costs one relaxed atomic load and a branch, and records nothing. Enabled,
// a span takes a mutex once, at its end, so threads other than the main one (DDP's gradient
// hooks, a communication thread) may record too.
//
// Lanes. Each rank is a process in the viewer (pid = rank) with rows (tid = lane): lane 0,
// "compute", holds forward, backward and the optimizer; lane 1, "communication", holds
// send, recv and the collectives. A span's lane follows its category unless Args::lane says
// otherwise. Spans on one lane should nest or follow each other, as the viewer draws them.
//
// Host time and the GPU. Spans are host times. On CUDA an op returns once it is queued, so a
// forward span measures the queuing, not the kernels, unless the recorder synchronizes:
// set_enabled(true, device) with a CUDA device makes every Span wait for that device's
// compute stream at its start and end, so compute spans measure the device's work (at the
// cost of the overlap between host and device). DDP's all-reduce spans run from the bucket's
// launch until the reducer first sees the collective complete (it polls at every gradient
// hook and waits at the end of backward); over Gloo the collective runs on the calling
// thread, so that is its exact duration. FSDP's all-gathers ("all_gather <unit>", with
// " (prefetch)" when issued ahead), reduce-scatters ("reduce_scatter <unit>") and, under
// HSDP, the replicas' all-reduces ("all_reduce <unit> (replicas)") are recorded the same way:
// from their issue until first seen complete.
//
// Merging. write_merged_trace(group, device, path) is called by every rank at the end: the
// ranks meet at a barrier and each reads its clock there; each rank's events are serialized
// and gathered to rank 0 (an all_gather of the sizes, then one of the payloads padded to the
// largest), and rank 0 writes the file. Clocks: ranks on one host share steady_clock, so their
// times are used as they are; a rank on another host is shifted by the difference between
// its clock and rank 0's at the barrier (exact to the barrier's skew, tens of microseconds on
// a LAN). Times in the file are microseconds from the earliest event of the run.
//
// Reading the trace. Open the file in ui.perfetto.dev. Each rank is a process "rank R" with
// its compute and communication rows. In a DDP step, compute shows forward, backward and the
// optimizer; communication shows "all_reduce bucket B" spans, which start during backward as
// each bucket fills (bucket 0 first: the last layers) — the overlap DDP promises is the part
// of each all-reduce under the backward span; an all-reduce that ends after backward is time
// the step waits for communication. In a pipeline, the gaps on a rank's compute row are its
// bubble; utilization() measures them (idle / window), the figure to set beside the
// schedule's formula. Click a span to see its arguments (micro-batch, stage, bytes).
//
// Memory: an event is about 100 bytes; a long run with tracing on keeps every step's events
// until clear() or the merge, so trace a few hundred steps, not an epoch of a large dataset.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "../engine/device.h"

namespace loom::dist {
class ProcessGroup;
}

namespace loom::dist::trace {

enum class Category : uint8_t {
  step,             // a whole training step (encloses the others on the compute lane)
  forward,
  backward,         // backward, or the input-gradient half where backward is split
  backward_weight,  // the weight-gradient half (zero-bubble schedules)
  optimizer,
  send,
  recv,
  allreduce,
  allgather,
  reduce_scatter,
  broadcast,
  idle,             // waiting on purpose (a pipeline stage waiting for its input)
  other,
};
// "forward", "backward-weight", "allreduce", ...: the "cat" field of the JSON.
const char* category_name(Category category);

inline constexpr int kComputeLane = 0;
inline constexpr int kCommunicationLane = 1;
// The lane a category's spans go to by default: communication for send, recv and the
// collectives, compute for the rest.
int default_lane(Category category);

// Optional arguments of a span; -1 means not given.
struct Args {
  int microbatch = -1;
  int stage = -1;
  int64_t bytes = -1;
  int lane = -1;  // -1: default_lane(category)
};

struct Event {
  std::string name;
  Category category = Category::other;
  int64_t start_ns = 0, end_ns = 0;  // steady_clock; after gather_events, on rank 0's clock
  int rank = 0;                      // set by gather_events
  int lane = kComputeLane;
  int microbatch = -1, stage = -1;
  int64_t bytes = -1;
};

namespace detail {
extern std::atomic<bool> enabled;
}

// Whether spans are being recorded (one relaxed load).
inline bool enabled() { return detail::enabled.load(std::memory_order_relaxed); }
// Turns recording on or off. With a CUDA `synchronize_on`, every Span waits for that device's
// compute stream at its start and end (see the header comment); the CPU means never.
void set_enabled(bool on, Device synchronize_on = Device::cpu());
// This process's steady_clock in nanoseconds.
int64_t now_ns();
// Records a finished span (nothing when disabled). Lane -1 becomes default_lane(category).
void record(std::string_view name, Category category, int64_t start_ns, int64_t end_ns, Args args = {});
// A copy of this process's events so far, in the order they ended; clear() drops them.
std::vector<Event> events();
void clear();

// Records [construction, end()) when tracing is enabled at construction.
class Span {
 public:
  Span(std::string_view name, Category category, Args args = {});
  ~Span() { end(); }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  // Ends the span now (later calls, and the destructor, do nothing).
  void end();

 private:
  bool active_ = false;
  std::string name_;
  Category category_ = Category::other;
  Args args_;
  int64_t start_ns_ = 0;
};

// ---- merging and writing ------------------------------------------------------------------

// Every rank of `group` calls this. Rank 0 gets every rank's events (rank set, times on rank
// 0's clock, see the header comment); the other ranks get an empty list. `device` holds the
// exchanged buffers: the CPU for a Gloo group, the rank's GPU for an NCCL one.
std::vector<Event> gather_events(ProcessGroup& group, Device device = Device::cpu());
// The Chrome-trace JSON of `events`: {"traceEvents": [...]} with a process per rank ("rank
// R"), a thread per lane, and one complete ("ph": "X") event per span, times in microseconds
// from the earliest start.
std::string chrome_trace_json(const std::vector<Event>& events);
// Writes chrome_trace_json(events) to `path` (through a temporary name, then renamed);
// throws naming the path when it cannot.
void write_chrome_trace(const std::string& path, const std::vector<Event>& events);
// gather_events, then rank 0 writes `path`. With a null group, this process's events alone.
// Every rank of the group must call it.
void write_merged_trace(ProcessGroup* group, Device device, const std::string& path);

// ---- busy and idle time ---------------------------------------------------------------------

struct RankUtilization {
  int rank = 0;
  int64_t busy_ns = 0;    // the union of the rank's busy spans inside the window
  int64_t window_ns = 0;  // the window's length
  int64_t idle_ns() const { return window_ns - busy_ns; }
  // idle / window: a pipeline's bubble fraction on this rank (0 for an empty window).
  double idle_fraction() const { return window_ns > 0 ? double(idle_ns()) / double(window_ns) : 0.0; }
};

// What counts as busy by default: forward, backward and backward-weight (the work a pipeline
// schedule places; sends, receives and waits are not).
std::vector<Category> compute_categories();

// Busy and idle time of every rank that has events, over the window [start_ns, end_ns)
// (clipped spans count for their part inside it), in rank order. Overlapping busy spans
// count once.
std::vector<RankUtilization> utilization(const std::vector<Event>& events, int64_t start_ns, int64_t end_ns,
                                         const std::vector<Category>& busy = compute_categories());
// The same over the whole run: from the earliest start to the latest end over all ranks.
std::vector<RankUtilization> utilization(const std::vector<Event>& events,
                                         const std::vector<Category>& busy = compute_categories());
// Total idle over total window across ranks: the bubble fraction of the run, the figure to
// compare with a schedule's (p - 1) / (m + p - 1).
double bubble_fraction(const std::vector<RankUtilization>& ranks);

}  // namespace loom::dist::trace
