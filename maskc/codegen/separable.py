"""Score mods that split as a·score + row(q_idx) + column(kv_idx), such as ALiBi.

For these the FULL-tile softmax needs no per-score bias arithmetic: the column term is a
vector per kv tile folded into the one FMA that scales the scores, and the row term a vector
per program added to the running max. A general score mod costs four or five more float
operations per score (FlashAttention-style kernels are bound by those, not by the matrix
units, once the matrices are small), so ALiBi's FULL tiles then cost what plain causal's do.

A column term polynomial in kv_idx is centred on the program's first query row, `q_lo`:
column(kv_idx) - column(q_lo) and row(q_idx) + column(q_lo) add up to the same score, and
near the diagonal both stay small, so float32 keeps its precision at any length (ALiBi's
slope * kv_idx alone would be ~10^5 at L = 131072, with 10^-2 absolute rounding error).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from maskc.trace.symbols import KV_IDX, Q_IDX, SCORE

# The first query row of a program (pid_m * BLOCK_M); only separable scores print it.
Q_LO = sympy.Symbol("q_lo", integer=True, nonnegative=True)


@dataclass(frozen=True)
class SeparableScore:
    """score_mod(score) == coefficient * score + row + column, in natural-log units."""

    coefficient: sympy.Expr  # free of score, q_idx and kv_idx (b, h, parameters, loads by them)
    row: sympy.Expr  # free of score and kv_idx
    column: sympy.Expr  # free of score and q_idx


def separate(score_expr: sympy.Expr | None) -> SeparableScore | None:
    """The split of `score_expr`, or None when it has no such form (softcap's tanh, a table
    indexed by q_idx - kv_idx, a product of score with a position).

    >>> separate(SCORE + LoadFloat(0, H) * (KV_IDX - Q_IDX))
    SeparableScore(coefficient=1, row=(q_lo - q_idx)*LoadFloat(0, h), column=(kv_idx - q_lo)*LoadFloat(0, h))
    """
    if score_expr is None:
        return None
    coefficient, row, column = sympy.Integer(0), sympy.Integer(0), sympy.Integer(0)
    for term in sympy.Add.make_args(sympy.expand(score_expr)):
        uses = _uses(term)
        if SCORE in uses:
            factor = sympy.cancel(term / SCORE)
            if _uses(factor) & {SCORE, Q_IDX, KV_IDX}:
                return None
            coefficient += factor
        elif Q_IDX in uses and KV_IDX in uses:
            return None
        elif KV_IDX in uses:
            column += term
        else:
            row += term
    if column.is_polynomial(KV_IDX):
        shift = column.subs(KV_IDX, Q_LO)
        column, row = sympy.factor_terms(column - shift), sympy.factor_terms(row + shift)
    return SeparableScore(coefficient, row, column)


def _uses(expr) -> set:
    """Index symbols and the score anywhere in `expr`, inside load arguments too."""
    return expr.free_symbols & {SCORE, Q_IDX, KV_IDX}


__all__ = ["Q_LO", "SeparableScore", "separate"]
