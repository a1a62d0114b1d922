"""The `maskc` command, also `python -m maskc`: show, source, cache, doctor, bench.

Exit codes: 0 done; 1 it cannot be done here (no GPU for bench, matplotlib missing for a PNG,
a doctor check failed, a cache lock held too long); 2 bad arguments, with the usage and a
message that says what was wrong.

>>> main(["show", "sliding_window:1024", "--q-len", "16384"])
"""
from __future__ import annotations

import argparse
import sys

from maskc._log import configure
from maskc._version import __version__
from maskc.cli import bench, cache, doctor, mask
from maskc.cli._common import Unavailable, UsageError


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="maskc", description="Inspect masks, their block maps and kernels; look after the kernel cache; check "
                                  "and time maskc on this machine. `maskc COMMAND --help` tells more.")
    top.add_argument("--version", action="version", version=f"maskc {__version__}")
    top.add_argument("-v", "--verbose", action="store_true",
                     help="log what maskc traces, analyses, renders, reads and compiles, with times, on stderr")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (mask, cache, doctor, bench):
        module.add(commands)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: this process's arguments); the exit code."""
    top = parser()
    args = top.parse_args(argv)
    if args.verbose:
        configure("info")
    try:
        return args.run(args)
    except UsageError as error:
        args.parser.error(str(error))  # the subcommand's usage and the message; exit code 2
    except Unavailable as error:
        print(f"maskc {args.command}: {error}", file=sys.stderr)
        return 1


__all__ = ["main", "parser"]
