"""maskc.PagedKVCache on CUDA against a reference of the tokens each slot should hold: random
appends and frees, refusals that write nothing, appends that do not synchronise, appends and frees
captured in a CUDA graph and replayed, and FlashInfer's CSR table round trip."""
from __future__ import annotations

import random

import pytest
import torch

import maskc
from maskc.inference.paged import CacheFullError

from ._common import lane_sample

BF16 = dict(dtype=torch.bfloat16, device="cuda")


def cdiv(a, b):
    return -(-a // b)


class Reference:
    """The tokens each slot should hold."""

    def __init__(self, cache):
        self.cache = cache
        self.k = {s: [] for s in range(cache.max_seqs)}
        self.v = {s: [] for s in range(cache.max_seqs)}

    def length(self, slot):
        return sum(k.shape[1] for k in self.k[slot])

    def fits(self, slots, T):
        P, c = self.cache.page_size, self.cache
        need = sum(cdiv(self.length(s) + T, P) - cdiv(self.length(s), P) for s in slots)
        return all(self.length(s) + T <= c.capacity for s in slots) and need <= self.free_pages()

    def free_pages(self):
        return self.cache.num_pages - sum(cdiv(self.length(s), self.cache.page_size) for s in self.k)

    def append(self, slots, k, v):
        for row, s in enumerate(slots):
            self.k[s].append(k[row])
            self.v[s].append(v[row])

    def free(self, slots):
        for s in slots:
            self.k[s], self.v[s] = [], []

    def check(self):
        c = self.cache
        assert c.lens.tolist() == [self.length(s) for s in range(c.max_seqs)], "lens differ"
        assert c.free_pages() == self.free_pages(), f"{c.free_pages()} pages free, expected {self.free_pages()}"
        for s in range(c.max_seqs):
            k, v = c.gather(s)
            if self.k[s]:
                assert torch.equal(k, torch.cat(self.k[s], 1)), f"slot {s}: k differs"
                assert torch.equal(v, torch.cat(self.v[s], 1)), f"slot {s}: v differs"
            else:
                assert k.shape[1] == 0, f"slot {s} should be empty"


def tokens(B, H, T, D, Dv=None):
    return torch.randn(B, H, T, D, **BF16), torch.randn(B, H, T, Dv or D, **BF16)


@pytest.mark.parametrize("page_size", lane_sample([1, 16, 64, 128], lambda i, v: v == 16))
def test_random_appends_and_frees(page_size):
    """60 random appends (bf16, ragged, strided, D=64 with Dv=32) and frees; an append that does
    not fit is refused."""
    rng = random.Random(page_size)
    cache = maskc.PagedKVCache(cdiv(6000, page_size), page_size, 4, 64, head_dim_v=32, max_seqs=8, device="cuda")
    ref = Reference(cache)
    for _ in range(60):
        slots = rng.sample(range(8), rng.randint(1, 8))
        if rng.random() < 0.25:
            cache.free(torch.tensor(slots, device="cuda"))
            ref.free(slots)
            continue
        T = rng.choice([1, 1, 3, 17, 64, 100, 1000])
        k, v = tokens(len(slots), 4, T, 64, 32)
        if rng.random() < 0.5:  # strided inputs
            k = torch.randn(len(slots), T, 4, 64, **BF16).transpose(1, 2)
        if ref.fits(slots, T):
            cache.append(torch.tensor(slots, device="cuda"), k, v)
            ref.append(slots, k, v)
        else:
            with pytest.raises(CacheFullError):
                cache.append(torch.tensor(slots, device="cuda"), k, v)
        ref.check()


def test_refused_append_writes_nothing():
    cache = maskc.PagedKVCache(5, 16, 2, 128, max_seqs=3, device="cuda")
    ref = Reference(cache)
    k, v = tokens(2, 2, 20, 128)  # two pages each: one of the five is left
    cache.append(torch.tensor([0, 1], device="cuda"), k, v)
    ref.append([0, 1], k, v)
    before = [t.clone() for t in (cache.k_pages, cache.v_pages, cache.page_table, cache.lens)]
    k, v = tokens(3, 2, 20, 128)
    with pytest.raises(CacheFullError, match="needs 4 new pages but 1"):
        cache.append(torch.tensor([0, 1, 2], device="cuda"), k, v)
    after = (cache.k_pages, cache.v_pages, cache.page_table, cache.lens)
    # bitwise: rows never written hold whatever torch.empty left, NaNs included
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after)), \
        "a refused append changed the cache"
    ref.check()
    cache.append(torch.tensor([0, 1, 2], device="cuda"), k, v, check=False)
    cache.append(torch.tensor([2, 2], device="cuda"), *tokens(2, 2, 1, 128), check=False)
    with pytest.raises(CacheFullError, match="2 calls were refused"):
        cache.check()
    ref.check()


def test_append_and_free_do_not_synchronise():
    cache = maskc.PagedKVCache(64, 16, 2, 64, max_seqs=4, device="cuda")
    ids = torch.tensor([0, 2], device="cuda")
    k, v = tokens(2, 2, 33, 64)
    cache.append(ids, k, v)  # compiles outside the watch
    cache.free(ids)
    cache.free(ids[:1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache.append(ids, k, v, check=False)
        cache.free(ids[:1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.lens.tolist() == [0, 0, 33, 0]


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_appends_replayed_from_a_cuda_graph(page_size):
    """200 one-token appends replayed from a captured append (check=True: no sync while
    capturing), then a captured free."""
    cache = maskc.PagedKVCache(cdiv(4 * 300, page_size), page_size, 8, 128, max_seqs=5, device="cuda")
    ref = Reference(cache)
    ids = torch.tensor([3, 1, 0], device="cuda")
    k_in, v_in = tokens(3, 8, 1, 128)
    # compile both kernels for these batch sizes before capture; slots start at one token
    cache.append(ids, k_in, v_in)
    ref.append([3, 1, 0], k_in.clone(), v_in.clone())
    cache.free(torch.tensor([2, 4], device="cuda"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.append(ids, k_in, v_in)
    for _ in range(200):
        k, v = tokens(3, 8, 1, 128)
        k_in.copy_(k)
        v_in.copy_(v)
        graph.replay()
        ref.append([3, 1, 0], k, v)
    cache.check()
    ref.check()
    free_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(free_graph):
        cache.free(ids[1:])
    free_graph.replay()
    ref.free([1, 0])
    ref.check()


def test_from_csr_round_trip():
    """FlashInfer's table (indptr, indices, last page lengths) of a cache, read back, then
    appends into its free pages."""
    cache = maskc.PagedKVCache(200, 16, 2, 64, max_seqs=4, device="cuda")
    ref = Reference(cache)
    for slots, T in (([0, 2], 100), ([2], 7), ([3], 1)):
        k, v = tokens(len(slots), 2, T, 64)
        cache.append(torch.tensor(slots, device="cuda"), k, v)
        ref.append(slots, k, v)
    lens = cache.lens.long()
    counts = (lens + 15) // 16
    indptr = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), counts.cumsum(0)]).int()
    indices = torch.cat([cache.page_table[s, :counts[s]] for s in range(4)])
    last = torch.where(counts > 0, lens - (counts - 1) * 16, 0).int()
    copy = maskc.PagedKVCache.from_csr(cache.k_pages, cache.v_pages, indptr, indices, last)
    ref.cache = copy
    ref.check()
    k, v = tokens(2, 2, 50, 64)
    copy.append(torch.tensor([1, 3], device="cuda"), k, v)
    ref.append([1, 3], k, v)
    ref.check()
