"""Autotuning of the forward's tile config: opt in with MASKC_AUTOTUNE=1.

The best tiles depend on the mask and score mod, not only the head dim: on an H100 at D=64,
64×128 tiles beat 64×64 by 9% with no mask and lose by 19% with a 1024 sliding window
(benchmarks/NOTES.md). With autotuning on, the first CUDA call of a kernel signature in a
length bucket times each candidate of `tiles.forward_candidates` on the caller's own
tensors and keeps the fastest in `autotune.json` beside the cached kernels; later calls and
later processes read the choice and time nothing. Tuning compiles every candidate, so it
costs a few seconds once; it is off by default to keep a new mask's first call short.

Limits: the key is the kernel signature and the length buckets, not the captured values, so
sliding_window(128) and sliding_window(8192) share one choice; `maskc.compile()` shows the
default-tile kernel, not a tuned one; two processes (or threads) meeting a new key at once
both tune it, and the last to write wins, which costs at most a later re-tune.
"""
from __future__ import annotations

import json
import logging
import threading

from triton.runtime.errors import OutOfResources

from maskc._log import progress
from maskc.runtime import state
from maskc.runtime.cache import write_atomic
from maskc.runtime.tiles import TileConfig
from maskc.settings import cache_dir

_FILE = "autotune.json"
_LOCK = threading.Lock()
_choices: dict | None = None  # the file's contents, read once per process
_log = logging.getLogger("maskc")


def bucket(length: int) -> int:
    """Lengths share a choice within a power of two."""
    return 1 << max(0, length - 1).bit_length()


def tuned(key: str, candidates: list[TileConfig], seconds_of) -> TileConfig:
    """The stored choice for `key`, else the candidate with the least median of three rounds of
    `seconds_of(config)` (timed in turn, so that clock and power drift fall on all alike),
    stored for later calls and processes. Candidates that do not fit the GPU are skipped."""
    with _LOCK:
        stored = _stored().get(key)
    if stored is not None:
        return TileConfig(*stored)
    times = {c: [] for c in candidates}
    progress(f"autotuning {len(candidates)} tile configs, once per kernel and length bucket (kept in {_FILE})")
    for _ in range(3):
        for c in list(times):
            try:
                times[c].append(seconds_of(c))
            except OutOfResources as e:
                if c == candidates[0]:
                    raise  # the default config must run; this is not a tuning question
                # a GPU with less shared memory than an H100: that candidate cannot run here
                _log.info("maskc autotune %s: %s does not fit (%s)", key, tuple(c), e)
                del times[c]
    best = min(times, key=lambda c: sorted(times[c])[1])
    _log.info("maskc autotune %s: %s (medians %s)", key, tuple(best),
              {tuple(c): f"{sorted(t)[1] * 1e3:.3f} ms" for c, t in times.items()})
    with _LOCK:
        _stored()[key] = list(best)
        _write()
    return best


def forget() -> None:
    """Drop the choices read in this process (the next lookup reads the file again)."""
    global _choices
    with _LOCK:
        _choices = None


state.register(__name__, "_choices", "the tuned tile choices read from autotune.json",
               "the file's entries, one per kernel signature and length bucket tuned; cleared, the file stays",
               size=lambda: len(_choices or ()), clear=forget)


def _stored() -> dict:
    global _choices
    if _choices is None:
        try:
            _choices = json.loads((cache_dir() / _FILE).read_text())
        except (OSError, ValueError):
            _choices = {}
    return _choices


def _write() -> None:
    path = cache_dir() / _FILE
    try:  # another process may have tuned other keys meanwhile: keep theirs too
        merged = {**json.loads(path.read_text()), **_choices}
    except (OSError, ValueError):
        merged = dict(_choices)
    try:
        write_atomic(path, json.dumps(merged, indent=1, sort_keys=True))
    except OSError as e:  # a read-only cache: the choice still serves this process
        _log.warning("maskc autotune: could not store choices in %s (%s); later processes will tune again", path, e)
