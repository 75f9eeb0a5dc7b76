// bench_collectives: the formulas of parallel/diagnostics/collective_bench.h (nccl-tests' bus
// bandwidth factors, sizes, buffer shapes, expected values), the short flags it takes, and
// the program itself run by loomrun on 2 and 4 Gloo CPU ranks and alone: it exits 0,
// prints nccl-tests' table with no wrong element, and writes one valid JSON object per
// collective and size. meson passes the programs' paths in LOOMRUN and BENCH_COLLECTIVES.
#include <gtest/gtest.h>

#include "run_command.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "engine/device.h"
#include "kernels/core/error.h"
#include "parallel/diagnostics/collective_bench.h"
#include "samples/common/flags.h"

namespace loom::dist::diagnostics {
namespace {

using dist::ReduceOp;

// ---- formulas ------------------------------------------------------------------------------

TEST(CollectiveBench, BusFactorsAreNcclTests) {
  struct Case {
    Collective c;
    double at1, at2, at4, at8;
  };
  const Case cases[] = {
      {Collective::all_reduce, 0, 1, 1.5, 1.75},       {Collective::all_gather, 0, 0.5, 0.75, 0.875},
      {Collective::reduce_scatter, 0, 0.5, 0.75, 0.875}, {Collective::broadcast, 1, 1, 1, 1},
      {Collective::sendrecv, 1, 1, 1, 1},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(collective_name(k.c));
    EXPECT_DOUBLE_EQ(bus_factor(k.c, 1), k.at1);
    EXPECT_DOUBLE_EQ(bus_factor(k.c, 2), k.at2);
    EXPECT_DOUBLE_EQ(bus_factor(k.c, 4), k.at4);
    EXPECT_DOUBLE_EQ(bus_factor(k.c, 8), k.at8);
  }
}

TEST(CollectiveBench, BandwidthIsBytesOverTimeInGBps) {
  Bandwidth bw = bandwidth(Collective::all_reduce, 2'000'000'000, 0.5, 4);
  EXPECT_DOUBLE_EQ(bw.algbw, 4.0);
  EXPECT_DOUBLE_EQ(bw.busbw, 6.0);
  bw = bandwidth(Collective::all_gather, 1'000'000'000, 1.0, 1);
  EXPECT_DOUBLE_EQ(bw.algbw, 1.0);
  EXPECT_DOUBLE_EQ(bw.busbw, 0.0);
  EXPECT_DOUBLE_EQ(bandwidth(Collective::broadcast, 100, 0.0, 2).algbw, 0.0);
}

TEST(CollectiveBench, ParsesSizesWithBinarySuffixes) {
  const std::pair<const char*, int64_t> good[] = {
      {"8", 8},           {"1K", 1024},          {"1k", 1024},        {"64K", 65536},
      {"128M", 128 << 20}, {"1G", int64_t(1) << 30}, {"3g", int64_t(3) << 30}, {"1000", 1000},
  };
  for (const auto& [text, bytes] : good) EXPECT_EQ(parse_size(text), bytes) << text;
  const char* bad[] = {"", "K", "abc", "12X", "-5", "+5", "1.5K", "0", " 8", "8 ", "1KB", "99999999999G"};
  for (const char* text : bad) EXPECT_THROW(parse_size(text), Error) << "'" << text << "'";
  try {
    parse_size("12X");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'12X'"), std::string::npos) << e.what();
  }
}

TEST(CollectiveBench, SweepsSizesByTheFactorUpToTheLargest) {
  EXPECT_EQ(size_sweep(8, 65536, 4), (std::vector<int64_t>{8, 32, 128, 512, 2048, 8192, 32768}));
  EXPECT_EQ(size_sweep(8, 128 << 20, 2).size(), 25u);
  EXPECT_EQ(size_sweep(1024, 1024, 2), (std::vector<int64_t>{1024}));
  EXPECT_EQ(size_sweep(1, int64_t(1) << 62, 2).back(), int64_t(1) << 62);  // no overflow past the end
  EXPECT_THROW(size_sweep(64, 8, 2), Error);
  EXPECT_THROW(size_sweep(8, 64, 1), Error);
}

TEST(CollectiveBench, ShapesRoundToWholeElementsPerRankAsNcclTests) {
  struct Case {
    Collective c;
    int64_t nominal;
    int n;
    CollectiveShape want;  // count, in_count, out_count, bytes
  };
  const Case cases[] = {
      {Collective::all_reduce, 40, 4, {10, 10, 10, 40}},
      {Collective::all_reduce, 7, 4, {1, 1, 1, 4}},
      {Collective::broadcast, 64, 3, {16, 16, 16, 64}},
      {Collective::sendrecv, 64, 2, {16, 16, 16, 64}},
      {Collective::all_gather, 40, 4, {8, 2, 8, 32}},  // size = the gathered output
      {Collective::all_gather, 8, 4, {0, 0, 0, 0}},    // less than one element per rank
      {Collective::reduce_scatter, 40, 4, {8, 8, 2, 32}},  // size = the input
      {Collective::reduce_scatter, 64, 1, {16, 16, 16, 64}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(std::string(collective_name(k.c)) + " " + std::to_string(k.nominal) + " B, n=" + std::to_string(k.n));
    CollectiveShape s = collective_shape(k.c, k.nominal, 4, k.n);
    EXPECT_EQ(s.count, k.want.count);
    EXPECT_EQ(s.in_count, k.want.in_count);
    EXPECT_EQ(s.out_count, k.want.out_count);
    EXPECT_EQ(s.bytes, k.want.bytes);
  }
}

TEST(CollectiveBench, ParsesCollectivesAndDatatypes) {
  EXPECT_EQ(parse_collectives("all").size(), 5u);
  EXPECT_EQ(parse_collectives("all_reduce,sendrecv"),
            (std::vector<Collective>{Collective::all_reduce, Collective::sendrecv}));
  EXPECT_THROW(parse_collectives("allreduce"), Error);
  EXPECT_THROW(parse_collectives("all_reduce,"), Error);
  EXPECT_EQ(parse_datatype("float"), DType::f32);
  EXPECT_EQ(parse_datatype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_datatype("half"), DType::f16);
  EXPECT_EQ(parse_datatype("int64"), DType::i64);
  EXPECT_STREQ(datatype_name(DType::f64), "double");
  EXPECT_THROW(parse_datatype("f32"), Error);
}

TEST(CollectiveBench, InputsAreSmallIntegersThatDifferBetweenRanks) {
  int differ = 0;
  for (int64_t i = 0; i < 1000; ++i) {
    for (int r = 0; r < 4; ++r) {
      const double v = input_value(r, i);
      EXPECT_TRUE(v >= 1 && v <= 11 && v == double(int64_t(v))) << v;
      EXPECT_NE(v, kUnwritten);
    }
    differ += input_value(0, i) != input_value(1, i);
  }
  EXPECT_GT(differ, 800);
}

TEST(CollectiveBench, ExpectedValuesFollowEachCollective) {
  const int n = 3;
  const CollectiveShape ag = collective_shape(Collective::all_gather, 48, 4, n);     // in 4, out 12
  const CollectiveShape rs = collective_shape(Collective::reduce_scatter, 48, 4, n);  // in 12, out 4
  const CollectiveShape flat = collective_shape(Collective::all_reduce, 48, 4, n);
  for (int64_t i = 0; i < 4; ++i) {
    const double a = input_value(0, i), b = input_value(1, i), c = input_value(2, i);
    EXPECT_EQ(expected_value(Collective::all_reduce, ReduceOp::sum, DType::f32, n, 1, 0, flat, i), a + b + c);
    EXPECT_EQ(expected_value(Collective::all_reduce, ReduceOp::max, DType::f32, n, 1, 0, flat, i),
              std::max({a, b, c}));
    EXPECT_EQ(expected_value(Collective::all_reduce, ReduceOp::avg, DType::f64, n, 1, 0, flat, i), (a + b + c) / 3);
    EXPECT_EQ(expected_value(Collective::all_reduce, ReduceOp::avg, DType::i32, n, 1, 0, flat, i),
              double(int64_t(a + b + c) / 3));
    // Rank 2 keeps slice 2 of the reduced input.
    const int64_t j = 2 * rs.out_count + i;
    EXPECT_EQ(expected_value(Collective::reduce_scatter, ReduceOp::min, DType::f32, n, 2, 0, rs, i),
              std::min({input_value(0, j), input_value(1, j), input_value(2, j)}));
    // Block r of the gathered output is rank r's input.
    EXPECT_EQ(expected_value(Collective::all_gather, ReduceOp::sum, DType::f32, n, 0, 0, ag, 1 * ag.in_count + i), b);
    EXPECT_EQ(expected_value(Collective::broadcast, ReduceOp::sum, DType::f32, n, 2, 1, flat, i), b);
    EXPECT_EQ(expected_value(Collective::sendrecv, ReduceOp::sum, DType::f32, n, 0, 0, flat, i), c);  // from rank 2
  }
}

TEST(CollectiveBench, ToleranceIsZeroWhereTheArithmeticIsExact) {
  EXPECT_EQ(tolerance(Collective::all_reduce, ReduceOp::sum, DType::f32, 8), 0);
  EXPECT_EQ(tolerance(Collective::all_reduce, ReduceOp::sum, DType::bf16, 8), 0);  // sums <= 88 fit 8 bits
  EXPECT_GT(tolerance(Collective::all_reduce, ReduceOp::sum, DType::bf16, 64), 0);
  EXPECT_LT(tolerance(Collective::all_reduce, ReduceOp::sum, DType::bf16, 64), 64 * 11 * 0.3);
  EXPECT_EQ(tolerance(Collective::reduce_scatter, ReduceOp::max, DType::f16, 8), 0);
  EXPECT_EQ(tolerance(Collective::all_reduce, ReduceOp::avg, DType::i64, 8), 0);
  EXPECT_GT(tolerance(Collective::all_reduce, ReduceOp::avg, DType::f32, 3), 0);
  EXPECT_LT(tolerance(Collective::all_reduce, ReduceOp::avg, DType::f32, 3), 1e-5);
  EXPECT_EQ(tolerance(Collective::all_gather, ReduceOp::avg, DType::bf16, 8), 0);
}

// What a row costs in memory, checked before the first row (bench_collectives -e 64G on a
// small machine is an error naming the size, not std::bad_alloc).
TEST(CollectiveBench, MemoryNeedCountsBothPairsOfBuffersAndTheFloat64Copies) {
  const CollectiveShape all_reduce = collective_shape(Collective::all_reduce, 1 << 20, 4, 2);
  const MemoryNeed on_cpu = memory_need(Collective::all_reduce, all_reduce, 4, true);
  EXPECT_EQ(on_cpu.host_bytes, 2 * (1 << 20) + 16 * (1 << 18));  // in place: two inputs, and the copies
  EXPECT_EQ(on_cpu.device_bytes, 0);
  const MemoryNeed on_gpu = memory_need(Collective::all_reduce, all_reduce, 4, false);
  EXPECT_EQ(on_gpu.host_bytes, 16 * (1 << 18));
  EXPECT_EQ(on_gpu.device_bytes, 2 * (1 << 20));
  const CollectiveShape gather = collective_shape(Collective::all_gather, 1 << 20, 4, 4);  // in 1/4 of out
  EXPECT_EQ(memory_need(Collective::all_gather, gather, 4, true).host_bytes,
            2 * ((1 << 16) + (1 << 18)) * 4 + 16 * (1 << 18));
  EXPECT_GT(available_host_memory(), 0);
}

TEST(CollectiveBench, FlagsTakeNcclTestsShortForms) {
  std::string minbytes = "8", maxbytes = "128M";
  int64_t factor = 2, iters = 20;
  samples::Flags flags("bench", "test");
  flags.add("minbytes", &minbytes, "", {}, "SIZE");
  flags.alias('b', "minbytes");
  flags.add("maxbytes", &maxbytes, "", {}, "SIZE");
  flags.alias('e', "maxbytes");
  flags.add("stepfactor", &factor, "", 2);
  flags.alias('f', "stepfactor");
  flags.add("iters", &iters, "", 1);
  std::vector<std::string> args = {"bench", "-b", "1K", "-e64M", "--stepfactor=4", "--iters", "3", "-x"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  const std::vector<std::string> positional = flags.parse(int(argv.size()), argv.data());
  EXPECT_EQ(minbytes, "1K");
  EXPECT_EQ(maxbytes, "64M");
  EXPECT_EQ(factor, 4);
  EXPECT_EQ(iters, 3);
  EXPECT_EQ(positional, (std::vector<std::string>{"-x"}));  // no such short form: left to the program
  EXPECT_NE(flags.usage().find("-b, --minbytes SIZE"), std::string::npos) << flags.usage();
  EXPECT_NE(flags.usage().find("  --iters N"), std::string::npos) << flags.usage();
}

// ---- the program ---------------------------------------------------------------------------

using testing::RunResult;

RunResult run(const std::string& command, int seconds) { return testing::run_command(command, seconds); }

int occurrences(const std::string& text, const std::string& what) {
  int count = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++count;
  return count;
}

// A strict reader of one flat JSON object (string and number values, as the program
// writes): the keys and the values' text, or nothing when the line is not valid JSON.
std::optional<std::map<std::string, std::string>> parse_flat_object(const std::string& line) {
  size_t i = 0;
  auto space = [&] {
    while (i < line.size() && std::isspace(static_cast<unsigned char>(line[i]))) ++i;
  };
  auto string = [&]() -> std::optional<std::string> {
    if (i >= line.size() || line[i] != '"') return std::nullopt;
    std::string out;
    for (++i; i < line.size() && line[i] != '"'; ++i) {
      if (line[i] == '\\' && ++i >= line.size()) return std::nullopt;
      out += line[i];
    }
    if (i >= line.size()) return std::nullopt;
    ++i;
    return out;
  };
  auto number = [&]() -> std::optional<std::string> {
    const size_t start = i;
    if (i < line.size() && line[i] == '-') ++i;
    const size_t digits = i;
    while (i < line.size() && (std::isdigit(static_cast<unsigned char>(line[i])) || line[i] == '.' ||
                               line[i] == 'e' || line[i] == 'E' || line[i] == '+' || line[i] == '-'))
      ++i;
    if (i == digits || !std::isdigit(static_cast<unsigned char>(line[digits]))) return std::nullopt;
    return line.substr(start, i - start);
  };
  std::map<std::string, std::string> out;
  space();
  if (i >= line.size() || line[i++] != '{') return std::nullopt;
  for (bool first = true;; first = false) {
    space();
    if (i < line.size() && line[i] == '}' && first) break;
    auto key = string();
    space();
    if (!key || i >= line.size() || line[i++] != ':') return std::nullopt;
    space();
    auto value = i < line.size() && line[i] == '"' ? string() : number();
    if (!value) return std::nullopt;
    out[*key] = *value;
    space();
    if (i < line.size() && line[i] == ',') {
      ++i;
      continue;
    }
    if (i < line.size() && line[i] == '}') break;
    return std::nullopt;
  }
  ++i;
  space();
  if (i != line.size()) return std::nullopt;
  return out;
}

std::string program() { return std::getenv("BENCH_COLLECTIVES"); }
std::string loomrun() { return std::getenv("LOOMRUN"); }

struct DistCase {
  int ranks;
  std::string flags;
  int ops;   // tables printed
  int rows;  // JSON records written
};

void PrintTo(const DistCase& k, std::ostream* os) { *os << k.ranks << " ranks, flags '" << k.flags << "'"; }

class BenchCollectivesOnCpuRanks : public ::testing::TestWithParam<DistCase> {};

TEST_P(BenchCollectivesOnCpuRanks, PrintsTheTableWithNoWrongElementAndValidJson) {
  const DistCase& k = GetParam();
  const std::string json =
      (std::filesystem::path(::testing::TempDir()) / ("bench_collectives_" + std::to_string(k.ranks) + ".jsonl"))
          .string();
  std::filesystem::remove(json);
  RunResult r = run(loomrun() + " --nproc-per-node " + std::to_string(k.ranks) + " " + program() +
                        " --device cpu -b 8 -e 64K -f 4 -n 3 -w 1 " + k.flags + " --json '" + json + "'",
                    120);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find(std::to_string(k.ranks) + " ranks (gloo) on cpu"), std::string::npos) << r.output;
  EXPECT_EQ(occurrences(r.output, "#       size         count      type   redop    root     time    algbw    busbw  #wrong"),
            k.ops)
      << r.output;
  EXPECT_EQ(occurrences(r.output, "# Wrong elements     : 0 OK"), k.ops) << r.output;
  EXPECT_EQ(occurrences(r.output, "# Avg bus bandwidth  : "), k.ops) << r.output;
  EXPECT_EQ(occurrences(r.output, "FAILED"), 0) << r.output;
  EXPECT_EQ(r.output.find("[rank 1]"), std::string::npos) << "only rank 0 prints:\n" << r.output;

  std::ifstream in(json);
  std::string line;
  int records = 0;
  std::map<std::string, int> per_op;
  while (std::getline(in, line)) {
    auto object = parse_flat_object(line);
    ASSERT_TRUE(object.has_value()) << "not a JSON object: " << line;
    ++records;
    ++per_op[(*object)["op"]];
    EXPECT_EQ((*object)["world_size"], std::to_string(k.ranks)) << line;
    EXPECT_EQ((*object)["backend"], "gloo") << line;
    EXPECT_EQ((*object)["device"], "cpu") << line;
    EXPECT_EQ((*object)["wrong"], "0") << line;
    EXPECT_GT(std::stod((*object)["time_us"]), 0) << line;
    for (const char* key : {"size_bytes", "count", "type", "redop", "algbw_gbps", "busbw_gbps"})
      EXPECT_EQ(object->count(key), 1u) << key << " missing: " << line;
  }
  EXPECT_EQ(records, k.rows);
  EXPECT_EQ(int(per_op.size()), k.ops);
}

// 7 sizes (8 B to 32 KiB by 4); all_gather and reduce_scatter skip 8 B (2 floats) on 4 ranks.
INSTANTIATE_TEST_SUITE_P(
    Gloo, BenchCollectivesOnCpuRanks,
    ::testing::Values(DistCase{2, "", 5, 35}, DistCase{4, "", 5, 33},
                      DistCase{2, "-d bfloat16 -o avg --collective all_reduce,reduce_scatter", 2, 14},
                      DistCase{4, "-d int64 -o max --collective all_reduce,reduce_scatter", 2, 13}),
    [](const ::testing::TestParamInfo<DistCase>& info) { return "case" + std::to_string(info.index); });

TEST(BenchCollectives, RunsAloneAsAGroupOfOne) {
  RunResult r = run(program() + " --device cpu -b 1K -e 4K -f 4 -n 2 -w 1", 60);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("1 rank (gloo) on cpu"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("# sendrecv: skipped at world size 1"), std::string::npos) << r.output;
  // Nothing crosses a link: all_reduce's bus bandwidth is 0, broadcast's equals its algbw.
  EXPECT_NE(r.output.find("# all_reduce: in place"), std::string::npos) << r.output;
  EXPECT_EQ(occurrences(r.output, "# Avg bus bandwidth  : 0\n"), 3) << r.output;  // all_reduce, all_gather, reduce_scatter
  EXPECT_EQ(occurrences(r.output, "# Wrong elements     : 0 OK"), 4) << r.output;
}

TEST(BenchCollectives, BadSizeIsAUsageError) {
  RunResult r = run(program() + " --device cpu -b 12X", 30);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("-b/--minbytes: size '12X'"), std::string::npos) << r.output;
  r = run(program() + " --device cpu -b 1M -e 1K", 30);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("give -e at least -b"), std::string::npos) << r.output;
}

TEST(BenchCollectives, SizeBeyondTheGpusMemoryIsRefusedUpFront) {
  if (!cuda_available()) GTEST_SKIP() << "needs a GPU";
  const RunResult r = run(program() + " --device cuda:0 -b 1M -e 1024G", 60);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("-e/--maxbytes 1024G: at that size each rank needs about"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("on its GPU"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("cuda:0 has"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace loom::dist::diagnostics
