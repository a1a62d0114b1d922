"""Interval arithmetic over tiles: the range of an expression on every tile at once.

Each index symbol is bound to a pair of broadcastable tensors (lowest and highest value on
the tile), so one pass of arithmetic covers the whole grid of tiles. Results carry two
facts used to decide when a PARTIAL verdict is certain rather than merely safe:
`tight` (lo and hi are attained on the tile) and `dense` (every integer between them is).

Infinities follow IEEE arithmetic (a captured window of inf keeps every pair). Where a value
may be NaN (inf - inf, 0 * inf, sin(inf), log of a negative), an end of its range is NaN,
and a comparison with a NaN end decides nothing (classify.relation). An operation with no
rule raises _Undecidable: the comparison holding it is PARTIAL, settled densely.

Each distinct node is evaluated once per top-level `run` (or classify_grid): nested
torch.where builds expressions whose tree is exponentially larger than the node count.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import sympy
import torch

from maskc.analysis.classify import EMPTY, FULL, PARTIAL, _Undecidable, classify_grid
from maskc.trace import dag
from maskc.trace.symbols import INDEX_SYMBOLS, LOADS, LoadBool, is_load


@dataclass
class Interval:
    lo: torch.Tensor
    hi: torch.Tensor
    tight: bool
    dense: bool
    vars: frozenset

    @staticmethod
    def const(value, device) -> "Interval":
        dtype = torch.int64 if isinstance(value, int) else torch.float64
        t = torch.tensor(value, dtype=dtype, device=device)
        return Interval(t, t, True, True, frozenset())


def _floordiv(a, b):
    return torch.div(a, b, rounding_mode="floor")


def _ceildiv(a, b):
    return -torch.div(-a, b, rounding_mode="floor")


def _truncdiv(a, b):
    return torch.div(a, b, rounding_mode="trunc")


def _f64(t):
    return t.to(torch.float64)


def _all_bits_below(m):
    """The least 2**k - 1 >= m, for int64 m >= 0: m with every bit below its highest set."""
    for shift in (1, 2, 4, 8, 16, 32):
        m = m | (m >> shift)
    return m


# sin and cos ranges are widened by this much: the kernel evaluates them in float32
_WAVE_SLACK = 1e-6


class IntervalEvaluator:
    """Ranges of integer/real expressions over tiles.

    `frame` maps index symbols to Intervals; `values` maps parameter symbols to numbers;
    `summaries` gives per-tensor range-min/max tables for captured-tensor loads.
    """

    def __init__(self, frame: dict, values: dict, summaries, device):
        self.frame, self.values, self.summaries, self.device = frame, values, summaries, device
        self.memo = None  # node -> Interval (or _Undecidable) within one top-level evaluation
        self.verdicts = None  # node -> verdict, for classify_grid, likewise

    @contextlib.contextmanager
    def scope(self):
        """One top-level evaluation: its nodes' ranges and verdicts are kept until it ends."""
        if self.memo is not None:
            yield
            return
        self.memo, self.verdicts = {}, {}
        try:
            yield
        finally:
            self.memo = self.verdicts = None

    def run(self, e) -> Interval:
        with self.scope():
            return self._run(e)

    def _run(self, e) -> Interval:
        out = self.memo.get(e)
        if out is None:
            try:
                out = self._evaluate(e)
            except _Undecidable as undecidable:
                out = undecidable
            self.memo[e] = out
        if isinstance(out, _Undecidable):
            raise out
        return out

    def _evaluate(self, e) -> Interval:
        if isinstance(e, sympy.Integer):
            return Interval.const(int(e), self.device)
        if e.is_Number:
            return Interval.const(float(e), self.device)
        if isinstance(e, sympy.Symbol):
            if e in self.frame:
                return self.frame[e]
            return Interval.const(self.values[e], self.device)
        if is_load(e):
            return self._load(e)
        affine = self._affine(e) if _shallow(e) else None
        if affine is not None:
            return affine
        method = getattr(self, "_" + type(e).__name__, None)
        if method is None:
            return self._unknown(e)
        return method(e)

    # -- exact for affine expressions: the extremes sit at the tile corners -----------------
    def _affine(self, e):
        form = _affine_form(e)
        if form is None or not form.params <= self.values.keys():
            return None
        const = _value(form.const, self.values)
        terms = [(s, c) for s, c in ((s, _value(c, self.values)) for s, c in form.terms) if c != 0]
        lo = hi = None
        for s, c in terms:
            iv = self.frame[s]
            low, high = (iv.lo, iv.hi) if c > 0 else (iv.hi, iv.lo)
            if not (c == 1 and type(c) is int):
                # a float coefficient as a float64 tensor: int64 * Python float gives float32
                c = _scalar(c, self.device) if isinstance(c, float) else c
                low, high = low * c, high * c
            lo, hi = (low, high) if lo is None else (lo + low, hi + high)
        if lo is None:
            lo = hi = _scalar(const, self.device)
        elif const != 0:
            # a float constant joins as a float64 tensor, as a float coefficient's product does
            c = _scalar(const, self.device) if isinstance(const, float) else const
            lo, hi = lo + c, hi + c
        unit = all(abs(c) == 1 for _, c in terms)
        integer = all(float(c).is_integer() for c in (const, *(c for _, c in terms)))  # False for inf and NaN
        return Interval(lo, hi, True, unit and integer, form.syms)

    def _unknown(self, e):
        raise _Undecidable(e)

    def _Add(self, e):
        parts = [self._run(a) for a in e.args]
        lo, hi = parts[0].lo, parts[0].hi
        for p in parts[1:]:
            lo, hi = lo + p.lo, hi + p.hi
        independent = _independent(parts)
        return Interval(lo, hi, independent and all(p.tight for p in parts),
                        independent and all(p.dense for p in parts), _vars(parts))

    def _Mul(self, e):
        parts = [self._run(a) for a in e.args]
        out = parts[0]
        for p in parts[1:]:
            products = [out.lo * p.lo, out.lo * p.hi, out.hi * p.lo, out.hi * p.hi]
            lo = torch.minimum(torch.minimum(products[0], products[1]), torch.minimum(products[2], products[3]))
            hi = torch.maximum(torch.maximum(products[0], products[1]), torch.maximum(products[2], products[3]))
            scalar = not out.vars or not p.vars
            out = Interval(lo, hi, scalar and out.tight and p.tight, False, out.vars | p.vars)
        return out

    def _Pow(self, e):
        base, exp = e.args
        if exp.is_Integer and int(exp) > 0:
            x, k = self._run(base), int(exp)
            if k % 2:
                return Interval(x.lo**k, x.hi**k, x.tight, False, x.vars)
            # even: from the least magnitude (0 where the range spans it) to the greatest
            least = torch.minimum(x.lo.abs(), x.hi.abs())
            least = torch.where((x.lo <= 0) & (x.hi >= 0), torch.zeros_like(least), least)
            return Interval(least**k, torch.maximum(x.lo.abs(), x.hi.abs())**k, False, False, x.vars)
        if exp.is_Number and float(exp) == 0.5:
            return self._increasing(base, torch.sqrt)
        if base.is_Number and base.is_positive:
            # b**x, monotone in x: increasing for b > 1, decreasing below
            b, x = float(base), self._run(exp)
            ends = b ** _f64(x.lo), b ** _f64(x.hi)
            lo, hi = ends if b >= 1 else ends[::-1]
            return Interval(lo, hi, x.tight, False, x.vars)
        return self._unknown(e)

    def _floor(self, e):
        return self._rounded(e, _floordiv, torch.floor)

    def _ceiling(self, e):
        return self._rounded(e, _ceildiv, torch.ceil)

    def _rounded(self, e, divide, rounding):
        """floor or ceiling: of an integer quotient by a literal, exactly (dense stays dense);
        of anything else, the rounded ends of its range."""
        num, den = _fraction(e.args[0])
        den_iv = self._run(den)
        if den != 1 and den_iv.lo.dim() == 0 and bool(den_iv.lo == den_iv.hi) and den_iv.lo.dtype == torch.int64:
            d = int(den_iv.lo)
            if d == 0:
                return self._unknown(e)
            x = self._run(num)
            if x.lo.dtype == torch.int64:
                a, b = divide(x.lo, d), divide(x.hi, d)
                lo, hi = (a, b) if d > 0 else (b, a)
                return Interval(lo, hi, x.tight, x.dense, x.vars)
        x = self._run(e.args[0])
        return Interval(rounding(x.lo), rounding(x.hi), x.tight, False, x.vars)

    def _Trunc(self, e):
        if _fraction(e.args[0])[1] != 1:
            # an integer quotient ((q_idx - kv_idx) / 3 from torch.div(rounding_mode="trunc")):
            # exactly, since its float ends can round across an integer (4/3 - 1/3 < 1)
            quotient = self._rounded(e, _truncdiv, torch.trunc)
            if quotient.lo.dtype == torch.int64:
                return quotient
        x = self._run(e.args[0])
        if x.lo.dtype == torch.int64:
            return x
        return self._integer(Interval(torch.trunc(x.lo), torch.trunc(x.hi), x.tight, False, x.vars), e)

    def _Mod(self, e):
        x, m = self._run(e.args[0]), self._run(e.args[1])
        if m.lo.dim() != 0 or bool(m.lo != m.hi) or m.lo.dtype != torch.int64 or int(m.lo) == 0:
            return self._unknown(e)
        mod = int(m.lo)
        if mod < 0:
            return self._unknown(e)
        wraps = _floordiv(x.lo, mod) != _floordiv(x.hi, mod)
        lo = torch.where(wraps, torch.zeros_like(x.lo), torch.remainder(x.lo, mod))
        hi = torch.where(wraps, torch.full_like(x.hi, mod - 1), torch.remainder(x.hi, mod))
        # A wrapping dense range reaches both 0 and mod-1; a non-wrapping one is a shifted copy.
        return Interval(lo, hi, x.tight and x.dense, x.dense and not bool(wraps.any()), x.vars)

    def _Min(self, e):
        parts = [self._run(a) for a in e.args]
        lo, hi = parts[0].lo, parts[0].hi
        for p in parts[1:]:
            lo, hi = torch.minimum(lo, p.lo), torch.minimum(hi, p.hi)
        return Interval(lo, hi, _independent(parts) and all(p.tight for p in parts), False, _vars(parts))

    def _Max(self, e):
        parts = [self._run(a) for a in e.args]
        lo, hi = parts[0].lo, parts[0].hi
        for p in parts[1:]:
            lo, hi = torch.maximum(lo, p.lo), torch.maximum(hi, p.hi)
        return Interval(lo, hi, _independent(parts) and all(p.tight for p in parts), False, _vars(parts))

    def _Abs(self, e):
        x = self._run(e.args[0])
        zero = torch.zeros_like(x.lo)
        lo = torch.where(x.lo >= 0, x.lo, torch.where(x.hi <= 0, -x.hi, zero))
        hi = torch.maximum(x.lo.abs(), x.hi.abs())
        return Interval(lo, hi, x.tight and x.dense, x.dense, x.vars)

    def _sign(self, e):
        x = self._run(e.args[0])
        return Interval(torch.sign(x.lo), torch.sign(x.hi), x.tight, x.dense, x.vars)

    def _Heaviside(self, e):
        x = self._run(e.args[0])
        at_zero = float(e.args[1]) if len(e.args) > 1 else 0.5
        if not 0 <= at_zero <= 1:  # then not monotone
            return self._unknown(e)

        def step(v):
            return torch.where(v > 0, 1.0, torch.where(v == 0, at_zero, 0.0)).to(torch.float64)

        return Interval(step(x.lo), step(x.hi), x.tight, False, x.vars)

    def _increasing(self, arg, fn):
        """A strictly increasing float function: the ends map to the ends."""
        x = self._run(arg)
        return Interval(fn(_f64(x.lo)), fn(_f64(x.hi)), x.tight, False, x.vars)

    def _exp(self, e):
        return self._increasing(e.args[0], torch.exp)

    def _log(self, e):
        return self._increasing(e.args[0], torch.log)  # NaN below 0, as the kernel's

    def _tanh(self, e):
        return self._increasing(e.args[0], torch.tanh)

    def _atan(self, e):
        return self._increasing(e.args[0], torch.atan)

    def _erf(self, e):
        return self._increasing(e.args[0], torch.erf)

    def _Float16(self, e):  # nondecreasing: the ends still map to the ends
        return self._increasing(e.args[0], lambda x: x.to(torch.float32).to(torch.float16).to(x.dtype))

    def _BFloat16(self, e):
        return self._increasing(e.args[0], lambda x: x.to(torch.float32).to(torch.bfloat16).to(x.dtype))

    def _CustomBackward(self, e):
        return self._run(e.value)

    def _sin(self, e):
        return self._wave(e, torch.sin, math.pi / 2)

    def _cos(self, e):
        return self._wave(e, torch.cos, 0.0)

    def _wave(self, e, fn, peak):
        """sin or cos, whose peaks lie at `peak` + 2πk and troughs π further: the values at the
        ends, or ±1 where a peak or trough lies between them; NaN for an infinite end."""
        x = self._run(e.args[0])
        lo, hi = _f64(x.lo), _f64(x.hi)
        at_lo, at_hi = fn(lo), fn(hi)

        def reaches(at):
            return torch.ceil((lo - at) / (2 * math.pi)) <= torch.floor((hi - at) / (2 * math.pi))

        top = torch.where(reaches(peak), 1.0, torch.maximum(at_lo, at_hi) + _WAVE_SLACK).clamp(max=1.0)
        bottom = torch.where(reaches(peak + math.pi), -1.0, torch.minimum(at_lo, at_hi) - _WAVE_SLACK).clamp(min=-1.0)
        finite = torch.isfinite(lo) & torch.isfinite(hi)
        nan = torch.tensor(math.nan, dtype=torch.float64, device=lo.device)
        return Interval(torch.where(finite, bottom, nan), torch.where(finite, top, nan), False, False, x.vars)

    # -- integer operations (maskc/trace/symbols.py), on int64 as torch's ------------------
    def _integer(self, x, e) -> Interval:
        """x with int64 ends: integer-valued float ends are converted where finite (an index
        of a captured tensor must be); otherwise e is undecidable."""
        if x.lo.dtype == torch.int64:
            return x
        if not bool((torch.isfinite(x.lo) & torch.isfinite(x.hi) & (x.lo.abs() < 2.0**62)
                     & (x.hi.abs() < 2.0**62)).all()):
            return self._unknown(e)
        return Interval(x.lo.to(torch.int64), x.hi.to(torch.int64), x.tight, x.dense, x.vars)

    def _shift_operands(self, e):
        """a and the count n of a shift, n's ends clipped to 63 (a count of 64 or more acts as
        63 on a right shift; left shifts that far are refused below). Negative counts are
        undecidable: torch gives 0 or the sign for them, not a monotone function."""
        a, n = (self._integer(self._run(x), e) for x in e.args)
        if not bool((n.lo >= 0).all()):
            return self._unknown(e)
        return a, n, n.lo.clamp(max=63), n.hi.clamp(max=63)

    def _RightShift(self, e):
        # floor(a / 2**n): increasing in a, toward 0 or -1 in n, so the extremes are at the corners
        a, n, n_lo, n_hi = self._shift_operands(e)
        lo = torch.minimum(a.lo >> n_lo, a.lo >> n_hi)
        hi = torch.maximum(a.hi >> n_lo, a.hi >> n_hi)
        point = bool((n.lo == n.hi).all())
        return Interval(lo, hi, a.tight and point, a.dense and point, a.vars | n.vars)

    def _LeftShift(self, e):
        # a * 2**n while it cannot overflow int64: the extremes are at the corners
        a, n, n_lo, n_hi = self._shift_operands(e)
        magnitude = torch.maximum(a.lo.abs(), a.hi.abs()).to(torch.float64) * 2.0 ** n_hi.to(torch.float64)
        if not bool((magnitude < 2.0**62).all()):
            return self._unknown(e)
        lo = torch.minimum(a.lo << n_lo, a.lo << n_hi)
        hi = torch.maximum(a.hi << n_lo, a.hi << n_hi)
        return Interval(lo, hi, a.tight and bool((n.lo == n.hi).all()), False, a.vars | n.vars)

    def _bit_operands(self, e):
        """Both operands, nonnegative: a bitwise operation on negative numbers has no range
        rule here, so it is undecidable."""
        a, b = (self._integer(self._run(x), e) for x in e.args)
        if not bool(((a.lo >= 0) & (b.lo >= 0)).all()):
            return self._unknown(e)
        return a, b

    def _bitwise(self, a, b, op, lo, hi):
        """The range [lo, hi], or the exact value on tiles where both operands are single values."""
        exact = (a.lo == a.hi) & (b.lo == b.hi)
        value = op(a.lo, b.lo)
        everywhere = bool(exact.all())
        return Interval(torch.where(exact, value, lo), torch.where(exact, value, hi), everywhere, everywhere,
                        a.vars | b.vars)

    def _BitAnd(self, e):
        a, b = self._bit_operands(e)
        return self._bitwise(a, b, torch.bitwise_and, 0, torch.minimum(a.hi, b.hi))

    def _BitOr(self, e):
        # at least either operand; at most every bit below the highest either can set
        a, b = self._bit_operands(e)
        top = torch.minimum(_all_bits_below(torch.maximum(a.hi, b.hi)), a.hi + b.hi)
        return self._bitwise(a, b, torch.bitwise_or, torch.maximum(a.lo, b.lo), top)

    def _BitXor(self, e):
        a, b = self._bit_operands(e)
        top = torch.minimum(_all_bits_below(torch.maximum(a.hi, b.hi)), a.hi + b.hi)
        return self._bitwise(a, b, torch.bitwise_xor, 0, top)

    def _Piecewise(self, e):
        out = self._run(e.args[-1].expr)
        tight = out.tight
        for branch in reversed(e.args[:-1]):
            verdict, _ = classify_grid(branch.cond, self)
            val = self._run(branch.expr)
            lo = torch.where(verdict == FULL, val.lo, torch.where(verdict == EMPTY, out.lo, torch.minimum(val.lo, out.lo)))
            hi = torch.where(verdict == FULL, val.hi, torch.where(verdict == EMPTY, out.hi, torch.maximum(val.hi, out.hi)))
            tight = tight and val.tight and not bool((verdict == PARTIAL).any())
            out = Interval(lo, hi, tight, False, out.vars | val.vars)
        return out

    def _load(self, e):
        slot = int(e.args[0])
        index = [self._integer(self._run(i), e) for i in e.args[1:]]
        lo, hi = self.summaries.range(slot, index)
        last = index[-1] if index else None
        tight = last is None or (last.tight and last.dense and all(bool((i.lo == i.hi).all()) for i in index[:-1])
                                 and not any(bool((i.lo < 0).any()) for i in index))  # wrapped: see range
        return Interval(lo, hi, tight, isinstance(e, LoadBool), _vars(index))


class _AffineForm(NamedTuple):
    const: object  # a number, or a sympy expression of the parameters
    terms: tuple  # (index symbol, coefficient as const) for each index symbol of e
    syms: frozenset  # the index symbols
    params: frozenset  # the other symbols, which the parameters must give values to


@functools.lru_cache(maxsize=1024)
def _affine_form(e) -> _AffineForm | None:
    """e as constant + Σ coefficient × index symbol, when it has that form, else None.
    Cached, and independent of parameter values: the sympy work costs more than the tensor
    arithmetic it sets up, and a mask is analysed at many lengths and parameter values."""
    syms = [s for s in INDEX_SYMBOLS if s in e.free_symbols]
    if not syms or e.atoms(sympy.Function) or not e.is_polynomial(*syms):
        return None
    poly = sympy.Poly(e, *syms)
    if poly.total_degree() > 1:
        return None
    terms = tuple((s, _stored(poly.coeff_monomial(s))) for s in syms)
    return _AffineForm(_stored(poly.coeff_monomial(1)), terms, frozenset(syms), frozenset(e.free_symbols - set(syms)))


def _stored(c):
    """A coefficient as kept in an _AffineForm: a Python number when it is one."""
    return _number(c) if c.is_Number else c


def _value(c, values: dict):
    """The value of a coefficient: a number, or a sympy expression of the parameters. Integer
    sums and products of parameters (sliding_window's bound, q_idx - p0) are worked out here,
    anything else by sympy."""
    if not isinstance(c, sympy.Basic):
        return c
    if c.is_Symbol and c in values:
        return values[c]
    if c.is_Integer:
        return int(c)
    if c.is_Add or c.is_Mul:
        parts = [_value(a, values) for a in c.args]
        if all(type(p) is int for p in parts):
            return sum(parts) if c.is_Add else math.prod(parts)
    return _number(c.xreplace({k: sympy.sympify(v) for k, v in values.items()}))


@functools.lru_cache(maxsize=1024)
def _fraction(e):
    """Numerator and denominator of e, found once per expression."""
    return sympy.fraction(sympy.together(e))


def _shallow(e, depth: int = 3) -> bool:
    """Whether e is sums, products and powers of symbols and numbers, nested at most `depth`
    deep: the only expressions that can be affine after canonicalisation. _affine_form's
    sympy queries walk the whole tree, which for nested torch.where is exponentially large."""
    if e.is_Atom:
        return True
    return depth > 0 and (e.is_Add or e.is_Mul or e.is_Pow) and all(_shallow(a, depth - 1) for a in e.args)


def _independent(parts) -> bool:
    seen = set()
    for p in parts:
        if seen & p.vars:
            return False
        seen |= p.vars
    return True


def _vars(parts) -> frozenset:
    out = frozenset()
    for p in parts:
        out |= p.vars
    return out


def _number(c):
    c = sympy.sympify(c)
    return int(c) if c.is_Integer else float(c)


def _scalar(c, device):
    v = _number(c)
    return torch.tensor(v, dtype=torch.int64 if isinstance(v, int) else torch.float64, device=device)


class TensorSummaries:
    """Range-minimum/maximum tables of captured tensors along their last dimension.

    Built in O(n log n) per tensor, answered in O(1) per tile; an index range reaching
    outside the tensor includes 0, the value an out-of-range load reads.
    """

    def __init__(self, tensors, device):
        self.tensors = [t.to(device) for t in tensors]
        self._tables = {}

    def _table(self, slot):
        """Level k holds the min (max) of each run of 2^k entries, padded to the full length so
        that the levels stack into one [levels, rows, n] tensor: a query is then one gather,
        with no per-level selection (each would be a host sync on a GPU). Kept in the tensor's
        own dtype (bool as uint8), which holds its minima and maxima exactly."""
        if slot not in self._tables:
            t = self.tensors[slot]
            base = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
            if base.dtype == torch.bool:
                base = base.to(torch.uint8)
            n = base.shape[-1]
            levels = max(1, n.bit_length())  # 2^(levels-1) <= n
            mins = base.new_zeros((levels, *base.shape))
            maxs = base.new_zeros((levels, *base.shape))
            mins[0], maxs[0] = base, base
            for k in range(1, levels):
                half, width = 1 << (k - 1), n - (1 << k) + 1
                torch.minimum(mins[k - 1, :, :width], mins[k - 1, :, half:half + width], out=mins[k, :, :width])
                torch.maximum(maxs[k - 1, :, :width], maxs[k - 1, :, half:half + width], out=maxs[k, :, :width])
            self._tables[slot] = (mins, maxs)
        return self._tables[slot]

    def range(self, slot, index):
        t = self.tensors[slot]
        mins, maxs = self._table(slot)
        dtype = torch.float64 if t.dtype.is_floating_point else torch.int64
        if t.dim() == 0:
            v = mins[0, 0, 0].to(dtype)
            return v, v
        # a negative index counts from the end (torch's t[-1]): where one is possible, the
        # whole tensor's range (and 0, for indices still out of range)
        negative = torch.zeros((), dtype=torch.bool, device=t.device)
        for iv in index:
            negative = negative | (iv.lo < 0)
        if bool(negative.any()):
            whole_lo, whole_hi = self._whole(slot)
            lo, hi = self._range(slot, index, mins, maxs, dtype)
            return torch.where(negative, whole_lo, lo), torch.where(negative, whole_hi, hi)
        return self._range(slot, index, mins, maxs, dtype)

    def _range(self, slot, index, mins, maxs, dtype):
        t = self.tensors[slot]
        n = t.shape[-1]
        inside = torch.tensor(True, device=t.device)
        row = torch.tensor(0, device=t.device)
        for dim, iv in enumerate(index[:-1]):
            if not bool((iv.lo == iv.hi).all()):
                return self._whole(slot)
            inside = inside & (iv.lo >= 0) & (iv.lo < t.shape[dim])
            row = row * t.shape[dim] + iv.lo.clamp(0, t.shape[dim] - 1)
        last = index[-1]
        first = last.lo.clamp(0, n - 1)
        final = last.hi.clamp(0, n - 1)
        first, final, row = torch.broadcast_tensors(first, final, row)
        # floor(log2(m)) is exact in float64: log2 of an integer below 2^52 that is not a power
        # of two lies more than 1/m from an integer, far beyond float64's rounding
        level = torch.log2((final - first + 1).to(torch.float64)).floor().to(torch.int64)
        other = final - (1 << level) + 1
        lo = torch.minimum(mins[level, row, first], mins[level, row, other]).to(dtype)
        hi = torch.maximum(maxs[level, row, first], maxs[level, row, other]).to(dtype)
        zero = torch.zeros((), dtype=dtype, device=t.device)
        outside = (last.lo < 0) | (last.hi >= n) | ~inside
        nowhere = (last.hi < 0) | (last.lo >= n) | ~inside
        lo = torch.where(nowhere, zero, torch.where(outside, torch.minimum(lo, zero), lo))
        hi = torch.where(nowhere, zero, torch.where(outside, torch.maximum(hi, zero), hi))
        return lo, hi

    def _whole(self, slot):
        t = self.tensors[slot]
        zero = torch.zeros((), dtype=torch.float64 if t.dtype.is_floating_point else torch.int64, device=t.device)
        flat = t.reshape(-1).to(zero.dtype)
        return torch.minimum(flat.min(), zero), torch.maximum(flat.max(), zero)


def doubtful_indices(exprs) -> tuple:
    """The captured-tensor indices in `exprs` that sympy cannot prove nonnegative."""
    return _doubtful(tuple(exprs))


@dag.identity_cache(maxsize=512)
def _doubtful(exprs: tuple) -> tuple:
    # cached: a call with a block map asks on every call, and sympy's is_nonnegative is slow;
    # not asked where it is wrong (dag.misleads_sympy: floor(2/(q_idx + kv_idx + 1) - 0.5) is -1)
    return tuple(i for e in exprs if e is not None for load in dag.atoms(e, *LOADS) for i in load.args[1:]
                 if dag.misleads_sympy(i) or not i.is_nonnegative)


def indices_nonnegative(exprs, tensors, values: dict, extents: dict) -> bool:
    """Whether every captured-tensor index in `exprs` is nonnegative at every position, each
    index symbol ranging over [0, extents[symbol]) and parameters at `values`: then a kernel
    for these positions needs no wrap of negative indices (t[-1] as the last element). An
    index sympy proves nonnegative is not asked; one whose range is undecided counts as
    possibly negative. A call with a block map asks this every time: an index that reads no
    captured tensor is decided on the host, with no copy and no device sync, once for its
    parameters' values and extents."""
    doubtful = doubtful_indices(exprs)
    if not doubtful:
        return True
    reads_tensors, symbols = _indices_read(doubtful)
    if reads_tensors:  # an index read from a tensor: its values' ranges
        return _nonnegative(doubtful, tensors, values, extents, tensors[0].device)
    # keyed by the values the indices read: a parameter they do not (a decoding step's offset
    # in the mask, a softcap) changes nothing here
    return _nonnegative_on_host(doubtful, tuple((k, v) for k, v in values.items() if k in symbols),
                                tuple(extents.items()))


@dag.identity_cache(maxsize=512)
def _indices_read(doubtful: tuple) -> tuple[bool, frozenset]:
    """Whether any of the indices reads a captured tensor, and the symbols they read."""
    return (any(dag.atoms(i, *LOADS) for i in doubtful),
            frozenset().union(*(dag.free_symbols(i) for i in doubtful)))


@dag.identity_cache(maxsize=512)
def _nonnegative_on_host(doubtful: tuple, values: tuple, extents: tuple) -> bool:
    return _nonnegative(doubtful, (), dict(values), dict(extents), torch.device("cpu"))


def _nonnegative(doubtful: tuple, tensors, values: dict, extents: dict, device: torch.device) -> bool:
    frame = {}
    for symbol, n in extents.items():
        lo, hi = torch.tensor(0, device=device), torch.tensor(n - 1, device=device)
        frame[symbol] = Interval(lo, hi, True, True, frozenset([symbol]))
    evaluator = IntervalEvaluator(frame, values, TensorSummaries(tensors, device), device)
    try:
        return all(bool((evaluator.run(i).lo >= 0).all()) for i in doubtful)
    except (_Undecidable, KeyError):  # KeyError: an index that reads the score, which has no range here
        return False
