"""Random mask_mods and score_mods from the grammar fuzzer (tests/fuzz_grammar.py) compiled on CUDA,
against the float64 reference: ragged lengths from 100 to 3000, D=64 and 128, bfloat16, float16
and float32, forward and, for a quarter of the cases, backward.

The CPU suite (tests/test_fuzz_grammar.py) runs a small sample through Triton's interpreter at 80
tokens; compiled code can differ (integer widths, library functions, constexpr folding) and long
rows reach the kernels' other paths (many kv tiles, the Gluon kernels), so this is its check.

A seed fixes a case: its mods, their captured tensors, shapes, dtype and inputs. Half the cases
are a mask, half a score mod (with a mask 40% of the time); an eighth have 1-64 queries and no
gradients, which take the split-KV decoding kernel. Each case runs with the default kernel
choice ("default") and, where the Gluon kernels can run it, under MASKC_GLUON=always ("gluon"),
where the Gluon forward (and dK/dV kernel, with gradients) must run unless the kernel did not fit
the GPU (a mod's code adds to its registers and shared memory: maskc runs the Triton kernel in
its place by design).

Skipped, with the reason: a case maskc refuses with a MaskcError (a clear refusal), a case whose
float64 reference is NaN (its answer undefined), and a score mod whose wrong answer moves past
the tolerance when torch runs the mod in float32 (a rounded score crossing a step near the top
of a row: no answer to float32's precision). The lane runs seeds 0 and 1; `-m slow` runs 2-199.
"""
from __future__ import annotations

import random
import warnings
from typing import NamedTuple

import pytest
import torch

import maskc
from fuzz_grammar import GeneratedMod, random_mask_mod, random_score_mod
from maskc.inference import decode
from maskc.runtime import hopper
from maskc.runtime import plan as plans
from maskc.testing import assert_close_to_reference, assert_gradient_close_to_reference, attention_reference

from ._common import lane_sample, ran

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LENGTHS = (100, 3000)
HEAD_DIMS = (64, 128)
GRAD_FRACTION = 0.25
SEEDS = lane_sample(range(200), lambda i, seed: seed < 2)


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
        mods = "; ".join(m.describe() for m in (self.score, self.mask) if m is not None)
        return (f"seed {self.seed} {str(self.dtype)[6:]} D={self.D} B={self.B} H={self.H} Lq={self.Lq} "
                f"Lkv={self.Lkv} {'fwd+bwd' if self.grad else 'fwd'} | {mods}")


def _case(seed: int) -> Case:
    """The case of `seed`: lengths first, then mods valid at them (tables as long as the longer)."""
    rng = random.Random(seed)
    dtype, D = rng.choice(DTYPES), rng.choice(HEAD_DIMS)
    B, H = rng.choice([(1, 1), (1, 2), (2, 1), (2, 2)])
    Lkv = rng.randint(*LENGTHS)
    decoding = rng.random() < 1 / 8
    Lq = rng.randint(1, decode.MAX_ROWS) if decoding else rng.randint(*LENGTHS)
    grad = not decoding and rng.random() < GRAD_FRACTION
    longest = max(Lq, Lkv)
    mask = score = None
    if rng.random() < 0.5:
        mask = random_mask_mod(seed, max_len=longest, device="cuda")
    else:
        score = random_score_mod(seed, max_len=longest, device="cuda")
        if rng.random() < 0.4:
            mask = random_mask_mod(seed, max_len=longest, device="cuda", depth=rng.choice([0, 1, 2]))
    return Case(seed, mask, score, B, H, Lq, Lkv, D, dtype, grad)


def _inputs(c: Case):
    g = torch.Generator(device="cuda").manual_seed(c.seed)
    return [torch.randn(c.B, c.H, n, c.D, generator=g, device="cuda").to(c.dtype).requires_grad_(c.grad)
            for n in (c.Lq, c.Lkv, c.Lkv)]


def _reference(c: Case, q, k, v):
    """(out, lse, grads) in float64 from the same (rounded) inputs; grads: (the output's gradient
    drawn for the backward, dq, dk, dv), or None without a backward. Skips on a NaN."""
    exact = [t.detach().double().requires_grad_(c.grad) for t in (q, k, v)]
    out, lse = attention_reference(*exact, mask_mod=c.mask.fn if c.mask else None,
                                   score_mod=c.score.fn if c.score else None)
    grads = None
    if c.grad:
        d_out = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(c.seed), device="cuda",
                            dtype=torch.float64)
        grads = (d_out, *torch.autograd.grad(out, exact, d_out))
    if torch.isnan(out).any() or torch.isnan(lse).any() or (grads and any(torch.isnan(g).any() for g in grads)):
        pytest.skip(f"the float64 reference is NaN: the case has no answer ({c})")
    return out.detach(), lse.detach(), grads


def _ill_conditioned(c: Case, q, k, v, want) -> bool:
    """Whether the answer moves past the dtype's tolerance when the score mod runs as torch runs it
    in float32 (on scores rounded to float32, and also moved by 2e-6 of themselves, twice): a
    rounded score crossing a step near the top of a row (fuzz_grammar's docstring)."""
    if c.score is None:
        return False  # a mask is decided by integers and index arithmetic alone
    fn = c.score.fn

    def in_float32(score, b, h, q_idx, kv_idx):
        return fn(score.float(), b, h, q_idx, kv_idx)

    exact = [t.detach().double() for t in (q, k, v)]
    g = torch.Generator(device="cuda").manual_seed(c.seed)
    for nudge in (0.0, 2e-6, 2e-6):
        noise = torch.randn(exact[0].shape, generator=g, device="cuda", dtype=torch.float64)
        out, _ = attention_reference(exact[0] * (1 + nudge * noise), *exact[1:],
                                     mask_mod=c.mask.fn if c.mask else None, score_mod=in_float32)
        try:
            assert_close_to_reference(out, want[0], c.dtype)
        except AssertionError:
            return True
    return False


def _gluon_can_run(c: Case, q, k) -> bool:
    return (torch.cuda.get_device_capability() == (9, 0) and hopper._gluon() is not None
            and c.dtype in (torch.float16, torch.bfloat16) and c.D in hopper.HEAD_DIMS
            and c.Lkv >= hopper.CONFIG.block_n and c.Lq >= hopper.CONSUMER_ROWS and not decode.wanted(q, k, c.grad))


def _check(c: Case, q, k, v, want) -> None:
    ref, ref_lse, ref_grads = want
    try:
        mask = maskc.mask_mod(c.mask.fn) if c.mask else None
        score = maskc.score_mod(c.score.fn) if c.score else None
        out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, return_lse=True)
        grads = torch.autograd.grad(out, (q, k, v), ref_grads[0].to(c.dtype)) if c.grad else ()
    except maskc.MaskcError as e:
        pytest.skip(f"maskc refuses the case with a MaskcError: {str(e)[:200]}")
    assert_close_to_reference(out.detach(), ref, c.dtype)
    empty, got_empty = torch.isneginf(ref_lse), torch.isneginf(lse.detach())
    assert torch.equal(got_empty, empty), \
        f"rows that keep nothing differ at {(got_empty != empty).nonzero()[:5].tolist()}"
    assert (out.detach()[empty] == 0).all(), "rows that keep nothing must give 0"
    assert_close_to_reference(lse.detach()[~empty], ref_lse[~empty], torch.float32, what="lse")
    for what, g, w in zip(("dq", "dk", "dv"), grads, ref_grads[1:] if c.grad else ()):
        assert_gradient_close_to_reference(g, w, c.dtype, what)


def _run(c: Case, q, k, v, want) -> None:
    try:
        _check(c, q, k, v, want)
    except AssertionError as wrong:
        if _ill_conditioned(c, q, k, v, want):
            pytest.skip(f"ill-conditioned: the answer moves past the tolerance in torch's float32 too ({wrong})")
        raise AssertionError(f"{wrong}\n{c}") from None


@pytest.mark.parametrize("seed", SEEDS)
def test_default(seed):
    c = _case(seed)
    q, k, v = _inputs(c)
    _run(c, q, k, v, _reference(c, q, k, v))
    torch.cuda.empty_cache()  # a case's float64 reference at 3000² holds gigabytes


@pytest.mark.parametrize("seed", SEEDS)
def test_gluon(seed, gluon_kernels):
    c = _case(seed)
    q, k, v = _inputs(c)
    if not _gluon_can_run(c, q, k):
        pytest.skip(f"the Gluon kernels do not run this case ({str(c.dtype)[6:]}, D={c.D}, Lq={c.Lq}, Lkv={c.Lkv})")
    want = _reference(c, q, k, v)
    plans.PLANS.clear()  # so that the launches recorded are this call's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(c, q, k, v, want)
    said = [str(w.message) for w in caught if "Gluon" in str(w.message)]
    if any("did not fit" in m for m in said):
        return  # maskc ran the Triton kernel in its place, and its answer was right
    assert not said, f"{said[0]}\n{c}"
    assert ran("hfwd"), f"the Gluon forward did not run\n{c}"
    assert not c.grad or ran("hbwd") or ran("hbwd+dq"), f"the Gluon dK/dV kernel did not run\n{c}"
    torch.cuda.empty_cache()
