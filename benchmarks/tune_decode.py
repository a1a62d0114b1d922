"""Sweep the decoding kernel's tiles, warps, stages and kv splits on the reference shapes.

    bash benchmarks/run_gpu.sh benchmarks/tune_decode.py

Prints µs per (workload, config, splits); "auto" is the split count maskc chooses.
"""
from __future__ import annotations

import sys

import torch
import triton

import maskc
from maskc.inference import decode
from maskc.runtime.tiles import TileConfig, use_config

CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 3), (32, 4, 4)]
SPLITS = (None, 2, 4, 8, 16)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def main():
    dev, dt, D, Hq, Hkv = "cuda", torch.bfloat16, 128, 32, 8
    shapes = [("no mask", 8, 32768, 1, None), ("sliding 4096", 8, 32768, 1, maskc.masks.sliding_window(4096)),
              ("causal Lq=16", 8, 32768, 16, maskc.masks.causal), ("batch 64x4096", 64, 4096, 1, None)]
    only = sys.argv[1:]
    for name, B, L, lq, mask in shapes:
        if only and not any(o in name for o in only):
            continue
        k = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
        v = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
        q = torch.randn(B, Hq, lq, D, device=dev, dtype=dt)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        rows = lq * Hq // Hkv
        block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
        results = []
        for block_n, warps, stages in CONFIGS:
            for splits in SPLITS:
                with use_config(decode=TileConfig(block_m, block_n, warps, stages), splits=splits):
                    run = lambda: maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True, kv_lens=lens)  # noqa: E731
                    run()
                    chosen = next(p for p in decode.DECODES.values() if p.B == B and p.Lq == lq).splits \
                        if splits is None else splits
                    results.append((bench(run), f"{block_n}x{warps}w{stages}s", "auto" if splits is None else "",
                                    chosen))
                decode.DECODES.clear()
        results.sort()
        print(f"{name}: best {results[0][0]:.1f} µs")
        for t, config, auto, chosen in results[:6] + [r for r in results if r[2] == "auto"]:
            print(f"   {t:8.1f} µs  {config:<10} splits {chosen:<3} {auto}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
