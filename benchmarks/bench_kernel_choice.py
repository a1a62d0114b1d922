"""Which forward kernel to choose by kept kv tiles a row (hopper.MIN_TILES_PER_ROW): the Gluon
forward forced (MASKC_GLUON=always) against the Triton-language one (MASKC_GLUON=0), on sliding
windows and causal documents of several sizes, forward and optionally forward + backward.

    bash benchmarks/run_gpu.sh benchmarks/bench_kernel_choice.py --dims 128,64 [--backward]

The arms differ in the forward only: the backward is the default one in both. B=4 H=16 L=8192
bf16. Each row gives the tiles a row of the Gluon kernel's 128-key tiles (what
hopper._faster compares with MIN_TILES_PER_ROW), each arm's ms (min of two rounds of do_bench,
arms timed in turn) and Triton ÷ Gluon (above 1: the Gluon kernel is faster); `chosen` is the
kernel the default setting picks.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
import maskc  # noqa: E402
from maskc import masks  # noqa: E402
from maskc.testing import dense_mask  # noqa: E402
from maskc.runtime import hopper  # noqa: E402
from maskc.runtime import plan as plans  # noqa: E402
from workloads import document_ids  # noqa: E402


def cases(L: int, windows, docs):
    yield "causal", masks.causal
    for window in windows:
        yield f"sliding window {window}", masks.sliding_window(window)
    for n in docs:
        yield f"document ({n}), causal", masks.document(document_ids(L, n, "cuda"), causal=True)


def tiles_a_row(mask, L: int) -> float:
    n = hopper.CONFIG.block_n  # the Gluon kernel's q and kv tiles are both 128 at both head dims' rule
    kept = dense_mask(mask, L, L, device="cuda")[0, 0].view(L // n, n, L // n, n).any(dim=3).any(dim=1)
    return kept.sum().item() / (L // n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--windows", default="384,512,768,1024,1536,2048")
    ap.add_argument("--docs", default="24,12,6,3", help="numbers of causal documents packed into the length")
    ap.add_argument("--backward", action="store_true", help="time forward + backward too")
    args = ap.parse_args()
    B, H, L = 4, 16, args.length
    runs = hopper.runs
    print(f"B={B} H={H} L={L} bf16, ms (min of two do_bench medians); MIN_TILES_PER_ROW={hopper.MIN_TILES_PER_ROW}")
    print(f"{'workload':24s} {'D':>4s} {'tiles':>6s} {'chosen':>7s} {'triton':>8s} {'gluon':>8s} {'t/g':>6s}"
          + (f" {'step t':>8s} {'step g':>8s} {'t/g':>6s}" if args.backward else ""))
    for D in (int(d) for d in args.dims.split(",")):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        d_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
        windows, docs = ([int(x) for x in given.split(",")] for given in (args.windows, args.docs))
        for name, mask in cases(L, windows, docs):
            def forward():
                with torch.no_grad():
                    maskc.compiled_attention(q, k, v, mask_mod=mask)

            def step():
                maskc.compiled_attention(q, k, v, mask_mod=mask).backward(d_out)
            os.environ["MASKC_GLUON"] = "1"
            plans.PLANS.clear()
            forward()
            chosen = "gluon" if any("hfwd" in p.launches for p in plans.PLANS.values()) else "triton"
            times = {}
            for _ in range(2):
                for arm in ("triton", "gluon"):
                    os.environ["MASKC_GLUON"] = "always" if arm == "gluon" else "1"
                    hopper.runs = runs if arm == "gluon" else (lambda problem: False)
                    plans.PLANS.clear()
                    timed = (("fwd", forward), ("step", step)) if args.backward else (("fwd", forward),)
                    for what, run in timed:
                        run()
                        times.setdefault((arm, what), []).append(triton.testing.do_bench(run, warmup=10, rep=60))
            ms = {key: min(t) for key, t in times.items()}
            line = (f"{name:24s} {D:4d} {tiles_a_row(mask, L):6.1f} {chosen:>7s} {ms['triton', 'fwd']:8.3f} "
                    f"{ms['gluon', 'fwd']:8.3f} {ms['triton', 'fwd'] / ms['gluon', 'fwd']:6.2f}")
            if args.backward:
                line += (f" {ms['triton', 'step']:8.3f} {ms['gluon', 'step']:8.3f} "
                         f"{ms['triton', 'step'] / ms['gluon', 'step']:6.2f}")
            print(line, flush=True)
    hopper.runs = runs
    os.environ["MASKC_GLUON"] = "1"


if __name__ == "__main__":
    main()
