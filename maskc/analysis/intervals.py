"""Interval arithmetic over tiles: the range of an expression on every tile at once.

Each index symbol is bound to a pair of broadcastable tensors (lowest and highest value on
the tile), so one pass of arithmetic covers the whole grid of tiles. Results carry two
facts used to decide when a PARTIAL verdict is certain rather than merely safe:
`tight` (lo and hi are attained on the tile) and `dense` (every integer between them is).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import sympy
import torch

from maskc.trace.symbols import INDEX_SYMBOLS, LoadBool, is_load


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


class IntervalEvaluator:
    """Ranges of integer/real expressions over tiles.

    `frame` maps index symbols to Intervals; `values` maps parameter symbols to numbers;
    `summaries` gives per-tensor range-min/max tables for captured-tensor loads.
    """

    def __init__(self, frame: dict, values: dict, summaries, device):
        self.frame, self.values, self.summaries, self.device = frame, values, summaries, device

    def run(self, e) -> Interval:
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
        affine = self._affine(e)
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
            low, high = (low, high) if c == 1 and type(c) is int else (low * c, high * c)
            lo, hi = (low, high) if lo is None else (lo + low, hi + high)
        if lo is None:
            lo = hi = _scalar(const, self.device)
        elif const != 0:
            # a float constant joins as a float64 tensor, as a float coefficient's product does
            c = _scalar(const, self.device) if isinstance(const, float) else const
            lo, hi = lo + c, hi + c
        unit = all(abs(c) == 1 for _, c in terms)
        integer = all(c == int(c) for c in (const, *(c for _, c in terms)))
        return Interval(lo, hi, True, unit and integer, form.syms)

    def _unknown(self, e):
        raise _Undecidable(e)

    def _Add(self, e):
        parts = [self.run(a) for a in e.args]
        lo, hi = parts[0].lo, parts[0].hi
        for p in parts[1:]:
            lo, hi = lo + p.lo, hi + p.hi
        independent = _independent(parts)
        return Interval(lo, hi, independent and all(p.tight for p in parts),
                        independent and all(p.dense for p in parts), _vars(parts))

    def _Mul(self, e):
        parts = [self.run(a) for a in e.args]
        out = parts[0]
        for p in parts[1:]:
            products = [out.lo * p.lo, out.lo * p.hi, out.hi * p.lo, out.hi * p.hi]
            lo = torch.minimum(torch.minimum(products[0], products[1]), torch.minimum(products[2], products[3]))
            hi = torch.maximum(torch.maximum(products[0], products[1]), torch.maximum(products[2], products[3]))
            scalar = not out.vars or not p.vars
            out = Interval(lo, hi, scalar and out.tight and p.tight, False, out.vars | p.vars)
        return out

    def _Pow(self, e):
        base = self.run(e.base)
        if e.exp.is_Integer and int(e.exp) >= 0 and int(e.exp) % 2 == 1:
            k = int(e.exp)
            return Interval(base.lo**k, base.hi**k, base.tight, False, base.vars)
        return self._unknown(e)

    def _floor(self, e):
        num, den = _fraction(e.args[0])
        den_iv = self.run(den)
        if den != 1 and den_iv.lo.dim() == 0 and bool(den_iv.lo == den_iv.hi) and den_iv.lo.dtype == torch.int64:
            d = int(den_iv.lo)
            if d == 0:
                return self._unknown(e)
            x = self.run(num)
            if x.lo.dtype == torch.int64:
                a, b = _floordiv(x.lo, d), _floordiv(x.hi, d)
                lo, hi = (a, b) if d > 0 else (b, a)
                return Interval(lo, hi, x.tight, x.dense, x.vars)
        x = self.run(e.args[0])
        return Interval(torch.floor(x.lo), torch.floor(x.hi), x.tight, False, x.vars)

    def _Mod(self, e):
        x, m = self.run(e.args[0]), self.run(e.args[1])
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
        parts = [self.run(a) for a in e.args]
        lo, hi = parts[0].lo, parts[0].hi
        for p in parts[1:]:
            lo, hi = torch.minimum(lo, p.lo), torch.minimum(hi, p.hi)
        return Interval(lo, hi, _independent(parts) and all(p.tight for p in parts), False, _vars(parts))

    def _Max(self, e):
        parts = [self.run(a) for a in e.args]
        lo, hi = parts[0].lo, parts[0].hi
        for p in parts[1:]:
            lo, hi = torch.maximum(lo, p.lo), torch.maximum(hi, p.hi)
        return Interval(lo, hi, _independent(parts) and all(p.tight for p in parts), False, _vars(parts))

    def _Abs(self, e):
        x = self.run(e.args[0])
        zero = torch.zeros_like(x.lo)
        lo = torch.where(x.lo >= 0, x.lo, torch.where(x.hi <= 0, -x.hi, zero))
        hi = torch.maximum(x.lo.abs(), x.hi.abs())
        return Interval(lo, hi, x.tight and x.dense, x.dense, x.vars)

    def _Piecewise(self, e):
        from maskc.analysis.classify import FULL, EMPTY, classify_grid

        out = self.run(e.args[-1].expr)
        tight = out.tight
        for branch in reversed(e.args[:-1]):
            verdict, _ = classify_grid(branch.cond, self)
            val = self.run(branch.expr)
            lo = torch.where(verdict == FULL, val.lo, torch.where(verdict == EMPTY, out.lo, torch.minimum(val.lo, out.lo)))
            hi = torch.where(verdict == FULL, val.hi, torch.where(verdict == EMPTY, out.hi, torch.maximum(val.hi, out.hi)))
            tight = tight and val.tight and not bool((verdict == 1).any())
            out = Interval(lo, hi, tight, False, out.vars | val.vars)
        return out

    def _load(self, e):
        slot = int(e.args[0])
        index = [self.run(i) for i in e.args[1:]]
        lo, hi = self.summaries.range(slot, index)
        last = index[-1] if index else None
        tight = last is None or (last.tight and last.dense and all(bool((i.lo == i.hi).all()) for i in index[:-1]))
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


class _Undecidable(Exception):
    """Raised inside evaluation when an expression has no interval rule; callers fall back."""


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

