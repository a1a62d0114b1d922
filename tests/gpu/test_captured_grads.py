"""Gradients of captured tensors that require grad, compiled on CUDA, against float64 autograd
through the reference: learnable ALiBi slopes (also driven negative), a per-head relative-position
table and a per-head softcap, deterministic from run to run; then hypothesis-drawn learnable score
mods (per-head slopes, relative tables, softcaps, per-row temperatures, column biases) under drawn
masks."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import maskc
from maskc.testing import assert_gradient_close_to_reference, attention_reference
from maskc.testing.strategies import lengths, masks

from ._common import drawn, examples, lane_sample, name

B, H, L, D = 2, 4, 300, 64


def _mods():
    """name -> (tensors, mod of them, dtype): the score mod built over given tensors, so that the
    same one runs with maskc's leaves and with float64 copies."""
    g = torch.Generator().manual_seed(0)
    slopes = torch.rand(H, generator=g).cuda()
    table = (torch.randn(H, 2 * L - 1, generator=g) * 0.1).cuda()
    cap = (20 + 10 * torch.rand(H, generator=g)).cuda()
    return {
        "alibi": ((slopes,), lambda t: lambda s, b, h, q, kv: s + t[0][h] * (kv - q), torch.bfloat16),
        # scores growing with q - kv: past Lq (300 of a 320-row tile) p overflowed to a NaN gradient.
        # float32: rows this peaked make dS = P (dP - Delta) a difference of near-equal terms, where
        # bfloat16's rounding of O (in Delta) exceeds the check's tolerance, as in any FlashAttention
        # backward
        "alibi, negative slopes": ((-1 - slopes,), lambda t: lambda s, b, h, q, kv: s + t[0][h] * (kv - q),
                                   torch.float32),
        "relative": ((table,), lambda t: lambda s, b, h, q, kv: s + t[0][h, q - kv + L - 1], torch.bfloat16),
        "softcap": ((cap,), lambda t: lambda s, b, h, q, kv: t[0][h] * torch.tanh(s / t[0][h]), torch.bfloat16),
    }


@pytest.mark.parametrize("mod", lane_sample(["alibi", "alibi, negative slopes", "relative", "softcap"],
                                             lambda i, v: v == "alibi, negative slopes"))
def test_learnable_tensor(mod):
    """Causal, B=2 H=4 L=300 D=64: the captured tensor's gradient within 3e-2 of the largest
    (or of 1), and the same bits from two runs (integer atomics in units of 2^-32)."""
    tensors, build, dtype = _mods()[mod]
    tensors = tuple(t.clone().requires_grad_() for t in tensors)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    d_out = torch.randn(B, H, L, D, device="cuda", dtype=dtype)
    runs = []
    for _ in range(2):
        out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=maskc.score_mod(build(tensors)))
        runs.append(torch.autograd.grad(out, tensors, d_out))
    exact = tuple(t.detach().double().requires_grad_() for t in (q, k, v, *tensors))
    ref, _ = attention_reference(*exact[:3], maskc.masks.causal, build(exact[3:]))
    want = torch.autograd.grad(ref, exact[3:], d_out.double())
    for got, again, w in zip(runs[0], runs[1], want):
        error = ((got.double() - w).abs().max() / w.abs().max().clamp(min=1)).item()
        assert error < 3e-2, f"gradient off by {error:.2e} of its largest value"
        assert torch.equal(got, again), "two runs gave different gradients"


@dataclass(frozen=True, repr=False)
class Learnable:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: object
    kind: str
    seed: int

    def __repr__(self) -> str:
        B, H, Lq, D = self.q.shape
        return f"Learnable(B={B} H={H} Lq={Lq} Lkv={self.k.shape[2]} D={D} mask={name(self.mask)} kind={self.kind})"


@st.composite
def learnables(draw, max_len: int = 700) -> Learnable:
    B, H = draw(st.integers(1, 2)), draw(st.sampled_from((1, 2, 4)))
    q_len, kv_len = draw(lengths(max_len))
    d = draw(st.sampled_from((64, 128, 32)))
    kind = draw(st.sampled_from(("slopes", "relative", "softcap", "rows", "columns")))
    mask = draw(st.none() | masks(q_len, kv_len, B=B, H=H, device="cuda"))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g).to(dtype=torch.bfloat16, device="cuda")
               for n in (q_len, kv_len, kv_len))
    return Learnable(q, k, v, mask, kind, seed)


def _learnable_mod(kind: str, H: int, q_len: int, kv_len: int, g: torch.Generator):
    """(tensor, mod of it): the kind's captured tensor and the score mod over a given copy."""
    if kind == "slopes":
        t = torch.rand(H, generator=g)
        mod = lambda t: lambda s, b, h, qi, ki: s + t[h] * (ki - qi)  # noqa: E731
    elif kind == "relative":
        t = torch.randn(H, q_len + kv_len - 1, generator=g) * 0.5
        mod = lambda t: lambda s, b, h, qi, ki: s + t[h, qi - ki + kv_len - 1]  # noqa: E731
    elif kind == "softcap":
        t = 5 + 10 * torch.rand(H, generator=g)
        mod = lambda t: lambda s, b, h, qi, ki: t[h] * torch.tanh(s / t[h])  # noqa: E731
    elif kind == "rows":  # a per-row temperature (a per-row bias would have gradient 0: softmax ignores it)
        t = 1 + 0.2 * torch.randn(q_len, generator=g)
        mod = lambda t: lambda s, b, h, qi, ki: s * t[qi]  # noqa: E731
    else:
        t = torch.randn(kv_len, generator=g)
        mod = lambda t: lambda s, b, h, qi, ki: s + t[ki]  # noqa: E731
    return t.cuda(), mod


@examples(2, 12)
def test_learnable_drawn(examples):
    @drawn(examples)
    @given(learnables())
    def learnable(case):
        _check_learnable(case)

    learnable()


def _check_learnable(case):
    """dq, dk, dv and the tensor's gradient within bf16's tolerance of float64. The tensor's
    gradient sums ds · d(score)/d(tensor) over every pair, and Σ_j ds = 0 in each row: where that
    sum cancels, bf16 inputs alone move it past bf16's tolerance. Then the same case from float32
    copies of the inputs must be within 1e-2: a kernel bug is off by O(1) (the float64 CPU tests
    hold these kernels to 1e-10)."""
    q, k, v, mask, kind = case.q, case.k, case.v, case.mask, case.kind
    table, mod = _learnable_mod(kind, q.shape[1], q.shape[2], k.shape[2], torch.Generator().manual_seed(case.seed))
    d_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def run(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)] + [table.clone().requires_grad_()]
        out = maskc.compiled_attention(*leaves[:3], mask_mod=mask, score_mod=maskc.score_mod(mod(leaves[3])))
        got = torch.autograd.grad(out, leaves, d_out.to(dtype))
        exact = [t.double().requires_grad_() for t in (q, k, v, table)]
        ref, _ = attention_reference(*exact[:3], mask_mod=mask, score_mod=mod(exact[3]))
        want = torch.autograd.grad(ref, exact, d_out.double())
        for what, g, w in zip(("dq", "dk", "dv", f"d{kind}"), got, want):
            if dtype == torch.float32:
                # a cancelling sum of 10^5 float32 terms is off by ~1e-3
                err = float((g.double() - w).norm() / w.norm().clamp(min=1e-3 * w.numel() ** 0.5))
                assert err <= 1e-2, f"{what} relative error {err:.3e} exceeds 1e-2 (float32 inputs)"
            else:
                assert_gradient_close_to_reference(g, w, dtype, what)

    try:
        run(q.dtype)
    except AssertionError as half:
        note(f"bfloat16 inputs: {half}; checked again from float32 inputs")
        run(torch.float32)
