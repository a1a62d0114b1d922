"""Dense float64 references: the correctness specification every kernel is checked against."""
from __future__ import annotations

import math

import torch

from maskc.trace.mods import as_mask_mod, as_score_mod


def dense_mask(mask_mod, q_len: int, kv_len: int, B: int = 1, H: int = 1, device=None) -> torch.Tensor:
    """bool [B, H, q_len, kv_len]: the user's mask_mod called on broadcast index tensors.

    Independent of tracing: this evaluates the original Python function, as
    FlexAttention's create_mask does.
    """
    fn = mask_mod.fn if hasattr(mask_mod, "fn") else mask_mod
    ar = lambda n: torch.arange(n, device=device)  # noqa: E731
    out = fn(ar(B).view(-1, 1, 1, 1), ar(H).view(1, -1, 1, 1), ar(q_len).view(1, 1, -1, 1),
             ar(kv_len).view(1, 1, 1, -1))
    if not isinstance(out, torch.Tensor):
        out = torch.tensor(bool(out), device=device)
    return out.to(torch.bool).expand(B, H, q_len, kv_len)


def dense_tiles(mask: torch.Tensor, block_size) -> torch.Tensor:
    """int8 [B, H, q_tiles, kv_tiles] verdicts (0 EMPTY, 1 PARTIAL, 2 FULL) of a dense mask;
    tiles at the ragged edge count only their in-range pairs."""
    bm, bn = (block_size, block_size) if isinstance(block_size, int) else block_size
    B, H, lq, lkv = mask.shape
    nq, nkv = -(-lq // bm), -(-lkv // bn)
    padded_keep = torch.zeros(B, H, nq * bm, nkv * bn, dtype=torch.bool, device=mask.device)
    padded_valid = torch.zeros_like(padded_keep)
    padded_keep[..., :lq, :lkv] = mask
    padded_valid[..., :lq, :lkv] = True
    keep = padded_keep.view(B, H, nq, bm, nkv, bn)
    valid = padded_valid.view(B, H, nq, bm, nkv, bn)
    any_kept = keep.any(5).any(3)
    all_kept = (keep | ~valid).all(5).all(3)
    return torch.where(all_kept, 2, torch.where(any_kept, 1, 0)).to(torch.int8)


def attention_reference(q, k, v, mask_mod=None, score_mod=None, scale=None, enable_gqa=False):
    """(out, lse) in float64 by the definition, with FlexAttention's semantics.

    q [B, Hq, Lq, D], k [B, Hkv, Lkv, D], v [B, Hkv, Lkv, Dv]. Fully masked rows give
    out = 0 and lse = -inf. `lse` is the natural-log sum of exp of the modified scores.
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lkv = k.shape[1], k.shape[2]
    q, k, v = q.double(), k.double(), v.double()
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError(f"Hq={Hq} differs from Hkv={Hkv}; pass enable_gqa=True for grouped-query attention")
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    dev = q.device
    b = torch.arange(B, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(Hq, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(Lq, device=dev).view(1, 1, -1, 1)
    ki = torch.arange(Lkv, device=dev).view(1, 1, 1, -1)
    score_mod = as_score_mod(score_mod)
    if score_mod is not None:
        scores = score_mod.fn(scores, b, h, qi, ki).to(torch.float64).expand(B, Hq, Lq, Lkv)
    if mask_mod is not None:
        keep = dense_mask(as_mask_mod(mask_mod), Lq, Lkv, B, Hq, device=dev)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    probs = probs.masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v), lse
