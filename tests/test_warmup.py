"""maskc.warmup and the kernel choice that does not depend on timing (maskc/runtime/warmup.py,
maskc/runtime/hopper.py).

On CPU tensors warmup plans the call and renders its kernels without interpreting any, and the
call after it renders nothing. A problem's Gluon kernel (faked here: Triton's interpreter runs
no Gluon) is compiled before its first call returns, so the first call and every later one run
the same kernel and give the same bits, whether the compile is slow or fails.
tests/gpu/test_first_call.py checks the same on a Hopper GPU, across processes too.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import maskc
from _inputs import qkv
from maskc import masks
from maskc.errors import MaskTraceError
from maskc.runtime import hopper, kernel
from maskc.testing import assert_close_to_reference, attention_reference, decode_reference


def _files(directory) -> set[str]:
    return {p.name for p in directory.glob("*.py")}


class _NoInterpreting:
    """In place of the lock every interpreted launch takes (maskc/runtime/kernel.py)."""

    def __enter__(self):
        raise AssertionError("warmup interpreted a kernel")

    def __exit__(self, *exc):
        return False


# what the call is: its arguments beyond q, k, v and the kinds of kernel file it renders
CALLS = {
    "forward": (dict(), {"fwd"}),
    "forward and backward": (dict(backward=True), {"fwd", "bwd"}),
    "kv_lens": (dict(kv_lens=True), {"dec"}),
    "few rows": (dict(rows=1), {"dec"}),
}


@pytest.mark.parametrize("call", CALLS)
def test_warmup_renders_the_kernels_a_call_runs_and_interprets_none(call, fresh_caches, tmp_path, monkeypatch):
    from maskc.runtime.launch import LaunchPlan
    given, kinds = CALLS[call]
    monkeypatch.setenv("MASKC_CACHE_DIR", str(tmp_path))
    q, k, v = qkv(Lq=given.get("rows", 100), Lkv=300)
    lens = torch.tensor([250]) if given.get("kv_lens") else None
    with monkeypatch.context() as m:
        m.setattr(kernel, "_INTERPRETER", _NoInterpreting())
        start = time.perf_counter()
        summary = maskc.warmup(q, k, v, masks.causal, kv_lens=lens, backward=given.get("backward", False))
        assert time.perf_counter() - start < 30  # rendering only: interpreting the backward takes longer
    rendered = _files(tmp_path)
    assert {name.split("_")[0] for name in rendered} == kinds
    assert all(name.split(" of ")[1] in rendered for name in summary.kernels)
    assert summary.seconds >= sum(summary.kernels.values()) >= 0
    # the call launches those kernels and renders nothing more, and its result is right
    launched, launch = set(), LaunchPlan.__call__

    def recorded(self, *values):
        launched.add(self._what)
        return launch(self, *values)
    monkeypatch.setattr(LaunchPlan, "__call__", recorded)
    misses = maskc.runtime.cache_info().misses
    if given.get("backward"):
        q, k, v, d_out = qkv(Lq=100, Lkv=300, requires_grad=True, grad_out=True)
        out = maskc.compiled_attention(q, k, v, masks.causal)
        out.backward(d_out)
        want = attention_reference(q, k, v, masks.causal)[0]
        for got, expected in zip((out, q.grad, k.grad, v.grad),
                                 (want, *torch.autograd.grad(want, (q, k, v), d_out.double()))):
            assert_close_to_reference(got, expected)
    else:
        out = maskc.compiled_attention(q, k, v, masks.causal, kv_lens=lens)
        want = attention_reference(q, k, v, masks.causal) if lens is None else decode_reference(q, k, v, lens,
                                                                                                 masks.causal)
        assert_close_to_reference(out, want[0])
    assert maskc.runtime.cache_info().misses == misses
    assert _files(tmp_path) == rendered
    assert launched == set(summary.kernels)


def test_warmup_takes_empty_tensors_and_leaves_the_callers_alone(fresh_caches):
    # q, k and v are read for their shapes, dtypes, layouts and device only; nothing gets a gradient
    q, k, v = (torch.empty(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    maskc.warmup(q, k, v, masks.sliding_window(8), backward=True)
    assert all(t.grad is None for t in (q, k, v))


def _python_if(b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:
        return True
    return False


BAD = {
    "three dimensions": (lambda q, k, v: (q[0], k, v), {}),
    "dtypes differ": (lambda q, k, v: (q, k.double(), v), {}),
    "heads without enable_gqa": (lambda q, k, v: (q, k[:, :1], v[:, :1]), {}),
    "python if": (lambda q, k, v: (q, k, v), dict(mask_mod=_python_if)),
    "block map of other lengths": (lambda q, k, v: (q, k, v), dict(block_map=True)),
    "kv_lens with gradients": (lambda q, k, v: (q, k, v), dict(kv_lens=torch.tensor([40]), backward=True)),
}


@pytest.mark.parametrize("case", BAD)
def test_warmups_errors_are_the_calls(case, fresh_caches):
    inputs, given = BAD[case]
    given = dict(given)
    backward = given.pop("backward", False)
    if given.get("block_map"):
        given["block_map"] = maskc.block_map(masks.causal, 80, 80)
    q, k, v = inputs(*qkv())
    with pytest.raises(Exception) as called:
        maskc.compiled_attention(q.requires_grad_(backward), k, v, **given)
    with pytest.raises(Exception) as warmed:
        maskc.warmup(q.detach(), k, v, **given, backward=backward)
    assert (type(warmed.value), str(warmed.value)) == (type(called.value), str(called.value))
    assert isinstance(called.value, (ValueError, TypeError, NotImplementedError, MaskTraceError))


# -- the kernel choice: made at the first call, fixed after it -----------------------------------------
class _Gluon:
    """Stands in for the Gluon forward's launch plan on the CPU: its compile takes `seconds` and
    is counted, and a compiled kernel is not compiled again, as in Triton's cache; a launch is
    counted and writes the float64 reference, whose bits differ from the Triton-language
    kernel's. `error` is raised by the compile, or by the launch where `fails` says so."""

    def __init__(self, seconds: float = 0.0, error: Exception | None = None, fails: str = "compile"):
        self.seconds, self.error, self.fails, self.compiled, self.launched = seconds, error, fails, 0, 0
        self.done = threading.Event()

    def warmup(self, q, k, v, out, lse):
        if not self.done.is_set():
            self.compiled += 1
            time.sleep(self.seconds)
            self.done.set()
        if self.error is not None and self.fails == "compile":
            raise self.error

    def __call__(self, q, k, v, out, lse):
        if self.error is not None and self.fails == "launch":
            raise self.error
        self.launched += 1
        want, want_lse = attention_reference(q, k, v, masks.causal)
        out.copy_(want)
        lse.copy_(want_lse)


@pytest.fixture
def gluon(monkeypatch, fresh_caches):
    """A _Gluon in place of the Gluon forward wherever it can run (the default MASKC_GLUON)."""
    from maskc.runtime import launch
    fake = _Gluon()
    monkeypatch.delenv("MASKC_GLUON", raising=False)
    monkeypatch.setattr(hopper, "_failures", {})
    monkeypatch.setattr(hopper, "runs", lambda problem: "hfwd" not in hopper._failures)
    monkeypatch.setattr(hopper, "descriptors", lambda q, k, v, out, config: [q, k, v, out])
    monkeypatch.setattr(launch, "_hopper_plan", lambda problem: fake)
    return fake


def test_a_slow_gluon_compile_serves_the_first_call_and_every_later_one(gluon):
    gluon.seconds = 0.3
    q, k, v = qkv(Lq=100)
    first = maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
    assert gluon.done.wait(10)  # however long the compile takes, the later calls come after it
    later = [maskc.compiled_attention(q, k, v, mask_mod=masks.causal) for _ in range(2)]
    assert (gluon.compiled, gluon.launched) == (1, 3)
    assert all(torch.equal(first, out) for out in later)


@pytest.mark.parametrize("fails, when", [("compile", "to compile"), ("launch", "on its first launch")])
def test_a_failed_gluon_kernel_is_known_at_the_first_call_and_stays(gluon, fails, when):
    gluon.error, gluon.fails = RuntimeError("ptxas fatal: out of registers"), fails
    q, k, v = qkv(Lq=100)
    with pytest.warns(RuntimeWarning, match=f"Gluon forward for Hopper failed {when}.*out of registers"):
        first = maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
    assert gluon.done.wait(10)
    later = maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
    assert (gluon.compiled, gluon.launched) == (1, 0)
    assert torch.equal(first, later)
    assert_close_to_reference(first, attention_reference(q, k, v, masks.causal)[0])


def test_warmup_compiles_the_gluon_kernel_without_launching_it(gluon):
    q, k, v = qkv(Lq=100)
    summary = maskc.warmup(q, k, v, masks.causal)
    assert (gluon.compiled, gluon.launched) == (1, 0)
    assert "attention_fwd" not in {name.split(" of ")[0] for name in summary.kernels}  # the Gluon kernel serves
    maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
    assert (gluon.compiled, gluon.launched) == (1, 1)
