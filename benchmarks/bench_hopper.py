"""The Gluon Hopper kernels (templates/attention_fwd_hopper.py.jinja, attention_bwd_hopper.py.jinja)
on an H100/H200 beside the Triton-language kernels, FlexAttention and SDPA: an A/B table of the
forward and one of forward + backward, bf16, B=4, H=16.

    bash benchmarks/run_gpu.sh benchmarks/bench_hopper.py [--timing fwd,bwd] [--dims 128,64] [--only "causal|document"]
                                                          [--length 8192] [--dkdv-tiles 64=64,128,4,2]

Their correctness against the float64 reference is tests/gpu/test_gluon.py's (the GPU lane).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
import maskc  # noqa: E402
from maskc.runtime import hopper  # noqa: E402
from maskc.runtime import plan as plans  # noqa: E402
from _results import JSON_HELP, Figure, write  # noqa: E402

FIGURES: list[Figure] = []  # every printed time, for --json


def ran_gluon(key: str = "hfwd") -> bool:
    return any(key in p.launches for p in plans.PLANS.values())


def _chosen(call) -> bool:
    """Whether the default setting (MASKC_GLUON=1) picks the Gluon kernel for this call."""
    plans.PLANS.clear()
    call()
    return ran_gluon()


def timing():
    """One table: Gluon vs the Triton-language forward (MASKC_GLUON=0), FlexAttention and SDPA."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from workloads import workloads
    torch._dynamo.config.recompile_limit = 64  # one compile per workload and head dim
    flex = torch.compile(flex_attention, dynamic=False)
    B, H, L = 4, 16, 8192
    print(f"\nforward, B={B} H={H} L={L} bf16, ms (median of do_bench); ratios are Gluon's speedup")
    print(f"{'workload':22s} {'D':>4s} {'auto':>7s} {'gluon':>8s} {'gluon2':>7s} {'triton':>8s} {'flex':>8s} "
          f"{'sdpa':>8s} "
          f"{'vs triton':>9s} {'vs flex':>8s} {'vs sdpa':>8s}")
    for D in (128, 64):
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name, mask, score in workloads(L, H, "cuda"):
            def ours():
                return maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score)
            times = {}
            for arm, flag in (("gluon", "always"), ("triton", "0"), ("gluon", "always"), ("triton", "0")):
                os.environ["MASKC_GLUON"] = flag
                ours()
                times.setdefault(arm, []).append(triton.testing.do_bench(ours, warmup=25, rep=100))
            os.environ["MASKC_GLUON"] = "1"
            auto = "gluon" if _chosen(ours) else "triton"
            bm = create_block_mask(mask, None, None, L, L, device="cuda") if mask is not None else None
            fl = triton.testing.do_bench(lambda: flex(q, k, v, score_mod=score, block_mask=bm), warmup=25, rep=100)
            sd = float("nan")
            if name in ("no mask", "causal"):
                sd = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=name == "causal"), warmup=25, rep=100)
            g, t = min(times["gluon"]), min(times["triton"])
            g2 = float("nan")
            if name in ("no mask", "causal"):  # two K/V stages instead of three
                saved = hopper.CONFIG, hopper.CONFIG_D64
                hopper.CONFIG, hopper.CONFIG_D64 = (c._replace(num_stages=2) for c in saved)
                os.environ["MASKC_GLUON"] = "always"
                plans.PLANS.clear()
                try:
                    ours()
                    g2 = triton.testing.do_bench(ours, warmup=25, rep=100)
                except Exception as e:  # noqa: BLE001
                    print(f"2 stages failed: {type(e).__name__}: {str(e)[:200]}")
                hopper.CONFIG, hopper.CONFIG_D64 = saved
                os.environ["MASKC_GLUON"] = "1"
                plans.PLANS.clear()
            print(f"{name:22s} {D:4d} {auto:>7s} {g:8.3f} {g2:7.3f} {t:8.3f} {fl:8.3f} {sd:8.3f} {t / g:9.2f} "
                  f"{fl / g:8.2f} {sd / g:8.2f}",
                  flush=True)
            measured = {"maskc": g if auto == "gluon" else t, "maskc, Gluon kernel": g,
                        "maskc, Gluon kernel, 2 K/V stages": g2, "maskc, Triton-language kernel": t,
                        "FlexAttention": fl, "SDPA": sd}
            FIGURES.extend(Figure(f"forward, {name}, D={D}", impl, "time", ms, "ms")
                           for impl, ms in measured.items() if not math.isnan(ms))  # NaN: not timed


def timing_backward(dims=(128, 64), only="", L=8192):
    """Forward + backward, timed in turn, two rounds, minimum, each with the default forward:
    the default backward, the Gluon dK/dV kernel computing dQ where hopper.computes_dq says
    ("gluon"); the Gluon dK/dV kernel beside the Triton dQ kernel ("g-dq"); the Triton backward
    ("triton"); and FlexAttention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from workloads import workloads
    torch._dynamo.config.recompile_limit = 64
    flex = torch.compile(flex_attention, dynamic=False)
    B, H = 4, 16
    os.environ["MASKC_GLUON"] = "1"  # the default setting
    rules = hopper.runs_backward, hopper.computes_dq
    print(f"\nforward + backward, B={B} H={H} L={L} bf16, ms (min of two do_bench medians); dK/dV tiles "
          f"{hopper.BACKWARD}")
    print(f"{'workload':22s} {'D':>4s} {'gluon':>8s} {'g-dq':>8s} {'triton':>8s} {'flex':>8s} {'flex/gluon':>10s} "
          f"{'flex/g-dq':>9s} {'flex/triton':>11s}")
    for D in dims:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        d_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
        for name, mask, score in workloads(L, H, "cuda"):
            if only and name not in only.split("|"):
                continue

            def step(gluon_backward=True, with_dq=True):
                def run():
                    if not gluon_backward:
                        hopper.runs_backward = lambda problem: False
                    if not with_dq:
                        hopper.computes_dq = lambda problem: False
                    try:
                        maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score).backward(d_out)
                    finally:
                        hopper.runs_backward, hopper.computes_dq = rules
                return run
            bm = create_block_mask(mask, None, None, L, L, device="cuda") if mask is not None else None

            def flex_step():
                flex(q, k, v, score_mod=score, block_mask=bm).backward(d_out)
            arms = {"gluon": step(), "g-dq": step(with_dq=False), "triton": step(gluon_backward=False),
                    "flex": flex_step}
            times = {}
            for _ in range(2):
                for arm, run in arms.items():
                    run()
                    times.setdefault(arm, []).append(triton.testing.do_bench(run, warmup=10, rep=100))
            ms = {arm: min(t) for arm, t in times.items()}
            print(f"{name:22s} {D:4d} {ms['gluon']:8.3f} {ms['g-dq']:8.3f} {ms['triton']:8.3f} {ms['flex']:8.3f} "
                  f"{ms['flex'] / ms['gluon']:10.2f} {ms['flex'] / ms['g-dq']:9.2f} {ms['flex'] / ms['triton']:11.2f}",
                  flush=True)
            labels = {"gluon": "maskc", "g-dq": "maskc, Gluon dK/dV + Triton dQ",
                      "triton": "maskc, Triton-language backward", "flex": "FlexAttention"}
            FIGURES.extend(Figure(f"forward + backward, {name}, D={D}", labels[arm], "time", t, "ms")
                           for arm, t in ms.items())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timing", default="fwd,bwd", help="which tables: fwd (forward), bwd (forward + backward)")
    parser.add_argument("--dims", default="128,64", help="head dims of the forward + backward table")
    parser.add_argument("--only", default="", help="workloads of the forward + backward table, separated by |")
    parser.add_argument("--length", type=int, default=8192, help="sequence length of the forward + backward table")
    parser.add_argument("--dkdv-tiles", action="append", default=[], help="the dK/dV kernel's tiles for the table "
                        "at a head dim: D=BLOCK_M,BLOCK_N,WARPS,STAGES (default hopper.BACKWARD's)")
    parser.add_argument("--json", metavar="PATH", help=JSON_HELP)
    args = parser.parse_args()
    torch.manual_seed(0)
    if "fwd" in args.timing.split(","):
        timing()
    if "bwd" in args.timing.split(","):
        for given in args.dkdv_tiles:
            dim, numbers = given.split("=")
            m, n, warps, stages = (int(x) for x in numbers.split(","))
            hopper.BACKWARD[int(dim)] = hopper.BACKWARD[int(dim)]._replace(
                block_m=m, block_n=n, num_warps=warps, num_stages=stages)
        timing_backward(tuple(int(d) for d in args.dims.split(",")), args.only, args.length)
    write(args.json, "hopper", "Gluon kernels beside the Triton-language ones",
          f"bf16, B=4 H=16, L=8192 (forward), L={args.length} (forward + backward)", FIGURES)


if __name__ == "__main__":
    main()
