"""GPU correctness sweep: ragged lengths, odd head dims, GQA, each load path, against float64;
forward for every tile config autotuning may choose, gradients for the backward's config.

    python benchmarks/check_gpu.py        # on a GPU machine

The CPU test suite runs the same generated kernels through Triton's interpreter; this runs
them compiled, on shapes the benchmarks never use (lengths that are not multiples of the
tile, head dims that are not powers of two), with each tile config autotuning may choose
through tensor descriptors (forced on however small the problem), and the default config
through pointers as well; then dq, dk and dv against float64 autograd of the reference, through
descriptors and pointers. Prints one line per case and a count of failures at the end; exits
non-zero if any case fails.
"""
from __future__ import annotations

import itertools
import sys

import torch

import maskc
import maskc.runtime.launch as launch
from maskc import masks, scores
from maskc.runtime.tiles import forward_candidates, use_config
from maskc.testing import assert_close_to_reference, attention_reference

SHAPES = [  # B, Hq, Hkv, Lq, Lkv, D, Dv
    (2, 4, 4, 1000, 777, 64, 64),
    (1, 8, 2, 333, 1029, 128, 128),
    (2, 2, 1, 257, 257, 72, 40),
    (1, 2, 2, 64, 4096, 128, 64),
]


def cases(Lq, Lkv, H):
    docs = torch.randint(0, 4, (max(Lq, Lkv),), device="cuda").sort().values
    return [
        ("no mask", None, None),
        ("causal", masks.causal, None),
        ("sliding 100", masks.sliding_window(100), None),
        ("document", masks.document(docs, causal=True), None),
        ("ALiBi causal", masks.causal, scores.alibi(scores.alibi_slopes(H).cuda())),
        ("softcap", None, scores.softcap(20.0)),
        ("late keys", masks.causal, late_keys),
    ]


def late_keys(score, b, h, q_idx, kv_idx):
    # a split score mod (codegen/separable.py) whose first kv tiles are -inf in every row
    return score + torch.where(kv_idx >= 40, 0.0, float("-inf"))


def main():
    failures = 0
    launch.DESCRIPTOR_MIN_PAIRS = 0  # descriptors wherever the layout allows, tiny or not
    for (B, Hq, Hkv, Lq, Lkv, D, Dv), dtype in itertools.product(SHAPES, (torch.bfloat16, torch.float16)):
        q = torch.randn(B, Hq, Lq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype)
        v = torch.randn(B, Hkv, Lkv, Dv, device="cuda", dtype=dtype)
        for name, mask, score in cases(Lq, Lkv, Hq):
            kwargs = dict(mask_mod=mask, score_mod=score, enable_gqa=Hq != Hkv)
            ref, ref_lse = attention_reference(q, k, v, **kwargs)
            # each autotuning candidate through descriptors, the default through pointers too
            candidates = forward_candidates(D, "cuda")
            runs = [(c, True) for c in candidates] + [(candidates[0], False)]
            for config, descriptors in runs:
                label = (f"{name:13s} B={B} Hq={Hq} Hkv={Hkv} Lq={Lq} Lkv={Lkv} D={D} Dv={Dv} {dtype} "
                         f"tiles={tuple(config)} tma={descriptors}")
                try:
                    # twice: Triton's entry point, then the direct launch (runtime/launch.py) on copies,
                    # so that the second launch binds new pointers
                    for inputs in ((q, k, v), (q.clone(), k.clone(), v.clone())):
                        with use_config(forward=config, descriptors=descriptors):
                            out, lse = maskc.compiled_attention(*inputs, return_lse=True, **kwargs)
                        assert_close_to_reference(out, ref, dtype)
                        finite = torch.isfinite(ref_lse)
                        assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ"
                        assert_close_to_reference(lse[finite], ref_lse[finite], torch.float32, what="lse")
                    print(f"ok    {label}")
                except AssertionError as e:
                    failures += 1
                    print(f"FAIL  {label}: {e}")
    failures += check_gradients()
    print(f"{failures} failures")
    sys.exit(1 if failures else 0)


def check_gradients() -> int:
    failures = 0
    for (B, Hq, Hkv, Lq, Lkv, D, Dv) in SHAPES[:3]:
        dtype = torch.bfloat16
        q = torch.randn(B, Hq, Lq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype)
        v = torch.randn(B, Hkv, Lkv, Dv, device="cuda", dtype=dtype)
        d_out = torch.randn(B, Hq, Lq, Dv, device="cuda", dtype=dtype)
        for name, mask, score in cases(Lq, Lkv, Hq):
            kwargs = dict(mask_mod=mask, score_mod=score, enable_gqa=Hq != Hkv)
            leaves = [t.double().requires_grad_() for t in (q, k, v)]
            want = torch.autograd.grad(attention_reference(*leaves, **kwargs)[0], leaves, d_out.double())
            for descriptors in (True, False):
                label = f"grad {name:13s} B={B} Hq={Hq} Hkv={Hkv} Lq={Lq} Lkv={Lkv} D={D} Dv={Dv} tma={descriptors}"
                try:
                    for _ in range(2):  # Triton's entry point, then the direct launch
                        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                        with use_config(descriptors=descriptors):
                            out = maskc.compiled_attention(*leaves, **kwargs)
                        got = torch.autograd.grad(out, leaves, d_out)
                        for what, g, w in zip(("dq", "dk", "dv"), got, want):
                            assert_close_to_reference(g, w, dtype, what=what)
                    print(f"ok    {label}")
                except AssertionError as e:
                    failures += 1
                    print(f"FAIL  {label}: {e}")
    return failures


if __name__ == "__main__":
    main()
