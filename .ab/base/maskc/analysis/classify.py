"""FULL / PARTIAL / EMPTY verdicts for boolean expressions over a grid of tiles.

A verdict is a pair of tensors: `cls` (EMPTY=0, PARTIAL=1, FULL=2) and `certain`, true
where a PARTIAL verdict is known to be exact (the tile really mixes kept and dropped
pairs). FULL and EMPTY are always exact; an uncertain PARTIAL is settled later by dense
evaluation of that tile alone. A comparison whose range has a NaN end (the value may be NaN,
which every comparison but != rejects) is an uncertain PARTIAL.

The ranges come from the evaluator that classify_grid is given (intervals.IntervalEvaluator),
whose Piecewise rule classifies its conditions here in turn. This module reaches the
evaluator only through that argument, so intervals imports classify and not the reverse.
"""
from __future__ import annotations

import functools

import sympy
import torch

from maskc.analysis._shapes import broadcast

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


def relation(rel, iv):
    """Verdict of a relation `e OP 0` from the interval of e = lhs - rhs. Relations are
    canonical (`e >= 0`, `e > 0`, Eq, Ne), except in Piecewise conditions, which sympy may
    turn round (`-e <= 0`)."""
    lo, hi = iv.lo, iv.hi
    if isinstance(rel, (sympy.LessThan, sympy.StrictLessThan)):
        lo, hi = -hi, -lo
    if isinstance(rel, (sympy.GreaterThan, sympy.LessThan)):
        full, empty, certain = lo >= 0, hi < 0, iv.tight
    elif isinstance(rel, (sympy.StrictGreaterThan, sympy.StrictLessThan)):
        full, empty, certain = lo > 0, hi <= 0, iv.tight
    elif isinstance(rel, (sympy.Equality, sympy.Unequality)):
        full, empty = (lo == 0) & (hi == 0), (lo > 0) | (hi < 0)
        # A PARTIAL tile has lo <= 0 <= hi, lo < hi. With both ends attained (tight), an end
        # at 0 is a kept pair and the other a dropped one; 0 strictly inside is attained only
        # if every integer is (dense). The first case is every boundary tile of a document
        # mask (ids[q_idx] == ids[kv_idx]), which would otherwise be settled pair by pair.
        certain = False
        if iv.tight and lo.dtype == torch.int64:
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
        except _Undecidable:
            shape = broadcast(*(f.lo.shape for f in evaluator.frame.values()))
            return (torch.full(shape, PARTIAL, dtype=torch.int8, device=evaluator.device),
                    torch.zeros(shape, dtype=torch.bool, device=evaluator.device))
        return relation(expr, iv)
    raise ValueError(f"cannot classify {type(expr).__name__} ({expr}); expected a boolean expression")


@functools.lru_cache(maxsize=1024)
def _difference(rel):
    """lhs - rhs, built once per relation: sympy arithmetic costs more than the tensor work."""
    return rel.lhs - rel.rhs


def _fold(op, verdicts):
    out = verdicts[0]
    for v in verdicts[1:]:
        out = op(out, v)
    return out
