"""PyTorch side of bench_engine's MLP step: the same 784-2048-2048-10 MLP, ReLU,
cross-entropy and SGD (lr 0.01), batch 512, f32 with TF32 allowed, eager.
Prints the median step in milliseconds (CUDA events, 10 warm-up, 50 timed)."""
import statistics
import torch

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
dev = "cuda"
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(784, 2048), torch.nn.ReLU(),
    torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
    torch.nn.Linear(2048, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(512, 784, device=dev)
y = torch.arange(512, device=dev) % 10


def step():
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(10):
    step()
times = []
for _ in range(50):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    stop.record()
    stop.synchronize()
    times.append(start.elapsed_time(stop))
print(f"{statistics.median(times):.4f}")
