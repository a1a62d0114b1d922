"""The decoding kernel compiled on CUDA against the float64 reference: kv_lens (ragged, with 0
and 1), Lq from 1 to 100, GQA groups 1-8, D 64/128, bf16 and fp16, forced and chosen splits,
the serving workloads; then the paged cache at page sizes 1, 16, 64 and 128 against the same
keys held contiguously (identical outputs).

    bash benchmarks/run_gpu.sh benchmarks/check_gpu_decode.py
"""
from __future__ import annotations

import random
import sys

import torch

import maskc
from maskc.runtime.tiles import use_config
from maskc.testing import decode_reference


def workload(name, L, B, H):
    if name == "causal":
        return maskc.masks.causal, None
    if name == "sliding":
        return maskc.masks.sliding_window(random.randint(1, 300)), None
    if name == "document":
        ids = torch.sort(torch.randint(0, 5, (L,), device="cuda")).values
        return maskc.masks.document(ids, causal=True), None
    if name == "prefix":
        return maskc.masks.prefix_lm(random.randint(0, L)), None
    if name == "alibi":
        return maskc.masks.causal, maskc.scores.alibi(maskc.scores.alibi_slopes(H).cuda())
    if name == "softcap":
        return maskc.masks.causal, maskc.scores.softcap(30.0)
    return None, None


def main(cases: int = 120) -> int:
    random.seed(0)
    torch.manual_seed(0)
    failures = 0
    for n in range(cases):
        B, h_kv, group = random.randint(1, 4), random.choice((1, 2, 8)), random.choice((1, 3, 4, 6, 8))
        lq = random.choice((1, 2, 4, 7, 16, 100))
        L = random.randint(lq, 700)
        D = random.choice((64, 128))
        dtype = random.choice((torch.bfloat16, torch.float16))
        lens = torch.tensor([random.choice((0, 1, L, random.randint(0, L))) for _ in range(B)], dtype=torch.int32,
                            device="cuda")
        name = random.choice(("none", "causal", "sliding", "document", "prefix", "alibi", "softcap"))
        mask, score = workload(name, L, B, h_kv * group)
        q = torch.randn(B, h_kv * group, lq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, h_kv, L, D, device="cuda", dtype=dtype)
        v = torch.randn(B, h_kv, L, D, device="cuda", dtype=dtype)
        splits = random.choice((None, 1, 3, 16))
        with use_config(splits=splits):
            out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=True,
                                                kv_lens=lens, return_lse=True)
        ref, ref_lse = decode_reference(q, k, v, lens, mask, score, enable_gqa=True)
        err = (out.double() - ref).abs().max().item()
        same_empty = torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        if err > 3e-2 or not same_empty:
            failures += 1
            print(f"FAIL case {n}: B={B} Hkv={h_kv} group={group} Lq={lq} L={L} D={D} {dtype} {name} "
                  f"splits={splits} lens={lens.tolist()}: max error {err:.3g}, empty rows agree {same_empty}")
    print(f"kv_lens: {cases} cases, {failures} failures", flush=True)

    for page_size in (1, 16, 64, 128):
        B, h_kv, D, L = 3, 2, 128, 1000
        k = torch.randn(B, h_kv, L, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, h_kv, L, D, device="cuda", dtype=torch.bfloat16)
        cache = maskc.PagedKVCache(64 * 128 // page_size, page_size, h_kv, D, dtype=torch.bfloat16, device="cuda",
                                   max_seqs=8)
        seq_ids = torch.tensor([5, 0, 2], dtype=torch.int32, device="cuda")
        start = 0
        for end in (1, 17, 300, 301, 1000):  # uneven chunks
            cache.append(seq_ids, k[:, :, start:end], v[:, :, start:end])
            start = end
        # the same tokens held contiguously, at the cache's capacity: the same problem, so the
        # same tiles and splits, and identical outputs
        pad = torch.zeros(B, h_kv, cache.capacity - L, D, device="cuda", dtype=torch.bfloat16)
        k, v = torch.cat([k, pad], 2), torch.cat([v, pad], 2)
        for lq in (1, 7):
            q = torch.randn(B, h_kv * 4, lq, D, device="cuda", dtype=torch.bfloat16)
            lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
            for mask in (None, maskc.masks.causal, maskc.masks.sliding_window(100)):
                paged = maskc.paged_attention(q, cache, seq_ids, mask_mod=mask, enable_gqa=True)
                flat = maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True, kv_lens=lens)
                if not torch.equal(paged, flat):
                    failures += 1
                    print(f"FAIL paged page_size={page_size} Lq={lq} {getattr(mask, '__name__', None)}: "
                          f"max difference {(paged.float() - flat.float()).abs().max().item():.3g}")
    print(f"total failures: {failures}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 120))
