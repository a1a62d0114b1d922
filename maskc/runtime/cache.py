"""Kernel cache: generated sources by signature, in memory and on disk.

Files are named for people (`fwd_bf16_d128_bm128_bn64_<hash>.py`), written atomically and
only when missing. `MASKC_CACHE_DIR` overrides the location; `MASKC_DEBUG=1` prints each
source as it is rendered or read.
"""
from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple


class CacheInfo(NamedTuple):
    """hits: kernels found in memory; misses: kernels rendered by this process;
    disk_hits: kernels read from disk without rendering; currsize: kernels in memory."""

    hits: int
    misses: int
    disk_hits: int
    currsize: int


def cache_dir() -> Path:
    """Where generated kernels are kept: $MASKC_CACHE_DIR, else the user's cache directory."""
    env = os.environ.get("MASKC_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "maskc"


def debug() -> bool:
    return os.environ.get("MASKC_DEBUG", "") not in ("", "0")


class SourceCache:
    """Signature -> CompiledKernel in memory; signature -> source file on disk."""

    def __init__(self):
        self._memory: dict = {}
        self._lock = threading.Lock()
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
        """The source stored under `name`, rendering (and writing) it only if missing."""
        path = cache_dir() / f"{name}.py"
        with self._lock:
            if path.exists():
                self.disk_hits += 1
                text = path.read_text()
            else:
                self.misses += 1
                text = render()
                write_atomic(path, text)
        if debug():
            print(f"# maskc kernel {path}\n{text}")
        return text, path


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
