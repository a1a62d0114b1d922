"""Proxy values: stand-ins for b, h, q_idx, kv_idx and score that record what the user does.

Every operator returns a new Proxy around a sympy expression. Python control flow on a
proxy (`if`, `and`, `or`, `not`, `bool()`, `int()`, `range()`) cannot be recorded, so it
raises MaskTraceError pointing at the user's line.
"""
from __future__ import annotations

import numbers

import sympy
import torch

from maskc.trace import _context
from maskc.trace.symbols import LoadBool, LoadFloat, LoadInt


class Proxy:
    """A traced value: `expr` is its sympy expression."""

    __slots__ = ("expr",)

    def __init__(self, expr):
        self.expr = sympy.sympify(expr)

    # -- kinds -----------------------------------------------------------------------------
    @property
    def is_bool(self) -> bool:
        # sympy Symbols are both Expr and Boolean; only non-Expr booleans are truth values
        return isinstance(self.expr, sympy.logic.boolalg.Boolean) and not isinstance(self.expr, sympy.Expr)

    def __repr__(self):
        return f"Proxy({self.expr})"

    # -- arithmetic ------------------------------------------------------------------------
    def __add__(self, other):
        return _arith(self, other, lambda a, b: a + b)

    def __radd__(self, other):
        return _arith(other, self, lambda a, b: a + b)

    def __sub__(self, other):
        return _arith(self, other, lambda a, b: a - b)

    def __rsub__(self, other):
        return _arith(other, self, lambda a, b: a - b)

    def __mul__(self, other):
        return _arith(self, other, lambda a, b: a * b)

    def __rmul__(self, other):
        return _arith(other, self, lambda a, b: a * b)

    def __truediv__(self, other):
        return _arith(self, other, lambda a, b: a / b)

    def __rtruediv__(self, other):
        return _arith(other, self, lambda a, b: a / b)

    def __floordiv__(self, other):
        return _arith(self, other, _floordiv)

    def __rfloordiv__(self, other):
        return _arith(other, self, _floordiv)

    def __mod__(self, other):
        return _arith(self, other, sympy.Mod)

    def __rmod__(self, other):
        return _arith(other, self, sympy.Mod)

    def __pow__(self, other):
        return _arith(self, other, lambda a, b: a**b)

    def __rpow__(self, other):
        return _arith(other, self, lambda a, b: a**b)

    def __neg__(self):
        return Proxy(-_number(self))

    def __pos__(self):
        return self

    def __abs__(self):
        return Proxy(sympy.Abs(_number(self)))

    # -- comparisons -----------------------------------------------------------------------
    def __lt__(self, other):
        return _compare(self, other, sympy.Lt)

    def __le__(self, other):
        return _compare(self, other, sympy.Le)

    def __gt__(self, other):
        return _compare(self, other, sympy.Gt)

    def __ge__(self, other):
        return _compare(self, other, sympy.Ge)

    def __eq__(self, other):
        return _compare(self, other, sympy.Eq)

    def __ne__(self, other):
        return _compare(self, other, sympy.Ne)

    __hash__ = object.__hash__

    # -- logic -----------------------------------------------------------------------------
    def __and__(self, other):
        return _logic(self, other, sympy.And, "&")

    __rand__ = __and__

    def __or__(self, other):
        return _logic(self, other, sympy.Or, "|")

    __ror__ = __or__

    def __xor__(self, other):
        return _logic(self, other, sympy.Xor, "^")

    __rxor__ = __xor__

    def __invert__(self):
        if not self.is_bool:
            _context.fail("applies '~' to a non-boolean value", "use '-x - 1' for integers or build the condition first")
        return Proxy(sympy.Not(self.expr))

    # -- what cannot be traced -------------------------------------------------------------
    def __bool__(self):
        _context.fail(
            "uses Python control flow ('if', 'and', 'or', 'not', bool() or builtin min/max) on a traced value",
            "use torch.where(cond, a, b), torch.minimum/maximum, or & | ~ instead",
        )

    def __index__(self):
        _context.fail(
            "converts a traced value to a Python int (int(), range(), or indexing a list)",
            "index a captured torch tensor instead, or keep the value symbolic",
        )

    __int__ = __index__

    def __float__(self):
        _context.fail("converts a traced value to a Python float", "keep the value symbolic")

    def __iter__(self):
        _context.fail("iterates over a traced value", "index captured tensors with the value instead")

    def __len__(self):
        _context.fail("asks the len() of a traced value", "use the lengths of captured tensors instead")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_call(func, args, kwargs or {})


def wrap(value):
    """A Proxy for a Python number, bool, sympy expression or Proxy."""
    if isinstance(value, Proxy):
        return value
    if isinstance(value, bool):
        return Proxy(sympy.true if value else sympy.false)
    if isinstance(value, numbers.Integral):
        return Proxy(sympy.Integer(int(value)))
    if isinstance(value, numbers.Real):
        return Proxy(sympy.Float(float(value)))
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return Proxy(_load_tensor(value, ()))
    if isinstance(value, sympy.Basic):
        return Proxy(value)
    _context.fail(f"combines a traced value with an object of type {type(value).__name__}",
                  "use Python numbers, captured tensors indexed by traced values, or other traced values")


def _number(p: Proxy):
    """The expression of `p` as a number: booleans count as 0/1, as in torch."""
    if p.is_bool:
        return sympy.Piecewise((sympy.Integer(1), p.expr), (sympy.Integer(0), True))
    return p.expr


def _floordiv(a, b):
    return sympy.floor(a / b)


def _arith(a, b, op):
    return Proxy(op(_number(wrap(a)), _number(wrap(b))))


def _compare(a, b, rel):
    return Proxy(rel(_number(wrap(a)), _number(wrap(b))))


def _boolean(p: Proxy, op: str):
    if not p.is_bool:
        _context.fail(f"applies '{op}' to a non-boolean value {p.expr}",
                      "compare it first (for example 'x != 0'); bitwise operations on integers are not supported")
    return p.expr


def _logic(a, b, op, name):
    return Proxy(op(_boolean(wrap(a), name), _boolean(wrap(b), name)))


# -- captured tensors ----------------------------------------------------------------------
def _load_tensor(tensor: torch.Tensor, index: tuple):
    slot = _context.tensor_slot(tensor)
    if tensor.dtype == torch.bool:
        return sympy.Ne(LoadBool(slot, *index), 0)
    if tensor.dtype.is_floating_point:
        return LoadFloat(slot, *index)
    if tensor.dtype.is_complex:
        _context.fail("indexes a complex tensor", "capture an integer, boolean or floating-point tensor")
    return LoadInt(slot, *index)


def _getitem(tensor: torch.Tensor, index):
    index = index if isinstance(index, tuple) else (index,)
    exprs = []
    for i in index:
        if isinstance(i, (slice, type(Ellipsis))) or i is None:
            _context.fail("slices a captured tensor with ':', '...' or None",
                          "index it with one traced value or integer per dimension, like table[h, q_idx]")
        p = wrap(i)
        if p.is_bool or not p.expr.is_integer:
            _context.fail(f"indexes a captured tensor with the non-integer value {p.expr}",
                          "index with integer expressions of b, h, q_idx and kv_idx")
        exprs.append(p.expr)
    if len(exprs) != tensor.dim():
        _context.fail(f"indexes a captured tensor of {tensor.dim()} dimensions with {len(exprs)} indices",
                      "give one index per dimension, like table[h, q_idx] for a 2-d tensor")
    return Proxy(_load_tensor(tensor, tuple(exprs)))


# -- torch functions -----------------------------------------------------------------------
def _where(cond, a, b):
    c = _boolean(wrap(cond), "torch.where")
    pa, pb = wrap(a), wrap(b)
    if pa.is_bool and pb.is_bool:
        return Proxy(sympy.Or(sympy.And(c, pa.expr), sympy.And(sympy.Not(c), pb.expr)))
    return Proxy(sympy.Piecewise((_number(pa), c), (_number(pb), True)))


def _clamp(x, min=None, max=None):
    e = _number(wrap(x))
    if min is not None:
        e = sympy.Max(e, _number(wrap(min)))
    if max is not None:
        e = sympy.Min(e, _number(wrap(max)))
    return Proxy(e)


def _unary(fn):
    return lambda x: Proxy(fn(_number(wrap(x))))


def _binary(fn):
    return lambda a, b: Proxy(fn(_number(wrap(a)), _number(wrap(b))))


def _sigmoid(x):
    return 1 / (1 + sympy.exp(-x))


_TORCH_FUNCTIONS = {
    "where": _where,
    "minimum": _binary(sympy.Min),
    "maximum": _binary(sympy.Max),
    "min": _binary(sympy.Min),
    "max": _binary(sympy.Max),
    "abs": _unary(sympy.Abs),
    "clamp": _clamp,
    "clip": _clamp,
    "exp": _unary(sympy.exp),
    "log": _unary(sympy.log),
    "tanh": _unary(sympy.tanh),
    "sigmoid": _unary(_sigmoid),
    "sqrt": _unary(sympy.sqrt),
    "floor_divide": _binary(_floordiv),
    "remainder": _binary(sympy.Mod),
    "logical_and": lambda a, b: wrap(a) & wrap(b),
    "logical_or": lambda a, b: wrap(a) | wrap(b),
    "logical_not": lambda a: ~wrap(a),
    "__getitem__": _getitem,
}


def _torch_call(func, args, kwargs):
    name = getattr(func, "__name__", str(func))
    if name.startswith("__") and name != "__getitem__" and hasattr(Proxy, name) and args:
        # `captured_tensor * proxy` reaches us as Tensor.__mul__(tensor, proxy); a 0-d
        # tensor becomes a load, any other tensor is refused by wrap().
        return getattr(wrap(args[0]), name)(*args[1:])
    handler = _TORCH_FUNCTIONS.get(name)
    if handler is None:
        _context.fail(f"calls torch.{name}, which maskc cannot trace",
                      "use + - * / // % comparisons & | ~ torch.where/minimum/maximum/abs/clamp, "
                      "and in score mods torch.exp/log/tanh/sigmoid/sqrt")
    return handler(*args, **kwargs)
