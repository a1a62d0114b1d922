"""Canonical form: equivalent spellings share one signature, and meaning is preserved."""
import pytest
import sympy
import torch
from hypothesis import given
from sympy.core.cache import clear_cache

import maskc
from _work import python_calls
from maskc.analysis.dense import evaluate, symbols_env
from maskc.testing import dense_mask
from maskc.testing.strategies import mask_cases
from maskc.trace.canonical import canonicalize, piecewise
from maskc.trace.symbols import KV_IDX, Q_IDX

W = 4


def _signatures(*fns):
    return {maskc.mask_mod(fn).signature for fn in fns}


def test_causal_spellings():
    assert len(_signatures(
        lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
        lambda b, h, q_idx, kv_idx: kv_idx <= q_idx,
        lambda b, h, q_idx, kv_idx: ~(q_idx < kv_idx),
        lambda b, h, q_idx, kv_idx: q_idx > kv_idx - 1,
        lambda b, h, q_idx, kv_idx: q_idx - kv_idx >= 0,
        lambda b, h, q_idx, kv_idx: ~~(kv_idx <= q_idx),
    )) == 1


@pytest.mark.parametrize("spellings", [
    (lambda b, h, q_idx, kv_idx: q_idx == kv_idx, lambda b, h, q_idx, kv_idx: kv_idx == q_idx),
    (lambda b, h, q_idx, kv_idx: q_idx != kv_idx + 1, lambda b, h, q_idx, kv_idx: kv_idx + 1 != q_idx,
     lambda b, h, q_idx, kv_idx: ~(q_idx - 1 == kv_idx)),
    (lambda b, h, q_idx, kv_idx: q_idx // 3 == kv_idx // 3, lambda b, h, q_idx, kv_idx: kv_idx // 3 == q_idx // 3),
], ids=["eq", "ne", "eq_floordiv"])
def test_equality_both_ways(spellings):
    assert len(_signatures(*spellings)) == 1


def test_boolean_argument_order():
    assert len(_signatures(
        lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= W),
        lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= W) & (kv_idx <= q_idx),
    )) == 1
    assert len(_signatures(
        lambda b, h, q_idx, kv_idx: (kv_idx < 16) | (q_idx >= kv_idx) | (h == 1),
        lambda b, h, q_idx, kv_idx: (h == 1) | (q_idx >= kv_idx) | (kv_idx < 16),
    )) == 1


def test_parameters_on_either_side():
    assert len(_signatures(
        lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= W,
        lambda b, h, q_idx, kv_idx: W >= q_idx - kv_idx,
        lambda b, h, q_idx, kv_idx: kv_idx + W >= q_idx,
        lambda b, h, q_idx, kv_idx: q_idx < kv_idx + W + 1,
    )) == 1


def test_different_masks_differ():
    assert len(_signatures(
        lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
        lambda b, h, q_idx, kv_idx: q_idx > kv_idx,
        lambda b, h, q_idx, kv_idx: q_idx <= kv_idx,
        lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= W,
        lambda b, h, q_idx, kv_idx: q_idx - kv_idx < W,
    )) == 5


def test_forms():
    assert canonicalize(Q_IDX > KV_IDX) == sympy.Ge(Q_IDX - KV_IDX - 1, 0)  # integer strict -> non-strict
    assert canonicalize(KV_IDX < Q_IDX) == sympy.Ge(Q_IDX - KV_IDX - 1, 0)
    half = sympy.Rational(1, 2)
    # rational coefficients are cleared: the relation is decided in integers (q/2 - kv - 1/2
    # rounds to +-1e-17 in floats), then made non-strict
    assert canonicalize(Q_IDX * half > KV_IDX) == sympy.Ge(Q_IDX - 2 * KV_IDX - 1, 0)
    score = sympy.Symbol("score", real=True)
    assert canonicalize(score * half > KV_IDX) == sympy.Gt(score / 2 - KV_IDX, 0)  # real: stays strict
    eq = canonicalize(sympy.Eq(Q_IDX, KV_IDX + 1))
    assert eq == canonicalize(sympy.Eq(KV_IDX + 1, Q_IDX))
    assert not eq.lhs.could_extract_minus_sign() and eq.rhs == 0


@given(mask_cases(max_len=64))
def test_canonicalize_is_idempotent(case):
    expr = case.mask_mod.expr
    assert canonicalize(expr) == expr


@given(mask_cases(max_len=64))
def test_traced_expression_means_what_the_function_computes(case):
    mm, B, H = case.mask_mod, case.B, case.H
    ar = torch.arange
    env = symbols_env(ar(B).view(-1, 1, 1, 1), ar(H).view(1, -1, 1, 1), ar(case.q_len).view(1, 1, -1, 1),
                      ar(case.kv_len).view(1, 1, 1, -1))
    traced = evaluate(mm.expr, env, mm.traced.tensors, mm.traced.param_values())
    assert torch.equal(traced.expand(B, H, case.q_len, case.kv_len), dense_mask(mm, case.q_len, case.kv_len, B, H))


# -- comparisons of torch.where values, and nested where -----------------------------------
def _where(cond, a, b):
    return sympy.Piecewise((a, cond), (b, True))


def test_a_relation_of_where_values_holds_no_piecewise():
    c = Q_IDX >= KV_IDX
    assert canonicalize(sympy.Eq(_where(c, 1, 0), 1)) == canonicalize(c)
    # the comparison goes into each branch, under the branch's condition
    split = canonicalize(_where(Q_IDX > 5, Q_IDX - KV_IDX, KV_IDX - Q_IDX) <= 2)
    assert split == canonicalize(((Q_IDX > 5) & (Q_IDX - KV_IDX <= 2)) | ((Q_IDX <= 5) & (KV_IDX - Q_IDX <= 2)))
    nested = canonicalize(sympy.floor(_where(c, _where(KV_IDX > 3, Q_IDX, 2), KV_IDX) / 2) + Q_IDX >= 4)
    assert not any(rel.atoms(sympy.Piecewise) for rel in nested.atoms(sympy.core.relational.Relational))
    assert canonicalize(nested) == nested


def _numeric_nest(depth):
    """x = where(x > i, x - 1, x + 1), `depth` times, then x >= kv_idx, built as the tracer
    builds it: without sympy's evaluation of Piecewise and relations, which walks trees."""
    clear_cache()  # so that sympy's constructor cache hands back no object of another copy
    x = Q_IDX
    for i in range(depth):
        x = piecewise((x - 1, sympy.Gt(x, i, evaluate=False)), (x + 1, sympy.true))
    return sympy.Ge(x, KV_IDX, evaluate=False)


@pytest.mark.timeout(120)
def test_nested_where_canonicalizes_once_per_distinct_node():
    # as a tree the depth-20 nest has about 3**20 nodes; as a graph, about 150 (canonical: about
    # 1300). Twice the depth costs about 6 times the calls (relations split over the branches);
    # a walk of the tree would cost 3**10 times as many
    shallow = python_calls(canonicalize, _numeric_nest(10))
    deep = _numeric_nest(20)
    calls = python_calls(canonicalize, deep)
    assert calls < 16 * shallow, (shallow, calls)
    expr = canonicalize(deep)
    assert canonicalize(expr) == expr


def test_equal_copies_built_apart_are_one_form():
    # two copies of one nest are two graphs, and sympy's equality test between them walks both
    # trees; x & x is built unevaluated, as asking whether the two are equal is that test.
    # NOTE: depth 10, not 25: where sympy's constructor cache does not already share the two
    # copies (it depends on what ran before in the process), a set or dict holding both still
    # compares them as trees, 3**depth nodes.
    one = python_calls(canonicalize, _numeric_nest(10))
    copies = sympy.Basic.__new__(sympy.And, _numeric_nest(10), _numeric_nest(10))
    # both cost less than twice one: the second copy is recognised, neither canonicalized again
    # nor compared with the first as a tree (3**10 nodes)
    calls = python_calls(canonicalize, copies)
    assert calls < 2 * one, (one, calls)
    assert isinstance(canonicalize(copies), sympy.Or)  # one copy: the nest's own Or of two branches
