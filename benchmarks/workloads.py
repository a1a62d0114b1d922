"""The seven workloads of DESIGN.md, as (name, mask_mod, score_mod) for maskc, FlexAttention and SDPA."""
from __future__ import annotations

import torch

from maskc import masks, scores


def document_ids(length: int, docs: int, device, seed: int = 0) -> torch.Tensor:
    """`docs` documents of random lengths packed into `length` tokens."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(length - 1, generator=gen)[: docs - 1] + 1).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([length])]))
    return torch.repeat_interleave(torch.arange(docs), sizes).to(device=device, dtype=torch.int32)


def workloads(length: int, heads: int, device):
    slopes = scores.alibi_slopes(heads).to(device)
    return [
        ("no mask", None, None),
        ("causal", masks.causal, None),
        ("sliding window 1024", masks.sliding_window(1024), None),
        ("prefix-LM L/4", masks.prefix_lm(length // 4), None),
        ("document (12), causal", masks.document(document_ids(length, 12, device), causal=True), None),
        ("ALiBi, causal", masks.causal, scores.alibi(slopes)),
        ("softcap 30, causal", masks.causal, scores.softcap(30.0)),
    ]
