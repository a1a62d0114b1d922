"""Proxy values: stand-ins for b, h, q_idx, kv_idx and score that record what the user does.

Every operator returns a new Proxy around a sympy expression, with torch's semantics for
the kind of value it holds: a boolean, an integer or a float, read from the expression (see
`Proxy.dtype`). Indexing a captured tensor with proxies is a load; with fewer indices than it
has dimensions, a small row of loads (maskc.trace.vector). Torch functions and tensor
methods reach `call` and are looked up by identity in the handlers that maskc.trace._functions
registers. Python control flow on a proxy (`if`, `and`, `or`, `not`, `bool()`, `int()`,
`range()`) cannot be recorded, so it raises MaskTraceError pointing at the user's line.
"""
from __future__ import annotations

import functools
import numbers
from fractions import Fraction

import numpy
import sympy
import torch

from maskc.errors import MaskTraceError
from maskc.trace import _context, dag
from maskc.trace.canonical import conjunction, disjunction, negation, parity, piecewise
from maskc.trace.symbols import (LOADS, SCORE, BitAnd, BitOr, BitXor, LeftShift, LoadBool, LoadFloat, LoadInt,
                                 RightShift, Trunc, is_param)


class Proxy:
    """A traced value: `expr` is its sympy expression."""

    __slots__ = ("expr",)

    def __init__(self, expr):
        self.expr = sympy.sympify(expr)
        for hook in _NEW_VALUE_HOOKS:
            hook()

    # -- kinds -----------------------------------------------------------------------------
    @property
    def is_bool(self) -> bool:
        # sympy Symbols are both Expr and Boolean; only non-Expr booleans are truth values
        return isinstance(self.expr, sympy.logic.boolalg.Boolean) and not isinstance(self.expr, sympy.Expr)

    @property
    def is_int(self) -> bool:
        return not self.is_bool and integral(self.expr)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype FlexAttention's value would have: its index arguments are int32."""
        return torch.bool if self.is_bool else torch.int32 if self.is_int else torch.float32

    # FlexAttention calls a mod on 0-d tensors (through vmap): torch's own noop_mask passes
    # device=b.device to new_ones, and mods write x.new_zeros(x.shape).
    shape = torch.Size([])
    ndim = 0
    device = torch.device("cpu")  # where the value lives does not change what it is

    def __repr__(self):
        return f"Proxy({self.expr})"

    # -- arithmetic ------------------------------------------------------------------------
    def __add__(self, other):
        return add(self, other)

    def __radd__(self, other):
        return add(other, self)

    def __sub__(self, other):
        return sub(self, other)

    def __rsub__(self, other):
        return sub(other, self)

    def __mul__(self, other):
        return mul(self, other)

    def __rmul__(self, other):
        return mul(other, self)

    def __truediv__(self, other):
        return arith(self, other, lambda a, b: a / b)

    def __rtruediv__(self, other):
        return arith(other, self, lambda a, b: a / b)

    def __floordiv__(self, other):
        return arith(self, other, floordiv)

    def __rfloordiv__(self, other):
        return arith(other, self, floordiv)

    def __mod__(self, other):
        return arith(self, other, mod)

    def __rmod__(self, other):
        return arith(other, self, mod)

    def __divmod__(self, other):
        return self // other, self % other

    def __pow__(self, other):
        return arith(self, other, power)

    def __rpow__(self, other):
        return arith(other, self, power)

    def __neg__(self):
        if self.is_bool:
            _context.fail("negates a boolean (torch refuses it too)", "use ~ for booleans, or .long() first")
        return Proxy(-self.expr)

    def __pos__(self):
        return self

    def __abs__(self):
        return self if self.is_bool else Proxy(dag.make(sympy.Abs, self.expr))

    # -- rounding, as math.floor/ceil/trunc and round() ask for it ---------------------------
    def __floor__(self):
        return unary(self, floor)

    def __ceil__(self):
        return unary(self, ceiling)

    def __trunc__(self):
        return unary(self, trunc)

    def __round__(self, ndigits=None):
        return round_half_even(self, ndigits or 0)

    # -- comparisons -----------------------------------------------------------------------
    def __lt__(self, other):
        return compare(self, other, sympy.Lt)

    def __le__(self, other):
        return compare(self, other, sympy.Le)

    def __gt__(self, other):
        return compare(self, other, sympy.Gt)

    def __ge__(self, other):
        return compare(self, other, sympy.Ge)

    def __eq__(self, other):
        return compare(self, other, sympy.Eq)

    def __ne__(self, other):
        return compare(self, other, sympy.Ne)

    __hash__ = object.__hash__

    # -- logic and bits --------------------------------------------------------------------
    def __and__(self, other):
        return bitwise(self, other, "&")

    def __rand__(self, other):
        return bitwise(other, self, "&")

    def __or__(self, other):
        return bitwise(self, other, "|")

    def __ror__(self, other):
        return bitwise(other, self, "|")

    def __xor__(self, other):
        return bitwise(self, other, "^")

    def __rxor__(self, other):
        return bitwise(other, self, "^")

    def __invert__(self):
        if self.is_bool:
            return Proxy(negation(self.expr))
        return Proxy(-integer(self, "~") - 1)

    def __lshift__(self, other):
        return shift(self, other, "<<")

    def __rlshift__(self, other):
        return shift(other, self, "<<")

    def __rshift__(self, other):
        return shift(self, other, ">>")

    def __rrshift__(self, other):
        return shift(other, self, ">>")

    # -- torch -----------------------------------------------------------------------------
    def __getattr__(self, name):
        # tensor methods (q_idx.clamp(0, 8), score.exp()): the same table as torch functions
        if name.startswith("_") or not hasattr(torch.Tensor, name):
            raise AttributeError(f"'Proxy' object has no attribute {name!r}")
        return method(self, name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return call(func, *args, **(kwargs or {}))

    # -- what cannot be traced, unless it is made of captured numbers only ------------------
    def _python_value(self):
        """The number or truth value Python asks for (bool(), int(), float()) where this value
        is made of constants and captured numbers alone (no position, score or tensor element),
        as FlexAttention hands Python the number: a constant as it folded, or else
        _context.Structural, and the trace starts again with those captured numbers as
        constants. None where Python cannot decide."""
        state = _context.current()
        if state is None or dag.atoms(self.expr, LoadInt, LoadFloat, LoadBool):
            return None
        symbols = self.expr.free_symbols
        if not symbols:
            # the trace keeps comparisons unevaluated: each node evaluated, bottom-up
            folded = dag.transform(self.expr, lambda e: e.func(*e.args) if e.args else e)
            return folded if folded.is_Number or folded in (sympy.true, sympy.false) else None
        if symbols <= state.param_origins.keys():
            raise _context.Structural(frozenset(state.param_origins[s] for s in symbols))
        return None

    def __bool__(self):
        value = self._python_value()
        if value is not None:
            return bool(value)
        _context.fail(
            "uses Python control flow ('if', 'and', 'or', 'not', bool() or builtin min/max) on a traced value",
            "use torch.where(cond, a, b), torch.minimum/maximum, or & | ~ instead",
        )

    def __index__(self):
        value = self._python_value()
        if value is not None and value.is_Integer:
            return int(value)
        _context.fail(
            "converts a traced value to a Python int (int(), range(), or indexing a list)",
            "index a captured torch tensor instead, or keep the value symbolic",
        )

    __int__ = __index__

    def __float__(self):
        value = self._python_value()
        if value is not None and value.is_Number:
            return float(value)
        _context.fail("converts a traced value to a Python float", "keep the value symbolic")

    def __iter__(self):
        _context.fail("iterates over a traced value", "index captured tensors with the value instead")

    def __len__(self):
        # torch.tensor(x) and torch.as_tensor(x) ask this too, as x has __getitem__
        _context.fail("asks the len() of a traced value, or makes a tensor of it with torch.tensor()",
                      "a traced value is a scalar tensor already: use it directly; for sizes use the lengths of "
                      "captured tensors")

    def __getitem__(self, index):
        _context.fail("indexes a traced value", "traced values are scalars: index captured tensors with them instead")


class Rows:
    """A traced row of a captured tensor, `means[q_idx]`, indexed with fewer indices than the
    tensor has dimensions. Its class, maskc.trace.vector's Vector (a row of scalar proxies),
    builds on this module and installs itself as `Rows.kind`; maskc/trace/__init__.py imports it
    before any trace. The operators here defer to it and hand it the calls on rows."""

    __slots__ = ()
    kind: type

    @classmethod
    def view(cls, tensor: torch.Tensor, index: tuple) -> "Rows":
        """`tensor[index]`, `index` a traced value or literal for each of its first dimensions."""
        raise NotImplementedError

    @staticmethod
    def call(func, *args, **kwargs):
        """`func(*args, **kwargs)` where an argument is a row."""
        raise NotImplementedError

    def refuse_as_value(self):
        """Fail: a row where one value is needed."""
        raise NotImplementedError


def _holds_rows(args, kwargs) -> bool:
    """Whether a row is among the arguments, or in a tuple of them (`table[b, row]`)."""
    return any(isinstance(a, Rows) or isinstance(a, tuple) and any(isinstance(i, Rows) for i in a)
               for a in (*args, *kwargs.values()))


def _defers_to_vectors(op):
    # `q_idx >= row`: Python then asks the row's reflected operator, elementwise (maskc.trace.vector)
    def operator(self, other):
        return NotImplemented if isinstance(other, Rows) else op(self, other)

    return functools.update_wrapper(operator, op)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"):
    for _dunder in (f"__{_name}__", f"__r{_name}__"):
        setattr(Proxy, _dunder, _defers_to_vectors(getattr(Proxy, _dunder)))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(Proxy, f"__{_name}__", _defers_to_vectors(getattr(Proxy, f"__{_name}__")))


_INTEGER_NODES = (sympy.Integer, sympy.floor, sympy.ceiling, Trunc, BitAnd, BitOr, BitXor, LeftShift, RightShift,
                  LoadInt, LoadBool)
_INTEGER_OF_INTEGERS = (sympy.Add, sympy.Mul, sympy.Min, sympy.Max, sympy.Abs, sympy.Mod, sympy.sign)


def quotient(factors):
    """A product's factors as torch divides them: (numerator, denominator, scale) where the
    product is one true division x / d times a number (sympy holds it as x * d**-n), else None.
    The printer and the dense evaluator both compute it so.
    - Every quotient is one division, captured float elements' too (`w[q_idx] / w[kv_idx] >= 1`
      keeps the diagonal only if w / w rounds to 1.0), and the scale is 1;
    - except a Python number over a tensor (a literal, or a captured float: a parameter):
      torch's `c / x` is `x.reciprocal() * c`, two roundings, so the numerator is 1 and the
      scale c;
    - and except a score's by a divisor that is not an integer (softcap's score / cap): that
      reciprocal is taken once in its own dtype, within a score's rounding of the quotient."""
    divisors = [f.base ** -f.exp for f in factors if _divisor(f)]
    if not divisors:
        return None
    numerator = sympy.Mul(*[f for f in factors if not _divisor(f)], evaluate=False)
    denominator = sympy.Mul(*divisors, evaluate=False)
    if SCORE in dag.free_symbols(sympy.Tuple(numerator, denominator)) and not all(map(_whole, divisors)):
        return None
    if not dag.atoms(numerator, *LOADS) and all(map(is_param, dag.free_symbols(numerator))):
        return sympy.S.One, denominator, numerator
    return numerator, denominator, sympy.S.One


def multiplied_out(exp) -> int | None:
    """The n of x**n where the printer and the dense evaluator multiply x out n times (a
    reciprocal of the product where n < 0): an integer exponent, written as one or as a float
    (score**2.0), from -64 to 64; else None."""
    if exp.is_Number and exp.is_finite and float(exp).is_integer() and abs(float(exp)) <= 64:
        return int(exp)
    return None


def _divisor(e) -> bool:
    # d**-n with n a literal from 1 to 64 (the powers a printer multiplies out), d not a number
    # (a number's reciprocal is a literal)
    return e.is_Pow and e.exp.is_Integer and -64 <= e.exp < 0 and not e.base.is_number


def _whole(e) -> bool:
    return bool(e.is_integer) or integral(e)


@functools.lru_cache(maxsize=1 << 16)
def integral(expr) -> bool:
    """Whether `expr` is an integer in torch's sense: integers combined by integer operations.
    Read from the structure, once per distinct node: sympy's `is_integer` is None for
    floor(kv_idx / p0) (p0 could be 0), and for a product it walks the whole tree of its
    factors, which is exponential for nested torch.where."""
    if isinstance(expr, _INTEGER_NODES):
        return True
    if isinstance(expr, sympy.Symbol):
        return bool(expr.is_integer)
    if isinstance(expr, _INTEGER_OF_INTEGERS):
        return all(integral(a) for a in expr.args)
    if isinstance(expr, sympy.Pow):
        return integral(expr.base) and integral(expr.exp) and expr.exp.is_nonnegative is True
    if isinstance(expr, sympy.Piecewise):
        return all(integral(pair.expr) for pair in expr.args)
    return False


def wrap(value) -> Proxy:
    """A Proxy for a Python number, bool, sympy expression, 0-d captured tensor or Proxy."""
    if isinstance(value, Proxy):
        return value
    if isinstance(value, bool):
        return Proxy(sympy.true if value else sympy.false)
    if isinstance(value, numbers.Integral):
        return Proxy(sympy.Integer(int(value)))
    if isinstance(value, numbers.Real):
        return Proxy(sympy.Float(float(value)))
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return Proxy(load(value, ()))
    if isinstance(value, sympy.Basic):
        return Proxy(value)
    if isinstance(value, Rows):
        value.refuse_as_value()
    _context.fail(f"combines a traced value with an object of type {type(value).__name__}",
                  "use Python numbers, captured tensors indexed by traced values, or other traced values")


def number(p: Proxy):
    """The expression of `p` as a number: booleans count as 0/1, as in torch."""
    if p.is_bool:
        return piecewise((sympy.Integer(1), p.expr), (sympy.Integer(0), sympy.true))
    return p.expr


def boolean(p: Proxy):
    """The expression of `p` as a truth value: numbers are true when nonzero, as in torch."""
    return p.expr if p.is_bool else relation(sympy.Ne, p.expr, sympy.Integer(0))


def relation(rel, a, b):
    # NOTE: unevaluated: sympy would ask the assumptions of a - b, which for nested torch.where
    # walks the whole tree; canonicalize() evaluates each relation once its sides are simple.
    return rel(a, b, evaluate=False)


def integer(p: Proxy, op: str):
    """The expression of `p` for an integer-only operation `op`."""
    if not p.is_bool and not p.is_int:
        _context.fail(f"applies '{op}' to a floating-point value {p.expr}",
                      "bitwise operations and shifts take integers or booleans; convert with .long() first")
    return number(p)


# -- arithmetic --------------------------------------------------------------------------------
def arith(a, b, op) -> Proxy:
    return Proxy(op(number(wrap(a)), number(wrap(b))))


def unary(x, fn) -> Proxy:
    return Proxy(fn(number(wrap(x))))


def add(a, b) -> Proxy:
    pa, pb = wrap(a), wrap(b)
    if pa.is_bool and pb.is_bool:
        return Proxy(disjunction(pa.expr, pb.expr))  # torch: True + True is True
    return Proxy(number(pa) + number(pb))


def sub(a, b) -> Proxy:
    pa, pb = wrap(a), wrap(b)
    if pa.is_bool and pb.is_bool:
        _context.fail("subtracts two booleans (torch refuses it too)", "use ^ or & ~ for booleans, or .long() first")
    return Proxy(number(pa) - number(pb))


def mul(a, b) -> Proxy:
    pa, pb = wrap(a), wrap(b)
    if pa.is_bool and pb.is_bool:
        return Proxy(conjunction(pa.expr, pb.expr))
    return Proxy(number(pa) * number(pb))


# A float literal is read as the rational it spells when its denominator and numerator are at
# most this: the int32 arithmetic that then rounds it exactly (a position times the numerator)
# holds for positions below 2 million.
_SPELLED_LIMIT = 1024


def as_spelled(x):
    """Index arithmetic `x` (integers and float literals only) with each literal as the
    rational it spells: 0.1 as 1/10, 1/7.0 as 1/7. For the operations whose result jumps
    at integers (floor, ceil, trunc, %, comparisons): sympy writes (q_idx - kv_idx) * 0.1 as
    0.1*q_idx - 0.1*kv_idx, which float32 rounds otherwise than torch's one product, and
    at q_idx - kv_idx = 10 that last bit picks the other integer. Over rationals the
    printer rounds exactly, with integer division. This is torch's float32 answer except
    where float32's own rounding of the product crosses an integer (ceil(50 * 0.3) is 16
    there); anything else (a score, a float load, a float parameter) is left as it is."""
    # by identity, once per distinct node: sympy's atoms walks the tree, exponential in a where-nest
    floats = set(dag.atoms(x, sympy.Float)) if isinstance(x, sympy.Basic) else ()
    if not floats or dag.atoms(x, LoadFloat) or not all(s.is_integer for s in dag.free_symbols(x)):
        return x  # a score, a float load or a float parameter: rounded as float32 rounds it
    spelled = {}
    for f in floats:
        r = Fraction(float(f)).limit_denominator(_SPELLED_LIMIT)
        if float(r) != float(f) or abs(r.numerator) > _SPELLED_LIMIT:
            return x
        spelled[f] = sympy.Rational(r.numerator, r.denominator)
    rational = dag.transform(x, lambda e: spelled.get(e, e))  # xreplace would evaluate Max, Abs, ... (dag.make)
    numerator, denominator = rational.as_numer_denom()
    return rational if denominator.is_Integer and integral(numerator) else x


def power(a, b):
    return dag.make(sympy.Pow, a, b)  # sympy writes sqrt(x**2) as Abs(x), which asks x's sign


def floor(x):
    return dag.make(sympy.floor, as_spelled(x))


def ceiling(x):
    return dag.make(sympy.ceiling, as_spelled(x))


def floordiv(a, b):
    return floor(a / b)


def float32_exact(m) -> bool:
    """Whether the divisor `m` of a remainder is one over whose rational reading the remainder
    is torch's: not a float literal that float32 holds inexactly. torch's remainder by 0.3 is
    exact arithmetic on float32's 0.30000001192, which is not 3/10 (at 3 it gives 0.2999999,
    not 0), so such a remainder stays float arithmetic."""
    return not any(float(numpy.float32(f)) != float(f) for f in dag.atoms(m, sympy.Float))


def mod(a, b):
    if b in (sympy.oo, -sympy.oo):
        # torch and Python: x % inf is x where x has the divisor's sign (or is 0), else the divisor
        # (-1 % inf == inf); sympy's Mod(x, oo) is nan, which would make every comparison false
        return piecewise((a, relation(sympy.Ge if b > 0 else sympy.Le, a, 0)), (b, sympy.true))
    return dag.make(sympy.Mod, as_spelled(a), as_spelled(b)) if float32_exact(b) else dag.make(sympy.Mod, a, b)


def trunc(x):
    """x rounded toward zero: C's integer division and float-to-integer conversion."""
    x = as_spelled(x)
    if integral(x):
        return x
    if x.is_Number:
        return sympy.Integer(int(x))
    return Trunc(x)


def round_half_even(x, decimals: int = 0) -> Proxy:
    """torch.round and Python's round(): halves go to the even neighbour."""
    e = as_spelled(number(wrap(x)))
    if integral(e) and decimals >= 0:
        return Proxy(e)
    scaled = e * sympy.Integer(10) ** decimals
    low = dag.make(sympy.floor, scaled)
    rest = scaled - low
    half = sympy.Rational(1, 2)
    rounded = piecewise((low, relation(sympy.Lt, rest, half)), (low + 1, relation(sympy.Gt, rest, half)),
                        (low + dag.make(sympy.Mod, low, 2), sympy.true))
    return Proxy(rounded / sympy.Integer(10) ** decimals)


# -- comparisons and logic ---------------------------------------------------------------------
def compare(a, b, rel) -> Proxy:
    pa, pb = wrap(a), wrap(b)
    if rel in (sympy.Eq, sympy.Ne) and pa.is_bool and pb.is_bool:
        # Eq of two conditions would be Eq of 0/1 Piecewise, which no later stage can read
        differ = parity(pa.expr, pb.expr)
        return Proxy(differ if rel is sympy.Ne else negation(differ))
    return Proxy(relation(rel, as_spelled(number(pa)), as_spelled(number(pb))))


_BOOLEAN_OPS = {"&": conjunction, "|": disjunction, "^": parity}
_LITERAL_MASKS = {"&": (0, -1), "|": (-1, 0), "^": (None, 0)}  # (absorbing, identity)


def bitwise(a, b, op: str) -> Proxy:
    """`a & b`, `a | b`, `a ^ b`: logic of two booleans, bitwise on integers (torch promotes a
    boolean beside an integer to 0/1)."""
    pa, pb = wrap(a), wrap(b)
    if pa.is_bool and pb.is_bool:
        return Proxy(_BOOLEAN_OPS[op](pa.expr, pb.expr))
    x, y = integer(pa, op), integer(pb, op)
    if isinstance(x, sympy.Integer):
        x, y = y, x
    if isinstance(y, sympy.Integer):
        m = int(y)
        absorbing, identity = _LITERAL_MASKS[op]
        if m == identity:
            return Proxy(x)
        if m == absorbing:
            return Proxy(y)
        if op == "^" and m == -1:
            return Proxy(-x - 1)
        if op == "&" and m > 0 and (m + 1) & m == 0:
            return Proxy(dag.make(sympy.Mod, x, m + 1))  # x & (2**k - 1): the low k bits, in two's complement too
        if op == "&" and m < 0 and -m & (-m - 1) == 0:
            return Proxy(x - dag.make(sympy.Mod, x, -m))  # x & -(2**k): the low k bits cleared
    return Proxy({"&": BitAnd, "|": BitOr, "^": BitXor}[op](x, y))


def shift(a, b, op: str) -> Proxy:
    """`a << b`, `a >> b` of integers: a literal shift is a multiplication or a floor division."""
    x, s = integer(wrap(a), op), integer(wrap(b), op)
    if isinstance(s, sympy.Integer):
        if s < 0:
            _context.fail(f"shifts by the negative amount {s}", "shift by a nonnegative amount")
        return Proxy(x * 2**s if op == "<<" else dag.make(sympy.floor, x / 2**s))
    return Proxy((LeftShift if op == "<<" else RightShift)(x, s))


# -- captured tensors --------------------------------------------------------------------------
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
    """`tensor[index]` for a captured tensor: a load once every dimension has an index, else a
    Vector of the rest."""
    exprs = []
    for dim, i in enumerate(index):
        if isinstance(i, (slice, type(Ellipsis))) or i is None:
            _context.fail("slices a captured tensor with ':', '...' or None",
                          "index it with one traced value or integer per dimension, like table[h, q_idx]")
        p = wrap(i)
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
        return Rows.kind.view(tensor, tuple(exprs))
    return Proxy(load(tensor, tuple(exprs)))


# -- torch functions and tensor methods --------------------------------------------------------
# NOTE: what they do to traced values is built from the operations above, so it lives in
# maskc.trace._functions, which imports this module and registers its handlers (and what a
# trace does at each new value) here; maskc/trace/__init__.py imports it before any trace.
_HANDLERS: dict = {}
_NEW_VALUE_HOOKS: list = []


def register(handler, *funcs) -> None:
    """Make `handler` what each of `funcs` (torch.X, Tensor.X, F.X, ...) does to traced values."""
    for func in funcs:
        _HANDLERS[func] = handler


def on_each_new_value(hook):
    """Have `hook()` called as each Proxy is created; returns it, to serve as a decorator."""
    _NEW_VALUE_HOOKS.append(hook)
    return hook


UNSUPPORTED_FIX = ("use + - * / // % comparisons & | ~ << >> torch.where/minimum/maximum/abs/clamp and elementwise "
                   "functions (exp, log, tanh, sigmoid, sqrt, sin, cos, erf, F.gelu, ...), or compute the value "
                   "outside the mod and capture it in a tensor")


def call(func, *args, **kwargs):
    """`func(*args, **kwargs)` on traced values."""
    if _holds_rows(args, kwargs):
        return Rows.kind.call(func, *args, **kwargs)
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

