"""torch.autograd.Function inside a score_mod: maskc runs its forward and takes the score's
gradient from its own backward, as torch (and FlexAttention) do, also where that backward is
not the forward's derivative (a straight-through estimator, a scaled gradient).

The reference applies the same Function to the dense float64 score matrix, so torch's autograd
calls its real backward (FlexAttention has no backward on CPU).
"""
import math

import pytest
import sympy
import torch

import maskc
from _inputs import qkv, randn
from maskc import MaskTraceError
from maskc.codegen.render import score_derivative
from maskc.trace.symbols import SCORE

H, L, D = 2, 40, 16


class Tripled(torch.autograd.Function):
    """Doubles the score; its backward triples the gradient."""

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class Doubled(torch.autograd.Function):
    """The same forward as Tripled, with the true derivative as backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class StraightThroughClamp(torch.autograd.Function):
    """clamp to [-1, 1], whose backward passes the gradient everywhere."""

    @staticmethod
    def forward(ctx, x):
        return torch.clamp(x, -1.0, 1.0)

    @staticmethod
    def backward(ctx, grad):
        return grad


class SoftGate(torch.autograd.Function):
    """x * gate forward; backward scales the score's gradient by its own choice of the saved
    input and gives the captured gate (an input requiring grad) twice its true gradient."""

    @staticmethod
    def forward(ctx, x, gate):
        ctx.save_for_backward(x, gate)
        return x * gate

    @staticmethod
    def backward(ctx, grad):
        x, gate = ctx.saved_tensors
        return grad * gate * torch.sigmoid(x), grad * x * 2


class Identity(torch.autograd.Function):
    """Returns its input itself (no new value in the forward); the backward halves the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad / 2


class SquaredGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * grad


def tripled(score, b, h, q_idx, kv_idx):
    return Tripled.apply(score)


def doubled(score, b, h, q_idx, kv_idx):
    return Doubled.apply(score)


def clamped(score, b, h, q_idx, kv_idx):
    return StraightThroughClamp.apply(score * 2) + (q_idx - kv_idx) / 16


def _attend(q, k, v, score_fn):
    """Float64 attention with `score_fn` applied to the whole score matrix."""
    scores = score_fn(torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1]))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, dim=-1), v)


def _positions():
    return torch.arange(L).view(-1, 1), torch.arange(L).view(1, -1)


def _check(score_mod, score_fn, extra=()):
    """maskc's output and gradients (of q, k, v and the `extra` captured tensors) against float64
    autograd of `score_fn` on the dense scores."""
    q, k, v, d_out = qkv(Hq=H, Lq=L, D=D, grad_out=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = maskc.compiled_attention(q, k, v, score_mod=score_mod)
    got = torch.autograd.grad(out, (q, k, v, *extra), d_out)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, *extra)]
    ref = _attend(*exact[:3], lambda s: score_fn(s, *exact[3:]))
    want = torch.autograd.grad(ref, exact, d_out.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    for name, g, w in zip(("dq", "dk", "dv", "d gate"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4 * max(1.0, float(w.abs().max())),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_a_backward_that_scales_the_gradient_is_used():
    _check(tripled, Tripled.apply)


def test_a_straight_through_clamp_passes_the_gradient_where_it_clamps():
    q_idx, kv_idx = _positions()
    _check(clamped, lambda s: StraightThroughClamp.apply(s * 2) + (q_idx - kv_idx) / 16)


def test_a_captured_input_requiring_grad_gets_the_gradient_the_backward_gives():
    gate = (1 + randn(H, seed=3).abs()).requires_grad_()

    def gated(score, b, h, q_idx, kv_idx):
        return SoftGate.apply(score, gate[h])

    _check(gated, lambda s, g: SoftGate.apply(s, g.view(1, H, 1, 1).expand_as(s)), extra=(gate,))


def test_the_same_forward_with_another_backward_is_another_kernel():
    # Tripled and Doubled differ only in backward: one signature would share one backward kernel
    assert maskc.score_mod(tripled).signature != maskc.score_mod(doubled).signature
    _check(doubled, Doubled.apply)
    _check(tripled, Tripled.apply)


def test_a_forward_that_returns_its_input_still_uses_the_backward():
    assert score_derivative(maskc.score_mod(lambda s, b, h, q, kv: Identity.apply(s)).expr) == sympy.Rational(1, 2)


def test_a_backward_not_linear_in_the_gradient_is_refused():
    def squared_gradient(score, b, h, q_idx, kv_idx):
        return SquaredGradient.apply(score)

    with pytest.raises(MaskTraceError, match="not linear in the gradient") as info:
        maskc.score_mod(squared_gradient)
    assert "'SquaredGradient'" in str(info.value)


def test_a_whole_captured_tensor_requiring_grad_passed_to_the_function_is_refused():
    bias = randn(H, seed=4).requires_grad_()

    class AddRow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, table, h):
            return x + table[h]

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None

    def whole_table(score, b, h, q_idx, kv_idx):
        return AddRow.apply(score, bias, h)

    with pytest.raises(MaskTraceError, match="requires grad") as info:
        maskc.score_mod(whole_table)
    assert "index the tensor in the mod" in str(info.value)


def test_the_score_derivative_is_the_backward_not_the_forward_derivative():
    assert score_derivative(maskc.score_mod(tripled).expr) == 3
    assert score_derivative(maskc.score_mod(doubled).expr) == 2
    slope = score_derivative(maskc.score_mod(clamped).expr)
    assert slope == 2, slope  # d(2 score) = 2, passed through the clamp whatever the score
    assert SCORE not in slope.free_symbols


class Vanishing(torch.autograd.Function):
    """A forward whose value does not read its input, and a backward that passes the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x * 0

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_forward_that_drops_its_input_still_passes_the_backward_gradient():
    assert score_derivative(maskc.score_mod(lambda s, b, h, q, kv: Vanishing.apply(s) + s).expr) == 2
