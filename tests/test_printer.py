"""TritonPrinter: exact Triton text for each node, and Python's semantics kept through a real kernel."""
import pytest
import sympy
import torch

import maskc
from maskc.codegen.printer import TritonPrinter, tensor_args
from maskc.testing import assert_close_to_reference, attention_reference
from maskc.trace.symbols import B, H, KV_IDX, Q_IDX, SCORE, LoadBool, LoadFloat, LoadInt, param_symbol

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
     "_mod(tl.load(T0 + (q_idx) * T0_stride0, mask=(((q_idx) >= 0) & ((q_idx) < T0_size0)) != 0, other=0), 4)"),
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
    (LoadInt(0, Q_IDX), "tl.load(T0 + (q_idx) * T0_stride0, mask=(((q_idx) >= 0) & ((q_idx) < T0_size0)) != 0, other=0)"),
    (LoadBool(2, KV_IDX),
     "tl.load(T2 + (kv_idx) * T2_stride0, mask=(((kv_idx) >= 0) & ((kv_idx) < T2_size0)) != 0, other=0)"),
    (LoadFloat(1, H, Q_IDX - KV_IDX),
     "tl.load(T1 + (off_h) * T1_stride0 + ((q_idx + (-1 * kv_idx))) * T1_stride1, "
     "mask=(((off_h) >= 0) & ((off_h) < T1_size0) & (((q_idx + (-1 * kv_idx))) >= 0) & "
     "(((q_idx + (-1 * kv_idx))) < T1_size1)) != 0, other=0)"),
    (LoadInt(0), "tl.load(T0)"),
], ids=str)
def test_loads_are_masked_to_the_tensor(expr, text):
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
    pytest.param(sympy.sin(SCORE), "sin"),
    pytest.param(sympy.zoo, "ComplexInfinity"),
    pytest.param(sympy.Integral(SCORE, SCORE), "Integral"),
    pytest.param(sympy.I, "ImaginaryUnit"),
], ids=["undefined_function", "sin", "zoo", "Integral", "I"])
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
