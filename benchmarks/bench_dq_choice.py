"""Where the Gluon dK/dV kernel should compute dQ too (hopper.computes_dq): forward + backward
with dQ inside the dK/dV kernel (a float32 sum the copy engine adds into, zeroed before and
cast after) against the Triton-language dQ kernel beside it (bf16 dQ written once, two more
matrix products a tile), beside FlexAttention, on rows of few and many kv tiles.

    bash benchmarks/run_gpu.sh benchmarks/bench_dq_choice.py [--dims 128,64]

B=4 H=16 L=8192 bf16; ms a step (median of three rounds, arms timed in turn).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).parent))
import maskc  # noqa: E402
from maskc import masks  # noqa: E402
from maskc.runtime import hopper  # noqa: E402
from bench_attention import bench, warm_up_gpu  # noqa: E402
from workloads import document_ids  # noqa: E402

# one compiled graph a block mask: sixteen cases pass Dynamo's default limit of eight, past which it
# falls back to eager FlexAttention (a dense L² backward, out of memory at L=8192)
torch._dynamo.config.cache_size_limit = 64
flex = torch.compile(flex_attention, dynamic=False)
fused_rule = hopper.computes_dq


def cases(L: int):
    yield "no mask", None
    yield "causal", masks.causal
    for window in (512, 1024, 2048):
        yield f"sliding window {window}", masks.sliding_window(window)
    for n in (24, 12, 6):
        yield f"document ({n}), causal", masks.document(document_ids(L, n, "cuda"), causal=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="128")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    B, H, L = 4, 16, args.length
    warm_up_gpu()
    print(f"# {torch.cuda.get_device_name()}, B={B} H={H} L={L} bf16, fwd+bwd ms")
    print(f"{'workload':24s} {'D':>4s} {'fused':>7s} {'dq kern':>7s} {'flex':>7s} {'f/fused':>7s} {'f/dqk':>7s}")
    for D in (int(d) for d in args.dims.split(",")):
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        d_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
        for name, mask in cases(L):
            if args.only and name not in args.only.split("|"):
                continue
            bm = create_block_mask(mask.fn, None, None, L, L, device="cuda") if mask else None
            arms = {
                "fused": (True, lambda: maskc.compiled_attention(q, k, v, mask_mod=mask).backward(d_out)),
                "dq kernel": (False, lambda: maskc.compiled_attention(q, k, v, mask_mod=mask).backward(d_out)),
                "flex": (None, lambda: flex(q, k, v, block_mask=bm).backward(d_out)),
            }
            times = {a: [] for a in arms}
            grads = {}
            for _ in range(3):
                for arm, (fused, fn) in arms.items():
                    hopper.computes_dq = fused_rule if fused else (lambda problem: False)
                    times[arm].append(bench(fn))
            for arm, (fused, fn) in arms.items():
                hopper.computes_dq = fused_rule if fused else (lambda problem: False)
                q.grad = k.grad = v.grad = None
                fn()
                grads[arm] = [t.grad.double() for t in (q, k, v)]
            hopper.computes_dq = fused_rule
            err = max(float((a - b).norm() / b.norm()) for a, b in zip(grads["dq kernel"], grads["fused"]))
            med = {a: sorted(t)[1] for a, t in times.items()}
            print(f"{name:24s} {D:4d} {med['fused']:7.3f} {med['dq kernel']:7.3f} {med['flex']:7.3f} "
                  f"{med['flex'] / med['fused']:7.2f} {med['flex'] / med['dq kernel']:7.2f}  (grads agree {err:.1e})",
                  flush=True)


if __name__ == "__main__":
    main()
