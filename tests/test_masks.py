"""The standard library of masks and score mods: names, argument checks, dense references."""
import re

import pytest
import torch
from hypothesis import given

from maskc import masks, scores
from maskc.testing import attention_reference, dense_mask
from maskc.testing.strategies import attention_inputs

IDS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 0, 0, 3, 3, 3, 1, 1, 1])  # unsorted: documents resume
KV_IDS = torch.tensor([0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0, 1, 1, 1, 2, 2, 2, 2])
Q_LEN, KV_LEN = len(IDS), len(KV_IDS)
q = torch.arange(Q_LEN).view(-1, 1)
kv = torch.arange(KV_LEN).view(1, -1)
CAUSAL = q >= kv
DIFF = q - kv


@pytest.mark.parametrize("mask, name", [
    (masks.causal, "causal"),
    (masks.sliding_window(1024), "sliding_window_1024"),
    (masks.prefix_lm(2048), "prefix_lm_2048"),
    (masks.chunked_causal(512), "chunked_causal_512"),
    (masks.dilated_sliding_window(256, 2), "dilated_sliding_window_256_2"),
    (masks.document(IDS), "document"),
    (masks.document(IDS, causal=True), "document_causal"),
    (masks.and_masks(masks.causal, masks.prefix_lm(64)), "and(causal, prefix_lm_64)"),
    (masks.or_masks(masks.sliding_window(64), masks.prefix_lm(16)), "or(sliding_window_64, prefix_lm_16)"),
    (masks.not_mask(masks.causal), "not(causal)"),
    (masks.and_masks(masks.not_mask(masks.causal), masks.or_masks(masks.causal, masks.chunked_causal(4))),
     "and(not(causal), or(causal, chunked_causal_4))"),
    (scores.softcap(30), "softcap_30"),
    (scores.softcap(2.5), "softcap_2.5"),
    (scores.alibi(scores.alibi_slopes(8)), "alibi"),
    (scores.relative_bias(torch.zeros(15)), "relative_bias"),
])
def test_names(mask, name):
    assert mask.__name__ == name
    assert repr(mask).startswith(f"{type(mask).__name__}({name}: ")


@pytest.mark.parametrize("make, match", [
    (lambda: masks.sliding_window(-1), "window must be a non-negative int, got -1"),
    (lambda: masks.sliding_window(1.5), "window must be a non-negative int, got 1.5"),
    (lambda: masks.sliding_window(True), "window must be a non-negative int, got True"),
    (lambda: masks.prefix_lm(-3), "prefix must be a non-negative int, got -3"),
    (lambda: masks.chunked_causal(0), "chunk must be at least 1, got 0"),
    (lambda: masks.chunked_causal("8"), "chunk must be a non-negative int, got '8'"),
    (lambda: masks.dilated_sliding_window(8, 0), "dilation must be at least 1, got 0"),
    (lambda: masks.dilated_sliding_window(-8, 2), "window must be a non-negative int, got -8"),
    (lambda: masks.document(IDS.float()), "doc_ids must be a 1-d integer tensor, got a 1-d torch.float32 tensor"),
    (lambda: masks.document(IDS.view(1, -1)), "doc_ids must be a 1-d integer tensor, got a 2-d torch.int64 tensor"),
    (lambda: masks.document([0, 0, 1]), "doc_ids must be a 1-d integer tensor, got list"),
    (lambda: masks.document(IDS, kv_doc_ids=KV_IDS.double()), "kv_doc_ids must be a 1-d integer tensor"),
    (lambda: masks.and_masks(), "and_masks needs at least one mask_mod, got none"),
    (lambda: masks.or_masks(), "or_masks needs at least one mask_mod, got none"),
    (lambda: scores.softcap(0), "cap must be a positive finite number, got 0"),
    (lambda: scores.softcap(float("inf")), "cap must be a positive finite number, got inf"),
    (lambda: scores.softcap(True), "cap must be a positive finite number, got True"),
    (lambda: scores.alibi_slopes(0), "num_heads must be a positive int, got 0"),
    (lambda: scores.alibi(torch.arange(4)), "slopes must be a 1-d floating-point tensor"),
    (lambda: scores.relative_bias(torch.zeros(2, 2, 2)), "table must be a 1-d or 2-d"),
    (lambda: scores.relative_bias(torch.zeros(9), offset=1.5), "offset must be an int, got 1.5"),
])
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        make()


def test_composing_a_score_mod_is_refused():
    with pytest.raises(TypeError, match="expected a mask_mod, got a score_mod"):
        masks.and_masks(masks.causal, scores.softcap(30))


DENSE_CASES = [
    (masks.causal, CAUSAL),
    (masks.sliding_window(0), q == kv),
    (masks.sliding_window(4), CAUSAL & (q - kv <= 4)),
    (masks.prefix_lm(0), CAUSAL),
    (masks.prefix_lm(5), (kv < 5) | CAUSAL),
    (masks.chunked_causal(1), q == kv),
    (masks.chunked_causal(4), (q // 4 == kv // 4) & CAUSAL),
    (masks.dilated_sliding_window(6, 2), (DIFF >= 0) & (DIFF <= 6) & (DIFF % 2 == 0)),
    (masks.dilated_sliding_window(9, 3), (DIFF >= 0) & (DIFF <= 9) & (DIFF % 3 == 0)),
    (masks.document(torch.cat([IDS, IDS])), IDS.view(-1, 1) == torch.cat([IDS, IDS])[:KV_LEN].view(1, -1)),
    (masks.document(IDS.int(), kv_doc_ids=KV_IDS), IDS.view(-1, 1) == KV_IDS.view(1, -1)),
    (masks.document(IDS, causal=True, kv_doc_ids=KV_IDS), (IDS.view(-1, 1) == KV_IDS.view(1, -1)) & CAUSAL),
    (masks.and_masks(masks.causal, masks.prefix_lm(5), masks.sliding_window(7)),
     CAUSAL & ((kv < 5) | CAUSAL) & (q - kv <= 7)),
    (masks.or_masks(masks.sliding_window(2), masks.chunked_causal(6)),
     (CAUSAL & (q - kv <= 2)) | ((q // 6 == kv // 6) & CAUSAL)),
    (masks.not_mask(masks.causal), q < kv),
    (masks.not_mask(masks.or_masks(masks.causal, masks.prefix_lm(3))), ~(CAUSAL | (kv < 3))),
]


@pytest.mark.parametrize("mask, expected", DENSE_CASES, ids=[m.__name__ for m, _ in DENSE_CASES])
def test_dense_reference(mask, expected):
    got = dense_mask(mask, Q_LEN, KV_LEN)
    assert got.shape == (1, 1, Q_LEN, KV_LEN) and got.dtype == torch.bool
    assert torch.equal(got[0, 0], expected)


def test_dense_mask_broadcasts_b_and_h():
    windows = torch.tensor([0, 3, 100])

    def head_windows(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h]) & (b == 0)

    got = dense_mask(head_windows, Q_LEN, KV_LEN, B=2, H=3)
    assert got.shape == (2, 3, Q_LEN, KV_LEN)
    for h, w in enumerate(windows.tolist()):
        assert torch.equal(got[0, h], CAUSAL & (q - kv <= w))
    assert not got[1].any()


def test_dense_mask_calls_the_original_function():
    seen = []

    def spy(b, h, q_idx, kv_idx):
        if isinstance(q_idx, torch.Tensor):  # not while traced: a mod may not change what it reads then
            seen.append(type(q_idx))
        return q_idx >= kv_idx

    mm = masks.and_masks(spy)  # traced on creation, with proxies
    assert seen == []
    assert torch.equal(dense_mask(mm, 5, 5)[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())
    assert seen == [torch.Tensor]


def test_constant_result_is_broadcast():
    got = dense_mask(lambda b, h, q_idx, kv_idx: True, 3, 4, B=2)
    assert got.shape == (2, 1, 3, 4) and got.all()


def test_masks_stay_callable_with_python_numbers():
    assert masks.sliding_window(4)(0, 0, 10, 3) is False
    assert masks.sliding_window(4)(0, 0, 10, 6) is True
    assert masks.prefix_lm(5)(0, 0, 0, 4) is True


def test_scores_compute_their_formulas():
    score = torch.randn(1, 2, Q_LEN, KV_LEN, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 40
    b, h = torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(2).view(1, -1, 1, 1)
    torch.testing.assert_close(scores.softcap(30).fn(score, b, h, q, kv), 30 * torch.tanh(score / 30))
    slopes = scores.alibi_slopes(2)
    assert torch.allclose(slopes, torch.tensor([2.0**-4, 2.0**-8]))
    # built where q, k and v live (a captured tensor must be on their device)
    assert scores.alibi_slopes(2, device="meta").device.type == "meta"
    torch.testing.assert_close(scores.alibi(slopes).fn(score, b, h, q, kv),
                               score + slopes.view(1, -1, 1, 1).double() * (kv - q))
    table = torch.randn(2, Q_LEN + KV_LEN - 1, dtype=torch.float64)
    biased = scores.relative_bias(table, offset=KV_LEN - 1).fn(score, b, h, q, kv)
    torch.testing.assert_close(biased, score + table[:, (q - kv + KV_LEN - 1)].view(1, 2, Q_LEN, KV_LEN))


@given(attention_inputs())
def test_drawn_attention_inputs_are_well_formed(inputs):
    B, Hq, Lq, D = inputs.q.shape
    _, Hkv, Lkv, Dv = inputs.v.shape
    assert inputs.k.shape == (B, Hkv, Lkv, D) and Hq % Hkv == 0 and inputs.enable_gqa == (Hq != Hkv)
    assert Lq <= 80 and Lkv <= 80 and inputs.q.dtype == inputs.k.dtype == inputs.v.dtype
    out, lse = attention_reference(inputs.q, inputs.k, inputs.v, **inputs.kwargs())
    assert out.shape == (B, Hq, Lq, Dv) and lse.shape == (B, Hq, Lq)
    assert not out.isnan().any() and not lse.isnan().any()
    assert "AttentionInputs(q=" in repr(inputs)
