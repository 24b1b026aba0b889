#!/usr/bin/env python3
"""Generates crates/qsr-optim/tests/fixtures/torch_optim.json and torch_muon.json: optimizer trajectories
computed by PyTorch.

The Rust tests replay the same parameters, gradients and per-step learning rates through qsr-optim and
compare with torch.optim.SGD / torch.optim.AdamW (single-tensor path, foreach=False) and
torch.nn.utils.clip_grad_norm_ (foreach=False) bit for bit. Every case runs on two seeds and two learning
rate schedules (a moderate one and a large one, 0.3 down to 0.003, where rounding differences grow
fastest). Gradients are given explicitly per step (the optimizer math is under test, not autograd).

Generated with torch 2.15.0+cu132 (the PyPI Linux wheel; only its CPU kernels run) on an AMD EPYC CPU
with AVX2 and no AVX-512 (ATen's AVX2 kernels). torch.sqrt there calls MKL's vsSqrt, whose result
depends on the CPU (on this one, about 1 input in 6 is an ulp off the IEEE root); `sqrt_probe` records
it on a spread of inputs so the Rust tests can tell whether they run where it can be reproduced.
Only this script needs torch (the wheel's libraries link the CUDA runtime, so install its dependencies
too, in a virtual environment outside the repository):
    pip install torch==2.15.0 numpy && python3 scripts/torch_optim_fixtures.py
"""
import json
import pathlib

import numpy as np
import torch

SHAPES = {
    "fc.weight": (5, 4),
    "fc.bias": (5,),
    "fc2.weight": (7, 9),
    "fc2.bias": (7,),
    "norm.gamma": (3,),
    "norm.beta": (3,),
}
NO_DECAY = ["fc.bias", "fc2.bias", "norm.gamma", "norm.beta"]  # what `exclude_norm_and_bias` excludes
STEPS = 6
SCHEDULES = {
    "moderate": [0.1, 0.09, 0.075, 0.05, 0.02, 0.01],
    "large": [0.3, 0.2, 0.1, 0.03, 0.01, 0.003],
}
SEEDS = [20241, 7]

CASES = [
    ("sgd_plain", "sgd", dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0), False, None),
    ("sgd_weight_decay_no_momentum", "sgd", dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=1e-2), False, None),
    ("sgd_momentum", "sgd", dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0), False, None),
    ("sgd_momentum_dampening", "sgd", dict(momentum=0.9, dampening=0.3, nesterov=False, weight_decay=0.0), False, None),
    ("sgd_nesterov", "sgd", dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=5e-4), False, None),
    ("sgd_weight_decay", "sgd", dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=1e-2), False, None),
    ("sgd_weight_decay_no_norm_bias", "sgd", dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=1e-2), True, None),
    ("sgd_clip", "sgd", dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=1e-4), False, 1.5),
    ("adamw_no_decay", "adamw", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), False, None),
    ("adamw_decay", "adamw", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05), False, None),
    ("adamw_decay_no_norm_bias", "adamw", dict(betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1), True, None),
    # beta1 <= 0.5: lerp's other branch (weight 1 - beta1 >= 0.5)
    ("adamw_low_beta1", "adamw", dict(betas=(0.3, 0.99), eps=1e-8, weight_decay=0.05), False, None),
    ("adamw_clip", "adamw", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05), False, 2.0),
]


class F32List(list):
    """Tensor values: written as the shortest decimals that read back, via f64 as the tests read them,
    to the same f32."""


def f32_list(t):
    return F32List(t.detach().float().reshape(-1).numpy())


def f32_text(x):
    text = str(x)  # numpy's shortest round-trip repr of an f32
    return text if np.float32(float(text)) == x else repr(float(x))


def dump(v):
    if isinstance(v, F32List):
        return "[" + ",".join(f32_text(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(dump(x) for x in v) + "]"
    return json.dumps(v)


def flat(tensors):
    return F32List(x for k in SHAPES for x in f32_list(tensors[k]))


data = []
for seed in SEEDS:
    torch.manual_seed(seed)
    params0 = {k: torch.randn(s) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s) * 2.0 for k, s in SHAPES.items()} for _ in range(STEPS)]
    data.append((seed, params0, grads))

cases = []
for data_index, (seed, params0, grads) in enumerate(data):
    for schedule, lrs in SCHEDULES.items():
        for name, kind, opts, exclude, clip in CASES:
            params = {k: v.clone().requires_grad_(True) for k, v in params0.items()}
            wd = opts["weight_decay"]
            if exclude:
                groups = [
                    {"params": [params[k] for k in SHAPES if k not in NO_DECAY], "weight_decay": wd},
                    {"params": [params[k] for k in SHAPES if k in NO_DECAY], "weight_decay": 0.0},
                ]
            else:
                groups = [{"params": [params[k] for k in SHAPES]}]
            # foreach=False: the single-tensor reference implementation.
            if kind == "sgd":
                opt = torch.optim.SGD(groups, lr=lrs[0], foreach=False, **opts)
            else:
                opt = torch.optim.AdamW(groups, lr=lrs[0], foreach=False, **opts)
            trajectory, norms = [], []
            for step in range(STEPS):
                for g in opt.param_groups:
                    g["lr"] = lrs[step]
                for k in SHAPES:
                    params[k].grad = grads[step][k].clone()
                if clip is not None:
                    norm = torch.nn.utils.clip_grad_norm_([params[k] for k in SHAPES], clip, foreach=False)
                    norms.append(np.float32(norm.item()))
                opt.step()
                trajectory.append({k: f32_list(params[k]) for k in SHAPES})
            state = {k: opt.state[params[k]] for k in SHAPES}
            if kind == "adamw":
                moments = {"first": flat({k: s["exp_avg"] for k, s in state.items()}),
                           "second": flat({k: s["exp_avg_sq"] for k, s in state.items()})}
            elif opts["momentum"] != 0:
                moments = {"first": flat({k: s["momentum_buffer"] for k, s in state.items()}), "second": []}
            else:
                moments = {"first": [], "second": []}
            cases.append({
                "name": name, "data": data_index, "schedule": schedule, "optimizer": kind,
                "options": {**opts, "betas": list(opts["betas"])} if "betas" in opts else opts,
                "exclude_norm_and_bias": exclude, "clip_grad_norm": clip, "clip_norms": F32List(norms),
                "trajectory": trajectory, "final_moments": moments,
            })

# torch.sqrt on AdamW-like second moments (1e-12 .. 1e2) and a few edge values.
gen = torch.Generator().manual_seed(3)
probe = torch.cat([
    torch.exp(torch.empty(4093).uniform_(-27.6, 4.6, generator=gen)),
    torch.tensor([0.0, 1.0, 4.0]),
]).float()

out = {
    "generator": f"torch {torch.__version__}, scripts/torch_optim_fixtures.py",
    "order": list(SHAPES), "shapes": {k: list(s) for k, s in SHAPES.items()}, "no_decay": NO_DECAY,
    "schedules": SCHEDULES,
    "data": [{"seed": seed, "params0": {k: f32_list(v) for k, v in p.items()},
              "grads": [{k: f32_list(v) for k, v in g.items()} for g in gs]} for seed, p, gs in data],
    "sqrt_probe": {"x": f32_list(probe), "torch_sqrt": f32_list(probe.sqrt())},
    "cases": cases,
}


def write(name, out):
    """`out` as crates/qsr-optim/tests/fixtures/`name`: one line per case and per data set, readable
    diffs at a tenth of the size of indented JSON."""
    path = pathlib.Path(__file__).resolve().parent.parent / "crates/qsr-optim/tests/fixtures" / name
    lines = [f" {json.dumps(k)}: {dump(v)}" for k, v in out.items() if k not in ("data", "cases")]
    lines.append(' "data": [\n' + ",\n".join(f"  {dump(d)}" for d in out["data"]) + "\n ]")
    lines.append(' "cases": [\n' + ",\n".join(f"  {dump(c)}" for c in out["cases"]) + "\n ]")
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {path} ({len(out['cases'])} cases x {STEPS} steps)")


write("torch_optim.json", out)

# torch.optim.Muon on the matrices and torch.optim.AdamW (foreach=False, eps 1e-8, the same lr and
# weight decay) on the rest, as qsr's `optimizer.kind = "muon"` splits them: torch_muon.json. The
# matrices are stored as torch holds them, (fan_out, fan_in).
MATRICES = ["fc.weight", "fc2.weight"]
MUON_CASES = [
    ("muon_defaults", dict(weight_decay=0.1), (0.9, 0.999), None),
    ("muon_match_rms_adamw_no_nesterov",
     dict(weight_decay=0.01, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw"), (0.9, 0.95), None),
    ("muon_spectral_three_steps",
     dict(weight_decay=0.05, ns_coefficients=(3.0, -3.2, 1.2), ns_steps=3, eps=1e-6,
          adjust_lr_fn="spectral_unclamped"), (0.8, 0.99), None),
    ("muon_clip", dict(weight_decay=0.1), (0.9, 0.999), 1.5),
]
muon_cases = []
for data_index, (seed, params0, grads) in enumerate(data):
    for schedule, lrs in SCHEDULES.items():
        for name, opts, betas, clip in MUON_CASES:
            params = {k: v.clone().requires_grad_(True) for k, v in params0.items()}
            rest = [k for k in SHAPES if k not in MATRICES]
            muon = torch.optim.Muon([params[k] for k in MATRICES], lr=lrs[0], **opts)
            adamw = torch.optim.AdamW([params[k] for k in rest], lr=lrs[0], betas=betas, eps=1e-8,
                                      weight_decay=opts["weight_decay"], foreach=False)
            trajectory = []
            for step in range(STEPS):
                for opt in (muon, adamw):
                    for g in opt.param_groups:
                        g["lr"] = lrs[step]
                for k in SHAPES:
                    params[k].grad = grads[step][k].clone()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_([params[k] for k in SHAPES], clip, foreach=False)
                adamw.step()
                muon.step()
                trajectory.append({k: f32_list(params[k]) for k in SHAPES})
            first = {k: muon.state[params[k]]["momentum_buffer"] for k in MATRICES}
            first.update({k: adamw.state[params[k]]["exp_avg"] for k in rest})
            second = {k: torch.zeros(SHAPES[k]) for k in MATRICES}
            second.update({k: adamw.state[params[k]]["exp_avg_sq"] for k in rest})
            muon_cases.append({
                "name": name, "data": data_index, "schedule": schedule,
                "options": {**opts, "betas": list(betas)}, "clip_grad_norm": clip,
                "trajectory": trajectory, "final_moments": {"first": flat(first), "second": flat(second)},
            })

write("torch_muon.json", {
    "generator": f"torch {torch.__version__}, scripts/torch_optim_fixtures.py",
    "order": list(SHAPES), "shapes": {k: list(s) for k, s in SHAPES.items()}, "matrices": MATRICES,
    "schedules": SCHEDULES,
    "data": out["data"],
    "cases": muon_cases,
})
