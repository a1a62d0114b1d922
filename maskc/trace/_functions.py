"""The torch functions and tensor methods maskc traces, looked up by the function object.

A name is not enough: a user's own function named `exp` that dispatches through
__torch_function__ must not trace as torch.exp. Each entry is keyed by every object the
operation arrives as: torch.X, torch.special.X, torch.nn.functional.X, Tensor.X (a method on
a traced value, or on a captured tensor given a traced argument), and the Tensor operators
(`bias * score` arrives as Tensor.mul(bias, score)). Indexing a captured tensor is one of
them: `bias[b][h][q_idx]` is a load once every dimension has its index.

Also here, what a trace does at each new value, among it checking torch.autograd.Function:
its forward traces like any code, but maskc differentiates the traced expression, so a custom
backward that is not the derivative of the forward would silently change the gradients.
"""
from __future__ import annotations

import functools
import math
import sys

import sympy
import torch
import torch.nn.functional as F
from sympy.core.cache import clear_cache

from maskc.errors import MaskTraceError
from maskc.trace import _context
from maskc.trace import proxy as P
from maskc.trace.symbols import SCORE, LoadBool, LoadFloat, LoadInt

UNSUPPORTED_FIX = ("use + - * / // % comparisons & | ~ << >> torch.where/minimum/maximum/abs/clamp and elementwise "
                   "functions (exp, log, tanh, sigmoid, sqrt, sin, cos, erf, F.gelu, ...), or compute the value "
                   "outside the mod and capture it in a tensor")


def call(func, *args, **kwargs):
    """`func(*args, **kwargs)` on traced values."""
    handler = _HANDLERS.get(func)
    if handler is None:
        _context.fail(f"calls {describe(func)}, which maskc cannot trace", UNSUPPORTED_FIX)
    try:
        return handler(*args, **kwargs)
    except MaskTraceError:
        raise
    except TypeError as error:  # an argument the entry does not take: name the call, not our internals
        _context.fail(f"calls {describe(func)} with arguments maskc cannot trace ({error})",
                      "pass the arguments torch documents for an elementwise call")


def method(value, name: str):
    """`value.name`, a tensor method of a traced value."""
    func = getattr(torch.Tensor, name)
    if func not in _HANDLERS:
        verb = "calls" if callable(func) else "reads"
        _context.fail(f"{verb} Tensor.{name}, which maskc cannot trace", UNSUPPORTED_FIX)
    return functools.partial(call, func, value)


def describe(func) -> str:
    name = torch.overrides.resolve_name(func)
    if name:
        return name.replace("torch.Tensor.", "Tensor.")
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


# -- captured tensors --------------------------------------------------------------------------
class TensorView:
    """A captured tensor indexed in fewer dimensions than it has, like `bias[b]`: its next
    indexing (`[h][q_idx]`) completes the load; anything else is refused."""

    __slots__ = ("tensor", "index")

    def __init__(self, tensor: torch.Tensor, index: tuple):
        self.tensor, self.index = tensor, index

    def __getitem__(self, index):
        return index_tensor(self.tensor, self.index + (index if isinstance(index, tuple) else (index,)))

    def refuse(self, *args, **kwargs):
        n, dims = len(self.index), self.tensor.dim()
        _context.fail(f"indexes a captured tensor of {dims} dimensions with {n} indices ({dims - n} missing), "
                      f"which leaves a vector: maskc traces mods that compute one value per (b, h, q_idx, "
                      f"kv_idx)", "give one index per dimension, like bias[b][h][q_idx] or bias[b, h, q_idx]; "
                      "for a reduction, dot product or top-k over a row, compute it outside the mod and "
                      "capture the result")

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        self.refuse()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        next(a for a in args if isinstance(a, TensorView)).refuse()


# Every operator of a partial view is refused: `bias[b] == 0` must not be Python's identity test.
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"):
    setattr(TensorView, f"__{_name}__", TensorView.refuse)
    setattr(TensorView, f"__r{_name}__", TensorView.refuse)
for _name in ("lt", "le", "gt", "ge", "eq", "ne", "neg", "pos", "abs", "invert", "bool", "index", "int", "float",
              "floor", "ceil", "trunc", "round", "iter", "len", "divmod"):
    setattr(TensorView, f"__{_name}__", TensorView.refuse)


def load(tensor: torch.Tensor, index: tuple):
    slot = _context.tensor_slot(tensor)
    if tensor.dtype == torch.bool:
        return sympy.Ne(LoadBool(slot, *index), 0)
    if tensor.dtype.is_floating_point:
        return LoadFloat(slot, *index)
    if tensor.dtype.is_complex:
        _context.fail("indexes a complex tensor", "capture an integer, boolean or floating-point tensor")
    return LoadInt(slot, *index)


def index_tensor(tensor: torch.Tensor, index: tuple):
    """`tensor[index]` for a captured tensor: a load once every dimension has an index."""
    exprs = []
    for dim, i in enumerate(index):
        if isinstance(i, (slice, type(Ellipsis))) or i is None:
            _context.fail("slices a captured tensor with ':', '...' or None",
                          "index it with one traced value or integer per dimension, like table[h, q_idx]")
        p = P.wrap(i)
        if not p.is_int:
            _context.fail(f"indexes a captured tensor with the non-integer value {p.expr}",
                          "index with integer expressions of b, h, q_idx and kv_idx")
        e = p.expr
        if isinstance(e, sympy.Integer) and e < 0 and dim < tensor.dim():
            e += tensor.shape[dim]  # torch counts a negative literal from the end
        exprs.append(e)
    if len(exprs) > tensor.dim():
        _context.fail(f"indexes a captured tensor of {tensor.dim()} dimensions with {len(exprs)} indices",
                      "give one index per dimension, like table[h, q_idx] for a 2-d tensor")
    if len(exprs) < tensor.dim():
        return TensorView(tensor, tuple(exprs))
    return P.Proxy(load(tensor, tuple(exprs)))


# -- the table ----------------------------------------------------------------------------------
_HANDLERS: dict = {}
T = torch.Tensor


def _register(handler, *funcs):
    for func in funcs:
        _HANDLERS[func] = handler


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
    def extreme(a, b=None, *rest, **kwargs):
        if isinstance(b, (P.Proxy, torch.Tensor)) and not rest and not kwargs:
            return P.extreme(a, b, fn)
        _context.fail("reduces a traced value with torch.max or torch.min", f"use torch.{elementwise}(a, b)")

    return extreme


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
    return P.Proxy(P.piecewise((e, e * beta > threshold), (sympy.log(1 + sympy.exp(e * beta)) / beta, sympy.true)))


def _leaky_relu(x, negative_slope=0.01, inplace=False):
    e = P.number(P.wrap(x))
    return P.Proxy(sympy.Max(e, 0) + negative_slope * sympy.Min(e, 0))


def _to(self, *args, dtype=None, **_options):
    # device, non_blocking, copy and memory_format change where the value lives, not what it is
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (torch.Tensor, P.Proxy)):
            dtype = a.dtype
    return P.cast(self, dtype)


def _scalar(size: tuple):
    shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)
    if shape:
        _context.fail(f"creates a tensor of shape {shape} from a traced value",
                      "a mod computes one value per (b, h, q_idx, kv_idx): make it a scalar, like x.new_ones(())")


def _new_full(self, size, fill_value, *, dtype=None, **_options):
    _scalar((size,))
    return P.cast(fill_value, dtype or self.dtype)


def _new_constant(fill_value):
    def new(self, *size, dtype=None, **_options):
        _scalar(size)
        return P.cast(fill_value, dtype or self.dtype)

    return new


def _new_tensor(self, data, *, dtype=None, **_options):
    if isinstance(data, (list, tuple)):
        _scalar((data,))
    return P.cast(data, dtype or self.dtype)


def _like(fill_value=None):
    def like(input, *args, dtype=None, **_options):
        value = args[0] if fill_value is None else fill_value
        return P.cast(value, dtype or input.dtype)

    return like


def _item(self):
    _context.fail("calls .item() on a traced value",
                  "keep it a tensor: comparisons, torch.where and arithmetic take traced values directly")


def _cast_to(dtype):
    return lambda self, *_options, **_kw: P.cast(self, dtype)


def _operator(name):
    # a Tensor operator with a traced operand: what the Proxy's own operator does
    return lambda a, *rest: getattr(P.wrap(a), name)(*rest)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"):
    for _dunder in (f"__{_name}__", f"__r{_name}__"):
        if hasattr(T, _dunder):
            _register(_operator(_dunder), getattr(T, _dunder))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    _register(_operator(f"__{_name}__"), getattr(T, f"__{_name}__"))
_register(lambda tensor, index: index_tensor(tensor, index if isinstance(index, tuple) else (index,)), T.__getitem__)

# arithmetic
_register(lambda a, b, *, alpha=1: P.add(a, _scaled(b, alpha)), torch.add, T.add)
_register(lambda a, b, *, alpha=1: P.sub(a, _scaled(b, alpha)), torch.sub, torch.subtract, T.sub, T.subtract)
_register(P.mul, torch.mul, torch.multiply, T.mul, T.multiply)
_register(_div, torch.div, torch.divide, T.div, T.divide)
_register(lambda a, b: P.arith(a, b, lambda x, y: x / y), torch.true_divide, T.true_divide)
_register(lambda a, b: P.arith(a, b, P.floordiv), torch.floor_divide, T.floor_divide)
_register(lambda a, b: P.arith(a, b, sympy.Mod), torch.remainder, T.remainder)
_register(lambda a, b: P.arith(a, b, P.fmod), torch.fmod, T.fmod)
_register(lambda a, b: P.arith(a, b, lambda x, y: x**y), torch.pow, T.pow, torch.float_power, T.float_power)
_register(lambda x: -P.wrap(x), torch.neg, torch.negative, T.neg, T.negative)
_register(lambda x: abs(P.wrap(x)), torch.abs, torch.absolute, T.abs, T.absolute)
_register(_unary(lambda e: e**2), torch.square, T.square)
_register(_unary(lambda e: 1 / e), torch.reciprocal, T.reciprocal)
_register(lambda x: P.wrap(x) if P.wrap(x).is_bool else P.unary(x, sympy.sign), torch.sign, torch.sgn, T.sign, T.sgn)
_register(lambda a, b: P.extreme(a, b, sympy.Max), torch.maximum, T.maximum)
_register(lambda a, b: P.extreme(a, b, sympy.Min), torch.minimum, T.minimum)
_register(_extreme_or_reduction(sympy.Max, "maximum"), torch.max, T.max)
_register(_extreme_or_reduction(sympy.Min, "minimum"), torch.min, T.min)
_register(P.clamp, torch.clamp, torch.clip, T.clamp, T.clip)
_register(lambda x, min: P.clamp(x, min=min), torch.clamp_min, T.clamp_min)
_register(lambda x, max: P.clamp(x, max=max), torch.clamp_max, T.clamp_max)

# rounding
_register(_unary(sympy.floor), torch.floor, T.floor)
_register(_unary(sympy.ceiling), torch.ceil, T.ceil)
_register(_unary(P.trunc), torch.trunc, torch.fix, T.trunc, T.fix)
_register(_unary(lambda e: e - P.trunc(e)), torch.frac, T.frac)
_register(lambda x, *, decimals=0: P.round_half_even(x, decimals), torch.round, T.round, *_special("round"))

# elementwise functions
_register(_unary(sympy.exp), torch.exp, T.exp)
_register(_unary(lambda e: 2**e), torch.exp2, T.exp2, *_special("exp2"))
_register(_unary(lambda e: sympy.exp(e) - 1), torch.expm1, T.expm1, *_special("expm1"))
_register(_unary(sympy.log), torch.log, T.log)
_register(_unary(lambda e: sympy.log(e, 2)), torch.log2, T.log2)
_register(_unary(lambda e: sympy.log(e, 10)), torch.log10, T.log10)
_register(_unary(lambda e: sympy.log(1 + e)), torch.log1p, T.log1p, *_special("log1p"))
_register(_unary(sympy.sqrt), torch.sqrt, T.sqrt)
_register(_unary(lambda e: 1 / sympy.sqrt(e)), torch.rsqrt, T.rsqrt)
_register(_unary(sympy.sin), torch.sin, T.sin)
_register(_unary(sympy.cos), torch.cos, T.cos)
# tan as written out: Triton has no tan, and sin/cos already print, analyse and differentiate
_register(_unary(lambda e: sympy.sin(e) / sympy.cos(e)), torch.tan, T.tan)
_register(_unary(sympy.tanh), torch.tanh, T.tanh)
_register(_unary(sympy.erf), torch.erf, T.erf, *_special("erf"))
_register(_unary(_sigmoid), torch.sigmoid, T.sigmoid, *_special("expit"))
_register(lambda x, inplace=False: P.unary(x, lambda e: sympy.Max(e, 0)), F.relu, torch.relu, T.relu)
_register(lambda x, inplace=False: P.unary(x, lambda e: e * _sigmoid(e)), F.silu)
_register(_gelu, F.gelu)
_register(_softplus, F.softplus)
_register(_leaky_relu, F.leaky_relu)
_register(lambda x, min_val=-1.0, max_val=1.0, inplace=False: P.clamp(x, min_val, max_val), F.hardtanh)
_register(lambda x, inplace=False: P.clamp(x, 0, 6), F.relu6)

# comparisons and logic
_register(lambda a, b: P.compare(a, b, sympy.Eq), torch.eq, T.eq)
_register(lambda a, b: P.compare(a, b, sympy.Ne), torch.ne, torch.not_equal, T.ne, T.not_equal)
_register(lambda a, b: P.compare(a, b, sympy.Lt), torch.lt, torch.less, T.lt, T.less)
_register(lambda a, b: P.compare(a, b, sympy.Le), torch.le, torch.less_equal, T.le, T.less_equal)
_register(lambda a, b: P.compare(a, b, sympy.Gt), torch.gt, torch.greater, T.gt, T.greater)
_register(lambda a, b: P.compare(a, b, sympy.Ge), torch.ge, torch.greater_equal, T.ge, T.greater_equal)
_register(lambda a, b: P.Proxy(P.conjunction(P.boolean(P.wrap(a)), P.boolean(P.wrap(b)))),
          torch.logical_and, T.logical_and)
_register(lambda a, b: P.Proxy(P.disjunction(P.boolean(P.wrap(a)), P.boolean(P.wrap(b)))),
          torch.logical_or, T.logical_or)
_register(lambda a, b: P.Proxy(P.parity(P.boolean(P.wrap(a)), P.boolean(P.wrap(b)))), torch.logical_xor, T.logical_xor)
_register(lambda a: P.Proxy(P.negation(P.boolean(P.wrap(a)))), torch.logical_not, T.logical_not)
_register(lambda a, b: P.bitwise(a, b, "&"), torch.bitwise_and, T.bitwise_and)
_register(lambda a, b: P.bitwise(a, b, "|"), torch.bitwise_or, T.bitwise_or)
_register(lambda a, b: P.bitwise(a, b, "^"), torch.bitwise_xor, T.bitwise_xor)
_register(lambda a: ~P.wrap(a), torch.bitwise_not, T.bitwise_not)
_register(lambda a, b: P.shift(a, b, "<<"), torch.bitwise_left_shift, T.bitwise_left_shift)
_register(lambda a, b: P.shift(a, b, ">>"), torch.bitwise_right_shift, T.bitwise_right_shift)
_register(P.where, torch.where)
_register(lambda self, condition, other: P.where(condition, self, other), T.where)

# dtypes and new values
_register(_to, T.to)
_register(lambda self, other: P.cast(self, other.dtype), T.type_as)
for _method, _dtype in (("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                        ("bfloat16", torch.bfloat16), ("long", torch.int64), ("int", torch.int32),
                        ("short", torch.int16), ("bool", torch.bool)):
    _register(_cast_to(_dtype), getattr(T, _method))
_register(lambda self, **_options: P.Proxy(P.wrap(self).expr), T.clone, T.contiguous)
_register(_new_constant(1), T.new_ones)
_register(_new_constant(0), T.new_zeros)
_register(_new_full, T.new_full)
_register(_new_tensor, T.new_tensor)
_register(_like(), torch.full_like)
_register(_like(1), torch.ones_like)
_register(_like(0), torch.zeros_like)
_register(_item, T.item)


# -- per trace ----------------------------------------------------------------------------------
_APPLY_CODE = torch.autograd.Function.apply.__func__.__code__
# [trace state, Function.apply frames already checked in it]; traces run one at a time (the tracer's lock)
_trace: list = [None, []]


def on_new_value() -> None:
    """Bookkeeping for each new proxy of a trace in progress.

    At a trace's first value, empty sympy's constructor cache (and ours): it holds expressions
    of earlier traces, and a lookup that meets one equal to its argument compares the two
    graphs node by node, which for nested torch.where is the whole exponential tree.

    Then check every torch.autograd.Function whose forward is running: it is called from C++,
    so creating values is the first we see of it.
    """
    state = _context.current()
    if state is None:
        return
    if _trace[0] is not state:
        _trace[:] = [state, []]
        clear_cache()
        P.integral.cache_clear()
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _APPLY_CODE and not any(f is frame for f in _trace[1]):
            _trace[1].append(frame)
            local = frame.f_locals
            _check_backward(local["cls"], local["args"], local.get("kwargs") or {})
        frame = frame.f_back


class _FunctionCtx:
    """The ctx a Function's forward and backward receive, while maskc checks its backward."""

    def __init__(self, needs_input_grad: tuple):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()

    def save_for_backward(self, *values):
        self.saved_tensors = values

    def mark_non_differentiable(self, *values):
        pass

    def set_materialize_grads(self, value):
        pass


def _check_backward(cls, args: tuple, kwargs: dict) -> None:
    """Refuse `cls` if its backward, traced, is not grad * d(forward)/d(input) for each input
    that carries the score (no gradient reaches the others)."""
    base = torch.autograd.Function
    backward = cls.vjp if cls.vjp is not base.vjp else cls.backward
    if backward is base.backward:
        return  # no backward of its own: torch too would have only the forward to go by
    inputs = {i: sympy.Dummy(f"input{i}", real=True) for i, a in enumerate(args)
              if isinstance(a, P.Proxy) and SCORE in a.expr.free_symbols}
    if not inputs:
        return
    traced_args = tuple(P.Proxy(inputs[i]) if i in inputs else a for i, a in enumerate(args))
    ctx = _FunctionCtx(tuple(i in inputs for i in range(len(args))))
    if cls.setup_context is not base.setup_context:
        out = cls.forward(*traced_args, **kwargs)
        cls.setup_context(ctx, traced_args, out)
    else:
        out = cls.forward(ctx, *traced_args, **kwargs)
    out = P.number(P.wrap(out))
    grad = sympy.Dummy("grad", real=True)
    grads = backward(ctx, P.Proxy(grad))
    grads = grads if isinstance(grads, tuple) else (grads,)
    for i, symbol in inputs.items():
        given = grads[i] if i < len(grads) else None
        got = sympy.Integer(0) if given is None else P.number(P.wrap(given))
        want = grad * sympy.diff(out, symbol)
        if sympy.simplify(got - want) != 0:
            _context.fail(f"uses torch.autograd.Function '{cls.__name__}' whose backward is not the derivative of "
                          f"its forward (backward gives {got}, the derivative is {want}); maskc differentiates the "
                          f"traced forward, so its gradients would differ from torch's",
                          "drop the Function and write its forward in the mod, or make backward return the true "
                          "derivative")
