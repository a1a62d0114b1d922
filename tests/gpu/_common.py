"""What the GPU tests share: hypothesis settings of drawn cases, inputs, the check of the
log-sum-exp, which kernels a call ran, and the Gluon kernels' check."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

import maskc
from maskc.runtime import plan as plans
from maskc.testing import assert_close_to_reference, assert_gradient_close_to_reference, attention_reference

HALF = (torch.bfloat16, torch.float16)


def drawn(examples: int) -> settings:
    """Hypothesis settings of a drawn GPU test: `examples` cases, the same ones every run
    (derandomized), no shrinking (each case compiles kernels: seconds), no deadline."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def lane_sample(values, keep, ids=None) -> list:
    """`values` as pytest parameters (a tuple is several arguments), those for which
    keep(index, value) is false marked slow: the lane runs the sample, `-m slow` the rest. A
    predicate rather than tests/_lanes.py's names: the GPU sweeps keep combinations (a case at
    one shape), each of which compiles its own kernels."""
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=ids(v) if ids else None,
                         marks=() if keep(i, v) else pytest.mark.slow) for i, v in enumerate(values)]


def examples(lane: int, slow: int) -> pytest.MarkDecorator:
    """A parameter `examples`: `lane` drawn cases in the lane, `slow` more under -m slow."""
    return pytest.mark.parametrize("examples", [lane, pytest.param(slow, marks=pytest.mark.slow)])


def randn(shape, dtype, generator: torch.Generator) -> torch.Tensor:
    """Standard normal values drawn on the CPU from `generator`, as `dtype` on the GPU."""
    return torch.randn(shape, generator=generator).to(dtype=dtype, device="cuda")


def name(mod) -> str:
    return "-" if mod is None else mod.__name__


def assert_lse_close(lse, ref_lse) -> None:
    """The same rows keep no key (lse -inf), and the others' lse is within float32's tolerance."""
    finite = torch.isfinite(ref_lse)
    got = torch.isfinite(lse)
    assert torch.equal(got, finite), \
        f"rows with no kept key differ (lse -inf) at {(got != finite).nonzero()[:5].tolist()}"
    assert_close_to_reference(lse[finite], ref_lse[finite], torch.float32, what="lse")


def ran(key: str) -> bool:
    """Whether a plan made since plans.PLANS was last cleared launched the kernel `key` (the Gluon
    kernels: "hfwd", "hbwd", "hbwd+dq")."""
    return any(key in p.launches for p in plans.PLANS.values())


def check_gluon(q, k, v, mask, score) -> None:
    """Under MASKC_GLUON=always: the Gluon forward and dK/dV kernel (computing dQ: no captured
    tensor needs a gradient) ran, out keeps q's memory order, and out, lse, dq, dk and dv are
    within the dtype's tolerance of the float64 reference."""
    kwargs = dict(mask_mod=mask, score_mod=score, enable_gqa=q.shape[1] != k.shape[1])
    plans.PLANS.clear()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_reference(*exact, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = maskc.compiled_attention(*leaves, return_lse=True, **kwargs)
        d_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, d_out)
    said = "; ".join(str(w.message) for w in caught if "Gluon" in str(w.message))
    assert ran("hfwd"), f"the Gluon forward did not run{': ' + said if said else ''}"
    assert ran("hbwd") or ran("hbwd+dq"), f"the Gluon dK/dV kernel did not run{': ' + said if said else ''}"
    assert ran("hbwd+dq"), "the Gluon dK/dV kernel did not compute dQ"
    # out comes back in q's memory order, as torch's does (the copy engine stores it there)
    assert out.stride() == q.stride(), f"out strides {out.stride()}, q's {q.stride()}"
    assert_close_to_reference(out, ref, q.dtype)
    assert_lse_close(lse, ref_lse)
    for what, g, w in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, exact, d_out.double())):
        assert_gradient_close_to_reference(g, w, q.dtype, what)
