"""State of the trace in progress: whose function it is, and the tensors it captured.

Kept out of the call arguments because proxies are created deep inside user code, where no
argument can carry it. It is per thread, so that a proxy only ever reports to the trace of
its own thread, and a stack, so that a mod body that builds another mod (and so traces it)
gets its own state back afterwards.
"""
from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field

import torch

from maskc.errors import MaskTraceError


@dataclass
class TraceState:
    kind: str  # "mask_mod" or "score_mod"
    name: str
    filename: str
    lineno: int
    user_codes: set = field(default_factory=set)  # shared with the tracer, which adds codes as it rebinds them
    tensors: list = field(default_factory=list)
    # symbol -> origin ("window", "mods[1].prefix") of each captured number made a parameter;
    # shared with the tracer, which adds them as it rebinds captures
    param_origins: dict = field(default_factory=dict)
    # (fetch, source, expected) reads the trace's structure depends on, re-checked on each use;
    # shared with the tracer's own guards
    guards: list = field(default_factory=list)


class Structural(BaseException):
    """Captured numbers (`origins`) reached int(), float(), bool() or a comparison Python
    itself decides (`if window > 0`, min(window, 5), math.log(max_distance / 8)): they
    decide the structure of the trace, not just a value in it, and the trace starts again with
    them as constants. A BaseException, so that a mod's own `except Exception` cannot swallow it."""

    def __init__(self, origins: frozenset):
        super().__init__(", ".join(sorted(origins)))
        self.origins = origins


_local = threading.local()


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current() -> TraceState | None:
    stack = _stack()
    return stack[-1] if stack else None


def begin(state: TraceState) -> None:
    """Make `state` this thread's trace in progress, until the matching end()."""
    _stack().append(state)


def end() -> None:
    _stack().pop()


def tensor_slot(tensor: torch.Tensor) -> int:
    """The index of `tensor` among the tensors this trace captured, registering it if new."""
    state = current()
    if state is None:
        fail("indexes a tensor", "use traced values only inside the mod while maskc traces it")
    tensors = state.tensors
    for i, t in enumerate(tensors):
        if t is tensor:
            return i
    tensors.append(tensor)
    return len(tensors) - 1


def _user_location(state: TraceState) -> tuple[str, int]:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in state.user_codes:
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return state.filename, state.lineno


def location() -> tuple[str, int] | None:
    """The user's file and line that the trace in progress is at, for an error raised later."""
    state = current()
    return None if state is None else _user_location(state)


def fail(what: str, fix: str, at: tuple[str, int] | None = None):
    """Raise MaskTraceError: '<kind> '<name>' <what> at <file>:<line>; <fix>'; the line is the
    user's line running now, or `at` (from location())."""
    state = current()
    if state is None:
        raise MaskTraceError(f"a traced value {what} outside of tracing; {fix}")
    filename, lineno = at or _user_location(state)
    raise MaskTraceError(
        f"{state.kind} '{state.name}' {what} at {os.path.basename(filename)}:{lineno} "
        f"({filename}); {fix}"
    )
