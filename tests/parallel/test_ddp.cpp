// DistributedDataParallel over CPU ranks in a Gloo group. The central promise: W ranks,
// each training on its rows of a global batch, end with the parameters of one process
// trained on the whole batch (within 1e-5 relative, and bitwise equal across the ranks; for
// world sizes 2 and 4, gradients copied back or left as bucket views); gradient accumulation
// under no_sync equals the large batch; an unused parameter is named in the error; buffers
// come from rank 0, or are averaged; buckets follow reverse registration order, the caps and
// the dtypes; differing models are refused; call() wraps any forward; and the hooks of a
// destroyed wrapper do nothing.
//
// Ranks and the single-process reference are forked children meeting through a FileStore;
// a child reports through its exit code (0: every check passed; otherwise it prints what
// failed), and an alarm turns a hang into a failure. The parent does no tensor work (a child
// would remake the CPU thread pool anyway); each child runs its kernels on one thread, as
// four ranks share two cores on CI.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <sstream>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/serialization.h"
#include "layers/layers.h"
#include "parallel/ddp.h"
#include "parallel/store.h"

namespace loom::dist {
namespace {

using namespace std::chrono_literals;

// ---- processes -----------------------------------------------------------------------------

std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  return (std::filesystem::path(::testing::TempDir()) /
          (stem + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
      .string();
}

// Runs `body` in a forked child; its exit code is 0 when body returned, 1 when it threw.
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

using RankBody = std::function<void(int rank, std::shared_ptr<ProcessGroup> group)>;

// Runs `body` on `world` forked ranks of one Gloo group; expects every one to succeed.
void run_ranks(int world, const RankBody& body, ProcessGroupOptions options = {}) {
  std::string store_path = temp_path("ddp_store");
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

// Runs `body` in one forked child and expects it to succeed.
void run_alone(const std::function<void()>& body) { EXPECT_EQ(exit_code(fork_child(body)), 0); }

// ---- checks inside children (they throw; the child prints and fails) -------------------------

template <class... Parts>
void require(bool ok, const Parts&... parts) {
  if (ok) return;
  std::ostringstream os;
  (os << ... << parts);
  throw std::runtime_error(os.str());
}

// Expects `fn` to throw a loom::Error whose message holds every one of `parts`; returns it.
std::string require_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const std::string& p : parts) require(msg.find(p) != std::string::npos, "'", p, "' missing from: ", msg);
    return msg;
  }
  throw std::runtime_error("expected a loom::Error");
}

// Largest |a - b| relative to the largest |b|.
double relative_difference(const Tensor& a, const Tensor& b) {
  std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  require(x.size() == y.size(), "sizes differ: ", x.size(), " and ", y.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return diff / std::max(scale, 1e-30);
}

void require_close(const nn::NamedTensors& got, const std::map<std::string, Tensor>& want, double rtol) {
  require(got.size() == want.size(), got.size(), " tensors against ", want.size());
  for (const auto& [name, t] : got) {
    require(want.count(name) == 1, name, " missing from the reference");
    double d = relative_difference(t, want.at(name));
    require(d <= rtol, name, " differs from the reference by ", d, " (relative), more than ", rtol);
  }
}

// Every rank's copy of `t` equals rank 0's, exactly.
void require_equal_across_ranks(ProcessGroup& group, const std::string& name, const Tensor& t) {
  Tensor mine = t.contiguous().reshape({t.numel()});
  Tensor all = Tensor::empty({group.size() * t.numel()}, t.dtype());
  group.all_gather(all, mine)->wait();
  std::vector<double> v = all.to_vector<double>();
  for (int r = 1; r < group.size(); ++r)
    for (int64_t i = 0; i < t.numel(); ++i)
      require(v[r * t.numel() + i] == v[i], name, "[", i, "] is ", v[r * t.numel() + i], " on rank ", r, " but ", v[i],
              " on rank 0");
}

// ---- data, models, training ----------------------------------------------------------------

struct Batch {
  Tensor images;  // (N, 1, 28, 28)
  Tensor labels;  // (N,) i64
};

// The global batch of a step: the same on every process.
Batch global_batch(int step, int64_t n) {
  manual_seed(1000 + step);
  std::vector<int64_t> labels(n);
  for (int64_t i = 0; i < n; ++i) labels[i] = (i * 7 + step) % 10;
  return {randn({n, 1, 28, 28}), from_vector(labels, {n})};
}

// Rows [part * N / parts, (part + 1) * N / parts) of a batch.
Batch rows(const Batch& b, int part, int parts) {
  int64_t n = b.images.size(0);
  int64_t lo = part * n / parts, hi = (part + 1) * n / parts;
  return {b.images.slice(0, lo, hi).contiguous(), b.labels.slice(0, lo, hi).contiguous()};
}

std::shared_ptr<nn::SimpleCNN> make_cnn(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<nn::SimpleCNN>(1, 28, 10);
}

optim::SGDOptions sgd_options() {
  optim::SGDOptions o;
  o.lr = 0.05;
  o.momentum = 0.9;
  return o;
}

// One process trains SimpleCNN (rank 0's initialisation) on whole batches and saves it.
void train_reference(const std::string& path, int steps, int64_t batch) {
  auto model = make_cnn(0);
  optim::SGD opt(model->parameters(), sgd_options());
  for (int step = 0; step < steps; ++step) {
    Batch b = global_batch(step, batch);
    opt.zero_grad();
    cross_entropy(model->forward(b.images), b.labels).backward();
    opt.step();
  }
  save_safetensors(path, model->named_parameters());
}

// ---- tests -----------------------------------------------------------------------------------

struct TrainingCase {
  int world;
  bool views;  // DDPOptions::gradient_as_bucket_view
  bool debug;  // the collective ledger checks every rank issues the same calls
};

void PrintTo(const TrainingCase& c, std::ostream* os) {
  *os << "world " << c.world << (c.views ? ", gradients as bucket views" : ", gradients copied back")
      << (c.debug ? ", debug ledger" : "");
}

class DdpTraining : public ::testing::TestWithParam<TrainingCase> {};

TEST_P(DdpTraining, RanksOnShardsEqualOneProcessOnTheGlobalBatch) {
  constexpr int kSteps = 20;
  constexpr int64_t kBatch = 16;
  const TrainingCase c = GetParam();
  std::string reference = temp_path("ddp_reference") + ".safetensors";
  run_alone([&] { train_reference(reference, kSteps, kBatch); });
  ProcessGroupOptions options;
  options.debug = c.debug;
  run_ranks(
      c.world,
      [&](int rank, std::shared_ptr<ProcessGroup> group) {
        DDPOptions ddp_options;
        ddp_options.bucket_cap_mb = ddp_options.first_bucket_cap_mb = 0.05;  // several buckets
        ddp_options.gradient_as_bucket_view = c.views;
        auto model = make_cnn(rank);  // the ranks start differently: DDP broadcasts rank 0's
        DistributedDataParallel ddp(model, group, ddp_options);
        require(ddp.bucket_assignment().size() >= 3, "expected several buckets, got ", ddp.bucket_assignment().size());
        optim::SGD opt(ddp.parameters(), sgd_options());
        for (int step = 0; step < kSteps; ++step) {
          Batch b = rows(global_batch(step, kBatch), rank, c.world);
          opt.zero_grad();
          cross_entropy(ddp.forward(b.images), b.labels).backward();
          opt.step();
        }
        for (const auto& [name, p] : ddp.named_parameters()) require_equal_across_ranks(*group, name, p);
        require_close(model->named_parameters(), load_safetensors_map(reference), 1e-5);
        // classifier.3's weight and bias share bucket 0: their grads share its buffer only as views.
        auto& head = static_cast<nn::Linear&>(*(*model->classifier)[3]);
        bool shared = head.weight.grad().storage() == head.bias.grad().storage();
        require(shared == c.views, "the gradients are ", shared ? "" : "not ", "views into the bucket buffer");
      },
      options);
  std::filesystem::remove(reference);
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpTraining,
                         ::testing::Values(TrainingCase{2, false, true}, TrainingCase{4, true, false}),
                         [](const auto& info) {
                           return "World" + std::to_string(info.param.world) +
                                  (info.param.views ? "GradientsAsBucketViews" : "GradientsCopiedBack");
                         });

TEST(DdpNoSync, MicroBatchesUnderNoSyncThenOneSyncedStepEqualTheLargeBatch) {
  constexpr int kSteps = 3, kWorld = 2, kMicro = 3;
  constexpr int64_t kBatch = 12;  // 6 rows per rank, 2 per micro-batch
  std::string reference = temp_path("ddp_nosync_reference") + ".safetensors";
  run_alone([&] { train_reference(reference, kSteps, kBatch); });
  run_ranks(kWorld, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    for (bool views : {false, true}) {
      auto model = make_cnn(rank);
      DDPOptions options;
      options.gradient_as_bucket_view = views;
      DistributedDataParallel ddp(model, group, options);
      optim::SGD opt(ddp.parameters(), sgd_options());
      for (int step = 0; step < kSteps; ++step) {
        Batch mine = rows(global_batch(step, kBatch), rank, kWorld);
        opt.zero_grad();
        for (int k = 0; k < kMicro; ++k) {
          Batch micro = rows(mine, k, kMicro);
          auto loss = [&] { return mul(cross_entropy(ddp.forward(micro.images), micro.labels), 1.0 / kMicro); };
          if (k + 1 < kMicro) {
            auto guard = ddp.no_sync();
            int64_t before = group->sequence_number();
            loss().backward();
            require(group->sequence_number() == before, "a backward under no_sync communicated");
          } else {
            loss().backward();
          }
        }
        opt.step();
      }
      require_close(model->named_parameters(), load_safetensors_map(reference), 1e-5);
    }
  });
  std::filesystem::remove(reference);
}

// fc1 always takes part; fc2 only when use_fc2.
class TwoLayers : public nn::Module {
 public:
  TwoLayers() {
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(4, 3));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(3, 2));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = fc1->forward(x);
    return use_fc2 ? fc2->forward(h) : h;
  }
  std::shared_ptr<nn::Linear> fc1, fc2;
  bool use_fc2 = true;
};

TEST(DdpErrors, AParameterWithoutGradientIsNamedAndFreezingItWorks) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> group) {
    manual_seed(rank);
    Tensor x = randn({2, 4});
    auto model = std::make_shared<TwoLayers>();
    DistributedDataParallel ddp(model, group);
    model->use_fc2 = false;
    std::string msg = require_error([&] { sum(ddp.forward(x)).backward(); },
                                    {"parameters that did not receive a gradient: module.fc2.weight, module.fc2.bias",
                                     "find_unused_parameters is not supported", "requires_grad(false)"});
    require(msg.find("fc1") == std::string::npos, "fc1 took part but is named: ", msg);
    // The group and the wrapper recover: a step that uses every parameter is averaged.
    model->use_fc2 = true;
    model->zero_grad();
    sum(ddp.forward(x)).backward();
    require_equal_across_ranks(*group, "fc1.weight.grad", model->fc1->weight.grad());

    auto frozen = std::make_shared<TwoLayers>();
    frozen->fc2->weight.set_requires_grad(false);
    frozen->fc2->bias.set_requires_grad(false);
    frozen->use_fc2 = false;
    DistributedDataParallel frozen_ddp(frozen, group);
    sum(frozen_ddp.forward(x)).backward();
    require_equal_across_ranks(*group, "fc1.weight.grad", frozen->fc1->weight.grad());
  });
}

TEST(DdpErrors, ChannelsLastParametersAreRefusedSayingWhy) {
  run_ranks(2, [](int, std::shared_ptr<ProcessGroup> group) {
    auto model = std::make_shared<nn::Conv2d>(3, 4, 3);
    model->to(MemoryFormat::channels_last);
    require_error([&] { DistributedDataParallel ddp(model, group); },
                  {"parameter module.weight is not row-major", "Module::to(MemoryFormat)",
                   "leave the module's parameters row-major"});
  });
}

TEST(DdpErrors, DifferentModelsOnTheRanksAreRefusedOnEveryRank) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> group) {
    auto model = std::make_shared<nn::Linear>(4, rank == 0 ? 2 : 3);
    require_error([&] { DistributedDataParallel ddp(model, group); },
                  {"differs from rank 0's", "on rank 1", "every rank must build the same model"});
  });
}

// A residual block in miniature: conv, batch norm, a skip connection, a linear head.
class ConvBnNet : public nn::Module {
 public:
  ConvBnNet() {
    nn::Conv2dOptions same;
    same.padding = {1, 1};
    conv = register_module("conv", std::make_shared<nn::Conv2d>(1, 4, 3, same));
    bn = register_module("bn", std::make_shared<nn::BatchNorm2d>(4));
    fc = register_module("fc", std::make_shared<nn::Linear>(4 * 8 * 8, 10));
  }
  // (N, 1, 8, 8) -> (N, 10)
  Tensor forward(const Tensor& x) override {
    Tensor h = conv->forward(x);
    return fc->forward(relu(add(bn->forward(h), h)).flatten(1));
  }
  std::shared_ptr<nn::Conv2d> conv;
  std::shared_ptr<nn::BatchNorm2d> bn;
  std::shared_ptr<nn::Linear> fc;
};

std::shared_ptr<ConvBnNet> make_bn_net(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<ConvBnNet>();
}

Batch small_batch(int step, int64_t n) {
  Batch b = global_batch(step, n);
  return {b.images.slice(2, 0, 8).slice(3, 0, 8).contiguous(), b.labels};
}

TEST(DdpBuffers, RankZerosBuffersAtConstructionAndBeforeEachForwardWithGradMode) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> group) {
    auto model = make_bn_net(rank);
    fill_(model->bn->running_mean, rank + 1);
    DistributedDataParallel ddp(model, group);
    auto rank0 = make_bn_net(0);
    auto mine = model->named_parameters(), theirs = rank0->named_parameters();
    for (size_t i = 0; i < mine.size(); ++i)
      require(relative_difference(mine[i].second, theirs[i].second) == 0, mine[i].first, " is not rank 0's");
    require(model->bn->running_mean.to_vector<double>() == std::vector<double>(4, 1), "running_mean is not rank 0's");

    model->eval();
    Tensor x = small_batch(0, 2).images;
    fill_(model->bn->running_mean, 10 + rank);
    Tensor out = ddp.forward(x);
    require(model->bn->running_mean.to_vector<double>() == std::vector<double>(4, 10),
            "the forward did not broadcast rank 0's running_mean");
    require_equal_across_ranks(*group, "output", out.detach());
    {
      // As in PyTorch, a forward under no-grad (evaluation, perhaps on one rank) does not
      // communicate.
      NoGradGuard no_grad;
      fill_(model->bn->running_mean, 20 + rank);
      ddp.forward(x);
      require(model->bn->running_mean.to_vector<double>() == std::vector<double>(4, 20 + rank),
              "a forward under no-grad broadcast the buffers");
    }
  });
}

TEST(DdpBuffers, AveragedRunningStatisticsEndEqualAcrossRanks) {
  constexpr int kSteps = 5, kWorld = 2;
  constexpr int64_t kBatch = 8;
  run_ranks(kWorld, [&](int rank, std::shared_ptr<ProcessGroup> group) {
    auto model = make_bn_net(rank);
    DDPOptions options;
    options.sync_buffers_average = true;
    DistributedDataParallel ddp(model, group, options);
    optim::SGD opt(ddp.parameters(), sgd_options());
    for (int step = 0; step < kSteps; ++step) {
      Batch global = small_batch(step, kBatch);
      Batch b = rows(global, rank, kWorld);
      opt.zero_grad();
      cross_entropy(ddp.forward(b.images), b.labels).backward();
      if (step == 0) {
        // Equal shards: the mean of the ranks' batch means is the global batch's mean, so
        // the averaged running_mean is the one a single process gets on the whole batch.
        auto single = make_bn_net(0);
        single->forward(global.images);
        double d = relative_difference(model->bn->running_mean, single->bn->running_mean);
        require(d < 1e-5, "the averaged running_mean differs from the global batch's by ", d);
      }
      opt.step();
    }
    for (const auto& [name, t] : ddp.state_dict()) require_equal_across_ranks(*group, name, t);
    require(model->bn->num_batches_tracked.item() == kSteps, "num_batches_tracked is ",
            model->bn->num_batches_tracked.item());
  });
}

// Parameters of three dtypes' worth of buckets: a and c f32, b f64, d frozen.
class MixedDtypes : public nn::Module {
 public:
  MixedDtypes() {
    register_parameter("a", zeros({4}));
    register_parameter("b", zeros({4}, DType::f64));
    register_parameter("c", zeros({4}));
    register_parameter("d", zeros({4})).set_requires_grad(false);
  }
};

TEST(DdpBuckets, ReverseRegistrationOrderWithinTheCapsOneDtypeEach) {
  using Buckets = std::vector<std::vector<std::string>>;
  run_ranks(2, [](int, std::shared_ptr<ProcessGroup> group) {
    auto names = [](std::vector<std::string> short_names) {
      for (std::string& n : short_names) n = "module." + n;
      return short_names;
    };
    auto require_buckets = [](const DistributedDataParallel& ddp, const Buckets& want, const char* what) {
      Buckets got = ddp.bucket_assignment();
      std::ostringstream os;
      for (const auto& b : got) {
        os << "[";
        for (const auto& n : b) os << n << " ";
        os << "] ";
      }
      require(got == want, what, ": got ", os.str());
    };
    // SimpleCNN's classifier.1.weight alone is 800 KiB; everything else is under 80 KiB.
    DistributedDataParallel one(make_cnn(0), group);
    require(one.state_dict()[0].first == "module.features.0.weight", "state_dict key ", one.state_dict()[0].first);
    require_buckets(one,
                    {names({"classifier.3.bias", "classifier.3.weight", "classifier.1.bias", "classifier.1.weight",
                            "features.3.bias", "features.3.weight", "features.0.bias", "features.0.weight"})},
                    "default caps");
    DDPOptions small;
    small.bucket_cap_mb = small.first_bucket_cap_mb = 0.1;
    DistributedDataParallel two(make_cnn(0), group, small);
    require_buckets(two,
                    {names({"classifier.3.bias", "classifier.3.weight", "classifier.1.bias", "classifier.1.weight"}),
                     names({"features.3.bias", "features.3.weight", "features.0.bias", "features.0.weight"})},
                    "0.1 MiB caps");
    DDPOptions tiny_first;
    tiny_first.first_bucket_cap_mb = 0.001;
    DistributedDataParallel first(make_cnn(0), group, tiny_first);
    require_buckets(first,
                    {names({"classifier.3.bias", "classifier.3.weight"}),
                     names({"classifier.1.bias", "classifier.1.weight", "features.3.bias", "features.3.weight",
                            "features.0.bias", "features.0.weight"})},
                    "a 1 KiB first bucket");
    DistributedDataParallel mixed(std::make_shared<MixedDtypes>(), group);
    require_buckets(mixed, {names({"c", "a"}), names({"b"})}, "mixed dtypes");
  });
}

TEST(DdpWrapper, CallRunsAForwardOfAnyShapeWithTheSameSynchronisation) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> group) {
    manual_seed(rank);
    Tensor x = randn({2, 4}), y = randn({2, 4});
    auto model = std::make_shared<TwoLayers>();
    DistributedDataParallel ddp(model, group);
    // A two-input forward, as a model with targets has.
    Tensor loss = ddp.call([&] { return sum(add(model->forward(x), model->forward(y))); });
    loss.backward();
    for (const auto& [name, p] : model->named_parameters()) require_equal_across_ranks(*group, name, p.grad());
  });
}

TEST(DdpWrapper, AModuleOutlivingItsWrapperTrainsLocally) {
  run_ranks(2, [](int rank, std::shared_ptr<ProcessGroup> group) {
    manual_seed(rank);
    Tensor x = randn({2, 4});
    auto model = std::make_shared<TwoLayers>();
    { DistributedDataParallel ddp(model, group); }
    int64_t before = group->sequence_number();
    sum(model->forward(x)).backward();
    require(group->sequence_number() == before, "the hooks of a destroyed wrapper communicated");
    require(model->fc2->bias.grad().to_vector<double>() == std::vector<double>(2, 2), "fc2.bias.grad is ",
            model->fc2->bias.grad().str());
  });
}

}  // namespace
}  // namespace loom::dist
