#!/usr/bin/env python3
"""Tokens per second of one PyTorch eager training step of the small GPT that qsr's `gpt_step` example
times: the same layout (nanoGPT: learned positions, pre-LN blocks, causal attention, 4x GELU MLP, tied
head), batch, context, AdamW with clipping, and thread count.

    python3 benches/peers/gpt_step.py --threads 2 --steps 30 --json out.json

Run by `cargo xtask bench train` from its own venv (`QSR_BENCH_PYTHON`, default
/var/tmp/qsr-bench-venv/bin/python); the step time is the median over the timed steps.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def attention(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        shape = lambda y: y.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        q, k, v = shape(q), shape(k), shape(v)
        # Eager math as qsr computes it (no fused kernel): scores, mask, softmax, weighted sum.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x, mask):
        x = x + self.attention(self.ln_1(x), mask)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, context, layers, heads, width):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x, mask)
        return self.ln_f(x) @ self.wte.weight.t()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--vocab", type=int, default=63)
    p.add_argument("--json")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    model = Gpt(a.vocab, a.context, a.layers, a.heads, a.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    times = []
    for step in range(a.warmup + a.steps):
        x = torch.randint(0, a.vocab, (a.batch, a.context + 1), generator=g)
        t0 = time.perf_counter()
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    tps = a.batch * a.context / median
    print(f"torch {torch.__version__}: {tps:.0f} tokens/s ({1e3 * median:.2f} ms per step, median of {len(times)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tokens_per_second": tps, "step_ms_median": 1e3 * median, "torch": torch.__version__}, f)


if __name__ == "__main__":
    main()
