"""`maskc cache info|list|clear|prune`: the kernel cache directory, seen and tidied.

Deletions wait for any process loading a kernel from the directory (maskc/runtime/cache.py
holds a shared lock from checking a file to the end of its import) and give up after --wait
seconds; a process that had read a file before it was deleted writes it again when it loads it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from maskc.cli._common import Unavailable, UsageError, ago, seconds, size, table
from maskc.runtime import cache
from maskc.runtime.kernel import provenance
from maskc.settings import cache_dir, cache_max_size, parse_size

# What else maskc keeps beside the kernels (maskc/runtime/autotune.py, loader.py).
OTHER_FILES = {"autotune.json": "tuned tile choices", "triton_key.json": "Triton's stored cache key"}


def add_cache(commands, help: str) -> None:
    parser = commands.add_parser(
        "cache", help=help,
        description="The kernel cache: generated kernel files, tuned tile choices and Triton's stored key, in "
                    "$MASKC_CACHE_DIR (default ~/.cache/maskc). A kernel is stale when no install of this maskc "
                    "version reads it again (another maskc version or codegen wrote it).")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, run, text in (("info", info, "the directory, its size, stale entries and the size cap"),
                            ("list", list_, "each kernel: size, age, last use, what made it and for which mask")):
        action = actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        action.set_defaults(run=run, parser=action)
    clear = actions.add_parser("clear", help="delete every kernel, tuned choice and stored key",
                               description="Delete every kernel, tuned choice and stored key of the cache directory, "
                                           "and the __pycache__ directory older maskc versions left there.")
    clear.set_defaults(run=clear_, parser=clear)
    prune = actions.add_parser(
        "prune", help="delete stale kernels, then the least recently used past a size",
        description="Delete stale kernels (written by another maskc version or codegen, or before maskc tagged its "
                    "files), temporary files of writes that never finished, the __pycache__ directory older maskc "
                    "versions left, and then, with --max-size or "
                    "MASKC_CACHE_MAX_SIZE, the least recently used kernels until the rest fit.")
    prune.add_argument("--max-size", metavar="SIZE", help="keep at most this much, e.g. 500M or 1G (powers of 1024; "
                                                          "default: MASKC_CACHE_MAX_SIZE, if set)")
    prune.add_argument("--dry-run", action="store_true", help="list what would go, delete nothing")
    prune.set_defaults(run=prune_, parser=prune)
    for p in (clear, prune):
        p.add_argument("--wait", type=seconds, default=10.0, metavar="SECONDS",
                       help="how long to wait for processes loading kernels (default: 10)")


def _stale(entry: cache.Entry, current: dict) -> str | None:
    """Why no install of this version reads `entry` again, or None where one may."""
    tags = entry.tags
    if not tags:
        return "written before maskc tagged its files"
    if tags.get("maskc") != current["maskc"]:
        return f"written by maskc {tags.get('maskc')}"
    if tags.get("codegen") != current["codegen"]:
        return "written by other templates or codegen"
    if "kernel" not in tags:  # a file must name the kernel it holds to be read (runtime/cache.py)
        return "written before maskc named the kernel in its files"
    return None


def info(args) -> int:
    home = cache_dir()
    found, current = cache.entries(home), provenance()
    stale = [e for e in found if _stale(e, current)]
    try:
        limit = cache_max_size()
    except ValueError as error:
        raise UsageError(str(error)) from None
    rows = [("directory", f"{home} ({_state(home)})"),
            ("kernels", f"{len(found)} files, {size(sum(e.size for e in found))}"),
            ("stale", f"{len(stale)} files, {size(sum(e.size for e in stale))} (maskc cache prune deletes them)"),
            ("size cap", f"{size(limit)} (MASKC_CACHE_MAX_SIZE)" if limit else "none (set MASKC_CACHE_MAX_SIZE)")]
    for name, meaning in OTHER_FILES.items():
        path = home / name
        rows.append((name, f"{meaning}, {size(path.stat().st_size)}" if path.is_file() else "none"))
    rows.append(("this install", ", ".join(f"{k} {v}" for k, v in current.items())))
    print(table(rows))
    return 0


def _state(home: Path) -> str:
    if not home.exists():
        return "not created yet"
    if not home.is_dir():
        return "not a directory: maskc keeps kernels in a temporary one"
    found = cache.untrusted(home)
    if found is not None:
        return f"not trusted, {found[0]}: maskc keeps kernels in a temporary one; {found[1]}"
    return "writable" if os.access(home, os.W_OK) else "read-only: maskc keeps new kernels in a temporary one"


def list_(args) -> int:
    home = cache_dir()
    found, current = cache.entries(home), provenance()
    if not found:
        print(f"no kernels in {home}")
        return 0
    now = time.time()
    rows = []
    for e in reversed(found):  # most recently used first
        made = f"maskc {e.tags.get('maskc', '?')}, triton {e.tags.get('triton', '?')}"
        mods = "; ".join(e.tags[k] for k in ("first_mask", "first_score") if k in e.tags) or "no mask or score"
        rows.append((e.path.name, size(e.size), ago(e.written, now), ago(e.used, now),
                     f"stale: {_stale(e, current)}" if _stale(e, current) else made, mods))
    print(f"{len(found)} kernels in {home}, {size(sum(e.size for e in found))}")
    print(table(rows, ("file", "size", "written", "last used", "made by", "first made for")))
    return 0


def clear_(args) -> int:
    home = cache_dir()
    found = cache.entries(home)
    others = [home / name for name in OTHER_FILES if (home / name).is_file()] + cache.bytecode(home)
    freed = _remove(home, [e.path for e in found] + others + cache.leftovers(home), args.wait)
    print(f"deleted {_kernels(len(found))}{''.join(f', {p.name}' for p in others)} from {home} ({size(freed)})")
    return 0


def prune_(args) -> int:
    home = cache_dir()
    try:
        limit = parse_size(args.max_size, "--max-size") if args.max_size else cache_max_size()
    except ValueError as error:
        raise UsageError(str(error)) from None
    found, current = cache.entries(home), provenance()
    stale = [e for e in found if _stale(e, current)]
    fresh = [e for e in found if e not in stale]
    over = cache.least_recently_used(fresh, limit) if limit is not None else []
    leftovers, bytecode = cache.leftovers(home), cache.bytecode(home)
    verb = "would delete" if args.dry_run else "deleted"
    summary = "would be deleted" if args.dry_run else "deleted"
    for e in stale:
        print(f"{verb} {e.path.name} ({size(e.size)}): stale, {_stale(e, current)}")
    for e in over:
        print(f"{verb} {e.path.name} ({size(e.size)}): last used {ago(e.used)}, past {size(limit)}")
    for path in leftovers:
        print(f"{verb} {path.name}: an unfinished write")
    for path in bytecode:
        print(f"{verb} {path.name}: bytecode an older maskc left (maskc runs the text it checked)")
    if not args.dry_run:
        _remove(home, [e.path for e in stale + over] + leftovers + bytecode, args.wait)
    kept = sum(e.size for e in fresh if e not in over)
    print(f"{_kernels(len(stale) + len(over))} {summary}; {len(fresh) - len(over)} kept in {home} ({size(kept)})")
    return 0


def _kernels(n: int) -> str:
    return f"{n} kernel" if n == 1 else f"{n} kernels"


def _remove(home: Path, paths: list[Path], wait: float) -> int:
    try:
        return cache.remove(home, paths, wait)
    except TimeoutError as error:
        raise Unavailable(f"{error}, or wait longer with --wait") from None


__all__ = ["OTHER_FILES", "add_cache"]
