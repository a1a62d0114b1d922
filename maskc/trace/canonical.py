"""Canonical form of traced expressions, so equivalent spellings share one signature.

Every comparison becomes `e >= 0`, `e > 0` (real e only), `Eq(e, 0)` or `Ne(e, 0)` with e
expanded; integer strict inequalities become non-strict (`a > b` is `a - b - 1 >= 0`);
the sign of e in Eq/Ne is chosen so that it cannot extract a minus sign. And/Or/Xor
arguments are ordered by sympy itself.
"""
import sympy
from sympy.core.relational import Relational


def canonicalize(expr):
    """The canonical form of `expr`; idempotent."""
    if isinstance(expr, Relational):
        return _relation(expr)
    if not expr.args or isinstance(expr, sympy.Symbol):
        return expr
    rebuilt = expr.func(*[canonicalize(a) for a in expr.args])
    if isinstance(rebuilt, Relational) and rebuilt != expr:
        return canonicalize(rebuilt)  # Not(a >= b) evaluates to a < b: normalise that too
    return rebuilt


def _relation(rel):
    lhs, rhs = canonicalize(rel.lhs), canonicalize(rel.rhs)
    if isinstance(rel, (sympy.GreaterThan, sympy.StrictGreaterThan)):
        diff = sympy.expand(lhs - rhs)
    elif isinstance(rel, (sympy.LessThan, sympy.StrictLessThan)):
        diff = sympy.expand(rhs - lhs)
    else:
        diff = sympy.expand(lhs - rhs)
        if diff.could_extract_minus_sign():
            diff = -diff
        return type(rel)(diff, 0)
    if isinstance(rel, (sympy.StrictGreaterThan, sympy.StrictLessThan)):
        if diff.is_integer:
            return sympy.Ge(diff - 1, 0)
        return sympy.Gt(diff, 0)
    return sympy.Ge(diff, 0)
