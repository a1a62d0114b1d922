"""The backward pass: autograd Function around the forward and the backward kernels.

A preprocess kernel computes Delta = rowsum(dO * O); dQ runs over the block map, dK/dV
over its transpose, summed over the query heads of a GQA group inside the kernel. dQ loads
q, k, v and dO and stores dq through tensor descriptors where the forward would
(maskc/runtime/descriptors.py); dK/dV keeps pointers, which measured faster there.
"""
from __future__ import annotations

import torch

from maskc.runtime.attention import (Problem, cached_block_map, dot_precision, forward, interpreter_safe, no_pairs,
                                     triton_dtype)
from maskc.runtime.configs import BackwardConfig, TileConfig, backward_config, descriptors_enabled, padded
from maskc.runtime.descriptors import descriptors
from maskc.runtime.kernel import kernel_for


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, problem: Problem):
        out, lse = forward(q, k, v, problem)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        # an output the loss does not use gets None, not a tensor of zeros: lse mostly
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(q, k, v, out, lse, d_out, d_lse, ctx.problem)
        return dq, dk, dv, None


class NoPairs(torch.autograd.Function):
    """Attention with no (q, kv) pair (a length, B or H is 0): out is 0 and lse -inf whatever
    q, k and v hold, so every gradient is zero, as SDPA's."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        return no_pairs(q, v)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs)


def backward(q, k, v, out, lse, d_out, d_lse, problem: Problem):
    """dq, dk, dv from the gradients of out and of lse (either may be None: unused)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    device = problem.block_map.device
    config = backward_config(D, device.type, q.element_size())
    if problem.given_block_map:
        tiles = problem.kernel.spec
        same = TileConfig(tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages)
        config = BackwardConfig(same, same)
    kernel = kernel_for("bwd", problem.mask, problem.score, q.dtype, D, Dv, problem.gqa,
                        (config.dq.block_m, config.dq.block_n), device)
    dtype = q.dtype
    d_out = torch.zeros_like(out) if d_out is None else d_out.contiguous()
    q, k, v, out, d_out = interpreter_safe(q, k, v, out, d_out)
    acc = triton_dtype(lse.dtype)
    d_pad, dv_pad = padded(D), padded(Dv)
    delta = torch.empty_like(lse)
    kernel.function(problem.interpret, "attention_bwd_delta")[(-(-Lq // config.dq.block_m), B * Hq)](
        out, d_out, delta, *out.stride(), *d_out.stride(), Hq, Lq, HEAD_DIM_V=Dv, DV_PAD=dv_pad,
        BLOCK_M=config.dq.block_m, ACC=acc)
    if d_lse is not None:
        # dS = P (dP - Delta) + P dlse: the gradient of lse (natural log, as the kernels' P =
        # exp(S - lse)) enters as Delta - dlse. Rows with lse = -inf have P = 0 and get none.
        delta -= d_lse
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    shared = dict(HEAD_DIM=D, HEAD_DIM_V=Dv, D_PAD=d_pad, DV_PAD=dv_pad,
                  DOT_PRECISION=dot_precision(q.dtype), ACC=acc)
    sizes = (Hq, Hq // Hkv, Lq, Lkv, problem.scale)

    dq_map = _map(problem, config.dq, Lq, Lkv, B, Hq)
    row_b, row_h = dq_map.kernel_rows(B, Hq)
    tensors = (q, k, v, d_out, dq)
    tma = None
    # where the forward's launch found descriptors worth their host cost (DESCRIPTOR_MIN_PAIRS).
    # dK/dV measured 5-12% slower with descriptors on an H100 (dQ 5-18% faster), so only dQ
    # takes them (benchmarks/NOTES.md).
    if problem.launch.descriptors and descriptors_enabled():
        m, n = config.dq.block_m, config.dq.block_n
        blocks = ((1, 1, m, d_pad), (1, 1, n, d_pad), (1, 1, n, dv_pad), (1, 1, m, dv_pad), (1, 1, m, d_pad))
        tma = descriptors(list(zip(tensors, blocks)))
    kernel.function(problem.interpret, "attention_bwd_dq")[(-(-Lq // config.dq.block_m), B * Hq)](
        *(tma or tensors), lse, delta,
        *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *dq.stride(), *sizes,
        dq_map.full_offsets, dq_map.full_runs, dq_map.partial_offsets, dq_map.partial_runs, row_b, row_h,
        *problem.extra, EVEN=Lkv % config.dq.block_n == 0, TMA=tma is not None, **shared, **_launch(config.dq))

    kv_map = _map(problem, config.dkdv, Lq, Lkv, B, Hq).transposed
    row_b, row_h = kv_map.kernel_rows(B, Hq)
    kernel.function(problem.interpret, "attention_bwd_dkdv")[(-(-Lkv // config.dkdv.block_n), B * Hkv)](
        q, k, v, d_out, dk, dv, lse, delta,
        *q.stride(), *k.stride(), *v.stride(), *d_out.stride(), *dk.stride(), *dv.stride(), *sizes,
        kv_map.full_offsets, kv_map.full_runs, kv_map.partial_offsets, kv_map.partial_runs, row_b, row_h,
        *problem.extra, EVEN=Lq % config.dkdv.block_m == 0, **shared, **_launch(config.dkdv))
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def _launch(tiles: TileConfig) -> dict:
    return dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps,
                num_stages=tiles.num_stages)


def _map(problem: Problem, tiles: TileConfig, Lq, Lkv, B, Hq):
    """The block map at the backward's tile sizes (the forward's own when they agree)."""
    if problem.block_map.block_size == (tiles.block_m, tiles.block_n):
        return problem.block_map
    return cached_block_map(problem.mask_mod, problem.mask, Lq, Lkv, (tiles.block_m, tiles.block_n), B, Hq,
                            problem.block_map.device)
