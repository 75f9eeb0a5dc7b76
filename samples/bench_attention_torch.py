"""PyTorch side of bench_attention: torch.nn.functional.scaled_dot_product_attention on
the same shapes, forward alone (under no_grad) and forward plus backward, with the same
FLOP counts (forward 4 B H T^2 D, halved when causal; backward 2.5x the forward).
CUDA events, 10 warm-up and 50 timed repetitions, median. PyTorch picks its own backend
(flash attention for bf16/f16 on the H200); --backend flash|efficient|cudnn|math forces one.
Prints a table; --out FILE writes "name|fwd_ms|train_ms" lines for bench_attention --torch FILE."""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Same list, same order, same names as samples/bench_attention.cpp.
SHAPES = [
    (16, 12, 1024, 64, True, "bf16"),
    (16, 12, 1024, 64, False, "bf16"),
    (16, 12, 1024, 64, True, "f16"),
    (8, 16, 2048, 64, True, "bf16"),
    (4, 12, 4096, 64, True, "bf16"),
    (8, 16, 1024, 128, True, "bf16"),
    (16, 12, 1024, 64, True, "f32"),
]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def name(B, H, T, D, causal, dt):
    return f"B{B} H{H} T{T} D{D} {'causal' if causal else 'full'} {dt}"


def time_ms(fn, warmup=10, reps=50):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write name|fwd_ms|train_ms lines here")
    parser.add_argument("--backend", choices=["flash", "efficient", "cudnn", "math"])
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    lines = []
    print(f"{'shape':34} {'fwd ms':>10} {'TFLOP/s':>9} {'fwd+bwd ms':>12} {'TFLOP/s':>9}")
    for B, H, T, D, causal, dt in SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=DTYPES[dt], requires_grad=True) for _ in range(3))
        gout = torch.randn(B, H, T, D, device="cuda", dtype=DTYPES[dt])

        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def train():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(gout)
            q.grad = k.grad = v.grad = None

        if args.backend:
            with sdpa_kernel(backends[args.backend]):
                fwd, tr = time_ms(forward), time_ms(train)
        else:
            fwd, tr = time_ms(forward), time_ms(train)
        flop = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
        n = name(B, H, T, D, causal, dt)
        print(f"{n:34} {fwd:10.3f} {flop / (fwd * 1e9):9.1f} {tr:12.3f} {3.5 * flop / (tr * 1e9):9.1f}", flush=True)
        lines.append(f"{n}|{fwd:.5f}|{tr:.5f}")
        del q, k, v, gout
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
