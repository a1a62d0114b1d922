"""Canonical form: equivalent spellings share one signature, and meaning is preserved."""
import pytest
import sympy
import torch
from hypothesis import given

import maskc
from maskc.analysis.dense import evaluate, symbols_env
from maskc.testing import dense_mask
from maskc.testing.strategies import mask_cases
from maskc.trace.canonical import canonicalize
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
    assert canonicalize(Q_IDX * half > KV_IDX) == sympy.Gt(Q_IDX / 2 - KV_IDX, 0)  # real: stays strict
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
