"""The keep-mask of a dropout call, evaluated in torch: the rule of maskc/runtime/dropout.py
written again with int64 tensors, independent of the kernels' Triton code, so that a reference
can drop exactly what a call dropped.

>>> g = torch.Generator(device=q.device).manual_seed(0)
>>> out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, dropout_p=0.1, generator=g)
>>> g.manual_seed(0)
>>> keep = maskc.testing.dropout_keep(B, Hq, Lq, Lkv, 0.1, generator=g, device=q.device)
>>> ref, _ = maskc.testing.attention_reference(q, k, v, maskc.masks.causal, dropout_keep=keep, dropout_p=0.1)
"""
from __future__ import annotations

import torch

from maskc.runtime.dropout import KEEP_BITS, draw, keep_min

_WORD = 0xFFFFFFFF
# Philox4x32's multipliers and Weyl key increments (Salmon et al., SC'11; Random123, Triton)
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a·b for a < 2**32 and b's int64 entries < 2**32, in pieces
    that stay below 2**63."""
    low_part = a * (b & 0xFFFF)
    upper = a * (b >> 16) + (low_part >> 16)
    return upper >> 16, ((upper & 0xFFFF) << 16) | (low_part & 0xFFFF)


def philox4x32_10(counter: tuple, key: tuple) -> tuple[torch.Tensor, ...]:
    """Philox4x32 with 10 rounds of the counter (c0, c1, c2, c3) under the key (k0, k1): int64
    tensors (or ints) holding 32-bit words, broadcast together; returns the four output words."""
    device = next((c.device for c in counter if isinstance(c, torch.Tensor)), None)
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64, device=device)
                                               for c in counter))
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _WORD, (k1 + _W1) & _WORD
    return c0, c1, c2, c3


def dropout_keep(B: int, H: int, q_len: int, kv_len: int, dropout_p: float, *, generator=None,
                 seed: int | None = None, device=None) -> torch.Tensor:
    """bool [B, H, q_len, kv_len]: which attention probabilities a compiled_attention call with
    `dropout_p` kept (H: its query heads). The call's seed is drawn from `generator` as the call
    draws it, so pass the generator in the state it had before the call (re-seed it), or give
    the drawn `seed` itself. Queries and keys are numbered from 0 as the kernels number them."""
    if seed is None:
        device = torch.device(device) if device is not None else (
            torch.device(generator.device) if generator is not None else torch.device("cpu"))
        drawn = draw(dropout_p, generator, device)
        if drawn is None:
            return torch.ones(B, H, q_len, kv_len, dtype=torch.bool, device=device)
        seed = int(drawn.seed.item())
    kv = torch.arange(kv_len, device=device)
    words = philox4x32_10((kv // 8, torch.arange(q_len, device=device)[:, None],
                           torch.arange(B * H, device=device).view(B, H, 1, 1), 0),
                          (seed & _WORD, (seed >> 32) & _WORD))
    word = torch.stack(words).gather(0, ((kv % 8) // 2).expand(1, B, H, q_len, kv_len))[0]
    bits = (word >> (16 * (kv % 2))) & 0xFFFF
    return bits >= keep_min(dropout_p)


def dropout_scale(dropout_p: float) -> float:
    """What a call multiplies the kept probabilities by: 1 / (1 - p), with p as the kernels
    apply it (⌊p · 2¹⁶⌋ / 2¹⁶)."""
    return 2 ** KEEP_BITS / (2 ** KEEP_BITS - keep_min(dropout_p))


__all__ = ["dropout_keep", "dropout_scale", "philox4x32_10"]
