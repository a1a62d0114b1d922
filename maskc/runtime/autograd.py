"""The autograd Functions around the launches: attention, and attention with no pairs."""
from __future__ import annotations

import torch

from maskc.errors import MaskcError
from maskc.runtime import launch
from maskc.runtime.dropout import Dropout
from maskc.runtime.plan import Problem


class AttentionFunction(torch.autograd.Function):
    """Attention differentiable in q, k, v and the captured tensors problem.grad_tensors, which
    follow `problem` and `dropout` (the call's, or None) as inputs so that autograd hands their
    gradients back. The backward regenerates the dropout's keep-mask from its seed."""

    @staticmethod
    def forward(ctx, q, k, v, problem: Problem, dropout: Dropout | None, *captured):
        out, lse = launch.forward(q, k, v, problem, dropout)
        # the seed is saved with out and lse, so that a recomputed forward (activation
        # checkpointing) hands the backward its own seed with its own out and lse
        ctx.save_for_backward(q, k, v, out, lse, *((dropout.seed,) if dropout else ()))
        ctx.problem, ctx.keep_min = problem, dropout.keep_min if dropout else None
        # an output the loss does not use gets None, not a tensor of zeros: lse mostly
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        refuse_second_derivatives()
        q, k, v, out, lse, *seed = ctx.saved_tensors
        dropout = Dropout(seed[0], ctx.keep_min) if seed else None
        dq, dk, dv, *captured = launch.backward(q, k, v, out, lse, d_out, d_lse, ctx.problem, dropout=dropout)
        return dq, dk, dv, None, None, *captured


class NoPairs(torch.autograd.Function):
    """Attention with no (q, kv) pair (a length, B or H is 0): out is 0 and lse -inf whatever
    q, k and v hold, so every gradient is zero, as SDPA's."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        return launch.no_pairs(q, v)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        refuse_second_derivatives()
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs)


def refuse_second_derivatives() -> None:
    """The backward's gradients come from kernels with no derivative of their own: where the
    backward runs with create_graph=True (grad mode on inside it), the gradients would come back
    as constants and a loss built on them (a gradient penalty) would lose its attention terms
    silently. torch's once_differentiable does not stop that: its error node hangs off copies."""
    if torch.is_grad_enabled():
        raise MaskcError("maskc's attention is differentiable once: its backward ran with create_graph=True, "
                         "whose gradients would not differentiate further; call backward or autograd.grad "
                         "without create_graph, or use scaled_dot_product_attention where second derivatives "
                         "are needed")


__all__ = ["AttentionFunction", "NoPairs", "refuse_second_derivatives"]
