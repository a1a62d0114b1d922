"""The split-KV decoding kernel compiled on CUDA against the float64 reference: queries at the
end of ragged sequences (kv_lens with 0, 1, full and drawn lengths), Lq 1-100, GQA groups 1-8, D
32-128, bf16 and fp16, forced and chosen splits, the serving workloads and drawn mods; then the
paged cache, whose outputs must be identical to the same keys held contiguously.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import maskc
from maskc.runtime.tiles import use_config
from maskc.testing import assert_close_to_reference, decode_reference
from maskc.testing.strategies import masks, score_mods

from ._common import HALF, assert_lse_close, drawn, examples, lane_sample, name


@dataclass(frozen=True, repr=False)
class Decode:
    """q [B, Hq, Lq, D] at the end of sequences of kv_lens keys of k, v [B, Hkv, L, D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor
    mask: object
    score: object
    splits: int | None

    def __repr__(self) -> str:
        # hypothesis prints a failing case with repr: shapes, lengths and mods, not values
        B, Hq, Lq, D = self.q.shape
        return (f"Decode(B={B} Hq={Hq} Hkv={self.k.shape[1]} Lq={Lq} L={self.k.shape[2]} D={D} "
                f"{str(self.q.dtype)[6:]} lens={self.lens.tolist()} mask={name(self.mask)} "
                f"score={name(self.score)} splits={self.splits})")


@st.composite
def decodes(draw, max_len: int = 350) -> Decode:
    """Queries at the end of ragged sequences (lengths 0, 1, full or drawn), drawn mods over
    logical positions, GQA groups up to 6, forced splits or the chosen ones."""
    B = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from((1, 3, 4, 6)))
    q_len = draw(st.sampled_from((1, 1, 3, 16)))
    kv_len = draw(st.integers(q_len, max(q_len, max_len)))
    lens = [draw(st.sampled_from((0, 1, kv_len)) | st.integers(0, kv_len)) for _ in range(B)]
    d = draw(st.sampled_from((64, 128, 32)))
    dtype = draw(st.sampled_from(HALF))
    H = h_kv * group
    mask = draw(st.none() | masks(kv_len, kv_len, B=B, H=H, device="cuda"))
    score = draw(score_mods(kv_len, kv_len, H=H, device="cuda"))
    splits = draw(st.sampled_from((None, None, 1, 3)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    q, k, v = (torch.randn(s, generator=g).to(dtype=dtype, device="cuda")
               for s in ((B, H, q_len, d), (B, h_kv, kv_len, d), (B, h_kv, kv_len, d)))
    return Decode(q, k, v, torch.tensor(lens, dtype=torch.int32, device="cuda"), mask, score, splits)


def _check(c: Decode) -> None:
    with use_config(splits=c.splits):
        out, lse = maskc.compiled_attention(c.q, c.k, c.v, mask_mod=c.mask, score_mod=c.score, enable_gqa=True,
                                            kv_lens=c.lens, return_lse=True)
    ref, ref_lse = decode_reference(c.q, c.k, c.v, c.lens, c.mask, c.score, enable_gqa=True)
    assert_close_to_reference(out, ref, c.q.dtype)
    assert_lse_close(lse, ref_lse)


@examples(4, 12)
def test_decode_drawn(examples):
    @drawn(examples)
    @given(decodes())
    def decode(case):
        _check(case)

    decode()


def _workload(name: str, L: int, H: int, rng: random.Random):
    if name == "causal":
        return maskc.masks.causal, None
    if name == "sliding":
        return maskc.masks.sliding_window(rng.randint(1, 300)), None
    if name == "document":
        ids = torch.randint(0, 5, (L,), generator=torch.Generator().manual_seed(rng.randint(0, 2**31)))
        return maskc.masks.document(torch.sort(ids).values.cuda(), causal=True), None
    if name == "prefix":
        return maskc.masks.prefix_lm(rng.randint(0, L)), None
    if name == "alibi":
        return maskc.masks.causal, maskc.scores.alibi(maskc.scores.alibi_slopes(H).cuda())
    if name == "softcap":
        return maskc.masks.causal, maskc.scores.softcap(30.0)
    return None, None


# the lane: seed 0 of four workloads; -m slow: 17 seeds of each of the seven (119 cases)
WORKLOADS = lane_sample([(w, seed) for w in ("none", "causal", "sliding", "document", "prefix", "alibi", "softcap")
                         for seed in range(17)],
                        lambda i, v: v[1] == 0 and v[0] in ("none", "document", "alibi", "softcap"),
                        ids=lambda v: f"{v[0]}-{v[1]}")


@pytest.mark.parametrize("workload, seed", WORKLOADS)
def test_decode_workloads(workload, seed):
    """The serving workloads with Lq up to 100, GQA groups up to 8 and splits up to 16, drawn from
    `seed`."""
    rng = random.Random(f"{workload}-{seed}")
    B, h_kv, group = rng.randint(1, 4), rng.choice((1, 2, 8)), rng.choice((1, 3, 4, 6, 8))
    lq = rng.choice((1, 2, 4, 7, 16, 100))
    L = rng.randint(lq, 700)
    D = rng.choice((64, 128))
    dtype = rng.choice(HALF)
    lens = torch.tensor([rng.choice((0, 1, L, rng.randint(0, L))) for _ in range(B)], dtype=torch.int32,
                        device="cuda")
    mask, score = _workload(workload, L, h_kv * group, rng)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g).to(dtype=dtype, device="cuda")
               for s in ((B, h_kv * group, lq, D), (B, h_kv, L, D), (B, h_kv, L, D)))
    _check(Decode(q, k, v, lens, mask, score, rng.choice((None, 1, 3, 16))))


PAGED = lane_sample([(p, m) for p in (1, 16, 64, 128) for m in (None, "causal", "sliding 100")],
                    lambda i, v: i in (1, 8), ids=lambda v: f"page{v[0]}-{v[1] or 'no mask'}")


@pytest.mark.parametrize("page_size, mask", PAGED)
def test_paged_matches_contiguous(page_size, mask):
    """Three sequences appended in uneven chunks: paged_attention gives the same bits as the same
    keys held contiguously at the cache's capacity (the same problem: the same tiles and splits)."""
    mask = {None: None, "causal": maskc.masks.causal, "sliding 100": maskc.masks.sliding_window(100)}[mask]
    B, h_kv, D, L = 3, 2, 128, 1000
    g = torch.Generator().manual_seed(page_size)
    k, v = (torch.randn(B, h_kv, L, D, generator=g).to(dtype=torch.bfloat16, device="cuda") for _ in "kv")
    cache = maskc.PagedKVCache(64 * 128 // page_size, page_size, h_kv, D, dtype=torch.bfloat16, device="cuda",
                               max_seqs=8)
    seq_ids = torch.tensor([5, 0, 2], dtype=torch.int32, device="cuda")
    start = 0
    for end in (1, 17, 300, 301, 1000):
        cache.append(seq_ids, k[:, :, start:end], v[:, :, start:end])
        start = end
    pad = torch.zeros(B, h_kv, cache.capacity - L, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.cat([k, pad], 2), torch.cat([v, pad], 2)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    for lq in (1, 7):
        q = torch.randn(B, h_kv * 4, lq, D, generator=g).to(dtype=torch.bfloat16, device="cuda")
        paged = maskc.paged_attention(q, cache, seq_ids, mask_mod=mask, enable_gqa=True)
        flat = maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True, kv_lens=lens)
        assert torch.equal(paged, flat), \
            f"Lq={lq}: paged and contiguous differ by up to {(paged.float() - flat.float()).abs().max().item():.3g}"


@examples(2, 12)
def test_paged_drawn(examples):
    """Drawn decoding cases from a paged cache, each sequence appended in two uneven parts into
    slots that are not 0..B-1: identical to the contiguous keys at the cache's capacity, and
    within tolerance of the reference (queries past a sequence's keys keep nothing)."""
    @drawn(examples)
    @given(decodes(), st.sampled_from((1, 16, 64)))
    def paged(case, page_size):
        _check_paged(case, page_size)

    paged()


def _check_paged(case, page_size):
    q, k, v, lens, mask, score = case.q, case.k, case.v, case.lens, case.mask, case.score
    B, h_kv, kv_len, D = k.shape
    pages_per_seq = -(-kv_len // page_size)
    cache = maskc.PagedKVCache(B * pages_per_seq + 3, page_size, h_kv, D, dtype=k.dtype, device="cuda",
                               max_seqs=B + 2, max_pages_per_seq=pages_per_seq)
    slots = torch.arange(B + 1, 0, -1, dtype=torch.int32, device="cuda")[:B]
    for b in range(B):
        n = int(lens[b])
        for lo, hi in ((0, n // 3), (n // 3, n)):
            if hi > lo:
                cache.append(slots[b:b + 1], k[b:b + 1, :, lo:hi], v[b:b + 1, :, lo:hi])
    got = maskc.paged_attention(q, cache, slots, mask_mod=mask, score_mod=score, enable_gqa=True)
    k_cap = torch.zeros(B, h_kv, pages_per_seq * page_size, D, dtype=k.dtype, device="cuda")
    v_cap = torch.zeros_like(k_cap)
    k_cap[:, :, :kv_len], v_cap[:, :, :kv_len] = k, v
    flat = maskc.compiled_attention(q, k_cap, v_cap, mask_mod=mask, score_mod=score, enable_gqa=True, kv_lens=lens)
    assert torch.equal(got, flat), "paged and contiguous outputs differ"
    ref, _ = decode_reference(q, k, v, lens, mask, score, enable_gqa=True)
    assert_close_to_reference(got, ref, q.dtype)
