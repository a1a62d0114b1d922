"""Canonical form of traced expressions, so equivalent spellings share one signature.

Every comparison of exact values (integers, see `exact`) becomes `e >= 0`, `e > 0` (real e
only), `Eq(e, 0)` or `Ne(e, 0)` with e expanded; integer strict inequalities become non-strict
(`a > b` is `a - b - 1 >= 0`); the sign of e in Eq/Ne is chosen so that it cannot extract a
minus sign. A comparison of values torch rounds keeps the arithmetic of its sides as written,
turned round to >= or > (`_kept`): rearranged, it would round otherwise. No relation holds
a Piecewise (a number-valued torch.where): the comparison is pushed into the branches,
`where(c, a, b) >= x` becoming `(c & (a >= x)) | (~c & (b >= x))`. And/Or/Xor arguments are
flat, free of duplicates and sorted as sympy sorts them.

A traced expression is a DAG: a value used twice is one sympy object, and a nest of
torch.where is exponentially larger as a tree than as a graph. So everything here visits
each distinct node once, and Piecewise, And, Or and Xor are built without sympy's automatic
evaluation, which walks the whole tree of its arguments.
"""
import math
import operator

import numpy
import sympy
from sympy.core.relational import Relational
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.logic.boolalg import And, Not, Or, Xor

from maskc.trace import dag
from maskc.trace.symbols import (SCORE, BitAnd, BitOr, BitXor, LeftShift, LoadBool, LoadInt, RightShift,
                                 Trunc)

_BOOLEAN_OPS = (And, Or, Xor, Not)


# -- building without sympy's evaluation ------------------------------------------------------
def piecewise(*pairs):
    """Piecewise((value, cond), ...) ending in a True condition, with only the folding that
    needs no look inside the values: false branches dropped, a true condition ends it, one
    value for all branches is that value."""
    kept = []
    for value, cond in pairs:
        if cond is sympy.false:
            continue
        kept.append((value, cond))
        if cond is sympy.true:
            break
    if all(value == kept[0][0] for value, _ in kept):
        return kept[0][0]
    return sympy.Basic.__new__(sympy.Piecewise, *[sympy.Tuple.__new__(ExprCondPair, v, c) for v, c in kept])


_NEGATED = {sympy.GreaterThan: sympy.StrictLessThan, sympy.StrictGreaterThan: sympy.LessThan,
            sympy.LessThan: sympy.StrictGreaterThan, sympy.StrictLessThan: sympy.GreaterThan,
            sympy.Equality: sympy.Unequality, sympy.Unequality: sympy.Equality}


def negation(x):
    """~x: a relation flipped, ~~x is x. sympy's Not would evaluate the flipped relation, and
    is memoised in a global cache that compares a large argument with the cached ones node
    by node."""
    if x is sympy.true or x is sympy.false:
        return sympy.false if x is sympy.true else sympy.true
    if isinstance(x, Not):
        return x.args[0]
    if isinstance(x, Relational):
        return _NEGATED[type(x)](x.lhs, x.rhs, evaluate=False)
    return sympy.Basic.__new__(Not, x)


def conjunction(*args):
    """a & b & ...: flattened, without True or repeats; False if any is False."""
    return _lattice(And, args)


def disjunction(*args):
    """a | b | ...: flattened, without False or repeats; True if any is True."""
    return _lattice(Or, args)


def _lattice(op, args, order=None):
    zero, identity = (sympy.false, sympy.true) if op is And else (sympy.true, sympy.false)
    kept = {}  # dict: ordered and without repeats
    for arg in args:
        for a in arg.args if isinstance(arg, op) else (arg,):
            if a is zero:
                return zero
            if a is not identity:
                kept[a] = None
    if not kept:
        return identity
    if len(kept) == 1:
        return next(iter(kept))
    args = sorted(kept, key=order) if order else list(kept)
    obj = sympy.Basic.__new__(op, *args)
    obj._argset = frozenset(args)
    return obj


def parity(*args, order=None):
    """a ^ b ^ ...: flattened, pairs cancelled, a True argument negating the rest."""
    odd = {}
    negate = False
    for arg in args:
        for a in arg.args if isinstance(arg, Xor) else (arg,):
            if a is sympy.true:
                negate = not negate
            elif a is not sympy.false:
                if odd.pop(a, 0) == 0:
                    odd[a] = 1
    if not odd:
        out = sympy.false
    elif len(odd) == 1:
        out = next(iter(odd))
    else:
        ordered = sorted(odd, key=order) if order else list(odd)
        out = sympy.Basic.__new__(Xor, *ordered)
        out._argset = frozenset(ordered)
    return negation(out) if negate else out


_COMPARED = {sympy.GreaterThan: operator.ge, sympy.StrictGreaterThan: operator.gt, sympy.Equality: operator.eq,
             sympy.Unequality: operator.ne}


def _kept(rel_type, lhs, rhs):
    """`rel_type(lhs, rhs)` of values torch rounds, in a form the kernel rounds as torch does:
    turned round to >= or >, and as `lhs - rhs OP 0` only where that difference is one
    subtraction of the two sides (IEEE subtraction has the sign of the exact difference: a - b
    > 0 exactly when a > b). A side that is a sum stays apart, since sympy would merge the
    difference into it, reordered, and float addition does not associate. Nothing is expanded,
    and only comparisons of numbers (in float32, torch's dtype for them), of an infinity and of
    a value with itself are decided: 0.1*score + 1e-8 > 0.1*score is not 1e-8 > 0."""
    if rel_type in (sympy.LessThan, sympy.StrictLessThan):
        lhs, rhs = rhs, lhs
        rel_type = sympy.GreaterThan if rel_type is sympy.LessThan else sympy.StrictGreaterThan
    if lhs.is_Number and rhs.is_Number:
        return sympy.true if _COMPARED[rel_type](numpy.float32(lhs), numpy.float32(rhs)) else sympy.false
    diff = lhs - rhs
    if diff in (sympy.oo, -sympy.oo, 0):  # an infinity beside a finite value, or a value beside itself
        return rel_type(diff, 0)
    if lhs.is_Add or rhs.is_Add:
        subtracts_once = rhs == 0
    else:  # not merged into one term (0.3*score - 0.1*score is 0.2*score, which rounds otherwise)
        subtracts_once = len(sympy.Add.make_args(diff)) == (lhs != 0) + (rhs != 0)
    if subtracts_once:
        if rel_type in (sympy.Equality, sympy.Unequality) and diff.could_extract_minus_sign():
            diff = -diff
        return rel_type(diff, 0, evaluate=False)
    if rel_type in (sympy.Equality, sympy.Unequality):
        lhs, rhs = sorted((lhs, rhs), key=sympy.default_sort_key)
    return rel_type(lhs, rhs, evaluate=False)


# -- canonical form ---------------------------------------------------------------------------
def canonicalize(expr):
    """The canonical form of `expr`; idempotent."""
    return _Canonicalizer().run(expr)


class _Canonicalizer:
    """Memos keyed by the identity of one representative object per structure: a trace can
    hold equal expressions as distinct objects (sympy's constructor cache hands back objects
    of earlier traces), and sympy's equality test on two such DAGs walks both trees."""

    def __init__(self):
        self.reps = {}  # id(expression) -> (expression, the representative of its structure)
        self.forms = {}  # (type, ids of the args' representatives) -> representative
        self.done = {}  # id(representative) -> its canonical form (a representative)
        self.piecewise_inside = {}
        self.keys = {}
        self.replaced = {}

    def run(self, e):
        e = self._rep(e)
        out = self.done.get(id(e))
        if out is None:
            out = self._build(e)
            if out is not e and type(out) is type(e) and _same_args(out, e):
                out = e  # already canonical: the same object, so that equality with it stays cheap
            out = self.done[id(e)] = self._rep(out)
            self.done.setdefault(id(out), out)  # a canonical form is its own canonical form
        return out

    def _rep(self, e):
        """The one object kept for `e`'s structure (hash-consing, by the identity of children)."""
        hit = self.reps.get(id(e))
        if hit is None:
            key = (type(e), tuple(id(self._rep(a)) for a in e.args)) if e.args else (type(e), e)
            hit = self.reps[id(e)] = (e, self.forms.setdefault(key, e))
        return hit[1]

    def _build(self, e):
        if isinstance(e, Relational):
            return self._relation(e)
        if not e.args or isinstance(e, sympy.Symbol):
            return e
        if isinstance(e, sympy.Piecewise):
            return piecewise(*[(self.run(p.expr), self.run(p.cond)) for p in e.args])
        args = [self.run(a) for a in e.args]
        if isinstance(e, (And, Or)):
            return self._lattice(type(e), args)
        if isinstance(e, Xor):
            rebuilt = parity(*args, order=self._order)  # Xor(r, True) is ~r: a relation
        elif isinstance(e, Not):
            rebuilt = negation(args[0])
        elif all(new is old for new, old in zip(args, e.args)):
            return e
        else:
            rebuilt = dag.make(e.func, *args)
        if isinstance(rebuilt, Relational):
            return self.run(rebuilt)  # ~(a >= b) is a < b: normalise that too
        return rebuilt

    def _lattice(self, op, args):
        out = _lattice(op, args, order=self._order)
        if isinstance(out, op):
            # x & ~x is False, x | ~x is True (sympy's own And and Or fold these too)
            negations = {self.run(negation(a)) for a in out.args}
            if any(a in negations for a in out.args):
                return sympy.false if op is And else sympy.true
        return out

    # -- relations --------------------------------------------------------------------------
    def _relation(self, rel):
        lhs, rhs = self.run(rel.lhs), self.run(rel.rhs)
        if self._has_piecewise(lhs) or self._has_piecewise(rhs):
            if SCORE not in dag.free_symbols(lhs) | dag.free_symbols(rhs):
                return self._split(type(rel), lhs, rhs)
            # A condition on the score is printed, never analysed (block maps read masks only),
            # so it stays as written: split over the branches of a where-nest on the score, it
            # would be 2**depth relations, one per distinct affine function of the score.
            return _kept(type(rel), lhs, rhs)
        if not (exact(lhs) and exact(rhs)):
            return _kept(type(rel), lhs, rhs)
        if isinstance(rel, (sympy.GreaterThan, sympy.StrictGreaterThan)):
            diff = _cleared(sympy.expand(lhs - rhs))
        elif isinstance(rel, (sympy.LessThan, sympy.StrictLessThan)):
            diff = _cleared(sympy.expand(rhs - lhs))
        else:
            diff = _cleared(sympy.expand(lhs - rhs))
            if diff.could_extract_minus_sign():
                diff = -diff
            return type(rel)(diff, 0)
        if isinstance(rel, (sympy.StrictGreaterThan, sympy.StrictLessThan)):
            if diff.is_integer:
                return sympy.Ge(diff - 1, 0)
            return sympy.Gt(diff, 0)
        return sympy.Ge(diff, 0)


    def _split(self, rel_type, lhs, rhs):
        """`rel_type(lhs, rhs)` with its outermost Piecewise replaced by each branch in turn,
        under that branch's condition. Relations repeat across branches (x - 1 >= k and
        x + 1 >= k both meet x + 0 >= k one level down), and `run` builds each once."""
        chosen = self._outermost_piecewise(lhs if self._has_piecewise(lhs) else rhs)
        terms, earlier = [], []
        for pair in chosen.args:
            branch = rel_type(self._replace(lhs, chosen, pair.expr), self._replace(rhs, chosen, pair.expr),
                              evaluate=False)
            terms.append(self._lattice(And, [*earlier, pair.cond, self.run(branch)]))
            earlier.append(self.run(negation(pair.cond)))
        return self._lattice(Or, terms)

    def _has_piecewise(self, e):
        e = self._rep(e)
        found = self.piecewise_inside.get(id(e))
        if found is None:
            found = self.piecewise_inside[id(e)] = (isinstance(e, sympy.Piecewise)
                                                    or any(self._has_piecewise(a) for a in e.args))
        return found

    def _outermost_piecewise(self, e):
        while not isinstance(e, sympy.Piecewise):
            e = next(a for a in e.args if self._has_piecewise(a))
        return e

    def _replace(self, e, old, new):
        """`e` with `old` replaced by `new`, rebuilding only the nodes that hold a Piecewise."""
        e, old = self._rep(e), self._rep(old)
        if e is old:
            return new
        if not self._has_piecewise(e):
            return e
        key = (id(e), id(old), id(self._rep(new)))
        out = self.replaced.get(key)
        if out is None:
            if isinstance(e, sympy.Piecewise):
                out = piecewise(*[(self._replace(p.expr, old, new), p.cond) for p in e.args])
            else:
                out = dag.make(e.func, *[self._replace(a, old, new) for a in e.args])
            out = self.replaced[key] = self._rep(out)
        return out

    # -- argument order ---------------------------------------------------------------------
    def _order(self, e):
        """sympy's order (`ordered`: tree size, then sort key), remembered per node: sympy would
        walk the whole tree of each argument, again for every node above it."""
        e = self._rep(e)
        key = self.keys.get(id(e))
        if key is None:
            if isinstance(e, _BOOLEAN_OPS):
                children = [self._order(a) for a in e.args]
                size = 1 + sum(k[0] for k in children)
                key = (size, (type(e).class_key(), (len(children), tuple(k[1] for k in children))))
            else:
                key = (_tree_size(e), sympy.default_sort_key(e))
            self.keys[id(e)] = key
        return key


# coefficients this small keep an int32 sum of positions from overflowing below 2 million positions
_CLEARED_LIMIT = 1024


def _cleared(diff):
    """`diff` times the common denominator of its rational coefficients where that makes it an
    integer: q_idx/20 - 1/2 > 0 (index arithmetic with the literal 0.05, read as 1/20) is
    decided as q_idx - 10 > 0, in integers, not in floats that round 1/2 - 1/2 to 1e-17."""
    if diff.is_integer:
        return diff
    denominators = set()
    for term in sympy.Add.make_args(diff):
        coefficient = term.as_coeff_Mul()[0]
        if not coefficient.is_Rational:
            return diff
        denominators.add(coefficient.q)
    scaled = sympy.expand(diff * math.lcm(*denominators))
    small = all(abs(term.as_coeff_Mul()[0]) <= _CLEARED_LIMIT for term in sympy.Add.make_args(scaled)
                if not term.is_Number)
    return scaled if small and scaled.is_integer else diff


# integers of integers, like the integer operations of symbols.py, and a torch.where of them
# under conditions on them; floor, ceiling, trunc and % take integer quotients too
# (q_idx // p0), which the printer divides in integers
_EXACT_OF_EXACT = (sympy.Add, sympy.Mul, sympy.Min, sympy.Max, sympy.Abs, sympy.sign, LoadInt, LoadBool, BitAnd,
                   BitOr, BitXor, LeftShift, RightShift, sympy.Piecewise, ExprCondPair, Relational, And, Or, Not,
                   Xor, sympy.logic.boolalg.BooleanAtom)
_OF_QUOTIENTS = (sympy.floor, sympy.ceiling, sympy.Mod, Trunc)


@dag.identity_cache(maxsize=1 << 16)
def exact(e) -> bool:
    """Whether torch computes `e` without rounding: integer arithmetic, with the rationals that
    proxy.as_spelled reads float literals as, and integer quotients under floor, ceiling, trunc and
    %. Only a comparison of such values may move terms across (expanded, cleared) and be
    decided by sympy: (q_idx - kv_idx) * 0.1 rounds otherwise than 0.1*q_idx - 0.1*kv_idx,
    and sympy's sign of a reciprocal of positions is wrong (dag.misleads_sympy)."""
    if e.is_Number:
        return e.is_Rational or e in (sympy.oo, -sympy.oo)
    if e.is_Symbol:
        return bool(e.is_integer)
    if e.is_Pow:
        return e.exp.is_Integer and e.exp >= 0 and exact(e.base)
    if isinstance(e, _OF_QUOTIENTS):
        return all(_exact_quotient(a) for a in e.args)
    return isinstance(e, _EXACT_OF_EXACT) and all(exact(a) for a in e.args)


@dag.identity_cache(maxsize=1 << 16)
def _exact_quotient(e) -> bool:
    """Whether `e` is exact but for divisions by exact values that read no position."""
    if e.is_Pow and e.exp.is_Integer and e.exp < 0:
        return exact(e.base) and not dag.misleads_sympy(e)
    if e.is_Add or e.is_Mul:
        return all(_exact_quotient(a) for a in e.args)
    return exact(e)


def _tree_size(e):
    # sympy's _node_count, which `ordered` sorts by first
    return 0.5 if e.is_Float else 1 + sum(_tree_size(a) for a in e.args)


def _same_args(a, b) -> bool:
    """Whether `a` and `b` hold the same argument objects; a relation's sides, small once
    canonical, are compared by value."""
    if isinstance(a, Relational):
        return a.args == b.args
    return len(a.args) == len(b.args) and all(x is y for x, y in zip(a.args, b.args))
