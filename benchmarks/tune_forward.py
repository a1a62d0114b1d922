"""Sweep forward tile configs (BLOCK_M, BLOCK_N, warps, stages) per head dim on the GPU.

    python benchmarks/tune_forward.py --dim 128
    python benchmarks/tune_forward.py --dim 64

Prints TFLOP/s (by kept pairs) of each config on a few workloads; the winners become the
defaults in maskc/runtime/configs.py (see benchmarks/NOTES.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
import maskc  # noqa: E402
from maskc.runtime.configs import TileConfig, use_config  # noqa: E402
from maskc.testing import dense_mask  # noqa: E402
from workloads import workloads  # noqa: E402

CANDIDATES = {
    64: [TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 3), TileConfig(128, 64, 4, 4), TileConfig(128, 128, 4, 3),
         TileConfig(64, 64, 4, 3), TileConfig(128, 32, 4, 3), TileConfig(128, 128, 8, 2)],
    128: [TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 3), TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 2),
          TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 4), TileConfig(128, 32, 8, 3), TileConfig(64, 128, 4, 3)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--only", default="no mask|causal|sliding window 1024|softcap 30, causal")
    args = ap.parse_args()
    B, H, L, D = 4, 16, args.length, args.dim
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    chosen = [w for w in workloads(L, H, "cuda") if w[0] in args.only.split("|")]
    pairs = {name: (int(dense_mask(m, L, L, device="cuda").sum()) if m is not None else L * L) for name, m, _ in chosen}
    print("config (BM, BN, warps, stages) | " + " | ".join(n for n, _, _ in chosen))
    for config in CANDIDATES[D]:
        cells = []
        for name, mask, score in chosen:
            with use_config(config):
                try:
                    fn = lambda: maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score)  # noqa: E731
                    fn()
                    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                    cells.append(f"{4 * B * H * D * pairs[name] / (ms * 1e-3) / 1e12:6.1f}")
                except Exception as e:  # a config that does not fit (shared memory) is reported, not fatal
                    cells.append(f"fail: {type(e).__name__}")
        print(f"{tuple(config)} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
