// The step timeline (parallel/trace.h): a disabled recorder records nothing; a Span records
// its name, category, lane and arguments; the JSON escapes names; busy and idle time follow
// the union of the compute spans inside a window; two Gloo ranks merge into one Chrome-trace
// file that parses, holds both ranks' events under pid = rank on one clock, with sane
// durations; and a DDP step records one all-reduce span per bucket on the communication lane.
//
// Ranks are forked children meeting through a FileStore (as in test_ddp.cpp); a child reports
// through its exit code, and the parent reads the file they wrote.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <thread>

#include "engine/ops.h"
#include "layers/layers.h"
#include "parallel/ddp.h"
#include "parallel/fsdp.h"
#include "parallel/store.h"
#include "parallel/trace.h"

namespace loom::dist {
namespace {

using namespace std::chrono_literals;

// ---- processes (as test_ddp.cpp) -------------------------------------------------------------

std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  return (std::filesystem::path(::testing::TempDir()) /
          (stem + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
      .string();
}

pid_t fork_child(const std::function<void()>& body) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(120);
    ::setenv("LOOM_NUM_THREADS", "1", 1);
    int code = 1;
    try {
      body();
      code = 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", ::getpid(), e.what());
    }
    ::_exit(code);
  }
  return pid;
}

int exit_code(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void run_ranks(int world, const std::function<void(int, std::shared_ptr<ProcessGroup>)>& body) {
  std::string store_path = temp_path("trace_store");
  ProcessGroupOptions options;
  options.timeout = 60s;
  std::vector<pid_t> ranks;
  for (int rank = 0; rank < world; ++rank)
    ranks.push_back(fork_child([&, rank] {
      auto store = std::make_shared<FileStore>(store_path, world, 60s);
      body(rank, new_gloo_group(store, rank, world, options));
    }));
  for (int rank = 0; rank < world; ++rank) EXPECT_EQ(exit_code(ranks[rank]), 0) << "rank " << rank;
  std::filesystem::remove(store_path);
}

template <class... Parts>
void require(bool ok, const Parts&... parts) {
  if (ok) return;
  std::ostringstream os;
  (os << ... << parts);
  throw std::runtime_error(os.str());
}

// ---- a small JSON reader: enough to prove the file is JSON and to walk it ----------------------

struct Json {
  enum class Kind { null, boolean, number, string, array, object } kind = Kind::null;
  double number = 0;
  std::string text;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;

  const Json* find(const std::string& key) const {
    for (const auto& [k, v] : members)
      if (k == key) return &v;
    return nullptr;
  }
};

class JsonReader {
 public:
  explicit JsonReader(const std::string& s) : s_(s) {}
  Json document() {
    Json v = value();
    space();
    if (i_ != s_.size()) fail("text after the document");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(i_));
  }
  void space() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  void expect(char c) {
    space();
    if (i_ >= s_.size() || s_[i_] != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (static_cast<unsigned char>(c) < 0x20) fail("a raw control character in a string");
      if (c == '\\') {
        if (i_ >= s_.size()) fail("an escape at the end");
        char e = s_[i_++];
        if (e == 'u') {
          if (i_ + 4 > s_.size()) fail("a short \\u escape");
          out += char(std::stoi(s_.substr(i_, 4), nullptr, 16));
          i_ += 4;
        } else if (e == 'n') {
          out += '\n';
        } else if (e == '"' || e == '\\' || e == '/') {
          out += e;
        } else {
          fail("an unknown escape");
        }
      } else {
        out += c;
      }
    }
    expect('"');
    return out;
  }
  Json value() {
    space();
    if (i_ >= s_.size()) fail("a missing value");
    Json v;
    const char c = s_[i_];
    if (c == '{') {
      v.kind = Json::Kind::object;
      ++i_;
      space();
      if (s_[i_] == '}') return ++i_, v;
      while (true) {
        std::string key = string();
        expect(':');
        v.members.emplace_back(key, value());
        space();
        if (s_[i_] == ',') {
          ++i_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = Json::Kind::array;
      ++i_;
      space();
      if (s_[i_] == ']') return ++i_, v;
      while (true) {
        v.items.push_back(value());
        space();
        if (s_[i_] == ',') {
          ++i_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = Json::Kind::string;
      v.text = string();
      return v;
    }
    for (const char* word : {"true", "false", "null"})
      if (s_.compare(i_, std::strlen(word), word) == 0) {
        i_ += std::strlen(word);
        v.kind = word[0] == 'n' ? Json::Kind::null : Json::Kind::boolean;
        return v;
      }
    size_t used = 0;
    try {
      v.number = std::stod(s_.substr(i_, 40), &used);
    } catch (const std::exception&) {
      fail("an unexpected character");
    }
    v.kind = Json::Kind::number;
    i_ += used;
    return v;
  }

  const std::string& s_;
  size_t i_ = 0;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ---- the recorder alone ----------------------------------------------------------------------

TEST(Trace, ADisabledRecorderRecordsNothing) {
  trace::set_enabled(false);
  trace::clear();
  { trace::Span span("forward", trace::Category::forward); }
  trace::record("send", trace::Category::send, 0, 10);
  EXPECT_TRUE(trace::events().empty());
}

TEST(Trace, ASpanRecordsItsNameCategoryLaneArgumentsAndDuration) {
  trace::clear();
  trace::set_enabled(true);
  {
    trace::Span span("F3", trace::Category::forward, {.microbatch = 3, .stage = 1});
    std::this_thread::sleep_for(2ms);
  }
  { trace::Span span("bucket", trace::Category::allreduce, {.bytes = 4096}); }
  trace::Span open("never ended", trace::Category::idle);
  trace::set_enabled(false);
  open.end();  // started while enabled: still recorded
  std::vector<trace::Event> events = trace::events();
  trace::clear();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].name, "F3");
  EXPECT_EQ(events[0].category, trace::Category::forward);
  EXPECT_EQ(events[0].lane, trace::kComputeLane);
  EXPECT_EQ(events[0].microbatch, 3);
  EXPECT_EQ(events[0].stage, 1);
  EXPECT_GE(events[0].end_ns - events[0].start_ns, 2'000'000);
  EXPECT_EQ(events[1].lane, trace::kCommunicationLane);
  EXPECT_EQ(events[1].bytes, 4096);
  EXPECT_LE(events[0].end_ns, events[1].start_ns);
  EXPECT_EQ(events[2].category, trace::Category::idle);
}

TEST(Trace, TheJsonEscapesNamesAndParses) {
  trace::Event e;
  e.name = "say \"hi\"\\\n";
  e.start_ns = 5000;
  e.end_ns = 7500;
  const Json doc = JsonReader(trace::chrome_trace_json({e})).document();
  const Json* list = doc.find("traceEvents");
  ASSERT_NE(list, nullptr);
  const Json* x = nullptr;
  for (const Json& item : list->items)
    if (item.find("ph")->text == "X") x = &item;
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(x->find("name")->text, e.name);
  EXPECT_EQ(x->find("ts")->number, 0.0);  // microseconds from the earliest start
  EXPECT_EQ(x->find("dur")->number, 2.5);
}

TEST(Trace, UtilizationCountsTheUnionOfComputeSpansInTheWindow) {
  auto event = [](int rank, trace::Category c, int64_t a, int64_t b) {
    trace::Event e;
    e.rank = rank;
    e.category = c;
    e.start_ns = a;
    e.end_ns = b;
    return e;
  };
  using C = trace::Category;
  const std::vector<trace::Event> events = {
      event(0, C::forward, 0, 10), event(0, C::backward, 20, 40), event(0, C::send, 40, 50),
      event(1, C::forward, 5, 15), event(1, C::backward_weight, 10, 30), event(1, C::forward, 45, 60)};
  auto u = trace::utilization(events, 0, 50);
  ASSERT_EQ(u.size(), 2u);
  EXPECT_EQ(u[0].busy_ns, 30);  // the send is not compute
  EXPECT_EQ(u[0].idle_ns(), 20);
  EXPECT_EQ(u[1].busy_ns, 30);  // [5, 30) once, and [45, 50) of the last span
  EXPECT_DOUBLE_EQ(trace::bubble_fraction(u), 40.0 / 100.0);
  auto whole = trace::utilization(events);  // [0, 60)
  EXPECT_EQ(whole[0].window_ns, 60);
  EXPECT_EQ(whole[1].busy_ns, 40);
}

// ---- two ranks -------------------------------------------------------------------------------

TEST(Trace, TwoGlooRanksMergeIntoOneChromeTraceOnOneClock) {
  const std::string path = temp_path("trace") + ".json";
  run_ranks(2, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    trace::set_enabled(true);
    group->barrier()->wait();
    // Rank 1 starts 30 ms after rank 0: the merged file must show it later.
    if (rank == 1) std::this_thread::sleep_for(30ms);
    {
      trace::Span step("step", trace::Category::step);
      {
        trace::Span forward("forward", trace::Category::forward, {.microbatch = rank, .stage = rank});
        std::this_thread::sleep_for(5ms);
      }
      {
        trace::Span reduce("all_reduce", trace::Category::allreduce, {.bytes = 16});
        Tensor t = ones({4});
        group->all_reduce(t)->wait();
      }
    }
    trace::write_merged_trace(group.get(), Device::cpu(), path);
  });
  const Json doc = JsonReader(read_file(path)).document();
  std::filesystem::remove(path);
  const Json* list = doc.find("traceEvents");
  ASSERT_NE(list, nullptr);
  std::map<int, std::map<std::string, std::pair<double, double>>> spans;  // pid -> name -> (ts, dur)
  std::map<int, std::string> process_names;
  for (const Json& item : list->items) {
    const std::string ph = item.find("ph")->text;
    const int pid = int(item.find("pid")->number);
    if (ph == "M" && item.find("name")->text == "process_name") process_names[pid] = item.find("args")->find("name")->text;
    if (ph != "X") continue;
    ASSERT_NE(item.find("tid"), nullptr);
    const double ts = item.find("ts")->number, dur = item.find("dur")->number;
    EXPECT_GE(ts, 0.0);
    EXPECT_GE(dur, 0.0);
    spans[pid][item.find("name")->text] = {ts, dur};
    if (item.find("name")->text == "forward") {
      EXPECT_EQ(item.find("cat")->text, "forward");
      EXPECT_EQ(int(item.find("args")->find("microbatch")->number), pid);
      EXPECT_EQ(int(item.find("tid")->number), trace::kComputeLane);
    }
    if (item.find("name")->text == "all_reduce") {
      EXPECT_EQ(int(item.find("tid")->number), trace::kCommunicationLane);
    }
  }
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(process_names[0], "rank 0");
  EXPECT_EQ(process_names[1], "rank 1");
  for (int pid : {0, 1}) {
    ASSERT_EQ(spans[pid].size(), 3u) << "pid " << pid;
    const auto [step_ts, step_dur] = spans[pid]["step"];
    const auto [f_ts, f_dur] = spans[pid]["forward"];
    const auto [r_ts, r_dur] = spans[pid]["all_reduce"];
    EXPECT_GE(f_dur, 5000.0);  // microseconds
    EXPECT_LE(step_ts, f_ts);
    EXPECT_LE(f_ts + f_dur, r_ts);
    EXPECT_LE(r_ts + r_dur, step_ts + step_dur + 1e-3);
  }
  // One clock: rank 1's forward began about 30 ms after rank 0's, and rank 0's all-reduce
  // waited for rank 1 to join it.
  EXPECT_GE(spans[1]["forward"].first - spans[0]["forward"].first, 20000.0);
  EXPECT_GE(spans[0]["all_reduce"].second, 20000.0);
}

TEST(Trace, ADdpStepRecordsAnAllReduceSpanPerBucketBesideBackward) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> group) {
    manual_seed(0);
    auto model = std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::Module>>{
        std::make_shared<nn::Linear>(64, 64), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(64, 10)});
    // A first bucket of 2 KiB closes on the last layer (2.6 KiB), the next takes the first
    // layer (16.25 KiB): two buckets, two all-reduces.
    DistributedDataParallel ddp(model, group, {.bucket_cap_mb = 1.0 / 64, .first_bucket_cap_mb = 1.0 / 512});
    const size_t buckets = ddp.bucket_assignment().size();
    require(buckets >= 2, "expected several buckets, got ", buckets);
    trace::clear();
    trace::set_enabled(true);
    Tensor loss = cross_entropy(ddp.forward(randn({8, 64})), from_vector(std::vector<int64_t>(8, rank), {8}));
    int64_t backward_start = 0, backward_end = 0;
    {
      trace::Span span("backward", trace::Category::backward);
      backward_start = trace::now_ns();
      loss.backward();
      backward_end = trace::now_ns();
    }
    trace::set_enabled(false);
    std::vector<trace::Event> reduces;
    for (const trace::Event& e : trace::events())
      if (e.category == trace::Category::allreduce) reduces.push_back(e);
    require(reduces.size() == buckets, reduces.size(), " all-reduce spans for ", buckets, " buckets");
    for (size_t i = 0; i < reduces.size(); ++i) {
      const trace::Event& e = reduces[i];
      require(e.name == "all_reduce bucket " + std::to_string(i), "span ", i, " is named ", e.name);
      require(e.lane == trace::kCommunicationLane, e.name, " is on lane ", e.lane);
      require(e.bytes > 0, e.name, " has no byte count");
      require(e.start_ns >= backward_start && e.end_ns <= backward_end && e.start_ns <= e.end_ns, e.name,
              " does not lie inside backward");
    }
  });
}

// FSDP's collectives appear beside the step as DDP's do: one all_gather span per gather (the
// prefetched ones named so), one reduce_scatter span per unit's backward, on the
// communication lane with their bytes, the forward's gathers inside forward and the
// reduce-scatters inside backward. Two steps, so that the second prefetches.
TEST(Trace, AnFsdpStepRecordsItsUnitsGathersAndReduceScattersBesideForwardAndBackward) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> group) {
    manual_seed(0);
    auto first = std::make_shared<nn::Linear>(32, 32), second = std::make_shared<nn::Linear>(32, 32),
         third = std::make_shared<nn::Linear>(32, 10);
    auto model = std::make_shared<nn::Sequential>(
        std::vector<std::shared_ptr<nn::Module>>{first, std::make_shared<nn::ReLU>(), second, third});
    FSDPOptions options;
    options.units = {{first}, {second}, {third}};
    FullyShardedDataParallel fsdp(model, group, options);
    trace::clear();
    trace::set_enabled(true);
    int64_t forward_start = 0, forward_end = 0, backward_start = 0, backward_end = 0;
    for (int step = 0; step < 2; ++step) {
      Tensor loss;
      forward_start = trace::now_ns();
      loss = cross_entropy(fsdp.forward(randn({8, 32})), from_vector(std::vector<int64_t>(8, rank), {8}));
      forward_end = backward_start = trace::now_ns();
      loss.backward();
      backward_end = trace::now_ns();
    }
    trace::set_enabled(false);
    int64_t gathers = 0, prefetches = 0, reduces = 0;
    for (const trace::Event& e : trace::events()) {
      if (e.category != trace::Category::allgather && e.category != trace::Category::reduce_scatter) continue;
      require(e.lane == trace::kCommunicationLane, e.name, " is on lane ", e.lane);
      require(e.bytes > 0 && e.start_ns <= e.end_ns, e.name, " has no bytes or ends before it starts");
      if (e.category == trace::Category::reduce_scatter) {
        ++reduces;
        require(e.name.starts_with("reduce_scatter "), "a reduce-scatter span is named ", e.name);
        if (e.start_ns >= forward_start)
          require(e.start_ns >= backward_start && e.end_ns <= backward_end, e.name, " lies outside backward");
        continue;
      }
      ++gathers;
      prefetches += e.name.ends_with(" (prefetch)");
      require(e.name.starts_with("all_gather "), "a gather span is named ", e.name);
      if (e.start_ns >= forward_start && e.end_ns <= forward_end) continue;  // the last step's forward
      require(e.end_ns <= forward_start || (e.start_ns >= backward_start && e.end_ns <= backward_end), e.name,
              " lies across the last step's forward and backward");
    }
    const FSDPMemory m = fsdp.memory();
    require(gathers == m.gathers && prefetches == m.prefetches && reduces == m.reduce_scatters, "spans: ", gathers,
            " gathers (", prefetches, " prefetched), ", reduces, " reduce-scatters; FSDP counted ", m.gathers, " (",
            m.prefetches, "), ", m.reduce_scatters);
    require(prefetches > 0 && reduces == 6, prefetches, " prefetched gathers and ", reduces,
            " reduce-scatters in two steps of three units");
  });
}

}  // namespace
}  // namespace loom::dist
