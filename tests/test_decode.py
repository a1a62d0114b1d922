"""Decoding and chunked prefill: compiled_attention's kv_lens and the split-KV kernel, checked
against the float64 dense reference through Triton's interpreter."""
import runpy
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import maskc
from maskc.inference import decode
from maskc.runtime.tiles import use_config
from maskc.testing import assert_close_to_reference, attention_reference, decode_reference
from maskc.testing.strategies import masks, score_mods
from maskc.trace.mods import as_mask_mod

QUERY_LENGTHS = (1, 2, 7, 16, 100)
GROUPS = (1, 3, 4, 6)


def _named(name: str, length: int, B: int, H: int, seed: int):
    """(mask_mod, score_mod) of the workloads serving runs, over logical positions < length."""
    gen = torch.Generator().manual_seed(seed)
    if name == "causal":
        return maskc.masks.causal, None
    if name == "sliding_window":
        return maskc.masks.sliding_window(int(torch.randint(1, 40, (), generator=gen))), None
    if name == "document":
        ids = torch.sort(torch.randint(0, 4, (B, length), generator=gen), dim=1).values

        def packed_documents(b, h, q_idx, kv_idx):  # one packing per sequence of the batch
            return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

        return packed_documents, None
    if name == "prefix_lm":
        return maskc.masks.prefix_lm(int(torch.randint(0, length + 1, (), generator=gen))), None
    if name == "alibi":
        return maskc.masks.causal, maskc.scores.alibi(maskc.scores.alibi_slopes(H))
    return maskc.masks.causal, maskc.scores.softcap(20.0)


WORKLOADS = ("causal", "sliding_window", "document", "prefix_lm", "alibi", "softcap")


@st.composite
def decode_cases(draw, mods: str = "drawn"):
    B = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from(GROUPS))
    q_len = draw(st.sampled_from(QUERY_LENGTHS))
    kv_len = draw(st.integers(q_len, q_len + 70))
    # ragged, with 0 and 1 and the full length likely
    lens = [draw(st.sampled_from((0, 1, kv_len)) | st.integers(0, kv_len)) for _ in range(B)]
    d = draw(st.sampled_from((16, 32, 64)))
    dtype = draw(st.sampled_from((torch.float32, torch.float16, torch.bfloat16)))
    H = h_kv * group
    if mods == "drawn":
        mask = draw(st.none() | masks(kv_len, kv_len, B=B, H=H))
        score = draw(score_mods(kv_len, kv_len, H=H))
    else:
        mask, score = _named(draw(st.sampled_from(WORKLOADS)), kv_len, B, H, draw(st.integers(0, 2**16)))
    splits = draw(st.sampled_from((None, 1, 2, 5)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    q, k, v = (torch.randn(shape, generator=gen).to(dtype)
               for shape in ((B, H, q_len, d), (B, h_kv, kv_len, d), (B, h_kv, kv_len, d)))
    return q, k, v, torch.tensor(lens, dtype=torch.int32), mask, score, splits


def _check(case):
    q, k, v, lens, mask, score, splits = case
    with use_config(splits=splits):
        out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=True,
                                            kv_lens=lens, return_lse=True)
    ref_out, ref_lse = decode_reference(q, k, v, lens, mask, score, enable_gqa=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close_to_reference(out, ref_out, q.dtype)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows with no kept key differ"
    finite = ~torch.isinf(ref_lse)
    assert_close_to_reference(lse[finite], ref_lse[finite], torch.float32, what="lse")


_DRAWN = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=8, **_DRAWN)
@given(decode_cases())
def test_kv_lens_matches_reference_for_drawn_mods(case):
    _check(case)


@pytest.mark.slow
@settings(max_examples=50, **_DRAWN)
@given(decode_cases())
def test_kv_lens_matches_reference_for_drawn_mods_deep(case):
    _check(case)


@settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(decode_cases(mods="named"))
def test_kv_lens_matches_reference_for_serving_workloads(case):
    _check(case)


@pytest.mark.parametrize("q_len", (1, 3))
@pytest.mark.parametrize("splits", (None, 3))
def test_small_queries_without_lens_decode_as_flex_attention_would(q_len, splits):
    """Without kv_lens query i sits at position i (FlexAttention's convention), and few query
    rows take the decoding kernel."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, q_len, 32), torch.randn(2, 2, 90, 32), torch.randn(2, 2, 90, 32)
    mask = maskc.masks.or_masks(maskc.masks.causal, maskc.masks.sliding_window(50))
    assert decode.wanted(q, k, differentiable=False)
    with use_config(splits=splits):
        out = maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True)
    ref, _ = attention_reference(q, k, v, mask, enable_gqa=True)
    assert_close_to_reference(out, ref, torch.float32)


def test_chunked_prefill_equals_one_pass():
    """A prompt fed in uneven chunks, each attending to the keys so far with masks.causal and no
    offset written by hand, gives the rows of one causal pass over the whole prompt."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 61, 32), torch.randn(1, 2, 61, 32), torch.randn(1, 2, 61, 32)
    full = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, enable_gqa=True)
    start = 0
    for end in (5, 6, 23, 40, 61):
        lens = torch.tensor([end], dtype=torch.int32)
        chunk = maskc.compiled_attention(q[:, :, start:end], k, v, mask_mod=maskc.masks.causal, enable_gqa=True,
                                         kv_lens=lens)
        torch.testing.assert_close(chunk, full[:, :, start:end], atol=1e-5, rtol=1e-5)
        start = end


def test_document_ids_over_logical_positions():
    """A document mask's captured ids index logical positions: a step at position n sees the
    keys of its own document only."""
    ids = torch.tensor([0] * 30 + [1] * 20 + [2] * 14)
    mask = maskc.masks.document(ids, causal=True)
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    for n in (1, 30, 31, 50, 51, 64):
        lens = torch.tensor([n], dtype=torch.int32)
        out = maskc.compiled_attention(q, k, v, mask_mod=mask, kv_lens=lens)
        ref, _ = decode_reference(q, k, v, lens, mask)
        assert_close_to_reference(out, ref, torch.float32)


def test_splits_follow_the_kept_span_not_the_length():
    """A sliding window keeps a few tiles per row at any length, so it gets few splits; the same
    rows over full attention get more."""
    device = torch.device("cpu")
    assert decode.choose_splits(rows=4, tiles_per_row=1, device=device) == 1
    few = decode.choose_splits(rows=1, tiles_per_row=3, device=device)
    many = decode.choose_splits(rows=1, tiles_per_row=300, device=device)
    assert 1 <= few <= 3 < many <= decode.MAX_SPLITS
    q = torch.randn(1, 1, 1, 16)
    window = decode.problem(q, (1, 2048, 16, 16), as_mask_mod(maskc.masks.sliding_window(64)), None, None, lens=True)
    full = decode.problem(q, (1, 2048, 16, 16), None, None, None, lens=True)
    assert window.splits < full.splits


def test_kv_lens_errors_name_the_rule():
    q, k, v = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    with pytest.raises(TypeError, match="kv_lens must be an integer tensor"):
        maskc.compiled_attention(q, k, v, kv_lens=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="kv_lens must be an integer tensor"):
        maskc.compiled_attention(q, k, v, kv_lens=[3, 4])
    with pytest.raises(ValueError, match=r"kv_lens must have shape \[B\] = \[2\]"):
        maskc.compiled_attention(q, k, v, kv_lens=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="k must hold at least Lq"):
        maskc.compiled_attention(torch.randn(2, 2, 11, 16), k, v, kv_lens=torch.tensor([3, 4]))
    with pytest.raises(NotImplementedError, match="torch.no_grad"):
        maskc.compiled_attention(q.requires_grad_(), k, v, kv_lens=torch.tensor([3, 4]))


# -- the paged cache -------------------------------------------------------------------------
@st.composite
def paged_cases(draw):
    page_size = draw(st.sampled_from((1, 16, 64)))
    pages_per_seq = -(-100 // page_size)
    B = draw(st.integers(1, 3))
    h_kv, group = draw(st.integers(1, 2)), draw(st.sampled_from(GROUPS))
    q_len = draw(st.sampled_from((1, 2, 7, 16)))
    # at most 100 tokens a sequence, every page size's capacity (4 × 30 overflowed 100 in a CI run)
    chunks = [draw(st.lists(st.integers(1, 25), min_size=1, max_size=4)) for _ in range(B)]
    name = draw(st.sampled_from(WORKLOADS))
    return page_size, pages_per_seq, B, h_kv, group, q_len, chunks, name, draw(st.integers(0, 2**16))


@settings(deadline=None, max_examples=20, suppress_health_check=[HealthCheck.too_slow])
@given(paged_cases())
def test_paged_cache_gives_what_contiguous_keys_give(case):
    """Tokens appended in uneven chunks to slots spread over a paged cache give outputs identical
    to the same tokens held contiguously (kv_lens, the same capacity), and both match the
    float64 reference."""
    page_size, pages_per_seq, B, h_kv, group, q_len, chunks, name, seed = case
    torch.manual_seed(seed)
    D, H = 32, h_kv * group
    capacity = pages_per_seq * page_size
    cache = maskc.PagedKVCache(4 * pages_per_seq, page_size, h_kv, D, dtype=torch.float32, max_seqs=5,
                               max_pages_per_seq=pages_per_seq)
    slots = torch.tensor([4, 0, 2][:B], dtype=torch.int32)
    k = torch.zeros(B, h_kv, capacity, D)
    v = torch.zeros(B, h_kv, capacity, D)
    lens = [0] * B
    for step in range(max(len(c) for c in chunks)):
        # each step appends its chunk to the sequences that still have one, the others wait
        todo = [b for b in range(B) if step < len(chunks[b])]
        for b in todo:
            n = chunks[b][step]
            k[b, :, lens[b]:lens[b] + n] = torch.randn(h_kv, n, D)
            v[b, :, lens[b]:lens[b] + n] = torch.randn(h_kv, n, D)
        for b in todo:  # one append per sequence: chunks differ in length
            n = chunks[b][step]
            cache.append(slots[b:b + 1], k[b:b + 1, :, lens[b]:lens[b] + n], v[b:b + 1, :, lens[b]:lens[b] + n])
            lens[b] += n
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    q_len = min(q_len, min(lens))
    q = torch.randn(B, H, q_len, D)
    mask, score = _named(name, capacity, B, H, seed)
    paged = maskc.paged_attention(q, cache, slots, mask_mod=mask, score_mod=score, enable_gqa=True)
    flat = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=True, kv_lens=kv_lens)
    assert torch.equal(paged, flat)
    ref, _ = decode_reference(q, k, v, kv_lens, mask, score, enable_gqa=True)
    assert_close_to_reference(paged, ref, torch.float32)


def test_freed_slots_are_reused_without_touching_the_others():
    torch.manual_seed(3)
    cache = maskc.PagedKVCache(6, 16, 1, 16, dtype=torch.float32, max_seqs=3, max_pages_per_seq=4)
    k, v = torch.randn(2, 1, 40, 16), torch.randn(2, 1, 40, 16)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    cache.append(slots, k, v)  # 3 pages each: the cache is full
    q = torch.randn(1, 1, 1, 16)
    before = maskc.paged_attention(q, cache, slots[1:], mask_mod=maskc.masks.causal)
    cache.free(slots[:1])
    k2, v2 = torch.randn(1, 1, 45, 16), torch.randn(1, 1, 45, 16)
    cache.append(torch.tensor([2], dtype=torch.int32), k2, v2)  # takes the freed pages
    after = maskc.paged_attention(q, cache, slots[1:], mask_mod=maskc.masks.causal)
    assert torch.equal(before, after)
    out = maskc.paged_attention(q, cache, torch.tensor([2], dtype=torch.int32), mask_mod=maskc.masks.causal)
    ref, _ = decode_reference(q, k2, v2, torch.tensor([45]), maskc.masks.causal)
    assert_close_to_reference(out, ref, torch.float32)


def test_paged_attention_errors_name_the_rule():
    cache = maskc.PagedKVCache(4, 16, 2, 16, dtype=torch.float32, max_seqs=2)
    q = torch.randn(1, 4, 1, 16)
    with pytest.raises(TypeError, match="cache must be a maskc.PagedKVCache"):
        maskc.paged_attention(q, object(), torch.tensor([0]))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        maskc.paged_attention(q, cache, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"seq_ids must have shape \[B\] = \[1\]"):
        maskc.paged_attention(q, cache, torch.tensor([0, 1]), enable_gqa=True)
    with pytest.raises(TypeError, match="q is torch.float16 but the cache holds torch.float32"):
        maskc.paged_attention(q.half(), cache, torch.tensor([0]), enable_gqa=True)


def test_generate_example_matches_recomputation():
    """examples/generate.py: greedy decoding from paged caches, its logits checked against
    recomputing each sequence at every step (it exits 1 where they differ)."""
    example = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "generate.py"))
    assert example["main"]() == 0


def test_strided_bf16_pages_from_one_kv_tensor():
    """FlashInfer's layout: k and v pages as two strided halves of one [pages, 2, P, H, D]
    tensor, in bf16 (which the interpreter runs in float32 copies with other strides)."""
    torch.manual_seed(6)
    kv = torch.randn(20, 2, 4, 2, 16).bfloat16()
    cache = maskc.PagedKVCache.from_csr(kv[:, 0], kv[:, 1], torch.tensor([0, 3, 5]), torch.tensor([7, 2, 9, 0, 15]),
                                        torch.tensor([2, 4]))
    q = torch.randn(2, 6, 2, 16).bfloat16()
    slots = torch.tensor([1, 0], dtype=torch.int32)
    out = maskc.paged_attention(q, cache, slots, mask_mod=maskc.masks.causal, enable_gqa=True)
    for b, slot in enumerate(slots.tolist()):
        k, v = cache.gather(slot)
        ref, _ = decode_reference(q[b:b + 1], k[None], v[None], torch.tensor([k.shape[1]]), maskc.masks.causal,
                                  enable_gqa=True)
        assert_close_to_reference(out[b:b + 1], ref, torch.bfloat16)


def test_a_slot_outside_the_cache_reads_as_empty():
    cache = maskc.PagedKVCache(4, 16, 1, 16, dtype=torch.float32, max_seqs=2)
    cache.append(torch.tensor([0, 1]), torch.randn(2, 1, 5, 16), torch.randn(2, 1, 5, 16))
    out, lse = maskc.paged_attention(torch.randn(2, 1, 1, 16), cache, torch.tensor([7, -1]), return_lse=True)
    assert torch.count_nonzero(out) == 0 and torch.isinf(lse).all()


def test_paged_errors_name_the_cache():
    cache = maskc.PagedKVCache(4, 16, 2, 16, dtype=torch.float32, max_seqs=2)
    with pytest.raises(ValueError, match="the cache's head_dim is 16"):
        maskc.paged_attention(torch.randn(1, 2, 1, 32), cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="q has 3 heads and the cache 2 kv heads"):
        maskc.paged_attention(torch.randn(1, 3, 1, 16), cache, torch.tensor([0]), enable_gqa=True)


def test_a_block_map_for_kv_lens_is_over_key_positions():
    q, k = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 40, 16)
    wrong = maskc.block_map(maskc.masks.causal, 2, 40, block_size=(16, 16))
    with pytest.raises(ValueError, match=r"maskc.block_map\(mask, 40, 40\)"):
        maskc.compiled_attention(q, k, k, mask_mod=maskc.masks.causal, block_map=wrong, kv_lens=torch.tensor([30]))


def test_int64_lengths_and_slots_past_int32_are_clamped_not_wrapped():
    """kv_lens and seq_ids past int32 follow the kernel's rules for out-of-range values, a
    length above the keys' reading as theirs, one below 0 as 0, a slot outside the cache as an
    empty sequence; narrowed to int32 they had wrapped (2**32 + 5 read as 5 keys, 2**32 + 2
    as slot 2)."""
    q, k, v = torch.randn(3, 2, 1, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    lens = torch.tensor([2**32 + 5, 2**40, -2**32 + 7])
    out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, kv_lens=lens)
    want = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal,
                                    kv_lens=torch.tensor([40, 40, 0], dtype=torch.int32))
    assert torch.equal(out, want)
    cache = maskc.PagedKVCache(4, 16, 2, 16, dtype=torch.float32, max_seqs=3)
    cache.append(torch.tensor([0, 1, 2]), torch.randn(3, 2, 5, 16), torch.randn(3, 2, 5, 16))
    out, lse = maskc.paged_attention(q[:2], cache, torch.tensor([2**32 + 2, -2**32 + 1]), return_lse=True)
    assert torch.count_nonzero(out) == 0 and torch.isinf(lse).all()


@maskc.mask_mod
def _scattered(b, h, q_idx, kv_idx):
    # no threshold along kv_idx and no tile decided by intervals: analysis alone leaves every tile unsure
    return (q_idx * 7 + kv_idx * 3) % 5 != 0


@pytest.mark.parametrize("capacity", [16384, "paged default"])
def test_a_decoding_map_is_not_evaluated_densely(capacity, monkeypatch, fresh_caches):
    """With kv_lens the map covers every position a query may take, kv_cap × kv_cap; a mask
    analysis cannot settle is left PARTIAL there, for the kernel to evaluate over the rows the
    queries take. Settling it densely asked for 2**28 pairs at 16384 keys (14-26 s for 5 valid
    keys) and was hang-like at the paged cache's default capacity of 131072, whose map also
    keeps within MAX_DECODE_MAP_TILES tiles."""
    from maskc.analysis import dense
    from maskc.runtime.tiles import MAX_DECODE_MAP_TILES

    def refused(expr, env, *args, **kwargs):
        pairs = torch.broadcast_shapes(*(t.shape for t in env.values())).numel()
        raise AssertionError(f"a decoding map evaluated the mask densely on {pairs} pairs")

    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    lens = torch.tensor([5])
    ref, _ = decode_reference(q, k, v, lens, _scattered)
    monkeypatch.setattr(dense, "evaluate", refused)
    if capacity == "paged default":
        cache = maskc.PagedKVCache(128, 1024, 2, 16, dtype=torch.float32, max_seqs=1)
        assert cache.capacity == 131072
        cache.append(torch.tensor([0]), k[:, :, :5], v[:, :, :5])
        out = maskc.paged_attention(q, cache, torch.tensor([0]), mask_mod=_scattered)
    else:
        long_k, long_v = (torch.cat([t, torch.randn(1, 2, capacity - 8, 16)], dim=2) for t in (k, v))
        out = maskc.compiled_attention(q, long_k, long_v, mask_mod=_scattered, kv_lens=lens)
    assert_close_to_reference(out, ref, torch.float32)
    kv_cap = 131072 if capacity == "paged default" else capacity
    found = decode.problem(q, (2, kv_cap, 16, 16), _scattered, None, None, lens=True)  # the call's, cached
    assert found.block_map.n_q * found.block_map.n_kv <= MAX_DECODE_MAP_TILES
