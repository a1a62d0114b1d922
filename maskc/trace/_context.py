"""State of the trace in progress: whose function it is, and the tensors it captured.

Kept module-level because proxies are created deep inside user code, where no argument can
carry it; tracing is single-threaded per process (guarded by a lock in the tracer).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

from maskc.errors import MaskTraceError


@dataclass
class TraceState:
    kind: str  # "mask_mod" or "score_mod"
    name: str
    filename: str
    lineno: int
    user_codes: set = field(default_factory=set)
    tensors: list = field(default_factory=list)


_state: TraceState | None = None


def begin(state: TraceState) -> None:
    global _state
    _state = state


def end() -> None:
    global _state
    _state = None


def tensor_slot(tensor: torch.Tensor) -> int:
    """The index of `tensor` among the tensors this trace captured, registering it if new."""
    for i, t in enumerate(_state.tensors):
        if t is tensor:
            return i
    _state.tensors.append(tensor)
    return len(_state.tensors) - 1


def _user_location() -> tuple[str, int]:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _state.user_codes:
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return _state.filename, _state.lineno


def fail(what: str, fix: str):
    """Raise MaskTraceError: '<kind> '<name>' <what> at <file>:<line>; <fix>'."""
    if _state is None:
        raise MaskTraceError(f"a traced value {what} outside of tracing; {fix}")
    filename, lineno = _user_location()
    raise MaskTraceError(
        f"{_state.kind} '{_state.name}' {what} at {os.path.basename(filename)}:{lineno} "
        f"({filename}); {fix}"
    )
