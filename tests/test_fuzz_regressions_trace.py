"""Silent wrong answers the grammar fuzzer found in tracing and tile classification.

- R1: sympy 1.14 decides the sign of a reciprocal of positions wrongly
  ((1/2 - 1/(Abs(kv_idx - q_idx) + 1)).is_nonpositive is True), and the trace trusted it: a
  comparison folded to a constant, Max/Min/Abs/sign/floor dropped what they needed.
- R3: a comparison of float values was rearranged (`(q - kv) * FC > 1` as `FC*q - FC*kv - 1 > 0`),
  which rounds otherwise than torch; and tiles were classified FULL/EMPTY from float64 ends with
  no slack for the kernel's float32 rounding.
- C1: Trunc of a number stayed unevaluated, which sympy's Min and Max refused to compare.
"""
import pytest
import sympy
import torch

import maskc
from maskc.analysis.classify import EMPTY, FULL, PARTIAL, classify_grid
from maskc.analysis.dense import evaluate, symbols_env
from maskc.analysis.intervals import Interval, IntervalEvaluator, TensorSummaries
from maskc.testing import assert_block_map_sound, attention_reference, dense_mask
from maskc.trace.symbols import KV_IDX, Q_IDX

L = 40
FC = 0.1  # captured floats: runtime parameters, which the trace cannot read as the rational they spell
FC3 = 0.3


def _assert_traces_as_torch(fn):
    """The traced expression keeps exactly the pairs the function keeps, and the block map is sound."""
    mm = maskc.mask_mod(fn)
    ar = torch.arange
    env = symbols_env(ar(1).view(-1, 1, 1, 1), ar(1).view(1, -1, 1, 1), ar(L).view(1, 1, -1, 1),
                      ar(L).view(1, 1, 1, -1))
    got = evaluate(mm.expr, env, mm.traced.tensors, mm.traced.param_values()).expand(1, 1, L, L)
    want = dense_mask(fn, L, L)
    assert torch.equal(got.to(torch.bool), want), f"traced as {mm.expr}: {int((got != want).sum())} pairs differ"
    for block_size in ((16, 16), (8, 32)):
        assert_block_map_sound(mm, L, L, block_size)


# -- R1: no sign sympy gets wrong is trusted ----------------------------------------------------
RECIPROCAL_MASKS = {
    "r1_far": lambda b, h, q_idx, kv_idx: 1 / (abs(q_idx - kv_idx) + 1) < 0.5,  # was the constant False
    "r1_near": lambda b, h, q_idx, kv_idx: 1 / (abs(q_idx - kv_idx) + 1) > 0.5,  # was the constant True
    "eq": lambda b, h, q_idx, kv_idx: 1 / (abs(q_idx - kv_idx) + 1) == 0.5,
    "sum": lambda b, h, q_idx, kv_idx: 1 / (q_idx + kv_idx + 1) >= 0.5,
    "clamp_min": lambda b, h, q_idx, kv_idx: torch.clamp(1 / (q_idx + kv_idx + 1), min=0.25) > 0.25,
    "clamp_max": lambda b, h, q_idx, kv_idx: torch.clamp(1 / (q_idx + kv_idx + 1), max=1 / 3) < 1 / 3,
    "abs": lambda b, h, q_idx, kv_idx: torch.abs(1 / (q_idx + kv_idx + 1) - 0.5) > 0.2,
    "sign": lambda b, h, q_idx, kv_idx: torch.sign(1 / (q_idx + kv_idx + 1) - 0.5) > 0,
    "floor": lambda b, h, q_idx, kv_idx: torch.floor(1 / (q_idx + kv_idx + 1) - 0.5) >= 0,
    "ceil": lambda b, h, q_idx, kv_idx: torch.ceil(0.5 - 1 / (q_idx + kv_idx + 1)) <= 0,
    "sqrt_of_square": lambda b, h, q_idx, kv_idx: torch.sqrt((1 / (q_idx + kv_idx + 1) - 0.5) ** 2) > 0.2,
}


@pytest.mark.parametrize("name", RECIPROCAL_MASKS)
def test_reciprocal_of_positions_is_not_decided_by_sympy(name):
    _assert_traces_as_torch(RECIPROCAL_MASKS[name])


def test_reciprocal_mask_runs_as_torch():
    # the fuzzer's case end to end: every row was empty (out 0, lse -inf)
    fn = RECIPROCAL_MASKS["r1_far"]
    q, k, v = (torch.randn(1, 1, 32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    out = maskc.compiled_attention(q, k, v, mask_mod=fn)
    ref, _ = attention_reference(q, k, v, mask_mod=fn)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_integer_comparisons_keep_their_canonical_form():
    # the kernel cache's keys: standard masks must trace as before
    assert maskc.masks.causal.traced.expr == sympy.Ge(Q_IDX - KV_IDX, 0)
    assert maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx > kv_idx).traced.expr == sympy.Ge(Q_IDX - KV_IDX - 1, 0)
    assert maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx + 1 > 0).traced.expr is sympy.true


# -- R3: float comparisons round as torch rounds them -------------------------------------------
def _scaled_distance(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).to(torch.float32) * FC > 1.0


def test_captured_float_product_is_not_expanded():
    # 10 * 0.1f is 1.0 in float32; 11 * 0.1f - 1 * 0.1f, the expanded form, is 1.0000001
    expr = maskc.mask_mod(_scaled_distance).traced.expr
    p0 = next(s for s in expr.free_symbols if s.name == "p0")
    assert p0 * (Q_IDX - KV_IDX) in expr.atoms(sympy.Mul), expr


@pytest.mark.parametrize("fn", [
    _scaled_distance,
    # not 1e-8 > 0: in float32 the sum is the product itself, from q_idx = 1 on
    lambda b, h, q_idx, kv_idx: q_idx.float() * FC + 1e-8 > q_idx.float() * FC,
], ids=["scaled_distance", "cancelled"])
def test_float_comparison_keeps_torch_rounding(fn):
    # the kernel, not the float64 dense evaluator, is what computes as torch does
    q = torch.zeros(1, 1, L, 16)  # q = k = 0: exp(lse) counts the keys each row keeps
    k, v = torch.zeros(1, 1, L, 16), torch.randn(1, 1, L, 16)
    _, lse = maskc.compiled_attention(q, k, v, mask_mod=fn, return_lse=True)
    kept = lse.exp().round().long()[0, 0]
    assert torch.equal(kept, dense_mask(fn, L, L).sum(-1)[0, 0])


def test_float_sides_are_not_merged():
    # q/5 + 0.3f*q is exactly 2.0 in float32 at q_idx = 4; moved to one side (-2 + ...) it is not
    def float_eq(b, h, q_idx, kv_idx):
        return (q_idx / 5) + q_idx.float() * FC3 == 2.0

    expr = maskc.mask_mod(float_eq).traced.expr
    p0 = next(s for s in expr.free_symbols if s.name == "p0")
    assert isinstance(expr, sympy.Eq) and set(expr.args) == {sympy.Integer(2), Q_IDX / 5 + p0 * Q_IDX}


def test_float_sides_equal_in_float32_keep_their_pair():
    # the tile classify leaves PARTIAL near the threshold was then settled by the dense
    # evaluator, which computed in float64 and found row 4's pair missing
    _assert_traces_as_torch(lambda b, h, q_idx, kv_idx: (q_idx / 5) + q_idx.float() * FC3 == 2.0)


def test_an_index_sympy_calls_nonnegative_wraps_from_the_end():
    # floor(2 / (q_idx + kv_idx + 1) - 0.5) is -1 from q_idx + kv_idx = 4 on; sympy's sign rule
    # (dag.misleads_sympy) called it nonnegative, and the kernel skipped the wrap of T[-1]
    table = torch.tensor([0.0, 1.0, 0.0, 1.0])

    def from_the_end(b, h, q_idx, kv_idx):
        return table[torch.floor(2 / (q_idx + kv_idx + 1) - 0.5).long()] > 0

    q, k, v = (torch.randn(1, 1, 24, 16, dtype=torch.float64) for _ in range(3))
    out = maskc.compiled_attention(q, k, v, mask_mod=from_the_end)
    ref, _ = attention_reference(q, k, v, mask_mod=from_the_end)
    torch.testing.assert_close(out, ref)


def test_numbers_compare_in_float32():
    # torch.where gives float32 1.0 for 1.00000001: the comparison is false, not 1e-8 > 0
    _assert_traces_as_torch(lambda b, h, q_idx, kv_idx: torch.where(q_idx > kv_idx, 1.00000001, 0.0) > 1.0)


@pytest.mark.parametrize("fn, most_partial", [
    # 3 * 0.3f >= 0.9f in float32, not in float64; only row 3 is near the threshold
    (lambda b, h, q_idx, kv_idx: q_idx.float() * FC3 >= 0.9, 1),
    # equal in exact arithmetic, and in float32 at some rows only: every row is near it
    (lambda b, h, q_idx, kv_idx: q_idx / 5 + q_idx.float() * FC3 == q_idx.float() / 2, 200),
], ids=["threshold", "equal_in_exact_arithmetic"])
def test_float_comparison_within_rounding_is_partial(fn, most_partial):
    # One tile per row: the float64 ends of an interval lie on one side of the threshold where the
    # kernel's float32 value may lie on the other; FULL and EMPTY there were wrong for some rows.
    n = 200
    rows = torch.arange(n).view(1, 1, -1, 1)
    traced = maskc.mask_mod(fn).traced
    evaluator = IntervalEvaluator({Q_IDX: Interval(rows, rows, True, True, frozenset([Q_IDX]))},
                                  traced.param_values(), TensorSummaries((), torch.device("cpu")), torch.device("cpu"))
    cls = classify_grid(traced.expr, evaluator)[0].flatten()
    keeps = dense_mask(fn, n, 1)[0, 0, :, 0]
    assert not (((cls == FULL) & ~keeps) | ((cls == EMPTY) & keeps)).any()
    assert (cls == PARTIAL).sum() <= most_partial  # away from the threshold, still decided


# -- C1: integer operations of numbers are numbers -----------------------------------------------
@pytest.mark.parametrize("fn", [
    lambda b, h, q_idx, kv_idx: torch.minimum(q_idx, torch.where(q_idx > kv_idx, 1.5, 0.0).long()) == 0,
    lambda b, h, q_idx, kv_idx: torch.clamp(torch.where(q_idx > kv_idx, 2.5, -1.5).long(), 0, 1) == 0,
    lambda b, h, q_idx, kv_idx: torch.minimum(q_idx, torch.where(q_idx > kv_idx, 3, 5) & 6) == 2,
    lambda b, h, q, kv: torch.maximum(kv, torch.where(q > kv, 12, 5) >> torch.where(q > 3, 2, 1)) == 3,
], ids=["trunc_in_min", "trunc_in_clamp", "bitand_in_min", "shift_in_max"])
def test_integer_operation_of_a_where_branch(fn):
    _assert_traces_as_torch(fn)


# -- review: the dense settle divides as the kernel does; roots keep decided tiles ---------------
def test_the_dense_settle_divides_once_as_the_kernel_does():
    # kv_idx / (q_idx + 1) is exactly 1.0 at kv_idx = q_idx + 1; as kv_idx * (1 / (q_idx + 1)) it is
    # 0.99999994 at q_idx = 40, and the settle made that tile EMPTY while the kernel kept the pair
    def ratio(b, h, q_idx, kv_idx):
        return (kv_idx / (q_idx + 1) == 1) & (q_idx % 32 == 8)

    for block_size in ((16, 16), (32, 32)):
        assert_block_map_sound(ratio, 64, 64, block_size)


def test_a_root_in_a_float_comparison_leaves_tiles_decided():
    # sqrt had no error bound, so classify decided no tile and each was settled pair by pair (the
    # same map, 0.25 s → 11 s at 32768 tokens)
    def band(b, h, q_idx, kv_idx):
        return abs(q_idx - kv_idx) < torch.sqrt(q_idx * 1.0 + 1) * 4

    n, tile = 32, 128
    starts = torch.arange(n) * tile
    lo_q, lo_kv = starts.view(-1, 1), starts.view(1, -1)
    interval = lambda lo, s: Interval(lo, lo + tile - 1, True, True, frozenset([s]))  # noqa: E731
    traced = maskc.mask_mod(band).traced
    evaluator = IntervalEvaluator({Q_IDX: interval(lo_q, Q_IDX), KV_IDX: interval(lo_kv, KV_IDX)},
                                  traced.param_values(), TensorSummaries((), torch.device("cpu")), torch.device("cpu"))
    cls = classify_grid(traced.expr, evaluator)[0]
    assert (cls != PARTIAL).sum() >= 0.8 * n * n
    assert_block_map_sound(band, 256, 256, (16, 16))


# -- sympy 1.14 squares a Mod factor of a product taken modulo a number (fuzzer seed 4087) ------
def mod_of_a_scaled_mod(b, h, q_idx, kv_idx):
    # Mod(8*Mod(kv, 7), 80) became 8*Mod(Mod(kv, 7)**2, 10): 72 at kv = 3, where torch has 24
    return ((kv_idx % 7) * 8) % 80 == 24


def test_a_mod_of_a_scaled_mod_keeps_torch_s_value():
    expr = maskc.mask_mod(mod_of_a_scaled_mod).traced.expr
    assert not any(isinstance(a, sympy.Pow) for a in sympy.preorder_traversal(expr))
    L = 40
    q, v = torch.zeros(1, 1, L, 16), torch.randn(1, 1, L, 16)
    _, lse = maskc.compiled_attention(q, q, v, mask_mod=maskc.mask_mod(mod_of_a_scaled_mod), return_lse=True)
    kept = torch.where(lse.isneginf(), 0, lse.exp()).round().long()[0, 0]
    assert torch.equal(kept, dense_mask(mod_of_a_scaled_mod, L, L).sum(-1)[0, 0])
    assert_block_map_sound(maskc.mask_mod(mod_of_a_scaled_mod), L, L, (16, 16))


def abs_nest(b, h, q_idx, kv_idx):
    x = q_idx - kv_idx
    for i in range(40):
        x = torch.abs(x - (i % 7))
    return x < 5


def halvings(b, h, q_idx, kv_idx):
    x = q_idx
    for _ in range(30):
        x = torch.floor(x / 2) + kv_idx
    return x >= 5


@pytest.mark.parametrize("nested, node, levels", [(abs_nest, sympy.Abs, 40), (halvings, sympy.floor, 30)],
                         ids=["abs", "floor"])
def test_a_node_nested_in_its_own_kind_is_kept_as_written(nested, node, levels):
    """sympy evaluates Abs by simplifying the signs of its whole argument, and floor by asking the
    assumptions of its whole argument, on every level: a mod nesting abs(x - i) in a loop traced
    in cubic time (9 s at 80 levels), one nesting floor(x / 2) + kv_idx took 44 s at 100 levels to
    reach the recursion refusal. An Abs, floor or ceiling of an argument holding one of its kind
    is built unevaluated: the trace keeps every level, and the map and the kernel still agree
    with torch's dense evaluation."""
    traced = maskc.mask_mod(nested).traced
    depth, e = 0, traced.expr
    while e.args:
        e = next((a for a in e.args if a.has(node)), None) or e.args[0]
        depth += isinstance(e, node)
    assert depth == levels
    assert torch.equal(dense_mask(nested, 50, 70), maskc.create_mask(nested, 1, 1, 50, 70, device="cpu"))
    assert_block_map_sound(nested, 50, 70, (16, 16))
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 50, 16, generator=g), torch.randn(1, 1, 70, 16, generator=g)
    out = maskc.compiled_attention(q, k, k, mask_mod=nested)
    torch.testing.assert_close(out.double(), attention_reference(q, k, k, mask_mod=nested)[0], atol=2e-6, rtol=0)
