#!/usr/bin/env python3
"""Items per second of one PyTorch eager training step of the models `qsr time-step` times, with the same
flags: the GPT (nanoGPT's layout: learned positions, pre-LN blocks, causal attention, 4x GELU MLP, tied
head; AdamW, clipping at 1; tokens/s), the digits CNN (conv32-BN-ReLU-pool, conv64-BN-ReLU-pool, fc, on
1 x 8 x 8 images; SGD; images/s) and CIFAR ResNet-20 (option A shortcuts; SGD; images/s).

    python3 benches/peers/train_step.py --model gpt --threads 2 --steps 30 --json out.json
    python3 benches/peers/train_step.py --model resnet20 --device cuda --json out.json

Run by `cargo xtask bench train` from its own venv (`QSR_BENCH_PYTHON`, default
/var/tmp/qsr-bench-venv/bin/python) and by scripts/gpu-check.sh; the step time is the median over the
timed steps (on CUDA each step ends with a synchronize).
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
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), diagonal=1)
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x, mask)
        return self.ln_f(x) @ self.wte.weight.t()


class Cnn(nn.Module):
    """qsr_models::SmallCnn with BatchNorm: [conv3x3 (no bias) -> BN -> ReLU -> maxpool 2] x 2 -> fc."""

    def __init__(self, cin, size, classes, channels=(32, 64)):
        super().__init__()
        c1, c2 = channels
        self.body = nn.Sequential(
            nn.Conv2d(cin, c1, 3, padding=1, bias=False), nn.BatchNorm2d(c1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1, bias=False), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(c2 * (size // 4) ** 2, classes)

    def forward(self, x):
        return self.fc(self.body(x).flatten(1))


class CifarBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride, self.pad = stride, (cout - cin) // 2

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        short = x
        if self.stride != 1 or self.pad:
            # Option A: subsample, then zero channels on each side.
            short = F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, self.pad, self.pad))
        return F.relu(out + short)


class ResNet20(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(CifarBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def setup(a, device):
    """The model, optimizer and a function giving step s's (inputs, targets, loss of logits)."""
    g = torch.Generator().manual_seed(0)
    if a.model == "gpt":
        model = Gpt(a.vocab, a.context, a.layers, a.heads, a.width).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

        def batch(_):
            x = torch.randint(0, a.vocab, (a.batch, a.context + 1), generator=g).to(device)
            return x[:, :-1], x[:, 1:].reshape(-1)

        return model, opt, batch, a.batch * a.context, "tokens"
    if a.model == "cnn":
        model, shape = Cnn(1, 8, 10), (a.batch, 1, 8, 8)
    else:
        model, shape = ResNet20(10), (a.batch, 3, 32, 32)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)
    images = torch.randn(shape, generator=g).to(device)
    labels = (torch.arange(a.batch) % 10).to(device)
    return model, opt, (lambda _: (images, labels)), a.batch, "images"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["gpt", "cnn", "resnet20"], default="gpt")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--vocab", type=int, default=63)
    p.add_argument("--json")
    a = p.parse_args()
    a.batch = a.batch or {"gpt": 16, "cnn": 64, "resnet20": 128}[a.model]
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    model, opt, batch, items, unit = setup(a, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(a.warmup + a.steps):
        x, y = batch(step)
        sync()
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.model == "gpt":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()  # as qsr reads the loss every step
        sync()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    rate = items / median
    print(f"torch {torch.__version__} {a.model} on {device}: {rate:.0f} {unit}/s ({1e3 * median:.2f} ms per step, median of {len(times)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"per_second": rate, "unit": unit, "step_ms_median": 1e3 * median, "torch": torch.__version__}, f)


if __name__ == "__main__":
    main()
