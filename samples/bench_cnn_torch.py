"""PyTorch side of bench_cnn: the same model (the guide's SimpleCNN, or ResNet-18 with the
CIFAR stem), batch, precision (f32 with TF32 allowed, or bf16 autocast) and optimizer (SGD,
momentum 0.9, weight decay 5e-4), synthetic data on the GPU, eager mode with cuDNN's
autotuner on (torch.backends.cudnn.benchmark = True, its fastest setting).
  python3 bench_cnn_torch.py MODEL IMAGE BATCH PRECISION [WARMUP STEPS]
Prints one JSON object like bench_cnn's."""
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


def main():
    model_name, image, batch, precision = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    warmup = int(sys.argv[5]) if len(sys.argv) > 5 else 10
    steps = int(sys.argv[6]) if len(sys.argv) > 6 else 50
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    c, side = (1, 28) if image == "1x28x28" else (3, 32)
    torch.manual_seed(0)
    model = (SimpleCNN(c, side) if model_name == "simplecnn" else ResNet18(c)).cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x = torch.randn(batch, c, side, side, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # Each step between CUDA events recorded back to back; the median step, as bench_cnn.
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    ms = sorted(events[i].elapsed_time(events[i + 1]) for i in range(steps))
    step_ms = ms[steps // 2] if steps % 2 else 0.5 * (ms[steps // 2 - 1] + ms[steps // 2])
    print(json.dumps({"engine": "pytorch", "torch": torch.__version__, "model": model_name, "image": image,
                      "batch": batch, "precision": precision, "images_per_s": batch / (step_ms * 1e-3),
                      "ms_per_step": step_ms,
                      "peak_mib": torch.cuda.max_memory_allocated() / 2**20}))


if __name__ == "__main__":
    main()
