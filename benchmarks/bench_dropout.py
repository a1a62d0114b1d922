"""Attention dropout's cost: forward + backward with dropout_p=0.1 beside dropout_p=0 in maskc, and
SDPA's dropout path (SDPA leaves cuDNN for the flash or efficient kernel when dropping), in one
process, bf16, B=4, H=16, L=8192, do_bench medians (ms) of out = attention(...); out.backward(dO).

    bash benchmarks/run_gpu.sh benchmarks/bench_dropout.py [--dims 128,64] [--length 8192] [--json PATH]

Workloads: no mask and causal (SDPA's is_causal), and documents of 1024 tokens with causal
attention within each (maskc's document mask; SDPA takes it only as a dense boolean mask, which
its dropout path runs on the efficient kernel, so it is timed too where memory allows).
Printed: each time, maskc's p=0.1 ÷ p=0 (target ≤ 1.15) and SDPA's dropout time ÷ maskc's
(target ≥ 1.3 at no mask and causal).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

import maskc
from _results import JSON_HELP, Figure, write

B, H = 4, 16
P = 0.1


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--json", metavar="PATH", help=JSON_HELP)
    args = parser.parse_args()
    L = args.length
    figures = []
    print(f"forward + backward, bf16, B={B} H={H} L={L}, ms (do_bench median); dropout p={P}")
    print(f"{'D':>4} {'workload':<10} {'maskc p=0':>10} {'maskc p=.1':>11} {'÷ p=0':>6} {'SDPA p=.1':>10} "
          f"{'SDPA ÷ maskc':>13}")
    for D in map(int, args.dims.split(",")):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
        d_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
        docs = torch.arange(L, device="cuda") // 1024
        workloads = {"no mask": (None, dict()), "causal": (maskc.masks.causal, dict(is_causal=True)),
                     "document": (maskc.masks.document(docs, causal=True),
                                  dict(attn_mask=(docs[:, None] == docs[None, :]) & torch.ones(
                                      L, L, dtype=torch.bool, device="cuda").tril()))}
        for name, (mod, sdpa_args) in workloads.items():
            def maskc_step(p):
                return lambda: maskc.compiled_attention(q, k, v, mask_mod=mod, dropout_p=p).backward(d_out)

            def sdpa_step():
                F.scaled_dot_product_attention(q, k, v, dropout_p=P, **sdpa_args).backward(d_out)

            plain, dropping = timed(maskc_step(0.0)), timed(maskc_step(P))
            try:
                sdpa = timed(sdpa_step)
            except torch.OutOfMemoryError:
                sdpa = float("nan")
            torch.cuda.empty_cache()
            print(f"{D:>4} {name:<10} {plain:10.3f} {dropping:11.3f} {dropping / plain:6.2f} {sdpa:10.3f} "
                  f"{sdpa / dropping:13.2f}", flush=True)
            workload = f"{name}, D={D}"
            figures += [Figure(workload, "maskc", "fwd+bwd time", plain, "ms"),
                        Figure(workload, f"maskc, dropout {P}", "fwd+bwd time", dropping, "ms"),
                        Figure(workload, f"SDPA, dropout {P}", "fwd+bwd time", sdpa, "ms")]
    write(args.json, "dropout", "Attention dropout, forward + backward", f"bf16, B={B} H={H} L={L}, dropout {P}",
          figures)


if __name__ == "__main__":
    main()
