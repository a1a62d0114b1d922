"""The `maskc` logger: quiet by default, on stderr where MASKC_LOG or MASKC_DEBUG asks.

Modules log to `logging.getLogger(__name__)` (maskc.trace.tracer, maskc.runtime.cache, ...),
children of `maskc`, which holds a NullHandler so that nothing prints unless asked: by the
environment when maskc is imported (maskc/settings.py), by `maskc -v` on the command line,
or by the application's own logging configuration.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import warnings

from maskc.settings import log_level

LOGGER = logging.getLogger("maskc")
LOGGER.addHandler(logging.NullHandler())


class _Stderr(logging.StreamHandler):
    """The handler maskc adds itself; it writes to whatever sys.stderr is when a record comes."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass  # StreamHandler.__init__ assigns one; the property always answers sys.stderr


def configure(level: str | int) -> None:
    """Print maskc's records at `level` and above on stderr (once: a second call changes the level).

    >>> configure("info")     # what MASKC_LOG=info does when maskc is imported
    """
    LOGGER.setLevel(level.upper() if isinstance(level, str) else level)
    if not any(isinstance(h, _Stderr) for h in LOGGER.handlers):
        LOGGER.addHandler(_Stderr())


def progress(message: str) -> None:
    """One line on stderr where stderr is a terminal (a person waiting), else nothing."""
    stream = sys.stderr
    if stream is not None and stream.isatty():
        print(f"maskc: {message}...", file=stream, flush=True)


@contextlib.contextmanager
def slow(message: str, after: float = 2.0):
    """progress(message) once the block has run `after` seconds: a first call that compiles
    for seconds does not look hung."""
    stream = sys.stderr
    if stream is None or not stream.isatty():
        yield
        return
    timer = threading.Timer(after, progress, (message,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _from_settings() -> None:
    try:
        level = log_level()
    except ValueError as error:  # a typo in a logging knob must not stop the program that imports maskc
        warnings.warn(str(error))
        return
    if level is not None:
        configure(level)


_from_settings()

__all__ = ["LOGGER", "configure", "progress", "slow"]
