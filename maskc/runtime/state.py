"""Every cache maskc keeps in memory, in one registry: its name, the module that owns it, what it
holds and its bound. `clear_caches()` empties them; `cache_info()` reports each one's size against
its bound.

A cache of maskc.runtime or of a stage after it registers itself where it is made: `lru()` makes
a bounded least-recently-used map (maskc/_slots.py's Slots) and registers it, `register()`
declares a cache of another kind. The caches of trace, analysis and codegen, which maskc.runtime
imports, and the functools caches are declared below by module and name, and read only once
their module is imported.

Some entries are state rather than caches, listed so that `cache_info()` shows all that lives
beside the calls; `clear_caches()` leaves them (their `clear` is None, and `bound` says why):
the weak tables that find live objects by name (mods and block maps by serial number: maskc's
torch operators name them so), the compiles under way, and the tiles a `use_config` block forces.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple

from maskc._slots import Slots


class CacheState(NamedTuple):
    """One cache's size and bound, as functools' cache_info reports them: currsize entries of at
    most maxsize (None where the bound is not a count: see Cache.bound), and where a cache counts
    the bytes its entries keep alive, nbytes of at most maxbytes (None: not counted, or no bound)."""

    currsize: int
    maxsize: int | None
    nbytes: int | None
    maxbytes: int | None


@dataclass(frozen=True)
class Cache:
    """A cache as declared: `name` is its owner module (without "maskc.") and attribute."""

    name: str
    owner: str
    holds: str
    bound: str  # in words, for every cache, whatever maxsize and maxbytes say
    size: Callable[[], int]
    clear: Callable[[], None] | None  # None: state that clear_caches() leaves (see `bound`)
    maxsize: int | None = None
    nbytes: Callable[[], int] | None = None
    maxbytes: Callable[[], int | None] | None = None

    def info(self) -> CacheState:
        return CacheState(self.size(), self.maxsize, self.nbytes() if self.nbytes else None,
                          self.maxbytes() if self.maxbytes else None)


CACHES: dict[str, Cache] = {}
_LOCK = threading.Lock()


def register(owner: str, attribute: str, holds: str, bound: str, *, size: Callable[[], int],
             clear: Callable[[], None] | None, maxsize: int | None = None, nbytes=None, maxbytes=None) -> None:
    """Declare the cache held by `owner`'s module-level `attribute` (a module imported again
    declares it again, replacing the first)."""
    name = f"{owner.removeprefix('maskc.')}.{attribute}"
    with _LOCK:
        CACHES[name] = Cache(name, owner, holds, bound, size, clear, maxsize, nbytes, maxbytes)


def lru(owner: str, attribute: str, holds: str, size: int, held=None, max_bytes=None, bound: str = "") -> Slots:
    """A Slots of `size` entries (and `held`/`max_bytes`, Slots' byte bound), registered."""
    cache = Slots(size, held, max_bytes)
    words = bound or (f"{size} entries, least recently used dropped first"
                      + (", and the bytes they keep alive (the newest entry stays)" if max_bytes else ""))
    register(owner, attribute, holds, words, size=cache.__len__, clear=cache.clear, maxsize=size,
             nbytes=(lambda: cache.nbytes) if held else None, maxbytes=max_bytes)
    return cache


def _declared(owner: str, attribute: str, holds: str, bound: str = "", maxsize: int | None = None, *,
              clears: bool = True, length=None, empty=None) -> None:
    """Declare `owner`.`attribute`, read once `owner` is imported: a functools cache, a function of
    maskc.trace.dag.identity_cache (its Slots are its `entries`), a container, or anything else
    given `length(it)` and `empty(it)`."""
    def found():
        module = sys.modules.get(owner)
        cache = getattr(module, attribute) if module is not None else None
        return getattr(cache, "entries", cache)

    def size() -> int:
        cache = found()
        if cache is None:
            return 0
        if length is not None:
            return length(cache)
        return cache.cache_info().currsize if hasattr(cache, "cache_info") else len(cache)

    def clear() -> None:
        cache = found()
        if cache is not None:
            if empty is not None:
                empty(cache)
            else:
                (cache.cache_clear if hasattr(cache, "cache_clear") else cache.clear)()

    register(owner, attribute, holds, bound or f"{maxsize} entries, least recently used dropped first", size=size,
             clear=clear if clears else None, maxsize=maxsize)


# The caches of the pipeline's first stages (trace, analysis, codegen), which maskc.runtime
# imports: they cannot import this module without a cycle, so they are declared here. Each
# maxsize is checked against the function's own by tests/test_state.py.
_DEVICES = "one entry per device"
_SYMPY = 1 << 16
_declared("maskc.trace.mods", "_BY_SERIAL", "every live MaskMod and ScoreMod by serial number (the torch operators "
          "name them by it: a handle or a key)",
          "weak: an entry goes with its mod; not cleared, as a compiled graph names its mods by it", clears=False)
_declared("maskc.trace.mods", "_plain_traces", "the mods traced from plain callables that are not functions",
          "weak: an entry goes with its callable")
_declared("maskc.trace._functions", "_trace", "the latest trace's state (its captured tensors among it)", "one trace",
          length=lambda trace: int(trace[0] is not None), empty=lambda trace: trace.__setitem__(0, None))
_declared("maskc.trace.proxy", "integral", "whether an expression is an integer, per expression node", maxsize=_SYMPY)
_declared("maskc.trace._functions", "_draws_random", "whether a torch function draws random numbers",
          "one entry per torch function a mod calls")
_declared("maskc.trace.dag", "_holds", "whether an expression holds a node of given kinds", maxsize=_SYMPY)
_declared("maskc.trace.dag", "misleads_sympy", "whether sympy misjudges an expression's sign", maxsize=_SYMPY)
_declared("maskc.trace.dag", "_reads_positions", "whether an expression reads q_idx or kv_idx", maxsize=_SYMPY)
_declared("maskc.trace.canonical", "exact", "whether an expression is exact in floating point", maxsize=_SYMPY)
_declared("maskc.trace.canonical", "_exact_quotient", "whether a quotient is exact", maxsize=_SYMPY)
_declared("maskc.analysis.blockmap", "_BY_SERIAL", "every live BlockMap by serial (the torch operators name them so)",
          "weak: an entry goes with its map; not cleared, as a compiled graph names its maps by serial",
          clears=False)
_declared("maskc.analysis.classify", "_difference", "lhs - rhs of each relation", maxsize=1024)
_declared("maskc.analysis.intervals", "_affine_form", "each expression's affine form", maxsize=1024)
_declared("maskc.analysis.intervals", "_fraction", "each expression's numerator and denominator", maxsize=1024)
_declared("maskc.analysis.intervals", "_doubtful", "the comparisons whose sign a mask's analysis doubts", maxsize=512)
_declared("maskc.analysis.intervals", "_indices_read", "the indices those comparisons read", maxsize=512)
_declared("maskc.analysis.intervals", "_nonnegative_on_host", "whether those indices stay nonnegative", maxsize=512)
_declared("maskc.analysis.pieces", "host_table", "the host's int8 table of each tile-combining operator",
          "one entry per operator (and, or, xor, not)")
_declared("maskc.analysis.pieces", "_table", "each tile-combining operator's table on each device",
          "one entry per operator (and, or, xor, not) and device")
_declared("maskc.analysis.pieces", "_verdicts", "the table of verdicts on each device", _DEVICES)
_declared("maskc.analysis.build", "_free_symbols", "each expression's free symbols", maxsize=1024)
_declared("maskc.analysis.build", "_kv_linear", "each relation's form linear in kv_idx", maxsize=1024)
_declared("maskc.analysis.build", "_atoms", "each expression's comparisons", maxsize=1024)
_declared("maskc.analysis.build", "_reads_kv", "whether each expression reads kv_idx", maxsize=1024)
_declared("maskc.analysis.build", "_negated", "each expression negated", maxsize=1024)
_declared("maskc.analysis.build", "row_wise", "whether each mask expression is decided per row", maxsize=1024)
_declared("maskc.analysis.build", "_keys", "the tile keys of each fixed order of verdicts",
          "one entry per order of verdicts (two), certainty and device")
_declared("maskc.codegen.render", "_environment", "the Jinja environment of each templates folder",
          "one entry per templates folder (the installed one, and benchmarks' copies)")
_declared("maskc.codegen.render", "codegen_hash", "the hash of the templates and the code generator", "one entry")
_declared("maskc.codegen.separable", "separate", "each score expression's separable form", maxsize=512)
_declared("maskc.codegen.source", "_renumbered", "expressions with their captured tensors renumbered", maxsize=512)
# runtime's own functools caches: their modules declare their other caches
_declared("maskc.runtime.descriptors", "_has_copy_engine", "whether a device has the copy engine (TMA)", _DEVICES)
_declared("maskc.runtime.hopper", "_gluon", "Gluon's descriptor types, where this Triton has them", "one entry")
_declared("maskc.runtime.hopper", "_is_hopper", "whether a device is a Hopper GPU", _DEVICES)
_declared("maskc.inference.decode", "_multiprocessors", "each device's multiprocessor count", _DEVICES)
_declared("maskc.integrations.transformers", "_causal_from", "transformers' causal masks by offset and window",
          maxsize=64)
_declared("maskc.integrations.transformers", "_softcap", "transformers' softcap score mods by cap", maxsize=16)


def cache_info() -> dict[str, CacheState]:
    """Every cache maskc keeps in memory, by name (its module and attribute), with its size and
    bound; `maskc.runtime.state.CACHES[name]` says what it holds and the bound in words. A module
    not imported yet (maskc.distributed, say) may have declared nothing: it holds nothing either.

    >>> maskc.cache_info()["runtime.plan.PLANS"]
    CacheState(currsize=3, maxsize=64, nbytes=2048, maxbytes=268435456)
    """
    with _LOCK:
        caches = sorted(CACHES.items())
    return {name: cache.info() for name, cache in caches}


def clear_caches() -> None:
    """Empty every in-memory cache of maskc: plans, block maps, decoding plans, loaded kernels,
    traces of plain functions, conversions, the sympy helpers' caches, the Gluon kernels'
    recorded failures. The next call of each kind builds what it needs again (and gives the same
    answer). In memory only: the kernel files on disk (MASKC_CACHE_DIR, and autotune.json) stay,
    so kernels are read again rather than rendered; `maskc cache clear` deletes those. What is
    state rather than a cache stays (see this module's docstring). A backward under
    torch.compile whose forward ran before the clear raises, naming the fix.

    >>> maskc.clear_caches()
    """
    with _LOCK:
        caches = list(CACHES.values())
    for cache in caches:
        if cache.clear is not None:
            cache.clear()


__all__ = ["CACHES", "Cache", "CacheState", "cache_info", "clear_caches", "lru", "register"]
