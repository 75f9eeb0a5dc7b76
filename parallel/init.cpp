// init.h's start-up; the step numbers are those of init.h's essay.
#include "parallel/init.h"

#include <unistd.h>

#include <climits>
#include <optional>

#include "engine/ops.h"
#include "parallel/launcher.h"
#include "parallel/rendezvous.h"
#include "parallel/socket.h"

namespace loom::dist {

DistContext init_distributed(const std::string& device_flag, Duration timeout) {
  DistContext ctx;
  if (!launched_with_rank()) {  // step 1
    ctx.device = device_flag == "auto" ? default_device() : Device::parse(device_flag);
    return ctx;
  }
  const RendezvousInfo info = rendezvous_from_env();  // step 2
  ctx.rank = info.rank, ctx.size = info.world_size, ctx.local_rank = info.local_rank;
  const int gpus = cuda_device_count();  // step 3
  if (device_flag == "cpu" || (device_flag == "auto" && gpus == 0)) {
    ctx.device = Device::cpu();
  } else {
    LOOM_CHECK(device_flag == "auto" || device_flag == "cuda", "--device ", device_flag,
               ": under a launcher each rank takes the GPU of its LOCAL_RANK; use --device cuda (or auto) or cpu");
    LOOM_CHECK(info.local_rank < gpus, "LOCAL_RANK=", info.local_rank, " but only ", gpus,
               " GPU(s) are visible: start at most one rank per GPU (loomrun --nproc-per-node auto), or "
               "--device cpu");
    ctx.device = Device::cuda(info.local_rank);
  }
  ctx.store = connect_store(info, timeout);  // step 4
  ProcessGroupOptions options;
  options.timeout = timeout;
  ctx.group = ctx.device.is_cuda() ? new_nccl_group(ctx.store, ctx.rank, ctx.size, ctx.device, options)
                                   : new_gloo_group(ctx.store, ctx.rank, ctx.size, options);
  ctx.active = ctx.size > 1;
  return ctx;
}

std::vector<std::string> command_without(int argc, char** argv, const std::vector<std::string>& drop_flags) {
  char self[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  std::vector<std::string> command{n > 0 ? std::string(self, size_t(n)) : std::string(argv[0])};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    bool dropped = false;
    for (const std::string& flag : drop_flags) {
      if (arg == "--" + flag) {
        ++i, dropped = true;  // and its value
        break;
      }
      if (arg.starts_with("--" + flag + "=")) {
        dropped = true;
        break;
      }
    }
    if (!dropped) command.push_back(arg);
  }
  return command;
}

int relaunch(int argc, char** argv, int ranks, const std::string& drop_flag) {
  LaunchOptions options;
  options.command = command_without(argc, argv, {drop_flag});
  options.nproc_per_node = ranks;
  options.master_addr = "127.0.0.1";
  options.master_port = net::free_port();
  return launch(options);
}

void check_same_on_every_rank(const DistContext& ctx, const std::vector<SharedValue>& values, const std::string& hint) {
  if (!ctx.active || values.empty()) return;
  const int64_t n = int64_t(values.size());
  std::vector<int64_t> mine;
  for (const SharedValue& v : values) mine.push_back(v.value);
  Tensor in = from_vector(mine, {n}).to(ctx.device);
  Tensor out = Tensor::empty({int64_t(ctx.size) * n}, DType::i64, ctx.device);
  ctx.group->all_gather(out, in)->wait();
  const std::vector<int64_t> all = out.to(Device::cpu()).to_vector<int64_t>();
  for (int r = 1; r < ctx.size; ++r) {
    std::string differ;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t theirs = all[size_t(r * n + i)], reference = all[size_t(i)];
      if (theirs == reference) continue;
      differ += ::loom::detail::str(differ.empty() ? "" : "; ", values[size_t(i)].name, ": rank ", r, " has ", theirs,
                            ", rank 0 has ", reference);
    }
    LOOM_CHECK(differ.empty(), "rank ", ctx.rank, ": ranks ", r, " and 0 disagree before the first step (", differ,
               "), so they would run different numbers of steps and collectives: ", hint);
  }
}

void check_on_every_rank(const DistContext& ctx, const std::function<void()>& check, const std::string& what) {
  if (!ctx.active) return check();
  std::optional<Error> mine;
  try {
    check();
  } catch (const Error& e) {
    mine = e;
  }
  // The lowest failing rank, or size() when none failed.
  Tensor failed = full({1}, double(mine ? ctx.rank : ctx.size), DType::i64, ctx.device);
  ctx.group->all_reduce(failed, ReduceOp::min)->wait();
  const int64_t first = int64_t(failed.to(Device::cpu()).item());
  if (mine) throw *mine;
  LOOM_CHECK(first >= ctx.size, "rank ", ctx.rank, ": rank ", first, " failed ", what,
             " (its message says why), so every rank stops");
}

double mean_over_ranks(const DistContext& ctx, double value) {
  if (!ctx.active) return value;
  Tensor t = full({1}, value, DType::f64, ctx.device);
  ctx.group->all_reduce(t, ReduceOp::avg)->wait();
  return t.to(Device::cpu()).to(DType::f64).item();
}

}  // namespace loom::dist
