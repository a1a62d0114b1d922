"""`maskc bench`: maskc, FlexAttention and scaled_dot_product_attention side by side on this GPU.

The standard workloads of docs/architecture.md (benchmarks/ uses the same list). TFLOP/s count
4·B·H·D·(pairs the mask keeps) for every implementation; times are medians of
`triton.testing.do_bench`. FlexAttention is `torch.compile(flex_attention)` with
`create_block_mask`; SDPA gets `is_causal` for causal and a dense boolean mask for the other
masks, and cannot take a score_mod. Each maskc output is compared with FlexAttention's.
benchmarks/bench_attention.py measures more (backward, block-map times, the float64 check).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from maskc import masks, scores
from maskc.cli._common import Unavailable, positive_int
from maskc.runtime.api import compiled_attention
from maskc.testing.reference import dense_mask

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# maskc and FlexAttention outputs further apart than this (relative, in norm) are flagged
AGREE = 2e-2


def document_ids(length: int, docs: int, device, seed: int = 0) -> torch.Tensor:
    """`docs` documents of random lengths packed into `length` tokens."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(length - 1, generator=gen)[: docs - 1] + 1).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([length])]))
    return torch.repeat_interleave(torch.arange(docs), sizes).to(device=device, dtype=torch.int32)


def workloads(length: int, heads: int, device) -> list[tuple]:
    """The seven workloads of docs/architecture.md as (name, mask_mod, score_mod)."""
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


def add_bench(commands, help: str) -> None:
    parser = commands.add_parser(
        "bench", help=help,
        description=__doc__.split("\n\n")[1].replace("\n", " ") + " Forward only.")
    parser.add_argument("--quick", action="store_true", help="a short run: B=1 H=8 L=2048, fewer repetitions")
    parser.add_argument("--batch", type=positive_int, help="batch size (default: 4; --quick 1)")
    parser.add_argument("--heads", type=positive_int, help="heads (default: 16; --quick 8)")
    parser.add_argument("--length", type=positive_int, help="sequence length (default: 8192; --quick 2048)")
    parser.add_argument("--dim", type=positive_int, default=128, help="head dim (default: 128)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="inputs' dtype (default: bf16)")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise Unavailable(f"bench times kernels on a CUDA GPU and torch {torch.__version__} sees none here; run it "
                          f"on a GPU machine (maskc doctor shows what torch sees)")
    B = args.batch or (1 if args.quick else 4)
    H = args.heads or (8 if args.quick else 16)
    L = args.length or (2048 if args.quick else 8192)
    D, dtype, rep = args.dim, DTYPES[args.dtype], (25 if args.quick else 100)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype, generator=gen) for _ in range(3))
    flex = torch.compile(flex_attention, dynamic=False)
    print(f"maskc bench: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"B={B} H={H} L={L} D={D} {args.dtype}, forward, TFLOP/s by kept pairs", flush=True)
    rows = []
    for name, mask, score in workloads(L, H, device):
        keep = dense_mask(mask, L, L, device=device)[0, 0] if mask is not None else None
        flops = 4 * B * H * D * (int(keep.sum()) if keep is not None else L * L)
        block_mask = create_block_mask(mask.fn, None, None, L, L, device=device) if mask is not None else None

        def ours():
            return compiled_attention(q, k, v, mask_mod=mask, score_mod=score)

        def theirs():
            return flex(q, k, v, score_mod=score.fn if score else None, block_mask=block_mask)

        sdpa = _sdpa(q, k, v, mask, keep) if score is None else None
        agree = _relative(ours(), theirs()) <= AGREE
        times = [_time(fn, rep) if fn else None for fn in (ours, theirs, sdpa)]
        rows.append((name, *(flops / t / 1e9 if t else None for t in times), agree))
        print(f"  {name}: " + ", ".join(f"{who} {_tf(r)}" for who, r in zip(("maskc", "flex", "sdpa"), rows[-1][1:4]))
              + ("" if agree else "  (maskc and FlexAttention disagree)"), flush=True)
    print()
    print("| workload | maskc | FlexAttention | SDPA | maskc/Flex | maskc/SDPA | agrees with Flex |")
    print("|---|---|---|---|---|---|---|")
    for name, ours_tf, flex_tf, sdpa_tf, agree in rows:
        print(f"| {name} | {_tf(ours_tf)} | {_tf(flex_tf)} | {_tf(sdpa_tf)} | {_ratio(ours_tf, flex_tf)} "
              f"| {_ratio(ours_tf, sdpa_tf)} | {'yes' if agree else 'NO'} |")
    return 0 if all(r[-1] for r in rows) else 1


def _sdpa(q, k, v, mask, keep):
    if mask is None:
        return lambda: F.scaled_dot_product_attention(q, k, v)
    if mask is masks.causal:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _time(fn, rep: int) -> float:
    """Median milliseconds of `fn` (compiled and warmed first)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _tf(value) -> str:
    return f"{value:.0f}" if value is not None else "—"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b is not None else "—"


__all__ = ["add_bench", "document_ids", "run", "workloads"]
