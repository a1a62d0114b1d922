"""Random mask_mods and score_mods from the grammar fuzzer (tests/fuzz_grammar.py) compiled on CUDA,
against the float64 reference: ragged lengths from 100 to 3000, D=64 and 128, bfloat16, float16 and
float32, forward and, for a quarter of the cases, backward.

    bash benchmarks/run_gpu.sh benchmarks/check_gpu_fuzz.py [--cases 200] [--start 0] [--seeds 17,40]
                                                            [--grad-fraction 0.25] [--max-len 3000] [--no-gluon]
    python benchmarks/check_gpu_fuzz.py --device cpu --cases 3     # this script's smoke run, no GPU

The CPU suite (tests/test_fuzz_grammar.py) runs a small sample through Triton's interpreter at
80 tokens; compiled code can differ (integer widths, library functions, constexpr folding) and
long rows reach the kernels' other paths (many kv tiles, the Gluon kernels), so this is its check.

Half the cases are a mask, half a score mod (with a mask 40% of the time); an eighth have 1-64
queries and no gradients, which take the split-KV decoding kernel. A seed fixes a case: its mods,
their captured tensors, shapes, dtype and inputs. Each case runs with the default kernel choice
and, on a Hopper GPU where the Gluon kernels can run (bfloat16 or float16, D 64 or 128, at least
64 queries outside the decoding kernel and 128 keys), again under MASKC_GLUON=always, where the Gluon forward (and
dK/dV kernel, with gradients) must have run, as check_gpu_hopper.py asserts. A Gluon kernel that
did not fit the GPU (a mod's code adds to its registers and shared memory) is counted apart:
maskc runs the Triton kernel in its place by design.

A MaskcError is a clear refusal and passes; a case whose float64 reference is NaN (a -inf score in
an operation that makes NaN) is skipped, its answer undefined. A wrong answer of a score mod is checked
again: where the answer moves past the tolerance when torch runs the score mod in float32 (a
rounded score crossing a step near the top of a row), its line says ILL and it is not counted as
a failure. Prints a line per run ("ok", or FAIL with the seed, problem, error and the mods' source),
then "N cases, F failures"; exits non-zero on a failure. --minutes ends it early with the summary.
--seeds replays failures. With --device cpu, shapes are tiny (8-80 tokens, D=16) and there is no
Gluon run.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import maskc  # noqa: E402
from fuzz_grammar import GeneratedMod, random_mask_mod, random_score_mod  # noqa: E402
from maskc.runtime import decode, hopper  # noqa: E402
from maskc.runtime import plan as plans  # noqa: E402
from maskc.testing import (assert_close_to_reference, assert_gradient_close_to_reference,  # noqa: E402
                           attention_reference)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SIZES = {"cuda": ((100, 3000), (64, 128)), "cpu": ((8, 80), (16,))}  # (shortest, longest) length, head dims


class Case(NamedTuple):
    seed: int
    mask: GeneratedMod | None
    score: GeneratedMod | None
    B: int
    H: int
    Lq: int
    Lkv: int
    D: int
    dtype: torch.dtype
    grad: bool

    def __str__(self) -> str:
        mods = "+".join(m.name.split("_")[0] for m in (self.score, self.mask) if m is not None)
        return (f"seed {self.seed} {mods} {str(self.dtype)[6:]} D={self.D} B={self.B} H={self.H} "
                f"Lq={self.Lq} Lkv={self.Lkv} {'fwd+bwd' if self.grad else 'fwd'}")


class Refused(Exception):
    """maskc refused the case with a MaskcError: a pass."""


class Undefined(Exception):
    """The float64 reference is NaN: the case has no answer to compare with."""


def case(seed: int, device: str, lengths: tuple[int, int], dims: tuple[int, ...], grad_fraction: float) -> Case:
    """The case of `seed`: lengths first, then mods valid at them (tables as long as the longer)."""
    rng = random.Random(seed)
    dtype, D = rng.choice(DTYPES), rng.choice(dims)
    B, H = rng.choice([(1, 1), (1, 2), (2, 1), (2, 2)])
    Lkv = rng.randint(*lengths)
    decoding = rng.random() < 1 / 8
    Lq = rng.randint(1, decode.MAX_ROWS) if decoding else rng.randint(*lengths)
    grad = not decoding and rng.random() < grad_fraction
    longest = max(Lq, Lkv)
    mask = score = None
    if rng.random() < 0.5:
        mask = random_mask_mod(seed, max_len=longest, device=device)
    else:
        score = random_score_mod(seed, max_len=longest, device=device)
        if rng.random() < 0.4:
            mask = random_mask_mod(seed, max_len=longest, device=device, depth=rng.choice([0, 1, 2]))
    return Case(seed, mask, score, B, H, Lq, Lkv, D, dtype, grad)


def inputs(c: Case, device: str):
    g = torch.Generator(device=device).manual_seed(c.seed)
    return [torch.randn(c.B, c.H, n, c.D, generator=g, device=device).to(c.dtype).requires_grad_(c.grad)
            for n in (c.Lq, c.Lkv, c.Lkv)]


def reference(c: Case, q, k, v):
    """(out, lse, grads) in float64 from the same (rounded) inputs; grads: (the output's gradient
    drawn for the backward, dq, dk, dv), or None without a backward. Raises Undefined on a NaN."""
    exact = [t.detach().double().requires_grad_(c.grad) for t in (q, k, v)]
    out, lse = attention_reference(*exact, mask_mod=c.mask.fn if c.mask else None,
                                   score_mod=c.score.fn if c.score else None)
    grads = None
    if c.grad:
        d_out = torch.randn(out.shape, generator=torch.Generator(device=q.device).manual_seed(c.seed),
                            device=q.device, dtype=torch.float64)
        grads = (d_out, *torch.autograd.grad(out, exact, d_out))
    if torch.isnan(out).any() or torch.isnan(lse).any() or (grads and any(torch.isnan(g).any() for g in grads)):
        raise Undefined()
    return out.detach(), lse.detach(), grads


def ran(key: str) -> bool:
    return any(key in p.launches for p in plans.PLANS.values())


def run(c: Case, q, k, v, want) -> None:
    """Raises what is wrong with maskc's answer, Refused where maskc refused the case."""
    ref, ref_lse, ref_grads = want
    try:
        mask = maskc.mask_mod(c.mask.fn) if c.mask else None
        score = maskc.score_mod(c.score.fn) if c.score else None
        plans.PLANS.clear()  # so that the launches recorded are this call's
        out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, return_lse=True)
        grads = torch.autograd.grad(out, (q, k, v), ref_grads[0].to(c.dtype)) if c.grad else ()
    except maskc.MaskcError as e:
        raise Refused() from e
    assert_close_to_reference(out.detach(), ref, c.dtype)
    empty, got_empty = torch.isneginf(ref_lse), torch.isneginf(lse.detach())
    assert torch.equal(got_empty, empty), \
        f"rows that keep nothing differ at {(got_empty != empty).nonzero()[:5].tolist()}"
    assert (out.detach()[empty] == 0).all(), "rows that keep nothing must give 0"
    assert_close_to_reference(lse.detach()[~empty], ref_lse[~empty], torch.float32, what="lse")
    for what, g, w in zip(("dq", "dk", "dv"), grads, ref_grads[1:] if c.grad else ()):
        assert_gradient_close_to_reference(g, w, c.dtype, what)


def gluon_can_run(c: Case, q, k, device: str) -> bool:
    return (device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
            and c.dtype in (torch.float16, torch.bfloat16) and c.D in hopper.HEAD_DIMS
            and c.Lkv >= hopper.CONFIG.block_n and c.Lq >= hopper.CONSUMER_ROWS and not decode.wanted(q, k, c.grad))


@contextlib.contextmanager
def gluon_setting(value: str | None):
    """MASKC_GLUON=value inside (None: as the environment has it)."""
    previous = os.environ.get("MASKC_GLUON")
    if value is not None:
        os.environ["MASKC_GLUON"] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MASKC_GLUON", None)
        else:
            os.environ["MASKC_GLUON"] = previous


def described(e: BaseException) -> str:
    """The error with maskc's last frames and where it was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    frames = [f for f in frames[:-1] if "/maskc/" in f.filename][-3:] + frames[-1:]
    where = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)
    return f"{type(e).__name__}: {str(e)[:300]} [{where}]"


def ill_conditioned(c: Case, q, k, v, want) -> bool:
    """Whether the answer moves past the dtype's tolerance when the score mod runs as torch runs it
    in float32 (on scores rounded to float32, and also moved by 2e-6 of themselves, twice): a
    rounded score crossing a step near the top of a row (fuzz_grammar's docstring). Such a case
    has no answer to float32's precision, whatever the kernel computes."""
    if c.score is None:
        return False  # a mask is decided by integers and index arithmetic alone
    fn = c.score.fn

    def in_float32(score, b, h, q_idx, kv_idx):
        return fn(score.float(), b, h, q_idx, kv_idx)

    exact = [t.detach().double() for t in (q, k, v)]
    g = torch.Generator(device=q.device).manual_seed(c.seed)
    for nudge in (0.0, 2e-6, 2e-6):
        noise = torch.randn(exact[0].shape, generator=g, device=q.device, dtype=torch.float64)
        out, _ = attention_reference(exact[0] * (1 + nudge * noise), *exact[1:],
                                     mask_mod=c.mask.fn if c.mask else None, score_mod=in_float32)
        try:
            assert_close_to_reference(out, want[0], c.dtype)
        except AssertionError:
            return True
    return False


def arm(c: Case, q, k, v, want, gluon: bool) -> tuple[str, str | None]:
    """('ok' | 'refused' | 'misfit' | 'wrong' | 'fail', what failed) of the case under the default
    kernel choice, or (gluon) under MASKC_GLUON=always, wherever the Gluon kernels can run; 'wrong':
    an answer off the reference's, 'fail': anything else."""
    problem = None
    wrong = False
    with gluon_setting("always" if gluon else None), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run(c, q, k, v, want)
        except Refused:
            return "refused", None
        except AssertionError as e:
            problem, wrong = described(e), True
        except Exception as e:  # noqa: BLE001 (a compile error is a failure to report, not a stop)
            problem = described(e)
        finally:
            hopper.settle()  # a background Gluon compile reports here, not in a later case
    messages = [str(w.message) for w in caught if "Gluon" in str(w.message)]
    if any("did not fit" in m for m in messages):
        # maskc ran the Triton kernel in its place, by design
        return ("wrong" if wrong else "fail", problem) if problem else ("misfit", None)
    if messages:
        # a Gluon failure ends that kind for the process: later cases must still try it
        hopper._failures.clear()
        problem, wrong = f"Gluon: {messages[0][:300]}" + (f"; {problem}" if problem else ""), False
    elif gluon and not problem and not ran("hfwd"):
        problem = "the Gluon forward did not run"
    elif gluon and not problem and c.grad and not (ran("hbwd") or ran("hbwd+dq")):
        problem = "the Gluon dK/dV kernel did not run"
    return ("wrong" if wrong else "fail", problem) if problem else ("ok", None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--start", type=int, default=0, help="the first case's seed")
    parser.add_argument("--seeds", default="", help="seeds to run, separated by commas (replaces --start/--cases)")
    parser.add_argument("--device", default="cuda", choices=sorted(SIZES))
    parser.add_argument("--max-len", type=int, help="the longest q or kv length (default 3000; 80 on the CPU)")
    parser.add_argument("--grad-fraction", type=float, default=0.25, help="the share of cases with a backward")
    parser.add_argument("--no-gluon", action="store_true", help="the default kernel choice only")
    parser.add_argument("--minutes", type=float, help="start no case after this long: the summary still prints "
                                                       "(a case compiles its own kernels, 2-15 s on an H100)")
    args = parser.parse_args()
    deadline = time.monotonic() + 60 * args.minutes if args.minutes else math.inf
    (shortest, longest), dims = SIZES[args.device]
    lengths = (min(shortest, args.max_len or longest), args.max_len or longest)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else range(args.start, args.start + args.cases)
    counts = {"ok": 0, "fail": 0, "refused": 0, "misfit": 0, "undefined": 0, "ill-conditioned": 0, "gluon runs": 0}
    done = 0
    for seed in seeds:
        if time.monotonic() > deadline:
            break
        done += 1
        c = case(seed, args.device, lengths, dims, args.grad_fraction)
        q, k, v = inputs(c, args.device)
        try:
            want = reference(c, q, k, v)
        except Undefined:
            counts["undefined"] += 1
            continue
        arms = [("default", False)]
        if not args.no_gluon and gluon_can_run(c, q, k, args.device):
            arms.append(("gluon", True))
            counts["gluon runs"] += 1
        for label, gluon in arms:
            verdict, problem = arm(c, q, k, v, want, gluon)
            if verdict == "wrong":
                verdict = "ill-conditioned" if ill_conditioned(c, q, k, v, want) else "fail"
            counts[verdict] += 1
            if not problem:
                print(f"ok    {c} {label}", flush=True)
            if problem:
                mods = "; ".join(m.describe() for m in (c.score, c.mask) if m is not None)
                tag = "ILL " if verdict == "ill-conditioned" else "FAIL"
                print(f"{tag}  {c} {label}: {problem} | {mods}", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()  # a case's float64 reference at 3000² can hold gigabytes
    print(f"{done} cases, {counts['fail']} failures ({counts['ok']} runs agreed with the reference, "
          f"{counts['refused']} were refused with a MaskcError, "
          f"{counts['undefined']} cases skipped with a NaN reference, {counts['ill-conditioned']} runs off an "
          f"ill-conditioned reference (ILL), {counts['gluon runs']} cases also under MASKC_GLUON=always, "
          f"{counts['misfit']} Gluon kernels that did not fit)")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
