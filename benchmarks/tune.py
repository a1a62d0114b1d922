"""Sweep tile configs per head dim on the GPU, forward or backward.

    python benchmarks/tune.py --dim 128              # forward: (BLOCK_M, BLOCK_N, warps, stages)
    python benchmarks/tune.py --dim 128 --backward   # forward + backward: dQ and dK/dV configs

Prints TFLOP/s (by kept pairs; 3.5x for forward + backward) of each config on a few
workloads; the winners become the defaults in maskc/runtime/configs.py (see
benchmarks/NOTES.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
import maskc  # noqa: E402
from maskc.runtime.configs import BackwardConfig, TileConfig, use_config  # noqa: E402
from maskc.testing import dense_mask  # noqa: E402
from workloads import workloads  # noqa: E402

T = TileConfig
FORWARD = {
    64: [T(128, 64, 4, 3), T(128, 128, 8, 3), T(128, 64, 4, 4), T(128, 128, 4, 3), T(64, 64, 4, 3), T(64, 64, 4, 4),
         T(64, 128, 4, 3)],
    128: [T(128, 64, 8, 3), T(128, 128, 8, 3), T(64, 64, 4, 3), T(64, 64, 4, 4), T(64, 64, 4, 2), T(64, 128, 4, 3),
          T(64, 32, 4, 3), T(64, 64, 8, 3)],
}
# BackwardConfig(dq=(q rows, kv tile, ...), dkdv=(q tile, kv rows, ...))
BACKWARD = [
    BackwardConfig(T(64, 64, 4, 3), T(64, 64, 4, 3)),
    BackwardConfig(T(128, 32, 4, 3), T(32, 128, 4, 3)),
    BackwardConfig(T(128, 32, 8, 3), T(32, 128, 8, 3)),
    BackwardConfig(T(64, 32, 4, 3), T(32, 64, 4, 3)),
    BackwardConfig(T(128, 64, 8, 3), T(64, 128, 8, 3)),
    BackwardConfig(T(64, 64, 4, 2), T(64, 64, 8, 2)),
    BackwardConfig(T(128, 32, 4, 4), T(32, 128, 4, 4)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--only", default="no mask|causal|sliding window 1024|softcap 30, causal")
    args = ap.parse_args()
    B, H, L, D = 4, 16, args.length, args.dim
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
               for _ in range(3))
    d_out = torch.randn_like(q)
    chosen = [w for w in workloads(L, H, "cuda") if w[0] in args.only.split("|")]
    pairs = {name: (int(dense_mask(m, L, L, device="cuda").sum()) if m is not None else L * L) for name, m, _ in chosen}
    factor = 3.5 if args.backward else 1.0
    print(f"config | {' | '.join(n for n, _, _ in chosen)}  (TFLOP/s, D={D}, {'fwd+bwd' if args.backward else 'fwd'})")
    for config in (BACKWARD if args.backward else FORWARD[D]):
        cells = []
        for name, mask, score in chosen:
            override = dict(backward=config) if args.backward else dict(forward=config)
            with use_config(**override):
                try:
                    def run():
                        out = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score)
                        if args.backward:
                            out.backward(d_out)
                    run()
                    ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
                    cells.append(f"{factor * 4 * B * H * D * pairs[name] / (ms * 1e-3) / 1e12:6.1f}")
                except Exception as e:  # a config that does not fit (shared memory) is reported, not fatal
                    cells.append(f"fail: {type(e).__name__}")
        print(f"{config} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
