#!/usr/bin/env python3
"""Generates crates/qsr-optim/tests/fixtures/torch_optim.json: optimizer trajectories computed by PyTorch.

The Rust tests replay the same parameters, gradients and per-step learning rates through qsr-optim and
must match torch.optim.SGD / torch.optim.AdamW (and clip_grad_norm_) to ~1e-6 relative. Gradients are
given explicitly per step (the optimizer math is under test, not autograd). Only this script needs torch:
    pip install torch && python3 scripts/torch_optim_fixtures.py
"""
import json
import pathlib

import torch

torch.manual_seed(20241)
SHAPES = {"fc.weight": (5, 4), "fc.bias": (5,), "norm.gamma": (3,), "norm.beta": (3,)}
NO_DECAY = ["fc.bias", "norm.gamma", "norm.beta"]  # what `exclude_norm_and_bias` excludes
STEPS = 6
LRS = [0.1, 0.09, 0.075, 0.05, 0.02, 0.01]


def f32_list(t):
    return [float(x) for x in t.detach().reshape(-1).tolist()]


params0 = {k: torch.randn(s) for k, s in SHAPES.items()}
grads = [{k: torch.randn(s) * 2.0 for k, s in SHAPES.items()} for _ in range(STEPS)]

CASES = [
    ("sgd_plain", "sgd", dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0), False, None),
    ("sgd_momentum", "sgd", dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0), False, None),
    ("sgd_momentum_dampening", "sgd", dict(momentum=0.9, dampening=0.3, nesterov=False, weight_decay=0.0), False, None),
    ("sgd_nesterov", "sgd", dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.0), False, None),
    ("sgd_weight_decay", "sgd", dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=1e-2), False, None),
    ("sgd_weight_decay_no_norm_bias", "sgd", dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=1e-2), True, None),
    ("sgd_clip", "sgd", dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=1e-4), False, 1.5),
    ("adamw_no_decay", "adamw", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), False, None),
    ("adamw_decay", "adamw", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05), False, None),
    ("adamw_decay_no_norm_bias", "adamw", dict(betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1), True, None),
    ("adamw_clip", "adamw", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05), False, 2.0),
]

cases = []
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
        opt = torch.optim.SGD(groups, lr=LRS[0], foreach=False, **opts)
    else:
        opt = torch.optim.AdamW(groups, lr=LRS[0], foreach=False, **opts)
    trajectory = []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = LRS[step]
        for k in SHAPES:
            params[k].grad = grads[step][k].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([params[k] for k in SHAPES], clip, foreach=False)
        opt.step()
        trajectory.append({k: f32_list(params[k]) for k in SHAPES})
    cases.append({
        "name": name, "optimizer": kind, "options": {**opts, "betas": list(opts["betas"])} if "betas" in opts else opts,
        "exclude_norm_and_bias": exclude, "clip_grad_norm": clip, "trajectory": trajectory,
    })

out = {
    "generator": f"torch {torch.__version__}, scripts/torch_optim_fixtures.py",
    "order": list(SHAPES), "shapes": {k: list(s) for k, s in SHAPES.items()}, "no_decay": NO_DECAY,
    "lrs": LRS, "params0": {k: f32_list(v) for k, v in params0.items()},
    "grads": [{k: f32_list(v) for k, v in g.items()} for g in grads], "cases": cases,
}
path = pathlib.Path(__file__).resolve().parent.parent / "crates/qsr-optim/tests/fixtures/torch_optim.json"
path.write_text(json.dumps(out, indent=1) + "\n")
print(f"wrote {path} ({len(cases)} cases x {STEPS} steps)")
