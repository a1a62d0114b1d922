"""Trace a mask_mod or score_mod into a canonical sympy expression.

The user's callable is re-created with its captured Python numbers replaced by parameter
proxies (closure cells, referenced globals, functools.partial arguments and the attributes a
callable object reads, recursively through helper functions and composed mods), then called
with proxies for b, h, q_idx, kv_idx (and score). Every value read on the way is kept as a
guard, as Dynamo guards its frames: `guards_hold` re-checks them on every use of the trace,
and a change means the trace no longer describes the mod. Other objects a mod captures (a
config, a namespace, an nn.Module a closure holds) reach it unchanged; the chains of attribute
reads and constant subscripts its code applies to them (`cfg.attn.window`, `self.ids`,
`CFG["attn"]["window"]`) are read from its bytecode and guarded as paths.
"""
from __future__ import annotations

import collections
import dis
import functools
import hashlib
import inspect
import logging
import math
import operator
import os
import random
import sys
import threading
import time
import types
from dataclasses import dataclass, field

import numpy
import sympy
import torch

from maskc._graph import outside_graph
from maskc.errors import MaskTraceError
from maskc.trace import _context, _functions, dag
from maskc.trace.canonical import canonicalize
from maskc.trace.proxy import Proxy, wrap
from maskc.trace.symbols import INDEX_SYMBOLS, LOADS, SCORE, is_load, param_symbol

_log = logging.getLogger(__name__)
# Re-entrant: a mod body may build, and so trace, another mod.
_LOCK = threading.RLock()
# Functions from these packages are library code: never re-bound, never treated as user code.
_LIBRARY_PREFIXES = ("torch", "numpy", "sympy", "builtins", "math", "functools")
# ...except these library modules, whose functions are mods themselves (FlexAttention's
# and_masks, or_masks, noop_mask): traced through like user code, so that the user mods they
# hold keep their parameters and guards.
_MOD_MODULES = ("torch.nn.attention.flex_attention",)

# The integers a mod may compute with, captured or written: within ±2**62, so that what
# canonical.py makes of a comparison (q_idx - kv_idx <= W is kv_idx + W - q_idx >= 0: a number
# and positions summed) stays inside the kernel's int64. A "no window" of sys.maxsize would
# wrap there while the block map, computing exactly, calls its tiles FULL.
_KERNEL_INT = (-(2**62), 2**62)
_KERNEL_INT_RULE = "use integers within ±2**62 (a window of 2**62 exceeds every length), or float('inf') for no bound"
_CONTAINERS = (list, tuple, dict)
# A guard compares values of these types by value (a new 4 is the old 4; a bound method is
# made anew on each attribute read, a numpy scalar on each element read) and everything else
# by identity; lists and dicts are kept as copies, so that a change in place shows too.
_BY_VALUE = frozenset({int, float, bool, complex, str, bytes, list, tuple, dict, types.MethodType,
                       *(t for t in set(numpy.sctypeDict.values()) if issubclass(t, (numpy.number, numpy.bool_)))})
_CELL = operator.attrgetter("cell_contents")
# Python 3.12 folded LOAD_METHOD into LOAD_ATTR, whose lowest argument bit marks a method load
_METHOD_BIT = sys.version_info >= (3, 12)
# what a path guard may index with a constant (_walkable): a numpy array too, whose elements
# (numpy scalars, compared by value) the trace reads as constants (WINDOWS[0], int(WINDOWS[0]))
_INDEXED = (list, tuple, dict, torch.nn.ModuleList, torch.nn.ModuleDict, numpy.ndarray)

# (fetch, source, expected): fetch(source) read `expected` while tracing.
Guard = tuple


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
    guards: tuple[Guard, ...] = field(default=(), repr=False, compare=False)
    # (guard index, parameter index) of each guard whose read became a parameter (-1: one the
    # expression does not use), so that a change of those numbers alone needs no new trace
    param_guards: tuple[tuple[int, int], ...] = field(default=(), repr=False, compare=False)

    signature: str = ""  # canonical text of expr: equal for equivalent spellings and any values
    # the divisors made of parameters alone (q_idx / p0, x % (p1 - 1)), checked against zero
    # whenever the values change (_check_divisors)
    divisors: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self):
        # computed once (or handed over with the expression it belongs to): the signature is
        # part of every kernel-cache lookup on the hot path
        if not self.signature:
            object.__setattr__(self, "signature", dag_text(self.expr))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.signature.encode()).hexdigest()[:16]

    def param_values(self) -> dict[sympy.Symbol, int | float]:
        return {p.symbol: p.value for p in self.params}

    def stamps(self) -> tuple:
        """Each captured tensor's (version, data pointer): what the runtime's caches, block maps
        and backward passes compare to know its values are the ones they were built from. A
        write through torch bumps the version; `t.data = other` keeps the version and changes
        the pointer (a holder of stamps keeps the storages alive, so that no other tensor takes
        the pointer meanwhile). A write torch never sees, into a numpy array under
        `torch.from_numpy`, changes neither: maskc.invalidate(t) is for that."""
        return tuple((t._version, t.data_ptr()) for t in self.tensors)

    def storages(self) -> tuple:
        """The captured tensors' storages, for a holder of stamps() to keep alive."""
        return tuple(t.untyped_storage() for t in self.tensors)


def dag_text(expr) -> str:
    """Canonical text of `expr` with each distinct subexpression written once, as numbered
    nodes in post-order. sympy.srepr writes the tree, which doubles with every level of a
    torch.where nest that reads its own result (a DAG of 60 nodes is 2^20 leaves as a tree).
    Numbered by equality, so that equal expressions give one text however they share nodes."""
    ids: dict = {}
    lines: list[str] = []
    for node in dag.postorder(expr):
        if node in ids:
            continue
        ids[node] = len(lines)
        if node.args:
            lines.append(f"{type(node).__name__}(" + ",".join(f"%{ids[a]}" for a in node.args) + ")")
        else:
            lines.append(sympy.srepr(node))
    return ";".join(lines)


def guards_hold(guards: tuple[Guard, ...]) -> bool:
    """Whether every global, closure cell, argument and attribute a trace read still holds what
    it read. Runs on every use of a trace, so it is one flat loop of C-level reads."""
    try:
        for fetch, source, expected in guards:
            got = fetch(source)
            if got is expected:
                continue
            kind = type(got)
            # (the last clause lets a nan equal a nan: an unused nan must not re-trace on every call)
            if kind is not type(expected) or kind not in _BY_VALUE or (
                    got != expected and (got == got or expected == expected)):
                return False
    except Exception:  # the name, key or attribute is gone, or cannot be compared: trace again
        return False
    return True


class _Rebinder:
    """Copies user callables with captured numbers swapped for parameter proxies, and records
    what it read as guards."""

    def __init__(self, kind: str, structural: frozenset = frozenset()):
        self.kind = kind
        self.structural = structural  # origins of captured numbers kept as Python numbers
        self.params: list[tuple[sympy.Symbol, int | float, str]] = []
        self.origins: dict[sympy.Symbol, str] = {}  # the trace state's param_origins
        self.infinite: list[tuple[str, float]] = []  # (origin, value) of infinities folded into a mask
        self.codes: set = set()
        self.guards: list[Guard] = []
        self.guard_origins: dict[int, str] = {}  # guard index -> what it read, for people ("SEEN", "cfg.window")
        self.param_guards: list[tuple[int, sympy.Symbol]] = []  # (guard index, raw parameter symbol)
        # id -> (original, copy): the original is held so that its id cannot be reused
        self._done: dict[int, tuple] = {}

    def guarded(self, fetch, source, found, origin: str):
        """`found`, which `fetch(source)` just read, rebound; the read becomes a guard."""
        self.guard_origins[len(self.guards)] = origin
        self.guards.append((fetch, source, found.copy() if type(found) in (list, dict) else found))
        n_params = len(self.params)
        rebound = self.value(found, origin)
        if type(found) in (int, float) and len(self.params) > n_params:  # this read became that parameter
            self.param_guards.append((len(self.guards) - 1, self.params[-1][0]))
        return rebound

    def value(self, value, origin: str):
        if isinstance(value, bool):
            return value  # flags choose structure: they stay constants in the expression
        if isinstance(value, float) and math.isinf(value) and self.kind == "mask_mod":
            # an infinite bound ("no window") is a constant, so that its comparisons fold to True
            # or False: block-map analysis and the kernel's integer index math see no infinity
            self.infinite.append((origin, value))
            return Proxy(sympy.oo if value > 0 else -sympy.oo)
        if isinstance(value, (int, float)):
            if origin in self.structural:
                return value
            symbol = param_symbol(len(self.params), isinstance(value, int))
            self.params.append((symbol, value, origin))
            self.origins[symbol] = origin
            return Proxy(symbol)
        if _draws_random(value):
            return _NoDraws(value, origin)
        done = self._done.get(id(value))
        if done is not None:
            return done[1]
        if type(value) in _CONTAINERS:
            return self._container(value, origin)
        if getattr(type(value), "_maskc_mod", False):
            return self._remember(value, self.value(value.fn, origin))
        if isinstance(value, types.FunctionType):
            return self.function(value, origin) if _traced_through(value) else value
        if isinstance(value, functools.partial):
            # func and args are fixed at creation, but keywords is a dict that can change in place
            func = self.value(value.func, origin)
            args = [self.guarded(operator.itemgetter(i), value.args, a, _join(origin, f"args[{i}]"))
                    for i, a in enumerate(value.args)]
            keywords = {k: self.guarded(operator.itemgetter(k), value.keywords, v, _join(origin, k))
                        for k, v in value.keywords.items()}
            self.guards.append((len, value.keywords, len(keywords)))
            return self._remember(value, functools.partial(func, *args, **keywords))
        if isinstance(value, types.MethodType) and _traced_through(value.__func__):
            method = types.MethodType(self.function(value.__func__, origin), self.instance(value.__self__, origin))
            self.guard_self_paths(value.__func__, value.__self__)
            return self._remember(value, method)
        if not isinstance(value, type) and _traced_through(getattr(type(value), "__call__", None)):
            return self.instance(value, origin)
        return value

    def _remember(self, original, copy):
        self._done[id(original)] = (original, copy)
        return copy

    def function(self, fn: types.FunctionType, origin: str) -> types.FunctionType:
        done = self._done.get(id(fn))
        if done is not None:
            return done[1]
        code = fn.__code__
        _refuse_writes(fn)
        self.codes.add(code)
        self.codes.update(c for c in code.co_consts if isinstance(c, types.CodeType))
        fn_globals = dict(fn.__globals__)
        cells = tuple(types.CellType() for _ in code.co_freevars)
        new = types.FunctionType(code, fn_globals, fn.__name__, fn.__defaults__, cells or None)
        new.__kwdefaults__ = fn.__kwdefaults__
        # remembered before its captures are rebound, so that a function reaching itself ends
        self._remember(fn, new)
        # the objects that reach the copy as they are (a config, an nn.Module), whose paths are guarded
        roots = {}
        for name, cell, new_cell in zip(code.co_freevars, fn.__closure__ or (), cells):
            try:
                found = cell.cell_contents
            except ValueError:  # an empty cell: a name assigned later in the enclosing scope
                continue
            new_cell.cell_contents = self.guarded(_CELL, cell, found, _join(origin, name))
            if new_cell.cell_contents is found and _path_root(found):
                roots["LOAD_DEREF", name] = (_CELL, cell)
        for name in code.co_names:
            if name in fn_globals:
                found = fn_globals[name]
                fn_globals[name] = self.guarded(operator.itemgetter(name), fn.__globals__, found, _join(origin, name))
                if fn_globals[name] is found and _path_root(found):
                    roots["LOAD_GLOBAL", name] = (operator.itemgetter(name), fn.__globals__)
        self.guard_paths(code, roots)
        return new

    def guard_paths(self, code: types.CodeType, roots: dict, past_first: bool = False) -> None:
        """Guard each chain of attribute reads and constant subscripts `code` applies to a root
        ((load opcode, name) -> (fetch, source)) that reached it unchanged: the value at the end
        of the chain is what the trace used (a number as a constant, a tensor as itself).
        `past_first`: the root is a stand-in, which guards (and rebinds) the chains' first reads
        itself: only chains whose first read reached the mod as it is are guarded here."""
        for root, steps in dict.fromkeys(_read_paths(code)):  # a chain read twice is guarded once
            if root not in roots:
                continue
            fetch, source = roots[root]
            if past_first and (len(steps) < 2 or _rebound(_first(fetch(source), steps[0]))):
                continue
            walked = _walkable(fetch(source), steps)
            if not walked:
                continue

            def path(src, fetch=fetch, steps=walked):
                value = fetch(src)
                for step, key in steps:
                    value = step(value, key)
                return value
            try:
                found, again = path(source), path(source)
                # a chain that gives a new object on each read could not be guarded without
                # tracing again on every call: such a read stays unguarded, as before paths were
                stable = found is again or (type(found) in _BY_VALUE and type(again) is type(found)
                                            and bool(found == again))
            except Exception:  # noqa: BLE001 (a read the mod did not make, or values that do not compare)
                continue
            if stable:
                self.guard_origins[len(self.guards)] = root[1] + "".join(
                    f".{key}" if step is getattr else f"[{key!r}]" for step, key in walked)
                self.guards.append((path, source, found.copy() if type(found) in (list, dict) else found))

    def guard_self_paths(self, fn: types.FunctionType, obj) -> None:
        """The chains past `self` (self.cfg.window) in a method of `obj`, whose stand-in guards
        self's own attributes."""
        code = fn.__code__
        if code.co_argcount:
            self.guard_paths(code, {("LOAD_FAST", code.co_varnames[0]): (_identity, obj)}, past_first=True)

    def _container(self, value, origin: str):
        if not _holds_callable(value):
            return value
        # each element is guarded too: the container's own guard compares a shallow copy,
        # which cannot see a change inside an element
        keys = value.keys() if isinstance(value, dict) else range(len(value))
        rebound = {k: self.guarded(operator.itemgetter(k), value, value[k], f"{origin}[{k!r}]") for k in keys}
        return self._remember(value, rebound if isinstance(value, dict) else type(value)(rebound.values()))

    def instance(self, obj, origin: str) -> "_Instance":
        done = self._done.get(id(obj))
        if done is not None and isinstance(done[1], _Instance):
            return done[1]
        stand_in = _Instance(obj, self, origin)
        if stand_in._maskc_call is not None:  # self.cfg.window in __call__
            self.guard_self_paths(type(obj).__call__, obj)
        # an object already rebound as something else (a MaskMod whose method is bound) keeps that copy
        return stand_in if done is not None else self._remember(obj, stand_in)


class _Instance:
    """Stands in for a callable object, and for `self` in its methods: each attribute read is
    rebound (numbers become parameters) and guarded, so `self.window = 128` traces again."""

    __slots__ = ("_maskc_obj", "_maskc_rebinder", "_maskc_origin", "_maskc_read", "_maskc_call")

    def __init__(self, obj, rebinder: _Rebinder, origin: str):
        self._maskc_obj, self._maskc_rebinder, self._maskc_origin = obj, rebinder, origin
        self._maskc_read = {}
        call = getattr(type(obj), "__call__", None)
        self._maskc_call = rebinder.function(call, origin) if _traced_through(call) else None

    def __getattr__(self, name):
        read = self._maskc_read
        if name not in read:
            fetch = operator.attrgetter(name)
            read[name] = self._maskc_rebinder.guarded(fetch, self._maskc_obj, fetch(self._maskc_obj),
                                                      _join(self._maskc_origin, name))
        return read[name]

    def __call__(self, *args, **kwargs):
        if self._maskc_call is None:  # the self of a bound method whose class has no Python __call__
            return self._maskc_obj(*args, **kwargs)
        return self._maskc_call(self, *args, **kwargs)


# Python's and numpy's random number generators (torch's own draws are _functions.NoRandom's)
_GENERATORS = (random.Random, numpy.random.RandomState, numpy.random.Generator, numpy.random.BitGenerator)


def _draws_random(value) -> bool:
    """Whether `value` draws random numbers outside torch, or holds what does: the random
    module, numpy and numpy.random, a generator of Python's or numpy's, its class, one of its
    methods (random.randint, np.random.rand), or a function of numpy.random (default_rng)."""
    if isinstance(value, types.ModuleType):
        return value is numpy or value.__name__ in ("random", "numpy.random")
    if isinstance(value, type):
        return issubclass(value, _GENERATORS)
    if isinstance(value, (types.MethodType, types.BuiltinMethodType)) and isinstance(value.__self__, _GENERATORS):
        return True
    return isinstance(value, _GENERATORS) or (
        callable(value) and str(getattr(value, "__module__", None)).startswith("numpy.random"))


class _NoDraws:
    """Stands in for what `_draws_random` finds in a mod's globals and captures: calling it, or
    a function read from it (np.random.randint, rng.integers), refuses the mod, whose body runs
    once, when it is traced; everything else passes through (np.pi, np.where, np.int64)."""

    __slots__ = ("_maskc_source", "_maskc_origin")

    def __init__(self, source, origin: str):
        self._maskc_source, self._maskc_origin = source, origin

    def __getattr__(self, name):
        found = getattr(self._maskc_source, name)
        if _draws_random(found) or (callable(found) and self._maskc_source is not numpy):
            return _NoDraws(found, _join(self._maskc_origin, name))
        return found

    def __call__(self, *args, **kwargs):
        if isinstance(self._maskc_source, types.ModuleType):
            return self._maskc_source(*args, **kwargs)  # (not callable: Python's own TypeError)
        _context.fail(f"calls {self._maskc_origin}, which draws random numbers: the mod is traced once, so one "
                      f"draw would serve every (b, h, q_idx, kv_idx) and every call",
                      "draw the random values outside the mod and capture the tensor, like "
                      "noise = torch.rand(q_len, kv_len) and noise[q_idx, kv_idx] in the mod")


def _join(origin: str, name: str) -> str:
    return f"{origin}.{name}" if origin else name


def _traced_through(fn) -> bool:
    """Whether `fn` is a Python function whose captures we rebind: user code, or a library mod."""
    if not isinstance(fn, types.FunctionType):
        return False
    module = fn.__module__ or ""
    return module in _MOD_MODULES or module.split(".")[0] not in _LIBRARY_PREFIXES


def _read_paths(code: types.CodeType) -> list[tuple[tuple[str, str], tuple]]:
    """((load opcode, name), steps) of each chain of attribute reads and constant subscripts in
    `code` that starts at a global, a closure cell or a local: steps are (getattr, name) and
    (operator.getitem, constant). A method call ends a chain (its result is not a read), as
    LOAD_METHOD (3.11) or LOAD_ATTR with its method bit (3.12 on). Python 3.13 and 3.14 load
    locals as LOAD_FAST_LOAD_FAST pairs and LOAD_FAST_BORROW: the pair's second name starts one."""
    found = []
    ops = [op for op in dis.get_instructions(code) if op.opname != "EXTENDED_ARG"]
    i = 0
    while i < len(ops):
        op = ops[i]
        i += 1
        if op.opname in ("LOAD_GLOBAL", "LOAD_DEREF"):
            root = (op.opname, op.argval)
        elif op.opname.startswith("LOAD_FAST"):
            root = ("LOAD_FAST", op.argval[-1] if isinstance(op.argval, tuple) else op.argval)
        else:
            continue
        steps = []
        while i < len(ops):
            if ops[i].opname == "LOAD_ATTR" and not (_METHOD_BIT and ops[i].arg & 1):
                steps.append((getattr, ops[i].argval))
                i += 1
            elif ops[i].opname in ("LOAD_CONST", "LOAD_SMALL_INT") and i + 1 < len(ops) and _subscript(ops[i + 1]):
                steps.append((operator.getitem, ops[i].argval))
                i += 2
            else:
                break
        if steps:
            found.append((root, tuple(steps)))
    return found


def _subscript(op) -> bool:
    # BINARY_SUBSCR until Python 3.13, BINARY_OP [] from 3.14
    return op.opname == "BINARY_SUBSCR" or (op.opname == "BINARY_OP" and op.argrepr == "[]")


def _walkable(value, steps) -> tuple:
    """The leading steps of a chain a guard may repeat on every call: attribute reads of objects
    that are no tensors, through no property (its getter would run on every check), and
    subscripts of lists, tuples, dicts (an OrderedDict too, not a defaultdict, whose read of a
    key gone would insert it), numpy arrays and nn.ModuleLists and ModuleDicts."""
    walked = []
    for step, key in steps:
        if step is getattr:
            if isinstance(value, torch.Tensor) or isinstance(inspect.getattr_static(type(value), key, None), property):
                break
        elif not isinstance(value, _INDEXED) or isinstance(value, collections.defaultdict):
            break
        try:
            value = step(value, key)
        except Exception:  # noqa: BLE001 (a read the mod did not make here)
            break
        walked.append((step, key))
    return tuple(walked)


_WRITES = {"STORE_GLOBAL": "assigns the global", "DELETE_GLOBAL": "deletes the global",
           "STORE_DEREF": "assigns the enclosing function's variable",
           "DELETE_DEREF": "deletes the enclosing function's variable"}


def _refuse_writes(fn: types.FunctionType) -> None:
    """Refuse a function that writes a global or a variable of an enclosing function (`global N;
    N += 1`, `nonlocal count`): the tracer runs a copy of it, with a copy of its globals and new
    closure cells, so the write would never reach the module or the enclosing function."""
    found = _write(fn.__code__, frozenset(fn.__code__.co_freevars))
    if found is None:
        return
    code, op = found
    state = _context.current()
    where = "" if fn.__name__ == state.name else f" in '{fn.__name__}'"
    positions = getattr(op, "positions", None)  # (Python 3.11 on)
    raise _trace_error(state.kind, state.name, code.co_filename, positions.lineno if positions else code.co_firstlineno,
                       f"{_WRITES[op.opname]} '{op.argval}'{where}",
                       f"a mod must have no side effects: maskc traces it once per change of what it reads, not "
                       f"once per call, on a copy of its globals and closure, so the write never reaches your "
                       f"module or function; compute '{op.argval}' outside the mod and capture the value")


def _write(code: types.CodeType, captured: frozenset):
    """(code, instruction) of the first write to a global or to a closure cell in `captured` by
    `code` or a function defined in it, or None."""
    for op in dis.get_instructions(code):
        if op.opname in _WRITES and (op.opname.endswith("GLOBAL") or op.argval in captured):
            return code, op
    for inner in code.co_consts:
        # an inner function's closure variables are the outer's own locals unless the outer captured them too
        if isinstance(inner, types.CodeType):
            found = _write(inner, captured & frozenset(inner.co_freevars))
            if found is not None:
                return found
    return None


def _path_root(value) -> bool:
    """Whether the chains read from `value`, which reached the mod as it is, are guarded: an
    object (a config, a namespace, a dict, an nn.Module), your own module or class, not a
    library's or the standard library's module or class, a function or a constant."""
    if isinstance(value, (types.ModuleType, type)):  # your own module or class (K.WINDOW)
        top = (value.__name__ if isinstance(value, types.ModuleType) else value.__module__).split(".")[0]
        return top not in _LIBRARY_PREFIXES and top not in sys.stdlib_module_names
    return not isinstance(value, (int, float, complex, str, bytes, torch.Tensor, types.FunctionType,
                                  types.BuiltinFunctionType))


def _rebound(value) -> bool:
    """Whether a stand-in's attribute read of `value` rebinds it (a number becomes a parameter, a
    function or callable object is traced through): chains past it are its copy's to guard."""
    return (isinstance(value, (bool, int, float, types.FunctionType, functools.partial, types.MethodType))
            or getattr(type(value), "_maskc_mod", False) or (type(value) in _CONTAINERS and _holds_callable(value))
            or (not isinstance(value, type) and _traced_through(getattr(type(value), "__call__", None))))


def _first(value, step):
    try:
        return step[0](value, step[1])
    except Exception:  # noqa: BLE001
        return None


def _identity(value):
    return value


def _holds_callable(value) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(callable(v) or (type(v) in _CONTAINERS and _holds_callable(v)) for v in items)


def _code(fn):
    """The code object that runs when `fn` is called, or None if it is not Python code."""
    if getattr(type(fn), "_maskc_mod", False):
        return _code(fn.fn)
    if isinstance(fn, types.FunctionType):
        return fn.__code__
    if isinstance(fn, functools.partial):
        return _code(fn.func)
    if isinstance(fn, types.MethodType):
        return _code(fn.__func__)
    call = getattr(type(fn), "__call__", None)
    return call.__code__ if isinstance(call, types.FunctionType) and not isinstance(fn, type) else None


def callable_name(fn) -> str:
    """A name for people: the function's, 'partial(f)' for a partial, the class for an object."""
    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    if isinstance(fn, functools.partial):
        return f"partial({callable_name(fn.func)})"
    return type(fn).__name__


def trace(fn, kind: str) -> Traced:
    """Trace `fn` (a mask_mod when kind == "mask_mod", else a score_mod)."""
    name = callable_name(fn)
    target = fn.fn if getattr(type(fn), "_maskc_mod", False) else fn
    code = _code(target)
    if code is None:
        raise TypeError(f"{kind} must be a Python function or lambda, got {type(target).__name__}; "
                        f"define it with def or lambda (a functools.partial of one, or an object with a "
                        f"Python __call__ method, works too)")
    filename, lineno = code.co_filename, code.co_firstlineno
    nargs = 5 if kind == "score_mod" else 4
    expected = "(score, b, h, q_idx, kv_idx)" if kind == "score_mod" else "(b, h, q_idx, kv_idx)"
    try:
        inspect.signature(target).bind(*range(nargs))
    except TypeError:
        raise _trace_error(kind, name, filename, lineno,
                           f"must take {nargs} positional arguments {expected}",
                           f"define it as def {name}{expected}") from None
    structural: frozenset = frozenset()
    start = time.perf_counter()
    while True:
        try:
            traced = _trace_once(target, kind, name, filename, lineno, structural)
        except _context.Structural as reached:
            _log.info("%s '%s': Python decides on %s, which become constants: a new value compiles a new kernel",
                      kind, name, ", ".join(sorted(reached.origins)))
            structural |= reached.origins
            continue
        except RecursionError:
            # sympy's constructors and the canonical form recurse once per level of the expression
            raise _trace_error(kind, name, filename, lineno,
                               "recursed past Python's recursion limit while tracing: its arithmetic nests deeper "
                               "than maskc's passes recurse (about 70 levels of floor(x / 2) + kv_idx in a loop), "
                               "or the mod calls itself without end",
                               "compute the deep part outside the mod, as a tensor over the positions, and index "
                               "it with q_idx and kv_idx") from None
        _log.info("traced %s '%s' in %.1f ms; parameters: %s; captured tensors: %d", kind, name,
                  (time.perf_counter() - start) * 1e3,
                  ", ".join(f"{p.origin}={p.value}" for p in traced.params) or "none", len(traced.tensors))
        return traced


def _trace_once(target, kind, name, filename, lineno, structural) -> Traced:
    with _LOCK:
        rebinder = _Rebinder(kind, structural)
        state = _context.TraceState(kind, name, filename, lineno, rebinder.codes, param_origins=rebinder.origins,
                                    guards=rebinder.guards)
        _context.begin(state)
        try:
            rebound = rebinder.value(target, "")
            args = [Proxy(s) for s in INDEX_SYMBOLS]
            if kind == "score_mod":
                args.insert(0, Proxy(SCORE))
            try:
                with _functions.NoRandom(), _functions.NoValueReads(), _functions.AutogradFunctions():
                    result = wrap(rebound(*args))
            except TypeError as error:
                # sympy refuses to compare the nan that `x % inf` or `inf - inf` made
                if rebinder.infinite and not isinstance(error, MaskTraceError):
                    raise _infinity_error(name, rebinder.infinite) from error
                raise
            _check_result(kind, result)
            _refuse_changes(rebinder)
        finally:
            _context.end()
    try:
        expr = canonicalize(result.expr)
    except TypeError as error:  # sympy refuses to compare the nan of `x % inf`
        if rebinder.infinite:
            raise _infinity_error(name, rebinder.infinite) from error
        raise
    if rebinder.infinite and expr.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        raise _infinity_error(name, rebinder.infinite)
    # sympy's x / 0 is complex infinity, without the sign torch's ±inf has (walked as a DAG: a
    # nest of torch.where is exponential as a tree)
    if dag.atoms(expr, sympy.core.numbers.ComplexInfinity):
        raise ValueError(f"{kind} '{name}' divides by zero; torch gives ±inf or nan there, which attention turns "
                         f"into nan rows: divide by a nonzero number")
    for literal in dag.atoms(expr, sympy.Integer):
        if not _KERNEL_INT[0] <= literal <= _KERNEL_INT[1]:
            raise _trace_error(kind, name, filename, lineno, f"computes with the integer {literal}, outside ±2**62, "
                               f"which the kernel's int64 arithmetic cannot sum with positions",
                               f"{_KERNEL_INT_RULE}, or a float literal (1e21) for float arithmetic")
    traced = _renumber(kind, name, expr, rebinder.params, state.tensors, tuple(rebinder.guards),
                       rebinder.param_guards)
    _check_values(traced)
    return traced


def _refuse_changes(rebinder: _Rebinder) -> None:
    """Refuse a mod that changed what it reads while it ran (SEEN.append(1), cfg.n += 1, del d[k]):
    its body runs once per trace, not once per call, and its guards, failing at once, would have
    it traced again on every call."""
    for i, guard in enumerate(rebinder.guards):
        if guards_hold((guard,)):
            continue
        fetch, source, _ = guard
        try:
            now = fetch(source)
        except Exception:  # noqa: BLE001 (the mod deleted what it read: a change)
            pass
        else:
            if not guards_hold(((fetch, source, now),)):
                continue  # a read that gives a new object each time, which the mod did not change
        origin = rebinder.guard_origins.get(i)
        what = f"'{origin}'" if origin else "a value"
        _context.fail(f"changes {what}, which it reads, while it is traced",
                      "a mod must have no side effects (.append, item or attribute assignment): maskc runs its "
                      "body once per trace, not once per call, and a mod that changes what it reads would be "
                      "traced again on every call; do that work outside the mod")


def _infinity_error(name: str, infinite) -> ValueError:
    captured = ", ".join(f"{origin} = {value}" for origin, value in infinite)
    return ValueError(f"mask_mod '{name}' captures {captured}, used where it does not fold into a comparison; "
                      f"compare with it directly (q_idx - kv_idx <= window) or capture a large finite number")


def _check_values(traced: Traced) -> None:
    """Refuse captured numbers no kernel argument can hold, naming where they came from."""
    for p in traced.params:
        if isinstance(p.value, int) and not _KERNEL_INT[0] <= p.value <= _KERNEL_INT[1]:
            raise ValueError(f"{traced.kind} '{traced.name}' captures {p.origin} = {p.value}, outside ±2**62, "
                             f"which the kernel's int64 arithmetic cannot sum with positions; {_KERNEL_INT_RULE}")
        if isinstance(p.value, float) and math.isnan(p.value):
            raise ValueError(f"{traced.kind} '{traced.name}' captures {p.origin} = nan; captured numbers must "
                             f"not be nan (a comparison with nan is always false): use a number")
    _check_divisors(traced)


def _parameter_divisors(expr, params) -> tuple:
    """The divisors in `expr` made of parameters alone: what _check_divisors evaluates."""
    if not params:  # (no walk of the expression for the common mod without captured numbers)
        return ()
    symbols = {p.symbol for p in params}
    found = []
    for node in dag.atoms(expr, sympy.Pow, sympy.Mod):
        if node.is_Pow and not (node.exp.is_number and node.exp.is_negative):
            continue
        divisor = node.base if node.is_Pow else node.args[1]
        if divisor.free_symbols and divisor.free_symbols <= symbols and divisor not in found:
            found.append(divisor)
    return tuple(found)


def _check_divisors(traced: Traced) -> None:
    """Refuse a divisor of captured numbers alone that their values make 0 (`q_idx / d` with
    d = 0.0, `q_idx % (n - 1)` with n = 1), as the tracer refuses a literal one: the block-map
    analysis met sympy's signless complex infinity there and crashed."""
    if not traced.divisors:  # (a decoding step's new offset comes here every step)
        return
    values = traced.param_values()
    for divisor in traced.divisors:
        if divisor.xreplace(values) == 0:
            captured = ", ".join(f"{p.origin} = {p.value}" for p in traced.params if p.symbol in divisor.free_symbols)
            raise ValueError(f"{traced.kind} '{traced.name}' divides by zero with {captured}; torch gives ±inf or "
                             f"nan there, which attention turns into nan rows: capture a nonzero number")


def _check_result(kind: str, result: Proxy) -> None:
    if kind == "mask_mod" and not result.is_bool:
        _context.fail(f"returns the non-boolean value {result.expr}",
                      "return a comparison or a combination of comparisons with & | ~")
    if kind == "score_mod" and result.is_bool:
        _context.fail(f"returns the boolean value {result.expr}",
                      "return a number; to mask, write a mask_mod")


def _trace_error(kind, name, filename, lineno, what, fix):
    return MaskTraceError(f"{kind} '{name}' {what} at {os.path.basename(filename)}:{lineno} ({filename}); {fix}")


def _renumber(kind, name, expr, raw_params, tensors, guards, param_guards) -> Traced:
    """Keep the parameters and tensors the expression uses, numbered by first discovery, so
    that the signature alone decides the kernel (two spellings with different variable
    names, or a capture that simplified away, change nothing)."""
    used = dag.free_symbols(expr)
    params = []
    mapping = {}
    for symbol, value, origin in raw_params:
        if symbol in used:
            new = param_symbol(len(params), isinstance(value, int))
            mapping[symbol] = new
            params.append(Param(new, value, origin))
    # simultaneous substitution: p3 -> p0 must not capture an existing p0
    expr = dag.transform(expr, lambda e: mapping.get(e, e))
    slots = sorted({int(load.args[0]) for load in dag.atoms(expr, *LOADS)})
    new_slot = {old: i for i, old in enumerate(slots)}
    expr = dag.transform(expr, lambda e: type(e)(new_slot[int(e.args[0])], *e.args[1:]) if is_load(e) else e)
    index = {mapping[symbol]: i for i, symbol in enumerate(mapping)}
    param_guards = tuple((g, index.get(mapping.get(symbol), -1)) for g, symbol in param_guards)
    return Traced(kind, name, expr, tuple(params), tuple(tensors[i] for i in slots), guards, param_guards,
                  divisors=_parameter_divisors(expr, params))


def retraced(fn, kind: str, old: Traced) -> Traced:
    """The trace of `fn` now that a guard of `old` failed: `old` with new values where the only
    reads that changed are captured numbers that became parameters (a decoding step's offset,
    a new window), which leave the expression as it is; otherwise a new trace."""
    renewed = _with_new_values(old)
    return renewed if renewed is not None else trace(fn, kind)


# Dynamo cannot trace maskc's tracer (sympy): a mod made or traced again inside compiled code
# is traced outside the graph (a graph break), which fullgraph=True refuses with this reason.
_IN_PYTHON = ("maskc traces a mask_mod or score_mod in Python, outside torch.compile's graph; with "
              "fullgraph=True make the mod and wrap it with maskc.mask_mod / maskc.score_mod outside the "
              "compiled function (its captured tensors may change between calls), or compile without fullgraph")
trace = outside_graph(trace, _IN_PYTHON)
retraced = outside_graph(retraced, _IN_PYTHON)


def _with_new_values(old: Traced) -> Traced | None:
    param_of = dict(old.param_guards)
    guards, values = list(old.guards), [p.value for p in old.params]
    try:
        for i, (fetch, source, expected) in enumerate(old.guards):
            got = fetch(source)
            if got is expected or (type(got) is type(expected) and type(got) in _BY_VALUE and got == expected):
                continue
            # a parameter's number, still a finite number of its type (an int that became an
            # infinity or a bool changes what the trace folds: trace again)
            if i not in param_of or type(got) is not type(expected) or type(got) not in (int, float):
                return None
            if isinstance(got, float) and not math.isfinite(got) or isinstance(got, int) and not (
                    _KERNEL_INT[0] <= got <= _KERNEL_INT[1]):
                return None
            guards[i] = (fetch, source, got)
            if param_of[i] >= 0:
                values[param_of[i]] = got
    except Exception:  # as guards_hold: the name, key or attribute is gone
        return None
    params = tuple(Param(p.symbol, v, p.origin) for p, v in zip(old.params, values))
    renewed = Traced(old.kind, old.name, old.expr, params, old.tensors, tuple(guards), old.param_guards, old.signature,
                     old.divisors)
    _check_divisors(renewed)
    return renewed
