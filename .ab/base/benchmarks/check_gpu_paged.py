"""maskc.PagedKVCache on a GPU: appends, frees and refusals checked against a reference on
CUDA, appends and frees captured in a CUDA graph, then append bandwidth.

    bash benchmarks/run_gpu.sh benchmarks/check_gpu_paged.py [checks|bench]

Prints one line per check, the number of failures, and a table of append times (bf16, B=8,
Hkv=8, D=128) for T=4096 and T=1 at page sizes 1, 16 and 64: eager (one Python call per
append) and replayed from a CUDA graph (the kernel alone), in µs and in GB/s of k and v read
plus written. Exit status 1 when any check failed.
"""
from __future__ import annotations

import random
import sys
import traceback

import torch
import triton
import triton.testing

import maskc
from maskc.runtime.paged import CacheFullError

DEV = "cuda"
BF16 = dict(dtype=torch.bfloat16, device=DEV)


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


def check_random_ops():
    rng = random.Random(0)
    for P in (1, 16, 64, 128):
        cache = maskc.PagedKVCache(cdiv(6000, P), P, 4, 64, head_dim_v=32, max_seqs=8, device=DEV)
        ref = Reference(cache)
        refused = 0
        for _ in range(60):
            slots = rng.sample(range(8), rng.randint(1, 8))
            if rng.random() < 0.25:
                cache.free(torch.tensor(slots, device=DEV))
                ref.free(slots)
                continue
            T = rng.choice([1, 1, 3, 17, 64, 100, 1000])
            k, v = tokens(len(slots), 4, T, 64, 32)
            if rng.random() < 0.5:  # strided inputs
                k = torch.randn(len(slots), T, 4, 64, **BF16).transpose(1, 2)
            if ref.fits(slots, T):
                cache.append(torch.tensor(slots, device=DEV), k, v)
                ref.append(slots, k, v)
            else:
                refused += 1
                try:
                    cache.append(torch.tensor(slots, device=DEV), k, v)
                    raise AssertionError("an append that does not fit was not refused")
                except CacheFullError:
                    pass
            ref.check()
        yield f"page_size {P}: 60 random appends and frees (bf16, ragged, strided), {refused} refused, match"


def check_all_or_nothing():
    cache = maskc.PagedKVCache(5, 16, 2, 128, max_seqs=3, device=DEV)
    ref = Reference(cache)
    k, v = tokens(2, 2, 20, 128)  # two pages each: one of the five is left
    cache.append(torch.tensor([0, 1], device=DEV), k, v)
    ref.append([0, 1], k, v)
    before = [t.clone() for t in (cache.k_pages, cache.v_pages, cache.page_table, cache.lens)]
    k, v = tokens(3, 2, 20, 128)
    try:
        cache.append(torch.tensor([0, 1, 2], device=DEV), k, v)
        raise AssertionError("not refused")
    except CacheFullError as error:
        assert "needs 4 new pages but 1" in str(error), str(error)
    after = (cache.k_pages, cache.v_pages, cache.page_table, cache.lens)
    # bitwise: rows never written hold whatever torch.empty left, NaNs included
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after)), \
        "a refused append changed the cache"
    ref.check()
    cache.append(torch.tensor([0, 1, 2], device=DEV), k, v, check=False)
    cache.append(torch.tensor([2, 2], device=DEV), *tokens(2, 2, 1, 128), check=False)
    try:
        cache.check()
        raise AssertionError("check() did not raise")
    except CacheFullError as error:
        assert "2 calls were refused" in str(error), str(error)
    ref.check()
    yield "out of pages: refused, nothing written; check=False refusals raised by check()"


def check_no_sync():
    cache = maskc.PagedKVCache(64, 16, 2, 64, max_seqs=4, device=DEV)
    ids = torch.tensor([0, 2], device=DEV)
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
    yield "append(check=False) and free() do not synchronise (torch sync debug mode 'error')"


def check_cuda_graph():
    for P in (1, 16, 64):
        cache = maskc.PagedKVCache(cdiv(4 * 300, P), P, 8, 128, max_seqs=5, device=DEV)
        ref = Reference(cache)
        ids = torch.tensor([3, 1, 0], device=DEV)
        k_in, v_in = tokens(3, 8, 1, 128)
        # compile both kernels for these batch sizes before capture; slots start at one token
        cache.append(ids, k_in, v_in)
        ref.append([3, 1, 0], k_in.clone(), v_in.clone())
        cache.free(torch.tensor([2, 4], device=DEV))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cache.append(ids, k_in, v_in)  # check=True: no sync while capturing
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
        yield f"page_size {P}: 200 T=1 appends replayed from a CUDA graph, and a captured free, match"


def check_from_csr():
    cache = maskc.PagedKVCache(200, 16, 2, 64, max_seqs=4, device=DEV)
    ref = Reference(cache)
    for slots, T in (([0, 2], 100), ([2], 7), ([3], 1)):
        k, v = tokens(len(slots), 2, T, 64)
        cache.append(torch.tensor(slots, device=DEV), k, v)
        ref.append(slots, k, v)
    lens = cache.lens.long()
    counts = (lens + 15) // 16
    indptr = torch.cat([torch.zeros(1, dtype=torch.long, device=DEV), counts.cumsum(0)]).int()
    indices = torch.cat([cache.page_table[s, :counts[s]] for s in range(4)])
    last = torch.where(counts > 0, lens - (counts - 1) * 16, 0).int()
    copy = maskc.PagedKVCache.from_csr(cache.k_pages, cache.v_pages, indptr, indices, last)
    ref.cache = copy
    ref.check()
    k, v = tokens(2, 2, 50, 64)
    copy.append(torch.tensor([1, 3], device=DEV), k, v)
    ref.append([1, 3], k, v)
    ref.check()
    yield "from_csr: FlashInfer's table round trip, then appends into its free pages"


def bench():
    B, H, D = 8, 8, 128
    print(f"append, bf16, B={B} Hkv={H} D={D} (reset of lens and top subtracted; GB/s of k, v read + written)")
    print(f"{'T':>6} {'page':>5} {'eager us':>9} {'GB/s':>7} {'graph us':>9} {'GB/s':>7}")
    for T in (4096, 1):
        for P in (1, 16, 64):
            cache = maskc.PagedKVCache(B * cdiv(T, P) + B, P, H, D, max_seqs=B, device=DEV)
            ids = torch.arange(B, device=DEV)
            k, v = tokens(B, H, T, D)
            lens, top = cache.lens.clone(), cache._top.clone()

            def reset():
                cache.lens.copy_(lens)
                cache._top.copy_(top)

            def step():
                reset()
                cache.append(ids, k, v, check=False)

            step()
            cache.check()
            eager = ms(step) - ms(reset)
            graphs = []
            for fn in (step, reset):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                graphs.append(graph)
            replayed = ms(graphs[0].replay) - ms(graphs[1].replay)
            cache.check()
            gb = 2 * (k.numel() + v.numel()) * k.element_size() / 1e9
            print(f"{T:>6} {P:>5} {eager * 1e3:>9.1f} {gb / (eager * 1e-3):>7.0f} {replayed * 1e3:>9.1f} "
                  f"{gb / (replayed * 1e-3):>7.0f}", flush=True)


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    failures = 0
    parts = sys.argv[1:] or ["checks", "bench"]
    if "checks" in parts:
        for check in (check_random_ops, check_all_or_nothing, check_no_sync, check_cuda_graph, check_from_csr):
            try:
                for line in check():
                    print(f"ok    {line}", flush=True)
            except Exception as error:  # report and go on: one line per failing check
                failures += 1
                print(f"FAIL  {check.__name__}: {type(error).__name__}: {error}", flush=True)
                traceback.print_exc(limit=4)
        print(f"{failures} failures")
    if "bench" in parts:
        bench()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
