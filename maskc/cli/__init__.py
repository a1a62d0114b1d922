"""The `maskc` command, also `python -m maskc`: show, source, cache, doctor, bench.

Exit codes: 0 done; 1 it cannot be done here (no GPU for bench, matplotlib missing for a PNG,
a doctor check failed, a cache lock held too long); 2 bad arguments, with the usage and a
message that says what was wrong.

>>> main(["show", "sliding_window:1024", "--q-len", "16384"])
"""
from __future__ import annotations

import argparse
import importlib
import sys

from maskc._log import configure
from maskc._version import __version__
from maskc.cli._common import Unavailable, UsageError

# Each command: the module that declares (add_<command>) and runs it, and its line in `maskc --help`.
# NOTE: a command's module is imported only when that command runs or prints its help: most
# need torch and the pipeline, and `maskc --help` needs neither (tests/test_import_cost.py).
COMMANDS = {
    "show": ("maskc.cli.mask", "print a mask's block map (FULL/PARTIAL/EMPTY tiles), optionally as a PNG"),
    "source": ("maskc.cli.mask", "print the Triton kernel maskc generates for a mask (and score_mod)"),
    "cache": ("maskc.cli.cache", "show, list, clear or prune the kernel cache"),
    "doctor": ("maskc.cli.doctor", "report versions, GPU, fast paths and cache, and run a tiny kernel"),
    "bench": ("maskc.cli.bench", "time maskc, FlexAttention and SDPA on the standard workloads (needs a GPU)"),
}


def parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `maskc` parser: every command's arguments, or with `command`, that command's alone
    (the others are listed by name and help line, their modules not imported)."""
    top = argparse.ArgumentParser(
        prog="maskc", description="Inspect masks, their block maps and kernels; look after the kernel cache; check "
                                  "and time maskc on this machine. `maskc COMMAND --help` tells more.")
    top.add_argument("--version", action="version", version=f"maskc {__version__}")
    top.add_argument("-v", "--verbose", action="store_true",
                     help="log what maskc traces, analyses, renders, reads and compiles, with times, on stderr")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, line) in COMMANDS.items():
        if command is None or command == name:
            getattr(importlib.import_module(module), f"add_{name}")(commands, line)
        else:
            commands.add_parser(name, help=line)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: this process's arguments); the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # the command is the first word that is not an option: no option of `maskc` itself takes a value
    top = parser(next((word for word in argv if not word.startswith("-")), ""))
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
