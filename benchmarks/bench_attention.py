"""Attention: maskc beside FlexAttention and scaled_dot_product_attention, in one run.

    python benchmarks/bench_attention.py                  # forward, B=4 H=16 L=8192 D=128 bf16
    python benchmarks/bench_attention.py --dim 64 --length 16384
    python benchmarks/bench_attention.py --backward       # forward + backward (torch.autograd.grad)

TFLOP/s count 4·B·H·D·(pairs the mask keeps) for the forward, 3.5 times that for forward
plus backward, the same count for every implementation. maskc and FlexAttention are timed
in turn, three times each, and the medians are reported. Each maskc output (and gradient)
is checked against FlexAttention on the full problem and against the float64 reference on
one (b, h) slice. Mask construction is timed separately from attention.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).parent))
import maskc  # noqa: E402
from maskc.runtime import launch, plan  # noqa: E402
from maskc.testing import attention_reference, dense_mask  # noqa: E402
from maskc.trace.mods import as_mask_mod, as_score_mod  # noqa: E402
from _results import JSON_HELP, Figure, write  # noqa: E402
from workloads import workloads  # noqa: E402

flex = torch.compile(flex_attention, dynamic=False)


def bench(fn) -> float:
    fn()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def alternating(run_a, run_b, rounds: int = 3) -> tuple[float, float]:
    """Median times of a and b, timed in turn a, b, a, b, ...: whatever drifts during the run
    (clocks, temperature) falls on both alike."""
    run_a(), run_b()  # compile and warm both before any timing
    times = [(bench(run_a), bench(run_b)) for _ in range(rounds)]
    return tuple(sorted(t[i] for t in times)[rounds // 2] for i in (0, 1))


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Keep the GPU busy until its clocks settle, so that the first workload is not timed on
    an idle card. (It did not close the gap between this script's maskc figures and
    tune.py's, which benchmarks/NOTES.md records as unexplained.)"""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def time_block_map(mask, L, block_size, dev) -> float:
    """Milliseconds to build the block map (median of 5 builds, each from scratch)."""
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        maskc.block_map(mask, L, L, block_size=block_size, device=dev)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[2]


def outputs(run, q, k, v, d_out, backward):
    out = run()
    if not backward:
        return [out.detach()]
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), d_out)]


def with_backward(run, q, k, v, d_out, accumulate):
    """A training step's attention: forward, then the gradients of q, k and v handed on, as
    autograd hands them to the projections that made q, k and v in a model. `accumulate` (the
    older method, `--accumulate-grads`) calls `.backward`, which also adds each gradient into the leaf
    tensors' `.grad`: three elementwise adds of B·H·L·D that are not attention (0.39 ms a step at
    the default shape on the H100, the same for every implementation; FlashAttention's
    benchmarks clear `.grad` before each backward for the same reason)."""
    if accumulate:
        return lambda: run().backward(d_out)
    return lambda: torch.autograd.grad(run(), (q, k, v), d_out)


def reference(q, k, v, d_out, mask, score, backward):
    """float64 output (and gradients) on the (b=0, h=0) slice."""
    q1, k1, v1 = (t[:1, :1].detach().double().requires_grad_(backward) for t in (q, k, v))
    out, _ = attention_reference(q1, k1, v1, mask, score)
    if not backward:
        return [out]
    return [out.detach(), *torch.autograd.grad(out, (q1, k1, v1), d_out[:1, :1].double())]


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--lengths", default="", help="comma-separated lengths to sweep instead of --length")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--only", default="", help="workload names to run, separated by |")
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    ap.add_argument("--accumulate-grads", action="store_true",
                    help="with --backward: .backward() into the leaves' .grad, the older method")
    ap.add_argument("--json", metavar="PATH", help=JSON_HELP)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [args.length]
    warm_up_gpu()
    rows = []
    for L in lengths:
        rows += run(args, L)
    table(args, rows)
    write_json(args, rows, sweep=len(lengths) > 1)


def write_json(args, rows, sweep: bool) -> None:
    """The table's times as a benchmarks/_results.py file (with --json)."""
    if args.json is None:
        return
    figures, work = [], {}
    for L, name, t_maskc, *_, t_map, t_flex_mask, _err_ref, _err_flex, t_flex, t_sdpa, flops in rows:
        workload = f"{name}, L={L}" if sweep else name
        work[workload] = flops
        figures += [Figure(workload, "maskc", "time", t_maskc, "ms"),
                    Figure(workload, "FlexAttention", "time", t_flex, "ms")]
        if t_sdpa is not None:
            figures.append(Figure(workload, "SDPA", "time", t_sdpa, "ms"))
        figures += [Figure(workload, "maskc", "block map", t_map, "ms"),
                    Figure(workload, "FlexAttention", "create_block_mask", t_flex_mask, "ms")]
    mode = "Forward + backward" if args.backward else "Forward"
    length = f" L={rows[0][0]}" if rows and not sweep else ""
    setup = (f"bf16, B={args.batch} H={args.heads}{length} D={args.dim}"
             f"{', gradients accumulated into .grad' if args.accumulate_grads else ''}"
             f"{', MASKC_AUTOTUNE=' + os.environ['MASKC_AUTOTUNE'] if os.environ.get('MASKC_AUTOTUNE') else ''}")
    write(args.json, "forward+backward" if args.backward else "forward", f"{mode}, D={args.dim}", setup, figures,
          work)


def run(args, L):
    B, H, D = args.batch, args.heads, args.dim
    dev = "cuda"
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16, requires_grad=args.backward)
               for _ in range(3))
    d_out = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
    mode = ("fwd+bwd" + (", .grad accumulated" if args.accumulate_grads else "")) if args.backward else "fwd"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"MASKC_AUTOTUNE={os.environ.get('MASKC_AUTOTUNE', '')!r}, "
          f"B={B} H={H} L={L} D={D} bf16, {mode}")
    rows = []
    for name, mask, score in workloads(L, H, dev):
        if args.only and name not in args.only.split("|"):
            continue
        keep = dense_mask(mask, L, L, device=dev)[0, 0] if mask is not None else None
        pairs = int(keep.sum()) if keep is not None else L * L
        flops = 4 * B * H * D * pairs * (3.5 if args.backward else 1.0)
        run_maskc = lambda: maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score)  # noqa: E731
        with torch.no_grad():
            run_maskc()  # plans the call (and autotunes it when MASKC_AUTOTUNE=1): its tiles are known after
        problem = plan.planned(q, k, v, as_mask_mod(mask), as_score_mod(score), None, launch.seconds)
        spec = problem.tiles.forward
        t_map = time_block_map(mask, L, problem.tiles.sparse, dev) if mask is not None else 0.0
        flex_bm = create_block_mask(mask.fn, None, None, L, L, device=dev) if mask is not None else None
        run_flex = lambda: flex(q, k, v, score_mod=score.fn if score else None, block_mask=flex_bm)  # noqa: E731
        timed_maskc, timed_flex = run_maskc, run_flex
        if args.backward:
            timed_maskc, timed_flex = (with_backward(fn, q, k, v, d_out, args.accumulate_grads)
                                       for fn in (run_maskc, run_flex))
        t_maskc, t_flex = alternating(timed_maskc, timed_flex)
        # checked after timing, so that no heavy float64 work runs between the timed calls
        got = outputs(run_maskc, q, k, v, d_out, args.backward)
        err_flex = max(rel_err(a, b) for a, b in zip(got, outputs(run_flex, q, k, v, d_out, args.backward)))
        # the float64 slice needs 8·L² bytes per score matrix: skip it for the longest runs
        err_ref = max(rel_err(a[:1, :1], b) for a, b in zip(got, reference(q, k, v, d_out, mask, score,
                                                                             args.backward))) if L <= 16384 else 0.0
        t_flex_mask = bench(lambda: create_block_mask(mask.fn, None, None, L, L, device=dev)) if mask else 0.0
        t_sdpa = None
        if score is None and not args.backward:
            if mask is None:
                run_sdpa = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
            elif mask is maskc.masks.causal:
                run_sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
            else:
                run_sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # noqa: E731
            t_sdpa = bench(run_sdpa)
        tf = lambda t: flops / (t * 1e-3) / 1e12  # noqa: E731
        rows.append((L, name, t_maskc, tf(t_maskc), tf(t_flex), tf(t_sdpa) if t_sdpa else None, t_map, t_flex_mask,
                     err_ref, err_flex, t_flex, t_sdpa, flops))
        print(f"{name:24s} maskc {tf(t_maskc):6.1f}  flex {tf(t_flex):6.1f}  "
              f"sdpa {tf(t_sdpa) if t_sdpa else float('nan'):6.1f} TFLOP/s | err vs f64 {err_ref:.1e} "
              f"vs flex {err_flex:.1e} | tiles {spec.block_m}x{spec.block_n}/{spec.num_warps}w/{spec.num_stages}s",
              flush=True)
        assert err_ref < 2e-2 and err_flex < 2e-2 and math.isfinite(err_ref), f"{name}: maskc disagrees"
    return rows


def table(args, rows):
    mode = "fwd+bwd" if args.backward else "fwd"
    print()
    print(f"| workload ({mode}, B={args.batch} H={args.heads} D={args.dim} bf16) | L | maskc ms | maskc TFLOP/s "
          f"| FlexAttention | SDPA | maskc/Flex | maskc/SDPA | maskc block map ms | flex create_block_mask ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for L, name, ms, m, f, s, tm, tfm in (r[:8] for r in rows):
        s_txt = f"{s:.0f}" if s else "—"
        ratio_s = f"{m / s:.2f}" if s else "—"
        print(f"| {name} | {L} | {ms:.3f} | {m:.0f} | {f:.0f} | {s_txt} | {m / f:.2f} | {ratio_s} | {tm:.1f} "
              f"| {tfm:.2f} |")


if __name__ == "__main__":
    main()
