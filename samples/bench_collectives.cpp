// bench_collectives: the bandwidth of Loom's collectives, measured and printed the way
// nccl-tests does (all_reduce_perf and its siblings), with its flags, so that the two read
// line by line against each other and Loom's process groups can be held to NCCL's own figures.
//
//   loomrun --nproc-per-node 8 bench_collectives -b 8 -e 128M -f 2     NCCL, one rank per GPU
//   loomrun --nproc-per-node 4 bench_collectives --device cpu -e 1M    Gloo, CPU ranks
//   bench_collectives -b 1M -e 1G                                      one rank, no launcher
//
// For each collective and size: warm-up calls, a barrier, then timed calls, each Work
// waited, timed with CUDA events on the compute stream around the loop on a GPU (the host
// never waits inside it) and with steady_clock on the CPU (Gloo's calls block); the time is
// averaged over ranks. Then one more call on fresh inputs is checked element by element
// against the formulas of parallel/diagnostics/collective_bench.h, and the wrong elements are
// summed over ranks (the #wrong column). Sizes, counts and bandwidths follow nccl-tests:
// see collective_bench.h. all_reduce and broadcast run in place (ProcessGroup offers no
// other form); the others write a separate output. The exit status is 1 when any element
// was wrong.
//
// sendrecv is a ring: every rank sends to rank + 1 and receives from rank - 1. ProcessGroup
// issues send and recv as separate calls: on Gloo both are posted before either is waited,
// so they overlap; on NCCL each is its own launch on the group's stream, so a rank's send
// and receive run one after the other (even ranks send first, odd ranks receive first, so
// the ring cannot deadlock) and the time covers both, where nccl-tests groups the pair.
// At world size 1 there is no peer, and sendrecv is skipped.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/device.h"
#include "engine/ops.h"
#include "parallel/store.h"
#include "parallel/diagnostics/collective_bench.h"
#include "parallel/init.h"
#include "parallel/rendezvous.h"
#include "samples/common/flags.h"
#include "samples/common/metrics.h"
#include "samples/common/program.h"

using namespace loom;
namespace bench = dist::diagnostics;  // the formulas, parallel/diagnostics/collective_bench.h
using bench::Collective;

namespace {

struct Options {
  std::string min_bytes = "8", max_bytes = "128M", datatype = "float", redop = "sum", collectives = "all";
  std::string device = "auto", json;
  int64_t step_factor = 2, iters = 20, warmup = 5, check = 1, root = 0, timeout_s = 600;
};

// What every row of a run shares.
struct Run {
  dist::DistContext ctx;
  DType dtype = DType::f32;
  dist::ReduceOp op = dist::ReduceOp::sum;
  int root = 0;
  int64_t iters = 0, warmup = 0;
  bool check = true;
};

struct Row {
  bench::CollectiveShape shape;
  double seconds = 0;  // per call, averaged over ranks
  int64_t wrong = 0;   // summed over ranks
  bench::Bandwidth bw;
};

Tensor upload(const std::vector<double>& values, DType dtype, Device device) {
  Tensor t = Tensor::empty({int64_t(values.size())}, dtype, device);
  copy_(t, from_vector(values, {int64_t(values.size())}));
  return t;
}

// This rank's input: input_value() everywhere, except that broadcast's non-root ranks
// start unwritten so that a broadcast that did not arrive shows.
Tensor make_input(const Run& run, Collective c, const bench::CollectiveShape& shape) {
  const int rank = run.ctx.rank;
  const bool unwritten = c == Collective::broadcast && rank != run.root;
  std::vector<double> values(size_t(shape.in_count));
  for (int64_t i = 0; i < shape.in_count; ++i)
    values[size_t(i)] = unwritten ? bench::kUnwritten : bench::input_value(rank, i);
  return upload(values, run.dtype, run.ctx.device);
}

// One call of collective `c`, its Works waited.
void call(const Run& run, Collective c, const Tensor& in, const Tensor& out) {
  dist::ProcessGroup& group = *run.ctx.group;
  switch (c) {
    case Collective::all_reduce: group.all_reduce(in, run.op)->wait(); break;
    case Collective::broadcast: group.broadcast(in, run.root)->wait(); break;
    case Collective::all_gather: group.all_gather(out, in)->wait(); break;
    case Collective::reduce_scatter: group.reduce_scatter(out, in, run.op)->wait(); break;
    case Collective::sendrecv: {
      const int rank = group.rank(), n = group.size();
      const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
      dist::WorkPtr sent, received;
      if (rank % 2 == 0) {
        sent = group.send(in, next);
        received = group.recv(out, prev);
      } else {
        received = group.recv(out, prev);
        sent = group.send(in, next);
      }
      sent->wait();
      received->wait();
      break;
    }
  }
}

// Seconds per call on this rank, over run.iters calls that start together on every rank.
double time_calls(const Run& run, Collective c, const Tensor& in, const Tensor& out) {
  run.ctx.group->barrier()->wait();
  if (run.ctx.device.is_cuda()) {
    const StreamHandle stream = compute_stream(run.ctx.device);  // and the device made current
    Event start, end;
    start.record(stream);
    for (int64_t i = 0; i < run.iters; ++i) call(run, c, in, out);
    end.record(stream);
    end.synchronize();
    return double(end.elapsed_ms_since(start)) / 1e3 / double(run.iters);
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < run.iters; ++i) call(run, c, in, out);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(run.iters);
}

// One call on fresh inputs into an unwritten output; returns this rank's wrong elements.
int64_t check_call(const Run& run, Collective c, const bench::CollectiveShape& shape) {
  const Tensor in = make_input(run, c, shape);
  const Tensor out = bench::in_place(c) ? in : full({shape.out_count}, bench::kUnwritten, run.dtype, run.ctx.device);
  call(run, c, in, out);
  const std::vector<double> got = out.to_vector<double>();
  const int n = run.ctx.size;
  const double tol = bench::tolerance(c, run.op, run.dtype, n);
  int64_t wrong = 0;
  for (int64_t i = 0; i < shape.out_count; ++i) {
    const double want = bench::expected_value(c, run.op, run.dtype, n, run.ctx.rank, run.root, shape, i);
    if (!(std::abs(got[size_t(i)] - want) <= tol)) ++wrong;
  }
  return wrong;
}

Row measure(const Run& run, Collective c, const bench::CollectiveShape& shape) {
  Row row;
  row.shape = shape;
  const Tensor in = make_input(run, c, shape);
  const Tensor out = bench::in_place(c) ? in : Tensor::empty({shape.out_count}, run.dtype, run.ctx.device);
  for (int64_t i = 0; i < run.warmup; ++i) call(run, c, in, out);
  const double seconds = time_calls(run, c, in, out);
  const int64_t wrong = run.check ? check_call(run, c, shape) : 0;
  // The time averaged and the wrong elements summed over ranks, in one all-reduce.
  Tensor totals = from_vector(std::vector<double>{seconds, double(wrong)}, {2}).to(run.ctx.device);
  run.ctx.group->all_reduce(totals, dist::ReduceOp::sum)->wait();
  const std::vector<double> sums = totals.to_vector<double>();
  row.seconds = sums[0] / run.ctx.size;
  row.wrong = int64_t(sums[1]);
  row.bw = bench::bandwidth(c, shape.bytes, row.seconds, run.ctx.size);
  return row;
}

// nccl-tests' time column: fewer decimals as the time grows.
std::string time_text(double us) {
  char buf[32];
  std::snprintf(buf, sizeof buf, us >= 10000 ? "%7.0f" : us >= 100 ? "%7.1f" : "%7.2f", us);
  return buf;
}

void print_header(const Run& run, Collective c) {
  const char* redop = bench::reduces(c) ? dist::reduce_op_name(run.op) : "none";
  std::printf("#\n# %s: %s, redop %s, %s, iters %lld after warmup iters %lld, %d rank%s (%s) on %s\n",
              bench::collective_name(c), bench::in_place(c) ? "in place" : "out of place", redop,
              bench::datatype_name(run.dtype), (long long)run.iters, (long long)run.warmup, run.ctx.size,
              run.ctx.size == 1 ? "" : "s", run.ctx.group->backend().c_str(), run.ctx.device.str().c_str());
  if (c == Collective::sendrecv && run.ctx.group->backend() == "nccl")
    std::printf("# sendrecv: send and recv are separate NCCL launches, so each rank's pair runs one after the other\n");
  std::printf("#\n#%11s  %12s  %8s  %6s  %6s  %7s  %7s  %7s  %6s\n", "size", "count", "type", "redop", "root", "time",
              "algbw", "busbw", "#wrong");
  std::printf("#%11s  %12s  %8s  %6s  %6s  %7s  %7s  %7s\n", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)",
              "(GB/s)");
}

void print_row(const Run& run, Collective c, const Row& row) {
  const char* redop = bench::reduces(c) ? dist::reduce_op_name(run.op) : "none";
  const int root = c == Collective::broadcast ? run.root : -1;
  const std::string wrong = run.check ? std::to_string(row.wrong) : "N/A";
  std::printf("%12lld  %12lld  %8s  %6s  %6d  %7s  %7.2f  %7.2f  %6s\n", (long long)row.shape.bytes,
              (long long)row.shape.count, bench::datatype_name(run.dtype), redop, root,
              time_text(row.seconds * 1e6).c_str(), row.bw.algbw, row.bw.busbw, wrong.c_str());
}

samples::MetricRecord json_record(const Run& run, Collective c, const Row& row) {
  return {{"bench", std::string("collectives")},
          {"op", std::string(bench::collective_name(c))},
          {"size_bytes", row.shape.bytes},
          {"count", row.shape.count},
          {"type", std::string(bench::datatype_name(run.dtype))},
          {"redop", std::string(bench::reduces(c) ? dist::reduce_op_name(run.op) : "none")},
          {"root", int64_t(c == Collective::broadcast ? run.root : -1)},
          {"in_place", int64_t(bench::in_place(c))},
          {"time_us", row.seconds * 1e6},
          {"algbw_gbps", row.bw.algbw},
          {"busbw_gbps", row.bw.busbw},
          {"wrong", run.check ? row.wrong : int64_t(-1)},
          {"iters", run.iters},
          {"warmup", run.warmup},
          {"world_size", int64_t(run.ctx.size)},
          {"backend", run.ctx.group->backend()},
          {"device", run.ctx.device.str()}};
}

// The largest row must fit in the memory there is: host memory on every rank of this
// machine at once, and on a GPU, its own free memory (one rank per GPU).
void check_memory(const Run& run, const std::vector<Collective>& collectives, int64_t max_bytes,
                  const std::string& max_text, const samples::Flags& flags) {
  const int local_ranks = int(dist::parse_integer(dist::process_env("LOCAL_WORLD_SIZE").value_or("1")).value_or(1));
  bench::MemoryNeed worst_host, worst_device;
  const char* host_name = "";
  const char* device_name = "";
  for (Collective c : collectives) {
    const bench::CollectiveShape shape = bench::collective_shape(c, max_bytes, dtype_size(run.dtype), run.ctx.size);
    const bench::MemoryNeed need = bench::memory_need(c, shape, dtype_size(run.dtype), !run.ctx.device.is_cuda());
    if (need.host_bytes > worst_host.host_bytes) worst_host = need, host_name = bench::collective_name(c);
    if (need.device_bytes > worst_device.device_bytes) worst_device = need, device_name = bench::collective_name(c);
  }
  const double gib = 1024.0 * 1024 * 1024;
  char text[400];
  const int64_t on_device = memory::available_bytes(run.ctx.device);
  if (on_device >= 0 && worst_device.device_bytes > on_device) {
    std::snprintf(text, sizeof text,
                  "-e/--maxbytes %s: at that size each rank needs about %.1f GiB on its GPU (%s's input and output, "
                  "and the check's pair), and %s has %.1f GiB free: lower -e/--maxbytes",
                  max_text.c_str(), double(worst_device.device_bytes) / gib, device_name,
                  run.ctx.device.str().c_str(), double(on_device) / gib);
    flags.fail(text);
  }
  const int64_t available = bench::available_host_memory();
  if (available < 0 || double(worst_host.host_bytes) * local_ranks <= double(available)) return;
  std::snprintf(text, sizeof text,
                "-e/--maxbytes %s: at that size each rank needs about %.1f GiB of host memory (%s's buffers and the "
                "check's float64 copies), %d rank(s) on this machine %.1f GiB, and %.1f GiB is available: lower "
                "-e/--maxbytes",
                max_text.c_str(), double(worst_host.host_bytes) / gib, host_name, local_ranks,
                double(worst_host.host_bytes) * local_ranks / gib, double(available) / gib);
  flags.fail(text);
}

int64_t parse_size_flag(const samples::Flags& flags, const char* spelling, const std::string& text) {
  try {
    return bench::parse_size(text);
  } catch (const Error& e) {
    flags.fail(std::string(spelling) + ": " + e.what());
  }
}

int run(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // loomrun reads our output through a pipe
  Options o;
  samples::Flags flags("bench_collectives",
                       "Bandwidth of all_reduce, all_gather, reduce_scatter, broadcast and a sendrecv ring, "
                       "as nccl-tests measures it.\nRun it under loomrun (or torchrun --no-python): NCCL with one "
                       "rank per GPU, or Gloo on CPU ranks with --device cpu.");
  flags.add("minbytes", &o.min_bytes, "smallest size (K, M, G: powers of 1024)", {}, "SIZE");
  flags.alias('b', "minbytes");
  flags.add("maxbytes", &o.max_bytes, "largest size", {}, "SIZE");
  flags.alias('e', "maxbytes");
  flags.add("stepfactor", &o.step_factor, "multiply the size by this from row to row", 2);
  flags.alias('f', "stepfactor");
  flags.add("iters", &o.iters, "timed calls per size", 1);
  flags.alias('n', "iters");
  flags.add("warmup_iters", &o.warmup, "untimed calls per size before them", 0);
  flags.alias('w', "warmup_iters");
  flags.add("datatype", &o.datatype, "element type", {"float", "half", "bfloat16", "double", "int32", "int64"});
  flags.alias('d', "datatype");
  flags.add("op", &o.redop, "reduction of all_reduce and reduce_scatter", {"sum", "avg", "max", "min"});
  flags.alias('o', "op");
  flags.add("root", &o.root, "broadcast's root rank", 0);
  flags.alias('r', "root");
  flags.add("check", &o.check, "1: check every element of one more call per size; 0: do not", 0, 1);
  flags.alias('c', "check");
  flags.add("collective", &o.collectives,
            "all, or a comma-separated list of all_reduce, all_gather, reduce_scatter, broadcast, sendrecv", {},
            "NAMES");
  flags.add("device", &o.device, "auto, cpu, cuda (under a launcher: cuda:LOCAL_RANK) or cuda:N", {}, "DEVICE");
  flags.add("timeout-s", &o.timeout_s, "seconds before a stuck collective ends the run", 1);
  flags.add("json", &o.json, "append one JSON object per collective and size to FILE", {}, "FILE");
  const std::vector<std::string> positional = flags.parse(argc, argv);
  if (!positional.empty()) flags.fail("unexpected argument '" + positional[0] + "'");

  std::vector<Collective> collectives;
  std::vector<int64_t> sizes;
  try {
    collectives = bench::parse_collectives(o.collectives);
  } catch (const Error& e) {
    flags.fail(std::string("--collective: ") + e.what());
  }
  const int64_t min_bytes = parse_size_flag(flags, "-b/--minbytes", o.min_bytes);
  const int64_t max_bytes = parse_size_flag(flags, "-e/--maxbytes", o.max_bytes);
  try {
    sizes = bench::size_sweep(min_bytes, max_bytes, o.step_factor);
    if (o.device != "auto") Device::parse(o.device);
  } catch (const Error& e) {
    flags.fail(e.what());
  }

  try {
    Run run;
    run.ctx = dist::init_distributed(o.device, std::chrono::seconds(o.timeout_s));
    const Device device = run.ctx.device;
    if (device.is_cuda() && device.index >= cuda_device_count())
      flags.fail("--device " + o.device + ": " + std::to_string(cuda_device_count()) +
                 " GPU(s) are visible; use --device cpu for Gloo on CPU ranks");
    if (!run.ctx.group) {
      // One process without a launcher: a group of one, over a store of its own.
      run.ctx.store = std::make_shared<dist::TcpStore>("127.0.0.1", 0, dist::TcpStore::Role::server);
      dist::ProcessGroupOptions options;
      options.timeout = std::chrono::seconds(o.timeout_s);
      run.ctx.group = device.is_cuda() ? dist::new_nccl_group(run.ctx.store, 0, 1, device, options)
                                       : dist::new_gloo_group(run.ctx.store, 0, 1, options);
    }
    const int n = run.ctx.size;
    if (o.root >= n) flags.fail("-r/--root " + std::to_string(o.root) + ": the group has ranks 0 to " + std::to_string(n - 1));
    run.dtype = bench::parse_datatype(o.datatype);
    run.op = o.redop == "avg" ? dist::ReduceOp::avg
           : o.redop == "max" ? dist::ReduceOp::max
           : o.redop == "min" ? dist::ReduceOp::min
                              : dist::ReduceOp::sum;
    run.root = int(o.root);
    check_memory(run, collectives, max_bytes, o.max_bytes, flags);
    run.iters = o.iters, run.warmup = o.warmup, run.check = o.check == 1;
    const bool main_rank = run.ctx.is_main();
    samples::MetricsLog log(main_rank ? o.json : "");
    if (main_rank)
      std::printf("# bench_collectives: %d rank%s (%s) on %s; minBytes %lld maxBytes %lld step: %lld(factor) "
                  "warmup iters: %lld iters: %lld validation: %lld\n",
                  n, n == 1 ? "" : "s", run.ctx.group->backend().c_str(), device.str().c_str(),
                  (long long)min_bytes, (long long)max_bytes, (long long)o.step_factor, (long long)o.warmup,
                  (long long)o.iters, (long long)o.check);

    int64_t all_wrong = 0;
    for (Collective c : collectives) {
      if (c == Collective::sendrecv && n == 1) {
        if (main_rank) std::printf("#\n# sendrecv: skipped at world size 1 (a rank has no peer to send to)\n");
        continue;
      }
      if (main_rank) print_header(run, c);
      double busbw_sum = 0;
      int rows = 0;
      int64_t wrong = 0;
      for (int64_t nominal : sizes) {
        const bench::CollectiveShape shape = bench::collective_shape(c, nominal, dtype_size(run.dtype), n);
        if (shape.in_count == 0 || shape.out_count == 0) continue;  // less than one element per rank
        const Row row = measure(run, c, shape);
        busbw_sum += row.bw.busbw, ++rows, wrong += row.wrong;
        if (!main_rank) continue;
        print_row(run, c, row);
        log.write(json_record(run, c, row));
      }
      all_wrong += wrong;
      if (!main_rank) continue;
      if (rows == 0) std::printf("# no size holds one element per rank: raise -e/--maxbytes\n");
      if (run.check) std::printf("# Wrong elements     : %lld %s\n", (long long)wrong, wrong == 0 ? "OK" : "FAILED");
      std::printf("# Avg bus bandwidth  : %g\n", rows ? busbw_sum / rows : 0.0);
    }
    if (main_rank) std::printf("#\n");
    return all_wrong == 0 ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_collectives: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  return samples::run_guarded("bench_collectives", [&] { return run(argc, argv); });
}
