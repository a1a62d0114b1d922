"""Score mods split as coefficient·score + row(q_idx) + column(kv_idx) (maskc/codegen/separable.py).

The kernels' results for these are checked against float64 in test_attention.py (ALiBi, the
hypothesis strategy's affine score mods, a column of -inf); here: which expressions split,
into what, and that the split adds up to the original expression.
"""
import pytest
import sympy

from maskc.codegen.separable import Q_LO, separate
from maskc.trace.symbols import B, H, KV_IDX, Q_IDX, SCORE, LoadFloat, param_symbol

SLOPE = LoadFloat(0, H)
TABLE_KV = LoadFloat(1, KV_IDX)
P0 = param_symbol(0, False)


@pytest.mark.parametrize("expr", [
    SCORE + SLOPE * (KV_IDX - Q_IDX),  # ALiBi
    2 * SCORE + Q_IDX / 10 - TABLE_KV,
    P0 * SCORE + LoadFloat(2, B, H),
    SCORE + sympy.Piecewise((0, KV_IDX >= 40), (-sympy.oo, True)),
    SCORE,
    SCORE + 2 ** (-4 * (H + 1)) * (KV_IDX - Q_IDX),  # ALiBi's slopes from torch.exp2
    SCORE * P0 * SLOPE - TABLE_KV,
], ids=str)
def test_split_adds_up_to_the_expression(expr):
    split = separate(expr)
    assert split is not None
    assert {Q_IDX, KV_IDX, SCORE}.isdisjoint(split.coefficient.free_symbols)
    assert KV_IDX not in split.row.free_symbols and SCORE not in split.row.free_symbols
    assert Q_IDX not in split.column.free_symbols and SCORE not in split.column.free_symbols
    assert sympy.simplify(split.coefficient * SCORE + split.row + split.column - expr) == 0


def test_alibi_is_centred_on_the_first_row_of_the_tile():
    # slope * (kv_idx - q_lo): an exact integer difference, small near the diagonal
    split = separate(SCORE + SLOPE * (KV_IDX - Q_IDX))
    assert split.coefficient == 1
    assert split.column == SLOPE * (KV_IDX - Q_LO)
    assert split.row == SLOPE * (Q_LO - Q_IDX)


@pytest.mark.parametrize("column", [
    sympy.exp(KV_IDX / 64 - P0 / 64),  # expanded, exp(kv/64) * exp(-p0/64) is inf * 0 in float32
    2e-9 * KV_IDX * (KV_IDX - 1),  # expanded, kv**2 prints as an int32 product that wraps
], ids=str)
def test_terms_are_kept_as_written(column):
    split = separate(SCORE + column)
    assert split.column == column and split.row == 0


def test_only_linear_columns_are_centred():
    assert separate(SCORE + 0.5 * KV_IDX ** 2).column == 0.5 * KV_IDX ** 2
    infinite_slope = sympy.Piecewise((-sympy.oo, sympy.Eq(H, 0)), (1, True)) * KV_IDX  # -inf * 0 at q_lo
    assert separate(SCORE + infinite_slope).column == infinite_slope


def test_columns_that_are_not_polynomials_are_not_centred():
    split = separate(SCORE - TABLE_KV)
    assert split.column == -TABLE_KV and split.row == 0


@pytest.mark.parametrize("expr", [
    30 * sympy.tanh(SCORE / 30),  # softcap
    SCORE + LoadFloat(0, Q_IDX - KV_IDX + 63),  # relative position table
    SCORE * Q_IDX,
    SCORE + (Q_IDX - KV_IDX) ** 2,
    sympy.Piecewise((SCORE, Q_IDX >= KV_IDX), (-sympy.oo, True)),
    sympy.exp(SCORE),
], ids=str)
def test_what_does_not_split(expr):
    assert separate(expr) is None


def test_shared_subexpressions_are_visited_once():
    # nested torch.where: 2**30 leaves as a tree, which free_symbols or sympy.diff would walk
    x = SCORE
    for i in range(30):
        x = sympy.Piecewise((x * 0.9 + i, Q_IDX - KV_IDX >= i), (x - 1, True))
    assert separate(x) is None
    assert separate(SCORE + x.subs(SCORE, 0)) is None  # mixes q_idx and kv_idx


def test_no_score_mod():
    assert separate(None) is None
