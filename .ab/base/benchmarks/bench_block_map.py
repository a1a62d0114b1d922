"""Block-map build time for causal and sliding window at long lengths, and for a document
mask (12 packed documents, causal: ids captured on the device), CPU and GPU.

    python benchmarks/bench_block_map.py

128×128 tiles. Each figure is the median of 21 builds after one warm-up build (the first
build of a mask does its sympy work, kept for later builds at any length). A GPU build is
timed until its tables are usable on the device. FlexAttention's create_block_mask is tried
beside it on the GPU (it evaluates the mask densely and is expected to run out of memory at
131,072 without torch.compile).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import maskc

sys.path.insert(0, str(Path(__file__).parent))
from workloads import document_ids  # noqa: E402

LENGTHS = (131072, 1048576)
DOCUMENT_LENGTHS = (8192, 131072)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn, n=21) -> float:
    fn()
    times = []
    for _ in range(n):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[n // 2]


def flex_ms(mask, L) -> str:
    from torch.nn.attention.flex_attention import create_block_mask

    try:
        return f"{median_ms(lambda: create_block_mask(mask.fn, None, None, L, L, device='cuda'), 3):.1f}"
    except torch.OutOfMemoryError:
        return "out of memory"
    finally:
        torch.cuda.empty_cache()


def main():
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print("| mask | L | device | maskc block_map ms | FlexAttention create_block_mask ms |")
    print("|---|---|---|---|---|")
    for L in LENGTHS:
        for mask in (maskc.masks.causal, maskc.masks.sliding_window(1024)):
            for dev in devices:
                ms = median_ms(lambda: maskc.block_map(mask, L, L, block_size=(128, 128), device=dev))
                flex = flex_ms(mask, L) if dev == "cuda" and L == LENGTHS[0] else "—"
                print(f"| {mask.__name__} | {L} | {dev} | {ms:.3f} | {flex} |", flush=True)
    for L in DOCUMENT_LENGTHS:
        for dev in devices:
            mask = maskc.masks.document(document_ids(L, 12, dev), causal=True)
            ms = median_ms(lambda: maskc.block_map(mask, L, L, block_size=(128, 128), device=dev))
            flex = flex_ms(mask, L) if dev == "cuda" else "—"
            print(f"| {mask.__name__} (12) | {L} | {dev} | {ms:.3f} | {flex} |", flush=True)


if __name__ == "__main__":
    main()
