"""The backward pass: autograd Function around the forward and the two backward kernels.

delta = rowsum(dO * O) is one torch reduction; dQ runs over the forward block map, dK/dV
over its transpose, summed over the query heads of a GQA group inside the kernel.
"""
from __future__ import annotations

import torch

from maskc.runtime.attention import Problem, dot_precision, forward
from maskc.runtime.configs import padded
from maskc.runtime.kernel import kernel_for


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, problem: Problem):
        out, lse = forward(q, k, v, problem)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(q, k, v, out, lse, d_out, ctx.problem)
        return dq, dk, dv, None


def backward(q, k, v, out, lse, d_out, problem: Problem):
    B, Hq, Lq, D = q.shape
    Hkv, Lkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    fwd_spec, bm = problem.kernel.spec, problem.block_map
    kernel = kernel_for("bwd", problem.mask, problem.score, q.dtype, D, Dv, problem.gqa,
                        (fwd_spec.block_m, fwd_spec.block_n), bm.device)
    spec = kernel.spec
    d_out = d_out.contiguous()
    delta = (d_out.float() * out.float()).sum(-1)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    shared = dict(HEAD_DIM=D, HEAD_DIM_V=Dv, D_PAD=padded(D), DV_PAD=padded(Dv), BLOCK_M=spec.block_m,
                  BLOCK_N=spec.block_n, DOT_PRECISION=dot_precision(q.dtype), num_warps=spec.num_warps,
                  num_stages=spec.num_stages)
    sizes = (Hq, Hq // Hkv, Lq, Lkv, problem.scale)
    row_b, row_h = bm.kernel_rows(B, Hq)
    kernel.function(problem.interpret, "attention_bwd_dq")[(-(-Lq // spec.block_m), B * Hq)](
        q, k, v, d_out, dq, lse, delta,
        *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *dq.stride(), *sizes,
        bm.full_offsets, bm.full_runs, bm.partial_offsets, bm.partial_runs, row_b, row_h, *problem.extra,
        EVEN=Lkv % spec.block_n == 0, **shared)
    bt = bm.transposed
    row_b, row_h = bt.kernel_rows(B, Hq)
    kernel.function(problem.interpret, "attention_bwd_dkdv")[(-(-Lkv // spec.block_n), B * Hkv)](
        q, k, v, d_out, dk, dv, lse, delta,
        *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *dk.stride(), *dv.stride(), *sizes,
        bt.full_offsets, bt.full_runs, bt.partial_offsets, bt.partial_runs, row_b, row_h, *problem.extra,
        EVEN=Lq % spec.block_m == 0, **shared)
    return dq, dk, dv
