"""Kernel cache: generated sources by signature, in memory and on disk.

Files are named for people (`fwd_bf16_d128_bm128_bn64_<hash>.py`), written atomically and
only when missing. The first line of each holds the sha256 of the rest, checked when the file
is read and again before it is imported: a file that fails it (edited, truncated, garbage) is
rendered again and replaced, with a warning. A cache directory that cannot be written
(read-only, or a file) still serves the kernels it holds; new ones go to a private temporary
directory for the rest of the process, with a warning. `MASKC_CACHE_DIR` overrides the
location; `MASKC_DEBUG=1` prints each source as it is rendered or read (maskc/settings.py).
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

from maskc.settings import cache_dir, debug


class CacheInfo(NamedTuple):
    """hits: kernels found in memory; misses: kernels rendered by this process;
    disk_hits: kernels read from disk without rendering; currsize: kernels in memory."""

    hits: int
    misses: int
    disk_hits: int
    currsize: int


class SourceCache:
    """Signature -> CompiledKernel in memory; signature -> source file on disk."""

    def __init__(self):
        self._memory: dict = {}
        self._lock = threading.Lock()
        self._spares: dict[Path, Path] = {}  # unwritable cache directory -> the temporary one used instead
        self.hits = self.misses = self.disk_hits = 0

    def info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, self.disk_hits, len(self._memory))

    def clear(self) -> None:
        """Forget the in-memory kernels and the counters (files on disk stay)."""
        with self._lock:
            self._memory.clear()
            self.hits = self.misses = self.disk_hits = 0

    def get(self, key):
        kernel = self._memory.get(key)
        if kernel is not None:
            self.hits += 1
        return kernel

    def put(self, key, kernel) -> None:
        self._memory[key] = kernel

    def source(self, name: str, render) -> tuple[str, Path]:
        """The source stored under `name` and its file, rendering (and writing) it where the
        file is missing or fails its hash."""
        with self._lock:
            home = cache_dir()
            text, path = self._stored(home, name)
            if text is not None:
                self.disk_hits += 1
            else:
                self.misses += 1
                text = stamped(render())
                path = self._store(home, name, text)
        if debug():
            print(f"# maskc kernel {path}\n{text}")
        return text, path

    def _stored(self, home: Path, name: str) -> tuple[str | None, Path | None]:
        """The intact file of `name` in `home` or in its spare, as (text, path); else (None, None)."""
        for directory in (home, self._spares.get(home)):
            text = _intact(directory / f"{name}.py") if directory is not None else None
            if text is not None:
                return text, directory / f"{name}.py"
        return None, None

    def importable(self, path: Path, text: str) -> Path:
        """A file holding `text` for an import: `path` while it still does, else `text`
        written again (with a warning), since what Python imports is the file, not `text`."""
        with self._lock:
            if _intact(path) == text:
                return path
            return self._store(path.parent, path.stem, text)

    def _store(self, home: Path, name: str, text: str) -> Path:
        """Write `text` as `name` in `home`, or in its spare once `home` proved unwritable."""
        spare = self._spares.get(home)
        path = (spare or home) / f"{name}.py"
        damaged = path.is_file()  # there, but it failed its hash
        try:
            write_atomic(path, text)
        except OSError as error:
            if spare is not None:
                raise
            spare = self._spares[home] = Path(tempfile.mkdtemp(prefix="maskc-kernels-"))
            atexit.register(shutil.rmtree, spare, ignore_errors=True)
            warnings.warn(f"maskc cannot write kernels to its cache directory {home} ({type(error).__name__}: "
                          f"{error}); this process keeps new kernels in the private temporary directory {spare}, "
                          f"deleted at exit; set MASKC_CACHE_DIR to a writable directory to keep them")
            return self._store(home, name, text)
        if damaged:
            warnings.warn(f"maskc kernel file {path} did not match the sha256 on its first line (edited, truncated "
                          f"or corrupted); it was rendered again and replaced")
        return path


_STAMP = "# maskc sha256 "


def stamped(text: str) -> str:
    """`text` under a first line holding the sha256 of it: what a cached kernel file holds."""
    return f"{_STAMP}{hashlib.sha256(text.encode()).hexdigest()}\n{text}"


def _intact(path: Path) -> str | None:
    """The text of the file at `path` if it matches the sha256 on its first line; None where
    it does not, or is missing or unreadable."""
    try:
        data = path.read_bytes()
    except OSError:  # missing, or the cache directory is not a directory
        return None
    head, _, body = data.partition(b"\n")
    if head.decode("latin-1") != _STAMP + hashlib.sha256(body).hexdigest():
        return None
    return data.decode()


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


KERNELS = SourceCache()
