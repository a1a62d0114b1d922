"""Tracing: what is recorded, what becomes a parameter, and how untraceable code is reported."""
import os

import pytest
import sympy
import torch

import maskc
from maskc import MaskTraceError, masks, scores
from maskc.analysis.dense import evaluate, symbols_env
from maskc.testing import dense_mask
from maskc.trace import as_mask_mod, as_score_mod
from maskc.trace.symbols import LoadFloat, LoadInt

FILE = os.path.basename(__file__)
WINDOW = 64  # a module-level global read by a mask: a runtime parameter like a closure cell
SCALE = 0.5
TABLE_2D = torch.zeros(4, 16, dtype=torch.int64)


# -- untraceable code: every message names the function, file:line and the fix ------------
def uses_if(b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:
        return q_idx >= kv_idx
    return q_idx < kv_idx


def uses_and(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) and (q_idx - kv_idx < 8)


def uses_or(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) or (kv_idx < 8)


def uses_not(b, h, q_idx, kv_idx):
    return not (q_idx < kv_idx)


def uses_bool(b, h, q_idx, kv_idx):
    return bool(q_idx >= kv_idx)


def uses_int(b, h, q_idx, kv_idx):
    return int(q_idx) >= kv_idx


def uses_range(b, h, q_idx, kv_idx):
    return kv_idx <= len(range(q_idx))


def uses_builtin_min(b, h, q_idx, kv_idx):
    return min(q_idx, 100) >= kv_idx


def uses_builtin_max(b, h, q_idx, kv_idx):
    return max(q_idx, kv_idx) <= 100


def uses_float(b, h, q_idx, kv_idx):
    return float(q_idx) >= kv_idx


def uses_cumsum(b, h, q_idx, kv_idx):
    return torch.cumsum(q_idx, 0) >= 0


def returns_number(b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def slices_table(b, h, q_idx, kv_idx):
    return TABLE_2D[h, :] == kv_idx


def indexes_with_too_few(b, h, q_idx, kv_idx):
    return TABLE_2D[q_idx] == kv_idx


def ands_floats(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx * 0.5)


def inverts_float(b, h, q_idx, kv_idx):
    return ~(q_idx * 0.5) >= 0


def combines_string(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx + "1"


def reduces_with_max(b, h, q_idx, kv_idx):
    return torch.max(q_idx - kv_idx, 0).values >= 0


def score_returns_bool(score, b, h, q_idx, kv_idx):
    return score >= 0


def score_uses_cumsum(score, b, h, q_idx, kv_idx):
    return torch.cumsum(score, 0)


def _helper_with_max(q_idx, kv_idx):
    return max(q_idx, kv_idx)


def calls_helper(b, h, q_idx, kv_idx):
    return _helper_with_max(q_idx, kv_idx) <= 100


CONTROL_FLOW = "Python control flow"
WHERE_FIX = "use torch.where(cond, a, b), torch.minimum/maximum, or & | ~ instead"
TO_INT = "converts a traced value to a Python int"
INT_FIX = "index a captured torch tensor instead"
UNSUPPORTED_FIX = "use + - * / // % comparisons & | ~ << >> torch.where/minimum/maximum/abs/clamp"

# (function, kind, line of the offence relative to the def, what, fix)
UNTRACEABLE = [
    (uses_if, "mask_mod", 1, CONTROL_FLOW, WHERE_FIX),
    (uses_and, "mask_mod", 1, CONTROL_FLOW, WHERE_FIX),
    (uses_or, "mask_mod", 1, CONTROL_FLOW, WHERE_FIX),
    (uses_not, "mask_mod", 1, CONTROL_FLOW, WHERE_FIX),
    (uses_bool, "mask_mod", 1, CONTROL_FLOW, WHERE_FIX),
    (uses_builtin_min, "mask_mod", 1, "builtin min/max", "torch.minimum/maximum"),
    (uses_builtin_max, "mask_mod", 1, "builtin min/max", "torch.minimum/maximum"),
    (uses_int, "mask_mod", 1, TO_INT, INT_FIX),
    (uses_range, "mask_mod", 1, TO_INT, INT_FIX),
    (uses_float, "mask_mod", 1, "converts a traced value to a Python float", "keep the value symbolic"),
    (uses_cumsum, "mask_mod", 1, "calls torch.cumsum, which maskc cannot trace", UNSUPPORTED_FIX),
    (slices_table, "mask_mod", 1, "slices a captured tensor with ':', '...' or None",
     "index it with one traced value or integer per dimension"),
    (indexes_with_too_few, "mask_mod", 1, "indexes a captured tensor of 2 dimensions with 1 indices",
     "give one index per dimension"),
    (reduces_with_max, "mask_mod", 1, "reduces a traced value with torch.max or torch.min", "use torch.maximum(a, b)"),
    (ands_floats, "mask_mod", 1, "applies '&' to a floating-point value", "convert with .long() first"),
    (inverts_float, "mask_mod", 1, "applies '~' to a floating-point value", "convert with .long() first"),
    (combines_string, "mask_mod", 1, "combines a traced value with an object of type str",
     "use Python numbers, captured tensors indexed by traced values"),
    # the result is checked after the function returns: the message points at its def line
    (returns_number, "mask_mod", 0, "returns the non-boolean value -kv_idx + q_idx", "return a comparison"),
    (score_returns_bool, "score_mod", 0, "returns the boolean value score >= 0", "to mask, write a mask_mod"),
    (score_uses_cumsum, "score_mod", 1, "calls torch.cumsum, which maskc cannot trace",
     "compute the value outside the mod and capture it in a tensor"),
]


def _trace_error(fn, kind) -> str:
    decorate = maskc.mask_mod if kind == "mask_mod" else maskc.score_mod
    with pytest.raises(MaskTraceError) as info:
        decorate(fn)
    return str(info.value)


@pytest.mark.parametrize("fn, kind, offset, what, fix", UNTRACEABLE, ids=[c[0].__name__ for c in UNTRACEABLE])
def test_untraceable_code_is_reported(fn, kind, offset, what, fix):
    message = _trace_error(fn, kind)
    assert message.startswith(f"{kind} '{fn.__name__}' ")
    assert f" at {FILE}:{fn.__code__.co_firstlineno + offset} " in message
    assert what in message
    assert fix in message


def test_error_in_a_helper_points_at_the_helper():
    message = _trace_error(calls_helper, "mask_mod")
    assert message.startswith("mask_mod 'calls_helper' ")
    assert f"{FILE}:{_helper_with_max.__code__.co_firstlineno + 1}" in message


def test_lambda_is_named():
    message = _trace_error(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx if q_idx else q_idx, "mask_mod")
    assert message.startswith("mask_mod '<lambda>' ")


def test_trace_error_is_a_type_error_and_a_maskc_error():
    with pytest.raises(TypeError):
        maskc.mask_mod(uses_if)
    with pytest.raises(maskc.MaskcError):
        maskc.mask_mod(uses_if)


def test_failed_trace_leaves_no_state_behind():
    with pytest.raises(MaskTraceError):
        maskc.mask_mod(uses_bool)
    assert maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).signature == masks.causal.signature


@pytest.mark.parametrize("kind, fn, expected", [
    ("mask_mod", lambda b, h, q_idx: q_idx >= 0, "must take 4 positional arguments (b, h, q_idx, kv_idx)"),
    ("mask_mod", lambda score, b, h, q_idx, kv_idx: q_idx >= 0, "must take 4 positional arguments"),
    ("score_mod", lambda b, h, q_idx, kv_idx: q_idx, "must take 5 positional arguments (score, b, h, q_idx, kv_idx)"),
])
def test_wrong_number_of_arguments(kind, fn, expected):
    message = _trace_error(fn, kind)
    assert expected in message
    assert f"{FILE}:{fn.__code__.co_firstlineno}" in message
    assert "define it as def <lambda>(" in message


def test_not_a_function():
    with pytest.raises(TypeError, match="mask_mod must be a Python function or lambda, got int"):
        maskc.mask_mod(42)


def test_mods_of_the_other_kind_are_refused():
    with pytest.raises(TypeError, match="expected a mask_mod, got a score_mod 'softcap_30'; pass it as score_mod="):
        as_mask_mod(scores.softcap(30))
    with pytest.raises(TypeError, match="expected a score_mod, got a mask_mod 'causal'"):
        as_score_mod(masks.causal)


# -- parameters and constants ---------------------------------------------------------------
def _values(mod):
    return [p.value for p in mod.traced.params]


def test_captured_numbers_are_parameters():
    a, b = masks.sliding_window(512), masks.sliding_window(1024)
    assert a.signature == b.signature
    assert a.traced.digest == b.traced.digest
    assert (_values(a), _values(b)) == ([512], [1024])
    assert a.traced.params[0].origin == "window"
    assert a.traced.params[0].symbol.is_integer


def test_module_globals_are_parameters():
    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= WINDOW) & (q_idx * SCALE >= kv_idx * SCALE)

    mm = maskc.mask_mod(near)
    assert [(p.origin, p.value) for p in mm.traced.params] == [("WINDOW", 64), ("SCALE", 0.5)]
    assert mm.traced.params[0].symbol.is_integer and not mm.traced.params[1].symbol.is_integer


def test_literals_are_constants():
    five = maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 5)
    six = maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 6)
    assert five.signature != six.signature
    assert five.traced.params == () == six.traced.params


def test_parameter_names_do_not_matter():
    def make(width):
        return maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= width)

    def make_other(span, cancelled=3):
        # `cancelled` is captured but drops out of the expression: it is not a parameter
        return maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx + cancelled - cancelled <= span)

    assert make(3).signature == make_other(9).signature
    assert _values(make_other(9)) == [9]


def test_flags_stay_constants():
    plain, causal = (masks.document(torch.zeros(8, dtype=torch.long), causal=c) for c in (False, True))
    assert plain.signature != causal.signature
    assert plain.traced.params == () == causal.traced.params


def test_captured_bools_choose_structure():
    def make(flag):
        def flagged(b, h, q_idx, kv_idx):
            if flag:  # a Python bool, not a traced value: allowed
                return q_idx >= kv_idx
            return q_idx <= kv_idx

        return maskc.mask_mod(flagged)

    assert make(True).signature == masks.causal.signature
    assert make(False).signature != masks.causal.signature
    assert make(True).traced.params == ()


def test_composition_retraces_inner_parameters():
    a = masks.and_masks(masks.sliding_window(5), masks.prefix_lm(3))
    b = masks.and_masks(masks.sliding_window(9), masks.prefix_lm(1))
    assert a.signature == b.signature
    assert [(p.origin, p.value) for p in a.traced.params] == [("mods[0].window", 5), ("mods[1].prefix", 3)]
    assert _values(b) == [9, 1]
    nested = masks.or_masks(masks.not_mask(masks.sliding_window(7)), masks.causal)
    assert _values(nested) == [7]


def test_captured_tensors_are_recorded_not_hashed():
    ids = torch.tensor([0, 0, 1, 1])
    mm = masks.document(ids)
    assert len(mm.traced.tensors) == 1 and mm.traced.tensors[0] is ids  # one slot for q and kv
    assert mm.expr.atoms(LoadInt)
    kv_ids = torch.tensor([0, 1, 1, 1])
    assert len(masks.document(ids, kv_doc_ids=kv_ids).traced.tensors) == 2
    assert masks.document(torch.tensor([5, 5, 5, 5])).signature == mm.signature


def test_score_mod_tensors_and_parameters():
    slopes = scores.alibi_slopes(4)
    alibi = scores.alibi(slopes)
    assert alibi.traced.tensors[0] is slopes and alibi.expr.atoms(LoadFloat)
    assert scores.softcap(30).signature == scores.softcap(50).signature
    assert _values(scores.softcap(30)) == [30.0]


def test_zero_dim_tensor_is_a_captured_tensor():
    limit = torch.tensor(7)
    mm = maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= limit)
    assert mm.traced.tensors == (limit,) and mm.traced.params == ()


def test_plain_functions_are_traced_once():
    def plain(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    assert as_mask_mod(plain) is as_mask_mod(plain)
    assert as_mask_mod(plain).signature == masks.causal.signature


def test_mask_mod_stays_callable():
    assert masks.causal(0, 0, 3, 2) is True
    assert repr(masks.causal) == "MaskMod(causal: -kv_idx + q_idx >= 0)"


# -- operations that trace, checked against the eager function ------------------------------
IDS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8])

TRACEABLE = [
    # a comparison of a number-valued where becomes comparisons in its branches
    (lambda b, h, q_idx, kv_idx: torch.where(q_idx > 5, q_idx - kv_idx, kv_idx - q_idx) <= 2, sympy.Or),
    (lambda b, h, q_idx, kv_idx: torch.where(h == 1, q_idx >= kv_idx, q_idx < kv_idx), sympy.Xor),
    (lambda b, h, q_idx, kv_idx: torch.minimum(q_idx, kv_idx) >= 3, sympy.Min),
    (lambda b, h, q_idx, kv_idx: torch.maximum(q_idx, kv_idx + b) <= 6, sympy.Max),
    (lambda b, h, q_idx, kv_idx: torch.abs(q_idx - kv_idx) <= 2, sympy.Abs),
    (lambda b, h, q_idx, kv_idx: abs(q_idx - kv_idx) >= 2, sympy.Abs),
    (lambda b, h, q_idx, kv_idx: torch.clamp(q_idx - kv_idx, 0, 3) == 3, sympy.Min),
    (lambda b, h, q_idx, kv_idx: (q_idx - 7) // 3 == (kv_idx - 7) // 3, sympy.floor),
    (lambda b, h, q_idx, kv_idx: (kv_idx - q_idx) % 3 == 1, sympy.Mod),
    (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) ^ (kv_idx < 4), sympy.Xor),
    (lambda b, h, q_idx, kv_idx: ((q_idx >= kv_idx) * 2 + (kv_idx < 3)) >= 2, sympy.GreaterThan),
    (lambda b, h, q_idx, kv_idx: IDS[q_idx] - IDS[kv_idx] >= -1, LoadInt),
    (lambda b, h, q_idx, kv_idx: torch.logical_and(q_idx >= kv_idx, torch.logical_not(kv_idx == 2)), sympy.And),
    (lambda b, h, q_idx, kv_idx: q_idx / 2 > kv_idx - h, sympy.GreaterThan),  # cleared to integers: q - 2kv + 2h - 1 >= 0
]


@pytest.mark.parametrize("fn, node", TRACEABLE, ids=range(len(TRACEABLE)))
def test_operations_trace_to_what_torch_computes(fn, node):
    mm = maskc.mask_mod(fn)
    assert mm.expr.atoms(node) or isinstance(mm.expr, node)
    B, H, n = 2, 2, len(IDS)
    ar = torch.arange
    env = symbols_env(ar(B).view(-1, 1, 1, 1), ar(H).view(1, -1, 1, 1), ar(n).view(1, 1, -1, 1),
                      ar(n).view(1, 1, 1, -1))
    traced = evaluate(mm.expr, env, mm.traced.tensors, mm.traced.param_values()).expand(B, H, n, n)
    assert torch.equal(traced, dense_mask(mm, n, n, B, H))


@pytest.mark.parametrize("fn", [
    scores.softcap(20).fn,
    scores.alibi(scores.alibi_slopes(2)).fn,
    scores.relative_bias(torch.randn(2, 23)).fn,
    lambda score, b, h, q_idx, kv_idx: torch.exp(score / 4) + torch.log(torch.abs(score) + 1),
    lambda score, b, h, q_idx, kv_idx: torch.sigmoid(score) * torch.sqrt(torch.abs(score)) - (q_idx - kv_idx) / 8,
    lambda score, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, score * 0.5 - h),
], ids=["softcap", "alibi", "relative_bias", "exp_log", "sigmoid_sqrt", "where"])
def test_score_mods_trace_to_what_torch_computes(fn):
    sm = maskc.score_mod(fn)
    B, H, n = 1, 2, 12
    ar = torch.arange
    b, h, q, kv = ar(B).view(-1, 1, 1, 1), ar(H).view(1, -1, 1, 1), ar(n).view(1, 1, -1, 1), ar(n).view(1, 1, 1, -1)
    score = torch.randn(B, H, n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 10
    traced = evaluate(sm.expr, symbols_env(b, h, q, kv, score), sm.traced.tensors, sm.traced.param_values())
    torch.testing.assert_close(traced.double().expand(B, H, n, n), fn(score, b, h, q, kv).double().expand(B, H, n, n))
