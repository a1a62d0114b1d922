"""compiled_attention against the float64 reference: masks, score mods, shapes, dtypes, layouts.

Every kernel here runs through Triton's interpreter (about a second a call), so shapes stay
small (L <= 80, B·H <= 4) and each property test draws a dozen fixed examples; pass
`--hypothesis-profile=thorough` for a long random run.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import maskc
from _inputs import qkv, randn
from maskc import masks, scores
from maskc.analysis.dense import evaluate, symbols_env
from maskc.runtime.tiles import bh_group, use_config
from maskc.runtime.descriptors import descriptors
from maskc.testing import assert_close_to_reference, attention_reference
from maskc.testing.strategies import AttentionInputs, doc_ids
from maskc.testing.strategies import masks as mask_strategy
from maskc.testing.strategies import score_mods as score_mod_strategy
from maskc.trace import symbols as S

# NOTE: a profile asking for hundreds of examples (thorough) gets them, randomised; the default run
# gets the same dozen every time.
_THOROUGH = settings.default.max_examples >= 500
FUZZ = settings(max_examples=settings.default.max_examples if _THOROUGH else 12, derandomize=not _THOROUGH,
                deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# |lse - ref| allowed on rows that keep something (absolute, natural log units)
LSE_ATOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}

@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKC_CACHE_DIR", str(tmp_path_factory.mktemp("maskc_cache")))
        yield


def check_lse(lse, ref_lse, dtype):
    """Same -inf pattern; finite entries close."""
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert not torch.isnan(lse).any(), "lse has NaN"
    ref_empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), ref_empty), (
        f"-inf pattern of lse differs at {(torch.isneginf(lse) != ref_empty).nonzero()[:5].tolist()}")
    assert torch.isfinite(lse[~ref_empty]).all()
    torch.testing.assert_close(lse[~ref_empty].double(), ref_lse[~ref_empty], atol=LSE_ATOL[dtype], rtol=0)


def check(q, k, v, reference_kwargs=None, **kwargs):
    """Run compiled_attention(return_lse=True) and compare with attention_reference.

    `reference_kwargs` replaces the kwargs given to the reference (a hand-built equivalent)."""
    out, lse = maskc.compiled_attention(q, k, v, return_lse=True, **kwargs)
    ref_out, ref_lse = attention_reference(q, k, v, **(reference_kwargs or kwargs))
    B, Hq, Lq, _ = q.shape
    assert out.shape == (B, Hq, Lq, v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (B, Hq, Lq)
    assert_close_to_reference(out, ref_out, q.dtype)
    check_lse(lse, ref_lse, q.dtype)
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all(), "fully masked rows must give exactly 0"
    return out, lse


# -- properties -----------------------------------------------------------------------------
# (B, Hq, Hkv): plain heads, GQA groups of 2, 3 and 4, B·Hq <= 4
HEADS = ((1, 1, 1), (1, 2, 2), (2, 2, 2), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 3, 1), (1, 4, 2), (1, 4, 1))


@st.composite
def problems(draw, dtypes):
    B, Hq, Hkv = draw(st.sampled_from(HEADS))
    Lq, Lkv = draw(st.integers(1, 80)), draw(st.integers(1, 80))
    D = draw(st.sampled_from((16, 32, 64, 80)))
    Dv = draw(st.sampled_from((D, 16, 32, 64, 80)))
    dtype = draw(st.sampled_from(dtypes))
    mask = draw(st.none() | mask_strategy(Lq, Lkv, B=B, H=Hq))
    score = draw(score_mod_strategy(Lq, Lkv, H=Hq))
    scale = draw(st.sampled_from((None, 0.125, 1.0)))
    seed = draw(st.integers(0, 2**31 - 1))
    q, k, v = qkv(B, Hq, Hkv, Lq, Lkv, D, Dv, dtype=dtype, seed=seed)
    return AttentionInputs(q, k, v, mask, score, scale, enable_gqa=Hq != Hkv)


@FUZZ
@given(problems(dtypes=(torch.float32,)), st.booleans())
def test_matches_reference_fp32(problem, descriptors):
    # both load paths: tensor descriptors (taken whenever the layout allows) and pointers
    with use_config(descriptors=descriptors):
        check(problem.q, problem.k, problem.v, **problem.kwargs())


@FUZZ
@given(problems(dtypes=(torch.float16,)))
def test_matches_reference_fp16(problem):
    check(problem.q, problem.k, problem.v, **problem.kwargs())


@pytest.mark.parametrize("mask,score", [
    (None, None), (masks.causal, None), (masks.sliding_window(9), None), (masks.causal, scores.softcap(5.0)),
    (None, scores.alibi(scores.alibi_slopes(4))),
], ids=["plain", "causal", "sliding", "causal_softcap", "alibi_gqa"])
def test_bfloat16(mask, score):
    q, k, v = qkv(1, 4, 2, 50, 45, 32, dtype=torch.bfloat16)
    check(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=True)


@FUZZ
@given(st.data())
def test_document_masks_with_captured_ids(data):
    Lq, Lkv = data.draw(st.integers(1, 80)), data.draw(st.integers(1, 80))
    causal = data.draw(st.booleans())
    if Lq == Lkv and data.draw(st.booleans()):
        mask = masks.document(data.draw(doc_ids(Lq)), causal=causal)
    else:
        mask = masks.document(data.draw(doc_ids(Lq)), causal=causal, kv_doc_ids=data.draw(doc_ids(Lkv)))
    score = data.draw(st.sampled_from((None, scores.softcap(20.0))))
    dtype = data.draw(st.sampled_from((torch.float32, torch.float16)))
    q, k, v = qkv(1, 2, 2, Lq, Lkv, 32, 32, dtype=dtype, seed=data.draw(st.integers(0, 1000)))
    check(q, k, v, mask_mod=mask, score_mod=score)


# -- standard library, one by one -----------------------------------------------------------
@pytest.mark.parametrize("mask", [
    None, masks.causal, masks.sliding_window(8), masks.prefix_lm(20), masks.chunked_causal(24),
    masks.dilated_sliding_window(30, 3), masks.and_masks(masks.causal, masks.prefix_lm(40)),
    masks.or_masks(masks.sliding_window(4), masks.prefix_lm(10)), masks.not_mask(masks.sliding_window(16)),
], ids=lambda m: "none" if m is None else m.__name__)
def test_standard_masks(mask):
    q, k, v = qkv(1, 2, 2, 71, 77, 32)
    check(q, k, v, mask_mod=mask)


@pytest.mark.parametrize("score", [scores.softcap(5.0), scores.alibi(scores.alibi_slopes(4)),
                                   scores.relative_bias(torch.randn(2 * 64 - 1, generator=torch.Generator()
                                                                    .manual_seed(3)), offset=63)],
                         ids=lambda s: s.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_score_mods_gqa(score, dtype):
    q, k, v = qkv(1, 4, 2, 64, 50, 64, 16, dtype=dtype)
    check(q, k, v, mask_mod=masks.causal, score_mod=score, enable_gqa=True)


@pytest.mark.parametrize("mask", [None, masks.causal], ids=lambda m: "none" if m is None else m.__name__)
def test_separable_score_with_minus_infinity_columns(mask):
    # score + column(kv_idx) whose first kv tile is -inf in every row: FULL tiles fold the
    # column into their FMA and must still give no NaN, and rows before kv 40 keep nothing
    def late_keys(score, b, h, q_idx, kv_idx):
        return score + torch.where(kv_idx >= 40, 0.0, float("-inf"))

    q, k, v = qkv(1, 2, 2, 70, 90, 32)
    check(q, k, v, mask_mod=mask, score_mod=late_keys)


@pytest.mark.parametrize("mask", [None, masks.causal], ids=lambda m: "none" if m is None else m.__name__)
def test_float64_split_score_mods_stay_exact(mask):
    # float64 is for exact checks (gradcheck): ALiBi runs as written there, not in its split
    # form, whose separately rounded row and column terms cost ~1e-8 (codegen/render.py)
    q, k, v = qkv(1, 4, 4, 70, 70, 32, dtype=torch.float64)
    score = scores.alibi(torch.rand(4, generator=torch.Generator().manual_seed(5)))
    out = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score)
    ref, _ = attention_reference(q, k, v, mask_mod=mask, score_mod=score)
    assert float((out - ref).norm() / ref.norm()) < 1e-12


def test_batch_and_head_dependent_mask():
    windows = torch.tensor([3, 40])
    ids = torch.randint(0, 3, (2 * 70,), generator=torch.Generator().manual_seed(0))  # [B * L], row b at b * 70

    def per_head_per_batch(b, h, q_idx, kv_idx):
        same_doc = ids[b * 70 + q_idx] == ids[b * 70 + kv_idx]
        return same_doc & (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h]) | ((b == 1) & (kv_idx < 2))

    q, k, v = qkv(2, 2, 1, 70, 70, 16)
    check(q, k, v, mask_mod=per_head_per_batch, enable_gqa=True)


def _batch_docs_2d():
    ids = torch.randint(0, 3, (2, 40), generator=torch.Generator().manual_seed(0))

    def batch_docs(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    return dict(mask_mod=batch_docs)


def _relative_bias_2d():
    table = torch.randn(2, 2 * 40 - 1, generator=torch.Generator().manual_seed(0))
    return dict(mask_mod=masks.causal, score_mod=scores.relative_bias(table, offset=39))


@pytest.mark.parametrize("kwargs", [_batch_docs_2d, _relative_bias_2d], ids=["ids[b, q_idx]", "table[h, q-kv]"])
def test_load_indexed_by_head_and_position(kwargs):
    q, k, v = qkv(2, 2, 2, 40, 40, 16)
    check(q, k, v, **kwargs())


def test_plain_function_is_traced_on_first_use():
    def plain(b, h, q_idx, kv_idx):
        return torch.abs(q_idx - kv_idx) <= 5

    q, k, v = qkv(1, 1, 1, 40, 40, 32)
    check(q, k, v, mask_mod=plain, score_mod=lambda score, b, h, q_idx, kv_idx: score * 0.5)


def test_a_cube_of_positions_in_a_score_does_not_wrap():
    # The trace keeps no casts: (q_idx - kv_idx).float() ** 3 printed over int32 positions
    # wrapped past a difference of 1290, a silent wrong answer (the GPU check at 4097 rows).
    q, k, v = qkv(1, 1, 1, 1344, 32, 16)
    check(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score + (q_idx - kv_idx).float() ** 3 * 1e-9)


def test_float64():
    q, k, v = qkv(1, 4, 2, 50, 45, 32, 16, dtype=torch.float64)
    check(q, k, v, mask_mod=masks.sliding_window(9), score_mod=scores.softcap(5.0), enable_gqa=True)


@pytest.mark.parametrize("D,Dv", [(16, 80), (80, 32), (64, 16), (32, 64)])
def test_head_dims_and_value_dim(D, Dv):
    q, k, v = qkv(1, 1, 1, 33, 65, D, Dv)
    check(q, k, v, mask_mod=masks.sliding_window(20))


def test_launch_order_groups_cover_every_tile():
    # head dims above 64 interleave (b, h) pairs two at a time in the launch order
    # (tiles.bh_group); five pairs leave a last group of one, and each pair has three q tiles
    assert bh_group(80) == 2
    q, k, v = qkv(1, 5, 5, 70, 70, 80)
    check(q, k, v, mask_mod=masks.causal)


# -- fully masked rows ----------------------------------------------------------------------
def _nothing(b, h, q_idx, kv_idx):
    return q_idx < 0


def _far_future(b, h, q_idx, kv_idx):
    return kv_idx > q_idx + 1000


@pytest.mark.parametrize("mask", [_nothing, _far_future, masks.not_mask(masks.prefix_lm(1000))],
                         ids=lambda m: getattr(m, "__name__", str(m)))
@pytest.mark.parametrize("score", [None, scores.softcap(10.0)], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_every_row_empty_gives_zero_and_minus_inf(mask, score, dtype):
    q, k, v = qkv(2, 2, 2, 45, 37, 32, dtype=dtype)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    ref_out, ref_lse = attention_reference(q, k, v, mask_mod=mask, score_mod=score)
    assert torch.isneginf(ref_lse).all() and (ref_out == 0).all()


@pytest.mark.parametrize("mask", [
    masks.not_mask(masks.causal),  # the last query row keeps nothing
    masks.and_masks(masks.causal, lambda b, h, q_idx, kv_idx: kv_idx >= 37),  # rows 0..36 keep nothing
    masks.and_masks(masks.sliding_window(3), lambda b, h, q_idx, kv_idx: (q_idx % 7) != 2),  # scattered rows
], ids=["not_causal", "late_keys", "scattered"])
def test_some_rows_empty(mask):
    q, k, v = qkv(1, 2, 2, 64, 64, 32)
    out, lse = check(q, k, v, mask_mod=mask)
    assert torch.isneginf(lse).any() and not torch.isneginf(lse).all()
    assert not torch.isnan(out).any()


def test_zero_lengths():
    q, k, v = qkv(1, 2, 2, 10, 0, 32)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=masks.causal, return_lse=True)
    assert out.shape == (1, 2, 10, 32) and torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    q, k, v = qkv(1, 2, 2, 0, 10, 32)
    out, lse = maskc.compiled_attention(q, k, v, return_lse=True)
    assert out.shape == (1, 2, 0, 32) and lse.shape == (1, 2, 0)
    q, k, v = qkv(0, 2, 2, 10, 10, 32)
    assert maskc.compiled_attention(q, k, v).shape == (0, 2, 10, 32)


# -- layouts, block maps, scale -------------------------------------------------------------
def test_non_contiguous_inputs():
    B, H, Lq, Lkv, D, Dv = 2, 2, 50, 45, 32, 16
    q = randn(B, Lq, H, D, seed=1).transpose(1, 2)
    k = randn(B, Lkv, H, D, seed=2).transpose(1, 2)
    v = randn(B, H, Dv, Lkv, seed=3).transpose(2, 3)  # unit stride along L, not along Dv
    assert not any(t.is_contiguous() for t in (q, k, v))
    out, lse = check(q, k, v, mask_mod=masks.sliding_window(10), score_mod=scores.softcap(20.0))
    out_c = maskc.compiled_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                     mask_mod=masks.sliding_window(10), score_mod=scores.softcap(20.0))
    # the contiguous copies load through tensor descriptors, these through pointers: the
    # products are the same, summed in another order
    torch.testing.assert_close(out, out_c, atol=1e-5, rtol=1e-5)


def test_descriptors_only_where_the_copy_engine_allows():
    x = torch.randn(1, 2, 8, 32, dtype=torch.float16)
    block = (1, 1, 8, 32)
    assert descriptors([(x, block)]) is not None
    unaligned_base = torch.randn(2 * 8 * 32 + 1, dtype=torch.float16)[1:].view(1, 2, 8, 32)
    odd_row = torch.randn(1, 2, 8, 20, dtype=torch.float16)  # 40-byte rows
    strided_last = torch.randn(1, 2, 32, 8, dtype=torch.float16).transpose(2, 3)
    broadcast_heads = torch.randn(1, 1, 8, 32, dtype=torch.float16).expand(1, 2, 8, 32)
    for t in (unaligned_base, odd_row, strided_last, broadcast_heads):
        assert descriptors([(x, block), (t, block)]) is None
    for t in (unaligned_base, odd_row, broadcast_heads):  # and the pointer path gets them right
        check(t, t, t, mask_mod=masks.causal)


def test_non_contiguous_captured_tensor():
    ids = torch.randint(0, 3, (120,), generator=torch.Generator().manual_seed(1))[::2]  # stride 2
    assert not ids.is_contiguous()
    q, k, v = qkv(1, 1, 1, 60, 60, 16)
    check(q, k, v, mask_mod=masks.document(ids, causal=True))


@pytest.mark.parametrize("mask", [masks.causal, masks.sliding_window(12), masks.prefix_lm(30)],
                         ids=lambda m: m.__name__)
def test_given_block_map_gives_the_same_result(mask):
    q, k, v = qkv(1, 2, 2, 70, 66, 32)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask, return_lse=True)
    bm = maskc.block_map(mask, 70, 66, block_size=(32, 32))
    out_bm, lse_bm = maskc.compiled_attention(q, k, v, mask_mod=mask, return_lse=True, block_map=bm)
    assert torch.equal(out, out_bm) and torch.equal(lse, lse_bm)
    # other tile sizes give another kernel, still right
    bm = maskc.block_map(mask, 70, 66, block_size=(16, 64))
    check(q, k, v, mask_mod=mask, block_map=bm, reference_kwargs=dict(mask_mod=mask))


def test_given_block_map_per_batch_and_head():
    windows = torch.tensor([0, 5, 50])

    def head_windows(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h]) & ((b == 0) | (kv_idx % 2 == 0))

    q, k, v = qkv(1, 3, 3, 50, 50, 16)
    bm = maskc.block_map(head_windows, 50, 50, block_size=(32, 32), B=1, H=3)
    check(q, k, v, mask_mod=head_windows, block_map=bm, reference_kwargs=dict(mask_mod=head_windows))


@pytest.mark.parametrize("score", [None, scores.softcap(30.0)], ids=["plain", "softcap"])
@pytest.mark.parametrize("scale", [0.3, 1.0, 2.5])
def test_scale_is_honoured(scale, score):
    q, k, v = qkv(1, 2, 2, 40, 40, 64)
    out, _ = check(q, k, v, mask_mod=masks.causal, score_mod=score, scale=scale)
    default = maskc.compiled_attention(q, k, v, mask_mod=masks.causal, score_mod=score)
    assert not torch.allclose(out, default, atol=1e-3)


def test_inputs_requiring_grad_run_under_no_grad():
    q, k, v = qkv(1, 1, 1, 20, 20, 16, requires_grad=True)
    with torch.no_grad():
        out = maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
    ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), mask_mod=masks.causal)
    assert_close_to_reference(out, ref)


# -- captured tensors indexed out of range: the load reads 0 --------------------------------
def _dense_reference(q, k, v, keep, bias=0.0):
    """float64 (out, lse) for a dense bool `keep` [Lq, Lkv] and an additive `bias`; default scale."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    return p @ v.double(), lse


def _check_dense(q, k, v, keep, bias=0.0, **kwargs):
    out, lse = maskc.compiled_attention(q, k, v, return_lse=True, **kwargs)
    ref_out, ref_lse = _dense_reference(q, k, v, keep, bias)
    assert_close_to_reference(out, ref_out, q.dtype)
    check_lse(lse, ref_lse, q.dtype)


TABLE = torch.tensor([1, 0, 1, 1])  # covers q_idx - kv_idx in [-2, 1]


def _table_positive(b, h, q_idx, kv_idx):
    return TABLE[q_idx - kv_idx + 2] > 0


def _table_zero(b, h, q_idx, kv_idx):
    return TABLE[q_idx - kv_idx + 2] == 0


def _read_with_zero_outside(table, i):
    """table[i] as torch reads it (a negative i from the end), and 0 where torch would raise."""
    i = torch.where(i < 0, i + len(table), i)
    inside = (i >= 0) & (i < len(table))
    return torch.where(inside, table[i.clamp(0, len(table) - 1)], torch.zeros((), dtype=table.dtype))


@pytest.mark.parametrize("mask,kept_outside", [(_table_positive, False), (_table_zero, True)],
                         ids=["out_of_range_dropped", "out_of_range_kept"])
def test_out_of_range_captured_index_reads_zero(mask, kept_outside):
    mm = maskc.mask_mod(mask)
    Lq, Lkv = 40, 50
    d = torch.arange(Lq).view(-1, 1) - torch.arange(Lkv).view(1, -1)
    value = _read_with_zero_outside(TABLE, d + 2)
    keep = value > 0 if mask is _table_positive else value == 0
    assert bool(keep[(d + 2 < -len(TABLE)) | (d + 2 >= len(TABLE))].all()) == kept_outside
    # the dense evaluator of the analysis documents the same semantics
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    env = symbols_env(zero, zero, torch.arange(Lq).view(1, 1, -1, 1), torch.arange(Lkv).view(1, 1, 1, -1))
    dense = evaluate(mm.expr, env, mm.traced.tensors, mm.traced.param_values())
    assert torch.equal(dense.expand(1, 1, Lq, Lkv)[0, 0], keep)
    q, k, v = qkv(1, 1, 1, Lq, Lkv, 32)
    _check_dense(q, k, v, keep, mask_mod=mm)


def test_out_of_range_score_table_reads_zero():
    table = torch.tensor([0.5, -1.0, 2.0])  # covers q_idx - kv_idx in [-1, 1]
    Lq = Lkv = 40
    d = torch.arange(Lq).view(-1, 1) - torch.arange(Lkv).view(1, -1)
    q, k, v = qkv(1, 2, 2, Lq, Lkv, 16)
    _check_dense(q, k, v, d >= 0, bias=_read_with_zero_outside(table, d + 1).double(),
                 mask_mod=masks.causal, score_mod=scores.relative_bias(table, offset=1))
