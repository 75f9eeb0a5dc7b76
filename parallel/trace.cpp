// The step timeline (trace.h): the process's recorder, the exchange that brings every rank's
// events to rank 0 on one clock, the Chrome-trace JSON writer, and the busy/idle measure.
#include "parallel/trace.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>

#include "engine/ops.h"
#include "parallel/process_group.h"

namespace loom::dist::trace {

namespace detail {
std::atomic<bool> enabled{false};
}

namespace {

std::mutex g_mutex;
std::vector<Event> g_events;
// The CUDA device whose compute stream spans wait for, as its index; -1: none.
std::atomic<int> g_synchronize_on{-1};

void synchronize_if_asked() {
  const int index = g_synchronize_on.load(std::memory_order_relaxed);
  if (index >= 0) synchronize(Device::cuda(index));
}

// ---- serialization for the exchange: little-endian host layout, both ends are Loom --------

template <class T>
void put(std::vector<uint8_t>& out, T value) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}

template <class T>
T take(const uint8_t*& p, const uint8_t* end) {
  LOOM_ASSERT(p + sizeof(T) <= end, "trace: a rank's serialized events end early");
  T value;
  std::memcpy(&value, p, sizeof(T));
  p += sizeof(T);
  return value;
}

struct Payload {
  int64_t barrier_ns = 0;  // the rank's clock just after the merge's barrier
  uint64_t host = 0;       // a hash of its host name
  std::vector<Event> events;
};

std::vector<uint8_t> serialize(const Payload& payload) {
  std::vector<uint8_t> out;
  put(out, payload.barrier_ns);
  put(out, payload.host);
  put(out, uint64_t(payload.events.size()));
  for (const Event& e : payload.events) {
    put(out, uint32_t(e.name.size()));
    out.insert(out.end(), e.name.begin(), e.name.end());
    put(out, uint8_t(e.category));
    put(out, int32_t(e.lane));
    put(out, int32_t(e.microbatch));
    put(out, int32_t(e.stage));
    put(out, e.bytes);
    put(out, e.start_ns);
    put(out, e.end_ns);
  }
  return out;
}

Payload deserialize(const uint8_t* p, const uint8_t* end) {
  Payload payload;
  payload.barrier_ns = take<int64_t>(p, end);
  payload.host = take<uint64_t>(p, end);
  const uint64_t n = take<uint64_t>(p, end);
  for (uint64_t i = 0; i < n; ++i) {
    Event& e = payload.events.emplace_back();
    const uint32_t length = take<uint32_t>(p, end);
    LOOM_ASSERT(p + length <= end, "trace: a rank's serialized events end early");
    e.name.assign(reinterpret_cast<const char*>(p), length);
    p += length;
    e.category = Category(take<uint8_t>(p, end));
    e.lane = take<int32_t>(p, end);
    e.microbatch = take<int32_t>(p, end);
    e.stage = take<int32_t>(p, end);
    e.bytes = take<int64_t>(p, end);
    e.start_ns = take<int64_t>(p, end);
    e.end_ns = take<int64_t>(p, end);
  }
  return payload;
}

uint64_t host_hash() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return std::hash<std::string>{}(name);
}

// ---- JSON ---------------------------------------------------------------------------------

void append_escaped(std::string& out, std::string_view text) {
  out += '"';
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(c));
      out += buf;
    } else {
      out += c;
    }
  }
  out += '"';
}

std::string microseconds(int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", double(ns) / 1000.0);
  return buf;
}

std::string lane_name(int lane) {
  if (lane == kComputeLane) return "compute";
  if (lane == kCommunicationLane) return "communication";
  return "lane " + std::to_string(lane);
}

}  // namespace

const char* category_name(Category category) {
  switch (category) {
    case Category::step: return "step";
    case Category::forward: return "forward";
    case Category::backward: return "backward";
    case Category::backward_weight: return "backward-weight";
    case Category::optimizer: return "optimizer";
    case Category::send: return "send";
    case Category::recv: return "recv";
    case Category::allreduce: return "allreduce";
    case Category::allgather: return "allgather";
    case Category::reduce_scatter: return "reduce-scatter";
    case Category::broadcast: return "broadcast";
    case Category::idle: return "idle";
    case Category::other: return "other";
  }
  return "other";
}

int default_lane(Category category) {
  switch (category) {
    case Category::send:
    case Category::recv:
    case Category::allreduce:
    case Category::allgather:
    case Category::reduce_scatter:
    case Category::broadcast: return kCommunicationLane;
    default: return kComputeLane;
  }
}

void set_enabled(bool on, Device synchronize_on) {
  g_synchronize_on.store(on && synchronize_on.is_cuda() ? synchronize_on.index : -1);
  detail::enabled.store(on);
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

// Records a span whatever the switch says (a Span begun while enabled ends after a disable).
void push(std::string_view name, Category category, int64_t start_ns, int64_t end_ns, const Args& args) {
  Event e;
  e.name = name;
  e.category = category;
  e.start_ns = start_ns;
  e.end_ns = std::max(start_ns, end_ns);
  e.lane = args.lane >= 0 ? args.lane : default_lane(category);
  e.microbatch = args.microbatch;
  e.stage = args.stage;
  e.bytes = args.bytes;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.push_back(std::move(e));
}

}  // namespace

void record(std::string_view name, Category category, int64_t start_ns, int64_t end_ns, Args args) {
  if (enabled()) push(name, category, start_ns, end_ns, args);
}

std::vector<Event> events() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_events;
}

void clear() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.clear();
}

Span::Span(std::string_view name, Category category, Args args) {
  if (!enabled()) return;
  active_ = true;
  name_ = name;
  category_ = category;
  args_ = args;
  synchronize_if_asked();
  start_ns_ = now_ns();
}

void Span::end() {
  if (!active_) return;
  active_ = false;
  synchronize_if_asked();
  push(name_, category_, start_ns_, now_ns(), args_);
}

// ---- merging --------------------------------------------------------------------------------

std::vector<Event> gather_events(ProcessGroup& group, Device device) {
  // Every rank leaves the barrier at nearly the same moment: each reads its clock there.
  group.barrier()->wait();
  if (device.is_cuda()) synchronize(device);
  Payload mine;
  mine.barrier_ns = now_ns();
  mine.host = host_hash();
  mine.events = events();
  std::vector<uint8_t> bytes = serialize(mine);
  bytes.resize((bytes.size() + 7) / 8 * 8, 0);
  const int64_t words = int64_t(bytes.size() / 8);

  // The sizes first, then every payload padded to the largest (all_gather takes equal sizes).
  const int world = group.size();
  Tensor sizes = Tensor::empty({int64_t(world)}, DType::i64, device);
  group.all_gather(sizes, from_vector(std::vector<int64_t>{words}, {1}, device))->wait();
  const std::vector<int64_t> counts = sizes.to(Device::cpu()).to_vector<int64_t>();
  const int64_t longest = *std::max_element(counts.begin(), counts.end());
  Tensor padded = zeros({longest}, DType::i64);
  std::memcpy(padded.data_ptr(), bytes.data(), bytes.size());
  Tensor all = Tensor::empty({int64_t(world) * longest}, DType::i64, device);
  group.all_gather(all, padded.to(device))->wait();
  if (group.rank() != 0) return {};

  Tensor host = all.to(Device::cpu());
  const auto* base = static_cast<const uint8_t*>(host.data_ptr());
  std::vector<Payload> ranks;
  for (int r = 0; r < world; ++r) {
    const uint8_t* begin = base + size_t(r) * size_t(longest) * 8;
    ranks.push_back(deserialize(begin, begin + size_t(counts[size_t(r)]) * 8));
  }
  std::vector<Event> merged;
  for (int r = 0; r < world; ++r) {
    // One host, one steady_clock; another host's clock is moved onto rank 0's at the barrier.
    const int64_t shift = ranks[size_t(r)].host == ranks[0].host ? 0 : ranks[0].barrier_ns - ranks[size_t(r)].barrier_ns;
    for (Event& e : ranks[size_t(r)].events) {
      e.rank = r;
      e.start_ns += shift;
      e.end_ns += shift;
      merged.push_back(std::move(e));
    }
  }
  std::stable_sort(merged.begin(), merged.end(), [](const Event& a, const Event& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.start_ns < b.start_ns;
  });
  return merged;
}

std::string chrome_trace_json(const std::vector<Event>& events) {
  int64_t origin = 0;
  if (!events.empty()) {
    origin = events[0].start_ns;
    for (const Event& e : events) origin = std::min(origin, e.start_ns);
  }
  std::string out = "{\"traceEvents\":[\n";
  bool first = true;
  auto next = [&] {
    if (!first) out += ",\n";
    first = false;
  };
  std::map<int, std::set<int>> lanes;  // rank -> its lanes
  for (const Event& e : events) lanes[e.rank].insert(e.lane);
  for (const auto& [rank, rank_lanes] : lanes) {
    next();
    out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + std::to_string(rank) +
           ",\"args\":{\"name\":\"rank " + std::to_string(rank) + "\"}},\n";
    out += "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + std::to_string(rank) +
           ",\"args\":{\"sort_index\":" + std::to_string(rank) + "}}";
    for (int lane : rank_lanes) {
      out += ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + std::to_string(rank) +
             ",\"tid\":" + std::to_string(lane) + ",\"args\":{\"name\":\"" + lane_name(lane) + "\"}}";
    }
  }
  for (const Event& e : events) {
    next();
    out += "{\"name\":";
    append_escaped(out, e.name);
    out += ",\"cat\":\"";
    out += category_name(e.category);
    out += "\",\"ph\":\"X\",\"pid\":" + std::to_string(e.rank) + ",\"tid\":" + std::to_string(e.lane) +
           ",\"ts\":" + microseconds(e.start_ns - origin) + ",\"dur\":" + microseconds(e.end_ns - e.start_ns);
    std::string args;
    auto arg = [&args](const char* key, int64_t value) {
      if (value < 0) return;
      args += std::string(args.empty() ? "" : ",") + "\"" + key + "\":" + std::to_string(value);
    };
    arg("microbatch", e.microbatch);
    arg("stage", e.stage);
    arg("bytes", e.bytes);
    if (!args.empty()) out += ",\"args\":{" + args + "}";
    out += "}";
  }
  out += "\n],\"displayTimeUnit\":\"ms\"}\n";
  return out;
}

void write_chrome_trace(const std::string& path, const std::vector<Event>& events) {
  const std::string text = chrome_trace_json(events);
  const std::string temporary = path + ".tmp";
  {
    std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
    LOOM_CHECK(file.good(), "trace: cannot write ", temporary, " (", std::strerror(errno),
               "): give --trace a path in a folder that exists and can be written");
    file.write(text.data(), std::streamsize(text.size()));
    file.close();
    LOOM_CHECK(!file.fail(), "trace: writing ", temporary, " failed (", std::strerror(errno), ")");
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  LOOM_CHECK(!error, "trace: cannot rename ", temporary, " to ", path, ": ", error.message());
}

void write_merged_trace(ProcessGroup* group, Device device, const std::string& path) {
  if (group == nullptr) {
    write_chrome_trace(path, events());
    return;
  }
  std::vector<Event> merged = gather_events(*group, device);
  if (group->rank() == 0) write_chrome_trace(path, merged);
}

// ---- busy and idle ----------------------------------------------------------------------------

std::vector<Category> compute_categories() {
  return {Category::forward, Category::backward, Category::backward_weight};
}

std::vector<RankUtilization> utilization(const std::vector<Event>& events, int64_t start_ns, int64_t end_ns,
                                         const std::vector<Category>& busy) {
  std::map<int, std::vector<std::pair<int64_t, int64_t>>> spans;  // rank -> busy intervals in the window
  for (const Event& e : events) {
    auto& mine = spans[e.rank];
    if (std::find(busy.begin(), busy.end(), e.category) == busy.end()) continue;
    const int64_t a = std::max(e.start_ns, start_ns), b = std::min(e.end_ns, end_ns);
    if (a < b) mine.emplace_back(a, b);
  }
  std::vector<RankUtilization> out;
  for (auto& [rank, intervals] : spans) {
    std::sort(intervals.begin(), intervals.end());
    RankUtilization u;
    u.rank = rank;
    u.window_ns = std::max<int64_t>(0, end_ns - start_ns);
    int64_t covered_to = start_ns;  // the union so far ends here
    for (const auto& [a, b] : intervals) {
      const int64_t from = std::max(a, covered_to);
      if (b > from) {
        u.busy_ns += b - from;
        covered_to = b;
      }
    }
    out.push_back(u);
  }
  return out;
}

std::vector<RankUtilization> utilization(const std::vector<Event>& events, const std::vector<Category>& busy) {
  if (events.empty()) return {};
  int64_t start = events[0].start_ns, end = events[0].end_ns;
  for (const Event& e : events) {
    start = std::min(start, e.start_ns);
    end = std::max(end, e.end_ns);
  }
  return utilization(events, start, end, busy);
}

double bubble_fraction(const std::vector<RankUtilization>& ranks) {
  int64_t idle = 0, window = 0;
  for (const RankUtilization& u : ranks) {
    idle += u.idle_ns();
    window += u.window_ns;
  }
  return window > 0 ? double(idle) / double(window) : 0.0;
}

}  // namespace loom::dist::trace
