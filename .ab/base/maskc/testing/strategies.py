"""Hypothesis strategies for masks, score mods and attention inputs, for users' tests and ours.

Lengths are drawn before masks, so masks that capture per-token tensors (document ids) are
always long enough for the lengths they are used with. Sizes stay small: the CPU Triton
interpreter and the dense references are slow.

>>> from hypothesis import given
>>> from maskc.testing import assert_block_map_sound
>>> from maskc.testing.strategies import mask_cases
>>> @given(mask_cases())
... def test_sound(case):
...     assert_block_map_sound(case.mask_mod, case.q_len, case.kv_len, case.block_size, B=case.B, H=case.H)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from maskc import masks as _masks
from maskc import scores as _scores
from maskc.trace.mods import MaskMod, ScoreMod

TILE_SIZES = (16, 32, 48, 64, 128)
HEAD_DIMS = (16, 32, 64, 80)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class MaskCase(NamedTuple):
    """A mask with lengths, tile sizes and batch/head counts it can be analysed at."""

    mask_mod: MaskMod
    q_len: int
    kv_len: int
    block_size: tuple[int, int]
    B: int
    H: int


@dataclass(frozen=True, repr=False)
class AttentionInputs:
    """q [B, Hq, Lq, D], k [B, Hkv, Lkv, D], v [B, Hkv, Lkv, Dv] with a mask and score mod.

    >>> out, lse = attention_reference(inputs.q, inputs.k, inputs.v, **inputs.kwargs())
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask_mod: MaskMod | None
    score_mod: ScoreMod | None
    scale: float | None
    enable_gqa: bool

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    def kwargs(self) -> dict:
        """Keyword arguments shared by maskc.compiled_attention and maskc.testing.attention_reference."""
        return {"mask_mod": self.mask_mod, "score_mod": self.score_mod, "scale": self.scale,
                "enable_gqa": self.enable_gqa}

    def __repr__(self) -> str:
        # NOTE: hypothesis prints failing examples with repr; shapes say more than tensor values.
        name = lambda m: None if m is None else m.__name__  # noqa: E731
        return (f"AttentionInputs(q={tuple(self.q.shape)}, k={tuple(self.k.shape)}, v={tuple(self.v.shape)}, "
                f"dtype={self.dtype}, mask_mod={name(self.mask_mod)}, score_mod={name(self.score_mod)}, "
                f"scale={self.scale}, enable_gqa={self.enable_gqa})")


def lengths(max_len: int = 256) -> st.SearchStrategy[tuple[int, int]]:
    """(q_len, kv_len), often unequal, mostly not multiples of the tile sizes, sometimes exact multiples."""
    multiples = list(range(16, max_len + 1, 16))
    one = st.integers(1, max_len)
    if multiples:
        one = st.one_of(one, st.sampled_from(multiples))
    return st.tuples(one, one)


def block_sizes() -> st.SearchStrategy[tuple[int, int]]:
    """(q_block, kv_block) from TILE_SIZES, square or not."""
    return st.tuples(st.sampled_from(TILE_SIZES), st.sampled_from(TILE_SIZES))


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def doc_ids(draw, length: int, rows: int | None = None, device="cpu") -> torch.Tensor:
    """Document ids of `length` tokens ([rows, length] when rows is given), int32 or int64.

    A drawn pattern of segments (length, document) repeats to fill the tensor: sorted ids
    (packed sequences) or unsorted ones (a document resumed later, interleaved documents).
    """
    dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    is_sorted = draw(st.booleans())

    def row():
        sizes = draw(st.lists(st.integers(1, max(1, length)), min_size=1, max_size=8))
        if is_sorted:
            labels = sorted(draw(st.lists(st.integers(0, 9), min_size=len(sizes), max_size=len(sizes), unique=True)))
        else:
            labels = draw(st.lists(st.integers(0, 5), min_size=len(sizes), max_size=len(sizes)))
        pattern = torch.repeat_interleave(torch.tensor(labels), torch.tensor(sizes))
        if is_sorted:
            # Sorted ids stay sorted only without repetition: extend the last document instead.
            return torch.cat([pattern, pattern[-1:].expand(max(0, length - len(pattern)))])[:length]
        return pattern.repeat(-(-length // len(pattern)))[:length]

    ids = row() if rows is None else torch.stack([row() for _ in range(rows)])
    return ids.to(dtype=dtype, device=device)


def _standard_leaf(q_len: int, kv_len: int, device):
    """A mask straight from maskc.masks, with arguments that matter at these lengths."""
    n = max(q_len, kv_len)
    sizes = st.integers(0, n + 2)
    return st.one_of(
        st.just(_masks.causal),
        sizes.map(_masks.sliding_window),
        sizes.map(_masks.prefix_lm),
        st.integers(1, n + 2).map(_masks.chunked_causal),
        st.builds(_masks.dilated_sliding_window, sizes, st.integers(1, 8)),
        _documents(q_len, kv_len, device),
    )


@st.composite
def _documents(draw, q_len: int, kv_len: int, device) -> MaskMod:
    causal = draw(st.booleans())
    if draw(st.booleans()):
        # one tensor for queries and keys, sometimes longer than needed
        ids = draw(doc_ids(max(q_len, kv_len) + draw(st.integers(0, 3)), device=device))
        return _masks.document(ids, causal=causal)
    return _masks.document(draw(doc_ids(q_len, device=device)), causal=causal,
                           kv_doc_ids=draw(doc_ids(kv_len, device=device)))


@st.composite
def _extra_leaf(draw, q_len: int, kv_len: int, B: int, H: int, device) -> MaskMod:
    """A mask outside maskc.masks: reads b or h through captured tables, or uses operations
    the interval analysis cannot decide (left to dense settling)."""
    n = max(q_len, kv_len)
    kind = draw(st.sampled_from(("head_windows", "parity", "batch_docs", "padding", "where", "undecidable")))
    if kind == "head_windows":
        windows = torch.tensor(draw(st.lists(st.integers(0, n), min_size=H, max_size=H)), device=device)

        def head_windows(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h])

        return MaskMod(head_windows)
    if kind == "parity":
        stride, modulus = draw(st.integers(1, 3)), draw(st.integers(2, 4))

        def parity(b, h, q_idx, kv_idx):
            return ((b + h * stride) % modulus == 0) | (q_idx >= kv_idx)

        return MaskMod(parity)
    if kind == "batch_docs":
        ids = draw(doc_ids(n, rows=B, device=device))

        def batch_docs(b, h, q_idx, kv_idx):
            return ids[b, q_idx] == ids[b, kv_idx]

        return MaskMod(batch_docs)
    if kind == "padding":
        valid = torch.tensor(draw(st.lists(st.integers(0, kv_len), min_size=B, max_size=B)), device=device)

        def padding(b, h, q_idx, kv_idx):
            return kv_idx < valid[b]

        return MaskMod(padding)
    if kind == "where":
        window = draw(st.integers(0, n))

        def per_head_where(b, h, q_idx, kv_idx):
            return torch.where(h == 0, q_idx >= kv_idx, torch.abs(q_idx - kv_idx) <= window)

        return MaskMod(per_head_where)
    modulus, offset = draw(st.integers(2, 9)), draw(st.integers(0, 8))

    def undecidable(b, h, q_idx, kv_idx):
        return (q_idx * kv_idx + offset) % modulus == 0

    return MaskMod(undecidable)


@st.composite
def masks(draw, q_len: int, kv_len: int, *, B: int = 1, H: int = 1, standard_only: bool = False,
          max_depth: int = 2, device="cpu") -> MaskMod:
    """A mask usable at (q_len, kv_len) for B batches and H heads, its tensors on `device`.

    Leaves are maskc.masks factories (and, unless standard_only, masks reading b/h or
    captured tables), composed with and_masks / or_masks / not_mask up to `max_depth`.
    """
    def leaf():
        # an explicit coin rather than st.one_of, which would flatten the standard choices
        # alongside the extra ones and leave the extras rare
        if not standard_only and draw(st.booleans()):
            return draw(_extra_leaf(q_len, kv_len, B, H, device))
        return draw(_standard_leaf(q_len, kv_len, device))

    def build(depth):
        if depth == 0 or draw(st.integers(0, 2)) == 0:
            return leaf()
        op = draw(st.sampled_from(("and", "or", "not")))
        if op == "not":
            return _masks.not_mask(build(depth - 1))
        parts = (build(depth - 1), build(depth - 1))
        return _masks.and_masks(*parts) if op == "and" else _masks.or_masks(*parts)

    return build(max_depth)


@st.composite
def mask_cases(draw, max_len: int = 256, *, standard_only: bool = False, max_batch: int = 2,
               max_heads: int = 3) -> MaskCase:
    """A MaskCase: lengths first (unequal, ragged), then tiles, B, H, and a mask fit for them."""
    q_len, kv_len = draw(lengths(max_len))
    block_size = draw(block_sizes())
    B, H = draw(st.integers(1, max_batch)), draw(st.integers(1, max_heads))
    mask = draw(masks(q_len, kv_len, B=B, H=H, standard_only=standard_only))
    return MaskCase(mask, q_len, kv_len, block_size, B, H)


@st.composite
def score_mods(draw, q_len: int, kv_len: int, H: int = 1, device="cpu") -> ScoreMod | None:
    """None, softcap(c), alibi(slopes) with one slope per query head, relative_bias(table)
    with a table covering every q_idx - kv_idx at these lengths (1-d or per head), or an
    affine a·score + r·q_idx + table[kv_idx]."""
    kind = draw(st.sampled_from(("none", "softcap", "alibi", "relative_bias", "affine")))
    if kind == "none":
        return None
    if kind == "softcap":
        return _scores.softcap(draw(st.sampled_from((1.0, 5.0, 20.0, 30.0, 50.0))))
    seed = draw(st.integers(0, 2**32 - 1))
    if kind == "alibi":
        if draw(st.booleans()):
            return _scores.alibi(_scores.alibi_slopes(H).to(device))
        return _scores.alibi(torch.rand(H, generator=_generator(seed)).to(device))
    if kind == "affine":
        return _affine(draw(st.sampled_from((0.5, 1.0, 2.0))), draw(st.sampled_from((0.0, 0.05, -0.1))),
                       torch.randn(kv_len, generator=_generator(seed)).to(device))
    width = q_len + kv_len - 1
    shape = (H, width) if draw(st.booleans()) else (width,)
    return _scores.relative_bias(torch.randn(shape, generator=_generator(seed)).to(device), offset=kv_len - 1)


def _affine(coefficient: float, row_slope: float, column: torch.Tensor) -> ScoreMod:
    """coefficient·score + row_slope·q_idx + column[kv_idx]: the split form (separable) that
    FULL tiles fold into one FMA, with a column that is a table rather than a polynomial."""
    def affine(score, b, h, q_idx, kv_idx):
        return coefficient * score + row_slope * q_idx + column[kv_idx]

    return ScoreMod(affine, name=f"affine_{coefficient:g}_{row_slope:g}")


@st.composite
def attention_inputs(draw, max_len: int = 80, *, dtypes=DTYPES, head_dims=HEAD_DIMS, max_batch: int = 2,
                     with_mask: bool = True, with_score_mod: bool = True, device="cpu") -> AttentionInputs:
    """Small attention problems: GQA head counts, unequal lengths, Dv != D, masks and score mods.

    Values are standard normal from a drawn seed; masks may drop whole rows.
    """
    B = draw(st.integers(1, max_batch))
    h_kv = draw(st.integers(1, 2))
    h_q = h_kv * draw(st.sampled_from((1, 2, 3)))
    q_len, kv_len = draw(lengths(max_len))
    d = draw(st.sampled_from(head_dims))
    dv = draw(st.sampled_from((d, *head_dims)))
    dtype = draw(st.sampled_from(dtypes))
    mask = draw(st.none() | masks(q_len, kv_len, B=B, H=h_q, device=device)) if with_mask else None
    score = draw(score_mods(q_len, kv_len, H=h_q, device=device)) if with_score_mod else None
    scale = draw(st.sampled_from((None, 0.125, 1.0)))
    gen = _generator(draw(st.integers(0, 2**32 - 1)))
    q, k, v = (torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
               for shape in ((B, h_q, q_len, d), (B, h_kv, kv_len, d), (B, h_kv, kv_len, dv)))
    return AttentionInputs(q, k, v, mask, score, scale, enable_gqa=h_q != h_kv)


__all__ = ["AttentionInputs", "DTYPES", "HEAD_DIMS", "MaskCase", "TILE_SIZES", "attention_inputs", "block_sizes",
           "doc_ids", "lengths", "mask_cases", "masks", "score_mods"]
