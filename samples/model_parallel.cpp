// The guide's model_parallel.py in Loom: a six-block post-norm transformer whose blocks are
// spread over a list of devices in one process, the activations following them, and a
// 10-way output layer on the last device (layers/models/guide_transformer.h,
// layers/placement.h). Like the guide it prints where each block sits and the output's
// shape; then it trains a few AdamW steps on a synthetic task the model can learn (the
// guide feeds random input with no target), printing each step's loss and time.
//
//   model_parallel --devices cuda:0,cuda:1 --placement round-robin
//   model_parallel --devices cuda:0,cpu        (one GPU: the same path, over PCIe)
//   model_parallel                             (every GPU; cuda:0,cpu with one; cpu,cpu with none)
//
// `model_parallel --help` lists every flag.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/models/guide_transformer.h"
#include "layers/optim/adam.h"
#include "layers/placement.h"
#include "samples/common/flags.h"

using namespace loom;

namespace {

// Every visible GPU; with one GPU, it and the CPU; without, the CPU twice.
std::string default_devices() {
  const int gpus = cuda_device_count();
  if (gpus == 0) return "cpu,cpu";
  if (gpus == 1) return "cuda:0,cpu";
  std::string list;
  for (int i = 0; i < gpus; ++i) list += (i ? ",cuda:" : "cuda:") + std::to_string(i);
  return list;
}

void synchronize_all(const std::vector<Device>& devices) {
  for (const Device& d : devices) synchronize(d);
}

}  // namespace

int main(int argc, char** argv) {
  samples::Flags flags("model_parallel",
                       "the guide's six-block transformer split over devices in one process (layer-wise model "
                       "parallelism); prints the placement and trains a few steps on a synthetic task");
  std::string devices_text = default_devices(), placement = "round-robin";
  int64_t width = 256, heads = 8, layers = 6, classes = 10, batch = 32, tokens = 10, steps = 20, seed = 0;
  double lr = 1e-3;
  flags.add("devices", &devices_text, "devices for the blocks, in order, separated by commas (cuda:0,cuda:1; cuda:0,cpu; "
                                      "cpu,cpu); the output layer goes on the last",
            {}, "LIST");
  flags.add("placement", &placement, "how blocks are dealt to the devices", {"round-robin", "contiguous"});
  flags.add("width", &width, "embedding width (the guide's embed_dim)", 1, 1 << 16);
  flags.add("heads", &heads, "attention heads (must divide --width)", 1, 1 << 10);
  flags.add("layers", &layers, "transformer blocks", 1, 1 << 10);
  flags.add("classes", &classes, "width of the output layer", 2, 1 << 16);
  flags.add("batch", &batch, "sequences a step", 1, 1 << 20);
  flags.add("tokens", &tokens, "positions a sequence", 1, 1 << 20);
  flags.add("steps", &steps, "training steps", 0, 1 << 30);
  flags.add("lr", &lr, "AdamW learning rate", 0.0, 10.0);
  flags.add("seed", &seed, "seed of the initialisation and the data", 0);
  flags.parse(argc, argv);
  if (width % heads != 0)
    flags.fail("--heads " + std::to_string(heads) + " does not divide --width " + std::to_string(width));

  std::vector<Device> devices;
  try {
    devices = nn::parse_device_list(devices_text);
  } catch (const Error& e) {
    flags.fail("--devices: " + std::string(e.what()));
  }
  for (const Device& d : devices)
    if (d.is_cuda() && d.index >= cuda_device_count())
      flags.fail("--devices " + devices_text + ": " + d.str() + " is not visible (" +
                 std::to_string(cuda_device_count()) + " GPU(s) here; expected cpu or cuda:0 to cuda:N-1)");

  try {
    manual_seed(uint64_t(seed));
    nn::GuideTransformer model({.width = width, .heads = heads, .layers = layers, .classes = classes});
    model.place(devices, nn::parse_placement_policy(placement));
    std::printf("%lld blocks of width %lld, %lld heads, %lld parameters, placed %s over %s:\n",
                (long long)layers, (long long)width, (long long)heads, (long long)model.num_parameters(),
                placement.c_str(), devices_text.c_str());
    std::fputs(model.placement().table().c_str(), stdout);

    // The guide's demo: random input of (batch, tokens, width) through the model.
    {
      NoGradGuard no_grad;
      Tensor y = model.forward(randn({batch, tokens, width}));
      std::printf("output shape: %s on %s\n", shape_str(y.shape()).c_str(), y.device().str().c_str());
    }

    std::set<std::string> seen;
    std::vector<Device> distinct;
    for (const Device& d : devices)
      if (seen.insert(d.str()).second) distinct.push_back(d);
    optim::AdamW opt(model.parameters(), {.lr = lr, .weight_decay = 0.0});
    nn::GuideSyntheticTask task(width, classes, uint64_t(seed) + 1);
    std::printf("training %lld steps on a synthetic task (loss starts near ln %lld = %.3f)\n", (long long)steps,
                (long long)classes, std::log(double(classes)));
    double first = 0, last = 0;
    for (int64_t step = 0; step < steps; ++step) {
      auto data = task.sample(batch, tokens);
      synchronize_all(distinct);
      const auto start = std::chrono::steady_clock::now();
      opt.zero_grad();
      Tensor loss = model.loss(data.inputs, data.targets);
      loss.backward();
      opt.step();
      const double value = loss.item();
      synchronize_all(distinct);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      (step == 0 ? first : last) = value;
      std::printf("step %4lld  loss %.4f  %8.2f ms\n", (long long)step, value, ms);
    }
    if (steps > 1) std::printf("loss %.4f -> %.4f\n", first, last);
  } catch (const Error& e) {
    std::fprintf(stderr, "model_parallel: %s\n", e.what());
    return 1;
  }
  return 0;
}
