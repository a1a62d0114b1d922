"""FULL / PARTIAL / EMPTY verdicts for boolean expressions over a grid of tiles.

A verdict is a pair of tensors: `cls` (EMPTY=0, PARTIAL=1, FULL=2) and `certain`, true
where a PARTIAL verdict is known to be exact (the tile really mixes kept and dropped
pairs). FULL and EMPTY are always exact; an uncertain PARTIAL is settled later by dense
evaluation of that tile alone. A comparison whose range has a NaN end (the value may be NaN,
which every comparison but != rejects) is an uncertain PARTIAL. A comparison of values the
kernel rounds (float32) is FULL or EMPTY only where its range clears 0 by more than a bound of
that rounding (_slack): within it, torch's float32 answer may be either.

The ranges come from the evaluator that classify_grid is given (intervals.IntervalEvaluator),
whose Piecewise rule classifies its conditions here in turn. This module reaches the
evaluator only through that argument, so intervals imports classify and not the reverse.
"""
from __future__ import annotations

import functools
import math

import sympy
import torch

from maskc.analysis._shapes import broadcast
from maskc.trace.canonical import exact
from maskc.trace.symbols import is_load

EMPTY, PARTIAL, FULL = 0, 1, 2


class _Undecidable(Exception):
    """Raised by an evaluator for an expression it has no interval rule for; callers fall
    back (a relation that holds one is an uncertain PARTIAL)."""


def constant(value: bool, device):
    return (torch.tensor(FULL if value else EMPTY, dtype=torch.int8, device=device),
            torch.tensor(True, device=device))


def combine_and(a, b):
    (ca, ka), (cb, kb) = a, b
    cls = torch.minimum(ca, cb)
    # exact when one side is FULL and the other an exact PARTIAL
    certain = ((ca == FULL) & kb) | ((cb == FULL) & ka)
    return cls, certain


def combine_or(a, b):
    (ca, ka), (cb, kb) = a, b
    cls = torch.maximum(ca, cb)
    certain = ((ca == EMPTY) & kb) | ((cb == EMPTY) & ka)
    return cls, certain


def combine_not(a):
    cls, certain = a
    return (FULL - cls).to(torch.int8), certain


def combine_xor(a, b):
    (ca, ka), (cb, kb) = a, b
    partial = (ca == PARTIAL) | (cb == PARTIAL)
    decided = torch.where(ca == cb, EMPTY, FULL).to(torch.int8)
    cls = torch.where(partial, torch.tensor(PARTIAL, dtype=torch.int8, device=ca.device), decided)
    certain = ((ca != PARTIAL) & kb) | ((cb != PARTIAL) & ka)
    return cls, certain


def relation(rel, iv, slack=None):
    """Verdict of a relation `e OP 0` from the interval of e = lhs - rhs, where the kernel's
    value of e lies within `slack` of it on each tile (None: the kernel computes e exactly).
    Relations are canonical (`e >= 0`, `e > 0`, Eq, Ne, or a float comparison with its sides
    kept apart), except in Piecewise conditions, which sympy may turn round (`-e <= 0`)."""
    lo, hi = iv.lo, iv.hi
    s = 0 if slack is None else slack
    if isinstance(rel, (sympy.LessThan, sympy.StrictLessThan)):
        lo, hi = -hi, -lo
    # With slack, a PARTIAL is certain where the kernel surely drops the pair at the low end and
    # keeps the one at the high end.
    if isinstance(rel, (sympy.GreaterThan, sympy.LessThan)):
        full, empty = lo - s >= 0, hi + s < 0
        certain = iv.tight if slack is None else (lo + s < 0) & (hi - s >= 0) & iv.tight
    elif isinstance(rel, (sympy.StrictGreaterThan, sympy.StrictLessThan)):
        full, empty = lo - s > 0, hi + s <= 0
        certain = iv.tight if slack is None else (lo + s <= 0) & (hi - s > 0) & iv.tight
    elif isinstance(rel, (sympy.Equality, sympy.Unequality)):
        full, empty = (lo == 0) & (hi == 0) & (s == 0), (lo - s > 0) | (hi + s < 0)
        # A PARTIAL tile has lo <= 0 <= hi, lo < hi. With both ends attained (tight), an end
        # at 0 is a kept pair and the other a dropped one; 0 strictly inside is attained only
        # if every integer is (dense). The first case is every boundary tile of a document
        # mask (ids[q_idx] == ids[kv_idx]), which would otherwise be settled pair by pair.
        certain = False
        if iv.tight and lo.dtype == torch.int64 and slack is None:
            certain = (lo == 0) | (hi == 0) | iv.dense
        if isinstance(rel, sympy.Unequality):
            full, empty = empty, full
    else:
        raise ValueError(f"relation {rel} is not a comparison")
    known = ~(torch.isnan(lo) | torch.isnan(hi))
    cls = torch.where(full & known, FULL, torch.where(empty & known, EMPTY, PARTIAL)).to(torch.int8)
    return cls, (torch.as_tensor(certain, device=cls.device) & known).expand(cls.shape)


def classify_grid(expr, evaluator):
    """Verdict of boolean `expr` on every tile of the evaluator's frame; each distinct
    subexpression is classified once (see IntervalEvaluator.scope)."""
    with evaluator.scope():
        return _classify(expr, evaluator)


def _classify(expr, evaluator):
    verdict = evaluator.verdicts.get(expr)
    if verdict is None:
        verdict = evaluator.verdicts[expr] = _verdict(expr, evaluator)
    return verdict


def _verdict(expr, evaluator):
    if expr is sympy.true or expr is sympy.false:
        return constant(expr is sympy.true, evaluator.device)
    if isinstance(expr, sympy.And):
        return _fold(combine_and, [_classify(a, evaluator) for a in expr.args])
    if isinstance(expr, sympy.Or):
        return _fold(combine_or, [_classify(a, evaluator) for a in expr.args])
    if isinstance(expr, sympy.Xor):
        return _fold(combine_xor, [_classify(a, evaluator) for a in expr.args])
    if isinstance(expr, sympy.Not):
        return combine_not(_classify(expr.args[0], evaluator))
    if isinstance(expr, sympy.ITE):  # (c & a) | (~c & b)
        c, a, b = (_classify(x, evaluator) for x in expr.args)
        return combine_or(combine_and(c, a), combine_and(combine_not(c), b))
    if isinstance(expr, sympy.core.relational.Relational):
        try:
            iv = evaluator.run(_difference(expr))
            slack = _slack(expr, iv, evaluator)
        except _Undecidable:
            shape = broadcast(*(f.lo.shape for f in evaluator.frame.values()))
            return (torch.full(shape, PARTIAL, dtype=torch.int8, device=evaluator.device),
                    torch.zeros(shape, dtype=torch.bool, device=evaluator.device))
        return relation(expr, iv, slack)
    raise ValueError(f"cannot classify {type(expr).__name__} ({expr}); expected a boolean expression")


# float32 rounds each operation to within half a unit in the last place (2**-24 of the
# magnitude), a GPU's division and libdevice functions to within one or two units: two units
# per operation cover both, and the second-order terms the bound below leaves out
_ROUNDING = 2.0**-22


def _slack(rel, iv, evaluator):
    """How far the kernel's value of rel.lhs - rel.rhs can lie from its exact range on each
    tile, or None where the kernel computes both sides exactly (integers). 10 * 0.1 is
    1.0000000149 in exact arithmetic and 1.0 in float32."""
    if iv.lo.dtype == torch.int64 and exact(rel.lhs) and exact(rel.rhs):
        return None
    memo = {}
    return _error(rel.lhs, evaluator, memo)[1] + _error(rel.rhs, evaluator, memo)[1]


def _error(e, evaluator, memo):
    """(magnitude, error): bounds, per tile, of |e| and of how far the kernel's float32 value
    of e can lie from it (Higham, Accuracy and Stability of Numerical Algorithms, ch. 3): each
    rounding adds _ROUNDING of the magnitude of its result, a sum adds its terms' errors, a
    product carries each factor's error times the other factors, a function its argument's times
    its slope. Infinite where no such bound holds: a rounded value rounded to an integer or
    used as an index can move by any amount."""
    found = memo.get(e)
    if found is None:
        iv = evaluator.run(e)
        m = torch.maximum(iv.lo.abs(), iv.hi.abs()).to(torch.float64)
        if exact(e) and iv.lo.dtype == torch.int64:
            error = torch.zeros_like(m)
        elif not e.args or (is_load(e) and all(exact(i) for i in e.args[1:])):
            error = _ROUNDING * m  # a literal, a parameter or a tensor element, rounded to float32 once
        elif isinstance(e, (sympy.Add, sympy.Mul)):
            error = _combined(e.is_Add, [_error(a, evaluator, memo) for a in e.args])
        elif e.is_Pow and e.exp.is_Integer and e.exp > 0:  # printed as a product
            error = _combined(False, [_error(e.base, evaluator, memo)] * int(e.exp))
        elif isinstance(e, (sympy.Min, sympy.Max, sympy.Abs)):  # each passes on its arguments' errors
            error = functools.reduce(torch.maximum, [_error(a, evaluator, memo)[1] for a in e.args])
        elif (e.is_Pow and e.exp.is_Number) or type(e) in _SLOPES:
            # a root, a reciprocal or a smooth function: its argument's error, grown by the
            # steepest slope near it
            x = e.base if e.is_Pow else e.args[0]
            x_iv, x_error = evaluator.run(x), _error(x, evaluator, memo)[1]
            slope = (_power_slope(float(e.exp)) if e.is_Pow else _SLOPES[type(e)])(
                x_iv.lo.to(torch.float64) - x_error, x_iv.hi.to(torch.float64) + x_error)
            error = torch.where(x_error == 0, 0.0, slope * x_error) + _ROUNDING * m
        else:
            error = torch.full_like(m, math.inf)
        found = memo[e] = (m, error)
    return found


# the largest |f'(x)| for x in [lo, hi], of the smooth functions the interval evaluator ranges
_SLOPES = {
    sympy.exp: lambda lo, hi: torch.exp(hi),
    sympy.log: lambda lo, hi: torch.where(lo > 0, 1 / lo, math.inf),
    sympy.tanh: lambda lo, hi: 1.0,
    sympy.atan: lambda lo, hi: 1.0,
    sympy.sin: lambda lo, hi: 1.0,
    sympy.cos: lambda lo, hi: 1.0,
    sympy.erf: lambda lo, hi: 2 / math.sqrt(math.pi),
}


def _power_slope(a: float):
    """The largest |d(x**a)/dx| for x in [lo, hi]: unbounded unless the range is positive."""
    return lambda lo, hi: torch.where(lo > 0, abs(a) * torch.maximum(lo.clamp(min=1e-300) ** (a - 1), hi ** (a - 1)),
                                      math.inf)


def _combined(is_sum: bool, parts):
    """The error of a sum or product of `parts` ((magnitude, error) pairs), each step rounded."""
    steps = len(parts) - 1
    if is_sum:
        total = sum(m for m, _ in parts)  # bounds every partial sum
        return sum(error for _, error in parts) + steps * _ROUNDING * total
    product = functools.reduce(torch.mul, [m for m, _ in parts])
    bound = functools.reduce(torch.mul, [m + error for m, error in parts])
    return bound - product + steps * _ROUNDING * bound


@functools.lru_cache(maxsize=1024)
def _difference(rel):
    """lhs - rhs, built once per relation: sympy arithmetic costs more than the tensor work."""
    return rel.lhs - rel.rhs


def _fold(op, verdicts):
    out = verdicts[0]
    for v in verdicts[1:]:
        out = op(out, v)
    return out
