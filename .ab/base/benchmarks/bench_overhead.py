"""Host overhead: a tiny causal problem where launch and bookkeeping dominate.

    python benchmarks/bench_overhead.py              # three fresh processes, one table
    python benchmarks/bench_overhead.py --profile    # one process: where a cached call's time goes

B=1, H=1, L=128, D=64, bf16. maskc with a cached kernel and block map, beside
torch.compile(flex_attention) with a prebuilt BlockMask, timed per call by wall clock over
many back-to-back calls and by do_bench (median). A problem this small loads through
pointers: tensor descriptors start at 2^27 (b, h, q, kv) pairs. Each process times maskc
and FlexAttention in turn, three rounds, and reports medians; the table has one row per
process, since what varied between runs before was the process, not the call.
"""
from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import time

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import maskc
from maskc.runtime import launch, plan
from maskc.trace.mods import as_mask_mod


def per_call_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def host_us(fn, n=5000) -> float:
    """Wall time of `fn` alone (no synchronisation), per call."""
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def one_process():
    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flex = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(maskc.masks.causal.fn, None, None, 128, 128, device="cuda")
    run_maskc = lambda: maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)  # noqa: E731
    run_flex = lambda: flex(q, k, v, block_mask=bm)  # noqa: E731
    run_maskc(), run_flex()
    walls, devs = {"maskc": [], "flex": []}, {"maskc": [], "flex": []}
    for _ in range(3):
        for name, fn in (("maskc", run_maskc), ("flex", run_flex)):
            walls[name].append(per_call_us(fn))
            devs[name].append(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3)
    # the parts of maskc's cached call, each timed alone
    mask = as_mask_mod(maskc.masks.causal)
    problem = plan.planned(q, k, v, mask, None, None, launch.seconds)
    parts = {
        "check_tensors": host_us(lambda: plan.check_tensors(q, k, v, False)),
        "guards (MaskMod.traced)": host_us(lambda: mask.traced),
        "plan lookup": host_us(lambda: plan.planned(q, k, v, mask, None, None, launch.seconds)),
        "forward (alloc + launch)": host_us(lambda: launch.forward(q, k, v, problem)),
    }
    torch.cuda.synchronize()
    print(json.dumps({"wall": {n: statistics.median(t) for n, t in walls.items()},
                      "do_bench": {n: statistics.median(t) for n, t in devs.items()}, "parts": parts}))
    if "--profile" in sys.argv:
        profile = cProfile.Profile()
        profile.runcall(lambda: [run_maskc() for _ in range(2000)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


def main():
    if "--child" in sys.argv or "--profile" in sys.argv:
        one_process()
        return
    rows = []
    for _ in range(3):
        out = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| process | maskc µs/call (wall) | flex µs/call (wall) | maskc do_bench µs | flex do_bench µs | "
          "maskc ÷ flex (do_bench) |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        w, d = r["wall"], r["do_bench"]
        print(f"| {i + 1} | {w['maskc']:.1f} | {w['flex']:.1f} | {d['maskc']:.1f} | {d['flex']:.1f} | "
              f"{d['maskc'] / d['flex']:.2f} |")
    print("\nparts of a cached maskc call, µs (each timed alone, per process):")
    for name in rows[0]["parts"]:
        print(f"  {name:26s} " + "  ".join(f"{r['parts'][name]:6.1f}" for r in rows))


if __name__ == "__main__":
    main()
