"""Attention dropout: the rule a call's keep-mask follows, its checks, and its seed.

Each kept probability P[b, h, i, j] is dropped with probability p and the survivors are scaled
by 1/(1 - p): out = (softmax(S) ∘ Z / (1 - p)) V, the lse unchanged. The kernels draw Z from a
counter-based generator, Philox4x32-10 (as Triton's `tl.philox`), so the backward regenerates
the forward's bits and no mask is stored. One evaluation gives 128 bits, 16 for each of 8
neighbouring keys, so that the generator's cost is shared by 8 pairs:

    key      = the call's seed (uint64: low word, high word)
    counter  = (j // 8, i, b·Hq + h, 0)     (j the key's position, i the query's, h the query head)
    bits     = 16 bits of output word (j % 8) // 2: its low half for even j, its high half for odd
    keep     = bits >= keep_min,   keep_min = ⌊p · 2¹⁶⌋

so the dropped fraction is keep_min / 2¹⁶ (p to within 2⁻¹⁶) and survivors are scaled by
2¹⁶ / (2¹⁶ - keep_min), which keeps the expected output unbiased. The seed is one int64 drawn
per call from `generator` (or torch's default generator of q's device) on q's device, by a
torch op: no host synchronisation, and under CUDA-graph capture torch's generator advances its
offset as it does for SDPA's dropout. Re-seeding the generator reproduces a call bit for bit;
maskc.testing.dropout_keep evaluates the same rule in torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KEEP_BITS = 16  # each pair's keep test reads 16 random bits: keep_min < 2**16
SEED_HIGH = 2 ** 62  # seeds are drawn from [0, 2**62): any int64 torch.randint takes as a bound


@dataclass(frozen=True)
class Dropout:
    """A call's dropout: its seed (int64 [1] on q's device) and keep_min = ⌊p · 2¹⁶⌋."""

    seed: torch.Tensor
    keep_min: int


def keep_min(dropout_p: float) -> int:
    """⌊p · 2¹⁶⌋: the threshold the 16 random bits of a pair must reach for it to be kept."""
    return int(dropout_p * 2 ** KEEP_BITS)


def check_dropout(dropout_p, generator, q, kv_lens=None) -> None:
    """Refuse a dropout_p outside [0, 1), a generator that cannot draw on q's device, and
    dropout in a decoding call (kv_lens)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p is the probability of dropping each attention probability, a float in [0, 1), "
                         f"got {dropout_p!r}; pass e.g. dropout_p=0.1 (0.0 turns dropout off)")
    if dropout_p and kv_lens is not None:
        raise ValueError(f"dropout is for training, and calls with kv_lens decode, which has none: got "
                         f"dropout_p={dropout_p} with kv_lens; pass dropout_p=0.0 when decoding (dropout_p=p if "
                         f"training else 0.0)")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}; pass "
                            f"torch.Generator(device=q.device), seeded with .manual_seed(n), or None")
        if torch.device(generator.device).type != q.device.type:
            raise ValueError(f"dropout draws its seed on q's device, {q.device}, but the generator is on "
                             f"{generator.device}; pass torch.Generator(device=q.device) (or None: torch's default "
                             f"generator for that device)")


def draw(dropout_p: float, generator, device: torch.device) -> Dropout | None:
    """The Dropout of a call, its seed drawn now; None where dropout_p is 0 (no dropout, and the
    kernels without it)."""
    if dropout_p == 0:
        return None
    seed = torch.randint(0, SEED_HIGH, (1,), dtype=torch.int64, device=device, generator=generator)
    return Dropout(seed, keep_min(dropout_p))


__all__ = ["Dropout", "KEEP_BITS", "check_dropout", "draw", "keep_min"]
