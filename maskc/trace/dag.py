"""Walks of traced expressions that visit each distinct subexpression once.

A traced expression is a DAG: `x = torch.where(x > i, x - 1, x + 1)` repeated reads x three
times a level. sympy's own walks (free_symbols, atoms, xreplace, replace, srepr) treat it as
a tree, which doubles or triples with every level; these take time in the number of
distinct nodes. Nodes are told apart by identity, which the tracer and canonical form share
between equal subexpressions.
"""
from __future__ import annotations

import functools

import sympy
from sympy.core.relational import Relational
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.logic.boolalg import And, Not, Or, Xor

from maskc._slots import Slots
from maskc.trace.symbols import INDEX_SYMBOLS


def postorder(expr) -> list:
    """The distinct nodes of `expr`, each after its arguments."""
    seen: set[int] = set()
    order: list = []
    stack = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
        elif id(node) not in seen:
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.args) if id(a) not in seen)
    return order


def free_symbols(expr) -> frozenset:
    return frozenset(n for n in postorder(expr) if isinstance(n, sympy.Symbol))


def atoms(expr, *types) -> list:
    """The distinct nodes of the given types (by identity: equal copies may repeat)."""
    return [n for n in postorder(expr) if isinstance(n, types)]


def transform(expr, rule):
    """`expr` rebuilt bottom-up with `rule(node)` applied to every node once its arguments
    are rebuilt (rule returns the node itself to keep it)."""
    done: dict[int, object] = {}
    for node in postorder(expr):
        args = tuple(done[id(a)] for a in node.args)
        new = _rebuilt(node, args) if any(n is not o for n, o in zip(args, node.args)) else node
        done[id(node)] = rule(new)
    return done[id(expr)]


def _rebuilt(node, args):
    """`node` with new arguments, as unevaluated as the tracer built it: boolean operators
    and Piecewise are made directly (evaluating them sorts and compares their arguments as
    trees), a comparison as canonical.py left it (it decides what may be decided); arithmetic
    evaluates, as sympy would (see make)."""
    if isinstance(node, (And, Or, Xor)):
        out = sympy.Basic.__new__(type(node), *args)
        out._argset = frozenset(args)
        return out
    if isinstance(node, (Not, sympy.Piecewise, ExprCondPair)):
        return sympy.Basic.__new__(type(node), *args)
    if isinstance(node, Relational):
        return type(node)(*args, evaluate=False)
    return make(node.func, *args)


def identity_cache(maxsize: int):
    """Memoise a pure function whose first argument is an expression or a tuple of them (None
    allowed) by the identity of those expressions, the other arguments by value; the entries
    keep the arguments alive, so that their ids stay theirs. An lru_cache would find a hit by
    ==, which sympy answers by walking both trees: exponential in a nest's depth for an equal
    expression traced afresh (a mod defined inside the training step; seconds at depth 12). A
    fresh trace here misses and costs one call of the function."""
    def wrap(fn):
        entries = Slots(maxsize)

        @functools.wraps(fn)
        def cached(exprs, *rest):
            key = (tuple(map(id, exprs)) if type(exprs) is tuple else id(exprs), *rest)
            hit = entries.get(key)
            if hit is not None:
                return hit[1]
            result = fn(exprs, *rest)
            entries.put(key, ((exprs, rest), result))
            return result
        cached.entries = entries  # for maskc.cache_info() and maskc.clear_caches() (runtime/state.py)
        return cached
    return wrap


# The nodes whose evaluation asks sympy the sign of an argument: Max(x, y) drops y where it
# finds x - y >= 0, Abs(x) is x where it finds x >= 0 (and sqrt(x**2) is Abs(x)), a relation
# folds to True or False.
_SIGN_DECIDED = (sympy.Min, sympy.Max, sympy.Abs, sympy.sign, sympy.Heaviside, sympy.floor, sympy.ceiling,
                 sympy.Mod, sympy.Pow, Relational)


def make(func, *args):
    """`func(*args)`, evaluated as sympy would, but left unevaluated where that evaluation
    would decide a sign that sympy can get wrong (see misleads_sympy), and where it would take a
    product with a Mod factor modulo a number (`_squares_a_mod`)."""
    args = [sympy.sympify(a) for a in args]
    if isinstance(func, type) and issubclass(func, _SIGN_DECIDED) and any(misleads_sympy(a) for a in args):
        return func(*args, evaluate=False)
    if func is sympy.Mod and _squares_a_mod(args[0]):
        return func(*args, evaluate=False)
    if func is sympy.Abs and _holds(args[0], sympy.Abs):
        # sympy's Abs simplifies the signs of its whole argument (signsimp) on every level: a mod
        # nesting abs(x - i) in a loop traced in O(n^3), 3 s at 60 levels, 9 s at 80
        return func(*args, evaluate=False)
    if func in (sympy.floor, sympy.ceiling) and _holds(args[0], _ROUNDINGS):
        # sympy's floor asks the assumptions of its whole argument on every level: a mod nesting
        # floor(x / 2) + kv_idx in a loop took 44 s at 100 levels to reach the recursion limit
        return func(*args, evaluate=False)
    return func(*args)


_ROUNDINGS = (sympy.floor, sympy.ceiling)


@identity_cache(maxsize=1 << 16)
def _holds(e, kinds) -> bool:
    return isinstance(e, kinds) or any(_holds(a, kinds) for a in e.args)


def _squares_a_mod(dividend) -> bool:
    """Whether sympy 1.14's Mod(dividend, n) would square a Mod factor of the product: it gives
    Mod(8*Mod(b, 7), 80) as 8*Mod(Mod(b, 7)**2, 10), 72 at b = 3 where torch's (b % 7) * 8 % 80 is
    24 (found by the grammar fuzzer, seed 4087)."""
    return dividend.is_Mul and any(isinstance(f, sympy.Mod) for f in dividend.args)


@identity_cache(maxsize=1 << 16)
def misleads_sympy(expr) -> bool:
    """Whether `expr` holds the reciprocal of a function of the positions, whose sign sympy
    1.14 gets wrong: its sign rule (exprtools._monotonic_sign) puts the least positions into
    1/(q_idx + kv_idx + 1) as if that gave the value nearest 0, so it finds
    1/(q_idx + kv_idx + 1) - 1/2 >= 0, Max(that, 0) equal to that, and
    floor(1/(q_idx + kv_idx + 1) - 0.5) equal to 0. A reciprocal of numbers or parameters
    alone (q_idx // p0) misleads nothing: an unsigned parameter has no least value to put in."""
    if expr.is_Pow and expr.exp.is_negative and _reads_positions(expr.base):
        return True
    return any(misleads_sympy(a) for a in expr.args)


@identity_cache(maxsize=1 << 16)
def _reads_positions(e) -> bool:
    return e in _POSITIONS if e.is_Symbol else any(_reads_positions(a) for a in e.args)


_POSITIONS = frozenset(INDEX_SYMBOLS)
