"""TritonPrinter: exact Triton text for each node, and Python's semantics kept through a real kernel."""
import pytest
import sympy
import torch

import maskc
from maskc.codegen.printer import Printed, TritonPrinter, tensor_args
from maskc.testing import assert_close_to_reference, attention_reference
from maskc.trace.symbols import (B, H, KV_IDX, Q_IDX, SCORE, BitAnd, BitOr, BitXor, LeftShift, LoadBool, LoadFloat,
                                 LoadInt, RightShift, Trunc, param_symbol)

P0_INT = param_symbol(0, True)
P0_FLOAT = param_symbol(0, False)


def show(expr) -> str:
    return TritonPrinter().doprint(expr)


# -- floor division and modulo --------------------------------------------------------------
@pytest.mark.parametrize("expr,text", [
    # the dividend may be negative: helpers with Python's semantics
    (sympy.floor((Q_IDX - KV_IDX) / 3), "_floordiv((q_idx + (-1 * kv_idx)), 3)"),
    (sympy.Mod(Q_IDX - KV_IDX, 5), "_mod((q_idx + (-1 * kv_idx)), 5)"),
    (sympy.floor(-Q_IDX / 3), "_floordiv((-1 * q_idx), 3)"),
    # a divisor that is negative, or not a literal
    (sympy.Mod(Q_IDX, -3), "_mod(q_idx, -3)"),
    (sympy.floor(Q_IDX / P0_INT), "_floordiv(q_idx, p0)"),
    (sympy.Mod(Q_IDX, P0_INT), "_mod(q_idx, p0)"),
    (sympy.Mod(Q_IDX - KV_IDX, P0_INT), "_mod((q_idx + (-1 * kv_idx)), p0)"),
    (sympy.Mod(LoadInt(0, Q_IDX), 4),
     "_mod(_widen(tl.load(T0 + (q_idx) * T0_stride0, mask=(((q_idx) >= 0) & ((q_idx) < T0_size0)) != 0, other=0)), 4)"),
    # nonnegative dividend, positive literal divisor: the plain operators agree with Python
    (sympy.floor(Q_IDX / 3), "(q_idx // 3)"),
    (sympy.floor((Q_IDX + KV_IDX) / 4), "((kv_idx + q_idx) // 4)"),
    (sympy.Mod(Q_IDX, 5), "(q_idx % 5)"),
    (sympy.Mod(Q_IDX + 3, 5), "((3 + q_idx) % 5)"),
    (sympy.Mod(B * 2 + H, 7), "((off_h + (2 * off_b)) % 7)"),
    (sympy.floor(sympy.Mod(Q_IDX - KV_IDX, 7) / 2), "(_mod((q_idx + (-1 * kv_idx)), 7) // 2)"),
    # not integers: floor of a true division
    (sympy.floor(Q_IDX / P0_FLOAT), "tl.floor(q_idx / p0)"),
    (sympy.floor(SCORE), "tl.floor(score)"),
    (sympy.Mod(SCORE, 3), "(score - 3 * tl.floor(score / 3))"),
], ids=str)
def test_floor_division_and_modulo(expr, text):
    assert show(expr) == text


def test_what_sympy_folds_prints_its_folded_form():
    # sympy rewrites Mod(-q, 7) as Mod(6 q, 7): nonnegative, so the plain operator is right
    assert show(sympy.Mod(-Q_IDX, 7)) == "((6 * q_idx) % 7)"


# -- numbers and arithmetic -----------------------------------------------------------------
@pytest.mark.parametrize("expr,text", [
    (sympy.Rational(1, 3), "0.3333333333333333"),
    (sympy.Rational(-3, 4), "-0.75"),
    (sympy.Rational(1, 2), "0.5"),
    (Q_IDX / 2, "(0.5 * q_idx_f)"),  # true division stays true division, over float positions
    (SCORE / 30, "(0.03333333333333333 * score)"),
    (sympy.Float(2.5) * SCORE, "(2.5 * score)"),
    (sympy.Integer(7), "7"),
    (sympy.Integer(-1), "-1"),
    (Q_IDX - KV_IDX, "(q_idx + (-1 * kv_idx))"),
    (SCORE**2, "(score * score)"),
    (SCORE**-2, "(1.0 / (score * score))"),
    (sympy.sqrt(SCORE), "tl.sqrt(score)"),
    (1 / sympy.sqrt(SCORE), "(1.0 / tl.sqrt(score))"),
    (sympy.exp(SCORE), "tl.exp(score)"),
    (sympy.log(SCORE), "tl.log(score)"),
    (sympy.tanh(SCORE), "_tanh(score)"),
    (sympy.Abs(Q_IDX - KV_IDX), "tl.abs((kv_idx + (-1 * q_idx)))"),
    (sympy.Min(Q_IDX, KV_IDX, 3), "tl.minimum(tl.minimum(3, kv_idx), q_idx)"),
    (sympy.Max(Q_IDX, KV_IDX), "tl.maximum(kv_idx, q_idx)"),
    (sympy.true, "True"),
    (sympy.false, "False"),
    (sympy.Piecewise((0, KV_IDX >= 40), (-sympy.oo, True)), 'tl.where((kv_idx >= 40), 0, float("-inf"))'),
    (sympy.oo, 'float("inf")'),
], ids=str)
def test_numbers_and_arithmetic(expr, text):
    assert show(expr) == text


# -- the rest of torch's vocabulary (issue 11) ------------------------------------------------
@pytest.mark.parametrize("expr,text", [
    # exp2 and powers: torch.exp2 is Pow(2, x); integer exponents written as floats multiply
    (2**SCORE, "tl.math.exp2(score)"),
    (3**SCORE, "tl.math.exp2(1.584962500721156 * score)"),
    (SCORE**2.0, "(score * score)"),
    (SCORE**0.5, "tl.sqrt(score)"),
    (SCORE**P0_FLOAT, "tl.exp(p0 * tl.log(score))"),
    # an integer exponent is converted to float, as torch.exp2 converts it
    (2 ** (-4 * (H + 1)), "tl.math.exp2(((-4 + (-4 * off_h))).to(tl.float32))"),
    (sympy.exp(Q_IDX - KV_IDX), "tl.exp((q_idx_f + (-1.0 * kv_idx_f)))"),  # positions as float vectors
    (sympy.sqrt(sympy.pi) * SCORE, "(score * 1.772453850905516)"),  # a function of numbers: its correctly rounded value
    (sympy.sin(SCORE / 2), "tl.sin((0.5 * score))"),
    (sympy.cos(SCORE), "tl.cos(score)"),
    (sympy.erf(SCORE), "tl.math.erf(score)"),
    (sympy.ceiling(Q_IDX / 3), "_ceildiv(q_idx, 3)"),
    (sympy.ceiling(SCORE), "tl.ceil(score)"),
    # steps: sign(0) = 0 as torch.sign; Heaviside's value at 0 is its second argument
    (sympy.sign(SCORE), "_sign(score)"),
    (sympy.Heaviside(SCORE, 1), "tl.where(score >= 0, 1.0, 0.0)"),
    (sympy.Heaviside(SCORE, 0), "tl.where(score > 0, 1.0, 0.0)"),
    (sympy.Heaviside(SCORE), "tl.where(score > 0, 1.0, tl.where(score == 0, 0.5, 0.0))"),
    (sympy.ITE(Q_IDX >= KV_IDX, SCORE > 0, KV_IDX > 3), "tl.where((q_idx >= kv_idx), (score > 0), (kv_idx > 3))"),
    # integer operations: torch's, shifts past the width included
    (BitAnd(Q_IDX, 3), "(q_idx & 3)"),
    (BitOr(Q_IDX, KV_IDX), "(q_idx | kv_idx)"),
    (BitXor(Q_IDX, KV_IDX), "(q_idx ^ kv_idx)"),
    (RightShift(Q_IDX, P0_INT), "_rshift(q_idx, p0)"),
    (LeftShift(1, KV_IDX), "_lshift(1, kv_idx)"),
    (Trunc(SCORE * 4), "((4 * score)).to(tl.int64)"),
    (Trunc(sympy.Float(-2.5)), "-2"),
], ids=str)
def test_torch_vocabulary(expr, text):
    assert show(expr) == text


@pytest.mark.parametrize("expr,advice", [
    (sympy.DiracDelta(SCORE), "derivative of sign and Heaviside as 0, as torch does"),
    (sympy.Derivative(sympy.floor(SCORE), SCORE), "score_derivative, which says where"),
], ids=["DiracDelta", "Derivative"])
def test_derivatives_sympy_leaves_are_refused_with_the_reason(expr, advice):
    with pytest.raises(ValueError, match=f"cannot print {type(expr).__name__}.*{advice}"):
        show(expr)


# -- shared subexpressions: statements before the value --------------------------------------
def test_shared_subexpressions_are_named_once():
    x = sympy.Piecewise((SCORE * 2, Q_IDX >= KV_IDX), (SCORE - 1, True))
    assert TritonPrinter().block([sympy.Max(x, 0) + sympy.exp(x)], "_score") == [Printed(
        ("_score0 = tl.where((kv_idx <= q_idx), (2 * score), (-1 + score))",),
        "(tl.maximum(0, _score0) + tl.exp(_score0))")]


def test_names_are_shared_across_the_expressions_of_a_block():
    # the backward prints the score and its derivative in one scope: tanh is computed once
    x = sympy.tanh(SCORE / 30)
    assert TritonPrinter().block([30 * x, 1 - x**2], "_score") == [
        Printed(("_score0 = _tanh((0.03333333333333333 * score))",), "(30 * _score0)"),
        Printed((), "(1 + (-1 * (_score0 * _score0)))")]


def test_single_uses_and_short_repeats_stay_inline():
    # a sliding window prints as it reads; q_idx - kv_idx is short enough to repeat
    window = sympy.And(sympy.GreaterThan(Q_IDX - KV_IDX, 0), sympy.Eq(sympy.Mod(Q_IDX - KV_IDX, 4), 0))
    assert TritonPrinter().block([window], "_mask") == [
        Printed((), "(((q_idx + (-1 * kv_idx)) >= 0) & (_mod((q_idx + (-1 * kv_idx)), 4) == 0))")]
    assert TritonPrinter().block([window], "_mask")[0].value == show(window)


def test_a_load_used_twice_is_loaded_once():
    doc = LoadInt(0, Q_IDX)
    (printed,) = TritonPrinter().block([sympy.And(sympy.Eq(doc - LoadInt(0, KV_IDX), 0), doc >= 1)], "_mask")
    assert printed.statements == ("_mask0 = " + show(doc),)
    assert printed.value.count("tl.load(") == 1 and printed.value.count("_mask0") == 2


def test_nested_where_prints_in_linear_size():
    x = SCORE
    for i in range(20):
        x = sympy.Piecewise((x * 0.9 + i, Q_IDX - KV_IDX >= i), (x - 1, True))
    (printed,) = TritonPrinter().block([x], "_score")
    # 2**20 copies of `score` as a tree; one statement per level here
    assert len(printed.statements) < 45 and sum(map(len, printed.statements)) < 4000


# -- positions inside float expressions -----------------------------------------------------
@pytest.mark.parametrize("expr,text", [
    (SCORE + (KV_IDX - Q_IDX) * P0_FLOAT, "(score + (p0 * (kv_idx_f + (-1.0 * q_idx_f))))"),  # ALiBi
    (SCORE - Q_IDX + 3, "(3 + score + (-1.0 * q_idx_f))"),
    ((Q_IDX - KV_IDX) * 2, "((-2 * kv_idx) + (2 * q_idx))"),  # integer: stays integer
    ((2 * Q_IDX - KV_IDX) * P0_FLOAT, "(p0 * ((-1 * kv_idx) + (2 * q_idx)))"),  # not ±1: converted by Triton
    (SCORE * (KV_IDX - 2**25), "(score * (-33554432 + kv_idx))"),  # beyond float32's exact integers
], ids=str)
def test_positions_in_float_expressions_are_float_vectors(expr, text):
    assert show(expr) == text


# -- logic and branches ---------------------------------------------------------------------
@pytest.mark.parametrize("expr,text", [
    (sympy.Piecewise((SCORE, Q_IDX >= KV_IDX), (0, True)), "tl.where((kv_idx <= q_idx), score, 0)"),
    (sympy.Piecewise((SCORE, Q_IDX > KV_IDX), (2 * SCORE, sympy.Eq(Q_IDX, KV_IDX)), (0, True)),
     "tl.where((kv_idx < q_idx), score, tl.where((kv_idx == q_idx), (2 * score), 0))"),
    (sympy.And(Q_IDX >= KV_IDX, Q_IDX - KV_IDX <= P0_INT), "((q_idx >= kv_idx) & ((q_idx + (-1 * kv_idx)) <= p0))"),
    (sympy.Or(Q_IDX < 3, KV_IDX < 3), "((kv_idx < 3) | (q_idx < 3))"),
    (sympy.Xor(Q_IDX < 3, KV_IDX < 3), "((kv_idx < 3) ^ (q_idx < 3))"),
    (sympy.Not(sympy.And(Q_IDX >= KV_IDX, KV_IDX < 3)), "(~((q_idx >= kv_idx) & (kv_idx < 3)))"),
    (sympy.Ne(Q_IDX, KV_IDX), "(q_idx != kv_idx)"),
], ids=str)
def test_logic(expr, text):
    assert show(expr) == text


def test_piecewise_without_default_is_an_error():
    with pytest.raises(ValueError, match="no default branch.*torch.where"):
        show(sympy.Piecewise((1, Q_IDX > KV_IDX)))


# -- captured-tensor loads ------------------------------------------------------------------
@pytest.mark.parametrize("expr,text", [
    (LoadInt(0, Q_IDX),
     "_widen(tl.load(T0 + (q_idx) * T0_stride0, mask=(((q_idx) >= 0) & ((q_idx) < T0_size0)) != 0, other=0))"),
    (LoadBool(2, KV_IDX),
     "_widen(tl.load(T2 + (kv_idx) * T2_stride0, mask=(((kv_idx) >= 0) & ((kv_idx) < T2_size0)) != 0, other=0))"),
    (LoadFloat(1, H, Q_IDX - KV_IDX),
     "_widen(tl.load(T1 + (off_h) * T1_stride0 + ((q_idx + (-1 * kv_idx))) * T1_stride1, "
     "mask=(((off_h) >= 0) & ((off_h) < T1_size0) & (((q_idx + (-1 * kv_idx))) >= 0) & "
     "(((q_idx + (-1 * kv_idx))) < T1_size1)) != 0, other=0))"),
    (LoadInt(0), "_widen(tl.load(T0))"),
], ids=str)
def test_loads_are_masked_to_the_tensor_and_widened(expr, text):
    # _widen (templates/_prelude.py.jinja): float16/bfloat16 become float32, small integers int32
    assert show(expr) == text


def test_every_indexed_load_has_mask_and_other():
    expr = sympy.Eq(LoadInt(0, B, Q_IDX), LoadInt(0, B, KV_IDX + 1))
    text = show(expr)
    assert text.count("tl.load(") == 2
    assert text.count("mask=") == 2 and text.count("other=0)") == 2


def test_tensor_args():
    assert tensor_args(0, 1) == ["T0", "T0_stride0", "T0_size0"]
    assert tensor_args(3, 2) == ["T3", "T3_stride0", "T3_stride1", "T3_size0", "T3_size1"]
    assert tensor_args(1, 0) == ["T1"]


# -- what the printer does not know ---------------------------------------------------------
@pytest.mark.parametrize("expr,name", [
    pytest.param(sympy.Function("mystery")(Q_IDX), "mystery"),
    pytest.param(sympy.asin(SCORE), "asin"),
    pytest.param(sympy.zoo, "ComplexInfinity"),
    pytest.param(sympy.Integral(SCORE, SCORE), "Integral"),
    pytest.param(sympy.I, "ImaginaryUnit"),
], ids=["undefined_function", "asin", "zoo", "Integral", "I"])
def test_unknown_nodes_raise_value_error_naming_them(expr, name):
    with pytest.raises(ValueError, match=f"cannot print {name}"):
        show(expr)


# -- Python's semantics through a real kernel ------------------------------------------------
@pytest.fixture
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKC_CACHE_DIR", str(tmp_path / "kernels"))


def _qkv(Lq, Lkv, D=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 1, Lq, D, generator=g), torch.randn(1, 1, Lkv, D, generator=g), \
        torch.randn(1, 1, Lkv, D, generator=g)


def test_negative_floor_division_and_modulo_in_a_kernel(_cache_dir):
    def negatives(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) // 3 == -1) | ((q_idx - kv_idx) % 5 == 2)

    mask = maskc.mask_mod(negatives)
    kernel = maskc.compile(mask, dtype=torch.float32, head_dim=16, device="cpu")
    assert "_floordiv((q_idx + (-1 * kv_idx)), 3)" in kernel.source
    assert "_mod((q_idx + (-1 * kv_idx)), 5)" in kernel.source
    # with C's truncation, d // 3 == -1 would hold for d in -5..-3 instead of -3..-1,
    # and d % 5 == 2 would miss d = -3, -8, ...
    q, k, v = _qkv(45, 60)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, mask_mod=mask)
    assert_close_to_reference(out, ref)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))


def test_negative_divisors_and_runtime_divisors_in_a_kernel(_cache_dir):
    divisor = 4  # captured: a runtime parameter, so the helpers must handle any sign

    def mixed(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d % -6 == -1) | (d // divisor == -3) | (d % divisor == 3) & (kv_idx % 7 == 1)

    q, k, v = _qkv(50, 41)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mixed, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, mask_mod=mixed)
    assert_close_to_reference(out, ref)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
