"""Every environment knob maskc reads, in one place (README lists them from SETTINGS).

Each is read when it is used, not at import, so a test or a long-running process can change
it between calls. Nothing else in maskc reads os.environ for its own settings.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class Setting(NamedTuple):
    name: str
    default: str
    meaning: str


SETTINGS = (
    Setting("MASKC_CACHE_DIR", "$XDG_CACHE_HOME/maskc or ~/.cache/maskc",
            "where generated kernels, tuned choices and Triton's stored key are kept"),
    Setting("MASKC_DEBUG", "0", "1 prints each kernel's source as it is rendered or read from the cache"),
    Setting("MASKC_AUTOTUNE", "0",
            "1 times the forward's candidate tiles on the first CUDA call of a kernel and length bucket"),
    Setting("MASKC_TRITON_KEY", "1",
            "0 stops maskc handing Triton its cache key from disk (Triton then hashes its install once per "
            "process, 0.3 s)"),
    Setting("MASKC_DIRECT_LAUNCH", "1",
            "0 launches every call through Triton's JIT entry point instead of the compiled kernel it returned"),
)


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value not in ("0", "false", "False", "no")


def cache_dir() -> Path:
    """Where generated kernels are kept: $MASKC_CACHE_DIR, else the user's cache directory."""
    env = os.environ.get("MASKC_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "maskc"


def debug() -> bool:
    return _flag("MASKC_DEBUG", False)


def autotune() -> bool:
    return _flag("MASKC_AUTOTUNE", False)


def triton_key_shortcut() -> bool:
    return _flag("MASKC_TRITON_KEY", True)


def direct_launch() -> bool:
    return _flag("MASKC_DIRECT_LAUNCH", True)


__all__ = ["SETTINGS", "Setting", "autotune", "cache_dir", "debug", "direct_launch", "triton_key_shortcut"]
