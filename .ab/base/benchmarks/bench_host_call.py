"""Host work of a cached compiled_attention call, on the CPU: the kernel's launch is replaced
by a no-op, so what is timed is maskc's Python between the call and the launch (the mod's
guards, the plan lookup, the checks). The tiny-call overhead on the GPU (bench_overhead.py)
is this plus the launch; this one runs anywhere, so a change can be compared before a GPU
session:

    python benchmarks/bench_host_call.py
    PYTHONPATH=/path/to/other/tree python benchmarks/bench_host_call.py   # another version

B=1, H=1, L=128, D=64, float32, causal, no gradients; best and median of 7 rounds of 2000
calls, µs a call.
"""
from __future__ import annotations

import statistics
import time

import torch

import maskc
from maskc.runtime import api


def main() -> None:
    q, k, v = (torch.randn(1, 1, 128, 64) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(1, 1, 128)
    api.launch.forward = lambda q, k, v, problem: (out, lse)  # the launch, and nothing else, left out
    mask = maskc.masks.causal
    with torch.no_grad():
        maskc.compiled_attention(q, k, v, mask_mod=mask)  # traces and plans once
        rounds = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(2000):
                maskc.compiled_attention(q, k, v, mask_mod=mask)
            rounds.append((time.perf_counter() - start) / 2000 * 1e6)
    print(f"host work of a cached call: best {min(rounds):.1f} µs, median {statistics.median(rounds):.1f} µs")


if __name__ == "__main__":
    main()
