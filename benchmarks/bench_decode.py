"""Decoding: maskc's split-KV kernel beside FlexAttention (compiled, which decodes at small Lq)
and scaled_dot_product_attention, in one run.

    bash benchmarks/run_gpu.sh benchmarks/bench_decode.py            # the reference shape
    bash benchmarks/run_gpu.sh benchmarks/bench_decode.py --graphs   # replayed from CUDA graphs
    bash benchmarks/run_gpu.sh benchmarks/bench_decode.py --quick    # fewer rows

The reference shape: bf16, B=8, Hq=32, Hkv=8, D=128, 32768 keys per sequence (K+V = 1.07 GB;
320 µs at the H100's 3.35 TB/s). The queries are the last Lq tokens (maskc: kv_lens; FlexAttention:
its mask offset by hand; SDPA: a bottom-right causal mask). GB/s counts the K and V bytes of the
keys the mask keeps, once; do_bench flushes L2 between runs. A decoding step is short enough
that the host's launch can be what is timed: --graphs replays each call from a CUDA graph. Every maskc output is checked
against FlexAttention's (or SDPA's) before it is timed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).parent))
import maskc  # noqa: E402
from maskc.inference import decode  # noqa: E402
from _results import JSON_HELP, Figure, write  # noqa: E402

# one compiled FlexAttention per query length and mask: more than Dynamo's default 8 recompiles
torch._dynamo.config.recompile_limit = 64
flex = torch.compile(flex_attention, dynamic=False)
PEAK_GBS = 3350.0  # H100 SXM HBM3


GRAPHS = "--graphs" in sys.argv
FIGURES: list[Figure] = []  # every printed time, for --json
NAMES = {"maskc": "maskc", "flex": "FlexAttention", "sdpa": "SDPA"}


def bench(fn) -> float:
    """µs of one call: with --graphs, replayed from a CUDA graph (the GPU's time alone, as a
    serving loop that captures its step sees it); else do_bench, host launch included where the
    host is slower than the kernel."""
    if GRAPHS:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def offset_mask(mask, offset: int):
    """FlexAttention's mask at decode: its q_idx counts from 0, so the step's position is added by hand."""
    def shifted(b, h, q_idx, kv_idx):
        return mask(b, h, q_idx + offset, kv_idx)
    return shifted


def row(name, lq, kept_keys, B, Hkv, D, times: dict, baseline: str | None):
    bytes_ = 2 * B * Hkv * kept_keys * D * 2
    mine = times["maskc"]
    cells = [f"{name:<22} Lq={lq:<3}", f"maskc {mine:8.1f} µs {bytes_ / mine / 1e3:7.0f} GB/s ({bytes_ / mine / 1e3 / PEAK_GBS:4.0%})"]
    for other in ("flex", "sdpa"):
        if other in times:
            cells.append(f"{other} {times[other]:8.1f} µs (×{times[other] / mine:4.2f})")
    print(" | ".join(cells), flush=True)
    workload = f"{name}, Lq={lq}"
    FIGURES.extend(Figure(workload, NAMES[impl], "time", t, "µs") for impl, t in times.items())
    FIGURES.append(Figure(workload, "maskc", "bandwidth", bytes_ / mine / 1e3, "GB/s"))


def check(a, b, what):
    err = (a.float() - b.float()).abs().max().item()
    if err > 2e-2:
        raise AssertionError(f"{what}: maskc differs from the reference implementation by {err}")


def decode_rows(args):
    B, Hq, Hkv, D, L = args.batch, 32, 8, 128, args.length
    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    docs = torch.repeat_interleave(torch.arange(16, device=dev), L // 16)
    cases = [("no mask", None), ("causal", maskc.masks.causal)]
    if not args.quick:
        cases += [("sliding window 4096", maskc.masks.sliding_window(4096)),
                  ("document (16)", maskc.masks.document(docs, causal=True))]
    for lq in args.lq:
        q = torch.randn(B, Hq, lq, D, device=dev, dtype=dt)
        for name, mask in cases:
            if lq > 1 and name.startswith(("sliding", "document")) and args.quick:
                continue
            times = {}
            out = maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True, kv_lens=lens)
            times["maskc"] = bench(lambda: maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True,
                                                                     kv_lens=lens))
            if args.debug:
                found = [p for p in decode.DECODES.values() if p.Lq == lq and p.B == B][-1]
                t0 = time.perf_counter()
                for _ in range(100):
                    maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True, kv_lens=lens)
                host = (time.perf_counter() - t0) * 1e4
                torch.cuda.synchronize()
                print(f"  {name}: splits {found.splits}, widest span {(found.tables['SPAN_HI'] - found.tables['SPAN_LO']).clamp(min=0).max().item()} map tiles, "
                      f"{host:.1f} µs per call enqueued", flush=True)
            fmask = offset_mask(mask, L - lq) if mask is not None else None
            bm = create_block_mask(fmask, B if name.startswith("document") else None, None, lq, L,
                                   device=dev) if fmask is not None else None
            ref = flex(q, k, v, block_mask=bm, enable_gqa=True)
            check(out, ref, f"{name} Lq={lq} vs FlexAttention")
            times["flex"] = bench(lambda: flex(q, k, v, block_mask=bm, enable_gqa=True))
            if mask is None or name == "causal":
                attn_mask = causal_lower_right(lq, L) if mask is not None else None
                times["sdpa"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                                             enable_gqa=True))
            kept = {"sliding window 4096": 4096, "document (16)": L // 16}.get(name, L)
            row(name, lq, kept, B, Hkv, D, times, None)


def paged_rows(args):
    B, Hq, Hkv, D, L = args.batch, 32, 8, 128, args.length
    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    base = bench(lambda: maskc.compiled_attention(q, k, v, enable_gqa=True, kv_lens=lens))
    ref = maskc.compiled_attention(q, k, v, enable_gqa=True, kv_lens=lens)
    FIGURES.append(Figure("contiguous cache, Lq=1", "maskc", "time", base, "µs"))
    seq_ids = torch.arange(B, dtype=torch.int32, device=dev)
    for page_size in args.page_sizes:
        cache = maskc.PagedKVCache(B * L // page_size, page_size, Hkv, D, dtype=dt, device=dev, max_seqs=B,
                                   max_pages_per_seq=L // page_size)
        cache.append(seq_ids, k, v)
        out = maskc.paged_attention(q, cache, seq_ids, enable_gqa=True)
        check(out, ref, f"paged (page size {page_size}) vs contiguous")
        t = bench(lambda: maskc.paged_attention(q, cache, seq_ids, enable_gqa=True))
        print(f"paged, page size {page_size:<4} Lq=1   | {t:8.1f} µs | {base / t:5.1%} of contiguous ({base:.1f} µs)",
              flush=True)
        FIGURES.append(Figure(f"paged, page size {page_size}, Lq=1", "maskc", "time", t, "µs"))
        del cache


def batch_rows(args):
    B, Hq, Hkv, D, L = 64, 32, 8, 128, 4096
    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    times = {"maskc": bench(lambda: maskc.compiled_attention(q, k, v, enable_gqa=True, kv_lens=lens)),
             "flex": bench(lambda: flex(q, k, v, enable_gqa=True)),
             "sdpa": bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))}
    row("batch 64 × 4096", 1, L, B, Hkv, D, times, None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--lq", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--debug", action="store_true", help="print each maskc row's splits and host time")
    parser.add_argument("--graphs", action="store_true", help="time calls replayed from CUDA graphs")
    parser.add_argument("--only", choices=("decode", "paged", "batch"), nargs="+",
                        default=("decode", "paged", "batch"))
    parser.add_argument("--json", metavar="PATH", help=JSON_HELP)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    print(f"bf16, B={args.batch}, Hq=32, Hkv=8, D=128, {args.length} keys; "
          f"{'CUDA graphs' if args.graphs else 'do_bench (L2 flushed)'}", flush=True)
    for part in args.only:
        {"decode": decode_rows, "paged": paged_rows, "batch": batch_rows}[part](args)
    write(args.json, "decode", "Decoding", f"bf16, B={args.batch} Hq=32 Hkv=8 D=128, {args.length} keys a sequence, "
          f"{'CUDA graphs' if args.graphs else 'do_bench (L2 flushed)'}", FIGURES)


if __name__ == "__main__":
    main()
