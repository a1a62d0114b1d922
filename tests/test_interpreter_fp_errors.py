"""The inf and NaN that Triton's interpreter reports while running maskc's kernels lie in lanes
the kernels drop.

The kernels compute whole tiles. Lanes past q_len or kv_len hold zero rows of q, k and v, and a
score_mod still runs there: its score can be large (exp2 overflows; in float16 a probability
past 65504 casts to inf; then inf · 0 is NaN), or 0 where d(score_mod)/d(score) is 1/0. A
tl.where or a masked store drops those lanes, and maskc's CPU path keeps numpy from warning
about them (maskc/runtime/kernel.py, _FP_ERRORS). Each case below makes one kind happen; the
test records every floating-point error numpy raises inside a kernel, finds the lanes where the
operation made a new inf or NaN, places them by the kernel's q_idx and kv_idx, and checks that
all lie past the lengths, with out and the gradients finite and matching the float64 reference.
"""
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import triton.runtime.interpreter as interpreter

import maskc
from _inputs import qkv, randn
from maskc import scores
from maskc.runtime import kernel as kernel_module
from maskc.testing import assert_close_to_reference, assert_gradient_close_to_reference, attention_reference

# The interpreter's methods that run a kernel's floating-point arithmetic in numpy, and how to
# run each again on the same operands (errors ignored) to see which lanes went non-finite.
_REPLAY = {
    "binary_op": lambda f: ((f["lhs"].data, f["rhs"].data), f["op"](f["lhs"].data, f["rhs"].data)),
    "unary_op": lambda f: ((f["arg"].data,), f["op"](f["arg"].data)),
    "cast_impl": lambda f: ((f["src"].data,), f["src"].data.astype(interpreter._get_np_dtype(f["dst_type"]))),
    # a product's row or column is new where the accumulator was finite
    "create_dot": lambda f: ((f["d"].data,), np.matmul(f["a_data"], f["b_data"], dtype=f["d"].data.dtype)
                             + f["d"].data),
}


def _value(x):
    return np.asarray(getattr(x, "handle", x).data)


@dataclass
class _Recorder:
    """numpy's error callback: each error inside a generated kernel, as (kernel function, line,
    interpreter method, error) with the number of new non-finite lanes past the lengths and kept."""
    errors: list = field(default_factory=list)

    def __call__(self, kind: str, flag: int) -> None:
        frame, op, kernel_frames = sys._getframe(1), None, []
        while frame is not None:
            if op is None and frame.f_code.co_name in _REPLAY and frame.f_code.co_filename == interpreter.__file__:
                op = frame
            if frame.f_globals.get("__name__", "").startswith("maskc_generated."):
                kernel_frames.append(frame)
            frame = frame.f_back
        if not kernel_frames:
            return
        where = (kernel_frames[0].f_code.co_name, kernel_frames[0].f_lineno, op and op.f_code.co_name, kind)
        padded, kept = self._place(op, kernel_frames)
        self.errors.append((*where, padded, kept))

    @staticmethod
    def _place(op, kernel_frames) -> tuple[int, int]:
        """New non-finite lanes past the lengths and within them; (0, -1) where they cannot be placed."""
        if op is None:
            return 0, -1
        with np.errstate(all="ignore"):
            inputs, out = _REPLAY[op.f_code.co_name](op.f_locals)
        # new: a NaN from operands without one (inf · 0 too), an inf from finite operands
        nan_in, finite_in = np.zeros(out.shape, bool), np.ones(out.shape, bool)
        for x in inputs:
            if x.dtype.kind == "f":
                nan_in |= np.broadcast_to(np.isnan(x), out.shape)
                finite_in &= np.broadcast_to(np.isfinite(x), out.shape)
        made = (np.isnan(out) & ~nan_in) | (np.isinf(out) & finite_in)
        if not made.any():
            return 0, 0
        lengths = {name: int(_value(f.f_locals[name]).reshape(-1)[0])
                   for f in kernel_frames for name in ("q_len", "kv_len") if name in f.f_locals}
        head_dims = {f.f_locals[name] for f in kernel_frames for name in ("D_PAD", "DV_PAD") if name in f.f_locals}
        # q_idx and kv_idx are [rows, 1] or [1, cols]: an axis of the operation's tile as long as
        # one of them is an axis of positions, unless the head dim is as long (then unplaced)
        past, placed = np.zeros(out.shape, bool), False
        for name, length in (("q_idx", lengths.get("q_len")), ("kv_idx", lengths.get("kv_len"))):
            index = next((_value(f.f_locals[name]) for f in kernel_frames if name in f.f_locals), None)
            if index is None or length is None or index.ndim != 2 or out.ndim != 2:
                continue
            for axis in (0, 1):
                if index.shape[axis] == out.shape[axis] and index.shape[1 - axis] == 1:
                    if out.shape[axis] in head_dims:
                        return 0, -1
                    past |= np.broadcast_to(index >= length, out.shape)
                    placed = True
        if not placed:
            return 0, -1
        return int((made & past).sum()), int((made & ~past).sum())


def _assert_past_the_lengths(errors):
    unplaced = [e for e in errors if e[-1] < 0]
    assert not unplaced, (f"errors the test cannot place in a tile (with tiles as long as the head dim, "
                          f"take another head dim): {unplaced[:5]}")
    kept = [e for e in errors if e[-1] > 0]
    assert not kept, f"inf or NaN made within the lengths (function, line, op, error, past, kept): {kept[:5]}"


def _run(q, k, v, d_out, **mods):
    out = maskc.compiled_attention(q, k, v, **mods)
    return out, torch.autograd.grad(out, (q, k, v), d_out)


def _recorded(monkeypatch, q, k, v, d_out, **mods):
    recorder = _Recorder()
    monkeypatch.setattr(kernel_module, "_FP_ERRORS", {"over": "call", "invalid": "call", "divide": "call",
                                                      "call": recorder})
    return _run(q, k, v, d_out, **mods), recorder.errors


CASES = {
    # fuzz seed 2001's kind: a per-key table times a distance; rows past q_len (lse -inf, read as
    # 0) reach scores past 88, exp2 overflows in dQ and inf · (dO·V − Delta = 0) is NaN
    "exp2 overflow past q_len": dict(dtype=torch.float32, Lq=65, Lkv=15, score_mod=lambda: _decay(randn(80, seed=3))),
    # a steep ALiBi without a mask: keys past kv_len score above the row's LSE by up to 19, a
    # float16 probability past 65504 casts to inf in dK/dV, and the products with dO's zeros are NaN
    "float16 cast overflow past kv_len": dict(dtype=torch.float16, Lq=5, Lkv=43,
                                              score_mod=lambda: scores.alibi(torch.tensor([0.9]))),
    # scores of 0 past the lengths: log(0) is -inf, its derivative 1/0, and inf · sign(0) NaN
    "1/0 past the lengths": dict(dtype=torch.float64, Lq=37, Lkv=100,
                                 score_mod=lambda: (lambda s, b, h, q_idx, kv_idx: torch.log(torch.abs(s)))),
}


def _decay(table):
    def decay(score, b, h, q_idx, kv_idx):
        return score - table[kv_idx] * torch.abs(q_idx - kv_idx)
    return decay


@pytest.mark.parametrize("case", CASES)
def test_non_finite_values_stay_past_the_lengths(case, monkeypatch):
    spec = CASES[case]
    q, k, v, d_out = qkv(Hq=1, Lq=spec["Lq"], Lkv=spec["Lkv"], D=16, dtype=spec["dtype"], requires_grad=True,
                         grad_out=True)
    mods = {"score_mod": spec["score_mod"]()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's warnings about them are silenced
        plain = _run(q, k, v, d_out, **mods)
    (out, grads), errors = _recorded(monkeypatch, q, k, v, d_out, **mods)
    assert errors, f"{case}: no floating-point error in the interpreter, so this case checks nothing"
    _assert_past_the_lengths(errors)

    assert torch.equal(out, plain[0]) and all(torch.equal(a, b) for a, b in zip(grads, plain[1]))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*exact, **mods)[0]
    want = torch.autograd.grad(ref, exact, d_out.double())
    assert out.isfinite().all() and all(g.isfinite().all() for g in grads)
    assert_close_to_reference(out.detach(), ref.detach(), q.dtype)
    for what, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert_gradient_close_to_reference(got, w, q.dtype, what)


def test_an_inf_within_the_lengths_is_caught(monkeypatch):
    # the check above is not vacuous: an exp2 made to overflow at lane [0, 0] of the forward's one
    # tile, pair (0, 0), which no mask drops, is placed within the lengths; the output it reaches is NaN
    exp2 = interpreter.InterpreterBuilder.create_exp2

    def overflowing_at_the_origin(builder, arg):
        if arg.data.ndim == 2:
            arg.data[0, 0] = 1000.0
        return exp2(builder, arg)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_exp2", overflowing_at_the_origin)
    # requiring grad keeps these 20 rows off the split-KV decoding kernel
    q, k, v = qkv(Hq=1, Lq=20, Lkv=20, D=16, requires_grad=True)
    recorder = _Recorder()
    monkeypatch.setattr(kernel_module, "_FP_ERRORS", {"over": "call", "invalid": "call", "call": recorder})
    out = maskc.compiled_attention(q, k, v)
    assert out.isnan().any()
    with pytest.raises(AssertionError, match="within the lengths"):
        _assert_past_the_lengths(recorder.errors)
