"""Dense float64 references: the correctness specification every kernel is checked against."""
from __future__ import annotations

import math

import torch

from maskc.testing.dropout import dropout_scale


def dense_mask(mask_mod, q_len: int, kv_len: int, B: int = 1, H: int = 1, device=None) -> torch.Tensor:
    """bool [B, H, q_len, kv_len]: the user's mask_mod evaluated on every (b, h, q_idx, kv_idx).

    Independent of tracing, and with FlexAttention's semantics: the function sees one 0-d
    index of each kind at a time, through torch.vmap, as create_mask calls it (chained
    indexing such as `bias[b][q_idx]` means what it means there).
    """
    ar = lambda n: torch.arange(n, device=device)  # noqa: E731
    out = _per_element(_user_function(mask_mod), with_score=False)(ar(B), ar(H), ar(q_len), ar(kv_len))
    return out.to(torch.bool).expand(B, H, q_len, kv_len)


def _user_function(mod):
    """The function the user wrote, not maskc's traced wrapper of it (no tracing here)."""
    return mod.fn if getattr(mod, "_maskc_mod", False) else mod


def _per_element(fn, with_score: bool):
    """`fn` vmapped over b, h, q_idx and kv_idx (kv_idx innermost); the score, if any, is
    batched at every level. A mod that returns a Python number gets it as a tensor."""
    def as_tensor(*args):
        out = fn(*args)
        return out if isinstance(out, torch.Tensor) else torch.tensor(out)

    mapped = as_tensor
    for axis in (3, 2, 1, 0):
        dims = tuple(0 if i == axis else None for i in range(4))
        mapped = torch.vmap(mapped, in_dims=((0,) + dims) if with_score else dims)
    return mapped


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


def attention_reference(q, k, v, mask_mod=None, score_mod=None, scale=None, enable_gqa=False, sinks=None,
                        dropout_keep=None, dropout_p: float = 0.0):
    """(out, lse) in float64 by the definition, with FlexAttention's semantics.

    q [B, Hq, Lq, D], k [B, Hkv, Lkv, D], v [B, Hkv, Lkv, Dv]. Fully masked rows give
    out = 0 and lse = -inf. `lse` is the natural-log sum of exp of the modified scores.
    `sinks` [Hq], one logit per query head, is one more column of every row's scores, not
    scaled, not score-modded, never masked, with no value: a fully masked row then gives
    out = 0 and lse = sinks[h]. `dropout_keep` (bool [B, Hq, Lq, Lkv], maskc.testing.dropout_keep)
    with `dropout_p`: the probabilities it drops are 0 and the rest scaled as the kernels scale
    them (dropout_scale); the lse is unchanged.
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
    if score_mod is not None:
        scores = _per_element(_user_function(score_mod), with_score=True)(
            scores, *(torch.arange(n, device=dev) for n in (B, Hq, Lq, Lkv))).to(torch.float64)
    if mask_mod is not None:
        keep = dense_mask(mask_mod, Lq, Lkv, B, Hq, device=dev)
        scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[None, :, None, None].expand(B, Hq, Lq, 1)], dim=-1)
    # Rows with nothing kept (masked, or every score -inf from the score_mod) take zeros before
    # logsumexp: its gradient over a row of -inf is 0/0, which would make dq and dk NaN
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    kept = scores.masked_fill(empty, 0.0)
    lse = torch.logsumexp(kept, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    # softmax subtracts the row's max: exp(scores - lse) lost a row of scores near float32's
    # lowest (transformers' finfo.min padding) whole, as lse's rounding there absorbs log(n)
    # and made each weight 1, the row the sum of v instead of its mean
    probs = torch.softmax(kept, dim=-1).masked_fill(empty, 0.0)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink's share of the row goes to no value
    if dropout_keep is not None:
        probs = probs * dropout_keep.to(dev) * dropout_scale(dropout_p)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v), lse


def decode_reference(q, k, v, kv_lens, mask_mod=None, score_mod=None, scale=None, enable_gqa=False, sinks=None):
    """(out, lse) in float64 for compiled_attention's kv_lens: the Lq queries of sequence b sit
    at positions kv_lens[b] - Lq + i and see keys below kv_lens[b]; a query before position 0
    gives out 0 and lse -inf (sinks[h] with `sinks`, as attention_reference's)."""
    B, Hq, Lq, D = q.shape
    Lkv = k.shape[2]
    lens = [min(max(int(n), 0), Lkv) for n in kv_lens]  # as the kernel clamps them
    placed = q.new_zeros((B, Hq, Lkv, D))
    for b, n in enumerate(lens):
        first = max(n - Lq, 0)
        placed[b, :, first:n] = q[b, :, Lq - (n - first):]
    ends = torch.tensor(lens, device=q.device)

    def within(b, h, q_idx, kv_idx):
        keep = kv_idx < ends[b]
        return keep if mask_mod is None else keep & mask_mod(b, h, q_idx, kv_idx)

    out_all, lse_all = attention_reference(placed, k, v, within, score_mod, scale, enable_gqa, sinks)
    out = out_all.new_zeros((B, Hq, Lq, v.shape[3]))
    lse = (lse_all.new_full((B, Hq, Lq), float("-inf")) if sinks is None
           else sinks.double()[None, :, None].expand(B, Hq, Lq).clone())
    for b, n in enumerate(lens):
        first = max(n - Lq, 0)
        out[b, :, Lq - (n - first):] = out_all[b, :, first:n]
        lse[b, :, Lq - (n - first):] = lse_all[b, :, first:n]
    return out, lse

