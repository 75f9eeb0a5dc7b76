// train_cnn: trains SimpleCNN or ResNet-18 on Fashion-MNIST, CIFAR-10/100 or a folder of
// images, on a GPU or the CPU, and reports test accuracy after every epoch. With no flags it
// trains the guide's SimpleCNN on Fashion-MNIST (Debian's dataset-fashion-mnist) on the GPU,
// or on the CPU where there is none. `train_cnn --help` lists every flag.
//
// Each epoch: a progress line (images/s, loss, time left, data-loader stalls), the test loss
// and accuracy, one JSON line in the metrics file, and the loss/accuracy chart redrawn as SVG.
// --save writes a training checkpoint (model, optimizer, schedule, generator, data position)
// after every epoch and every --save-every steps; --resume continues from one, following the
// same losses as a run that never stopped.
//
// Data parallel: under loomrun (or torchrun --no-python, mpirun, srun) every rank trains on
// its shard with DistributedDataParallel over NCCL (GPUs) or Gloo (--device cpu); `--gpus N`
// starts the N ranks itself. Rank 0 prints, logs and checkpoints; the batch size is per rank.
// With --fsdp the ranks hold only their shards of the parameters, gradients and optimizer state
// (FullyShardedDataParallel, units chosen by --min-params; --hsdp N for N replicas of
// sharded groups), and --save writes a sharded
// checkpoint, a folder in which every rank writes its own shards (parallel/sharded_checkpoint.h).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include "data/cifar.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "data/loader.h"
#include "engine/autocast.h"
#include "engine/allocator.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/layers.h"
#include "layers/optim/captured_step.h"
#include "parallel/ddp.h"
#include "parallel/device_mesh.h"
#include "parallel/fsdp.h"
#include "parallel/sharded_checkpoint.h"
#include "parallel/init.h"
#include "parallel/memory_plan.h"
#include "parallel/rendezvous.h"
#include "parallel/trace.h"
#include "samples/common/flags.h"
#include "samples/common/metrics.h"
#include "samples/common/program.h"
#include "samples/common/progress.h"
#include "samples/common/scaling.h"

using namespace loom;

namespace {

struct Options {
  std::string model = "simplecnn", data = "fashion-mnist", data_dir, optimizer = "auto", schedule = "cosine";
  std::string precision = "f32", device = "auto", augment = "auto";
  std::string init, save, resume, metrics = "train_cnn.jsonl", plot = "train_cnn.svg";
  std::string trace, reshard_after_forward = "yes";
  int64_t epochs = 0, batch_size = 128, seed = 0, workers = 4, subset = 0, test_subset = 0, save_every = 0;
  int64_t warmup = 0, max_steps = 0, gpus = 0, bucket_mb = 25, timeout_s = 600, scaling = 0, min_params = 100000,
          hsdp = 1;
  double lr = 0, momentum = 0.9, weight_decay = -1, clip = 0, label_smoothing = 0;
  bool gpu_resident = false, quiet = false, sync_bn_stats = false, allow_nonfinite = false, fsdp = false;
  bool graph = true, channels_last = false;
};

struct Datasets {
  data::ImageSet train, test;
  std::string name;
  std::vector<float> mean, std;
};

std::string default_dir(const std::string& data) {
  if (data == "fashion-mnist") return data::kFashionMnistDir;
  if (data == "cifar10") return "data/cifar-10-batches-bin";
  if (data == "cifar100") return "data/cifar-100-binary";
  return "";
}

// Keeps the first `n` examples (n = 0: all).
void take_first(data::ImageSet* set, int64_t n) {
  if (n <= 0 || n >= set->count) return;
  set->count = n;
  set->pixels.resize(size_t(n * set->image_bytes()));
  if (!set->labels.empty()) set->labels.resize(size_t(n));
}

std::string shape_text(const data::ImageSet& s) {
  return std::to_string(s.channels) + "x" + std::to_string(s.height) + "x" + std::to_string(s.width);
}

Datasets load_datasets(const Options& o, const samples::Flags& flags) {
  Datasets d;
  const std::string dir = o.data_dir.empty() ? default_dir(o.data) : o.data_dir;
  if (o.data == "fashion-mnist") {
    if (!std::filesystem::exists(dir))
      flags.fail("Fashion-MNIST is not in " + dir +
                 "; install Debian's dataset-fashion-mnist package or give --data-dir with the four IDX files");
    d.train = data::load_fashion_mnist(dir, data::Split::train);
    d.test = data::load_fashion_mnist(dir, data::Split::test);
    d.mean = {0.2860f};
    d.std = {0.3530f};
  } else if (o.data == "cifar10" || o.data == "cifar100") {
    if (!std::filesystem::exists(dir))
      flags.fail("no CIFAR data in " + dir + "; download the binary version (" +
                 (o.data == "cifar10" ? std::string("cifar-10-binary.tar.gz") : "cifar-100-binary.tar.gz") +
                 " from https://www.cs.toronto.edu/~kriz/cifar.html), unpack it and give --data-dir");
    if (o.data == "cifar10") {
      d.train = data::load_cifar10(dir, data::Split::train);
      d.test = data::load_cifar10(dir, data::Split::test);
    } else {
      d.train = data::load_cifar100(dir, data::Split::train);
      d.test = data::load_cifar100(dir, data::Split::test);
    }
    d.mean = {0.4914f, 0.4822f, 0.4465f};
    d.std = {0.2470f, 0.2435f, 0.2616f};
  } else {  // folder: DIR/train/<class>/... and DIR/test/<class>/...
    if (dir.empty()) flags.fail("--data folder needs --data-dir DIR with DIR/train and DIR/test, one subfolder per class");
    for (const char* split : {"train", "test"})
      if (!std::filesystem::is_directory(std::filesystem::path(dir) / split))
        flags.fail("--data-dir " + dir + " has no " + split + "/ folder; --data folder expects DIR/train/<class>/ and DIR/test/<class>/");
    d.train = data::load_image_folder((std::filesystem::path(dir) / "train").string());
    d.test = data::load_image_folder((std::filesystem::path(dir) / "test").string(), int(d.train.channels));
    if (d.train.class_names != d.test.class_names)
      flags.fail("--data-dir " + dir + ": train/ and test/ have different class folders");
    d.mean.assign(size_t(d.train.channels), 0.5f);
    d.std.assign(size_t(d.train.channels), 0.5f);
  }
  if (d.test.channels != d.train.channels || d.test.height != d.train.height || d.test.width != d.train.width)
    flags.fail("the test images in " + d.test.source + " are " + shape_text(d.test) + " (channels x height x width), " +
               "the training images in " + d.train.source + " are " + shape_text(d.train) +
               ": a model trained on one shape cannot be tested on another; give a test set of the training images' "
               "shape");
  take_first(&d.train, o.subset);
  take_first(&d.test, o.test_subset);
  d.name = o.data;
  return d;
}

int64_t class_count(const Datasets& d) {
  int64_t classes = 0;
  for (int64_t l : d.train.labels) classes = std::max(classes, l + 1);
  for (int64_t l : d.test.labels) classes = std::max(classes, l + 1);
  return std::max<int64_t>(classes, int64_t(d.train.class_names.size()));
}

std::shared_ptr<nn::Module> make_model(const Options& o, const Datasets& d, const samples::Flags& flags) {
  const int64_t classes = class_count(d);
  if (o.model == "simplecnn") {
    if (d.train.height != d.train.width)
      flags.fail("SimpleCNN takes square images; the data's are " + std::to_string(d.train.height) + "x" +
                 std::to_string(d.train.width));
    return std::make_shared<nn::SimpleCNN>(d.train.channels, d.train.height, classes);
  }
  return nn::resnet18(classes, d.train.channels);
}

// What a checkpoint to resume holds, checked against this run before anything is loaded:
// the program and model first (a message that names them beats a list of missing weights),
// then the settings that give its data position its meaning.
void check_resume(const Options& o, const std::map<std::string, std::string>& saved, const samples::Flags& flags) {
  const auto entry = [&](const char* key) { return saved.count(key) ? saved.at(key) : std::string(); };
  if (!entry("program").empty() && entry("program") != "train_cnn")
    flags.fail("--resume " + o.resume + " was written by " + entry("program") +
               (entry("config").empty() ? "" : " (a GPT of config " + entry("config") + ")") +
               "; train_cnn resumes its own checkpoints");
  if (entry("model").empty() && !entry("config").empty())
    flags.fail("--resume " + o.resume + " holds a GPT (config " + entry("config") +
               ", written by train_gpt); train_cnn resumes its own checkpoints");
  for (const char* key : {"model", "data"}) {
    const std::string& mine = key == std::string("model") ? o.model : o.data;
    if (!entry(key).empty() && entry(key) != mine)
      flags.fail("--resume " + o.resume + " holds a " + entry("model") + " trained on " + entry("data") +
                 "; this run is --" + key + " " + mine + ": resume with --model " + entry("model") + " --data " +
                 entry("data"));
  }
  if (!entry("optimizer").empty() && entry("optimizer") != o.optimizer)
    flags.fail("--resume " + o.resume + " was saved with --optimizer " + entry("optimizer") + ", this run has --optimizer " +
               o.optimizer + ": resume with --optimizer " + entry("optimizer"));
}

std::unique_ptr<optim::Optimizer> make_optimizer(const Options& o, const TensorList& params) {
  if (o.optimizer == "sgd")
    return std::make_unique<optim::SGD>(params, optim::SGDOptions{.lr = o.lr, .momentum = o.momentum,
                                                                  .weight_decay = o.weight_decay,
                                                                  .nesterov = optim::Nesterov::no});
  if (o.optimizer == "adam")
    return std::make_unique<optim::Adam>(params, optim::AdamOptions{.lr = o.lr, .weight_decay = o.weight_decay});
  return std::make_unique<optim::AdamW>(params, optim::AdamWOptions{.lr = o.lr, .weight_decay = o.weight_decay});
}

optim::Schedule make_schedule(const Options& o, int64_t total_steps) {
  optim::Schedule main;
  if (o.schedule == "cosine") main = optim::cosine_annealing(std::max<int64_t>(total_steps - o.warmup, 1));
  else if (o.schedule == "step") main = optim::step_lr(std::max<int64_t>(total_steps / 3, 1), 0.1);
  else if (o.schedule == "onecycle")
    return optim::one_cycle({.max_lr = o.lr, .total_steps = std::max<int64_t>(total_steps, 1)});
  else main = [](int64_t, double base) { return base; };
  if (o.warmup > 0) return optim::sequential(optim::linear_lr(1.0 / double(o.warmup), 1.0, o.warmup), o.warmup, main);
  return main;
}

struct EvalResult {
  double loss = 0, accuracy = 0;
};

// `forward` runs the model (through FSDP when its parameters are sharded).
EvalResult evaluate(nn::Module& model, const std::function<Tensor(const Tensor&)>& forward,
                    const data::DataLoader& loader, std::optional<DType> autocast) {
  NoGradGuard no_grad;
  AutocastGuard cast(autocast);
  model.eval();
  Tensor loss_sum, correct;
  int64_t seen = 0;
  data::Epoch batches = loader.epoch(0);
  for (data::Batch& b : batches) {
    Tensor logits = forward(b.inputs).to(DType::f32);
    Tensor l = mul(cross_entropy(logits, b.targets), double(b.targets.size(0)));
    Tensor c = sum(eq(argmax(logits, 1), b.targets).to(DType::f32));
    loss_sum = loss_sum.defined() ? add(loss_sum, l) : l;
    correct = correct.defined() ? add(correct, c) : c;
    seen += b.targets.size(0);
  }
  model.train();
  if (seen == 0) return {};
  return {loss_sum.item() / double(seen), correct.item() / double(seen)};
}

int run(int argc, char** argv) {
  Options o;
  samples::Flags flags("train_cnn",
                       "Trains SimpleCNN (the guide's CIFAR-10 network) or ResNet-18 on Fashion-MNIST, CIFAR-10/100 or an\n"
                       "image folder, printing test accuracy each epoch. With no flags: SimpleCNN on Fashion-MNIST.");
  flags.add("model", &o.model, "the network", {"simplecnn", "resnet18"});
  flags.add("data", &o.data, "the dataset", {"fashion-mnist", "cifar10", "cifar100", "folder"});
  flags.add("data-dir", &o.data_dir,
            "where the data is (default: /usr/share/datasets/fashion-mnist, data/cifar-10-batches-bin, "
            "data/cifar-100-binary; folder: DIR/train/<class>/, DIR/test/<class>/)",
            {}, "DIR");
  flags.add("epochs", &o.epochs, "passes over the training set (0: 15 for simplecnn, 2 on the CPU; 30 for resnet18)", 0);
  flags.add("batch-size", &o.batch_size, "images per step", 1);
  flags.add("lr", &o.lr, "peak learning rate (0: 0.1 for sgd, 1e-3 for adam/adamw)", 0);
  flags.add("optimizer", &o.optimizer, "the optimizer (auto: adam for simplecnn, sgd for resnet18)",
            {"auto", "sgd", "adam", "adamw"});
  flags.add("momentum", &o.momentum, "SGD momentum", 0, 1);
  flags.add("weight-decay", &o.weight_decay, "weight decay (-1: 5e-4 for sgd, 0 for adam, 0.01 for adamw)", -1);
  flags.add("schedule", &o.schedule, "learning-rate schedule over the run", {"cosine", "step", "onecycle", "none"});
  flags.add("warmup", &o.warmup, "linear warm-up steps before the schedule", 0);
  flags.add("clip", &o.clip, "clip the gradients' global norm to this (0: no clipping)", 0);
  flags.add("label-smoothing", &o.label_smoothing, "cross-entropy label smoothing", 0, 1);
  flags.add("augment", &o.augment, "training augmentation (auto: crop-flip for CIFAR, none otherwise)",
            {"auto", "none", "flip", "crop-flip"});
  flags.add("precision", &o.precision, "f32, or bf16 autocast for convolutions and products (f32 master weights)",
            {"f32", "bf16"});
  flags.add("device", &o.device, "cpu, cuda or cuda:N (auto: the first GPU, else the CPU)", {}, "DEVICE");
  flags.add("workers", &o.workers, "data-loader threads", 0, 64);
  flags.add_switch("gpu-resident", &o.gpu_resident, "keep the whole dataset on the GPU (no augmentation)");
  flags.add_switch("channels-last", &o.channels_last,
                   "lay each batch out channels-last (N, H, W, C in memory); the network keeps that layout, "
                   "and on one GPU (not under DDP or FSDP) the convolutions' weights are laid out so too");
  flags.add("init", &o.init, "initial weights (a safetensors state dict, e.g. from PyTorch)", {}, "FILE");
  flags.add("save", &o.save, "write a training checkpoint here after every epoch (with --fsdp: a folder of shards)", {},
            "PATH");
  flags.add("save-every", &o.save_every, "also checkpoint every N steps (needs --save)", 0);
  flags.add("resume", &o.resume, "continue the run saved in this checkpoint (file, or --fsdp's folder)", {}, "PATH");
  flags.add("seed", &o.seed, "seed for initial weights, data order and augmentation", 0);
  flags.add("subset", &o.subset, "train on the first N images only (0: all)", 0);
  flags.add("test-subset", &o.test_subset, "test on the first N images only (0: all)", 0);
  flags.add("max-steps", &o.max_steps, "stop after this many steps in all (0: no limit)", 0);
  flags.add("metrics", &o.metrics, "append one JSON line per epoch here (\"\": none)", {}, "FILE");
  flags.add("plot", &o.plot, "draw the loss and accuracy curves here as SVG (\"\": none)", {}, "FILE");
  flags.add("trace", &o.trace, "write every rank's step timeline here as Chrome-trace JSON (ui.perfetto.dev)", {},
            "FILE");
  flags.add("gpus", &o.gpus, "data-parallel over N GPUs of this node: starts N ranks (as loomrun would)", 0, 1024);
  flags.add("bucket-mb", &o.bucket_mb, "data parallel: gradient bucket size in MiB", 1);
  flags.add_switch("sync-bn-stats", &o.sync_bn_stats,
                   "data parallel (DDP or FSDP): average BatchNorm running statistics over ranks after each step");
  flags.add_switch("fsdp", &o.fsdp,
                   "data parallel: shard parameters, gradients and optimizer state over the ranks (parallel/fsdp.h) "
                   "instead of replicating them (DDP)");
  flags.add("reshard-after-forward", &o.reshard_after_forward,
            "FSDP: free a unit's full parameters after its forward (yes: ZeRO-3) or keep them until its backward "
            "(no: ZeRO-2)",
            {"yes", "no"});
  flags.add("min-params", &o.min_params, "FSDP: a module with at least this many parameters becomes a unit", 1);
  flags.add("hsdp", &o.hsdp,
            "FSDP: hybrid sharding (HSDP): N replicas, each sharding the model over ranks / N consecutive ranks "
            "(one node's GPUs), their gradients averaged between replicas",
            1);
  flags.add("timeout-s", &o.timeout_s, "data parallel: seconds before a stuck collective ends the run", 1);
  flags.add("scaling", &o.scaling,
            "run the same training on 1, 2, 4, ... N ranks and report speedup and efficiency (table, "
            "--metrics JSON lines, --plot SVG); add --device cpu for CPU ranks",
            0, 1024);
  flags.add_switch("quiet", &o.quiet, "print only the per-epoch summaries");
  flags.add_switch("graph", &o.graph,
                   "on one GPU, capture the training step as one CUDA graph after 2 eager steps and replay it "
                   "(not under DDP or FSDP, nor with --trace; a smaller last batch runs eagerly)");
  flags.add_switch("allow-nonfinite", &o.allow_nonfinite,
                   "train on even when the initial weights or the loss hold NaN or infinity (default: stop, naming "
                   "the parameter or the step)");
  samples::reject_positional(flags, flags.parse(argc, argv), "the data is chosen with --data and --data-dir");
  if (!o.init.empty() && !o.resume.empty())
    flags.fail("--init " + o.init + " and --resume " + o.resume +
               " both give the weights: --resume continues a run (its weights included), --init starts a new one");
  if (o.scaling > 0 && !dist::launched_with_rank()) {
    samples::ScalingOptions so;
    so.max_ranks = int(o.scaling);
    so.json_path = o.metrics == "train_cnn.jsonl" ? "train_cnn_scaling.jsonl" : o.metrics;
    so.svg_path = o.plot == "train_cnn.svg" ? "train_cnn_scaling.svg" : o.plot;
    return samples::run_scaling(argc, argv, so);
  }
  // Data parallel, started here: run this program again as `--gpus` ranks and wait for them.
  if (o.gpus > 1 && !dist::launched_with_rank()) {
    if (cuda_device_count() < o.gpus)
      flags.fail("--gpus " + std::to_string(o.gpus) + ": only " + std::to_string(cuda_device_count()) +
                 " GPU(s) are visible (for CPU ranks use loomrun --nproc-per-node N ... --device cpu)");
    return dist::relaunch(argc, argv, int(o.gpus), "gpus");
  }

  // ---- resolve defaults ---------------------------------------------------------------
  const bool resnet = o.model == "resnet18";
  if (o.optimizer == "auto") o.optimizer = resnet ? "sgd" : "adam";
  if (flags.given("momentum") && o.optimizer != "sgd")
    flags.fail("--momentum is SGD's; this run's optimizer is " + o.optimizer + " (add --optimizer sgd, or drop it)");
  if (o.lr == 0) o.lr = o.optimizer == "sgd" ? 0.1 : 1e-3;
  if (o.weight_decay < 0) o.weight_decay = o.optimizer == "sgd" ? 5e-4 : o.optimizer == "adamw" ? 0.01 : 0;
  const bool on_gpu = o.device == "auto" ? cuda_device_count() > 0 : o.device.starts_with("cuda");
  if (o.epochs == 0) {
    // A full run on a GPU; on the CPU a short one that still shows learning (2 epochs of
    // SimpleCNN on Fashion-MNIST take about a minute on two cores and reach about 87%).
    o.epochs = resnet ? 30 : on_gpu ? 15 : 2;
    if (!on_gpu) std::printf("no GPU: training %lld epochs on the CPU (--epochs N for more)\n", (long long)o.epochs);
  }
  if (o.augment == "auto") o.augment = o.data.starts_with("cifar") ? "crop-flip" : "none";
  if (o.save_every > 0 && o.save.empty()) flags.fail("--save-every needs --save PATH");
  if (!o.fsdp && (flags.given("reshard-after-forward") || flags.given("min-params") || flags.given("hsdp")))
    flags.fail("--reshard-after-forward, --min-params and --hsdp are FSDP's: add --fsdp");
  if (o.gpu_resident && o.augment != "none")
    flags.fail("--gpu-resident keeps batches on the GPU without augmentation; add --augment none");
  if (o.device != "auto") {
    try {
      Device::parse(o.device);
    } catch (const Error& e) {
      flags.fail("--device " + o.device + ": " + e.what());
    }
  }
  // A checkpoint to resume is looked at (its header alone) before any data is read.
  const std::map<std::string, std::string> saved =
      o.resume.empty() ? std::map<std::string, std::string>{} : samples::checkpoint_entries(flags, o.resume, "train_cnn");
  if (!o.resume.empty()) {
    check_resume(o, saved, flags);
    // --fsdp resumes its folders of shards, and a single file of a plain or DDP run too.
    samples::check_resume_format(flags, o.resume,
                                 o.fsdp ? std::vector<std::string>{samples::kShardedCheckpoint, samples::kFileCheckpoint}
                                        : std::vector<std::string>{samples::kFileCheckpoint});
  }
  dist::DistContext ctx = dist::init_distributed(o.device, std::chrono::seconds(o.timeout_s));
  const Device device = ctx.device;
  const bool main_rank = ctx.is_main();
  if (o.hsdp > 1 && (!ctx.active || ctx.size % o.hsdp != 0))
    flags.fail("--hsdp " + std::to_string(o.hsdp) + ": the " + std::to_string(ctx.size) +
               " rank(s) started do not divide into that many replicas of equal size");
  if (main_rank) {
    samples::check_output_paths(flags, {{"--save", o.fsdp ? "" : o.save}, {"--plot", o.plot}});
    samples::check_output_folders(flags, {{"--save", o.fsdp ? o.save : ""}}, samples::kShardedCheckpoint);
  }
  if (device.is_cuda() && device.index >= cuda_device_count())
    flags.fail("--device " + o.device + ": there is no such GPU (" + std::to_string(cuda_device_count()) +
               " visible)");
  const std::optional<DType> autocast =
      o.precision == "bf16" ? std::optional<DType>(DType::bf16) : std::nullopt;

  // ---- data ---------------------------------------------------------------------------
  Datasets d = load_datasets(o, flags);
  if (d.train.count < o.batch_size)
    flags.fail("--batch-size " + std::to_string(o.batch_size) + " is larger than the training set (" +
               std::to_string(d.train.count) + " images)");
  data::LoaderOptions lo;
  lo.batch_size = o.batch_size;
  lo.num_workers = int(o.workers);
  lo.device = device;
  lo.gpu_resident = o.gpu_resident ? data::GpuResident::yes : data::GpuResident::no;
  lo.drop_last = data::DropLast::yes;
  data::ImageTransforms train_tf{.augment = {}, .normalize = {d.mean, d.std}, .seed = uint64_t(o.seed)};
  if (o.augment == "crop-flip") train_tf.augment.push_back(data::random_crop(d.train.height, d.train.height / 8));
  if (o.augment != "none") train_tf.augment.push_back(data::random_horizontal_flip());
  const int64_t train_count = d.train.count, test_count = d.test.count;
  auto train_set = std::make_shared<data::ImageDataset>(d.train, train_tf);
  // Data parallel: each rank a disjoint shard, reshuffled every epoch (the loader passes the
  // epoch on, so no rank can forget it); the batch size is per rank, as with PyTorch's DDP.
  std::shared_ptr<data::Sampler> sampler;
  if (ctx.active)
    sampler = std::make_shared<data::DistributedSampler>(train_count, ctx.rank, ctx.size, data::Shuffle::yes,
                                                         uint64_t(o.seed), data::DropLast::no);
  else
    sampler = std::make_shared<data::RandomSampler>(train_count, uint64_t(o.seed));
  data::DataLoader train_loader(train_set, sampler, lo);
  data::LoaderOptions test_lo = lo;
  test_lo.drop_last = data::DropLast::no;
  test_lo.batch_size = std::max<int64_t>(o.batch_size, 500);
  auto test_set = std::make_shared<data::ImageDataset>(d.test, data::ImageTransforms{.normalize = {d.mean, d.std}});
  data::DataLoader test_loader(test_set, std::make_shared<data::SequentialSampler>(test_count), test_lo);
  const int64_t steps_per_epoch = train_loader.num_batches();
  const int64_t total_steps = o.max_steps > 0 ? std::min(o.max_steps, steps_per_epoch * o.epochs)
                                              : steps_per_epoch * o.epochs;
  dist::check_same_on_every_rank(ctx,
                                 {{"training images", train_count},
                                  {"batch size", o.batch_size},
                                  {"steps per epoch", steps_per_epoch},
                                  {"steps in all", total_steps}},
                                 "start every rank with the same --subset, --batch-size, --epochs and --max-steps, "
                                 "and the same copy of the data");
  if (!o.resume.empty())
    samples::check_saved_settings(
        flags, o.resume, saved,
        {{"batch_size", "--batch-size", std::to_string(o.batch_size), "its data position counts batches of that size"},
         {"seed", "--seed", std::to_string(o.seed), "its data position is a place in that seed's order"},
         samples::saved_rank_count(ctx.size),
         {"train_images", "the training image count", std::to_string(train_count),
          "its data position is a place in a dataset of that size (same --subset and data)"}});
  if (main_rank && o.warmup > total_steps)
    std::fprintf(stderr, "train_cnn: warning: --warmup %lld is longer than the run's %lld steps: the learning rate "
                 "never reaches --lr %g\n", (long long)o.warmup, (long long)total_steps, o.lr);
  if (main_rank && std::all_of(d.train.labels.begin(), d.train.labels.end(),
                               [&](int64_t l) { return l == d.train.labels.front(); }))
    std::fprintf(stderr, "train_cnn: warning: every training image has label %lld: a model learns nothing from one "
                 "class (a --subset of sorted data, or one class folder?)\n",
                 (long long)(d.train.labels.empty() ? 0 : d.train.labels.front()));

  // ---- model, optimizer, schedule --------------------------------------------------------
  const size_t allocated_before_model = memory::stats(device).allocated;
  manual_seed(uint64_t(o.seed));
  std::shared_ptr<nn::Module> model = make_model(o, d, flags);
  if (!o.init.empty()) {
    nn::load_weights(o.init, *model);
    if (!o.allow_nonfinite) samples::check_finite_parameters(*model, "--init " + o.init);
  }
  model->to(device);
  // On the GPU a channels-last run lays the weights out so too (cuDNN's NHWC kernels read them
  // that way, and no step converts one); DDP and FSDP take row-major parameters.
  if (o.channels_last && device.is_cuda() && !ctx.active) model->to(MemoryFormat::channels_last);
  model->train();
  // What a step of this rank's batch holds, from a probe step of one and two random images
  // (parallel/memory_plan.h) before any wrapper shards the weights; on the rank that prints
  // the plan, and only when it does.
  const bool print_plan = main_rank && !o.quiet;
  // --channels-last lays each batch out once, at the input; the CNN ops keep the layout.
  auto laid_out = [&](const Tensor& batch) {
    return o.channels_last ? batch.contiguous(MemoryFormat::channels_last) : batch;
  };
  const size_t activations =
      !print_plan ? 0 : dist::activation_bytes(*model, device, o.batch_size, [&](int64_t rows) {
        AutocastGuard cast(autocast);
        Tensor images = randn({rows, d.train.channels, d.train.height, d.train.width}, DType::f32, device);
        Tensor logits = model->forward(laid_out(images));
        return cross_entropy(logits.to(DType::f32), zeros({rows}, DType::i64, device));
      });
  // Under data parallelism the step runs through DDP, which starts every rank from rank 0's
  // weights and averages the gradients during backward; checkpoints and evaluation use the
  // model itself, so their names carry no "module." prefix.
  std::shared_ptr<nn::Module> trained = model;
  std::unique_ptr<dist::FullyShardedDataParallel> fsdp;
  if (o.fsdp && !ctx.active)
    flags.fail("--fsdp shards over several ranks: start them with loomrun --nproc-per-node N (or --gpus N)");
  if (o.fsdp) {
    dist::FSDPOptions fsdp_options;
    fsdp_options.min_num_params = o.min_params;
    fsdp_options.average_buffers = o.sync_bn_stats;
    fsdp_options.reshard_after_forward =
        o.reshard_after_forward == "yes" ? dist::ReshardAfterForward::yes : dist::ReshardAfterForward::no;
    if (o.hsdp > 1) {
      // Replicas along the mesh's rows, shards along its columns: a row is consecutive ranks.
      dist::DeviceMesh mesh(ctx.group, {int(o.hsdp), ctx.size / int(o.hsdp)}, {"replicate", "shard"});
      if (main_rank) std::printf("HSDP: %lld replicas, each sharded over %d ranks\n%s", (long long)o.hsdp,
                                 ctx.size / int(o.hsdp), mesh.table().c_str());
      fsdp = dist::hybrid_shard(model, mesh, fsdp_options);
    } else {
      fsdp = std::make_unique<dist::FullyShardedDataParallel>(model, ctx.group, fsdp_options);
    }
    if (main_rank) {
      size_t bytes = 0;
      for (const Tensor& p : model->parameters()) bytes += p.nbytes();
      std::printf("FSDP (%s): %zu units; parameters %.3f MB in all, %.3f MB of shards on rank 0\n",
                  o.reshard_after_forward == "yes" ? "ZeRO-3" : "ZeRO-2", fsdp->unit_names().size(),
                  double(bytes) / 1e6, double(fsdp->memory().shard_parameter_bytes) / 1e6);
    }
  } else if (ctx.active) {
    dist::DDPOptions ddp_options;
    ddp_options.bucket_cap_mb = o.bucket_mb;
    ddp_options.sync_buffers_average = o.sync_bn_stats;
    ddp_options.gradient_as_bucket_view = true;  // no copy of the averaged gradients back
    trained = std::make_shared<dist::DistributedDataParallel>(model, ctx.group, ddp_options);
  }
  std::unique_ptr<optim::Optimizer> opt = make_optimizer(o, fsdp ? fsdp->parameters() : model->parameters());
  auto forward = [&](const Tensor& batch) {
    const Tensor x = laid_out(batch);
    return fsdp ? fsdp->forward(x) : trained->forward(x);
  };
  const dist::MemoryPlan plan =
      fsdp ? dist::plan_sharded(*fsdp, *opt, activations)
           : dist::plan_replicated(*model, *opt, activations,
                                   dynamic_cast<const dist::DistributedDataParallel*>(trained.get()));
  if (print_plan) std::printf("%s\n", plan.table().c_str());
  optim::LRScheduler sched(*opt, make_schedule(o, total_steps));

  int64_t epoch = 0, batch = 0, step = 0;
  std::vector<std::pair<double, double>> train_curve, test_loss_curve, test_acc_curve, train_acc_curve;
  if (!o.resume.empty()) {
    const samples::ResumedAt at = samples::resume_data_parallel(o.resume, "train_cnn", *model, fsdp.get(), *opt,
                                                                sched, ctx, steps_per_epoch, o.allow_nonfinite);
    epoch = at.epoch, batch = at.batch, step = at.step;
  }

  if (main_rank) std::printf("train_cnn: %s (%lld parameters) on %s: %lld training and %lld test images of %lldx%lldx%lld, "
              "%lld classes\n  %s lr %g, %s schedule, batch %lld, %lld epochs, %s%s on %s\n",
              model->type_name().c_str(), (long long)model->num_parameters(), d.name.c_str(),
              (long long)d.train.count, (long long)d.test.count, (long long)d.train.channels,
              (long long)d.train.height, (long long)d.train.width, (long long)class_count(d), opt->type_name().c_str(),
              o.lr, o.schedule.c_str(), (long long)o.batch_size, (long long)o.epochs, o.precision.c_str(),
              o.channels_last ? " channels-last" : "",
              ctx.active ? (std::to_string(ctx.size) + " ranks (" + ctx.group->backend() + "), " + device.str() +
                            " on rank 0").c_str()
                         : device.str().c_str());

  samples::MetricsLog metrics(main_rank ? o.metrics : "");
  // Rank 0 writes the whole model; under FSDP every rank writes its shards into the folder.
  auto save = [&](int64_t next_epoch, int64_t next_batch) {
    const std::map<std::string, std::string> user{{"epoch", std::to_string(next_epoch)},
                                                  {"batch", std::to_string(next_batch)},
                                                  {"step", std::to_string(step)},
                                                  {"program", "train_cnn"},
                                                  {"model", o.model},
                                                  {"data", o.data},
                                                  {"optimizer", o.optimizer},
                                                  {"seed", std::to_string(o.seed)},
                                                  {"batch_size", std::to_string(o.batch_size)},
                                                  {"world_size", std::to_string(ctx.size)},
                                                  {"train_images", std::to_string(train_count)}};
    if (fsdp)
      dist::save_sharded_checkpoint(o.save, *fsdp, opt.get(), {.scheduler = &sched, .user = user});
    else if (main_rank)
      nn::save_checkpoint(o.save, {.model = model.get(), .optimizer = opt.get(), .scheduler = &sched, .user = user});
  };

  // One training step on `inputs` and `targets`; returns its loss.
  auto train_step = [&](const Tensor& inputs, const Tensor& targets) {
    opt->zero_grad();
    Tensor loss;
    {
      dist::trace::Span forward_span("forward", dist::trace::Category::forward);
      AutocastGuard cast(autocast);
      Tensor logits = forward(inputs);
      loss = cross_entropy(logits.to(DType::f32), targets, -100, o.label_smoothing);
    }
    {
      dist::trace::Span backward_span("backward", dist::trace::Category::backward);
      loss.backward();
    }
    dist::trace::Span optimizer_span("optimizer", dist::trace::Category::optimizer);
    if (o.clip > 0 && fsdp) fsdp->clip_grad_norm_(o.clip);
    else if (o.clip > 0) optim::clip_grad_norm_(model->parameters(), o.clip);
    opt->step();
    return loss;
  };
  // The step as one CUDA graph (layers/optim/captured_step.h) where everything in it can be
  // captured: one GPU, one process (so no DDP), no FSDP (not even on one rank: its clipping
  // reads the norm summed over the ranks), no trace. Full batches are copied into the graph's
  // static tensors; a smaller last batch runs eagerly.
  const bool graphed = o.graph && device.is_cuda() && !ctx.active && !fsdp && o.trace.empty();
  std::optional<optim::CapturedBatchStep> captured;
  if (graphed) captured.emplace(device, std::vector<optim::Optimizer*>{opt.get()}, train_step);
  if (main_rank && graphed && !o.quiet) std::printf("  the step is captured as one CUDA graph (--no-graph: eager)\n");

  samples::start_step_trace(o.trace, ctx, device);
  const auto run_start = std::chrono::steady_clock::now();
  bool plan_measured = false;
  memory::reset_peak(device);
  for (; epoch < o.epochs && step < total_steps; ++epoch, batch = 0) {
    char label[64];
    std::snprintf(label, sizeof label, "epoch %lld/%lld", (long long)epoch + 1, (long long)o.epochs);
    samples::Progress progress(label, steps_per_epoch, "img");
    const auto epoch_start = std::chrono::steady_clock::now();
    Tensor loss_sum;
    int64_t epoch_steps = 0;
    data::Epoch batches = train_loader.epoch(epoch, batch);
    for (data::Batch& b : batches) {
      dist::trace::Span step_span("step", dist::trace::Category::step);
      Tensor loss = captured ? captured->run(b.inputs, b.targets) : train_step(b.inputs, b.targets);
      sched.step();
      ++step, ++batch, ++epoch_steps;
      // A captured step's loss is the graph's, rewritten by the next replay: the sum starts
      // from a copy.
      Tensor l = loss.detach();
      loss_sum = loss_sum.defined() ? add(loss_sum, l) : l.clone();
      // Reading the loss waits for the GPU; the progress line does so only when it redraws,
      // and the loss is checked there too (on the CPU, every step).
      const bool redraw = main_rank && !o.quiet && (batch % 20 == 0 || batch == steps_per_epoch);
      if (!o.allow_nonfinite && (!device.is_cuda() || batch % 20 == 0 || batch == steps_per_epoch))
        samples::check_finite_loss(l.item(), step, !device.is_cuda());
      if (redraw)
        progress.update(batch, batch * o.batch_size, l.item(), samples::device_note(device, batches.stall_seconds()));
      // A save on an epoch's last batch is the next epoch's start.
      if (o.save_every > 0 && step % o.save_every == 0)
        batch == steps_per_epoch ? save(epoch + 1, 0) : save(epoch, batch);
      if (step >= total_steps) break;
    }
    if (main_rank && !o.quiet) progress.finish();
    // The plan beside what the allocator saw since the model was built (its peak: the
    // batches in flight and what the plan leaves out included), once.
    if (print_plan && epoch_steps > 0 && !plan_measured) {
      plan_measured = true;
      std::printf("%s\n", plan.measured_line(device, allocated_before_model, epoch_steps).c_str());
    }
    // Reading the loss waits for the GPU, so the epoch's clock stops after its last step ran.
    const double train_loss = dist::mean_over_ranks(ctx, epoch_steps ? loss_sum.item() / double(epoch_steps) : NAN);
    const double epoch_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
    const double images_per_s = double(epoch_steps * o.batch_size * ctx.size) / epoch_seconds;
    EvalResult test = evaluate(*model, forward, test_loader, autocast);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    if (main_rank) std::printf("epoch %lld: train loss %.4f  test loss %.4f  test accuracy %.2f%%  (%.1f s)\n",
                (long long)epoch + 1, train_loss, test.loss, test.accuracy * 100, elapsed);
    if (fsdp && main_rank)
      std::printf("FSDP: at most %.3f MB of full parameters held at once on rank 0\n",
                  double(fsdp->memory().peak_full_parameter_bytes) / 1e6);
    std::fflush(stdout);
    const bool finished_epoch = batch >= steps_per_epoch;
    if (!o.save.empty()) save(finished_epoch ? epoch + 1 : epoch, finished_epoch ? 0 : batch);
    metrics.write({{"epoch", epoch + 1},
                   {"step", step},
                   {"train_loss", train_loss},
                   {"test_loss", test.loss},
                   {"test_accuracy", test.accuracy},
                   {"lr", sched.last_lr()[0]},
                   {"images_per_s", images_per_s},
                   {"seconds", elapsed},
                   {"model", o.model},
                   {"data", o.data},
                   {"precision", o.precision},
                   {"device", device.str()}});
    train_curve.emplace_back(double(epoch + 1), train_loss);
    test_loss_curve.emplace_back(double(epoch + 1), test.loss);
    test_acc_curve.emplace_back(double(epoch + 1), test.accuracy * 100);
    if (main_rank && !o.plot.empty())
      samples::write_svg_chart(o.plot, model->type_name() + " on " + d.name,
                               {{"loss", "epoch", "cross-entropy", {{"train", train_curve}, {"test", test_loss_curve}}},
                                {"test accuracy", "epoch", "%", {{"test", test_acc_curve}}}});
  }
  samples::write_step_trace(o.trace, ctx, device);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return samples::run_guarded("train_cnn", [&] { return run(argc, argv); });
}
