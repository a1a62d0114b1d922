"""Host work of a call that passes a block map: its Problem is built on every call (the plan
cache is keyed without the map), so the merge of the mods, the split of the score and the
negative-index decision run each time. CPU only, no kernel runs:

    python benchmarks/bench_problem_host.py
    PYTHONPATH=/path/to/other/tree python benchmarks/bench_problem_host.py   # another version

B=1, H=4, L=1024, D=64, float32 tensors on the CPU; best of 7 rounds of 50 `plan.problem_of`
calls, µs a call.
"""
from __future__ import annotations

import time

import torch

import maskc
from maskc import masks, scores
from maskc.runtime import plan
from maskc.trace.mods import as_mask_mod, as_score_mod

B, H, L, D = 1, 4, 1024, 64


def cases():
    documents = torch.arange(L) // 100
    table = torch.randn(2 * L - 1)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + L - 1]

    return {"causal": (masks.causal, None),
            "document + relative bias": (masks.document(documents, causal=True), relative_bias),
            "ALiBi, causal": (masks.causal, scores.alibi(scores.alibi_slopes(H)))}


def main():
    q = torch.randn(B, H, L, D)
    print("| case | µs a Problem |\n|---|---|")
    for name, (mask, score) in cases().items():
        mask_mod, score_mod = as_mask_mod(mask), (as_score_mod(score) if score is not None else None)
        block_map = maskc.block_map(mask, L, L, B=B, H=H)
        traces = plan.traces_of(mask_mod, score_mod)

        def build():
            plan.problem_of(q, q, q, mask_mod, score_mod, None, traces, block_map=block_map)
        build()  # the kernel's source rendered once
        best = float("inf")
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(50):
                build()
            best = min(best, (time.perf_counter() - start) / 50)
        print(f"| {name} | {best * 1e6:.0f} |")


if __name__ == "__main__":
    main()
