#include "parallel/diagnostics/collective_bench.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <string>

#include "kernels/core/error.h"

namespace loom::dist::diagnostics {

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::broadcast: return "broadcast";
    case Collective::sendrecv: return "sendrecv";
  }
  return "?";
}

std::vector<Collective> parse_collectives(std::string_view text) {
  std::vector<Collective> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view word = text.substr(start, comma - start);
    start = comma + 1;
    if (word == "all") {
      out.insert(out.end(), std::begin(kCollectives), std::end(kCollectives));
      continue;
    }
    const auto* found = std::find_if(std::begin(kCollectives), std::end(kCollectives),
                                     [&](Collective c) { return word == collective_name(c); });
    LOOM_CHECK(found != std::end(kCollectives), "unknown collective '", word, "' in '", text,
               "': expected all, all_reduce, all_gather, reduce_scatter, broadcast or sendrecv, or a "
               "comma-separated list of them");
    out.push_back(*found);
  }
  return out;
}

bool reduces(Collective c) { return c == Collective::all_reduce || c == Collective::reduce_scatter; }

bool in_place(Collective c) { return c == Collective::all_reduce || c == Collective::broadcast; }

namespace {

struct DatatypeName {
  DType dtype;
  const char* name;
};
constexpr DatatypeName kDatatypes[] = {{DType::f32, "float"},  {DType::f16, "half"},   {DType::bf16, "bfloat16"},
                                       {DType::f64, "double"}, {DType::i32, "int32"}, {DType::i64, "int64"}};

// Bits of the significand (the implicit one included): integers up to 2^bits are exact.
int significand_bits(DType dtype) {
  switch (dtype) {
    case DType::f64: return 53;
    case DType::f32: return 24;
    case DType::f16: return 11;
    case DType::bf16: return 8;
    default: return 63;
  }
}

uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr double kLargestInput = 11;

}  // namespace

DType parse_datatype(std::string_view name) {
  for (const auto& d : kDatatypes)
    if (name == d.name) return d.dtype;
  LOOM_FAIL("unknown datatype '", name, "': expected float, half, bfloat16, double, int32 or int64");
}

const char* datatype_name(DType dtype) {
  for (const auto& d : kDatatypes)
    if (dtype == d.dtype) return d.name;
  return "uint8";
}

int64_t parse_size(std::string_view text) {
  std::string_view digits = text;
  int64_t unit = 1;
  if (!text.empty()) {
    switch (std::toupper(static_cast<unsigned char>(text.back()))) {
      case 'K': unit = int64_t(1) << 10; break;
      case 'M': unit = int64_t(1) << 20; break;
      case 'G': unit = int64_t(1) << 30; break;
    }
    if (unit > 1) digits.remove_suffix(1);
  }
  int64_t value = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  const bool whole = !digits.empty() && ec != std::errc::invalid_argument && end == digits.data() + digits.size() &&
                     std::isdigit(static_cast<unsigned char>(digits.front()));
  LOOM_CHECK(whole, "size '", text, "': expected a whole number of bytes, optionally followed by K, M or G ",
             "(powers of 1024), such as 8, 64K, 128M or 1G");
  LOOM_CHECK(ec != std::errc::result_out_of_range && value <= std::numeric_limits<int64_t>::max() / unit, "size '",
             text, "' is too large");
  LOOM_CHECK(value > 0, "size '", text, "': must be at least 1 byte");
  return value * unit;
}

std::vector<int64_t> size_sweep(int64_t min_bytes, int64_t max_bytes, int64_t factor) {
  LOOM_CHECK(min_bytes >= 1, "the smallest size must be at least 1 byte, got ", min_bytes);
  LOOM_CHECK(max_bytes >= min_bytes, "the largest size (", max_bytes, " bytes) is below the smallest (", min_bytes,
             " bytes): give -e at least -b");
  LOOM_CHECK(factor >= 2, "the step factor must be at least 2, got ", factor);
  std::vector<int64_t> sizes;
  for (int64_t s = min_bytes;; s *= factor) {
    sizes.push_back(s);
    if (s > max_bytes / factor) break;
  }
  return sizes;
}

CollectiveShape collective_shape(Collective c, int64_t nominal_bytes, size_t element_size, int n) {
  CollectiveShape shape;
  shape.count = nominal_bytes / int64_t(element_size);
  switch (c) {
    case Collective::all_reduce:
    case Collective::broadcast:
    case Collective::sendrecv: shape.in_count = shape.out_count = shape.count; break;
    case Collective::all_gather:
      shape.count -= shape.count % n;
      shape.in_count = shape.count / n, shape.out_count = shape.count;
      break;
    case Collective::reduce_scatter:
      shape.count -= shape.count % n;
      shape.in_count = shape.count, shape.out_count = shape.count / n;
      break;
  }
  shape.bytes = shape.count * int64_t(element_size);
  return shape;
}

double bus_factor(Collective c, int n) {
  switch (c) {
    case Collective::all_reduce: return 2.0 * (n - 1) / n;
    case Collective::all_gather:
    case Collective::reduce_scatter: return double(n - 1) / n;
    case Collective::broadcast:
    case Collective::sendrecv: return 1;
  }
  return 0;
}

Bandwidth bandwidth(Collective c, int64_t bytes, double seconds, int n) {
  if (!(seconds > 0)) return {};
  const double algbw = double(bytes) / 1e9 / seconds;
  return {algbw, algbw * bus_factor(c, n)};
}

double input_value(int rank, int64_t index) {
  // Indices stay far below 2^40, so (rank, index) pairs map to distinct hash inputs.
  return double(splitmix64((uint64_t(rank) << 40) ^ uint64_t(index)) % 11 + 1);
}

double expected_value(Collective c, dist::ReduceOp op, DType dtype, int n, int rank, int root,
                      const CollectiveShape& shape, int64_t index) {
  auto reduce = [&](int64_t at) {
    double acc = input_value(0, at);
    for (int r = 1; r < n; ++r) {
      const double v = input_value(r, at);
      switch (op) {
        case dist::ReduceOp::sum:
        case dist::ReduceOp::avg: acc += v; break;
        case dist::ReduceOp::max: acc = std::max(acc, v); break;
        case dist::ReduceOp::min: acc = std::min(acc, v); break;
      }
    }
    if (op != dist::ReduceOp::avg) return acc;
    return is_floating(dtype) ? acc / n : std::trunc(acc / n);
  };
  switch (c) {
    case Collective::all_reduce: return reduce(index);
    case Collective::reduce_scatter: return reduce(int64_t(rank) * shape.out_count + index);
    case Collective::all_gather: return input_value(int(index / shape.in_count), index % shape.in_count);
    case Collective::broadcast: return input_value(root, index);
    case Collective::sendrecv: return input_value((rank + n - 1) % n, index);
  }
  return 0;
}

double tolerance(Collective c, dist::ReduceOp op, DType dtype, int n) {
  if (!reduces(c) || !is_floating(dtype) || op == dist::ReduceOp::max || op == dist::ReduceOp::min) return 0;
  const int bits = significand_bits(dtype);
  const double largest_sum = kLargestInput * n;
  if (op == dist::ReduceOp::sum && largest_sum <= std::ldexp(1.0, bits)) return 0;
  // n - 1 roundings of partial sums, plus avg's scaling (before or after the sum, by
  // backend), each off by at most half a unit in the last place of a value below the bound.
  const double magnitude = op == dist::ReduceOp::avg ? kLargestInput : largest_sum;
  return (n + 2) * std::ldexp(magnitude, -bits);
}

MemoryNeed memory_need(Collective c, const CollectiveShape& shape, size_t element_size, bool buffers_on_host) {
  const int64_t out = in_place(c) ? 0 : shape.out_count;
  const int64_t buffers = 2 * (shape.in_count + out) * int64_t(element_size);
  // make_input's values and their float64 tensor, or the output read back as float64 twice.
  const int64_t copies = 16 * std::max(shape.in_count, shape.out_count);
  MemoryNeed need;
  need.host_bytes = copies + (buffers_on_host ? buffers : 0);
  need.device_bytes = buffers_on_host ? 0 : buffers;
  return need;
}

int64_t available_host_memory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    if (!line.starts_with("MemAvailable:")) continue;
    const char* p = line.c_str() + 13;
    while (*p == ' ') ++p;
    int64_t kib = 0;
    auto [end, ec] = std::from_chars(p, line.c_str() + line.size(), kib);
    return ec == std::errc() ? kib * 1024 : -1;
  }
  return -1;
}

}  // namespace loom::dist::diagnostics
