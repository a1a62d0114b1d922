"""maskc.PagedKVCache.append bandwidth on a GPU: eager (one Python call per append) and replayed
from a CUDA graph (the kernel alone), bf16, B=8, Hkv=8, D=128, for T=4096 and T=1 new tokens a
sequence at page sizes 1, 16 and 64, in µs and in GB/s of k and v read plus written.

    bash benchmarks/run_gpu.sh benchmarks/bench_paged.py

The cache's correctness (appends, frees, refusals, CUDA graphs) is tests/gpu/test_paged_cache.py's.
"""
from __future__ import annotations

import torch
import triton
import triton.testing

import maskc


def cdiv(a, b):
    return -(-a // b)


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    B, H, D = 8, 8, 128
    print(f"append, bf16, B={B} Hkv={H} D={D} (reset of lens and top subtracted; GB/s of k, v read + written)")
    print(f"{'T':>6} {'page':>5} {'eager us':>9} {'GB/s':>7} {'graph us':>9} {'GB/s':>7}")
    for T in (4096, 1):
        for P in (1, 16, 64):
            cache = maskc.PagedKVCache(B * cdiv(T, P) + B, P, H, D, max_seqs=B, device="cuda")
            ids = torch.arange(B, device="cuda")
            k, v = (torch.randn(B, H, T, D, dtype=torch.bfloat16, device="cuda") for _ in "kv")
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


if __name__ == "__main__":
    main()
