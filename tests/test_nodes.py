"""Every node of the traced vocabulary: printed for Triton, evaluated densely, given a sound
range over tiles, differentiated for the backward pass, and run end to end (issue 11).

End-to-end cases go through the tracer, and again with hand-built sympy expressions for the
nodes the tracer did not emit when this was written: `_mod` pairs such an expression with the
torch function it stands for, which the float64 references run.
"""
import math

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import maskc
from _inputs import qkv
from _work import python_calls
from maskc.analysis import EMPTY, FULL, PARTIAL
from maskc.analysis.classify import classify_grid
from maskc.analysis.dense import evaluate, symbols_env
from maskc.analysis.intervals import Interval, IntervalEvaluator, TensorSummaries
from maskc.codegen.render import render, score_derivative
from maskc.codegen.separable import separate
from maskc.codegen.source import KernelSource
from maskc.errors import MaskcError
from maskc.testing import assert_block_map_sound, assert_close_to_reference, attention_reference
from maskc.trace.mods import MaskMod, ScoreMod
from maskc.trace.symbols import (B, H, KV_IDX, Q_IDX, SCORE, BitAnd, BitOr, BitXor, LeftShift, LoadFloat, RightShift,
                                 Trunc, param_symbol)
from maskc.trace.tracer import Param, Traced

P0 = param_symbol(0, True)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MASKC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernels"))


def _mod(cls, name, expr, fn, params=(), tensors=()):
    """A mask or score mod whose trace is `expr` as given; `fn` is the torch function it stands for."""
    mod = cls.__new__(cls)
    mod.fn, mod.__name__ = fn, name
    params = tuple(Param(param_symbol(i, isinstance(v, int)), v, f"p{i}") for i, v in enumerate(params))
    mod._traced = Traced(cls.kind, name, expr, params, tuple(tensors))
    return mod


def _check_attention(mask_mod=None, score_mod=None, dtype=torch.float32, reference_mask=None):
    q, k, v, d_out = qkv(dtype=dtype, grad_out=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = maskc.compiled_attention(*leaves, mask_mod=mask_mod, score_mod=score_mod)
    grads = torch.autograd.grad(out, leaves, d_out.to(out.dtype))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_leaves, mask_mod=reference_mask or mask_mod, score_mod=score_mod)[0]
    ref_grads = torch.autograd.grad(ref, ref_leaves, d_out.double())
    assert_close_to_reference(out.detach(), ref.detach(), dtype, "output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_to_reference(got, want, dtype, name)


def _score(name, expr, fn, **kwargs):
    return _mod(ScoreMod, name, expr, fn, **kwargs)


def _gelu(x):
    return x / 2 * (1 + sympy.erf(x / sympy.sqrt(2)))



def _ge(e):
    return sympy.GreaterThan(e, 0, evaluate=False)


# -- dense evaluation: torch's semantics ------------------------------------------------------
Q = torch.arange(-6, 7).view(-1, 1)
KV = torch.arange(0, 5).view(1, -1)


def _dense(expr, params=None, tensors=()):
    zero = torch.zeros((), dtype=torch.int64)
    return evaluate(expr, symbols_env(zero, zero, Q, KV), tensors, params or {})


@pytest.mark.parametrize("expr,want", [
    (sympy.sign(Q_IDX - 2 * KV_IDX), torch.sign(Q - 2 * KV)),
    (sympy.Heaviside(Q_IDX - KV_IDX), torch.heaviside((Q - KV).double(), torch.tensor(0.5, dtype=torch.float64))),
    (sympy.Heaviside(Q_IDX - KV_IDX, 1), ((Q - KV) >= 0).double()),
    (Trunc((Q_IDX - KV_IDX) / 4), torch.trunc((Q - KV) / 4).long()),  # toward zero
    (BitAnd(Q_IDX, KV_IDX + 1), (Q & (KV + 1))),
    (BitOr(Q_IDX, KV_IDX), Q | KV),
    (BitXor(Q_IDX, -KV_IDX), Q ^ -KV),
    (RightShift(Q_IDX, KV_IDX), Q >> KV),  # arithmetic: floor(q / 2**kv) for negative q too
    (RightShift(Q_IDX, 70 + KV_IDX), Q >> (70 + KV)),  # torch's rule past the width: the sign
    (LeftShift(Q_IDX, KV_IDX), Q << KV),
    (sympy.ceiling((Q_IDX - KV_IDX) / 4), -((KV - Q) // 4)),
    (2 ** (Q_IDX - KV_IDX), torch.exp2((Q - KV).double())),
    (2 ** KV_IDX, 2 ** KV),  # an integer power stays an integer, as torch's
    (sympy.sin(Q_IDX / 3) * sympy.cos(KV_IDX), torch.sin(Q / 3) * torch.cos(KV.double())),
    (sympy.erf(Q_IDX / 4), torch.erf(Q / 4)),
    (sympy.Piecewise((Q_IDX, sympy.ITE(Q_IDX >= 3, KV_IDX >= 2, KV_IDX < 1)), (0, True)),
     torch.where(torch.where(Q >= 3, KV >= 2, KV < 1), Q, 0)),
], ids=str)
def test_dense_evaluation_follows_torch(expr, want):
    got = _dense(expr)
    assert got.dtype.is_floating_point == want.dtype.is_floating_point
    torch.testing.assert_close(got.double().expand(want.shape), want.double())


@pytest.mark.parametrize("expr, table", [
    (sympy.Max(0, Q_IDX - 2) <= KV_IDX, (8,)),  # natten's clamp: a constant broadcast beside the indices
    (sympy.Min(7, Q_IDX) > KV_IDX, (8,)),
    (LoadFloat(0, sympy.Max(1, KV_IDX)), (8,)),  # a captured tensor read at an index built from a constant
    (LoadFloat(0, 3, KV_IDX), (8, 8)),  # ... and at a constant index
    (sympy.true, (8,)),  # a constant mask: the dense verdict expands it beside the lengths' bounds
], ids=str)
def test_dense_evaluation_stays_on_the_indices_device(expr, table):
    # "meta" stands in for CUDA: constants are 0-d CPU tensors, which broke Max, Min (expanded
    # by torch.broadcast_tensors into CPU tensors) and loads at constant indices on the GPU
    zero = torch.zeros((), dtype=torch.int64, device="meta")
    env = symbols_env(zero, zero, Q.to("meta"), KV.to("meta"))
    assert evaluate(expr, env, [torch.randn(table)], {}).device.type == "meta"


# -- interval analysis: sound on every tile, by brute force ------------------------------------
def _verdicts(expr, q_len, kv_len, block, values=None, tensors=()):
    """(analysed, certain, dense) verdicts of boolean expr on each [block × block] tile."""
    def bounds(symbol, length, shape):
        lo = torch.arange(0, length, block)
        return Interval(lo.view(shape), (lo + block - 1).clamp(max=length - 1).view(shape), True, True,
                        frozenset([symbol]))

    zero = Interval(torch.tensor(0), torch.tensor(0), True, True, frozenset())
    frame = {B: zero, H: zero, Q_IDX: bounds(Q_IDX, q_len, (-1, 1)), KV_IDX: bounds(KV_IDX, kv_len, (1, -1))}
    analysis = IntervalEvaluator(frame, values or {}, TensorSummaries(tensors, "cpu"), torch.device("cpu"))
    cls, certain = classify_grid(expr, analysis)
    zero = torch.zeros((), dtype=torch.int64)
    keep = evaluate(expr, symbols_env(zero, zero, torch.arange(q_len).view(-1, 1), torch.arange(kv_len).view(1, -1)),
                    tensors, values or {})
    dense = maskc.testing.dense_tiles(keep.expand(q_len, kv_len)[None, None], block)[0, 0]
    return cls.expand(dense.shape), certain.expand(dense.shape), dense


def _assert_sound(expr, q_len, kv_len, block, values=None, tensors=()):
    cls, certain, dense = _verdicts(expr, q_len, kv_len, block, values, tensors)
    wrong = ((cls == FULL) & (dense != FULL)) | ((cls == EMPTY) & (dense != EMPTY)) | (
        (cls == PARTIAL) & certain & (dense != PARTIAL))
    assert not wrong.any(), f"{expr}: analysis {cls.tolist()} (certain {certain.tolist()}), dense {dense.tolist()}"
    return cls


# Float comparisons are kept off exact ties (HALF): the analysis and the dense evaluation add the
# same terms in different orders, and a tie could round either way in either.
HALF = sympy.Rational(1, 2)
t = st.integers(-8, 8)
SOUNDNESS = {
    "sign": lambda a, c: _ge(sympy.sign(Q_IDX - a * KV_IDX - c) - sympy.sign(c)),
    "sign_eq": lambda a, c: sympy.Eq(sympy.sign(Q_IDX - a * KV_IDX + c), 0),
    "heaviside": lambda a, c: _ge(sympy.Heaviside(Q_IDX - KV_IDX - c, sympy.Rational(a % 3, 2)) - sympy.Rational(1, 2)),
    "exp": lambda a, c: sympy.Gt(sympy.exp((Q_IDX - a * KV_IDX + HALF) / 8) - sympy.exp(sympy.Rational(c, 4)), 0),
    "exp2": lambda a, c: _ge(2 ** ((KV_IDX - Q_IDX) / 4 + sympy.Rational(1, 7)) - 2 ** sympy.Rational(c, 3)
                             + sympy.Rational(a, 5)),
    "base_below_one": lambda a, c: _ge(sympy.Rational(1, 3) ** ((Q_IDX - KV_IDX) / 6) - (c + 9 + HALF) / 4),
    "tanh": lambda a, c: _ge(sympy.tanh((Q_IDX - a * KV_IDX + HALF) / 10) - sympy.Rational(c, 9)),
    "erf": lambda a, c: _ge(sympy.erf((Q_IDX - KV_IDX - c - HALF) / 5) - sympy.Rational(a, 9)),
    "atan": lambda a, c: _ge(sympy.atan((Q_IDX - a * KV_IDX + HALF) / 3) - sympy.Rational(c, 6)),
    "log": lambda a, c: _ge(sympy.log(Q_IDX - a * KV_IDX + c) - 1),  # NaN below 0
    "sqrt": lambda a, c: _ge(sympy.sqrt(Q_IDX - KV_IDX + c) - sympy.Rational(a + 8, 3)),
    "even_power": lambda a, c: _ge((Q_IDX - KV_IDX - c) ** 2 - a * a),
    "sin_cos": lambda a, c: _ge(sympy.sin(Q_IDX / (abs(a) + 2)) - sympy.cos(KV_IDX / 7) - sympy.Rational(c, 8)),
    "narrow_sin": lambda a, c: _ge(sympy.sin((Q_IDX + KV_IDX) / 100) - sympy.Rational(c, 20)),
    "ceiling": lambda a, c: _ge(sympy.ceiling((Q_IDX - KV_IDX) / (abs(a) + 1)) - c),
    "ceiling_float": lambda a, c: _ge(sympy.ceiling((Q_IDX - KV_IDX) * sympy.Float(0.37)) - c),
    "trunc": lambda a, c: _ge(Trunc((Q_IDX - KV_IDX) * sympy.Float(0.3)) - c),
    "right_shift": lambda a, c: _ge(RightShift(Q_IDX - c, P0) - RightShift(KV_IDX, P0)),
    "right_shift_by_index": lambda a, c: _ge(RightShift(Q_IDX + 40 * c, KV_IDX % 4) - a),
    "left_shift": lambda a, c: _ge(LeftShift(Q_IDX, P0) - (abs(a) + 1) * KV_IDX - c),
    "bit_and": lambda a, c: sympy.Eq(BitAnd(Q_IDX, abs(a) + 1) - BitAnd(KV_IDX, abs(c) + 1), 0),
    "bit_or": lambda a, c: _ge(BitOr(Q_IDX, KV_IDX + abs(a)) - 4 * abs(c)),
    "bit_xor": lambda a, c: _ge(4 * abs(c) - BitXor(Q_IDX, KV_IDX)),
    "bit_and_negative": lambda a, c: _ge(BitAnd(Q_IDX - 30, KV_IDX) + c),  # undecidable: settled densely
    "morton_block": lambda a, c: sympy.Eq(BitAnd(RightShift(Q_IDX, P0), 1) - BitAnd(RightShift(KV_IDX, P0), 1), 0),
    "ite": lambda a, c: sympy.ITE(_ge(Q_IDX - KV_IDX), _ge(KV_IDX - c - 8), _ge(Q_IDX - a - 8)),
    "where_turned_round": lambda a, c: _ge(sympy.Piecewise((Q_IDX - c, sympy.Le(KV_IDX - Q_IDX, a)), (c, True))),
}


@settings(max_examples=25)
@given(a=t, c=t, lengths=st.tuples(st.integers(1, 60), st.integers(1, 60)), block=st.sampled_from([1, 4, 8, 16]),
       shift=st.integers(0, 5))
@pytest.mark.parametrize("node", SOUNDNESS)
def test_intervals_are_sound(node, a, c, lengths, block, shift):
    _assert_sound(SOUNDNESS[node](a, c), *lengths, block, values={P0: shift})


def test_intervals_decide_what_they_can():
    # not everything falls to the dense fallback: the ranges of the new nodes decide tiles
    cls = _assert_sound(SOUNDNESS["exp"](1, 0), 64, 64, 16)
    assert (cls == FULL).any() and (cls == EMPTY).any()
    cls = _assert_sound(SOUNDNESS["morton_block"](0, 0), 64, 64, 16, values={P0: 4})
    assert (cls != PARTIAL).all()  # tile-aligned bits are exact
    cls = _assert_sound(_ge(15 - BitAnd(Q_IDX, KV_IDX)), 64, 64, 16)
    assert (cls == FULL)[0].all()


@pytest.mark.parametrize("value", [math.inf, -math.inf, 0.5, -2.0])
def test_infinite_parameters_are_sound(value):
    p = param_symbol(0, False)
    for expr in (_ge(p - Q_IDX + KV_IDX),  # a window of inf keeps every pair
                 _ge((Q_IDX - KV_IDX) * p - 1),  # 0 * inf is NaN: dropped, never FULL
                 sympy.Ne((KV_IDX - Q_IDX) * p, 0),  # NaN != 0 is kept
                 _ge(sympy.sin(Q_IDX * p) + 1),  # sin(inf) is NaN
                 _ge(p + KV_IDX - (p - Q_IDX))):  # inf - inf is NaN
        _assert_sound(expr, 40, 40, 16, values={p: value})


def test_nan_ranges_are_uncertain():
    p = param_symbol(0, False)
    cls, certain, _ = _verdicts(_ge((Q_IDX - KV_IDX) * p - 1), 40, 40, 16, values={p: math.inf})
    assert not certain[cls == PARTIAL].any()


@pytest.mark.parametrize("window", [math.inf, -math.inf])
def test_block_map_with_an_infinite_window(window):
    def sliding(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= window) & (q_idx >= kv_idx)

    mask = maskc.mask_mod(sliding)
    assert_block_map_sound(mask, 40, 40, (16, 16))
    bm = maskc.block_map(mask, 40, 40, block_size=(16, 16))
    assert bm.num_full == (3 if window > 0 else 0)


# -- d(score_mod)/d(score): torch's autograd, over the DAG -------------------------------------
SCORES = torch.cat([torch.linspace(-3, 3, 61, dtype=torch.float64), torch.tensor([-0.5, 0.5, 0.0],
                                                                                  dtype=torch.float64)]).view(-1, 1)


@pytest.mark.parametrize("expr,fn", [
    (sympy.Abs(SCORE), torch.abs),
    (sympy.Max(sympy.Min(SCORE, 0.5), -0.5), lambda s: torch.clamp(s, -0.5, 0.5)),  # passes at the bounds
    (sympy.Min(SCORE, 0.5), lambda s: torch.clamp(s, max=0.5)),
    # off the ties, where torch.maximum splits the gradient and clamp passes it (see below)
    (sympy.Max(SCORE, (Q_IDX - KV_IDX) / 4 + 0.013), lambda s: torch.maximum(s, (Q - KV) / 4 + 0.013)),
    (SCORE * sympy.sign(SCORE), lambda s: s * torch.sign(s)),
    (sympy.sign(SCORE) + sympy.Heaviside(SCORE), lambda s: torch.sign(s) + (s > 0) + 0 * s),  # steps: 0
    (2 ** (SCORE / 3), lambda s: torch.exp2(s / 3)),
    (SCORE ** 3 - sympy.sqrt(SCORE + 4), lambda s: s ** 3 - torch.sqrt(s + 4)),
    (sympy.sin(SCORE) * sympy.cos(2 * SCORE), lambda s: torch.sin(s) * torch.cos(2 * s)),
    (_gelu(SCORE), torch.nn.functional.gelu),
    (sympy.tanh(SCORE) + sympy.log(SCORE + 5) + sympy.exp(-SCORE),
     lambda s: torch.tanh(s) + torch.log(s + 5) + torch.exp(-s)),
    (sympy.Mod(SCORE, 0.7), lambda s: torch.remainder(s, 0.7)),
    (sympy.Piecewise((SCORE ** 2, SCORE > Q_IDX / 5), (-SCORE, True)),
     lambda s: torch.where(s > Q / 5, s ** 2, -s)),
    (sympy.floor(Q_IDX / 3) * SCORE + LoadFloat(0, KV_IDX), lambda s: torch.floor(Q / 3) * s),
], ids=lambda x: str(x) if isinstance(x, sympy.Basic) else "torch")
def test_score_derivative_is_torchs(expr, fn):
    s = SCORES.view(-1, 1, 1).expand(-1, Q.shape[0], KV.shape[1]).clone().requires_grad_()
    zero = torch.zeros((), dtype=torch.int64)
    want, = torch.autograd.grad(fn(s).sum(), s)
    env = symbols_env(zero, zero, Q, KV, s.detach())
    got = evaluate(score_derivative(expr), env, (torch.zeros(5, dtype=torch.float64),), {})
    torch.testing.assert_close(got.double().expand(want.shape), want)


def test_min_and_max_pass_the_gradient_at_a_tie_as_clamp_does():
    # torch.maximum(s, c) would pass half; the tracer cannot tell it from clamp, which passes all
    tie = torch.tensor([0.5], dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.int64)
    for expr in (sympy.Max(SCORE, 0.5), sympy.Min(SCORE, 0.5), sympy.Max(0.5, 2 * SCORE - 0.5)):
        slope = evaluate(score_derivative(expr), symbols_env(zero, zero, zero, zero, tie), (), {})
        assert float(slope) == float(score_derivative(expr).subs(SCORE, 0.7 if expr.func == sympy.Max else 0.3))


@pytest.mark.parametrize("expr,what", [
    (sympy.floor(SCORE), "floor"),
    (sympy.ceiling(SCORE / 2), "ceiling"),
    (Trunc(SCORE), "Trunc"),
    (SCORE + LoadFloat(0, Trunc(SCORE)), r"Trunc\(score\)"),  # an index of a captured tensor
], ids=str)
def test_not_differentiable_names_where(expr, what):
    with pytest.raises(MaskcError, match=f"score_mod is not differentiable in score at {what}.*use"):
        score_derivative(expr)


def test_not_differentiable_is_raised_when_the_backward_is_rendered():
    floor_mod = _score("floored", sympy.floor(SCORE * 4) / 4, lambda s, b, h, q, kv: torch.floor(s * 4) / 4)
    q, k, v = qkv()
    maskc.compiled_attention(q, k, v, score_mod=floor_mod)  # the forward needs no derivative
    out = maskc.compiled_attention(q.requires_grad_(), k, v, score_mod=floor_mod)
    with pytest.raises(MaskcError, match=r"not differentiable in score at floor\(4\*score\)"):
        out.sum().backward()


# -- shared subexpressions: nested torch.where ------------------------------------------------
def score_nest(depth):
    x = SCORE
    for i in range(depth):
        x = sympy.Piecewise((x * 0.9 + i, _ge(Q_IDX - KV_IDX - i)), (x - 1, True))
    return x


def mask_nest(depth):
    x = Q_IDX - KV_IDX
    for i in range(depth):
        x = sympy.Piecewise((x + 1, _ge(Q_IDX - 2 * KV_IDX - i)), (x - 2, True))
    return _ge(x)


def _spec(kind, mask_expr, score_expr):
    return KernelSource(kind, "m", "s", (), (), split_score=False, mask_expr=mask_expr, score_expr=score_expr)


@pytest.mark.timeout(120)
def test_depth_20_where_nest_is_printed_evaluated_and_analysed_in_polynomial_time():
    # 2**20 leaves as a tree; sympy.diff alone took about 3 minutes that way
    sizes = {}

    def stages(depth):
        score, mask = score_nest(depth), mask_nest(depth)
        sources = [render(_spec(kind, mask, score)).text for kind in ("fwd", "bwd")]
        for source in sources:
            compile(source, "nest", "exec")
        sizes[depth] = sum(len(source) for source in sources)
        assert separate(score) is None
        cls = _assert_sound(mask, 64, 64, 16)  # intervals, and dense evaluation of every pair
        assert (cls != PARTIAL).any()

    calls = {depth: python_calls(stages, depth) for depth in (10, 20)}
    # twice the nodes: less than twice the text, and about twice the calls
    assert sizes[20] < 2 * sizes[10], sizes
    assert calls[20] < 3 * calls[10], calls


def test_where_nest_end_to_end():
    def nest(s, b, h, q, kv):
        for i in range(10):
            s = torch.where(q - kv >= i, s * 0.9 + i, s - 1)
        return s

    _check_attention(maskc.masks.causal, maskc.score_mod(nest))
    _check_attention(maskc.masks.causal, _score("nest", score_nest(10), nest))


@pytest.mark.timeout(300)  # seconds here; a walk of the tree would not end
def test_depth_20_where_nests_run_end_to_end_in_polynomial_time():
    """Each level reads the last one's value three times: 3**20 leaves as a tree. Tracing,
    canonical form, signature, block map, printing and the derivative walk distinct nodes
    (the issue measured 97 s at depth 10 and no end at 12)."""
    def position_nest(b, h, q_idx, kv_idx):
        x = q_idx
        for i in range(20):
            x = torch.where(x > i, x - 1, x + 1)
        return x >= kv_idx

    def score_on_score(score, b, h, q_idx, kv_idx):
        # conditions on the score itself: 2**20 distinct affine functions if split per branch
        for i in range(20):
            score = torch.where(score > i * 0.1, score * 0.9, score + 0.03)
        return score

    _check_attention(position_nest, score_on_score)


@pytest.mark.timeout(300)
def test_a_deep_nest_traced_afresh_each_step_plans_in_polynomial_time():
    """A call with a block map plans on every call, with caches of its sympy steps. Keyed by
    equality, an equal nest traced afresh (a mod defined inside the step, FlexAttention's idiom)
    compared as a tree on every hit: 6-7 s a call at depth 12, no end at 20 (a review's
    measurement). Keyed by identity it misses and costs a plan."""
    from maskc.runtime import plan
    from maskc.trace.mods import as_mask_mod, as_score_mod

    q = torch.randn(1, 2, 256, 32)
    mask = as_mask_mod(maskc.masks.causal)
    block_map = maskc.block_map(maskc.masks.causal, 256, 256, B=1, H=2)

    def step():
        def score_on_score(score, b, h, q_idx, kv_idx):
            for i in range(20):
                score = torch.where(score > i * 0.1, score * 0.9, score + 0.03)
            return score
        score = as_score_mod(score_on_score)
        plan.problem_of(q, q, q, mask, score, None, plan.traces_of(mask, score), block_map=block_map)

    calls = [python_calls(step) for _ in range(3)]
    # a later step costs about what the first did, less the kernel it finds rendered
    assert max(calls[1:]) < 2 * calls[0], calls


# -- captured tensors in narrow dtypes ---------------------------------------------------------
@pytest.mark.parametrize("inputs", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16])
def test_narrow_bias_is_widened_where_it_is_loaded(bias_dtype, inputs):
    # the separable FULL-tile path multiplied the raw bf16 value: NaN or errors of order 1
    bias = torch.randn(40, generator=torch.Generator().manual_seed(1)).to(bias_dtype)

    @maskc.score_mod
    def additive_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    _check_attention(maskc.masks.causal, additive_bias, dtype=inputs)
    _check_attention(None, additive_bias, dtype=inputs)


def test_small_integer_tables_are_read_as_int32():
    # 117 * 117 wraps in int8, where torch would compute it: maskc reads the table as int32
    ids = (torch.arange(40) * 3).to(torch.int8)
    wide = ids.long()

    @maskc.mask_mod
    def products(b, h, q_idx, kv_idx):
        return ids[q_idx] * ids[kv_idx] <= 3000

    def reference(b, h, q_idx, kv_idx):
        return wide[q_idx] * wide[kv_idx] <= 3000

    assert_block_map_sound(maskc.mask_mod(reference), 40, 40, (16, 16))
    assert torch.equal(maskc.block_map(products, 40, 40, block_size=16).to_dense(),
                       maskc.block_map(reference, 40, 40, block_size=16).to_dense())
    _check_attention(products, None, reference_mask=reference)


# -- end to end: forward and backward against float64 autograd of the reference ---------------
SCORE_MODS = {
    "abs": lambda s, b, h, q, kv: torch.abs(s),
    "clamp": lambda s, b, h, q, kv: torch.clamp(s, -0.5, 0.5),
    "minimum": lambda s, b, h, q, kv: torch.minimum(s, (q - kv) * 0.05),
    "maximum": lambda s, b, h, q, kv: torch.maximum(s * 2.0, s + 0.1),
    "bool_where": lambda s, b, h, q, kv: s * torch.where(q >= kv, s > 0, kv > 3),
    "alibi_exp2": lambda s, b, h, q, kv: s + torch.exp2(-4.0 * (h + 1)) * (kv - q),
    "sin_cos": lambda s, b, h, q, kv: torch.sin(s) + torch.cos(s / 2 + q),
    "gelu": lambda s, b, h, q, kv: torch.nn.functional.gelu(s),
    "silu": lambda s, b, h, q, kv: torch.nn.functional.silu(s),
    "sign": lambda s, b, h, q, kv: s * torch.sign(s) + torch.sign(q - kv),
    "trunc": lambda s, b, h, q, kv: s + (q / 3).long() * 0.1,
}
# the same with hand-built expressions: the sympy forms, as the tracer emitted none of these at first
BUILT = {
    "alibi_exp2": SCORE + 2 ** (-4 * (H + 1)) * (KV_IDX - Q_IDX),
    "sin_cos": sympy.sin(SCORE) + sympy.cos(SCORE / 2 + Q_IDX),
    "gelu": _gelu(SCORE),
    "sign": SCORE * sympy.sign(SCORE) + sympy.sign(Q_IDX - KV_IDX),
    "heaviside": SCORE * sympy.Heaviside(SCORE - 0.2) + sympy.Heaviside(Q_IDX - KV_IDX, 1),
    "ite": SCORE * sympy.Piecewise((2, sympy.ITE(Q_IDX >= KV_IDX, SCORE > 0, KV_IDX > 3)), (1, True)),
}
BUILT_FNS = {
    **SCORE_MODS,
    "heaviside": lambda s, b, h, q, kv: s * ((s > 0.2) + 0.5 * (s == 0.2)) + (q >= kv),
    "ite": lambda s, b, h, q, kv: s * torch.where(torch.where(q >= kv, s > 0, kv > 3), 2, 1),
}


@pytest.mark.parametrize("name", BUILT)
def test_built_score_mods_forward_and_backward(name):
    _check_attention(maskc.masks.causal, _score(name, BUILT[name], BUILT_FNS[name]))


@pytest.mark.parametrize("name", SCORE_MODS)
def test_score_mods_forward_and_backward(name):
    _check_attention(maskc.masks.causal, maskc.score_mod(SCORE_MODS[name], name=name))


SHIFT = 3


def morton(b, h, q_idx, kv_idx):
    # same 8-row block parity of q and kv, within a Z-order neighbourhood, causal
    near = (q_idx ^ kv_idx) < (1 << (h + 4))
    return (((q_idx >> SHIFT) & 1) == ((kv_idx >> SHIFT) & 1)) & near & (q_idx >= kv_idx)


def test_traced_morton_mask_forward_and_backward():
    mask = maskc.mask_mod(morton)
    assert_block_map_sound(mask, 40, 40, (16, 16), H=2)
    _check_attention(mask, None)


def test_built_morton_mask_forward_and_backward():
    # same 8-row block parity of q and kv (RightShift by a captured count, BitAnd), causal
    expr = sympy.And(sympy.Eq(BitAnd(RightShift(Q_IDX, P0), 1) - BitAnd(RightShift(KV_IDX, P0), 1), 0),
                     _ge(Q_IDX - KV_IDX), _ge(7 - BitXor(Q_IDX, KV_IDX) + LeftShift(1, P0 + 2)))
    mask = _mod(MaskMod, "morton", expr, lambda b, h, q, kv: (((q >> 3) & 1) == ((kv >> 3) & 1)) & (q >= kv)
                & (7 - (q ^ kv) + (1 << (3 + 2)) >= 0), params=(3,))
    assert_block_map_sound(mask, 40, 40, (16, 16))
    _check_attention(mask, None)


def test_the_host_decision_of_nonnegative_indices_follows_parameters_and_extents():
    # indices_nonnegative caches what it decides on the host (an index reading no tensor) by
    # parameter values and extents: a call with a block map asks it every time, and a new
    # value of a captured number (a parameter, not a new trace) must get its own answer
    from maskc.analysis.intervals import indices_nonnegative
    from maskc.trace import symbols as S

    p0 = S.param_symbol(0, True)
    expr = S.LoadFloat(0, S.H, S.Q_IDX - S.KV_IDX + p0)
    table = torch.zeros(2, 300)
    for offset, kv_len, nonnegative in ((69, 70, True), (69, 90, False), (0, 70, False), (69, 70, True),
                                        (89, 90, True), (0, 1, True)):
        extents = {S.B: 1, S.H: 2, S.Q_IDX: 70, S.KV_IDX: kv_len}
        assert indices_nonnegative((None, expr), (table,), {p0: offset}, extents) is nonnegative, (offset, kv_len)
