"""MaskMod and ScoreMod: a user function together with its trace, kept current by guards."""
from __future__ import annotations

import functools
import itertools
import types
import weakref

import torch

from maskc.trace.tracer import Traced, callable_name, guards_hold, retraced, trace


# Every mod by its serial number, which maskc's torch operators take as the mod's handle (that
# number as a tensor) or its key (a string with it): a mod is found by either while it lives.
_BY_SERIAL: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_SERIAL = itertools.count()


class _Mod:
    kind = ""
    _maskc_mod = True  # lets the tracer see through composed mods without importing this module

    def __init__(self, fn, name: str | None = None):
        self.fn = fn.fn if isinstance(fn, _Mod) else fn
        # updated=(): a callable object's attributes must not land on (and clobber) the mod's
        functools.update_wrapper(self, self.fn, updated=())
        if name is not None or not hasattr(self, "__name__"):
            self.__name__ = self.__qualname__ = name or callable_name(self.fn)
        self._set_traced(trace(self, self.kind))
        serial = next(_SERIAL)
        # A string for the operators a CUDA graph may record (it takes no CPU tensor); a tensor
        # for the others: a compiled graph takes it as an input, so a new mod (a factory's new
        # window or document ids) runs the same graph, where a string is a constant it guards on.
        self.key = f"{self.__name__}#{serial}"
        self.handle = torch.tensor(serial, dtype=torch.int64, device="cpu")  # (not the default device: meta, cuda)
        _BY_SERIAL[serial] = self

    @property
    def traced(self) -> Traced:
        """The trace of the values the function reads now: traced again when a global, closure
        cell or attribute it read has changed since (a new trace object; the same signature,
        and so the same kernel, when only a captured number changed)."""
        traced = self._traced
        if not guards_hold(traced.guards):
            traced = self._set_traced(retraced(self, self.kind, traced))
        return traced

    def _set_traced(self, traced: Traced) -> Traced:
        self._traced = traced
        # A plain bool for code that torch.compile traces, which must neither run the tracer
        # (re-checking guards) nor read the tensors (Dynamo would guard on each): whether a
        # captured tensor required grad when the mod was last traced (captured_need_grad_for_dynamo).
        self.captured_requires_grad = bool(captured_needing_grad(traced, recording=True))
        # Likewise: whether that trace captured neither a tensor nor a number, so that the plans
        # of a call depend on its shapes alone (a CUDA graph may replay them: runtime/ops.py).
        self.captures_nothing = not traced.tensors and not traced.params
        return traced

    def __call__(self, *args):
        return self.fn(*args)

    @property
    def expr(self):
        return self.traced.expr

    @property
    def signature(self) -> str:
        return self.traced.signature

    def __repr__(self):
        return f"{type(self).__name__}({self.__name__}: {self.traced.expr})"


class MaskMod(_Mod):
    """A traced mask_mod(b, h, q_idx, kv_idx) -> bool; still callable like the function."""

    kind = "mask_mod"


class ScoreMod(_Mod):
    """A traced score_mod(score, b, h, q_idx, kv_idx) -> score; still callable like the function."""

    kind = "score_mod"


def captured_needing_grad(*traces, recording: bool | None = None) -> tuple:
    """The captured tensors of `traces` (Traced or None) whose gradients a call computes: those
    that require grad, where autograd records the call. `recording` defaults to grad mode; an
    autograd Function's forward, which runs with grad mode off while autograd records it,
    passes True. Every eager site asks this; code Dynamo traces asks
    captured_need_grad_for_dynamo."""
    if not (torch.is_grad_enabled() if recording is None else recording):
        return ()
    return tuple(x for t in traces if t is not None for x in t.tensors if x.requires_grad)


def captured_need_grad_for_dynamo(*mods) -> bool:
    """captured_needing_grad for code torch.compile traces, from the flag each mod (MaskMod,
    ScoreMod or None) recorded at its last trace. Two entries exist because Dynamo must neither
    read `mod.traced` (its guard check may run the tracer) nor the captured tensors (it would
    guard on each). The flag is as current as the mod's last trace: where the operator's
    autograd records the call, runtime/ops.py asks the eager rule again."""
    return torch.is_grad_enabled() and any(mod is not None and mod.captured_requires_grad for mod in mods)


def mod_of_key(key: str):
    """The MaskMod or ScoreMod whose `key` this is, or None when it no longer lives."""
    return _BY_SERIAL.get(int(key.rpartition("#")[2]))


def mod_of_handle(handle: torch.Tensor):
    """The MaskMod or ScoreMod whose `handle` this is, or None when it no longer lives."""
    return _BY_SERIAL.get(int(handle))


def mask_mod(fn=None, *, name: str | None = None):
    """Trace `fn` now and return a MaskMod.

    >>> @maskc.mask_mod
    ... def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    """
    if fn is None:
        return lambda f: MaskMod(f, name)
    return MaskMod(fn, name)


def score_mod(fn=None, *, name: str | None = None):
    """Trace `fn` now and return a ScoreMod.

    >>> @maskc.score_mod
    ... def softcap(score, b, h, q_idx, kv_idx):
    ...     return 30.0 * torch.tanh(score / 30.0)
    """
    if fn is None:
        return lambda f: ScoreMod(f, name)
    return ScoreMod(fn, name)


# Plain functions are wrapped and traced on first use, and the wrapper re-checks its trace on
# every use like a decorated mod. A Python function keeps its wrapper as an attribute, so the
# two are freed together (a weak-keyed table would hold the function through the wrapper's
# `fn` forever); other callables (partials, objects) live in the table below.
_plain_traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _as(cls, fn):
    if fn is None or isinstance(fn, cls):
        return fn
    if isinstance(fn, _Mod):
        raise TypeError(f"expected a {cls.kind}, got a {fn.kind} '{fn.__name__}'; "
                        f"pass it as {fn.kind}= instead")
    if isinstance(fn, types.FunctionType):
        attribute = f"_maskc_{cls.kind}"
        cached = fn.__dict__.get(attribute)
        if cached is None:
            cached = cls(fn)
            setattr(fn, attribute, cached)
        return cached
    try:
        cached = _plain_traces.get(fn)
    except TypeError:  # not weak-referenceable: trace every time
        return cls(fn)
    if cached is None:
        cached = _plain_traces[fn] = cls(fn)
    return cached


def as_mask_mod(fn) -> MaskMod | None:
    return _as(MaskMod, fn)


def as_score_mod(fn) -> ScoreMod | None:
    return _as(ScoreMod, fn)
