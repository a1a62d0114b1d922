"""Score mods that split as a·score + row(q_idx) + column(kv_idx), such as ALiBi.

For these the FULL-tile softmax needs no per-score bias arithmetic: the column term is a
vector per kv tile folded into the one FMA that scales the scores, and the row term a vector
per program added to the running max. A general score mod costs a few more float operations
per score; split, ALiBi-causal measured 4-5% faster on an H100 (benchmarks/NOTES.md), still
about 7% below plain causal.

Terms are printed as the user wrote them: only a product that mixes q_idx and kv_idx is
multiplied out (ALiBi's slope * (kv_idx - q_idx)), since a deep expand rewrites what runs
(exp(a + b) into exp(a) * exp(b), which overflows; kv * (kv - 1) into an int32 kv**2).

A column linear in kv_idx is centred on the program's first query row, `q_lo`:
column(kv_idx) - column(q_lo) and row(q_idx) + column(q_lo) add up to the same score, and
near the diagonal both stay small, so float32 keeps its precision at any length (ALiBi's
slope * kv_idx alone would be ~10^5 at L = 131072, with 10^-2 absolute rounding error).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from maskc.trace import dag
from maskc.trace.symbols import KV_IDX, Q_IDX, SCORE

# The first query row of a program (pid_m * BLOCK_M); only separable scores print it.
Q_LO = sympy.Symbol("q_lo", integer=True, nonnegative=True)


@dataclass(frozen=True)
class SeparableScore:
    """score_mod(score) == coefficient * score + row + column, in natural-log units."""

    coefficient: sympy.Expr  # free of score, q_idx and kv_idx (b, h, parameters, loads by them)
    row: sympy.Expr  # free of score and kv_idx
    column: sympy.Expr  # free of score and q_idx


@dag.identity_cache(maxsize=512)  # a call with a block map asks on every call: 1-2 ms of sympy for ALiBi
def separate(score_expr: sympy.Expr | None) -> SeparableScore | None:
    """The split of `score_expr`, or None when it has no such form (softcap's tanh, a table
    indexed by q_idx - kv_idx, a product of score with a position).

    >>> separate(SCORE + LoadFloat(0, H) * (KV_IDX - Q_IDX))
    SeparableScore(coefficient=1, row=(-q_idx + q_lo)*LoadFloat(0, h), column=(kv_idx - q_lo)*LoadFloat(0, h))
    """
    if score_expr is None:
        return None
    uses = _Uses()
    coefficient, row, column = sympy.Integer(0), sympy.Integer(0), sympy.Integer(0)
    for term in _terms(score_expr, uses):
        used = uses(term)
        if SCORE in used:
            # score itself times factors free of score and positions
            factors = sympy.Mul.make_args(term)
            if [f for f in factors if uses(f)] != [SCORE]:
                return None
            coefficient += sympy.Mul(*[f for f in factors if f != SCORE])
        elif Q_IDX in used and KV_IDX in used:
            return None
        elif KV_IDX in used:
            column += term
        else:
            row += term
    if column.is_polynomial(KV_IDX) and sympy.degree(column, KV_IDX) == 1 and not column.has(*_INFINITIES):
        shift = column.subs(KV_IDX, Q_LO)
        column, row = sympy.factor_terms(column - shift), sympy.factor_terms(row + shift)
    return SeparableScore(coefficient, row, column)


def _terms(expr, uses) -> list:
    """The top-level terms of expr, with products that mix q_idx and kv_idx multiplied out
    one level; everything else as written."""
    terms = []
    for term in sympy.Add.make_args(expr):
        if term.is_Mul and {Q_IDX, KV_IDX} <= uses(term):
            terms += sympy.Add.make_args(sympy.expand_mul(term, deep=False))
        else:
            terms.append(term)
    return terms


_INFINITIES = (sympy.oo, -sympy.oo, sympy.zoo)


class _Uses:
    """`uses(expr)`: the index symbols and the score anywhere in `expr`, inside load arguments
    too. Each distinct node is visited once: free_symbols walks the tree, which nested
    torch.where makes exponentially large."""

    def __init__(self):
        self.done = {}

    def __call__(self, expr) -> frozenset:
        found = self.done.get(expr)
        if found is None:
            if expr.is_Symbol:
                found = frozenset({expr}) & _TRACKED
            else:
                found = frozenset().union(*(self(a) for a in expr.args))
            self.done[expr] = found
        return found


_TRACKED = frozenset({SCORE, Q_IDX, KV_IDX})


__all__ = ["Q_LO", "SeparableScore", "separate"]
