"""The Triton-language kernels compiled on CUDA (MASKC_GLUON=0) against the float64 reference.

Forward: the default tiles through tensor descriptors and through pointers, and every other
tile config autotuning may choose; backward: dq, dk and dv through both load paths. Named cases
run on shapes the benchmarks never use (lengths that are not tile multiples, head dims that are
not powers of two, GQA, Dv != D), then hypothesis draws masks, score mods and shapes
(maskc.testing.strategies: lengths up to 700, head dims 16-256, bf16 and fp16).

Descriptors are used however small the problem (DESCRIPTOR_MIN_PAIRS = 0). Each named call runs
twice, the second time on copies: Triton's entry point, then the direct launch
(runtime/launch.py) binding new pointers.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, note

import maskc
from maskc import masks, scores
from maskc.runtime import launch
from maskc.runtime import plan as plans
from maskc.runtime.tiles import forward_candidates, use_config
from maskc.testing import assert_close_to_reference, assert_gradient_close_to_reference, attention_reference
from maskc.testing.strategies import attention_inputs

from ._common import HALF, assert_lse_close, drawn, examples, lane_sample, randn

# name: (B, Hq, Hkv, Lq, Lkv, D, Dv, dtype)
SHAPES = {
    "B2-H4-1000x777-D64": (2, 4, 4, 1000, 777, 64, 64, torch.bfloat16),
    "B1-GQA8:2-333x1029-D128-fp16": (1, 8, 2, 333, 1029, 128, 128, torch.float16),
    "B2-GQA2:1-257x257-D72-Dv40": (2, 2, 1, 257, 257, 72, 40, torch.bfloat16),
    "B1-H2-64x4096-D128-Dv64-fp16": (1, 2, 2, 64, 4096, 128, 64, torch.float16),
}


def late_keys(score, b, h, q_idx, kv_idx):
    # a split score mod (codegen/separable.py) whose first kv tiles are -inf in every row
    return score + torch.where(kv_idx >= 40, 0.0, float("-inf"))


def _documents(Lq, Lkv, H):
    ids = torch.randint(0, 4, (max(Lq, Lkv),), generator=torch.Generator().manual_seed(0)).sort().values
    return masks.document(ids.cuda(), causal=True), None


# name: (Lq, Lkv, Hq) -> (mask_mod, score_mod), built in the test (captured tensors on the GPU)
CASES = {
    "no mask": lambda Lq, Lkv, H: (None, None),
    "causal": lambda Lq, Lkv, H: (masks.causal, None),
    "sliding 100": lambda Lq, Lkv, H: (masks.sliding_window(100), None),
    "document": _documents,
    "ALiBi causal": lambda Lq, Lkv, H: (masks.causal, scores.alibi(scores.alibi_slopes(H).cuda())),
    "softcap": lambda Lq, Lkv, H: (None, scores.softcap(20.0)),
    "late keys": lambda Lq, Lkv, H: (masks.causal, late_keys),
}


@pytest.fixture(autouse=True)
def _descriptors_everywhere(triton_kernels, monkeypatch):
    monkeypatch.setattr(launch, "DESCRIPTOR_MIN_PAIRS", 0)
    plans.PLANS.clear()  # plans made before decided their load path under the default threshold


def _problem(shape: str, case: str):
    B, Hq, Hkv, Lq, Lkv, D, Dv, dtype = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    q, k, v = (randn(s, dtype, g) for s in ((B, Hq, Lq, D), (B, Hkv, Lkv, D), (B, Hkv, Lkv, Dv)))
    mask, score = CASES[case](Lq, Lkv, Hq)
    return q, k, v, dict(mask_mod=mask, score_mod=score, enable_gqa=Hq != Hkv)


def _check_forward(q, k, v, kwargs, config, descriptors: bool, twice: bool = True) -> None:
    ref, ref_lse = attention_reference(q, k, v, **kwargs)
    runs = ((q, k, v), tuple(t.clone() for t in (q, k, v))) if twice else ((q, k, v),)
    for inputs in runs:
        with use_config(forward=config, descriptors=descriptors):
            out, lse = maskc.compiled_attention(*inputs, return_lse=True, **kwargs)
        assert_close_to_reference(out, ref, q.dtype)
        assert_lse_close(lse, ref_lse)


def _check_backward(q, k, v, kwargs, descriptors: bool, twice: bool = True) -> None:
    d_out = torch.randn(*q.shape[:3], v.shape[3], device="cuda", dtype=q.dtype)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_reference(*exact, **kwargs)[0], exact, d_out.double())
    for _ in range(2 if twice else 1):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with use_config(descriptors=descriptors):
            out = maskc.compiled_attention(*leaves, **kwargs)
        for what, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, d_out), want):
            assert_gradient_close_to_reference(g, w, q.dtype, what)


def _named(case, shape, descriptors):
    return f"{case}-{shape}-{'tma' if descriptors else 'pointers'}"


# the lane: each case at one shape (its kernels compile per head dim and dtype: seconds), through
# descriptors, and the first three through pointers too
FORWARD = lane_sample([(c, s, d) for c in CASES for s in SHAPES for d in (True, False)],
                      lambda i, v: list(SHAPES).index(v[1]) == list(CASES).index(v[0]) % len(SHAPES)
                      and (v[2] or list(CASES).index(v[0]) < 3), ids=lambda v: _named(*v))


@pytest.mark.parametrize("case, shape, descriptors", FORWARD)
def test_forward(case, shape, descriptors):
    q, k, v, kwargs = _problem(shape, case)
    _check_forward(q, k, v, kwargs, forward_candidates(q.shape[3], "cuda")[0], descriptors)


# every tile config autotuning may choose beside the default, at the shapes of its head dim; the
# lane takes each config with one case
CANDIDATES = lane_sample([(shape, config, case) for shape in ("B2-H4-1000x777-D64", "B1-GQA8:2-333x1029-D128-fp16")
                          for config in forward_candidates(SHAPES[shape][5], "cuda")[1:]
                          for case in ("no mask", "document", "late keys")],
                         lambda i, v: i % 3 == i // 3, ids=lambda v: f"{v[0]}-tiles{tuple(v[1])}-{v[2]}")


@pytest.mark.parametrize("shape, config, case", CANDIDATES)
def test_forward_tile_candidates(shape, config, case):
    q, k, v, kwargs = _problem(shape, case)
    _check_forward(q, k, v, kwargs, config, descriptors=True, twice=False)


# pointers on one shape: the backward's load paths differ in q, k, v and dO alone; the lane takes
# each case at one shape through descriptors, and causal through pointers
BACKWARD = lane_sample([(c, s, True) for c in CASES for s in list(SHAPES)[:3]]
                       + [(c, "B2-H4-1000x777-D64", False) for c in CASES],
                       lambda i, v: (v[2] and list(SHAPES).index(v[1]) == list(CASES).index(v[0]) % 3)
                       or (not v[2] and v[0] == "causal"), ids=lambda v: _named(*v))


@pytest.mark.parametrize("case, shape, descriptors", BACKWARD)
def test_backward(case, shape, descriptors):
    q, k, v, kwargs = _problem(shape, case)
    _check_backward(q, k, v, kwargs, descriptors)


PROBLEMS = attention_inputs(max_len=700, dtypes=HALF, head_dims=(64, 128, 16, 32, 72, 96, 256), device="cuda")


@examples(3, 12)
def test_forward_drawn(examples):
    """Each tile candidate through descriptors, the default through pointers too."""
    @drawn(examples)
    @given(PROBLEMS)
    def forward(inputs):
        q, k, v = inputs.q, inputs.k, inputs.v
        candidates = forward_candidates(q.shape[3], "cuda")
        for config, descriptors in [(c, True) for c in candidates] + [(candidates[0], False)]:
            note(f"tiles {tuple(config)}, descriptors {descriptors}")
            _check_forward(q, k, v, inputs.kwargs(), config, descriptors, twice=False)

    forward()


@examples(2, 12)
def test_backward_drawn(examples):
    @drawn(examples)
    @given(PROBLEMS)
    def backward(inputs):
        for descriptors in (True, False):
            note(f"descriptors {descriptors}")
            _check_backward(inputs.q, inputs.k, inputs.v, inputs.kwargs(), descriptors, twice=False)

    backward()
