"""Host overhead: a tiny causal problem where launch and bookkeeping dominate.

    python benchmarks/bench_overhead.py [--profile]

B=1, H=1, L=128, D=64, bf16. maskc with a cached kernel and block map, beside
torch.compile(flex_attention) with a prebuilt BlockMask, timed per call by wall clock over
many back-to-back calls (and by CUDA graph-free do_bench). A problem this small loads
through pointers: tensor descriptors start at 2^27 (b, h, q, kv) pairs.
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import maskc


def per_call_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flex = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(maskc.masks.causal.fn, None, None, 128, 128, device="cuda")
    run_maskc = lambda: maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)  # noqa: E731
    run_flex = lambda: flex(q, k, v, block_mask=bm)  # noqa: E731
    rows = []
    for name, fn in (("maskc", run_maskc), ("flex", run_flex)):
        wall = per_call_us(fn)
        dev = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        rows.append((name, wall, dev))
    if "--profile" in sys.argv:
        # where a cached call's host time goes: maskc's Python, Triton's launcher, torch
        profile = cProfile.Profile()
        profile.runcall(lambda: [run_maskc() for _ in range(2000)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    print("| B=1 H=1 L=128 D=64 causal | µs per call (back-to-back, wall) | do_bench µs |")
    print("|---|---|---|")
    for name, wall, dev in rows:
        print(f"| {name} | {wall:.1f} | {dev:.1f} |")


if __name__ == "__main__":
    main()
