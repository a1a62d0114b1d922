"""Sweep tile configs per head dim on the GPU, forward or backward.

    python benchmarks/tune.py --dim 128              # forward: (BLOCK_M, BLOCK_N, warps, stages)
    python benchmarks/tune.py --dim 128 --descriptors both   # each forward config with and without TMA
    python benchmarks/tune.py --dim 128 --backward   # forward + backward: dQ and dK/dV configs

Prints TFLOP/s (by kept pairs; 3.5x for forward + backward) of each config on a few
workloads, after FlexAttention's figure in the same run; a config whose output differs
from FlexAttention's by more than 2e-2 (relative) is reported as wrong. The winners become
the defaults in maskc/runtime/tiles.py (see benchmarks/NOTES.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).parent))
import maskc  # noqa: E402
from maskc.runtime.tiles import BackwardConfig, TileConfig, use_config  # noqa: E402
from maskc.testing import dense_mask  # noqa: E402
from workloads import workloads  # noqa: E402

T = TileConfig
FORWARD = {
    64: [T(64, 64, 4, 3), T(128, 64, 4, 3), T(128, 128, 8, 3), T(128, 64, 8, 3), T(64, 128, 4, 3)],
    128: [T(64, 64, 4, 3), T(128, 64, 8, 3), T(128, 128, 8, 3), T(128, 128, 8, 2), T(64, 128, 4, 3)],
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
    ap.add_argument("--descriptors", choices=("on", "off", "both"), default="on",
                    help="forward: load through tensor descriptors (TMA) where the inputs allow")
    args = ap.parse_args()
    B, H, L, D = 4, 16, args.length, args.dim
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
               for _ in range(3))
    d_out = torch.randn_like(q)
    chosen = [w for w in workloads(L, H, "cuda") if w[0] in args.only.split("|")]
    pairs = {name: (int(dense_mask(m, L, L, device="cuda").sum()) if m is not None else L * L) for name, m, _ in chosen}
    factor = 3.5 if args.backward else 1.0
    tflops = lambda name, ms: factor * 4 * B * H * D * pairs[name] / (ms * 1e-3) / 1e12  # noqa: E731

    def timed(fn, name):
        fn()
        return tflops(name, triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))

    flex = torch.compile(flex_attention, dynamic=False)
    flex_runs, flex_outs = {}, {}
    for name, mask, score in chosen:
        bm = create_block_mask(mask.fn, None, None, L, L, device="cuda") if mask is not None else None
        flex_runs[name] = lambda bm=bm, score=score: flex(q, k, v, score_mod=score.fn if score else None, block_mask=bm)
        flex_outs[name] = flex_runs[name]().detach()
    print(f"config | {' | '.join(n for n, _, _ in chosen)}  (TFLOP/s, D={D}, {'fwd+bwd' if args.backward else 'fwd'})")
    if not args.backward:
        print("FlexAttention | " + " | ".join(f"{timed(flex_runs[n], n):6.1f}" for n, _, _ in chosen), flush=True)
    sweeps = [(dict(backward=c), f"{c}") for c in BACKWARD] if args.backward else [
        (dict(forward=c, descriptors=d), f"{c} tma={d}") for c in FORWARD[D]
        for d in {"on": [True], "off": [False], "both": [True, False]}[args.descriptors]]
    for override, label in sweeps:
        cells = []
        for name, mask, score in chosen:
            with use_config(**override):
                try:
                    def run():
                        out = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score)
                        if args.backward:
                            out.backward(d_out)
                        return out
                    err = float((run().detach().double() - flex_outs[name].double()).norm() / flex_outs[name].double().norm())
                    cells.append(f"{timed(run, name):6.1f}" + ("" if err < 2e-2 else f" WRONG {err:.1e}"))
                except Exception as e:  # a config that does not fit (shared memory) is reported, not fatal
                    cells.append(f"fail: {type(e).__name__}: {str(e)[:80]}")
        print(f"{label} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
