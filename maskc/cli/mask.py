"""`maskc show` (a mask's block map: picture, counts, time, PNG) and `maskc source` (its kernel)."""
from __future__ import annotations

import argparse
import textwrap
import time
from pathlib import Path

import torch

from maskc.analysis.build import block_map
from maskc.cli import specs
from maskc.cli._common import Unavailable, UsageError, positive_int
from maskc.errors import MaskcError
from maskc.plot import plot_block_map
from maskc.runtime.api import compile as compile_kernel
from maskc.runtime.kernel import kernel_for
from maskc.trace import symbols as S

DEFAULT_LENGTH = 8192
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def _tiles(text: str) -> tuple[int, int]:
    """argparse type: `128` or `128x64` (q tile × kv tile)."""
    parts = text.lower().replace("×", "x").split("x")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) not in (1, 2) or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be a tile size like 128 or 128x64, got {text!r}")
    return values * 2 if len(values) == 1 else values


def add_show(commands, help: str) -> None:
    show = commands.add_parser(
        "show", help=help,
        description=textwrap.fill(
            "Analyse MASK into its block map and print it: a picture of the tiles (█ FULL: no mask code, "
            "░ PARTIAL: mask evaluated, · EMPTY: skipped), their counts, the sparsity and the time the analysis "
            "took."),
        epilog=specs.help_text("mask") + "\n\nexamples:\n  maskc show sliding_window:1024 --q-len 16384\n"
               "  maskc show document:lengths=1000,3000,4192:causal=true --png docs.png",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    show.add_argument("mask", metavar="MASK", help="the mask (see below)")
    _lengths(show)
    show.add_argument("--block-size", type=_tiles, default=(128, 128), metavar="M[xN]",
                      help="tile size, q × kv (default: 128)")
    show.add_argument("--batch", type=positive_int, metavar="B", help="batch size, for masks that read b")
    show.add_argument("--heads", type=positive_int, metavar="H", help="number of heads, for masks that read h")
    show.add_argument("--b", type=int, default=0, help="the batch index to draw (default: 0)")
    show.add_argument("--h", type=int, default=0, help="the head index to draw (default: 0)")
    show.add_argument("--png", metavar="FILE", help="also draw the map into this PNG file (needs matplotlib)")
    show.set_defaults(run=run_show, parser=show)


def add_source(commands, help: str) -> None:
    source = commands.add_parser(
        "source", help=help,
        description=textwrap.fill(
            "Print the generated Triton source of MASK's kernel, exactly the file that runs (or its path). dtype and "
            "head dim are launch values, checked as a call would check them: one file serves them all but float64, "
            "whose scores run as written."),
        epilog=specs.help_text("mask") + "\nMASK 'none' keeps every pair.\n\n" + specs.help_text("score")
               + "\n\nexamples:\n  maskc source sliding_window:1024 --score-mod softcap:30\n"
                 "  maskc source causal --backward --path",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    source.add_argument("mask", metavar="MASK", help="the mask (see below), or none")
    source.add_argument("--score-mod", metavar="SCORE", help="a score_mod (see below)")
    source.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the inputs' dtype (default: bf16)")
    source.add_argument("--head-dim", type=positive_int, default=128, help="head dim (default: 128)")
    source.add_argument("--backward", action="store_true", help="the backward kernels' file instead of the forward's")
    source.add_argument("--path", action="store_true", help="print the file's path instead of its text")
    source.set_defaults(run=run_source, parser=source)


def _lengths(parser) -> None:
    parser.add_argument("--q-len", type=positive_int, metavar="N",
                        help=f"query length (default: a document mask's total, else {DEFAULT_LENGTH})")
    parser.add_argument("--kv-len", type=positive_int, metavar="N", help="key/value length (default: --q-len)")


def run_show(args) -> int:
    mask, length = specs.resolve(args.mask, "mask")
    q_len = args.q_len or length or DEFAULT_LENGTH
    if length is not None and q_len != length:
        raise UsageError(f"the documents of {args.mask!r} hold {length} tokens but --q-len is {q_len}; pass --q-len "
                         f"{length}, or lengths that add up to {q_len}")
    kv_len = args.kv_len or q_len
    if args.png and Path(args.png).is_dir():
        raise UsageError(f"cannot write --png {args.png}: it is a folder; name a file in it, like "
                         f"{Path(args.png) / 'map.png'}")
    if args.png and not Path(args.png).resolve().parent.is_dir():
        raise UsageError(f"--png {args.png}: no folder {Path(args.png).resolve().parent}; name a file in a folder "
                         f"that exists")
    reads = mask.traced.expr.free_symbols if mask is not None else set()
    for symbol, given, count, index in ((S.B, args.batch, "--batch B", "--b"), (S.H, args.heads, "--heads H", "--h")):
        if symbol in reads and given is None:
            raise UsageError(f"mask {args.mask!r} reads {symbol}, so its block map differs per {symbol}; pass "
                             f"{count} (and {index} to pick which one to draw)")
    start = time.perf_counter()
    try:
        bm = block_map(mask, q_len, kv_len, block_size=args.block_size, B=args.batch, H=args.heads)
        elapsed = time.perf_counter() - start
        print(bm.picture(args.b, args.h))
    except (ValueError, MaskcError) as error:
        raise UsageError(str(error)) from None
    except (MemoryError, RuntimeError) as error:
        if not isinstance(error, MemoryError) and "allocate" not in str(error):
            raise
        raise Unavailable(f"the block map of {args.mask!r} at {q_len}×{kv_len} with tiles of {args.block_size} does "
                          f"not fit in this machine's memory; pass shorter lengths, fewer --batch or --heads, or a "
                          f"larger --block-size") from None
    print(f"block map built in {elapsed * 1e3:.2f} ms")
    if args.png:
        try:
            ax = plot_block_map(bm, b=args.b, h=args.h)
        except ImportError as error:
            raise Unavailable(str(error)) from None
        try:
            # format given: matplotlib writes the file named, where it would add ".png" to a name without it
            ax.figure.savefig(args.png, dpi=100, format="png")
        except OSError as error:
            raise UsageError(f"cannot write --png {args.png}: {error.strerror or error}; name a file you can "
                             f"write") from None
        width, height = ax.figure.canvas.get_width_height()
        print(f"wrote {args.png} ({width}×{height} px)")
    return 0


def run_source(args) -> int:
    mask = None if args.mask == "none" else specs.resolve(args.mask, "mask").mod
    score = specs.resolve(args.score_mod, "score").mod if args.score_mod else None
    dtype = DTYPES[args.dtype]
    try:
        # the source is the same on every device: render it without starting a GPU
        kernel = compile_kernel(mask, score, dtype=dtype, head_dim=args.head_dim, device="cpu")
    except (ValueError, TypeError, MaskcError) as error:
        raise UsageError(str(error)) from None
    if args.backward:
        kernel = kernel_for("bwd", mask.traced if mask else None, score.traced if score else None, dtype,
                            torch.device("cpu"))
    print(kernel.path if args.path else kernel.source, end="\n" if args.path else "")
    return 0


__all__ = ["add_show", "add_source", "run_show", "run_source"]
