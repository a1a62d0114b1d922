"""Every environment knob maskc reads, in one place (docs/guides/settings.md lists them).

Each is read when it is used, not at import, so a test or a long-running process can change
it between calls. Nothing else in maskc reads os.environ for its own settings. Each is checked
as it is read: a value it does not accept raises SettingError (a MaskcError and a ValueError)
naming the variable, the value and the accepted form, whatever else the call would have done.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from maskc.errors import SettingError  # a module of classes alone: settings stays a leaf


class Setting(NamedTuple):
    name: str
    default: str
    meaning: str


SETTINGS = (
    Setting("MASKC_CACHE_DIR", "$XDG_CACHE_HOME/maskc or ~/.cache/maskc",
            "where generated kernels, tuned choices and Triton's stored key are kept"),
    Setting("MASKC_DEBUG", "0", "1 prints each kernel's source as it is rendered or read from the cache, and "
            "turns the maskc logger on at debug level (on stderr; read when maskc is imported)"),
    Setting("MASKC_LOG", "off",
            "debug, info or warning turns the maskc logger on at that level, on stderr: what was traced, analysed, "
            "rendered, read from the cache and compiled, with times (read when maskc is imported)"),
    Setting("MASKC_CACHE_MAX_SIZE", "none",
            "a size like 500M or 2G: after writing a kernel, maskc deletes the least recently used kernel files "
            "until the cache directory's kernels fit (K, M, G: powers of 1024)"),
    Setting("MASKC_PLAN_CACHE_MAX_SIZE", "256M",
            "the bytes each in-memory cache of plans, block maps and decoding plans may keep alive (captured "
            "tensors, tables), past which its least recently used entries go (its newest entry stays); none "
            "bounds them by count alone (64 entries each)"),
    Setting("MASKC_AUTOTUNE", "0",
            "1 times the forward's candidate tiles on the first CUDA call of a kernel and length bucket"),
    Setting("MASKC_TRITON_KEY", "1",
            "0 stops maskc handing Triton its cache key from disk (Triton then hashes its install once per "
            "process, 0.3 s)"),
    Setting("MASKC_GLUON", "1",
            "on Hopper GPUs, 1 runs the Gluon forward (templates/attention_fwd_hopper.py.jinja) and dK/dV kernel "
            "(attention_bwd_hopper.py.jinja; with dQ, not under deterministic algorithms or learnable "
            "captured tensors): the forward where it measured faster, the dK/dV kernel wherever it can "
            "run (maskc/runtime/hopper.py); always both wherever they can run, 0 never"),
    Setting("MASKC_DIRECT_LAUNCH", "1",
            "0 launches every call through Triton's JIT entry point instead of the compiled kernel it returned"),
)


def _flag(name: str, default: bool, accepted: str = "1 or 0") -> bool:
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise SettingError(f"{name} must be {accepted} (1 may also be written true, yes or on; 0 false, no or off), "
                       f"got {value!r}; fix or unset it")


def cache_dir() -> Path:
    """Where generated kernels are kept: $MASKC_CACHE_DIR, else the user's cache directory."""
    env = os.environ.get("MASKC_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "maskc"


def debug() -> bool:
    return _flag("MASKC_DEBUG", False)


def log_level() -> str | None:
    """The level MASKC_LOG names ("debug", "info", ...), "debug" under MASKC_DEBUG=1, else None.

    Raises SettingError for a MASKC_LOG that names no level."""
    value = os.environ.get("MASKC_LOG", "").strip().lower()
    if value in _LEVELS:
        return value
    if value not in ("", "off", "0"):
        raise SettingError(f"MASKC_LOG must be one of {', '.join(_LEVELS)} or off, got {value!r}; fix or unset it")
    return "debug" if debug() else None


_LEVELS = ("debug", "info", "warning", "error")


def cache_max_size() -> int | None:
    """MASKC_CACHE_MAX_SIZE in bytes, or None where it is unset."""
    value = os.environ.get("MASKC_CACHE_MAX_SIZE", "").strip()
    if value.lower() in ("", "none", "0"):
        return None
    try:
        return parse_size(value, "MASKC_CACHE_MAX_SIZE")
    except ValueError:
        raise SettingError(f"MASKC_CACHE_MAX_SIZE must be {_SIZE} or none, got {value!r}; fix or unset it") from None


def plan_cache_max_size() -> int | None:
    """MASKC_PLAN_CACHE_MAX_SIZE in bytes (256 MiB where unset), or None where it is "none"."""
    value = os.environ.get("MASKC_PLAN_CACHE_MAX_SIZE", "").strip()
    if value.lower() == "none":
        return None
    return parse_size(value or "256M", "MASKC_PLAN_CACHE_MAX_SIZE")


_SIZE = "a size like 500M or 2G (K, M, G, T: powers of 1024)"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in a size like "1G", "500M", "1.5g", "64KiB" or "1048576" (units are powers of 1024).

    >>> parse_size("2G")
    2147483648
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise ValueError(f"{what} must be {_SIZE}, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def overridden() -> dict[str, str]:
    """The settings this process's environment sets, by name (for reports such as `maskc doctor`)."""
    return {s.name: os.environ[s.name] for s in SETTINGS if s.name in os.environ}


def autotune() -> bool:
    return _flag("MASKC_AUTOTUNE", False)


def triton_key_shortcut() -> bool:
    return _flag("MASKC_TRITON_KEY", True)


def direct_launch() -> bool:
    return _flag("MASKC_DIRECT_LAUNCH", True)


def gluon() -> str:
    """"auto", "always" or "never" (MASKC_GLUON 1, always, 0)."""
    if os.environ.get("MASKC_GLUON", "").strip().lower() == "always":
        return "always"
    return "auto" if _flag("MASKC_GLUON", True, "1, 0 or always") else "never"


__all__ = ["SETTINGS", "Setting", "autotune", "cache_dir", "cache_max_size", "debug", "direct_launch", "gluon",
           "log_level", "overridden", "parse_size", "plan_cache_max_size", "triton_key_shortcut"]
