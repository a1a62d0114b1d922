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
from sympy.functions.elementary.piecewise import ExprCondPair
from sympy.logic.boolalg import And, Not, Or, Xor

from maskc._slots import Slots


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
    trees); arithmetic evaluates, as sympy would."""
    if isinstance(node, (And, Or, Xor)):
        out = sympy.Basic.__new__(type(node), *args)
        out._argset = frozenset(args)
        return out
    if isinstance(node, (Not, sympy.Piecewise, ExprCondPair)):
        return sympy.Basic.__new__(type(node), *args)
    return node.func(*args)


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
        return cached
    return wrap
