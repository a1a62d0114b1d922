"""Run a generated source file's checked text as a module, compiled for CUDA or interpreted for CPU.

Triton picks the interpreter when `@triton.jit` runs with TRITON_INTERPRET=1, so the
interpreted copy is made with that variable set; both copies run the same text.

The Triton-key shortcut: before the first compiled load, Triton is handed its cache key
from disk (`triton_key.json` in the kernel cache) so that a new process does not hash
Triton's install again. It replaces `triton.runtime.cache.triton_key`, a private function,
for the whole process. MASKC_TRITON_KEY=0 turns it off (maskc/settings.py); a Triton without
that function, or whose install cannot be stamped, is left to compute its key itself.

Triton's other one-off costs before a first compiled kernel, hashing its install when no key
is stored and building its CUDA driver utilities (a C library, with gcc, once per Triton
cache), run in background threads started once per process by `warm_up()`, which
`kernel_for` calls for CUDA devices: they overlap maskc's rendering and block map, and the
first compiled `load()` waits for them and raises what failed there.
"""
from __future__ import annotations

import json
import linecache
import os
import threading
import types
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import triton
import triton.runtime.cache

from maskc.codegen.render import AST_LOCK
from maskc.runtime.cache import untrusted, write_atomic
from maskc.settings import cache_dir, triton_key_shortcut

_LOCK = threading.Lock()
_TRITON_KEY_FILE = "triton_key.json"


def load(path: Path, *, interpret: bool, text: str | None = None):
    """The module that `text`, the checked contents of the file at `path` (by default the file
    as read now: a file of maskc's own package), makes when it runs as that file.

    NOTE: the text is compiled and run here, not imported: the import system would run whatever
    bytecode `__pycache__` holds for the file (planted, corrupt or stale, whatever the .py
    says) and write some there. Triton reads each @jit function's source through inspect,
    which asks linecache before the file, and reads it again at the first interpreted launch:
    linecache holds `text` under `path` for the life of the process (an entry without a time,
    which linecache.checkcache leaves alone), so a file deleted or replaced after the check,
    by another process's eviction or anyone, changes nothing that runs."""
    if text is None:
        text = path.read_text()
    filename = str(path)
    module = types.ModuleType(f"maskc_generated.{path.stem}{'_interp' if interpret else ''}")
    module.__file__ = filename
    with _LOCK, AST_LOCK:
        if not interpret:
            _WARM_UP.join()
        code = compile(text, filename, "exec", dont_inherit=True)
        linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            exec(code, module.__dict__)
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    return module


def warm_up() -> None:
    """Start Triton's one-off work for compiled kernels in the background, once per process.
    Only for processes that will launch on CUDA: it creates Triton's CUDA driver."""
    _WARM_UP.start()


class _WarmUp:
    """The background work of warm_up(): two threads, since hashing Triton's install and gcc
    both run without the GIL, and so alongside each other and the main thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started = False
        self._key: Future | None = None
        self._driver: Future | None = None

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
            pool = ThreadPoolExecutor(2, thread_name_prefix="maskc-warm-up")
            computed = _replaceable_triton_key()
            if computed is not None:
                self._key = pool.submit(_stored_triton_key, computed)
            self._driver = pool.submit(_driver_utils)
            pool.shutdown(wait=False)  # the threads end with their work; exit waits for a running gcc

    def join(self) -> None:
        """Wait for the work started, if any; hand Triton its key; re-raise what failed in a
        thread, once: later calls find nothing pending and do the work inline, as Triton would."""
        with self._lock:
            key, driver = self._key, self._driver
            self._key = self._driver = None
        try:
            _remember_triton_key(key.result() if key is not None else None)
        finally:
            if driver is not None:
                driver.result()


_WARM_UP = _WarmUp()


def _driver_utils():
    """NOTE: Triton (3.6 to 3.9 at least) creates its CUDA driver on the first use of
    `driver.active`, and the driver's utils are the C library built with gcc (0.3-0.7 s)
    unless Triton's cache holds it."""
    return triton.runtime.driver.active.utils


def _remember_triton_key(prefetched: str | None = None) -> None:
    """NOTE: Triton keys its kernel cache with triton_key(), a hash of its own sources and of
    the 500 MB libtriton.so that every process computes before its first kernel (0.3 s, a
    third of a warm start). It changes only when those files do, so maskc keeps it on disk
    next to the kernels and hands Triton the stored value (`prefetched`: already read or
    computed by warm_up())."""
    computed = _replaceable_triton_key()
    if computed is None:
        return
    key = prefetched if prefetched is not None else _stored_triton_key(computed)
    if key is None:
        return

    def memo() -> str:
        return key

    memo.maskc_memo = True
    triton.runtime.cache.triton_key = memo


def _replaceable_triton_key():
    """Triton's own triton_key function where the shortcut may replace it; None where it is
    turned off, already replaced, or this Triton keys its cache some other way."""
    computed = getattr(triton.runtime.cache, "triton_key", None)
    if not triton_key_shortcut() or not callable(computed) or getattr(computed, "maskc_memo", False):
        return None
    return computed


def _stored_triton_key(compute) -> str | None:
    """The key stored for this Triton install, else `compute()`, stored for the next process;
    None where the install cannot be stamped (a layout this code does not know)."""
    try:
        stamp = _triton_stamp()
    except (OSError, AttributeError, TypeError):
        return None
    home = cache_dir()
    if untrusted(home) is not None:  # not read, as its kernels are not (the kernel cache warns of it)
        return compute()
    path = home / _TRITON_KEY_FILE
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    if stored.get("stamp") == stamp and "key" in stored:
        return stored["key"]
    key = compute()
    try:
        write_atomic(path, json.dumps({"stamp": stamp, "key": key}))
    except OSError:
        pass  # a read-only cache still serves its kernels; each process then hashes, as Triton does
    return key


def _triton_stamp() -> list:
    """Triton's version and the size and time of every file triton_key() can read (its
    Python sources and shared libraries): any reinstall or edit changes it. About 2 ms."""
    root = Path(triton.__file__).parent
    files = [Path(triton.runtime.cache.__file__)]
    for folder in ("compiler", "backends", "language"):
        files += sorted((root / folder).rglob("*.py"))
    files += sorted((root / "_C").glob("*.so"))
    stamp = [triton.__version__]
    for f in files:
        stat = f.stat()
        stamp.append([str(f), stat.st_size, stat.st_mtime_ns])
    return stamp
