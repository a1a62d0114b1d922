"""Trace a mask_mod or score_mod into a canonical sympy expression.

The user function is re-created with its captured Python numbers replaced by parameter
proxies (closure cells and referenced globals, recursively through helper functions and
composed mods), then called with proxies for b, h, q_idx, kv_idx (and score).
"""
from __future__ import annotations

import hashlib
import inspect
import os
import threading
import types
from dataclasses import dataclass

import sympy
import torch

from maskc.errors import MaskTraceError
from maskc.trace import _context
from maskc.trace.canonical import canonicalize
from maskc.trace.proxy import Proxy, wrap
from maskc.trace.symbols import INDEX_SYMBOLS, LOADS, SCORE, is_load, param_symbol

_LOCK = threading.Lock()
# Functions from these packages are library code: never re-bound, never treated as user code.
_LIBRARY_PREFIXES = ("torch", "numpy", "sympy", "builtins", "math", "functools")


@dataclass(frozen=True)
class Param:
    """A captured Python number that became a runtime kernel argument."""

    symbol: sympy.Symbol
    value: int | float
    origin: str  # where it came from, for people: "window", "mods[1].prefix"


@dataclass(frozen=True)
class Traced:
    """The result of tracing: what the kernel computes, and the values it reads at run time."""

    kind: str
    name: str
    expr: sympy.Basic
    params: tuple[Param, ...]
    tensors: tuple[torch.Tensor, ...]

    signature: str = ""  # canonical text of expr: equal for equivalent spellings and any values

    def __post_init__(self):
        # computed once: the signature is part of every kernel-cache lookup on the hot path
        object.__setattr__(self, "signature", sympy.srepr(self.expr))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.signature.encode()).hexdigest()[:16]

    def param_values(self) -> dict[sympy.Symbol, int | float]:
        return {p.symbol: p.value for p in self.params}


class _Rebinder:
    """Copies user functions with captured numbers swapped for parameter proxies."""

    def __init__(self):
        self.params: list[tuple[sympy.Symbol, int | float, str]] = []
        self.codes: set = set()
        self._done: dict[int, object] = {}

    def function(self, fn: types.FunctionType, origin: str) -> types.FunctionType:
        if id(fn) in self._done:
            return self._done[id(fn)]
        code = fn.__code__
        self.codes.add(code)
        self.codes.update(c for c in code.co_consts if isinstance(c, types.CodeType))
        cells = []
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell: a name assigned later in the enclosing scope
                cells.append(cell)
                continue
            cells.append(types.CellType(self.value(value, _join(origin, name))))
        fn_globals = dict(fn.__globals__)
        for name in code.co_names:
            if name in fn_globals:
                fn_globals[name] = self.value(fn_globals[name], _join(origin, name))
        new = types.FunctionType(code, fn_globals, fn.__name__, fn.__defaults__, tuple(cells) or None)
        new.__kwdefaults__ = fn.__kwdefaults__
        self._done[id(fn)] = new
        return new

    def value(self, value, origin: str):
        if isinstance(value, bool):
            return value  # flags choose structure: they stay constants in the expression
        if isinstance(value, (int, float)):
            symbol = param_symbol(len(self.params), isinstance(value, int))
            self.params.append((symbol, value, origin))
            return Proxy(symbol)
        if isinstance(value, (list, tuple)) and any(callable(v) for v in value):
            return type(value)(self.value(v, f"{origin}[{i}]") for i, v in enumerate(value))
        user_fn = _user_function(value)
        if user_fn is not None:
            return self.function(user_fn, origin)
        return value


def _join(origin: str, name: str) -> str:
    return f"{origin}.{name}" if origin else name


def _user_function(value):
    """The plain Python function behind `value` if it is user code we should trace through."""
    fn = value.fn if getattr(value, "_maskc_mod", False) else value
    if not isinstance(fn, types.FunctionType):
        return None
    module = fn.__module__ or ""
    if module.split(".")[0] in _LIBRARY_PREFIXES:
        return None
    return fn


def _location(fn) -> tuple[str, int]:
    code = fn.__code__
    return code.co_filename, code.co_firstlineno


def trace(fn, kind: str) -> Traced:
    """Trace `fn` (a mask_mod when kind == "mask_mod", else a score_mod)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    user_fn = _user_function(fn)
    if user_fn is None:
        got = fn.fn if getattr(fn, "_maskc_mod", False) else fn  # name what the user passed, not our wrapper
        raise TypeError(f"{kind} must be a Python function or lambda, got {type(got).__name__}; "
                        f"define it with def or lambda")
    nargs = 5 if kind == "score_mod" else 4
    expected = "(score, b, h, q_idx, kv_idx)" if kind == "score_mod" else "(b, h, q_idx, kv_idx)"
    try:
        inspect.signature(user_fn).bind(*range(nargs))
    except TypeError:
        filename, lineno = _location(user_fn)
        raise _trace_error(kind, name, filename, lineno,
                           f"must take {nargs} positional arguments {expected}",
                           f"define it as def {name}{expected}") from None
    with _LOCK:
        rebinder = _Rebinder()
        filename, lineno = _location(user_fn)
        _context.begin(_context.TraceState(kind, name, filename, lineno))
        try:
            rebound = rebinder.function(user_fn, "")
            _context._state.user_codes.update(rebinder.codes)
            args = [Proxy(s) for s in INDEX_SYMBOLS]
            if kind == "score_mod":
                args.insert(0, Proxy(SCORE))
            result = wrap(rebound(*args))
            tensors = tuple(_context._state.tensors)
            _check_result(kind, result)
        finally:
            _context.end()
    expr = canonicalize(result.expr)
    return _renumber(kind, name, expr, rebinder.params, tensors)


def _check_result(kind: str, result: Proxy) -> None:
    if kind == "mask_mod" and not result.is_bool:
        _context.fail(f"returns the non-boolean value {result.expr}",
                      "return a comparison or a combination of comparisons with & | ~")
    if kind == "score_mod" and result.is_bool:
        _context.fail(f"returns the boolean value {result.expr}",
                      "return a number; to mask, write a mask_mod")


def _trace_error(kind, name, filename, lineno, what, fix):
    return MaskTraceError(f"{kind} '{name}' {what} at {os.path.basename(filename)}:{lineno} ({filename}); {fix}")


def _renumber(kind, name, expr, raw_params, tensors) -> Traced:
    """Keep the parameters and tensors the expression uses, numbered by first discovery, so
    that the signature alone decides the kernel (two spellings with different variable
    names, or a capture that simplified away, change nothing)."""
    used = expr.free_symbols
    params = []
    mapping = {}
    for symbol, value, origin in raw_params:
        if symbol in used:
            new = param_symbol(len(params), isinstance(value, int))
            mapping[symbol] = new
            params.append(Param(new, value, origin))
    # simultaneous substitution: p3 -> p0 must not capture an existing p0
    expr = expr.xreplace(mapping)
    slots = sorted({int(load.args[0]) for load in expr.atoms(*LOADS)})
    new_slot = {old: i for i, old in enumerate(slots)}
    expr = expr.replace(is_load, lambda e: type(e)(new_slot[int(e.args[0])], *e.args[1:]))
    return Traced(kind, name, expr, tuple(params), tuple(tensors[i] for i in slots))
