// The arithmetic of a collective bandwidth benchmark (samples/bench_collectives.cpp is one),
// apart from any program so that tests can check it and other tools can reuse it: the message
// sizes swept, how a nominal size becomes each collective's buffers, the bandwidths, and the
// values every rank writes and must read back. It follows nccl-tests
// (NVIDIA/nccl-tests, doc/PERFORMANCE.md), so Loom's figures compare with theirs directly:
//
//   algbw = bytes / time, bytes being the size column:
//     all_reduce, broadcast, sendrecv   the buffer
//     all_gather                        the gathered output (n times each rank's input)
//     reduce_scatter                    the input (n times each rank's output)
//   busbw = algbw * factor, the bandwidth each link needs for that algbw on a ring:
//     all_reduce                        2(n-1)/n
//     all_gather, reduce_scatter        (n-1)/n
//     broadcast, sendrecv               1
// so busbw is comparable across collectives and world sizes, and at n = 1 the first three
// read 0 (nothing crosses a link), as nccl-tests prints them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "../../kernels/core/dtype.h"
#include "../process_group.h"

namespace loom::dist::diagnostics {

enum class Collective { all_reduce, all_gather, reduce_scatter, broadcast, sendrecv };
inline constexpr Collective kCollectives[] = {Collective::all_reduce, Collective::all_gather,
                                              Collective::reduce_scatter, Collective::broadcast,
                                              Collective::sendrecv};

const char* collective_name(Collective c);
// "all_reduce", ..., or "all"; a comma-separated list of them. Throws loom::Error naming the
// unknown word and listing the accepted ones.
std::vector<Collective> parse_collectives(std::string_view text);
// Whether the collective combines values with a reduction op (the redop column).
bool reduces(Collective c);
// Whether it writes its result over its input (all_reduce and broadcast, as ProcessGroup
// offers them) rather than into a separate output.
bool in_place(Collective c);

// nccl-tests' names: float, half, bfloat16, double, int32, int64. Throws loom::Error.
DType parse_datatype(std::string_view name);
const char* datatype_name(DType dtype);

// A byte count as nccl-tests' -b and -e take it: digits, then optionally K, M or G (powers
// of 1024, either case): "8", "1K", "128M", "1G". Throws loom::Error naming the text.
int64_t parse_size(std::string_view text);

// The nominal sizes min, min*factor, min*factor^2, ... up to max included.
std::vector<int64_t> size_sweep(int64_t min_bytes, int64_t max_bytes, int64_t factor);

// One row's buffers, from a nominal size in bytes, the element size and the world size n.
// As nccl-tests: count = bytes / element_size, rounded down to a multiple of n for
// all_gather and reduce_scatter, whose per-rank part is count / n.
struct CollectiveShape {
  int64_t count = 0;      // the count column: elements of the buffer `bytes` measures
  int64_t in_count = 0;   // elements of each rank's input
  int64_t out_count = 0;  // elements of each rank's output (== in_count when in place)
  int64_t bytes = 0;      // the size column: count * element_size
};
CollectiveShape collective_shape(Collective c, int64_t nominal_bytes, size_t element_size, int n);

// The memory one rank of bench_collectives holds at its peak for a row of `shape`: the timed
// call's input and output and, while they live, the check's fresh pair, plus the host copies
// the check makes (each input is built as float64 values on the host, the output read back
// as float64). `buffers_on_host` is false when the buffers live on a GPU; the float64 copies
// are on the host either way. Checked against the memory there is before the first row, so
// a size too large for the machine is an error naming it rather than std::bad_alloc.
struct MemoryNeed {
  int64_t host_bytes = 0, device_bytes = 0;
};
MemoryNeed memory_need(Collective c, const CollectiveShape& shape, size_t element_size, bool buffers_on_host);
// MemAvailable of /proc/meminfo, in bytes; -1 when it cannot be read.
int64_t available_host_memory();

// busbw / algbw at world size n (see the header comment).
double bus_factor(Collective c, int n);
struct Bandwidth {
  double algbw = 0, busbw = 0;  // GB/s, 1e9 bytes
};
Bandwidth bandwidth(Collective c, int64_t bytes, double seconds, int n);

// ---- the correctness check ---------------------------------------------------------------
// Every rank fills its input with small integers (1 to 11) drawn from a hash of (rank,
// index): exact in every dtype, different on every rank, with no short period that a
// misplaced block could hide behind. Outputs start as kUnwritten, which no input holds.
inline constexpr double kUnwritten = -1;
double input_value(int rank, int64_t index);

// What element `index` of rank `rank`'s output (of `shape`) must hold after the collective
// (broadcast from `root`; sendrecv from rank - 1 around the ring). avg of integer types
// rounds toward zero.
double expected_value(Collective c, dist::ReduceOp op, DType dtype, int n, int rank, int root,
                      const CollectiveShape& shape, int64_t index);

// How far a correct element may be from expected_value: 0 where the arithmetic is exact
// (no reduction, max and min, sums whose partial sums fit the dtype's significand, integer
// types), else a bound on the rounding of n - 1 additions and of avg's division.
double tolerance(Collective c, dist::ReduceOp op, DType dtype, int n);

}  // namespace loom::dist::diagnostics
