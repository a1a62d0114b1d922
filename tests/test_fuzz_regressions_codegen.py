"""Regressions from the grammar fuzzer (/tmp/hunt_fuzz/REPORT.md) in the printer and renderer:
each mod here gave a wrong answer or crashed inside Triton before its fix. Every kernel runs
through Triton's interpreter and is compared with the float64 reference (maskc.testing)."""
import pytest
import sympy
import torch

import maskc
from _inputs import qkv
from maskc.codegen.printer import TritonPrinter
from maskc.codegen.render import render
from maskc.codegen.source import KernelSource, fuses_multiply_add
from maskc.runtime.kernel import kernel_for
from maskc.testing import assert_close_to_reference, attention_reference, dense_mask
from maskc.trace.mods import as_mask_mod, as_score_mod
from maskc.trace.symbols import B, H, KV_IDX, Q_IDX, SCORE, LoadFloat, param_symbol

P0_INT = param_symbol(0, True)
P0_FLOAT = param_symbol(0, False)


def show(expr) -> str:
    return TritonPrinter().doprint(expr)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKC_CACHE_DIR", str(tmp_path / "kernels"))


def _check(q, k, v, mask_mod=None, score_mod=None):
    """maskc's output and LSE equal the float64 reference's; its empty rows are the same rows."""
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, return_lse=True)
    ref, ref_lse = attention_reference(q.detach(), k.detach(), v.detach(), mask_mod=mask_mod, score_mod=score_mod)
    assert_close_to_reference(out.detach(), ref)
    assert torch.equal(torch.isneginf(lse.detach()), torch.isneginf(ref_lse))
    if q.requires_grad:
        out.sum().backward()  # the backward kernels print the same expressions
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# -- R2: a true division by an index expression is one correctly rounded float32 division ------
def ratio(b, h, q_idx, kv_idx):
    return kv_idx / (q_idx + 1) >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Lq", [100, 64], ids=["forward", "decoding"])
def test_division_by_an_index_keeps_the_pairs_torch_keeps(dtype, Lq):
    # torch: kv / (q + 1) is exactly 1.0 at kv = q + 1. kv * (1.0 / (q + 1)), two roundings, is
    # 0.99999994 at q + 1 = 41, 47, 55, 61, 82, ..., and that pair was dropped; float64 inputs
    # too, since index arithmetic is float32 in torch whatever q's dtype.
    L = 100
    q, k = torch.zeros(1, 1, Lq, 16, dtype=dtype), torch.zeros(1, 1, L, 16, dtype=dtype)
    v = torch.randn(1, 1, L, 16, dtype=dtype)
    _, lse = maskc.compiled_attention(q, k, v, mask_mod=maskc.mask_mod(ratio), return_lse=True)
    kept = lse.exp().round().long()[0, 0]  # q = k = 0: every kept score is 0, so exp(lse) counts them
    assert torch.equal(kept, dense_mask(ratio, Lq, L).sum(-1)[0, 0])


# a captured float table over itself: w[i] / w[i] is 1.0 in torch; w[q] * (1.0 / w[kv]), two
# roundings, was 0.99999994 at rows 16, 28, 33, ... (found by review, not by the fuzzer)
RATES = (torch.arange(100, dtype=torch.float32) + 1.0) * 0.1
RATES64 = RATES.double()
# torch's `3 / x` is x.reciprocal() * 3, two roundings: its value where one division is larger
THIRDS = torch.full((100,), 3.0) / (torch.arange(100) + 1)


def table_ratio(b, h, q_idx, kv_idx):
    return RATES[q_idx] / RATES[kv_idx] >= 1


def table_ratio_float64(b, h, q_idx, kv_idx):
    return RATES64[q_idx] / RATES64[kv_idx] >= 1


def number_over_an_index(b, h, q_idx, kv_idx):
    return 3 / (kv_idx + 1) >= THIRDS[q_idx]


@pytest.mark.parametrize("fn", [table_ratio, table_ratio_float64, number_over_an_index])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("Lq", [100, 64], ids=["forward", "decoding"])
def test_a_division_rounds_as_torch_divides(fn, dtype, Lq):
    L = 100
    q, k = torch.zeros(1, 1, Lq, 16, dtype=dtype), torch.zeros(1, 1, L, 16, dtype=dtype)
    v = torch.randn(1, 1, L, 16, dtype=dtype)
    _, lse = maskc.compiled_attention(q, k, v, mask_mod=maskc.mask_mod(fn), return_lse=True)
    kept = lse.exp().round().long()[0, 0]
    assert torch.equal(kept, dense_mask(fn, Lq, L).sum(-1)[0, 0])


def test_number_over_an_index_has_a_pair_where_one_rounding_differs():
    # the mask above tests nothing unless torch's two roundings differ from one somewhere
    assert not torch.equal(3 / (torch.arange(100) + 1), THIRDS)


def product_over_a_table(b, h, q_idx, kv_idx):
    return (kv_idx + 1) * THIRDS[q_idx] <= 3  # torch rounds the product, then compares


@pytest.mark.parametrize("mask,fuses", [
    (number_over_an_index, False), (product_over_a_table, False), (table_ratio, False),
    (maskc.masks.causal, True), (maskc.masks.sliding_window(10), True),
    (maskc.masks.document(torch.tensor([0, 0, 1, 1])), True),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_mod_deciding_on_floats_runs_without_fused_multiply_adds(mask, fuses):
    # On a GPU, `-t + rcp * 3 >= 0` fused to fma(rcp, 3, -t) dropped pairs at exact ties that
    # torch keeps (tests/gpu/test_gluon.py, "number over an index"): the interpreter has
    # no FMA, so this checks the decision and the compile option it makes.
    kernel = kernel_for("fwd", as_mask_mod(mask).traced, None, torch.float32, torch.device("cpu"))
    assert kernel.kernel_source.fuse_multiply_add is fuses
    assert kernel.options == ({} if fuses else {"enable_fp_fusion": False})


def test_a_score_mod_computing_floats_still_fuses():
    score = maskc.scores.alibi(maskc.scores.alibi_slopes(4))
    assert fuses_multiply_add(None, as_score_mod(score).traced.expr)
    assert not fuses_multiply_add(None, as_score_mod(where_of_a_float).traced.expr)


def root_distance(score, b, h, q_idx, kv_idx):
    return score - torch.sqrt((q_idx - kv_idx).abs().float())


def root_distance_cut(score, b, h, q_idx, kv_idx):
    return torch.where(torch.sqrt((q_idx - kv_idx).abs().float()) <= 4, score, float("-inf"))


@pytest.mark.parametrize("score,text", [(root_distance, "tl.sqrt("), (root_distance_cut, "_sqrt(")])
def test_a_score_mod_s_root_rounds_as_torch_only_where_it_decides(score, text):
    rendered = render(KernelSource.of("fwd", None, as_score_mod(score).traced, exact=False)).text
    assert text in rendered and ("_sqrt(" in rendered) == (text == "_sqrt(")


def where_of_a_float(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx) * 0.1 + score > 1.0, score, 0.0)


# from the review of the fixes above (each failed before its fix)
CONSTANT = torch.full((64,), 1.7)
SCALE = 3.0  # a captured Python float: torch's SCALE / x is x.reciprocal() * SCALE, as for a literal


def negative_power(b, h, q_idx, kv_idx):
    # torch keeps every pair; the dense settle computed t**-2 by pow (rounded once) beside the
    # kernel's 1 / (t * t), and the block map called every tile EMPTY
    return CONSTANT[kv_idx] ** -2 >= CONSTANT[q_idx] ** -2


SCALE_OVER_RATES = torch.full((100,), SCALE) / RATES  # one rounding, where torch's SCALE / x takes two


def parameter_over_a_table(b, h, q_idx, kv_idx):
    return SCALE / RATES[kv_idx] >= SCALE_OVER_RATES[q_idx]


def parameter_over_an_index(b, h, q_idx, kv_idx):
    return SCALE / (kv_idx + 1) >= THIRDS[q_idx]


HALVES64 = torch.full((64,), 0.5, dtype=torch.float64)
FIVES = torch.full((64,), 5)


def float64_table_beside_a_literal(b, h, q_idx, kv_idx):
    # 0.5 / 5 >= 0.1 in float64, as torch and the kernel read the literal; the dense settle read
    # it in float32 (0.10000000149) and called every tile EMPTY (pre-existing, found by review)
    return HALVES64[q_idx] / FIVES[kv_idx] >= 0.1


@pytest.mark.parametrize("fn", [negative_power, parameter_over_a_table, parameter_over_an_index,
                                float64_table_beside_a_literal])
def test_reviewed_divisions_keep_the_pairs_torch_keeps(fn):
    L = 64
    q, k = torch.zeros(1, 1, L, 16), torch.zeros(1, 1, L, 16)
    v = torch.randn(1, 1, L, 16)
    _, lse = maskc.compiled_attention(q, k, v, mask_mod=maskc.mask_mod(fn), return_lse=True)
    kept = torch.where(lse.isneginf(), 0, lse.exp()).round().long()[0, 0]
    assert torch.equal(kept, dense_mask(fn, L, L).sum(-1)[0, 0])
    bm = maskc.block_map(fn, L, L, block_size=(16, 16)).to_dense()[0, 0]
    tiles = dense_mask(fn, L, L)[0, 0].reshape(4, 16, 4, 16)
    assert not (tiles.any(3).any(1) & (bm == 0)).any() and (tiles.all(3).all(1) | (bm != 2)).all()


def test_a_division_by_an_index_prints_as_one_division():
    # index arithmetic: torch's float32 true division, correctly rounded (a GPU's `/` is not)
    assert show(KV_IDX / (Q_IDX + 1)) == "tl.math.div_rn(kv_idx_f, 1.0 + q_idx_f)"
    assert show(1 / (Q_IDX + 1)) == "tl.math.div_rn(1.0, 1.0 + q_idx_f)"
    assert show(2 * KV_IDX / (Q_IDX + 1)) == "tl.math.div_rn(2 * kv_idx_f, 1.0 + q_idx_f)"
    assert show(KV_IDX / P0_FLOAT) == "tl.math.div_rn(kv_idx_f, p0)"
    # a number over a tensor as torch computes it: the reciprocal, times the number
    assert show(3 / (Q_IDX + 1)) == "tl.math.div_rn(1.0, 1.0 + q_idx_f) * 3"
    assert show(-3 / (Q_IDX + 1)) == "tl.math.div_rn(1.0, 1.0 + q_idx_f) * -3"
    # roots and reciprocals that can decide a pair are correctly rounded (a GPU's are not)
    assert show(sympy.sqrt(KV_IDX)) == "_sqrt(kv_idx_f)"
    assert show(1 / sympy.sqrt(LoadFloat(0, Q_IDX))) == "_div(1.0, _sqrt(_widen(tl.load(T0 + q_idx * T0_stride0, mask=((q_idx >= 0) & (q_idx < T0_size0)) != 0, other=0))))"
    assert show(sympy.sqrt(SCORE)) == "tl.sqrt(score)"
    # a score's value where nothing decides on floats keeps the GPU's faster forms
    fast = TritonPrinter(decides=False)
    assert fast.doprint(SCORE + sympy.sqrt(KV_IDX)) == "score + tl.sqrt(kv_idx_f)"
    assert fast.doprint(LoadFloat(0, H) / LoadFloat(0, B)).startswith("_widen(tl.load(T0 + off_h")
    assert "_div" not in fast.doprint(LoadFloat(0, H) / LoadFloat(0, B))
    # a captured float element: one division in its dtype
    assert show(LoadFloat(0, Q_IDX) / LoadFloat(0, KV_IDX)) == "_div(_widen(tl.load(T0 + q_idx * T0_stride0, mask=((q_idx >= 0) & (q_idx < T0_size0)) != 0, other=0)), _widen(tl.load(T0 + kv_idx * T0_stride0, mask=((kv_idx >= 0) & (kv_idx < T0_size0)) != 0, other=0)))"
    # a score over an integer: one division in the score's dtype (1.0 / d was float32 beside float64)
    assert show(SCORE / (Q_IDX + 1)) == "score / (1.0 + q_idx_f)"
    assert show(SCORE / (KV_IDX + 1) / (Q_IDX + 1)) == "score / ((1 + kv_idx_f) * (1 + q_idx_f))"
    # as before: a score over a float (softcap's score / cap), and literal divisors
    assert show(SCORE / P0_FLOAT) == "score * (1.0 / p0)"
    assert show(SCORE / 30) == "0.03333333333333333 * score"


def per_position(score, b, h, q_idx, kv_idx):
    return score / (q_idx + 1)


def test_a_score_over_an_index_is_exact_in_float64():
    # score * (1.0 / (1 + q_idx)) took the reciprocal in float32: 2e-9 relative error in float64
    _check(*qkv(1, 2, Lq=70, Lkv=50, dtype=torch.float64), score_mod=maskc.score_mod(per_position))


# -- C2: a scalar condition from a float comparison beside a per-pair one ---------------------
TF = torch.tensor([0.5, 3.0])
TF2 = torch.tensor([[0.5, 1.5], [2.0, 0.0]])
WP = 3


def xor_per_head(b, h, q_idx, kv_idx):
    return (TF[h] <= 2.0) ^ (q_idx >= kv_idx)


def where_of_a_parameter(b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, WP * 0.5, 0.0) > 1.0  # (0.5*p0 - 1 > 0) & (q_idx - kv_idx >= 0)


def half_unequal_to_an_element(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx).int() / 2 != TF2[0, 0]


@pytest.mark.parametrize("fn", [xor_per_head, where_of_a_parameter, half_unequal_to_an_element])
@pytest.mark.parametrize("grad", [True, False], ids=["forward", "decoding"])
def test_a_scalar_float_condition_beside_a_per_pair_one_runs(fn, grad):
    # Triton's interpreter cannot `&`, `|` or `^` a block of booleans with a 0-d one from a float
    # comparison: InterpreterError "ufunc 'bitwise_xor' not supported"
    _check(*qkv(1, 2, Lq=20, Lkv=24, requires_grad=grad), mask_mod=maskc.mask_mod(fn))


def test_a_condition_free_of_positions_is_compared_with_zero_where_it_meets_others():
    scalar = LoadFloat(0, B) <= 2
    assert show(sympy.And(Q_IDX >= KV_IDX, scalar)) == \
        "(q_idx >= kv_idx) & ((_widen(tl.load(T0 + off_b * T0_stride0, mask=((off_b >= 0) & (off_b < T0_size0)) " \
        "!= 0, other=0)) <= 2) != 0)"
    # conditions over positions print as before
    assert show(sympy.And(Q_IDX >= KV_IDX, KV_IDX < 3)) == "(q_idx >= kv_idx) & (kv_idx < 3)"


# -- C3: integer nodes sympy cannot call integers, and rounded floats used as indices -----------
W = 3
T1 = torch.arange(4) * 5
TB = torch.rand(83, generator=torch.Generator().manual_seed(1)) > 0.5
TF3 = torch.randn(4, 9, generator=torch.Generator().manual_seed(2)) * 20
WN = -3


def blockwise_table(b, h, q_idx, kv_idx):
    return T1[(q_idx // W) % 4] > kv_idx


def ceil_index(b, h, q_idx, kv_idx):
    return TB[torch.clamp(torch.ceil(TF3[0, q_idx % 9]).long(), 0, 79)]


def floor_index(b, h, q_idx, kv_idx):
    return TB[torch.floor(TF3[1, kv_idx % 9]).long() % 80] | (q_idx == kv_idx)


def floor_mod_compared(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) // WN) * 4 % 4 == kv_idx


def rounded_quotients(b, h, q_idx, kv_idx):
    # `//`, rounding_mode="trunc" and >> of a rounded float: Triton's // takes no float
    floored = torch.floor(TF3[1, kv_idx % 9]).long()
    truncated = torch.div(torch.ceil(TF3[0, q_idx % 9]).long(), 3, rounding_mode="trunc")
    return (floored // 3 > q_idx % 5 - 3) | (((floored >> 1) ^ q_idx) % 3 == 0) | (truncated == kv_idx % 7 - 3)


@pytest.mark.parametrize("fn", [blockwise_table, ceil_index, floor_index, floor_mod_compared, rounded_quotients])
@pytest.mark.parametrize("dtype,grad", [(torch.float32, True), (torch.float64, True), (torch.float32, False)],
                         ids=["float32", "float64", "decoding"])
def test_integer_nodes_index_and_compare_as_integers(fn, dtype, grad):
    # floor(q_idx / p0) is an integer to torch, but sympy allows p0 = 0: it was printed as a float
    # remainder (a float pointer offset, or tl.floor of an int); ceil(x).long() lost its cast
    _check(*qkv(1, 1, Lq=20, Lkv=24, dtype=dtype, requires_grad=grad), mask_mod=maskc.mask_mod(fn))


@pytest.mark.parametrize("expr,text", [
    (sympy.Mod(sympy.floor(Q_IDX / P0_INT), 4), "_mod(_floordiv(q_idx, p0), 4)"),
    # an integer sum: positions stay integers (were q_idx_f, a float offset)
    (sympy.floor(KV_IDX / P0_INT) - Q_IDX, "-q_idx + _floordiv(kv_idx, p0)"),
    # sympy's Mod(4 x, 4) is 4 Mod(x, 1), which it cannot fold: tl.floor of an int, refused
    (sympy.Mod(4 * sympy.floor((Q_IDX - KV_IDX) / P0_INT), 4), "4 * _mod(_floordiv(q_idx - kv_idx, p0), 1)"),
    (sympy.floor(sympy.Mod(Q_IDX, P0_INT)), "_mod(q_idx, p0)"),
], ids=str)
def test_what_torch_calls_an_integer_prints_as_one(expr, text):
    assert show(expr) == text


def test_a_rounded_float_used_as_an_index_is_converted_to_an_integer():
    rounded = sympy.ceiling(LoadFloat(0, Q_IDX))
    assert "tl.ceil(" in show(rounded) and ".to(tl.int64)" not in show(rounded)  # a float where one is read
    assert ").to(tl.int64) * T1_stride0" in show(LoadFloat(1, sympy.Min(sympy.Max(rounded, 0), 79)))


# -- C4: a score that is not a tile (a constant, a per-head or per-row value) ------------------
TH = torch.tensor([0.25, -1.5])


def minus_infinity(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx < 0, score, float("-inf"))  # q_idx < 0 folds: the score is -inf


def per_head(score, b, h, q_idx, kv_idx):
    return TH[h]  # one value per program of the forward


def per_row(score, b, h, q_idx, kv_idx):
    return q_idx * 0.25


@pytest.mark.parametrize("fn", [minus_infinity, per_head, per_row])
@pytest.mark.parametrize("dtype,grad,Lq", [(torch.float64, False, 65), (torch.float32, False, 65),
                                           (torch.float64, True, 65), (torch.float32, False, 20)],
                         ids=["float64", "float32", "backward", "decoding"])
def test_a_score_without_the_tile_shape_runs(fn, dtype, grad, Lq):
    # a kv length that is a multiple of the tile: the FULL tiles apply no bounds `where`, which
    # had broadcast the score; the row max of a 0-d score failed (axis 1 out of bounds for shape [])
    _check(*qkv(1, 2, Lq=Lq, Lkv=32, dtype=dtype, requires_grad=grad), score_mod=maskc.score_mod(fn))
