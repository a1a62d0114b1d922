"""maskc.PagedKVCache on CPU tensors (its kernels through Triton's interpreter).

The reference is a Python dict of each slot's tokens: every slot, read back through page_table
and lens (cache.gather), holds exactly what was appended to it, whatever the page size, the
chunks, the frees in between and the appends refused for want of pages or capacity.
"""
import pathlib
from unittest import mock

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import maskc
from maskc.inference import paged
from maskc.inference.paged import CacheFullError

F32 = dict(dtype=torch.float32, device="cpu")
# Elements a program copies (paged._TILE): small tiles split even T=3 over several programs, so
# that pages, their table entries and the bookkeeping are shared between programs.
TILES = [16, paged._TILE]


def _cdiv(a, b):
    return -(-a // b)


def _raises(exc, words, fn, *args, **kwargs):
    """fn(*args, **kwargs) raises `exc` with each of `words` in its message, from outside triton."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    triton_frames = [entry for entry in info.traceback if "triton" in pathlib.Path(str(entry.path)).parts]
    assert not triton_frames, f"error raised from inside triton: {triton_frames[-1]}"
    return message


class Reference:
    """The tokens each slot should hold, and the pages that leaves free."""

    def __init__(self, cache):
        self.cache = cache
        empty_k = torch.empty(cache.num_kv_heads, 0, cache.head_dim, dtype=cache.dtype)
        empty_v = torch.empty(cache.num_kv_heads, 0, cache.head_dim_v, dtype=cache.dtype)
        self.k = {slot: empty_k for slot in range(cache.max_seqs)}
        self.v = {slot: empty_v for slot in range(cache.max_seqs)}

    def tokens(self, seed, slots, T):
        g = torch.Generator().manual_seed(seed)
        c = self.cache
        k = torch.randn(len(slots), c.num_kv_heads, T, c.head_dim, generator=g).to(c.dtype)
        v = torch.randn(len(slots), c.num_kv_heads, T, c.head_dim_v, generator=g).to(c.dtype)
        return k, v

    def needs(self, slots, T):
        P = self.cache.page_size
        return sum(_cdiv(self.k[s].shape[1] + T, P) - _cdiv(self.k[s].shape[1], P) for s in slots)

    def fits(self, slots, T):
        capacity = all(self.k[s].shape[1] + T <= self.cache.capacity for s in slots)
        return capacity and self.needs(slots, T) <= self.free_pages()

    def append(self, slots, k, v):
        for row, s in enumerate(slots):
            self.k[s] = torch.cat([self.k[s], k[row]], 1)
            self.v[s] = torch.cat([self.v[s], v[row]], 1)

    def free(self, slots):
        for s in slots:
            self.k[s], self.v[s] = self.k[s][:, :0], self.v[s][:, :0]

    def free_pages(self):
        return self.cache.num_pages - sum(_cdiv(k.shape[1], self.cache.page_size) for k in self.k.values())

    def assert_matches(self):
        c = self.cache
        assert c.lens.tolist() == [self.k[s].shape[1] for s in range(c.max_seqs)]
        assert c.free_pages() == self.free_pages()
        for s in range(c.max_seqs):
            k, v = c.gather(s)
            assert torch.equal(k, self.k[s]), f"slot {s}: k differs"
            assert torch.equal(v, self.v[s]), f"slot {s}: v differs"
        held = torch.cat([c.page_table[s, :_cdiv(c.lens[s].item(), c.page_size)] for s in range(c.max_seqs)])
        assert held.unique().numel() == held.numel(), "a page belongs to two slots"


# -- appends, frees and refusals against the reference --------------------------------------
@settings(deadline=None, max_examples=10)
@given(st.data())
def test_appends_and_frees_match_the_reference(data):
    _appends_and_frees(data)


@pytest.mark.slow
@settings(deadline=None, max_examples=60)
@given(st.data())
def test_appends_and_frees_match_the_reference_deep(data):
    _appends_and_frees(data)


def _appends_and_frees(data):
    P = data.draw(st.sampled_from([1, 16, 64]), label="page_size")
    heads, (D, Dv) = data.draw(st.integers(1, 2), label="heads"), data.draw(st.sampled_from([(4, 4), (3, 6)]))
    num_pages = data.draw(st.integers(_cdiv(30, P), 4 * _cdiv(40, P)), label="num_pages")
    max_pages = data.draw(st.sampled_from([None, _cdiv(40, P)]), label="max_pages_per_seq")
    with mock.patch.object(paged, "_TILE", data.draw(st.sampled_from(TILES), label="tile")):
        _run_steps(data, maskc.PagedKVCache(num_pages, P, heads, D, head_dim_v=Dv, max_seqs=3,
                                            max_pages_per_seq=max_pages, **F32))


def _run_steps(data, cache):
    ref = Reference(cache)
    for step in range(data.draw(st.integers(1, 6), label="steps")):
        slots = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True), label="slots")
        if data.draw(st.booleans(), label="free"):
            cache.free(torch.tensor(slots))
            ref.free(slots)
            event("free")
        else:
            T = data.draw(st.sampled_from([1, 3, 17, 40]), label="T")
            k, v = ref.tokens(step, slots, T)
            if ref.fits(slots, T):
                cache.append(torch.tensor(slots), k, v)
                ref.append(slots, k, v)
                event("append")
            else:
                event("append refused")
                with pytest.raises(CacheFullError):
                    cache.append(torch.tensor(slots), k, v)
        ref.assert_matches()


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("P", [1, 16, 64])
def test_uneven_chunks_into_a_ragged_batch(P, tile, monkeypatch):
    monkeypatch.setattr(paged, "_TILE", tile)
    cache = maskc.PagedKVCache(_cdiv(200, P) + 2, P, 2, 8, max_seqs=4, **F32)
    ref = Reference(cache)
    # slots start at different lengths, so one append lands at different page offsets per slot
    for seed, (slots, T) in enumerate([([0], 1), ([0, 2], 3), ([2, 3, 0], 17), ([3], 1), ([0, 1, 2, 3], 5),
                                       ([1, 3], 33), ([0, 1, 2, 3], 1)]):
        k, v = ref.tokens(seed, slots, T)
        cache.append(torch.tensor(slots), k, v)
        ref.append(slots, k, v)
    ref.assert_matches()


def test_bf16_strided_inputs_and_other_v_head_dim():
    cache = maskc.PagedKVCache(8, 16, 2, 16, head_dim_v=8, dtype=torch.bfloat16, device="cpu", max_seqs=2)
    assert cache.k_pages.shape == (8, 16, 2, 16) and cache.v_pages.shape == (8, 16, 2, 8)
    k = torch.randn(2, 21, 2, 16).to(torch.bfloat16).transpose(1, 2)  # [B, Hkv, T, D] with T outer
    v = torch.randn(2, 2, 21, 16).to(torch.bfloat16)[..., ::2]  # every other element of D
    ids = torch.tensor([1, 0])
    cache.append(ids, k, v)
    cache.append(ids, k[:, :, :3], v[:, :, :3])
    for row, slot in enumerate(ids.tolist()):
        got_k, got_v = cache.gather(slot)
        assert torch.equal(got_k, torch.cat([k[row], k[row, :, :3]], 1))
        assert torch.equal(got_v, torch.cat([v[row], v[row, :, :3]], 1))


def test_freed_pages_are_reused_and_other_slots_untouched():
    cache = maskc.PagedKVCache(6, 4, 1, 4, max_seqs=3, **F32)
    ref = Reference(cache)
    k, v = ref.tokens(0, [0, 1, 2], 8)
    cache.append(torch.tensor([0, 1, 2]), k, v)
    ref.append([0, 1, 2], k, v)
    assert cache.free_pages() == 0
    slot1_pages = set(cache.page_table[1, :2].tolist())
    cache.free(torch.tensor([1]))
    ref.free([1])
    ref.assert_matches()
    k, v = ref.tokens(1, [2], 5)  # slot 2 grows by two pages: the ones slot 1 gave back
    cache.append(torch.tensor([2]), k, v)
    ref.append([2], k, v)
    ref.assert_matches()
    assert set(cache.page_table[2, 2:4].tolist()) == slot1_pages


def test_freeing_several_slots_at_once_returns_every_page():
    cache = maskc.PagedKVCache(6, 4, 1, 4, max_seqs=3, **F32)
    ref = Reference(cache)
    k, v = ref.tokens(0, [0, 1, 2], 8)
    cache.append(torch.tensor([0, 1, 2]), k, v)
    ref.append([0, 1, 2], k, v)
    freed = set(cache.page_table[0, :2].tolist()) | set(cache.page_table[2, :2].tolist())
    cache.free(torch.tensor([2, 0]))
    ref.free([2, 0])
    k, v = ref.tokens(1, [1], 16)  # every freed page, each once
    cache.append(torch.tensor([1]), k, v)
    ref.append([1], k, v)
    ref.assert_matches()
    assert set(cache.page_table[1, 2:6].tolist()) == freed


def test_free_of_empty_slots_and_empty_calls():
    cache = maskc.PagedKVCache(4, 4, 1, 4, max_seqs=2, **F32)
    ref = Reference(cache)
    cache.free(torch.tensor([0, 1]))
    cache.free(torch.tensor([], dtype=torch.int64))
    cache.append(torch.tensor([0]), *ref.tokens(0, [0], 0))
    cache.append(torch.tensor([], dtype=torch.int64), torch.empty(0, 1, 3, 4), torch.empty(0, 1, 3, 4))
    ref.assert_matches()


# -- running out: all or nothing -------------------------------------------------------------
def _filled(P=4):
    """A cache with 2 of its 5 pages free and slots 0, 1 holding 5 and 4 tokens."""
    cache = maskc.PagedKVCache(5, P, 2, 4, max_seqs=3, **F32)
    ref = Reference(cache)
    for seed, (slots, T) in enumerate([([0, 1], 4), ([0], 1)]):
        k, v = ref.tokens(seed, slots, T)
        cache.append(torch.tensor(slots), k, v)
        ref.append(slots, k, v)
    # a refused append writes nothing at all, not even page rows past the lengths
    before = (cache.k_pages.clone(), cache.v_pages.clone(), cache.page_table.clone())
    return cache, ref, before


def test_out_of_pages_raises_and_changes_nothing():
    cache, ref, _ = _filled()
    k, v = ref.tokens(9, [0, 1, 2], 4)  # slot 0 has 3 rows left in its page: needs 1 + 1 + 1 pages
    _raises(CacheFullError, ["needs 3 new pages", "2 of the cache's 5 are free", "nothing was written",
                             "cache.free(seq_ids)", "more pages"], cache.append, torch.tensor([0, 1, 2]), k, v)
    ref.assert_matches()


def test_refused_append_leaves_page_contents_alone():
    cache, ref, (k_pages, v_pages, table) = _filled()
    k, v = ref.tokens(9, [0, 1, 2], 4)
    with pytest.raises(CacheFullError):
        cache.append(torch.tensor([0, 1, 2]), k, v)
    # bitwise: rows never written hold whatever torch.empty left, NaNs included
    for got, before in ((cache.k_pages, k_pages), (cache.v_pages, v_pages), (cache.page_table, table)):
        assert torch.equal(got.view(torch.uint8), before.view(torch.uint8))


def test_unchecked_refusal_is_raised_by_check_and_then_cleared():
    cache, ref, _ = _filled()
    k, v = ref.tokens(9, [0, 1, 2], 4)
    cache.append(torch.tensor([0, 1, 2]), k, v, check=False)
    cache.append(torch.tensor([0, 1, 2]), k, v, check=False)
    ref.assert_matches()
    _raises(CacheFullError, ["2 calls were refused since the last check()", "needs 3 new pages"], cache.check)
    cache.check()  # the record is cleared
    cache.append(torch.tensor([0, 1, 2]), k, v, check=False)
    # the next checked append raises, though it fits (and is done)
    k1, v1 = ref.tokens(10, [2], 1)
    _raises(CacheFullError, ["needs 3 new pages"], cache.append, torch.tensor([2]), k1, v1)
    ref.append([2], k1, v1)
    ref.assert_matches()


def test_slot_over_capacity():
    cache = maskc.PagedKVCache(10, 4, 1, 4, max_seqs=2, max_pages_per_seq=2, **F32)
    assert cache.capacity == 8
    ref = Reference(cache)
    k, v = ref.tokens(0, [0, 1], 5)
    cache.append(torch.tensor([0, 1]), k, v)
    ref.append([0, 1], k, v)
    k, v = ref.tokens(1, [1, 0], 4)
    _raises(CacheFullError, ["slot 1 holds 5 tokens", "appending 4", "capacity of 8", "max_pages_per_seq=2",
                             "nothing was written"], cache.append, torch.tensor([1, 0]), k, v)
    ref.assert_matches()
    k, v = ref.tokens(2, [0], 9)
    _raises(CacheFullError, ["appending 9 tokens", "capacity of 8"], cache.append, torch.tensor([0]), k, v)
    k, v = ref.tokens(3, [0, 1], 3)  # exactly full
    cache.append(torch.tensor([0, 1]), k, v)
    ref.append([0, 1], k, v)
    ref.assert_matches()


@pytest.mark.parametrize("ids,words", [([0, 3], ["slots in [0, 3)", "got 3"]), ([-1], ["got -1"]),
                                       ([1, 0, 1], ["distinct", "slot 1 twice"])])
def test_bad_slots_change_nothing(ids, words):
    cache, ref, _ = _filled()
    k, v = ref.tokens(9, ids, 1)
    _raises(ValueError, words + ["nothing was stored"], cache.append, torch.tensor(ids), k, v)
    cache.free(torch.tensor(ids))
    ref.assert_matches()
    _raises(ValueError, words + ["nothing was freed"], cache.check)


# -- from_csr ---------------------------------------------------------------------------------
def _csr(cache):
    """FlashInfer's (indptr, indices, last_page_len) for every slot of `cache`."""
    lens = cache.lens.long()
    counts = (lens + cache.page_size - 1) // cache.page_size
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).int()
    indices = torch.cat([cache.page_table[s, :counts[s]] for s in range(cache.max_seqs)])
    last = torch.where(counts > 0, lens - (counts - 1) * cache.page_size, 0).int()
    return indptr, indices, last


@pytest.mark.parametrize("P", [1, 16])
def test_from_csr_round_trip(P):
    cache = maskc.PagedKVCache(_cdiv(60, P) + 3, P, 2, 4, max_seqs=4, **F32)
    ref = Reference(cache)
    for seed, (slots, T) in enumerate([([0, 2], 17), ([2], 3), ([3], 1)]):  # slot 1 stays empty
        k, v = ref.tokens(seed, slots, T)
        cache.append(torch.tensor(slots), k, v)
        ref.append(slots, k, v)
    copy = maskc.PagedKVCache.from_csr(cache.k_pages, cache.v_pages, *_csr(cache))
    assert copy.k_pages is cache.k_pages and copy.max_seqs == 4 and copy.max_pages_per_seq == cache.num_pages
    ref.cache = copy
    ref.assert_matches()
    # its free list holds exactly the unreferenced pages: appends fill them all, then refuse
    k, v = ref.tokens(7, [1, 3], 2)
    copy.append(torch.tensor([1, 3]), k, v)
    ref.append([1, 3], k, v)
    ref.assert_matches()
    k, v = ref.tokens(8, [1], ref.free_pages() * P)  # exactly the free pages
    copy.append(torch.tensor([1]), k, v)
    ref.append([1], k, v)
    assert copy.free_pages() == 0
    k, v = ref.tokens(9, [1], P)
    with pytest.raises(CacheFullError):
        copy.append(torch.tensor([1]), k, v)
    ref.assert_matches()


def test_from_csr_with_unordered_pages():
    P = 4
    k_pages, v_pages = torch.randn(6, P, 1, 4), torch.randn(6, P, 1, 4)
    indptr, indices, last = torch.tensor([0, 2, 3]), torch.tensor([5, 1, 3]), torch.tensor([2, 4])
    cache = maskc.PagedKVCache.from_csr(k_pages, v_pages, indptr, indices, last, max_pages_per_seq=4)
    assert cache.lens.tolist() == [6, 4] and cache.free_pages() == 3
    k, _ = cache.gather(0)
    assert torch.equal(k, torch.cat([k_pages[5], k_pages[1, :2]]).transpose(0, 1))
    assert sorted(cache._free[:3].tolist()) == [0, 2, 4]


@pytest.mark.parametrize("change,words", [
    (dict(indices=torch.tensor([5, 1, 1])), ["page 1 2 times"]),
    (dict(indices=torch.tensor([5, 1, 6])), ["pages in [0, 6)", "to 6"]),
    (dict(last=torch.tensor([0, 4])), ["last_page_len must be in [1, 4]"]),
    (dict(last=torch.tensor([2, 5])), ["last_page_len must be in [1, 4]"]),
    (dict(indptr=torch.tensor([0, 3, 2])), ["indptr must start at 0, never decrease"]),
    (dict(indptr=torch.tensor([0, 2, 4])), ["end at most at len(indices) (3)"]),
    (dict(last=torch.tensor([2])), ["indptr must have B + 1 entries"]),
    (dict(indices=torch.tensor([5.0, 1.0, 3.0])), ["indices must be a 1-d integer tensor"]),
    (dict(max_pages_per_seq=1), ["sequence 0 has 2 pages", "max_pages_per_seq=1"]),
])
def test_from_csr_bad_tables(change, words):
    args = dict(indptr=torch.tensor([0, 2, 3]), indices=torch.tensor([5, 1, 3]), last=torch.tensor([2, 4]),
                max_pages_per_seq=None) | change
    exc = TypeError if "integer tensor" in words[0] else ValueError
    _raises(exc, words, maskc.PagedKVCache.from_csr, torch.randn(6, 4, 1, 4), torch.randn(6, 4, 1, 4),
            args["indptr"], args["indices"], args["last"], max_pages_per_seq=args["max_pages_per_seq"])


def test_from_csr_bad_pages():
    table = (torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1]))
    _raises(ValueError, ["k_pages must be a tensor [num_pages, page_size, Hkv, D]"], maskc.PagedKVCache.from_csr,
            torch.randn(6, 4, 4), torch.randn(6, 4, 1, 4), *table)
    _raises(ValueError, ["share num_pages, page_size and Hkv"], maskc.PagedKVCache.from_csr,
            torch.randn(6, 4, 1, 4), torch.randn(6, 4, 2, 4), *table)
    _raises(ValueError, ["page_size must be a power of two, got 3"], maskc.PagedKVCache.from_csr,
            torch.randn(6, 3, 1, 4), torch.randn(6, 3, 1, 4), *table)


# -- bad inputs --------------------------------------------------------------------------------
@pytest.mark.parametrize("args,kwargs,exc,words", [
    ((0, 16, 1, 8), {}, ValueError, ["num_pages must be a positive int, got 0"]),
    ((4, 12, 1, 8), {}, ValueError, ["page_size must be a power of two, got 12"]),
    ((4, 16, 1.0, 8), {}, ValueError, ["num_kv_heads must be a positive int, got 1.0"]),
    ((4, 16, 1, 8), dict(head_dim_v=-2), ValueError, ["head_dim_v must be a positive int, got -2"]),
    ((4, 16, 1, 8), dict(max_seqs=0), ValueError, ["max_seqs must be a positive int, got 0"]),
    ((4, 16, 1, 8), dict(max_pages_per_seq=True), ValueError, ["max_pages_per_seq must be a positive int"]),
    ((4, 16, 1, 8), dict(dtype=torch.int32), TypeError, ["dtype must be a floating torch.dtype", "int32"]),
    ((4, 16, 1, 8), dict(device="meta"), ValueError, ["CUDA (compiled) or CPU (interpreted)", "meta"]),
    ((4, 2**30, 1, 8), dict(max_pages_per_seq=4), ValueError, ["below 2**31"]),
])
def test_constructor_errors(args, kwargs, exc, words):
    _raises(exc, words, maskc.PagedKVCache, *args, **(dict(max_seqs=2, device="cpu") | kwargs))


def _append_args(**change):
    args = dict(seq_ids=torch.tensor([0, 1]), k=torch.randn(2, 2, 3, 8), v=torch.randn(2, 2, 3, 6)) | change
    return args["seq_ids"], args["k"], args["v"]


@pytest.mark.parametrize("change,exc,words", [
    (dict(k=torch.randn(2, 3, 8)), ValueError, ["k must have 4 dimensions [B, Hkv, T, D]", "(2, 3, 8)"]),
    (dict(v=[1.0]), TypeError, ["v must be a torch.Tensor, got list"]),
    (dict(k=torch.randn(2, 4, 3, 8)), ValueError, ["k has 4 heads but the cache holds 2 kv heads"]),
    (dict(k=torch.randn(2, 2, 3, 6)), ValueError, ["k has head dim 6 but the cache's is 8", "head_dim=6"]),
    (dict(v=torch.randn(2, 2, 3, 8)), ValueError, ["v has head dim 8 but the cache's is 6", "head_dim_v=8"]),
    (dict(k=torch.randn(2, 2, 3, 8, dtype=torch.float64)), TypeError, ["k is torch.float64", ".to(cache.dtype)"]),
    (dict(v=torch.randn(2, 2, 3, 6, device="meta")), ValueError, ["v is on meta but the cache is on cpu"]),
    (dict(v=torch.randn(2, 2, 4, 6)), ValueError, ["k and v must have one batch and length"]),
    (dict(seq_ids=torch.tensor([0])), ValueError, ["batch 2 but seq_ids names 1 slots"]),
    (dict(seq_ids=torch.tensor([0.0, 1.0])), TypeError, ["seq_ids must be a 1-d integer tensor", "float32"]),
    (dict(seq_ids=[0, 1]), TypeError, ["seq_ids must be a 1-d integer tensor", "got list", "torch.tensor([...]"]),
    (dict(seq_ids=torch.tensor([[0, 1]])), TypeError, ["seq_ids must be a 1-d integer tensor", "(1, 2)"]),
    (dict(seq_ids=torch.tensor([0, 1], device="meta")), ValueError, ["seq_ids is on meta"]),
    (dict(seq_ids=torch.tensor([0, 1, 2, 3]), k=torch.randn(4, 2, 3, 8), v=torch.randn(4, 2, 3, 6)), ValueError,
     ["names 4 slots but a call takes at most 3"]),
])
def test_append_errors(change, exc, words):
    cache = maskc.PagedKVCache(4, 16, 2, 8, head_dim_v=6, max_seqs=3, **F32)
    _raises(exc, words, cache.append, *_append_args(**change))
    assert cache.lens.tolist() == [0, 0, 0]


def test_gather_errors_and_repr():
    cache = maskc.PagedKVCache(4, 16, 2, 8, max_seqs=3, **F32)
    _raises(ValueError, ["slot must be an int in [0, 3)", "got 3"], cache.gather, 3)
    assert "PagedKVCache(num_pages=4, page_size=16" in repr(cache)
