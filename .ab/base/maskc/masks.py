"""Ready-made mask_mods. Factories return named MaskMods whose captured numbers are
runtime parameters: sliding_window(512) and sliding_window(1024) share one kernel.

>>> from maskc import masks
>>> masks.sliding_window(1024).__name__
'sliding_window_1024'
>>> both = masks.and_masks(masks.causal, masks.prefix_lm(256))
"""
from __future__ import annotations

import torch

from maskc.trace.mods import MaskMod, as_mask_mod


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


causal = MaskMod(_causal, name="causal")
causal.__doc__ = """Each query sees itself and earlier keys: q_idx >= kv_idx.

>>> maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)
"""


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def sliding_window(window: int) -> MaskMod:
    """Causal attention to the last `window` keys: 0 <= q_idx - kv_idx <= window.

    >>> maskc.masks.sliding_window(1024).__name__
    'sliding_window_1024'
    """
    _positive_int("window", window)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    return MaskMod(sliding, name=f"sliding_window_{window}")


def prefix_lm(prefix: int) -> MaskMod:
    """Bidirectional over the first `prefix` keys, causal after: kv_idx < prefix or q_idx >= kv_idx.

    >>> maskc.masks.prefix_lm(2048).__name__
    'prefix_lm_2048'
    """
    _positive_int("prefix", prefix)

    def prefix_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    return MaskMod(prefix_mask, name=f"prefix_lm_{prefix}")


def chunked_causal(chunk: int) -> MaskMod:
    """Causal inside chunks of `chunk` tokens, nothing across: q_idx // chunk == kv_idx // chunk.

    >>> maskc.masks.chunked_causal(512).__name__
    'chunked_causal_512'
    """
    if _positive_int("chunk", chunk) == 0:
        raise ValueError("chunk must be at least 1, got 0")

    def chunked(b, h, q_idx, kv_idx):
        return (q_idx // chunk == kv_idx // chunk) & (q_idx >= kv_idx)

    return MaskMod(chunked, name=f"chunked_causal_{chunk}")


def dilated_sliding_window(window: int, dilation: int) -> MaskMod:
    """Causal window of `window` keys keeping every `dilation`-th: (q_idx - kv_idx) % dilation == 0.

    >>> maskc.masks.dilated_sliding_window(256, 2).__name__
    'dilated_sliding_window_256_2'
    """
    _positive_int("window", window)
    if _positive_int("dilation", dilation) == 0:
        raise ValueError("dilation must be at least 1, got 0")

    def dilated(b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        return (diff >= 0) & (diff <= window) & (diff % dilation == 0)

    return MaskMod(dilated, name=f"dilated_sliding_window_{window}_{dilation}")


def document(doc_ids: torch.Tensor, *, causal: bool = False, kv_doc_ids: torch.Tensor | None = None) -> MaskMod:
    """Packed sequences: a query sees keys of its own document (and only earlier ones if causal).

    `doc_ids[i]` is the document of token i; pass `kv_doc_ids` when keys differ from queries.

    >>> doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 412, 12]))
    >>> maskc.masks.document(doc_ids, causal=True).__name__
    'document_causal'
    """
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 1 or doc_ids.dtype.is_floating_point:
        raise ValueError(f"doc_ids must be a 1-d integer tensor, got {_describe(doc_ids)}")
    kv_ids = doc_ids if kv_doc_ids is None else kv_doc_ids
    if not isinstance(kv_ids, torch.Tensor) or kv_ids.dim() != 1 or kv_ids.dtype.is_floating_point:
        raise ValueError(f"kv_doc_ids must be a 1-d integer tensor, got {_describe(kv_ids)}")

    if causal:
        def doc_mask(b, h, q_idx, kv_idx):
            return (doc_ids[q_idx] == kv_ids[kv_idx]) & (q_idx >= kv_idx)
    else:
        def doc_mask(b, h, q_idx, kv_idx):
            return doc_ids[q_idx] == kv_ids[kv_idx]

    return MaskMod(doc_mask, name="document_causal" if causal else "document")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-d {x.dtype} tensor"
    return type(x).__name__


def and_masks(*mask_mods) -> MaskMod:
    """Keep a pair only where every mask keeps it.

    >>> maskc.masks.and_masks(maskc.masks.causal, maskc.masks.prefix_lm(64)).__name__
    'and(causal, prefix_lm_64)'
    """
    mods = _mods("and_masks", mask_mods)

    def both(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    return MaskMod(both, name=f"and({', '.join(m.__name__ for m in mods)})")


def or_masks(*mask_mods) -> MaskMod:
    """Keep a pair where any mask keeps it.

    >>> maskc.masks.or_masks(maskc.masks.sliding_window(64), maskc.masks.prefix_lm(16)).__name__
    'or(sliding_window_64, prefix_lm_16)'
    """
    mods = _mods("or_masks", mask_mods)

    def either(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    return MaskMod(either, name=f"or({', '.join(m.__name__ for m in mods)})")


def not_mask(mask_mod) -> MaskMod:
    """Keep exactly the pairs `mask_mod` drops.

    >>> maskc.masks.not_mask(maskc.masks.causal).__name__
    'not(causal)'
    """
    (mod,) = _mods("not_mask", (mask_mod,))

    def inverted(b, h, q_idx, kv_idx):
        return ~mod(b, h, q_idx, kv_idx)

    return MaskMod(inverted, name=f"not({mod.__name__})")


def _mods(what, mask_mods) -> tuple:
    if not mask_mods:
        raise ValueError(f"{what} needs at least one mask_mod, got none")
    return tuple(as_mask_mod(m) for m in mask_mods)


__all__ = ["and_masks", "causal", "chunked_causal", "dilated_sliding_window", "document", "not_mask", "or_masks",
           "prefix_lm", "sliding_window"]
