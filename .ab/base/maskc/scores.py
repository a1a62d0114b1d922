"""Ready-made score_mods, named like the masks: softcap(30).__name__ == 'softcap_30'.

>>> out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal,
...                                score_mod=maskc.scores.softcap(30.0))
"""
from __future__ import annotations

import math

import torch

from maskc.trace.mods import ScoreMod


def alibi_slopes(num_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ALiBi paper's head slopes 2^(-8 i / n) for i = 1..n (float32 [num_heads]) on `device`
    (the CPU by default): a score mod's captured tensor must be on the device of q, k and v."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)], dtype=torch.float32,
                        device=device)


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi: score + slopes[h] * (kv_idx - q_idx), a linear penalty on distance per head.

    >>> maskc.scores.alibi(maskc.scores.alibi_slopes(16)).__name__
    'alibi'
    """
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1 or not slopes.dtype.is_floating_point:
        raise ValueError("slopes must be a 1-d floating-point tensor with one slope per query head; "
                         "build one with maskc.scores.alibi_slopes(num_heads)")

    def alibi_bias(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return ScoreMod(alibi_bias, name="alibi")


def softcap(cap: float) -> ScoreMod:
    """Tanh soft-capping (Gemma 2, Grok): cap * tanh(score / cap).

    >>> maskc.scores.softcap(30).__name__
    'softcap_30'
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"cap must be a positive finite number, got {cap!r}")
    cap = float(cap)

    def capped(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return ScoreMod(capped, name=f"softcap_{cap:g}")


def relative_bias(table: torch.Tensor, offset: int | None = None) -> ScoreMod:
    """A learned bias by relative position: score + table[q_idx - kv_idx + offset].

    `table` is 1-d (shared by all heads) or 2-d [heads, positions] (read as table[h, ...]).
    `offset` defaults to the middle of the positions, so table[offset] is distance 0.

    >>> maskc.scores.relative_bias(torch.zeros(2 * 4096 - 1)).__name__
    'relative_bias'
    """
    if not isinstance(table, torch.Tensor) or table.dim() not in (1, 2) or not table.dtype.is_floating_point:
        raise ValueError("table must be a 1-d or 2-d [heads, positions] floating-point tensor")
    if offset is None:
        offset = table.shape[-1] // 2
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"offset must be an int, got {offset!r}")

    if table.dim() == 1:
        def biased(score, b, h, q_idx, kv_idx):
            return score + table[q_idx - kv_idx + offset]
    else:
        def biased(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + offset]

    return ScoreMod(biased, name="relative_bias")


__all__ = ["alibi", "alibi_slopes", "relative_bias", "softcap"]
