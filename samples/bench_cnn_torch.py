"""PyTorch side of bench_cnn: the same model (the guide's SimpleCNN, or ResNet-18 with the
CIFAR stem), batch, precision (f32 with TF32 allowed, or bf16 autocast) and optimizer (SGD,
momentum 0.9, weight decay 5e-4), synthetic data on the GPU, cuDNN's autotuner on
(torch.backends.cudnn.benchmark = True), in PyTorch's fast settings, one JSON line each:
  eager     channels_last model and input (NHWC convolutions, the fast layout for cuDNN);
  compile   the same with the model under torch.compile (default mode);
  graph     the eager step (forward, backward and SGD's step) captured once as one CUDA graph
            and replayed, inputs copied into its static tensors: PyTorch's answer to launch cost.
The faster of them is PyTorch's best; bench_cnn's rows are compared against it.
  python3 bench_cnn_torch.py MODEL IMAGE BATCH PRECISION [WARMUP STEPS [VARIANTS]]
VARIANTS is a comma-separated subset of eager,compile,graph (all three by default).
--profile-step (anywhere) runs one more step of each variant after the timed ones between
cudaProfilerStart and cudaProfilerStop, for `ncu --profile-from-start off`, as bench_cnn's."""
import json
import sys

import torch
import torch.nn as nn


class SimpleCNN(nn.Module):
    def __init__(self, c, side):
        super().__init__()
        s = ((side - 2) // 2 - 2) // 2
        self.features = nn.Sequential(nn.Conv2d(c, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * s * s, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (self.downsample(x) if self.downsample is not None else x))


class ResNet18(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for i, cout in enumerate((64, 128, 256, 512)):
            layers.append(nn.Sequential(BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(512, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def median(values):
    ms, n = sorted(values), len(values)
    return ms[n // 2] if n % 2 else 0.5 * (ms[n // 2 - 1] + ms[n // 2])


def measure(model_name, image, batch, precision, warmup, steps, variant, profile_step=False):
    c, side = (1, 28) if image == "1x28x28" else (3, 32)
    torch.manual_seed(0)
    model = (SimpleCNN(c, side) if model_name == "simplecnn" else ResNet18(c)).cuda().train()
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(batch, c, side, side, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device="cuda")
    forward = torch.compile(model) if variant == "compile" else model
    # Autocast's weight cache must be off while a graph is captured.
    bf16 = precision == "bf16"

    def step():
        opt.zero_grad(set_to_none=variant != "graph")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16, cache_enabled=variant != "graph"):
            loss = nn.functional.cross_entropy(forward(x).float(), y)
        loss.backward()
        opt.step()

    run = step
    if variant == "graph":
        # Warm up on a side stream (cuDNN's plans, the optimizer's momentum buffers), then
        # capture one whole step; replaying it reads x and y where they are.
        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side_stream)
        # The step's memory is taken while capturing: replays allocate nothing.
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    if variant != "graph":
        torch.cuda.reset_peak_memory_stats()
    # Each step between CUDA events recorded back to back; the median step, as bench_cnn.
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        run()
        events[i + 1].record()
    torch.cuda.synchronize()
    step_ms = median([events[i].elapsed_time(events[i + 1]) for i in range(steps)])
    if profile_step:
        torch.cuda.profiler.start()
        run()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return {"engine": "pytorch", "torch": torch.__version__, "variant": variant, "model": model_name, "image": image,
            "batch": batch, "precision": precision, "images_per_s": batch / (step_ms * 1e-3), "ms_per_step": step_ms,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20}


def main():
    profile_step = "--profile-step" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--profile-step"]
    model_name, image, batch, precision = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    warmup = int(sys.argv[5]) if len(sys.argv) > 5 else 10
    steps = int(sys.argv[6]) if len(sys.argv) > 6 else 50
    variants = sys.argv[7].split(",") if len(sys.argv) > 7 else ["eager", "compile", "graph"]
    for v in variants:
        if v not in ("eager", "compile", "graph"):
            sys.exit(f"bench_cnn_torch.py: variant '{v}' is not one of eager, compile, graph")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    for v in variants:
        print(json.dumps(measure(model_name, image, batch, precision, warmup, steps, v, profile_step)), flush=True)


if __name__ == "__main__":
    main()
