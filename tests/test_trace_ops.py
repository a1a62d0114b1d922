"""FlexAttention's own mods trace unchanged: torch functions, tensor methods, bitwise ops,
boolean comparisons, chained indexing, nested torch.where and autograd.Function (issue 11).

Every traced expression is checked against the original function evaluated by torch on an
index grid; what cannot be traced must raise MaskTraceError naming the function and line.
"""
import math
import os

import numpy as np
import pytest
import sympy
import torch
import torch.nn.functional as F

import maskc
from _inputs import qkv
from _work import python_calls
from maskc import MaskTraceError
from maskc.analysis.dense import evaluate, symbols_env
from maskc.codegen.render import score_derivative
from maskc.testing import assert_close_to_reference, attention_reference, dense_mask
from maskc.trace import _context
from maskc.trace.canonical import canonicalize
from maskc.trace.proxy import Proxy
from maskc.trace.symbols import INDEX_SYMBOLS

FILE = os.path.basename(__file__)
N = 12  # query and key length of the value grids
IDS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8])
SEQ_FLAGS = torch.tensor([True, True, False, True, False, False, True, False, True, True, False, True])
SCALE_T = torch.tensor(0.25)
SHIFT_T = torch.tensor(2)
BIAS_3D = torch.randn(2, 2, N, generator=torch.Generator().manual_seed(1))
BIAS_4D = torch.randn(1, 2, 3, N, generator=torch.Generator().manual_seed(2))
TABLE = torch.tensor([[0, 5], [1, 4], [2, 3], [3, 2], [4, 1], [5, 0]])
PERIOD = 3  # a captured int: a runtime parameter
# read at distances q_idx - kv_idx of the 40-token end-to-end inputs, negative ones from the end
KEEP_BY_DISTANCE = torch.rand(79, generator=torch.Generator().manual_seed(3)) > 0.3
BIAS_BY_DISTANCE = torch.randn(79, generator=torch.Generator().manual_seed(4))


# -- comparing a trace with the eager function ----------------------------------------------
def _grid(B, H, n=N):
    ar = torch.arange
    return ar(B).view(-1, 1, 1, 1), ar(H).view(1, -1, 1, 1), ar(n).view(1, 1, -1, 1), ar(n).view(1, 1, 1, -1)


def _traced_values(mod, b, h, q, kv, score=None):
    t = mod.traced
    return evaluate(mod.expr, symbols_env(b, h, q, kv, score), t.tensors, t.param_values())


def assert_mask_traces(fn, B=1, H=2, reference=None):
    """`reference`: the same mask in torch's spelling, where `fn` itself cannot run on index
    tensors (math.floor and round of a tensor)."""
    mm = maskc.mask_mod(fn)
    got = _traced_values(mm, *_grid(B, H)).expand(B, H, N, N)
    want = dense_mask(reference or fn, N, N, B, H)
    wrong = (got != want).nonzero()[:3].tolist()
    assert torch.equal(got.to(torch.bool), want), f"{mm.expr} differs from the function at {wrong}"
    return mm


def assert_score_traces(fn, B=1, H=2, reference=None):
    sm = maskc.score_mod(fn)
    b, h, q, kv = _grid(B, H)
    score = torch.randn(B, H, N, N, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 5
    got = _traced_values(sm, b, h, q, kv, score).double().expand(B, H, N, N)
    want = torch.as_tensor((reference or fn)(score, b, h, q, kv)).double().expand(B, H, N, N)
    # fn may round through float32 (.float(), .half() on small integers): compare at that precision
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{sm.expr}: {m}")
    return sm


def assert_refused(fn, what, fix, kind="mask_mod", offset=1, at=None):
    """`at`: the function holding the offending line, when it is a helper of `fn`."""
    decorate = maskc.mask_mod if kind == "mask_mod" else maskc.score_mod
    with pytest.raises(MaskTraceError) as info:
        decorate(fn)
    message = str(info.value)
    assert message.startswith(f"{kind} '{fn.__name__}' "), message
    assert f" at {FILE}:{(at or fn).__code__.co_firstlineno + offset} " in message, message
    assert what in message, message
    assert fix in message, message
    return message


# -- 1. torch functions are recognised by identity, not by name ----------------------------
def exp(x):
    """Not torch.exp: a user function named exp that dispatches like torch's own functions."""
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(exp, (x,), x)
    return torch.exp(x) * 2


def calls_own_exp(score, b, h, q_idx, kv_idx):
    return exp(score)


def calls_cumsum(score, b, h, q_idx, kv_idx):
    return score.cumsum(0)


def test_a_function_named_like_a_torch_function_is_refused():
    message = assert_refused(calls_own_exp, "calls test_trace_ops.exp, which maskc cannot trace", "torch.where",
                             kind="score_mod", offset=3, at=exp)
    assert "torch.exp" not in message


def test_an_unknown_tensor_method_names_itself():
    assert_refused(calls_cumsum, "calls Tensor.cumsum, which maskc cannot trace", "torch.where", kind="score_mod")


@pytest.mark.parametrize("fn", [
    lambda score, b, h, q_idx, kv_idx: SCALE_T * score,
    lambda score, b, h, q_idx, kv_idx: SCALE_T.mul(score) - SCALE_T / (q_idx + 1),
    lambda score, b, h, q_idx, kv_idx: torch.special.expit(score) + torch.special.erf(score / 4),
    lambda score, b, h, q_idx, kv_idx: F.relu(score) + F.silu(score) - F.sigmoid(score) + F.tanh(score),
    lambda score, b, h, q_idx, kv_idx: F.gelu(score) + F.gelu(score, approximate="tanh"),
    lambda score, b, h, q_idx, kv_idx: F.softplus(score) + F.softplus(score, beta=2, threshold=3),
    lambda s, b, h, q, kv: F.elu(s) + F.elu(s, alpha=0.5) + F.selu(s) + torch.special.erfc(s / 4) + torch.erfc(s / 8),
    lambda s, b, h, q, kv: torch.atan(s) + torch.arctan(s * 3) + s.atan() / 2 + s.arctan() * (q - kv),
    lambda score, b, h, q_idx, kv_idx: torch.exp2(score / 8) + torch.sin(score) * torch.cos(score) + torch.sign(score),
    lambda score, b, h, q_idx, kv_idx: torch.square(score) / 16 - torch.pow(torch.abs(score), 0.5) + torch.erf(score),
    lambda score, b, h, q_idx, kv_idx: torch.sigmoid(score) * torch.full_like(score, 3.0) + torch.ones_like(score),
    lambda score, b, h, q_idx, kv_idx: score + torch.zeros_like(q_idx) + torch.tensor(2.5),
    lambda score, b, h, q_idx, kv_idx: torch.div(q_idx - kv_idx, 3, rounding_mode="trunc") + score,
    lambda score, b, h, q_idx, kv_idx: torch.div(q_idx - kv_idx, 3, rounding_mode="floor") + torch.div(score, 3),
    lambda score, b, h, q_idx, kv_idx: torch.fmod(q_idx - kv_idx, 4) + torch.remainder(q_idx - kv_idx, 4) + score,
    lambda s, b, h, q, kv: torch.clamp(s, min=-2) + torch.clip(s, max=1.5) + torch.maximum(s, q / 4),
    # a 0-d captured tensor is a load with no free symbols, which sympy's Max took for a number
    # it could compare ("LoadFloat(0) is not comparable")
    lambda s, b, h, q, kv: torch.maximum(s, torch.tensor(-0.5)) + torch.minimum(s, SCALE_T) + s.clamp(max=SCALE_T)
    + torch.maximum(s, torch.full_like(s, 0.1).half()),  # a rounded constant is no number sympy can compare
    # torch.min/max of two tensors is elementwise (transformers' T5 decoder bucket writes
    # -torch.min(relative_position, torch.zeros_like(relative_position))); the tracer called
    # itself there and refused every such call as a reduction
    lambda s, b, h, q, kv: s - torch.min(kv - q, torch.zeros_like(q)) + torch.max(s, torch.tensor(-0.5))
    + s.max(torch.zeros_like(s)) - s.min(q / 8),
], ids=["captured_operator", "captured_method", "special", "functional", "gelu", "softplus", "elu_selu_erfc", "atan",
        "exp2_trig_sign", "square_pow_erf", "like", "zeros_like_tensor", "div_trunc", "div_floor", "fmod_remainder",
        "clamp", "maximum_captured_scalar", "min_max_of_two"])
def test_torch_functions_trace_to_what_torch_computes(fn):
    assert_score_traces(fn)


def test_int_over_int_is_true_division():
    assert_score_traces(lambda score, b, h, q_idx, kv_idx: score + (q_idx - kv_idx) / 5 + torch.true_divide(q_idx, 7))


# -- 2. tensor methods on the traced values -------------------------------------------------
@pytest.mark.parametrize("fn", [
    lambda score, b, h, q_idx, kv_idx: score.clamp(min=-2, max=2) + score.clip(-1) + score.clamp(max=0.5),
    lambda score, b, h, q_idx, kv_idx: score.abs().sqrt() + score.sign() - score.neg() + score.square() / 10,
    lambda score, b, h, q_idx, kv_idx: score.exp().log() + score.exp2().log2() + (score / 10).tanh() + score.sigmoid(),
    lambda s, b, h, q, kv: s.sin() + s.cos() + (s.abs() + 1).rsqrt() + (s.abs() + 1).reciprocal(),
    lambda s, b, h, q, kv: s.pow(2) / 10 + (q + 1).pow(0.5) + s.maximum(kv / 3) + s.minimum(q / 5),
    lambda score, b, h, q_idx, kv_idx: score.to(torch.float32) + (score * 4).to(torch.int64) + score.double(),
    lambda score, b, h, q_idx, kv_idx: (score * 3).long() + (score * 2).int() + (q_idx - kv_idx).float() / 4,
    lambda s, b, h, q, kv: s * (s > 0).to(s.dtype) + (q - kv).half() + (q + kv).bfloat16(),
    lambda s, b, h, q, kv: s * (q - kv).bool() + s.to("cpu") + s.to(device="cpu", dtype=torch.float64),
    lambda score, b, h, q_idx, kv_idx: (q_idx > kv_idx).type_as(score) * score + kv_idx.type_as(score) / 4,
    lambda s, b, h, q, kv: s.add(q, alpha=2).sub(kv).mul(0.5).div(4) + s.div(3, rounding_mode="floor"),
    lambda s, b, h, q, kv: (q - kv).div(3, rounding_mode="trunc") + (q - kv).floor_divide(3) + s,
    lambda s, b, h, q, kv: (q - kv).remainder(5) + (q - kv).fmod(5) + s.fmod(2.5) + s.remainder(2.5),
    lambda score, b, h, q_idx, kv_idx: score.where(q_idx >= kv_idx, -score) + score.new_zeros(()) + score.new_ones(()),
    lambda score, b, h, q_idx, kv_idx: score + score.new_full((), 2.5) + score.new_tensor(1.5) + q_idx.new_full((), 7),
], ids=["clamp", "abs_sqrt_sign_neg_square", "exp_log_tanh_sigmoid", "trig_rsqrt_reciprocal", "pow_max_min",
        "to_dtype", "long_int_float", "to_score_dtype_half", "bool_to_device", "type_as", "add_alpha_div",
        "div_rounding", "remainder_fmod", "where_new", "new_full"])
def test_score_methods_trace_to_what_torch_computes(fn):
    assert_score_traces(fn)


def and_masks(*mods):
    """torch.nn.attention.flex_attention.and_masks, as torch writes it."""
    def and_mask(b, h, q_idx, kv_idx):
        result = b.new_ones((), dtype=torch.bool)
        for mod in mods:
            result = result & mod(b, h, q_idx, kv_idx)
        return result

    return and_mask


def or_masks(*mods):
    def or_mask(b, h, q_idx, kv_idx):
        result = b.new_zeros((), dtype=torch.bool)
        for mod in mods:
            result = result | mod(b, h, q_idx, kv_idx)
        return result

    return or_mask


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _near(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 3


@pytest.mark.parametrize("fn", [
    and_masks(_causal, _near),
    or_masks(_causal, _near),
    lambda b, h, q_idx, kv_idx: q_idx.ge(kv_idx).logical_and(q_idx.sub(kv_idx).lt(4)),
    lambda b, h, q_idx, kv_idx: q_idx.eq(kv_idx).logical_or(kv_idx.le(2)).logical_xor(h.ne(0)),
    lambda b, h, q_idx, kv_idx: q_idx.gt(kv_idx).logical_not() & kv_idx.clamp(2, 8).ge(q_idx.clamp(max=6)),
    lambda b, h, q_idx, kv_idx: torch.logical_xor(q_idx > 3, kv_idx > 5) | q_idx.bool().logical_not(),
    lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs().sign() == 0,
    lambda b, h, q_idx, kv_idx: q_idx.to(torch.bool) & kv_idx.bool() & (q_idx.long() % 3 == kv_idx.int() % 3),
    lambda b, h, q_idx, kv_idx: torch.ones_like(q_idx, dtype=torch.bool) & (q_idx >= kv_idx),
    lambda b, h, q_idx, kv_idx: q_idx.new_tensor(4) <= q_idx + kv_idx.new_full((), 1),
], ids=["and_masks", "or_masks", "logical_methods", "eq_or_xor", "not_clamp", "logical_xor_bool", "sign",
        "to_bool", "ones_like_bool", "new_tensor"])
def test_mask_methods_trace_to_what_torch_computes(fn):
    assert_mask_traces(fn)


def calls_item(b, h, q_idx, kv_idx):
    return q_idx.item() >= kv_idx


def reads_shape(b, h, q_idx, kv_idx):
    return q_idx.new_ones((2,), dtype=torch.bool)


def test_item_is_refused():
    assert_refused(calls_item, "calls .item() on a traced value", "keep it a tensor")


def test_a_tensor_of_a_shape_is_refused():
    assert_refused(reads_shape, "creates a tensor of shape (2,)", "one value per (b, h, q_idx, kv_idx)")


# -- 3. integer bitwise operations and shifts ------------------------------------------------
@pytest.mark.parametrize("fn", [
    lambda b, h, q_idx, kv_idx: (q_idx >> 2) == (kv_idx >> 2),
    lambda b, h, q_idx, kv_idx: (q_idx << 1) >= kv_idx + (kv_idx << 2) - 20,
    lambda b, h, q_idx, kv_idx: (q_idx & 3) == (kv_idx & 3),
    lambda b, h, q_idx, kv_idx: ((q_idx ^ kv_idx) & ~3) == 0,
    lambda b, h, q_idx, kv_idx: ((q_idx | kv_idx) & 1) == 1,
    lambda b, h, q_idx, kv_idx: (q_idx ^ kv_idx) < 4,
    lambda b, h, q_idx, kv_idx: ~q_idx + kv_idx <= -1,
    lambda b, h, q_idx, kv_idx: (q_idx >> SHIFT_T) == (kv_idx >> SHIFT_T),
    lambda b, h, q_idx, kv_idx: (1 << (h + 2)) > (q_idx - kv_idx),
    lambda b, h, q_idx, kv_idx: (q_idx >> (h + 1)) <= kv_idx,
    lambda b, h, q_idx, kv_idx: torch.bitwise_and(q_idx, kv_idx) == torch.bitwise_or(q_idx, 0) & kv_idx,
    lambda b, h, q_idx, kv_idx: q_idx.bitwise_xor(kv_idx).bitwise_and(6) == q_idx.bitwise_not().bitwise_and(0),
    lambda b, h, q_idx, kv_idx: q_idx.__lshift__(1) == kv_idx.__rshift__(1) * 2 + (q_idx & -4) - (q_idx & -4),
    lambda b, h, q_idx, kv_idx: ((q_idx >= 4) & (kv_idx % 2)) == 1,
], ids=["rshift", "lshift", "and_low_bits", "morton_block", "or", "xor", "invert", "shift_by_captured",
        "shift_by_traced", "rshift_by_traced", "bitwise_functions", "bitwise_methods", "shift_methods", "bool_and_int"])
def test_bitwise_operations_trace_to_what_torch_computes(fn):
    assert_mask_traces(fn, H=2)


def _morton(x):
    """Interleave the low 3 bits of x with zeros (Morton / Z-order)."""
    x = (x | (x << 2)) & 0x33
    return (x | (x << 1)) & 0x55


def morton_tiles(b, h, q_idx, kv_idx):
    z = _morton(q_idx) | (_morton(kv_idx) << 1)
    return (z >> 4) <= (z & 15)


def test_morton_order_mask():
    assert_mask_traces(morton_tiles)


def shifts_float(score, b, h, q_idx, kv_idx):
    return score << 1


def ands_float(b, h, q_idx, kv_idx):
    return ((q_idx / 2) & 1) == 1


def test_bitwise_on_floats_is_refused():
    assert_refused(shifts_float, "applies '<<' to a floating-point value", "integers", kind="score_mod")
    assert_refused(ands_float, "applies '&' to a floating-point value", "integers")


# -- 4. == and != between booleans ----------------------------------------------------------
@pytest.mark.parametrize("fn", [
    lambda b, h, q_idx, kv_idx: (q_idx < 6) == (kv_idx < 6),
    lambda b, h, q_idx, kv_idx: (q_idx < 6) != (kv_idx < 6),
    lambda b, h, q_idx, kv_idx: SEQ_FLAGS[q_idx] == SEQ_FLAGS[kv_idx],
    lambda b, h, q_idx, kv_idx: (SEQ_FLAGS[q_idx] != SEQ_FLAGS[kv_idx]) | (q_idx == kv_idx),
    lambda b, h, q_idx, kv_idx: ((q_idx >= kv_idx) == True) & ((kv_idx > 3) != False),  # noqa: E712
], ids=["eq", "ne", "captured_bool_eq", "captured_bool_ne", "python_bools"])
def test_booleans_compared_for_equality(fn):
    mm = assert_mask_traces(fn)
    assert not mm.expr.atoms(sympy.Piecewise)


# -- 5. number-valued torch.where compared with something -----------------------------------
@pytest.mark.parametrize("fn", [
    lambda b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, 1, 0) == 1,
    lambda b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, 1.0, 0.0) > 0.5,
    lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx).long() + (kv_idx < 3).int() >= 1,
    lambda b, h, q_idx, kv_idx: torch.where(h == 0, q_idx - kv_idx, kv_idx - q_idx) // 2 <= 1,
    lambda b, h, q_idx, kv_idx: IDS[torch.where(q_idx > 5, q_idx - 6, q_idx)] >= IDS[kv_idx],
    lambda b, h, q_idx, kv_idx: torch.where(q_idx > 4, torch.where(kv_idx > 6, 2, 1), 0) == (q_idx + kv_idx) % 3,
], ids=["where_eq_1", "where_float", "bool_sum", "where_floordiv", "where_index", "nested"])
def test_where_values_compared(fn):
    mm = assert_mask_traces(fn)
    for rel in mm.expr.atoms(sympy.core.relational.Relational):
        assert not rel.atoms(sympy.Piecewise), rel


# -- 6. indexing captured tensors -----------------------------------------------------------
# Chained indexing (TABLE[i][j]) runs per element under FlexAttention's vmap; on the index grids
# of the eager reference it needs torch's one-tuple spelling (TABLE[i, j]).
@pytest.mark.parametrize("fn, reference", [
    (lambda b, h, q_idx, kv_idx: IDS[kv_idx // PERIOD] <= IDS[q_idx % PERIOD], None),
    (lambda b, h, q_idx, kv_idx: IDS[(q_idx + kv_idx) // PERIOD] >= 4, None),
    (lambda b, h, q_idx, kv_idx: TABLE[q_idx // 2][0] >= TABLE[kv_idx // 2][1],
     lambda b, h, q_idx, kv_idx: TABLE[q_idx // 2, 0] >= TABLE[kv_idx // 2, 1]),
    (lambda b, h, q_idx, kv_idx: TABLE[q_idx % 6][kv_idx % 2] >= 2,
     lambda b, h, q_idx, kv_idx: TABLE[q_idx % 6, kv_idx % 2] >= 2),
    (lambda b, h, q_idx, kv_idx: TABLE[q_idx % 6][-1] > kv_idx % 6,
     lambda b, h, q_idx, kv_idx: TABLE[q_idx % 6, -1] > kv_idx % 6),
    (lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= math.floor(PERIOD / 2) + round(PERIOD / 2), None),
    (lambda b, h, q_idx, kv_idx: q_idx.floor_divide(PERIOD) == torch.floor(kv_idx / PERIOD), None),
], ids=["captured_int_divisor", "sum_floordiv", "chained", "chained_mod", "negative_literal", "rounding_captured",
        "torch_floor"])
def test_indexing_captured_tensors(fn, reference):
    assert_mask_traces(fn, reference=reference)


# math.floor, math.ceil, math.trunc and round of a traced value, beside torch's spelling
@pytest.mark.parametrize("fn, reference", [
    (lambda b, h, q_idx, kv_idx: math.floor(q_idx / 4) == math.floor(kv_idx / 4),
     lambda b, h, q_idx, kv_idx: torch.floor(q_idx / 4) == torch.floor(kv_idx / 4)),
    (lambda b, h, q_idx, kv_idx: math.ceil(q_idx / 4) >= math.trunc((kv_idx - 5) / 3),
     lambda b, h, q_idx, kv_idx: torch.ceil(q_idx / 4) >= torch.trunc((kv_idx - 5) / 3)),
    (lambda b, h, q_idx, kv_idx: round(q_idx / 4) == round(kv_idx / 4),
     lambda b, h, q_idx, kv_idx: torch.round(q_idx / 4) == torch.round(kv_idx / 4)),
], ids=["floor", "ceil_trunc", "round_half_even"])
def test_python_rounding_of_traced_values(fn, reference):
    assert_mask_traces(fn, reference=reference)


@pytest.mark.parametrize("fn, reference", [
    (lambda score, b, h, q_idx, kv_idx: score + BIAS_3D[b][h][q_idx],
     lambda score, b, h, q_idx, kv_idx: score + BIAS_3D[b, h, q_idx]),
    (lambda score, b, h, q_idx, kv_idx: score + BIAS_3D[b][h, kv_idx] * BIAS_3D[b, h][q_idx],
     lambda score, b, h, q_idx, kv_idx: score + BIAS_3D[b, h, kv_idx] * BIAS_3D[b, h, q_idx]),
    (lambda score, b, h, q_idx, kv_idx: score + BIAS_4D[b][h][q_idx % 3, kv_idx],
     lambda score, b, h, q_idx, kv_idx: score + BIAS_4D[b, h, q_idx % 3, kv_idx]),
    (lambda score, b, h, q_idx, kv_idx: score + torch.round(score * 2) + score.floor() + score.ceil() + score.trunc()
     + score.frac(), None),
], ids=["bias_chain", "bias_mixed", "bias_4d", "torch_rounding"])
def test_chained_indexing_and_rounding_in_score_mods(fn, reference):
    assert_score_traces(fn, reference=reference)


def test_python_rounding_in_score_mods():
    assert_score_traces(
        lambda s, b, h, q, kv: round(s * 2) + math.floor(s) - math.ceil(s / 3) + math.trunc(s),
        reference=lambda s, b, h, q, kv: torch.round(s * 2) + torch.floor(s) - torch.ceil(s / 3) + torch.trunc(s))


def uses_partial_view(score, b, h, q_idx, kv_idx):
    return score + BIAS_3D[b][h]


def compares_partial_view(b, h, q_idx, kv_idx):
    return BIAS_3D[b] == 0


def slices_after_index(b, h, q_idx, kv_idx):
    return TABLE[q_idx][:] == kv_idx


def test_incomplete_indexing_is_refused():
    assert_refused(uses_partial_view, "indexes a captured tensor of 3 dimensions with 2 indices (1 missing)",
                   "give one index per dimension", kind="score_mod")
    assert_refused(compares_partial_view, "(2 missing)", "give one index per dimension")
    assert_refused(slices_after_index, "slices a captured tensor", "index it with one traced value or integer")


# -- 7. nested torch.where stays polynomial ---------------------------------------------------
# NOTE: the loops run over a captured tuple: a captured int in range() would be a runtime parameter.
def _numeric_nest(depth):
    levels = tuple(range(depth))

    def numeric_nest(b, h, q_idx, kv_idx):
        x = q_idx
        for i in levels:
            x = torch.where(x > i, x - 1, x + 1)
        return x >= kv_idx

    return numeric_nest


def _boolean_nest(depth):
    levels = tuple(range(depth))

    def boolean_nest(b, h, q_idx, kv_idx):
        m = q_idx >= kv_idx
        for i in levels:
            m = torch.where(q_idx % (i + 2) == 0, m, ~m)
        return m

    return boolean_nest


def _general_boolean_nest(depth):
    levels = tuple(range(depth))

    def general_boolean_nest(b, h, q_idx, kv_idx):
        m = q_idx >= kv_idx
        for i in levels:
            m = torch.where(m, q_idx % (i + 2) == 0, kv_idx % (i + 3) != 1)
        return m

    return general_boolean_nest


def _trace_and_canonicalize(fn):
    """Call `fn` with proxies and canonicalize the result: the tracing proper, without what
    tracer.py does with the expression afterwards."""
    _context.begin(_context.TraceState("mask_mod", fn.__name__, FILE, 0))
    try:
        expr = fn(*[Proxy(s) for s in INDEX_SYMBOLS]).expr
    finally:
        _context.end()
    return canonicalize(expr)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", [_numeric_nest, _boolean_nest, _general_boolean_nest])
def test_nested_where_traces_in_polynomial_time(make):
    # twice the depth: twice the calls for the boolean nests, about 6 times for the numeric one
    # (relations split over the branches); walking the tree, 2**10 to 3**10 times
    shallow = python_calls(_trace_and_canonicalize, make(10))
    calls = python_calls(_trace_and_canonicalize, make(20))
    assert calls < 16 * shallow, f"depth 10: {shallow} calls, depth 20: {calls}"
    expr = _trace_and_canonicalize(make(20))
    assert canonicalize(expr) == expr


@pytest.mark.parametrize("make", [_numeric_nest, _boolean_nest, _general_boolean_nest])
def test_nested_where_means_what_the_function_computes(make):
    assert_mask_traces(make(5))


@pytest.mark.timeout(120)
def test_boolean_nest_traces_through_mask_mod_in_linear_time():
    shallow = python_calls(maskc.mask_mod, _boolean_nest(10))
    calls = python_calls(maskc.mask_mod, _boolean_nest(20))
    assert calls < 4 * shallow, f"depth 10: {shallow} calls, depth 20: {calls}"


# -- 8. torch.autograd.Function -----------------------------------------------------------------
class Softcap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cap):
        ctx.save_for_backward(x)
        ctx.cap = cap
        return cap * torch.tanh(x / cap)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (1 - torch.tanh(x / ctx.cap) ** 2), None


class Doubled(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Squared(torch.autograd.Function):
    """A custom backward that is not the derivative (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return x * x

    @staticmethod
    def backward(ctx, grad):
        return grad


class ForwardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + 1


def softcap_function(score, b, h, q_idx, kv_idx):
    return Softcap.apply(score, 20.0)


def doubled_function(score, b, h, q_idx, kv_idx):
    return Doubled.apply(score + q_idx)


def squared_function(score, b, h, q_idx, kv_idx):
    return Squared.apply(score) / 8


def forward_only_function(score, b, h, q_idx, kv_idx):
    return ForwardOnly.apply(score)


@pytest.mark.parametrize("fn", [softcap_function, doubled_function, forward_only_function])
def test_autograd_function_traces_its_forward(fn):
    assert_score_traces(fn)


def test_autograd_function_whose_backward_is_not_the_derivative_gives_that_gradient():
    # torch runs the backward it is given: d(Squared(score) / 8) is 1/8, not score / 4
    sm = assert_score_traces(squared_function)
    assert score_derivative(sm.expr) == sympy.Rational(1, 8)


# -- end to end: generated kernels on CPU (Triton's interpreter) -------------------------------
@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKC_CACHE_DIR", str(tmp_path_factory.mktemp("maskc_cache")))
        yield


def _bias_chain(score, b, h, q_idx, kv_idx):
    return score + BIAS_3D[0][h][kv_idx % N]


def _bias_tuple(score, b, h, q_idx, kv_idx):
    return score + BIAS_3D[0, h, kv_idx % N]  # the eager reference's spelling of _bias_chain


@pytest.mark.parametrize("mask_mod, score_mod, reference_score_mod", [
    (morton_tiles, None, None),
    (lambda b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, 1, 0) == 1, None, None),
    (and_masks(_causal, lambda b, h, q_idx, kv_idx: (q_idx >> 3) == (kv_idx >> 3)), None, None),
    (_causal, lambda score, b, h, q_idx, kv_idx: F.gelu(score) + score.clamp(-1, 1) + (q_idx - kv_idx).float() / 16,
     None),
    (lambda b, h, q_idx, kv_idx: torch.floor(q_idx / 8) >= kv_idx // 8, _bias_chain, _bias_tuple),
    # float literals in index arithmetic that is then rounded or compared: sympy distributes the
    # literal (0.1*q_idx - 0.1*kv_idx), whose float32 value fell on the other side of an integer
    # at every multiple of 10 (error 0.16 before maskc read literals as the rationals they spell)
    (lambda b, h, q_idx, kv_idx: (((q_idx - kv_idx) * 0.1).int() == 0) | ((kv_idx - q_idx) * 0.1 >= 2.0),
     lambda s, b, h, q, kv: s + torch.trunc((q - kv) / 7.0) + torch.floor((q - kv) / 3.0) + torch.ceil(kv / 5.0),
     None),
    (None, lambda s, b, h, q, kv: s + torch.fmod((q - kv).float(), 2.5) + torch.remainder((q - kv).float(), 0.75)
     + torch.round((q - kv) * 0.05) + (kv * 0.1).long() % 3, None),
    # negative indices count from the end, as torch's do (maskc read 0 there: error 1.0)
    (lambda b, h, q_idx, kv_idx: KEEP_BY_DISTANCE[q_idx - kv_idx], lambda s, b, h, q, kv: s + BIAS_BY_DISTANCE[kv - q],
     None),
    # casts to bfloat16 and float16 round (they were dropped: error 4e-3); bfloat16 holds every
    # other integer past 256, so the mask keeps some kv_idx = q_idx + 1
    (lambda b, h, q_idx, kv_idx: (q_idx + 250).bfloat16() >= (kv_idx + 250).bfloat16(),
     lambda s, b, h, q, kv: s.to(torch.bfloat16).to(torch.float32) * 2 + (s * 3).half(), None),
    # refused before though FlexAttention runs them
    (None, lambda s, b, h, q, kv: F.elu(s) + F.selu(s / 2) + torch.special.erfc(s / 4), None),
], ids=["morton", "where_eq", "and_masks_shift", "gelu_clamp", "floor_bias_chain", "float_literal_rounded",
        "float_literal_remainder", "negative_index", "narrow_float_casts", "elu_selu_erfc"])
def test_end_to_end(mask_mod, score_mod, reference_score_mod):
    q, k, v = qkv()
    out = maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
    ref, _ = attention_reference(q, k, v, mask_mod=mask_mod, score_mod=reference_score_mod or score_mod)
    assert_close_to_reference(out, ref)


def _atan_everywhere(score, b, h, q_idx, kv_idx):
    # arguments from 0 through both of the kernel's range reductions (tan(pi/8), tan(3pi/8)) to
    # ±1186 and ±1e4·score; 8· makes an error of float32's size the largest term of the output's
    x = (q_idx - kv_idx).float() ** 3 / 50 + score / 8
    return score + 8 * torch.atan(x) + torch.arctan(score * 1e4) - (score / 1e3).atan() * 100


def test_atan_holds_float32_precision():
    # the kernel's arctangent is a polynomial of its own (Triton has none): the end-to-end
    # tolerance (1e-3 relative) would pass a wrong coefficient, these bounds do not (a coefficient
    # off by 1e-3 moves the output by 3e-4)
    q, k, v = qkv(requires_grad=True)
    out = maskc.compiled_attention(q, k, v, score_mod=_atan_everywhere)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(d_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, score_mod=_atan_everywhere)
    ref.backward(d_out.double())
    assert (out.double() - ref).abs().max() < 1e-5
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert (got.double() - want).abs().max() < 2e-5 * want.abs().max()


_ATAN_KERNEL = '''

@triton.jit
def atan_of(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _atan(tl.load(X + offs)))
'''


def test_the_kernels_atan_is_within_4_ulp_of_float32(tmp_path):
    # the prelude's _atan on its own, through the interpreter: softmax hides an error in the
    # polynomial's high terms from the end-to-end test above (its c9 off by 1e-2 passes there)
    from maskc.codegen.render import LOG2E, _environment
    from maskc.runtime import loader

    prelude = _environment().get_template("_prelude.py.jinja").render(
        helpers=["_atan"], jit="triton.jit", template_name="_prelude.py.jinja", maskc_version="test",
        mask_text="none", score_text="none", log2e=LOG2E)
    path = tmp_path / "atan_of.py"
    path.write_text(prelude + _ATAN_KERNEL)
    module = loader.load(path, interpret=True)
    grid = np.geomspace(1e-8, 1e6, 4000)
    x = np.concatenate([grid, -grid, [0.0, np.inf, -np.inf, 0.41421356, 0.41421357, 2.4142134, 2.4142137]])
    x = torch.from_numpy(np.resize(x, 8192).astype(np.float32))
    y = torch.empty_like(x)
    module.atan_of[(1,)](x, y, N=x.numel())
    want = np.arctan(x.double().numpy())
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert (np.abs(y.double().numpy() - want) <= 4 * ulp).all()
    nan = torch.full((16,), float("nan"))
    module.atan_of[(1,)](nan, y[:16], N=16)
    assert torch.isnan(y[:16]).all()
