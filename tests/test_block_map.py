"""Block maps: sound for every mask, exact for the standard ones, cheap at long lengths."""
import warnings

import pytest
import torch
from hypothesis import given
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import maskc
from maskc import masks
from maskc.analysis import EMPTY, FULL, PARTIAL, build, intervals
from maskc.analysis.dense import evaluate, symbols_env
from maskc.analysis.rows import row_pieces
from maskc.testing import (assert_block_map_exact, assert_block_map_sound, assert_close_to_reference,
                           attention_reference, dense_mask, dense_tiles)
from maskc.testing.strategies import mask_cases


def _check(assertion, case):
    assertion(case.mask_mod, case.q_len, case.kv_len, case.block_size, B=case.B, H=case.H)


# -- properties -----------------------------------------------------------------------------
@given(mask_cases())
def test_sound_for_any_mask(case):
    _check(assert_block_map_sound, case)


@given(mask_cases(standard_only=True))
def test_exact_for_standard_masks_and_compositions(case):
    _check(assert_block_map_exact, case)


@given(mask_cases(max_len=96))
def test_transposed_is_the_transpose(case):
    bm = maskc.block_map(case.mask_mod, case.q_len, case.kv_len, block_size=case.block_size, B=case.B, H=case.H)
    t = bm.transposed
    assert torch.equal(t.to_dense(), bm.to_dense().transpose(-1, -2))
    assert (t.q_len, t.kv_len, t.block_size) == (case.kv_len, case.q_len, case.block_size[::-1])
    assert (t.num_full, t.num_partial, t.num_empty) == (bm.num_full, bm.num_partial, bm.num_empty)


@given(mask_cases(max_len=96))
def test_kept_per_row_counts_the_rows_kept_tiles(case):
    bm = maskc.block_map(case.mask_mod, case.q_len, case.kv_len, block_size=case.block_size, B=case.B, H=case.H)
    assert torch.equal(bm.kept_per_row(), (bm.to_dense() != EMPTY).sum(-1).flatten())


@given(mask_cases())
def test_runs_are_sorted_and_nonempty(case):
    on_host = []  # whether the map was worked out on the host (rows.py), whose runs are the fewest
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "row_pieces", lambda *args: on_host.append(True) or row_pieces(*args))
        bm = maskc.block_map(case.mask_mod, case.q_len, case.kv_len, block_size=case.block_size, B=case.B,
                             H=case.H)
    rows = torch.arange(bm.B * bm.H * bm.n_q)
    for offsets, runs in ((bm.full_offsets, bm.full_runs), (bm.partial_offsets, bm.partial_runs)):
        row = torch.repeat_interleave(rows, offsets.diff().long())
        starts, ends = runs[:, 0], runs[:, 1]
        assert bool((starts < ends).all()) and bool((ends <= bm.n_kv).all())
        # in order within a row; touching runs of one kind could have been one
        apart = ends[:-1] < starts[1:] if on_host else ends[:-1] <= starts[1:]
        assert bool(apart[row[1:] == row[:-1]].all())


@given(mask_cases(standard_only=True))
def test_host_rows_agree_with_pieces_combined_pair_by_pair(case):
    # Row-wise masks are evaluated at once on the host (rows.py); the same thresholds, combined as
    # Pieces, are what masks mixing thresholds with captured tensors or per-tile verdicts use.
    def build_map():
        return maskc.block_map(case.mask_mod, case.q_len, case.kv_len, block_size=case.block_size, B=case.B,
                               H=case.H)

    host = build_map()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build._Analysis, "host_pieces", lambda self, e: None)
        combined = build_map()
    assert torch.equal(host.to_dense(), combined.to_dense())


# -- counts and forms -----------------------------------------------------------------------
def test_causal_counts():
    bm = maskc.block_map(masks.causal, q_len=1024, kv_len=1024, block_size=(128, 128))
    assert (bm.num_full, bm.num_partial, bm.num_empty) == (28, 8, 28)
    assert bm.sparsity == pytest.approx(28 / 64)
    assert bm.shape == (1, 1, 8, 8)


def test_to_dense_shape_dtype_and_values():
    bm = maskc.block_map(masks.causal, q_len=300, kv_len=200, block_size=(64, 32))
    dense = bm.to_dense()
    assert dense.dtype == torch.int8
    assert dense.shape == (1, 1, 5, 7)
    assert torch.equal(dense, dense_tiles(dense_mask(masks.causal, 300, 200), (64, 32)))
    assert set(dense.unique().tolist()) == {EMPTY, PARTIAL, FULL}


def test_picture():
    bm = maskc.block_map(masks.sliding_window(400), q_len=1024, kv_len=1024, block_size=(128, 128))
    text = str(bm)
    assert "sliding_window_400" in text
    assert {"█", "░", "·"} <= set(text)
    assert len(text.splitlines()) == 1 + 8 + 1  # the head, a row a tile, the legend
    assert text.splitlines()[-1] == "█ FULL: no mask code  ░ PARTIAL: mask evaluated  · EMPTY: skipped"
    assert repr(bm) == text.splitlines()[0]


def test_picture_of_many_tiles_is_downsampled():
    bm = maskc.block_map(masks.causal, q_len=1 << 16, kv_len=1 << 16, block_size=(128, 128))
    lines = str(bm).splitlines()
    assert "each character covers" in lines[1]
    assert max(len(line) for line in lines[2:-1]) <= 64


@pytest.mark.parametrize("letter, mask", [
    ("B", maskc.mask_mod(lambda b, h, q_idx, kv_idx: (b == 0) | (q_idx >= kv_idx))),
    ("H", maskc.mask_mod(lambda b, h, q_idx, kv_idx: (h == 0) | (q_idx >= kv_idx))),
])
def test_batch_or_head_dependent_masks_need_their_size(letter, mask):
    with pytest.raises(ValueError, match=f"pass {letter}="):
        maskc.block_map(mask, 128, 128, block_size=(64, 64))
    bm = maskc.block_map(mask, 128, 128, block_size=(64, 64), B=2, H=3)
    assert bm.shape == ((2, 1, 2, 2) if letter == "B" else (1, 3, 2, 2))


def test_mask_ignoring_b_and_h_is_stored_once():
    bm = maskc.block_map(masks.causal, 256, 256, block_size=(64, 64), B=4, H=8)
    assert bm.shape == (1, 1, 4, 4)
    assert bm.kernel_rows(4, 8) == (0, 0)


def test_kernel_rows_rejects_other_sizes():
    windows = torch.tensor([3, 70])

    def head_windows(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h])

    bm = maskc.block_map(head_windows, 256, 256, block_size=(64, 64), H=2)
    assert bm.kernel_rows(5, 2) == (0, 4)
    with pytest.raises(ValueError, match="built for H=2 but the inputs have H=3"):
        bm.kernel_rows(1, 3)


@pytest.mark.parametrize("kwargs, match", [
    ({"q_len": 0, "kv_len": 8}, "q_len must be a positive int"),
    ({"q_len": 8, "kv_len": 8.0}, "kv_len must be a positive int"),
    ({"q_len": 8, "kv_len": 8, "block_size": (0, 16)}, "block_size must be"),
    ({"q_len": 8, "kv_len": 8, "block_size": (16, 16, 16)}, "block_size must be"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        maskc.block_map(masks.causal, **kwargs)


def test_int_block_size_is_square():
    assert maskc.block_map(masks.causal, 100, 100, block_size=32).block_size == (32, 32)


# -- FlexAttention's BlockMask ---------------------------------------------------------------
@pytest.mark.parametrize("mask, q_len, kv_len, block_size", [
    (masks.causal, 256, 192, (64, 32)),
    (masks.prefix_lm(50), 200, 150, (64, 32)),
    (masks.sliding_window(40), 256, 256, (32, 64)),
])
def test_to_flex_block_mask(mask, q_len, kv_len, block_size):
    ours = maskc.block_map(mask, q_len, kv_len, block_size=block_size)
    dense = ours.to_dense()
    flex = ours.to_flex_block_mask()
    assert flex.BLOCK_SIZE == block_size
    assert flex.seq_lengths == (q_len, kv_len)
    assert torch.equal(flex.to_dense(), (dense != EMPTY).to(flex.to_dense().dtype))
    assert torch.equal(flex.kv_num_blocks, (dense == PARTIAL).sum(-1).int())
    assert torch.equal(flex.full_kv_num_blocks, (dense == FULL).sum(-1).int())
    for row in range(ours.n_q):
        n, nf = int(flex.kv_num_blocks[0, 0, row]), int(flex.full_kv_num_blocks[0, 0, row])
        assert flex.kv_indices[0, 0, row, :n].tolist() == (dense[0, 0, row] == PARTIAL).nonzero().view(-1).tolist()
        assert flex.full_kv_indices[0, 0, row, :nf].tolist() == (dense[0, 0, row] == FULL).nonzero().view(-1).tolist()

    # torch's own builder: the same tiles, except that it counts ragged edge tiles as partial
    theirs = create_block_mask(mask.fn, None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=block_size)
    assert torch.equal(theirs.to_dense(), flex.to_dense())
    ragged = q_len % block_size[0] or kv_len % block_size[1]
    full_ours = dense[0, 0] == FULL
    full_theirs = torch.zeros_like(full_ours)
    for row in range(ours.n_q):
        nf = int(theirs.full_kv_num_blocks[0, 0, row])
        full_theirs[row, theirs.full_kv_indices[0, 0, row, :nf].long()] = True
    if ragged:
        assert not bool((full_theirs & ~full_ours).any())
    else:
        assert torch.equal(full_theirs, full_ours)


def test_flex_block_mask_broadcast_and_runs_in_flex_attention():
    mask = masks.and_masks(masks.causal, masks.not_mask(masks.chunked_causal(48)))
    bm = maskc.block_map(mask, 160, 160, block_size=(32, 32))
    flex = bm.to_flex_block_mask(B=2, H=3)
    assert flex.kv_num_blocks.shape == (2, 3, 5)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 160, 16, generator=gen) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused: expected here
        out = flex_attention(q, k, v, block_mask=flex)
    ref, _ = attention_reference(q, k, v, mask_mod=mask)
    # rows with nothing kept: flex gives 0, like our reference
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# -- particular masks -----------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_unsorted_document_ids(causal):
    ids = torch.tensor([0, 0, 1, 1, 1, 0, 2, 2, 1, 1, 1, 1, 0] * 20, dtype=torch.int32)
    mask = masks.document(ids, causal=causal)
    for block_size in [(16, 16), (32, 48), (64, 16)]:
        assert_block_map_exact(mask, len(ids), len(ids) - 7, block_size)



@pytest.mark.parametrize("causal", [False, True])
def test_document_boundaries_are_decided_without_dense_work(causal, monkeypatch):
    # On a tile across a document boundary, ids[q_idx] - ids[kv_idx] ranges over an interval
    # with an end at 0, attained: the tile surely mixes kept and dropped pairs. Only the tiles
    # where a boundary crosses the diagonal (q and kv tiles both across it) remain to settle.
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 250, 70, 90]))  # boundaries in 3 tiles
    settled = []
    real = build._Analysis._dense_verdict

    def counted(self, tiles):
        settled.append(len(tiles))
        return real(self, tiles)

    monkeypatch.setattr(build._Analysis, "_dense_verdict", counted)
    assert_block_map_exact(masks.document(ids, causal=causal), 510, 510, (32, 32))
    assert max(settled, default=0) <= 3  # per build (the exactness check builds more than once)

@pytest.mark.parametrize("block_size", [(16, 32), (48, 16), (5, 3)])
def test_out_of_range_table_index_reads_zero(block_size):
    # distance q - kv in [-1, 2] reads the table, [-5, -2] too (from the end, as torch's negative
    # indices); elsewhere the kernel reads 0
    table = torch.tensor([1, 0, 1, 1])

    def short_table(b, h, q_idx, kv_idx):
        return table[q_idx - kv_idx + 1] != 0

    mm = maskc.mask_mod(short_table)
    q_len, kv_len = 100, 90
    # dense_mask runs the Python function, where torch would raise; evaluate the traced expression
    # instead, with the kernel's reading of 0 out of range.
    qi, ki = torch.arange(q_len).view(-1, 1), torch.arange(kv_len).view(1, -1)
    keep = evaluate(mm.expr, symbols_env(torch.tensor(0), torch.tensor(0), qi, ki), mm.traced.tensors, {})
    index = qi - ki + 1
    index = torch.where(index < 0, index + 4, index)
    expected = (index >= 0) & (index < 4) & (table[index.clamp(0, 3)] != 0)
    assert torch.equal(keep, expected)
    want = dense_tiles(expected.view(1, 1, q_len, kv_len), block_size)
    got = maskc.block_map(mm, q_len, kv_len, block_size=block_size).to_dense()
    assert not bool(((got == FULL) & (want != FULL)).any()), "unsound: FULL tile that drops pairs"
    assert not bool(((got == EMPTY) & (want != EMPTY)).any()), "unsound: EMPTY tile that keeps pairs"
    assert torch.equal(got, want)


@pytest.mark.parametrize("fn", [
    lambda b, h, q_idx, kv_idx: (q_idx * kv_idx) % 7 == 0,
    lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) ** 2 <= 30,
    lambda b, h, q_idx, kv_idx: kv_idx % (q_idx + 1) == 0,
], ids=["product_mod", "square", "variable_modulus"])
@pytest.mark.parametrize("q_len, kv_len, block_size", [(100, 130, (16, 16)), (77, 77, (48, 32)), (60, 50, (5, 3))])
def test_undecidable_operations_are_settled_densely(fn, q_len, kv_len, block_size):
    assert_block_map_exact(fn, q_len, kv_len, block_size)


@pytest.mark.parametrize("fn", [
    lambda b, h, q_idx, kv_idx: kv_idx <= q_idx * q_idx,  # a threshold whose bound has no interval rule
    lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 3),  # partial edges meet in a tile
    lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= 2 * h + 5) & (kv_idx <= q_idx) | (h == 1),
], ids=["square_bound", "narrow_window", "per_head"])
@pytest.mark.parametrize("q_len, kv_len, block_size", [(100, 130, (16, 16)), (77, 77, (48, 32)), (60, 50, (5, 3))])
def test_row_wise_masks_that_need_settling_or_heads(fn, q_len, kv_len, block_size):
    assert_block_map_exact(fn, q_len, kv_len, block_size, H=3)


def test_settling_decides_tiles():
    # no interval rule covers these, yet the map has FULL and EMPTY tiles: settling found them
    for fn in (lambda b, h, q_idx, kv_idx: (q_idx * kv_idx) % 7 == 0,
               lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) ** 2 <= 30):
        bm = maskc.block_map(fn, 60, 50, block_size=(5, 3))
        assert bm.num_empty > 0 and bm.num_full + bm.num_partial > 0


def test_constant_masks():
    everything = maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= 0)
    nothing = masks.not_mask(everything)
    full = maskc.block_map(everything, 100, 70, block_size=(32, 32))
    empty = maskc.block_map(nothing, 100, 70, block_size=(32, 32))
    assert (full.num_full, full.num_partial) == (4 * 3, 0)
    assert (empty.num_full, empty.num_partial, empty.sparsity) == (0, 0, 1.0)


# -- cost ---------------------------------------------------------------------------------
def test_million_token_causal():
    n = (1 << 20) // 128
    bm = maskc.block_map(masks.causal, 1 << 20, 1 << 20, block_size=(128, 128))
    assert (bm.num_full, bm.num_partial) == (n * (n - 1) // 2, n)
    assert len(bm.full_runs) <= n and len(bm.partial_runs) == n  # one run of each per row


def test_million_token_sliding_window():
    n, k = (1 << 20) // 128, 1024 // 128  # tiles per side, window in tiles
    bm = maskc.block_map(masks.sliding_window(1024), 1 << 20, 1 << 20, block_size=(128, 128))
    # rows past the start: the diagonal and the window's far edge are partial, k - 1 tiles between are full
    assert bm.num_partial == 2 * n - k
    assert bm.num_full == k * (k - 1) // 2 + (k - 1) * (n - k)


def test_later_builds_at_other_lengths_and_values_do_no_sympy_work():
    maskc.block_map(masks.and_masks(masks.sliding_window(100), masks.prefix_lm(30)), 1000, 1000)
    caches = (build._kv_linear, build._negated, build._reads_kv, intervals._affine_form)
    misses = [c.cache_info().misses for c in caches]
    maskc.block_map(masks.and_masks(masks.sliding_window(700), masks.prefix_lm(50)), 3000, 2000, block_size=(64, 32))
    assert [c.cache_info().misses for c in caches] == misses


# -- devices ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [masks.causal, masks.sliding_window(300), masks.not_mask(masks.sliding_window(300))])
def test_threshold_masks_are_analysed_on_the_host_for_another_device(mask):
    # On a GPU every small step of the analysis would be a kernel launch: the host takes them and
    # only the finished tables cross. A meta target holds no data, so nothing else can have run there.
    here = maskc.block_map(mask, 4096, 4000, block_size=(128, 64))
    there = maskc.block_map(mask, 4096, 4000, block_size=(128, 64), device="meta")
    assert there.device == torch.device("meta") and there.shape == here.shape
    for name in ("full_offsets", "full_runs", "partial_offsets", "partial_runs"):
        assert getattr(there, name).shape == getattr(here, name).shape


def test_per_tile_verdicts_and_captured_tensors_stay_on_the_target_device():
    cuda = torch.device("cuda", 0)
    for mask in (masks.chunked_causal(256), masks.document(torch.zeros(64, dtype=torch.int64))):
        assert build._work_device(mask.traced, cuda) == cuda
    assert build._work_device(masks.causal.traced, cuda) == torch.device("cpu")


# -- a map's batch and head rows against the call's --------------------------------------------
_BANDS = torch.tensor([0, 200])
_HEAD_BANDS = torch.tensor([0, 40, 80, 160])


def _band_per_batch(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= _BANDS[b]) & (q_idx >= kv_idx)


def _band_per_head(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= _HEAD_BANDS[h]) & (q_idx >= kv_idx)


@pytest.mark.parametrize("mod, rows, name", [(_band_per_batch, {"B": 1}, "B"), (_band_per_head, {"H": 1}, "H")])
def test_one_row_of_a_mask_that_reads_b_or_h_is_refused_for_more(mod, rows, name):
    # b = 0's (h = 0's) tiles served every row: whole tiles of the others skipped (errors of 1.7)
    q = torch.randn(2, 4, 256, 16, generator=torch.Generator().manual_seed(0))
    bm = maskc.block_map(mod, 256, 256, block_size=(64, 64), **rows)
    given = {"B": 2, "H": 4}[name]
    with pytest.raises(maskc.MaskcError, match=rf"reads {name.lower()}, was built with {name}=1 but the inputs "
                                               rf"have {name}={given}.*build it with {name}={given}"):
        maskc.compiled_attention(q, q, q, mask_mod=mod, block_map=bm)
    for block_mask in (create_block_mask(mod, None, None, 256, 256, device="cpu"),
                       maskc.create_block_mask(mod, None, None, 256, 256, device="cpu")):
        with pytest.raises(maskc.MaskcError, match=rf"was built with {name}=1"):
            maskc.flex_attention(q, q, q, block_mask=block_mask)
    whole = maskc.block_map(mod, 256, 256, block_size=(64, 64), B=2, H=4)
    out = maskc.compiled_attention(q, q, q, mask_mod=mod, block_map=whole)
    assert_close_to_reference(out, attention_reference(q, q, q, mask_mod=mod)[0])


def test_one_row_still_serves_every_batch_and_head_of_a_mask_that_reads_neither():
    q = torch.randn(2, 4, 100, 16, generator=torch.Generator().manual_seed(0))
    bm = maskc.block_map(masks.sliding_window(30), 100, 100, block_size=(32, 32))
    assert (bm.B, bm.H) == (1, 1)
    out = maskc.compiled_attention(q, q, q, mask_mod=masks.sliding_window(30), block_map=bm)
    assert_close_to_reference(out, attention_reference(q, q, q, mask_mod=masks.sliding_window(30))[0])
