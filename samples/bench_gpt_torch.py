"""PyTorch side of bench_gpt: nanoGPT's GPT-2 (the same shapes, initialisation and tied
output layer as Loom's GPT), AdamW with fused=True (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on
the matrices only), bf16 autocast over f32 weights, random tokens on the GPU, TF32 allowed.
Attention is F.scaled_dot_product_attention (causal), PyTorch's flash attention.
  python3 bench_gpt_torch.py MODE [--config gpt2-124m|gpt2-350m] [--batch 16] [--seq 1024]
                             [--warmup 10] [--steps 50]
MODE is eager or compile (torch.compile of the model). --config picks GPT-2 124M (12 x 768,
12 heads) or 350M (24 x 1024, 16 heads); a --seq beyond 1024 grows the position table to it,
as bench_gpt does. Each step is bracketed by CUDA events;
prints one JSON line like bench_gpt's (median step, tokens/s, MFU, peak memory)."""
import argparse
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


CONFIGS = {"gpt2-124m": (12, 12, 768), "gpt2-350m": (24, 16, 1024)}  # layers, heads, width


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab=50304, context=1024, layers=12, heads=12, d=768):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith(".bias") and "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["eager", "compile"])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    layers, heads, width = CONFIGS[a.config]
    context = max(1024, a.seq)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = GPT(context=context, layers=layers, heads=heads, d=width).cuda().train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    run = torch.compile(model) if a.mode == "compile" else model
    ids = torch.randint(0, 50304, (a.batch, a.seq + 1), device="cuda")
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(x, y)
        loss.backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps + 1)]
    events[0].record()
    for i in range(a.steps):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    ms = sorted(events[i].elapsed_time(events[i + 1]) for i in range(a.steps))
    step_ms = ms[len(ms) // 2] if len(ms) % 2 else 0.5 * (ms[len(ms) // 2 - 1] + ms[len(ms) // 2])
    tokens_per_s = a.batch * a.seq / (step_ms * 1e-3)
    flop_per_token = 6 * n_params + 12 * layers * width * a.seq
    print(json.dumps({"engine": "pytorch", "mode": a.mode, "torch": torch.__version__, "config": a.config,
                      "batch": a.batch, "seq": a.seq, "context": context, "precision": "bf16", "params": n_params,
                      "ms_per_step": step_ms, "tokens_per_s": tokens_per_s,
                      "mfu": tokens_per_s * flop_per_token / 989e12,
                      "peak_mib": torch.cuda.max_memory_allocated() / 2**20}))


if __name__ == "__main__":
    main()
