"""The torch functions and tensor methods maskc traces, registered with proxy.register and
looked up there by the function object.

A name is not enough: a user's own function named `exp` that dispatches through
__torch_function__ must not trace as torch.exp. Each entry is keyed by every object the
operation arrives as: torch.X, torch.special.X, torch.nn.functional.X, Tensor.X (a method on
a traced value, or on a captured tensor given a traced argument), and the Tensor operators
(`bias * score` arrives as Tensor.mul(bias, score)). Indexing a captured tensor is one of
them (proxy.index_tensor).

Also here, what a trace does at each new value, and torch.autograd.Function: its forward traces
like any code, and in a score mod its own backward, traced too, gives the gradient
(symbols.CustomBackward), as torch's autograd uses that backward whether or not it is the
forward's derivative.
"""
from __future__ import annotations

import functools
import inspect
import math
import sys

import sympy
import torch
import torch.nn.functional as F
from sympy.core.cache import clear_cache
from torch.overrides import TorchFunctionMode, resolve_name

from maskc.trace import _context, dag
from maskc.trace import proxy as P
from maskc.trace.canonical import conjunction, disjunction, negation, parity, piecewise
from maskc.trace.symbols import SCORE, BFloat16, CustomBackward, Float16, LoadFloat, Trunc


# -- operations that only torch functions perform ----------------------------------------------
def fmod(a, b):
    """torch.fmod: the remainder with the sign of the dividend, as C computes it."""
    if b in (sympy.oo, -sympy.oo):
        return a  # C's fmod(x, ±inf) is x (trunc(x / inf) * inf would be 0 * inf: nan)
    return a - (P.trunc(a / b) if P.float32_exact(b) else Trunc(a / b)) * b


def extreme(a, b, fn) -> P.Proxy:
    """torch.maximum (fn=Max) or minimum (Min); of two booleans it is | or &."""
    pa, pb = P.wrap(a), P.wrap(b)
    if pa.is_bool and pb.is_bool:
        return P.Proxy((disjunction if fn is sympy.Max else conjunction)(pa.expr, pb.expr))
    return P.Proxy(dag.make(fn, P.number(pa), P.number(pb)))


def clamp(x, min=None, max=None) -> P.Proxy:
    e = P.number(P.wrap(x))
    if min is not None:
        e = dag.make(sympy.Max, e, P.number(P.wrap(min)))
    if max is not None:
        e = dag.make(sympy.Min, e, P.number(P.wrap(max)))
    return P.Proxy(e)


def where(cond, a, b) -> P.Proxy:
    c = P.wrap(cond)
    if not c.is_bool:
        _context.fail(f"passes the non-boolean condition {c.expr} to torch.where",
                      "compare it first, like torch.where(x != 0, a, b)")
    pa, pb = P.wrap(a), P.wrap(b)
    if pa.is_bool and pb.is_bool:
        return P.Proxy(_choose(c.expr, pa.expr, pb.expr))
    return P.Proxy(piecewise((P.number(pa), c.expr), (P.number(pb), sympy.true)))


def _choose(c, a, b):
    """torch.where of booleans, with c written once where the choice allows: a nest of
    where(c, m, ~m) stays linear in size."""
    if a == b:
        return a
    if b == negation(a):
        return negation(parity(c, a))
    if a == negation(b):
        return parity(c, b)
    if a is sympy.true or b is sympy.false:
        return conjunction(c, a) if b is sympy.false else disjunction(c, b)
    if a is sympy.false or b is sympy.true:
        return conjunction(negation(c), b) if a is sympy.false else disjunction(negation(c), a)
    return disjunction(conjunction(c, a), conjunction(negation(c), b))


def cast(x, dtype) -> P.Proxy:
    """`x.to(dtype)`: a float converted to an integer dtype is truncated; to bool, nonzero."""
    p = P.wrap(x)
    if dtype is None:
        return p
    if dtype == torch.bool:
        return P.Proxy(P.boolean(p))
    if dtype.is_complex:
        _context.fail(f"converts a traced value to {dtype}", "use a real dtype")
    if dtype in _ROUNDED:
        return P.Proxy(_ROUNDED[dtype](P.number(p)))
    if dtype.is_floating_point or p.is_bool:
        return P.Proxy(P.number(p))
    return P.Proxy(P.trunc(p.expr))


# a float16 or bfloat16 value is its float32 (or float64) one rounded: mods compute in float32,
# and torch's x.to(torch.bfloat16).to(torch.float32) rounds there too
_ROUNDED = {torch.float16: Float16, torch.bfloat16: BFloat16}


# -- the table ----------------------------------------------------------------------------------
T = torch.Tensor


def _special(*names):
    """torch.special's spellings that this torch has."""
    return [getattr(torch.special, n) for n in names if hasattr(torch.special, n)]


def _unary(fn):
    return lambda x: P.unary(x, fn)


def _div(a, b, *, rounding_mode=None):
    ops = {None: lambda x, y: x / y, "floor": P.floordiv, "trunc": lambda x, y: P.trunc(x / y)}
    if rounding_mode not in ops:
        raise TypeError(f"rounding_mode={rounding_mode!r}")
    return P.arith(a, b, ops[rounding_mode])


def _scaled(b, alpha):
    return b if alpha == 1 else P.mul(b, alpha)


def _extreme_or_reduction(fn, elementwise: str):
    # torch.max(a, b) is elementwise only when b is a tensor; torch.max(a) and torch.max(a, dim) reduce
    def extreme_or_reduction(a, b=None, *rest, **kwargs):
        if isinstance(b, (P.Proxy, torch.Tensor)) and not rest and not kwargs:
            return extreme(a, b, fn)
        _context.fail("reduces a traced value with torch.max or torch.min", f"use torch.{elementwise}(a, b)")

    return extreme_or_reduction


def _sigmoid(e):
    return 1 / (1 + sympy.exp(-e))


def _gelu(x, approximate="none"):
    e = P.number(P.wrap(x))
    if approximate == "tanh":
        inner = sympy.Float(math.sqrt(2 / math.pi)) * (e + sympy.Float(0.044715) * e**3)
        return P.Proxy(e / 2 * (1 + sympy.tanh(inner)))
    if approximate != "none":
        raise TypeError(f"approximate={approximate!r}")
    return P.Proxy(e / 2 * (1 + sympy.erf(e * sympy.Float(math.sqrt(0.5)))))


def _softplus(x, beta=1.0, threshold=20.0):
    e = P.number(P.wrap(x))
    # above the threshold torch returns x itself, as log(1 + exp(beta x)) / beta would overflow
    return P.Proxy(piecewise((e, P.relation(sympy.Gt, e * beta, threshold)),
                             (sympy.log(1 + sympy.exp(e * beta)) / beta, sympy.true)))


def _elu(x, alpha=1.0, inplace=False):
    e = P.number(P.wrap(x))
    return P.Proxy(piecewise((e, P.relation(sympy.Gt, e, 0)), (alpha * (sympy.exp(e) - 1), sympy.true)))


# torch's F.selu constants (scale · elu(x, alpha))
_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _selu(x, inplace=False):
    return P.mul(_elu(x, _SELU_ALPHA), _SELU_SCALE)


def _leaky_relu(x, negative_slope=0.01, inplace=False):
    e = P.number(P.wrap(x))
    return P.Proxy(dag.make(sympy.Max, e, 0) + negative_slope * dag.make(sympy.Min, e, 0))


def _to(self, *args, dtype=None, **_options):
    # device, non_blocking, copy and memory_format change where the value lives, not what it is
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (torch.Tensor, P.Proxy)):
            dtype = a.dtype
    return cast(self, dtype)


def _scalar(size: tuple):
    shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)
    if shape:
        _context.fail(f"creates a tensor of shape {shape} from a traced value",
                      "a mod computes one value per (b, h, q_idx, kv_idx): make it a scalar, like x.new_ones(())")


def _new_full(self, size, fill_value, *, dtype=None, **_options):
    _scalar((size,))
    return cast(fill_value, dtype or self.dtype)


def _new_constant(fill_value):
    def new(self, *size, dtype=None, **_options):
        _scalar(size)
        return cast(fill_value, dtype or self.dtype)

    return new


def _new_tensor(self, data, *, dtype=None, **_options):
    if isinstance(data, (list, tuple)):
        _scalar((data,))
    return cast(data, dtype or self.dtype)


def _like(fill_value=None):
    def like(input, *args, dtype=None, **_options):
        value = args[0] if fill_value is None else fill_value
        return cast(value, dtype or input.dtype)

    return like


def _item(self):
    _context.fail("calls .item() on a traced value",
                  "keep it a tensor: comparisons, torch.where and arithmetic take traced values directly")


def _cast_to(dtype):
    return lambda self, *_options, **_kw: cast(self, dtype)


def _operator(name):
    # a Tensor operator with a traced operand: what the Proxy's own operator does
    return lambda a, *rest: getattr(P.wrap(a), name)(*rest)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"):
    for _dunder in (f"__{_name}__", f"__r{_name}__"):
        if hasattr(T, _dunder):
            P.register(_operator(_dunder), getattr(T, _dunder))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    P.register(_operator(f"__{_name}__"), getattr(T, f"__{_name}__"))
P.register(lambda tensor, index: P.index_tensor(tensor, index if isinstance(index, tuple) else (index,)), T.__getitem__)

# arithmetic
P.register(lambda a, b, *, alpha=1: P.add(a, _scaled(b, alpha)), torch.add, T.add)
P.register(lambda a, b, *, alpha=1: P.sub(a, _scaled(b, alpha)), torch.sub, torch.subtract, T.sub, T.subtract)
P.register(P.mul, torch.mul, torch.multiply, T.mul, T.multiply)
P.register(_div, torch.div, torch.divide, T.div, T.divide)
P.register(lambda a, b: P.arith(a, b, lambda x, y: x / y), torch.true_divide, T.true_divide)
P.register(lambda a, b: P.arith(a, b, P.floordiv), torch.floor_divide, T.floor_divide)
P.register(lambda a, b: P.arith(a, b, P.mod), torch.remainder, T.remainder)
P.register(lambda a, b: P.arith(a, b, fmod), torch.fmod, T.fmod)
P.register(lambda a, b: P.arith(a, b, P.power), torch.pow, T.pow, torch.float_power, T.float_power)
P.register(lambda x: -P.wrap(x), torch.neg, torch.negative, T.neg, T.negative)
P.register(lambda x: abs(P.wrap(x)), torch.abs, torch.absolute, T.abs, T.absolute)
P.register(_unary(lambda e: P.power(e, 2)), torch.square, T.square)
P.register(_unary(lambda e: 1 / e), torch.reciprocal, T.reciprocal)
P.register(lambda x: P.wrap(x) if P.wrap(x).is_bool else P.unary(x, lambda e: dag.make(sympy.sign, e)),
           torch.sign, torch.sgn, T.sign, T.sgn)
P.register(lambda a, b: extreme(a, b, sympy.Max), torch.maximum, T.maximum)
P.register(lambda a, b: extreme(a, b, sympy.Min), torch.minimum, T.minimum)
P.register(_extreme_or_reduction(sympy.Max, "maximum"), torch.max, T.max)
P.register(_extreme_or_reduction(sympy.Min, "minimum"), torch.min, T.min)
P.register(clamp, torch.clamp, torch.clip, T.clamp, T.clip)
P.register(lambda x, min: clamp(x, min=min), torch.clamp_min, T.clamp_min)
P.register(lambda x, max: clamp(x, max=max), torch.clamp_max, T.clamp_max)

# rounding
P.register(_unary(P.floor), torch.floor, T.floor)
P.register(_unary(P.ceiling), torch.ceil, T.ceil)
P.register(_unary(P.trunc), torch.trunc, torch.fix, T.trunc, T.fix)
P.register(_unary(lambda e: e - P.trunc(e)), torch.frac, T.frac)
P.register(lambda x, *, decimals=0: P.round_half_even(x, decimals), torch.round, T.round, *_special("round"))

# elementwise functions
P.register(_unary(sympy.exp), torch.exp, T.exp)
P.register(_unary(lambda e: 2**e), torch.exp2, T.exp2, *_special("exp2"))
P.register(_unary(lambda e: sympy.exp(e) - 1), torch.expm1, T.expm1, *_special("expm1"))
P.register(_unary(sympy.log), torch.log, T.log)
P.register(_unary(lambda e: sympy.log(e, 2)), torch.log2, T.log2)
P.register(_unary(lambda e: sympy.log(e, 10)), torch.log10, T.log10)
P.register(_unary(lambda e: sympy.log(1 + e)), torch.log1p, T.log1p, *_special("log1p"))
P.register(_unary(lambda e: P.power(e, sympy.Rational(1, 2))), torch.sqrt, T.sqrt)
P.register(_unary(lambda e: P.power(e, sympy.Rational(-1, 2))), torch.rsqrt, T.rsqrt)
P.register(_unary(sympy.sin), torch.sin, T.sin)
P.register(_unary(sympy.cos), torch.cos, T.cos)
# tan as written out: Triton has no tan, and sin/cos already print, analyse and differentiate
P.register(_unary(lambda e: sympy.sin(e) / sympy.cos(e)), torch.tan, T.tan)
P.register(_unary(sympy.tanh), torch.tanh, T.tanh)
P.register(_unary(sympy.atan), torch.atan, torch.arctan, T.atan, T.arctan)
P.register(_unary(sympy.erf), torch.erf, T.erf, *_special("erf"))
# 1 - erf: absolute error within float32's, which is what a score's sum sees (the relative error
# of a tiny erfc(5) = 1.5e-12 is lost)
P.register(_unary(lambda e: 1 - sympy.erf(e)), torch.erfc, T.erfc, *_special("erfc"))
P.register(_unary(_sigmoid), torch.sigmoid, T.sigmoid, *_special("expit"))
P.register(lambda x, inplace=False: P.unary(x, lambda e: dag.make(sympy.Max, e, 0)), F.relu, torch.relu, T.relu)
P.register(lambda x, inplace=False: P.unary(x, lambda e: e * _sigmoid(e)), F.silu)
P.register(_gelu, F.gelu)
P.register(_softplus, F.softplus)
P.register(_leaky_relu, F.leaky_relu)
P.register(_elu, F.elu)
P.register(_selu, F.selu, torch.selu)
P.register(lambda x, min_val=-1.0, max_val=1.0, inplace=False: clamp(x, min_val, max_val), F.hardtanh)
P.register(lambda x, inplace=False: clamp(x, 0, 6), F.relu6)

# comparisons and logic
P.register(lambda a, b: P.compare(a, b, sympy.Eq), torch.eq, T.eq)
P.register(lambda a, b: P.compare(a, b, sympy.Ne), torch.ne, torch.not_equal, T.ne, T.not_equal)
P.register(lambda a, b: P.compare(a, b, sympy.Lt), torch.lt, torch.less, T.lt, T.less)
P.register(lambda a, b: P.compare(a, b, sympy.Le), torch.le, torch.less_equal, T.le, T.less_equal)
P.register(lambda a, b: P.compare(a, b, sympy.Gt), torch.gt, torch.greater, T.gt, T.greater)
P.register(lambda a, b: P.compare(a, b, sympy.Ge), torch.ge, torch.greater_equal, T.ge, T.greater_equal)
P.register(lambda a, b: P.Proxy(conjunction(P.boolean(P.wrap(a)), P.boolean(P.wrap(b)))),
          torch.logical_and, T.logical_and)
P.register(lambda a, b: P.Proxy(disjunction(P.boolean(P.wrap(a)), P.boolean(P.wrap(b)))),
          torch.logical_or, T.logical_or)
P.register(lambda a, b: P.Proxy(parity(P.boolean(P.wrap(a)), P.boolean(P.wrap(b)))), torch.logical_xor, T.logical_xor)
P.register(lambda a: P.Proxy(negation(P.boolean(P.wrap(a)))), torch.logical_not, T.logical_not)
P.register(lambda a, b: P.bitwise(a, b, "&"), torch.bitwise_and, T.bitwise_and)
P.register(lambda a, b: P.bitwise(a, b, "|"), torch.bitwise_or, T.bitwise_or)
P.register(lambda a, b: P.bitwise(a, b, "^"), torch.bitwise_xor, T.bitwise_xor)
P.register(lambda a: ~P.wrap(a), torch.bitwise_not, T.bitwise_not)
P.register(lambda a, b: P.shift(a, b, "<<"), torch.bitwise_left_shift, T.bitwise_left_shift)
P.register(lambda a, b: P.shift(a, b, ">>"), torch.bitwise_right_shift, T.bitwise_right_shift)
P.register(where, torch.where)
P.register(lambda self, condition, other: where(condition, self, other), T.where)

# dtypes and new values
P.register(_to, T.to)
P.register(lambda self, other: cast(self, other.dtype), T.type_as)
for _method, _dtype in (("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                        ("bfloat16", torch.bfloat16), ("long", torch.int64), ("int", torch.int32),
                        ("short", torch.int16), ("bool", torch.bool)):
    P.register(_cast_to(_dtype), getattr(T, _method))
P.register(lambda self, **_options: P.Proxy(P.wrap(self).expr), T.clone, T.contiguous)
P.register(_new_constant(1), T.new_ones)
P.register(_new_constant(0), T.new_zeros)
P.register(_new_full, T.new_full)
P.register(_new_tensor, T.new_tensor)
P.register(_like(), torch.full_like)
P.register(_like(1), torch.ones_like)
P.register(_like(0), torch.zeros_like)
P.register(_item, T.item)


# -- per trace ----------------------------------------------------------------------------------
# torch.nn.functional's random functions written in Python, whose names are no seeded aten op
_RANDOM_COMPOSITES = frozenset({"dropout1d", "dropout2d", "dropout3d", "feature_alpha_dropout", "gumbel_softmax",
                                "rrelu"})


@functools.cache
def _draws_random(func) -> bool:
    """Whether `func` (torch.rand, Tensor.uniform_, F.dropout, ...) draws random numbers: its aten op
    carries torch's nondeterministic_seeded tag."""
    name = (resolve_name(func) or "").rpartition(".")[2]
    if name in _RANDOM_COMPOSITES:
        return True
    packet = getattr(torch.ops.aten, name, None) if name else None
    return isinstance(packet, torch._ops.OpOverloadPacket) and any(
        torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


class NoRandom(TorchFunctionMode):
    """Active while a mod body runs: refuses the torch functions that draw random numbers. Called
    without a traced argument (torch.rand(()), torch.randint(0, 8, ())), they run as plain torch
    and the trace would freeze one draw for every pair and every call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _draws_random(func):
            _context.fail(f"calls {P.describe(func)}, which draws random numbers: the mod is traced once, so one "
                          f"draw would serve every (b, h, q_idx, kv_idx) and every call",
                          "draw the random values outside the mod and capture the tensor, like "
                          "noise = torch.rand(q_len, kv_len) and noise[q_idx, kv_idx] in the mod")
        return func(*args, **(kwargs or {}))


# What turns a tensor's elements into Python values (numpy's too: indexing the array gives numbers)
_VALUE_READS = frozenset({T.__int__, T.__index__, T.__float__, T.__complex__, T.__bool__, T.item, T.tolist, T.numpy,
                          T.__array__, T.equal, T.allclose, T.is_nonzero, torch.equal, torch.allclose,
                          torch.is_nonzero})


class NoValueReads(TorchFunctionMode):
    """Active while a mod body runs: refuses reading a tensor's element as a Python value
    (int(T[0]), T[0].item(), if T[0]:). The trace would keep the value read then as a constant,
    and a later write to the tensor would not reach the kernel; a guard re-reading it on every
    call would wait for the GPU. maskc's own tracing code may read values (its frames are
    skipped)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _VALUE_READS and args and isinstance(args[0], torch.Tensor) and not (
                sys._getframe(1).f_globals.get("__name__", "").startswith("maskc.trace")):
            _context.fail(f"reads a tensor's element as a Python value ({P.describe(func)}), which the trace would "
                          f"keep as a constant: a later change to the tensor would not reach the kernel",
                          "use the element as a tensor (q_idx - kv_idx <= windows[0]) or index it with an index "
                          "argument (windows[h]): the kernel reads it at run time; or capture a Python number")
        return func(*args, **(kwargs or {}))


# the trace state whose first value has been seen; traces run one at a time (the tracer's lock)
_trace: list = [None]


@P.on_each_new_value
def on_new_value() -> None:
    """At a trace's first value, empty sympy's constructor cache (and ours): it holds expressions
    of earlier traces, and a lookup that meets one equal to its argument compares the two
    graphs node by node, which for nested torch.where is the whole exponential tree."""
    state = _context.current()
    if state is not None and _trace[0] is not state:
        _trace[0] = state
        clear_cache()
        P.integral.cache_clear()


# -- torch.autograd.Function --------------------------------------------------------------------
_BASE = torch.autograd.Function
_TORCH_APPLY = _BASE.__dict__["apply"]


def _apply(cls, *args, **kwargs):
    if _context.current() is None or not any(isinstance(a, P.Proxy) for a in (*args, *kwargs.values())):
        return _TORCH_APPLY.__func__(cls, *args, **kwargs)
    return apply(cls, args, kwargs)


class AutogradFunctions:
    """Active while a mod body runs: `SomeFunction.apply(...)` given a traced value is maskc's
    `apply`. torch calls forward from C++ and hands back what it returned, so that maskc would
    see neither the call nor the backward. Calls without traced values (other threads' among
    them) reach torch's apply unchanged."""

    def __enter__(self):
        self.saved = _BASE.__dict__["apply"]  # a trace inside a mod body finds the traced one
        _BASE.apply = classmethod(_apply)
        return self

    def __exit__(self, *exc):
        _BASE.apply = self.saved


class _FunctionCtx:
    """The ctx a Function's forward and backward receive while maskc traces them."""

    def __init__(self, needs_input_grad: tuple):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()

    def save_for_backward(self, *values):
        self.saved_tensors = values

    def mark_non_differentiable(self, *values):
        pass

    def mark_dirty(self, *values):
        pass

    def set_materialize_grads(self, value):
        pass


def apply(cls, args: tuple, kwargs: dict):
    """`cls.apply(*args, **kwargs)` with traced arguments: its forward, traced. In a score mod,
    where cls has a backward of its own and the value could have a gradient (it reads the score
    or a captured float element), the value carries the gradient that backward gives
    (CustomBackward), as torch's autograd uses it: through each traced float input that reads the
    score or a captured float element, the backward's grad * slope; through whatever the forward
    reads by itself, nothing (torch runs forward without recording it)."""
    backward = cls.vjp if cls.vjp is not _BASE.vjp else cls.backward
    custom = _context.current().kind == "score_mod" and backward is not _BASE.backward
    if custom:
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                _context.fail(f"passes a whole captured tensor that requires grad to torch.autograd.Function "
                              f"'{cls.__name__}'; maskc takes a Function's gradient through its traced inputs",
                              "index the tensor in the mod and pass the element, like "
                              f"{cls.__name__}.apply(score, table[h]), or pass table.detach() if no gradient "
                              f"should reach it")
    setup = cls.setup_context is not _BASE.setup_context
    # as torch's apply: arguments given by keyword are inputs in their place, and with
    # setup_context forward sees its defaults bound
    bound = inspect.signature(cls.forward).bind(*(() if setup else (None,)), *args, **kwargs)
    if setup:
        bound.apply_defaults()
    args, kwargs = bound.args[0 if setup else 1:], bound.kwargs
    inputs = [i for i, a in enumerate(args) if isinstance(a, P.Proxy) and _differentiable(a)]
    if custom and any(isinstance(a, P.Proxy) and _differentiable(a) for a in kwargs.values()):
        _context.fail(f"passes the score to torch.autograd.Function '{cls.__name__}' as a keyword-only argument, "
                      f"which its backward gives no gradient", "pass it as a positional argument")
    ctx = _FunctionCtx(tuple(i in inputs for i in range(len(args))))
    if setup:
        out = cls.forward(*args, **kwargs)
        cls.setup_context(ctx, args, out)
    else:
        out = cls.forward(ctx, *args, **kwargs)
    if not custom:
        return out
    if isinstance(out, (tuple, list)):
        if not inputs:
            return out
        _context.fail(f"uses torch.autograd.Function '{cls.__name__}', whose forward returns {len(out)} values, on "
                      f"the score; maskc takes the gradient of a Function of one output",
                      "return one value from forward (a Function per output)")
    value = P.wrap(out)
    # no gradient flows through a boolean or integer output (a literal may be a float's value: x * 0)
    if value.is_bool or (value.is_int and not value.expr.is_Number) or not (inputs or _differentiable(value)):
        return out
    grad = sympy.Dummy("grad", real=True)
    grads = backward(ctx, P.Proxy(grad))
    grads = grads if isinstance(grads, (tuple, list)) else (grads,)
    pairs = []
    for i in inputs:
        given = grads[i] if i < len(grads) else None
        got = sympy.Integer(0) if given is None else P.number(P.wrap(given))
        slope = _slope(got, grad, {})
        if slope is None:
            _context.fail(f"uses torch.autograd.Function '{cls.__name__}' whose backward is not linear in the "
                          f"gradient (it gives {got} for input {i}); the kernel computes a score's gradient as "
                          f"the incoming gradient times a slope",
                          "make backward return grad times a value that does not depend on grad, like grad * 3, "
                          "grad * torch.sigmoid(x) or torch.where(c, grad, 0)")
        if slope != 0:
            pairs += [args[i].expr, slope]
    return P.Proxy(CustomBackward(value.expr, *pairs))


def _differentiable(p: P.Proxy) -> bool:
    """Whether a gradient can flow through `p`: a float reading the score or a captured float element."""
    return not (p.is_bool or p.is_int) and any(n == SCORE or isinstance(n, LoadFloat) for n in dag.postorder(p.expr))


def _slope(e, grad, done: dict):
    """s such that e = grad * s with s free of grad, read from e's structure (sums, products,
    torch.where on conditions free of grad); None where e is not of that form."""
    if e in done:
        return done[e]
    if e == grad:
        s = sympy.Integer(1)
    elif grad not in dag.free_symbols(e):
        s = sympy.Integer(0) if e == 0 else None
    elif isinstance(e, sympy.Add):
        terms = [_slope(a, grad, done) for a in e.args]
        s = None if any(t is None for t in terms) else sympy.Add(*terms)
    elif isinstance(e, sympy.Mul):
        reading = [f for f in e.args if grad in dag.free_symbols(f)]
        s = _slope(reading[0], grad, done) if len(reading) == 1 else None  # grad * grad is not linear
        s = None if s is None else sympy.Mul(s, *[f for f in e.args if f is not reading[0]])
    elif isinstance(e, sympy.Piecewise) and not any(grad in dag.free_symbols(p.cond) for p in e.args):
        values = [_slope(p.expr, grad, done) for p in e.args]
        s = None if any(v is None for v in values) else piecewise(*[(v, p.cond) for v, p in zip(values, e.args)])
    else:
        s = None
    done[e] = s
    return s
