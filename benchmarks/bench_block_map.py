"""Block-map build time for causal and sliding window at long lengths, CPU and GPU.

    python benchmarks/bench_block_map.py

128×128 tiles. FlexAttention's create_block_mask is tried beside it on the GPU (it
evaluates the mask densely and is expected to run out of memory at 131,072 without
torch.compile).
"""
from __future__ import annotations

import time

import torch

import maskc


def median_ms(fn, n=7) -> float:
    times = []
    for _ in range(n):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[n // 2]


def main():
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print("| mask | L | device | maskc block_map ms | FlexAttention create_block_mask ms |")
    print("|---|---|---|---|---|")
    for L in (131072, 1048576):
        for mask in (maskc.masks.causal, maskc.masks.sliding_window(1024)):
            for dev in devices:
                ms = median_ms(lambda: maskc.block_map(mask, L, L, block_size=(128, 128), device=dev))
                flex = "—"
                if dev == "cuda" and L == 131072:
                    from torch.nn.attention.flex_attention import create_block_mask
                    try:
                        flex = f"{median_ms(lambda: create_block_mask(mask.fn, None, None, L, L, device=dev), 3):.1f}"
                    except torch.OutOfMemoryError:
                        flex = "out of memory"
                    torch.cuda.empty_cache()
                print(f"| {mask.__name__} | {L} | {dev} | {ms:.2f} | {flex} |", flush=True)


if __name__ == "__main__":
    main()
