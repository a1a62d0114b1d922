"""The backward's float32 dQ sum: zeroing it before the Gluon dK/dV kernel adds into it, and
casting it to the inputs' dtype after, by several means (B=4 H=16 L=8192 D=128: 268 MB).

    bash benchmarks/run_gpu.sh benchmarks/bench_zeroing.py

Prints µs (median of do_bench) and GB/s for each.
"""
from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl


@triton.jit
def _fill_zero(X, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + offs, tl.zeros([BLOCK], tl.float32), mask=offs < n)


@triton.jit
def _cast(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n).to(Y.dtype.element_ty), mask=offs < n)


def main():
    x = torch.empty(4, 16, 8192, 128, device="cuda", dtype=torch.float32)
    n = x.numel()
    libcuda = ctypes.CDLL("libcuda.so.1")

    def memset_driver():
        stream = torch.cuda.current_stream().cuda_stream
        status = libcuda.cuMemsetD32Async(ctypes.c_uint64(x.data_ptr()), ctypes.c_uint(0), ctypes.c_size_t(n),
                                          ctypes.c_void_p(stream))
        assert status == 0, status

    y = torch.empty(x.shape, device="cuda", dtype=torch.bfloat16)
    arms = {
        "zero_() (torch fill)": x.zero_,
        "cuMemsetD32Async": memset_driver,
        "triton store, 4096 a program": lambda: _fill_zero[(triton.cdiv(n, 4096),)](x, n, BLOCK=4096),
        "triton store, 16384 a program": lambda: _fill_zero[(triton.cdiv(n, 16384),)](x, n, BLOCK=16384),
    }
    print(f"zeroing {x.numel() * 4 / 1e6:.0f} MB of float32")
    for name, run in arms.items():
        run()
        torch.cuda.synchronize()
        us = triton.testing.do_bench(run, warmup=25, rep=200) * 1e3
        print(f"  {name:32s} {us:8.1f} µs  {x.numel() * 4 / us / 1e3:7.0f} GB/s")
    x.normal_()
    memset_driver()
    torch.cuda.synchronize()
    assert bool((x == 0).all()), "cuMemsetD32Async left non-zeros"
    x.normal_()
    casts = {
        "x.to(bfloat16)": lambda: x.to(torch.bfloat16),
        "triton cast, 4096 a program": lambda: _cast[(triton.cdiv(n, 4096),)](x, y, n, BLOCK=4096),
    }
    print("casting to bfloat16")
    for name, run in casts.items():
        run()
        us = triton.testing.do_bench(run, warmup=25, rep=200) * 1e3
        print(f"  {name:32s} {us:8.1f} µs  {x.numel() * 6 / us / 1e3:7.0f} GB/s")


if __name__ == "__main__":
    main()
