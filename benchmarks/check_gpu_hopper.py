"""The Gluon Hopper kernels (templates/attention_fwd_hopper.py.jinja, attention_bwd_hopper.py.jinja)
on an H100/H200: correctness against the float64 reference, then A/B tables beside the
Triton-language kernels, FlexAttention and SDPA (forward; forward + backward).

    bash benchmarks/run_gpu.sh benchmarks/check_gpu_hopper.py [--no-timing] [--examples 30] [--timing fwd,bwd]

The CPU suite cannot run Gluon (the interpreter runs only Triton's language), so this is its
check: every case asserts that the Gluon forward and dK/dV kernels ran (their launch plans
exist), and compares out, LSE, dQ, dK and dV with the float64 reference on ragged lengths, GQA,
D=64 and 128, bf16 and fp16, the workloads' masks and score mods and hypothesis-drawn ones
(maskc.testing.strategies). Exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import traceback
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
import maskc  # noqa: E402
from maskc import masks, scores  # noqa: E402
from maskc.runtime import hopper  # noqa: E402
from maskc.runtime import plan as plans  # noqa: E402
from maskc.testing import (assert_close_to_reference, assert_gradient_close_to_reference,  # noqa: E402
                           attention_reference)

SHAPES = [  # B, Hq, Hkv, Lq, Lkv, D
    (2, 4, 4, 1000, 777, 64),
    (1, 8, 2, 333, 1029, 128),
    (1, 2, 2, 128, 4096, 128),
    (2, 3, 1, 4097, 300, 64),
    (1, 2, 2, 65, 129, 128),
]


def late_keys(score, b, h, q_idx, kv_idx):
    # a split score mod whose first kv tiles are -inf in every row
    return score + torch.where(kv_idx >= 40, 0.0, float("-inf"))


def float_literals_rounded(b, h, q_idx, kv_idx):
    # index arithmetic with float literals, rounded and compared: read as the rationals they spell
    return (((q_idx - kv_idx) * 0.1).int() >= 0) & (torch.floor(kv_idx / 3.0) <= q_idx * 0.5 + 40)


def narrow_casts(score, b, h, q_idx, kv_idx):
    # rounded to bfloat16 and float16 inside the mod (the bfloat16 rounding by its bits)
    return score.to(torch.bfloat16).to(torch.float32) + (score * 0.5).half()


def late_rows(b, h, q_idx, kv_idx):
    # causal from row 70: the first q tile's rows keep nothing, so no program of the dK/dV
    # kernel adds into that tile's dQ
    return (q_idx >= 70) & (kv_idx <= q_idx)


def arctangent(score, b, h, q_idx, kv_idx):
    # the prelude's own arctangent, across both of its range reductions
    return score + 4 * torch.atan((q_idx - kv_idx).float() ** 3 / 1000 + score / 8)


def cases(Lq, Lkv, H):
    docs = torch.randint(0, 4, (max(Lq, Lkv),), device="cuda").sort().values
    table = torch.randn(H, 2 * max(Lq, Lkv) - 1, device="cuda")
    distance = torch.randn(2 * max(Lq, Lkv) - 1, device="cuda")

    def from_the_end(score, b, h, q_idx, kv_idx):
        return score + distance[q_idx - kv_idx]  # a negative index counts from the end, as torch's

    positions = torch.arange(max(Lq, Lkv), device="cuda")
    squares = (positions * positions).float()
    rates, thirds = (positions + 1.0) * 0.1, torch.full_like(positions, 3.0, dtype=torch.float32) / (positions + 1)

    def table_ratio(b, h, q_idx, kv_idx):
        return rates[q_idx] / rates[kv_idx] >= 1  # one division: the diagonal is exactly 1.0

    def number_over_an_index(b, h, q_idx, kv_idx):
        return 3 / (kv_idx + 1) >= thirds[q_idx]  # torch's 3 / x is x.reciprocal() * 3; no FMA

    def product_over_a_table(b, h, q_idx, kv_idx):
        return (kv_idx + 1) * thirds[q_idx] <= 3  # torch rounds the product: no FMA

    def root_of_a_square(b, h, q_idx, kv_idx):
        return torch.sqrt(squares[q_idx]) >= kv_idx  # causal: the root is exact in torch

    def over_a_table(score, b, h, q_idx, kv_idx):
        return score + rates[kv_idx] / rates[q_idx]

    return [
        ("float literals rounded", float_literals_rounded, narrow_casts),
        ("negative index", masks.causal, from_the_end),
        ("arctangent", masks.causal, arctangent),
        ("no mask", None, None),
        ("causal", masks.causal, None),
        ("late rows", late_rows, None),
        ("table ratio", table_ratio, over_a_table),
        ("number over an index", number_over_an_index, None),
        ("product over a table", product_over_a_table, None),
        ("root of a square", root_of_a_square, None),
        ("sliding 100", masks.sliding_window(100), None),
        ("prefix-LM 300", masks.prefix_lm(300), None),
        ("document", masks.document(docs, causal=True), None),
        ("ALiBi causal", masks.causal, scores.alibi(scores.alibi_slopes(H).cuda())),
        ("softcap", None, scores.softcap(20.0)),
        ("relative bias", masks.causal, scores.relative_bias(table, offset=max(Lq, Lkv) - 1)),
        ("late keys", masks.causal, late_keys),
    ]


# the cases also run with q, k and v in a model's memory order, (B, L, H, D) seen as (B, H, L, D)
MODEL_LAYOUT_CASES = ("no mask", "causal", "document", "ALiBi causal")


def model_layout(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def ran_gluon(key: str = "hfwd") -> bool:
    return any(key in p.launches for p in plans.PLANS.values())


def check(label, q, k, v, mask, score) -> int:
    kwargs = dict(mask_mod=mask, score_mod=score, enable_gqa=q.shape[1] != k.shape[1])
    plans.PLANS.clear()
    try:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = attention_reference(*exact, **kwargs)
        out, lse = maskc.compiled_attention(*leaves, return_lse=True, **kwargs)
        assert ran_gluon(), "the Gluon forward did not run"
        # out comes back in q's memory order, as torch's does (the copy engine stores it there)
        assert out.stride() == q.stride(), f"out strides {out.stride()}, q's {q.stride()}"
        assert_close_to_reference(out, ref, q.dtype)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ"
        assert_close_to_reference(lse[finite], ref_lse[finite], torch.float32, what="lse")
        d_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, d_out)
        # no captured tensor needs a gradient here: the Gluon kernel computes dQ too
        fused = ran_gluon("hbwd+dq")
        assert fused or ran_gluon("hbwd"), "the Gluon dK/dV kernel did not run"
        assert fused, "the Gluon kernel did not compute dQ"
        for what, g, w in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, exact, d_out.double())):
            assert_gradient_close_to_reference(g, w, q.dtype, what)
        print(f"ok    {label}")
        return 0
    except Exception as e:  # noqa: BLE001 (a compile error is a failure to report, not a stop)
        # maskc's last frames, and where it was raised
        frames = traceback.extract_tb(e.__traceback__)
        frames = [f for f in frames[:-1] if "/maskc/" in f.filename][-3:] + frames[-1:]
        where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)
        print(f"FAIL  {label}: {type(e).__name__}: {str(e)[:400]} [{where}]")
        return 1


def drawn(examples: int) -> int:
    """Hypothesis-drawn masks and score mods (the CPU suite's strategies) through the Gluon kernel."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from maskc.testing import strategies

    failures = []

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    # lengths the kernel runs at (hopper.runs: at least 64 queries and 128 keys)
    @given(data=st.data(), Lq=st.integers(65, 700), Lkv=st.integers(128, 700), D=st.sampled_from([64, 128]),
           gqa=st.booleans(), seed=st.integers(0, 2 ** 16))
    def one(data, Lq, Lkv, D, gqa, seed):
        Hq, Hkv = (4, 2) if gqa else (2, 2)
        mask = data.draw(strategies.masks(Lq, Lkv, H=Hq, device="cuda"))
        score = data.draw(strategies.score_mods(Lq, Lkv, H=Hq, device="cuda"))
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(1, h, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h, n in ((Hq, Lq), (Hkv, Lkv), (Hkv, Lkv)))
        failures.append(check(f"drawn Lq={Lq} Lkv={Lkv} D={D} gqa={gqa} seed={seed}", q, k, v, mask, score))

    one()
    return sum(failures)


def _chosen(call) -> bool:
    """Whether the default setting (MASKC_GLUON=1) picks the Gluon kernel for this call."""
    plans.PLANS.clear()
    call()
    hopper.settle()  # a new Gluon kernel compiles in the background: the next call takes it
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
    os.environ["MASKC_GLUON"] = "1"  # the default setting (the check ran with "always")
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
                    hopper.settle()
                    times.setdefault(arm, []).append(triton.testing.do_bench(run, warmup=10, rep=100))
            ms = {arm: min(t) for arm, t in times.items()}
            print(f"{name:22s} {D:4d} {ms['gluon']:8.3f} {ms['g-dq']:8.3f} {ms['triton']:8.3f} {ms['flex']:8.3f} "
                  f"{ms['flex'] / ms['gluon']:10.2f} {ms['flex'] / ms['g-dq']:9.2f} {ms['flex'] / ms['triton']:11.2f}",
                  flush=True)


def main():
    os.environ["MASKC_GLUON"] = "always"  # wherever it can run, small shapes too
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--timing", default="fwd,bwd", help="which tables: fwd (forward), bwd (forward + backward)")
    parser.add_argument("--no-check", action="store_true", help="the timing table only")
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="the first two shapes, bfloat16 only")
    parser.add_argument("--cases", default="", help="names of the named cases to check, separated by | "
                        "(default: all)")
    parser.add_argument("--shapes", default="", help="indices into SHAPES to check, e.g. 3,4 (default: all)")
    parser.add_argument("--dims", default="128,64", help="head dims of the forward + backward table")
    parser.add_argument("--only", default="", help="workloads of the forward + backward table, separated by |")
    parser.add_argument("--length", type=int, default=8192, help="sequence length of the forward + backward table")
    parser.add_argument("--dkdv-tiles", action="append", default=[], help="the dK/dV kernel's tiles for the table "
                        "at a head dim: D=BLOCK_M,BLOCK_N,WARPS,STAGES (default hopper.BACKWARD's)")
    args = parser.parse_args()
    torch.manual_seed(0)
    failures = 0
    shapes = [] if args.no_check else SHAPES[:2] if args.quick else SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16)
    for (B, Hq, Hkv, Lq, Lkv, D), dtype in itertools.product(shapes, dtypes):
        q = torch.randn(B, Hq, Lq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype)
        v = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype)
        for name, mask, score in cases(Lq, Lkv, Hq):
            if args.cases and name not in args.cases.split("|"):
                continue
            label = f"{name:14s} B={B} Hq={Hq} Hkv={Hkv} Lq={Lq} Lkv={Lkv} D={D} {dtype}"
            failures += check(label, q, k, v, mask, score)
            if name in MODEL_LAYOUT_CASES:
                failures += check(label + " (B, L, H, D) memory", *map(model_layout, (q, k, v)), mask, score)
    if args.examples and not args.no_check:
        failures += drawn(args.examples)
    print(f"{failures} failures")
    if not args.no_timing:
        if "fwd" in args.timing.split(","):
            timing()
        if "bwd" in args.timing.split(","):
            for given in args.dkdv_tiles:
                dim, numbers = given.split("=")
                m, n, warps, stages = (int(x) for x in numbers.split(","))
                hopper.BACKWARD[int(dim)] = hopper.BACKWARD[int(dim)]._replace(
                    block_m=m, block_n=n, num_warps=warps, num_stages=stages)
            timing_backward(tuple(int(d) for d in args.dims.split(",")), args.only, args.length)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
