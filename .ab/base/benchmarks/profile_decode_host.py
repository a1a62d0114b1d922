"""Where a decoding call's host time goes: cProfile of repeated maskc.compiled_attention calls
with kv_lens (B=8, Hq=32, Hkv=8, D=128, 32768 keys), no mask and a document mask.

    bash benchmarks/run_gpu.sh benchmarks/profile_decode_host.py
"""
import cProfile
import pstats
import time

import torch

import maskc

B, Hq, Hkv, D, L = 8, 32, 8, 128, 32768
q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
docs = torch.repeat_interleave(torch.arange(16, device="cuda"), L // 16)
for name, mask in (("no mask", None), ("document", maskc.masks.document(docs, causal=True))):
    run = lambda: maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True, kv_lens=lens)  # noqa: E731
    run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        run()
        torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} µs per synchronised call")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        run()
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
