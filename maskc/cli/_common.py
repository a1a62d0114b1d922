"""What every subcommand shares: its two kinds of failure, and numbers printed for people."""
from __future__ import annotations

import argparse
import time


class UsageError(Exception):
    """The arguments are wrong: the command prints its usage and this message, and exits 2."""


class Unavailable(Exception):
    """The arguments are right but this machine cannot do it (no GPU, no matplotlib, a lock
    held too long): the command prints this message and exits 1."""


def positive_int(text: str) -> int:
    """argparse type: an int of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def seconds(text: str) -> float:
    """argparse type: a number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # (nan too)
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, got {text!r}")
    return value


def size(n: float) -> str:
    """Bytes for people, in powers of 1024 as sizes are given (maskc.settings.parse_size)."""
    for unit in ("B", "K", "M"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} G"


def ago(when: float, now: float | None = None) -> str:
    """How long ago the time `when` was, in its largest whole unit ("3 s", "5 min", "2 h", "4 d")."""
    seconds = max(0.0, (time.time() if now is None else now) - when)
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds // length:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def table(rows: list[tuple], head: tuple | None = None) -> str:
    """Rows of cells as left-aligned columns (two spaces apart)."""
    rows = [tuple(str(c) for c in r) for r in ([head] if head else []) + rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


__all__ = ["Unavailable", "UsageError", "ago", "positive_int", "seconds", "size", "table"]
