#!/usr/bin/env python3
"""Gloo all-reduce sweep (torch.distributed) in the same form as qsr-comm's allreduce_bench JSON.

    python3 benches/peers/gloo_allreduce.py --ranks 4 --min-bytes 4096 --max-bytes 268435456 --json out.json

Ranks are local processes on 127.0.0.1; time is the median over iterations on rank 0, each call preceded by
a barrier (as in allreduce_bench); busbw = algbw * 2(n-1)/n; #wrong counts elements != n after summing ones.
Run by `cargo xtask bench comm` when torch is importable.
"""
import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def sizes(lo, hi):
    b = lo
    while b <= hi:
        yield b
        b *= 4


def worker(rank, n, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    rows = []
    for b in sizes(args.min_bytes, args.max_bytes):
        count = b // 4
        x = torch.ones(count)
        iters = max(3, min(20, (64 << 20) // b))
        for _ in range(2):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            x.fill_(1.0)
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        wrong = int((x != float(n)).sum())
        algbw = b / med / 1e9
        rows.append({"backend": "gloo", "ranks": n, "bytes": b, "count": count, "time_us": med * 1e6,
                     "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (n - 1) / n, "wrong": wrong})
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        for r in rows:
            print(f"{r['bytes']:>12} {r['time_us']:>12.1f} us {r['algbw_gbs']:8.3f} {r['busbw_gbs']:8.3f} {r['wrong']}")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
