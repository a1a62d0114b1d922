"""maskc.flex_attention and maskc.create_block_mask as a drop-in for FlexAttention's, and the
conversion of torch BlockMasks to maskc BlockMaps and back.

torch's flex_attention runs eagerly on CPU tensors (unfused, dense) and is the comparison
here beside maskc's float64 reference. Eager FlexAttention applies only the mask_mod, where its
compiled kernels also skip the tiles a BlockMask leaves out; maskc follows the compiled
kernels, so a hand-made BlockMask is checked against a reference built from its tiles. Shapes
are tiny: maskc's kernels run in Triton's interpreter.
"""
import importlib.util
import itertools
import logging
import math
import re
import warnings

import numpy as np
import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import maskc
from _inputs import qkv
from maskc import masks
from maskc.analysis import EMPTY, FULL, PARTIAL
from maskc.integrations import flex
from maskc.runtime.tiles import choose
from maskc.testing import assert_gradient_close_to_reference, attention_reference

# What a FlexAttention user writes; only the import line differs between the two copies.
SNIPPET = '''
import torch
from {source} import create_block_mask, flex_attention


def mods(document_ids, slopes):
    def document_causal(b, h, q_idx, kv_idx):
        return (document_ids[q_idx] == document_ids[kv_idx]) & (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    return document_causal, alibi


def attend(q, k, v, document_ids, slopes, block_size=128):
    document_causal, alibi = mods(document_ids, slopes)
    block_mask = create_block_mask(document_causal, None, None, q.shape[-2], k.shape[-2], device=q.device,
                                   BLOCK_SIZE=block_size)
    return flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, enable_gqa=True)
'''


def _snippet(tmp_path, source: str):
    name = "snippet_" + source.replace(".", "_")
    path = tmp_path / f"{name}.py"
    path.write_text(SNIPPET.format(source=source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torch_flex(*args, **kwargs):
    with warnings.catch_warnings():  # eager on CPU is unfused (and return_lse deprecated): said once per process
        warnings.simplefilter("ignore")
        return torch_flex.flex_attention(*args, **kwargs)


def _tiles(block_mask) -> torch.Tensor:
    """int8 [B, H, q_blocks, kv_blocks] of a torch BlockMask: 0 EMPTY, 1 PARTIAL, 2 FULL, read from its lists."""
    n_kv = -(-block_mask.seq_lengths[1] // block_mask.BLOCK_SIZE[1])
    grid = torch.zeros(*block_mask.kv_num_blocks.shape, n_kv, dtype=torch.int8)
    for num, idx, value in ((block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL),
                            (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)):
        if num is None:
            continue
        for row in itertools.product(*map(range, num.shape)):
            listed = idx[row][: num[row]].long()
            assert not grid[row][listed].any(), f"row {row} lists a block twice"
            grid[row][listed] = value
    return grid


DOCS = torch.tensor([0] * 30 + [1] * 25 + [2] * 45)  # 100 positions, documents across tile edges


def _document_causal(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


# -- the drop-in --------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [128, 32])
def test_a_flex_attention_snippet_runs_unchanged_with_the_maskc_imports(tmp_path, block_size):
    theirs, ours = _snippet(tmp_path, "torch.nn.attention.flex_attention"), _snippet(tmp_path, "maskc")
    q, k, v = qkv(2, 4, 2, 80, 80)
    document_ids = DOCS[:80].clone()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = theirs.attend(q, k, v, document_ids, slopes, block_size)
    out = ours.attend(q, k, v, document_ids, slopes, block_size)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    mask_mod, score_mod = ours.mods(document_ids, slopes)
    ref, _ = attention_reference(q, k, v, mask_mod=mask_mod, score_mod=score_mod, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_create_block_mask_returns_torchs_block_mask_with_torchs_tiles():
    # Lengths that are not multiples of the block size: torch counts the padding of a ragged edge
    # tile as masked (PARTIAL), maskc's analysis counts only in-range pairs (FULL where all are kept).
    cases = ((masks.causal, 100, 72), (masks.sliding_window(20), 90, 90), (_document_causal, 100, 100))
    for mask_mod, lq, lkv in cases:
        ours = maskc.create_block_mask(mask_mod, 2, None, lq, lkv, device="cpu", BLOCK_SIZE=(32, 16))
        theirs = torch_flex.create_block_mask(mask_mod, 2, None, lq, lkv, device="cpu", BLOCK_SIZE=(32, 16))
        assert isinstance(ours, maskc.BlockMask) and maskc.BlockMask is torch_flex.BlockMask
        assert ours.shape == theirs.shape and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
        a, b = _tiles(ours), _tiles(theirs)
        assert torch.equal(a != EMPTY, b != EMPTY)
        differ = (a != b).nonzero()
        assert all(a[tuple(t)] == FULL and b[tuple(t)] == PARTIAL for t in differ)
        last_row = (differ[:, 2] == a.shape[2] - 1) & bool(lq % 32)
        last_column = (differ[:, 3] == a.shape[3] - 1) & bool(lkv % 16)
        assert (last_row | last_column).all()


@pytest.mark.parametrize("length", [torch.tensor(48), np.int64(48)], ids=["0-d tensor", "numpy int"])
def test_create_block_mask_takes_lengths_as_torch_takes_them(length):
    # lingua's generate.py passes lengths.sum(), a 0-d tensor; torch's create_block_mask takes it
    ours = maskc.create_block_mask(masks.causal, 1, None, length, 48, device="cpu", BLOCK_SIZE=16)
    theirs = torch_flex.create_block_mask(masks.causal, 1, None, length, 48, device="cpu", BLOCK_SIZE=16)
    assert tuple(int(n) for n in ours.seq_lengths) == (48, 48)
    assert torch.equal(_tiles(ours), _tiles(theirs))


def test_create_block_mask_without_full_blocks_lists_every_kept_tile_as_partial():
    bm = maskc.create_block_mask(masks.causal, None, None, 100, 100, device="cpu", BLOCK_SIZE=32,
                                 separate_full_blocks=False)
    assert bm.full_kv_num_blocks is None
    assert torch.equal(_tiles(bm), torch.tril(torch.ones(4, 4, dtype=torch.int8)).view(1, 1, 4, 4))


def test_small_names_match_torchs():
    sliding, prefix = masks.sliding_window(5), masks.prefix_lm(7)
    for ours, theirs in ((maskc.and_masks(masks.causal, sliding), torch_flex.and_masks(masks.causal, sliding)),
                         (maskc.or_masks(prefix, sliding), torch_flex.or_masks(prefix, sliding)),
                         (maskc.noop_mask, torch_flex.noop_mask)):
        assert torch.equal(maskc.create_mask(ours, 1, 2, 24, 30, device="cpu"),
                           torch_flex.create_mask(theirs, 1, 2, 24, 30, device="cpu"))
    assert maskc.create_mask(maskc.noop_mask, None, None, 3, 4, device="cpu").all()
    # the types an import line names beside them (torch 2.9+), torch's own
    from maskc import AuxOutput, AuxRequest, FlexKernelOptions
    assert (AuxOutput, AuxRequest, FlexKernelOptions) == (torch_flex.AuxOutput, torch_flex.AuxRequest,
                                                         torch_flex.FlexKernelOptions)


# -- BlockMask <-> BlockMap ---------------------------------------------------------------------
ROUND_TRIP = [
    (masks.causal, 100, 72, (32, 32)),
    (masks.sliding_window(20), 90, 90, (16, 64)),
    (masks.document(DOCS, causal=True), 100, 100, (32, 16)),
]


@pytest.mark.parametrize("mask_mod, lq, lkv, block_size", ROUND_TRIP)
def test_block_map_round_trips_through_block_mask(mask_mod, lq, lkv, block_size):
    bm = maskc.block_map(mask_mod, lq, lkv, block_size=block_size)
    back = maskc.BlockMap.from_flex_block_mask(bm.to_flex_block_mask())
    assert torch.equal(back.to_dense(), bm.to_dense())
    assert (back.q_len, back.kv_len, back.block_size, back.shape) == (lq, lkv, block_size, bm.shape)
    assert back.traced.signature == bm.traced.signature
    assert [t is u for t, u in zip(back.traced.tensors, bm.traced.tensors)] == [True] * len(bm.traced.tensors)


@pytest.mark.parametrize("mask_mod, lq, lkv, block_size", ROUND_TRIP)
def test_torchs_block_mask_round_trips_through_block_map(mask_mod, lq, lkv, block_size):
    theirs = torch_flex.create_block_mask(mask_mod, 2, 3, lq, lkv, device="cpu", BLOCK_SIZE=block_size)
    bm = maskc.BlockMap.from_flex_block_mask(theirs)
    assert torch.equal(bm.to_dense(), _tiles(theirs))
    again = bm.to_flex_block_mask()
    assert torch.equal(_tiles(again), _tiles(theirs))
    assert (again.seq_lengths, again.BLOCK_SIZE, again.shape) == (theirs.seq_lengths, theirs.BLOCK_SIZE, theirs.shape)
    assert torch.equal(again.to_dense(), theirs.to_dense())


def test_conversion_is_linear_in_tiles_not_pairs():
    # 65536² pairs would take 4 GiB as a bool mask; 512² tiles take a quarter of a MiB
    length = 1 << 16
    for mask_mod in (masks.causal, masks.sliding_window(1000)):
        made = maskc.create_block_mask(mask_mod, None, None, length, length, device="cpu")
        bm = maskc.BlockMap.from_flex_block_mask(made)
        analysed = maskc.block_map(mask_mod, length, length, block_size=128)
        assert (bm.num_full, bm.num_partial) == (analysed.num_full, analysed.num_partial)


# -- maskc.flex_attention with BlockMasks ----------------------------------------------------------
def test_a_torch_block_mask_drives_maskc_flex_attention():
    docs = torch.stack([DOCS[:70], DOCS[30:]])  # a different document layout per batch

    def per_batch_documents(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    block_mask = torch_flex.create_block_mask(per_batch_documents, 2, None, 70, 70, device="cpu", BLOCK_SIZE=32)
    q, k, v = qkv(2, 2, 2, 70, 70, seed=1)
    out = maskc.flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(out, _torch_flex(q, k, v, block_mask=block_mask), atol=2e-5, rtol=2e-5)
    ref, _ = attention_reference(q, k, v, mask_mod=per_batch_documents)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_a_hand_made_block_mask_is_read_as_flexattentions_kernels_read_it():
    # Row 0: the diagonal tile, masked. Row 1: the diagonal tile listed FULL, so it runs without
    # the mask (its upper triangle is attended). Row 2: only tile 0, masked; the diagonal tile is
    # skipped, and rows from 90 on keep nothing at all.
    def causal_below_90(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx < 90)

    kv_num = torch.tensor([[[1, 0, 1]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 1, 2], [0, 1, 2], [0, 1, 2]]]], dtype=torch.int32)
    full_num = torch.tensor([[[0, 1, 0]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 1, 2], [1, 0, 2], [0, 1, 2]]]], dtype=torch.int32)
    block_mask = torch_flex.BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=32,
                                                     mask_mod=causal_below_90, seq_lengths=(96, 96))
    q, k, v = qkv(1, 2, 2, 96, 96, seed=2)
    out, lse = maskc.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)

    pos = torch.arange(96)
    tile = torch.tensor([[PARTIAL, EMPTY, EMPTY], [EMPTY, FULL, EMPTY], [PARTIAL, EMPTY, EMPTY]])
    tiles = tile[pos.view(-1, 1) // 32, pos.view(1, -1) // 32]
    keep = (tiles == FULL) | ((tiles == PARTIAL) & causal_below_90(0, 0, pos.view(-1, 1), pos.view(1, -1)))
    ref_out, ref_lse = attention_reference(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: keep[q_idx, kv_idx])
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    assert (out[:, :, 90:] == 0).all() and torch.isneginf(lse[:, :, 90:]).all()


@pytest.mark.parametrize("q_len", [1, 20])
def test_a_block_mask_made_for_more_queries_serves_its_first_rows(q_len):
    # pytorch's test_flex_decoding idiom: a mask of the whole cache, seq_lengths set for the step
    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)

    block_mask = torch_flex.create_block_mask(sliding, 1, 1, 128, 128, device="cpu", BLOCK_SIZE=16)
    block_mask.seq_lengths = (q_len, 128)
    q, k, v = qkv(1, 2, 2, q_len, 128, seed=3)
    out = maskc.flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(out, torch_flex.flex_attention(q, k, v, block_mask=block_mask), atol=2e-5, rtol=2e-5)
    ref, _ = attention_reference(q, k, v, mask_mod=sliding)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    short = torch_flex.create_block_mask(sliding, 1, 1, 16, 128, device="cpu", BLOCK_SIZE=16)
    short.seq_lengths = (20, 128)
    with pytest.raises(ValueError, match=r"block_mask has 1 rows of q blocks, but its seq_lengths \(20, 128\)"):
        maskc.flex_attention(qkv(1, 2, 2, 20, 128)[0], k, v, block_mask=short)


def test_blocks_larger_than_the_kernels_tiles_are_read_as_flex_attention_reads_them():
    """torch's own no-op BlockMask (one block of 2**30 made for lengths (1, 1), which torch's
    flex_attention does not check) and hand-made blocks of 512: each block's status holds for
    every kernel tile in it. Both were refused for their BLOCK_SIZE."""
    q, k, v = qkv(1, 2, 2, 600, 600, seed=5)
    no_op = torch_flex._create_empty_block_mask(q, k)
    torch.testing.assert_close(maskc.flex_attention(q, k, v, block_mask=no_op), _torch_flex(q, k, v),
                               atol=2e-5, rtol=2e-5)
    # q block 0 lists kv block 0, q block 1 kv block 1, both partial (causal decides inside)
    blocks = torch_flex.BlockMask.from_kv_blocks(torch.ones(1, 1, 2, dtype=torch.int32),
                                                 torch.tensor([[[[0, 0], [1, 0]]]], dtype=torch.int32),
                                                 BLOCK_SIZE=512, mask_mod=masks.causal, seq_lengths=(600, 600))

    def block_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // 512 == kv_idx // 512)

    want, _ = attention_reference(q, k, v, mask_mod=block_causal)
    torch.testing.assert_close(maskc.flex_attention(q, k, v, block_mask=blocks).double(), want, atol=2e-5,
                               rtol=2e-5)
    assert flex.converted(blocks).block_size == (256, 256)  # the kernels' largest tile
    assert flex.converted(maskc.create_block_mask(masks.causal, None, None, 600, 600, device="cpu",
                                                  BLOCK_SIZE=256)).block_size == (256, 256)


# Blocks that are multiples of 16 but not powers of two (FlashAttention 4's tests use (128, 112)),
# with the power-of-two tiles maskc reads them at.
ODD_BLOCKS = [((128, 112), (128, 16)), ((112, 96), (16, 32)), ((48, 80), (16, 16))]
ODD_DOCS = torch.tensor([0] * 70 + [1] * 95 + [2] * 95)  # 260 positions, documents across block edges


def _document_sliding(b, h, q_idx, kv_idx):
    return (ODD_DOCS[q_idx] == ODD_DOCS[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < 64)


@pytest.mark.parametrize("blocks, tiles", ODD_BLOCKS, ids=[str(b) for b, _ in ODD_BLOCKS])
@pytest.mark.parametrize("maker", ["maskc", "torch"])
@pytest.mark.parametrize("mask_mod", [masks.causal, _document_sliding], ids=["causal", "document_sliding"])
def test_blocks_that_are_multiples_of_16_run_exactly(blocks, tiles, maker, mask_mod):
    """Each block is read as the power-of-two tiles inside it, each with its block's status, so
    the tiles FlexAttention runs are the tiles maskc runs; forward and backward match the float64
    reference and torch's own flex_attention (eager on CPU) at lengths that are not multiples."""
    create = maskc.create_block_mask if maker == "maskc" else torch_flex.create_block_mask
    block_mask = create(mask_mod, None, None, 250, 230, device="cpu", BLOCK_SIZE=blocks)
    converted = flex.converted(block_mask)
    assert converted.block_size == tiles
    # so read at the kernels' own tiles, however coarser
    assert converted.agrees_with_mask and converted.coarsens_exactly(256, 256)
    rows = torch.arange(converted.n_q) * tiles[0] // blocks[0]
    columns = torch.arange(converted.n_kv) * tiles[1] // blocks[1]
    assert torch.equal(converted.to_dense(), _tiles(block_mask)[:, :, rows][..., columns])
    q, k, v, d_out = qkv(1, 2, 2, 250, 230, seed=11, requires_grad=True, grad_out=True)
    out = maskc.flex_attention(q, k, v, block_mask=block_mask)
    theirs = _torch_flex(q.detach(), k.detach(), v.detach(), block_mask=block_mask)  # no backward on CPU
    torch.testing.assert_close(out.detach(), theirs, atol=2e-5, rtol=2e-5)
    ref, _ = attention_reference(q, k, v, mask_mod=mask_mod)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    expected = torch.autograd.grad(ref, (q, k, v), d_out.double())
    for got, want, name in zip(grads, expected, "qkv"):
        assert_gradient_close_to_reference(got, want, torch.float32, f"d{name}")


def test_a_hand_made_block_mask_of_112_wide_blocks_skips_the_blocks_it_leaves_out():
    """q block 1 leaves out kv block 0, which causal keeps whole: FlexAttention's kernels skip it
    (its eager CPU path applies only the mask_mod), and maskc must too."""
    kv_num = torch.tensor([[[2, 2]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 1, 2], [1, 2, 0]]]], dtype=torch.int32)
    block_mask = torch_flex.BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(128, 112), mask_mod=masks.causal,
                                                     seq_lengths=(250, 300))
    converted = flex.converted(block_mask)
    assert not converted.agrees_with_mask
    # the kernels' 32-wide tiles would mix kv block 0's last 16 keys with block 1's first
    assert converted.coarsens_exactly(32, 16) and not converted.coarsens_exactly(32, 32)
    chosen = choose(64, "cpu", 4, block_map_size=converted.block_size, reads_exactly=converted.coarsens_exactly)
    assert [(c.block_m, c.block_n) for c in (chosen.forward, *chosen.backward)] == [(32, 16)] * 3
    q, k, v = qkv(1, 2, 2, 250, 300, seed=12)
    out, lse = maskc.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)

    pos_q, pos_kv = torch.arange(250).view(-1, 1), torch.arange(300).view(1, -1)
    listed = torch.tensor([[True, True, False], [False, True, True]])[pos_q // 128, pos_kv // 112]
    keep = listed & (pos_q >= pos_kv)
    ref_out, ref_lse = attention_reference(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: keep[q_idx, kv_idx])
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    causal_out, _ = attention_reference(q, k, v, mask_mod=masks.causal)
    assert not torch.allclose(out[:, :, 128:].double(), causal_out[:, :, 128:], atol=1e-3)


def _every_seventh_pair_out(b, h, q_idx, kv_idx):
    # keeps pairs in every tile, and drops some in every tile: no listed tile agrees with it
    return ((q_idx + kv_idx) % 7 != 0) & (kv_idx <= q_idx + 90)


def _hand_made(blocks, q_len: int, kv_len: int, seed: int):
    """A BlockMask of BLOCK_SIZE `blocks` listing random tiles, in random order, as left out,
    masked (kv_indices) or full (full_kv_indices), and the pairs FlexAttention's kernels attend
    with it: a full tile's every pair, a masked tile's where the mask_mod keeps them."""
    n_q, n_kv = -(-q_len // blocks[0]), -(-kv_len // blocks[1])
    generator = torch.Generator().manual_seed(seed)
    tile = torch.multinomial(torch.tensor([0.4, 0.35, 0.25]), n_q * n_kv, replacement=True,
                             generator=generator).view(1, 1, n_q, n_kv).to(torch.int8)  # EMPTY, PARTIAL, FULL
    lists = []
    for status in (PARTIAL, FULL):
        chosen = tile == status
        order = torch.rand(chosen.shape, generator=generator) + (~chosen).float()  # chosen first, shuffled
        lists += [chosen.sum(-1).to(torch.int32), order.argsort(-1).to(torch.int32)]
    block_mask = torch_flex.BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=blocks, mask_mod=_every_seventh_pair_out,
                                                     seq_lengths=(q_len, kv_len))
    pos_q, pos_kv = torch.arange(q_len).view(-1, 1), torch.arange(kv_len).view(1, -1)
    tiles = tile[0, 0, pos_q // blocks[0], pos_kv // blocks[1]]
    keep = (tiles == FULL) | ((tiles == PARTIAL) & _every_seventh_pair_out(0, 0, pos_q, pos_kv))
    return block_mask, keep


HAND_MADE_BLOCKS = [(16, 16), (32, 64), (128, 112), (64, 48)]


@pytest.mark.parametrize("blocks", HAND_MADE_BLOCKS, ids=str)
def test_hand_made_block_masks_attend_only_their_listed_tiles(blocks):
    """Whatever the tiles' size against the kernels' (finer ones are read at coarser kernel
    tiles only where that changes no pair), forward, lse and gradients match the float64
    reference of the listed tiles and the mask_mod, at lengths that are not multiples."""
    block_mask, keep = _hand_made(blocks, 150, 170, seed=sum(blocks))
    q, k, v, d_out = qkv(1, 2, 2, 150, 170, seed=13, requires_grad=True, grad_out=True)
    out, lse = maskc.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: keep[q_idx, kv_idx])
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    expected = torch.autograd.grad(ref_out, (q, k, v), d_out.double())
    for got, want, name in zip(grads, expected, "qkv"):
        assert_gradient_close_to_reference(got, want, torch.float32, f"d{name}")


@pytest.mark.parametrize("blocks", HAND_MADE_BLOCKS, ids=str)
def test_hand_made_block_masks_attend_only_their_listed_tiles_when_decoding(blocks):
    # few query rows and no gradient, which take the decoding kernel where the map agrees with its
    # mask_mod; it evaluates the mask on FULL tiles and across rows' spans, so this map runs on the prefill one
    block_mask, keep = _hand_made(blocks, 20, 170, seed=sum(blocks) + 1)
    q, k, v = qkv(1, 2, 2, 20, 170, seed=14)
    out, lse = maskc.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: keep[q_idx, kv_idx])
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


def test_kv_lens_refuse_a_hand_made_block_mask_that_disagrees_with_its_mask_mod():
    block_mask, _ = _hand_made((16, 16), 170, 170, seed=15)
    q, k, v = qkv(1, 2, 2, 4, 170, seed=16)
    with pytest.raises(maskc.MaskcError, match=r"the decoding kernel \(kv_lens\) needs a block_map whose tiles agree"):
        maskc.compiled_attention(q, k, v, block_map=flex.converted(block_mask), kv_lens=torch.tensor([170]))


@pytest.mark.parametrize("blocks", [100, (128, 100), (8, 16)], ids=str)
def test_blocks_that_are_not_multiples_of_16_are_refused_with_the_fix(blocks):
    with pytest.raises(ValueError, match=rf"BLOCK_SIZE sizes must be multiples of 16 .* got {re.escape(str(blocks))}; "
                                         r"use for example 128 or \(128, 112\)"):
        maskc.create_block_mask(masks.causal, None, None, 250, 230, device="cpu", BLOCK_SIZE=blocks)
    theirs = torch_flex.create_block_mask(masks.causal, None, None, 250, 230, device="cpu", BLOCK_SIZE=blocks)
    q, k, v = qkv(1, 1, 1, 250, 230)
    with pytest.raises(ValueError, match=r"block_mask BLOCK_SIZE sizes must be multiples of 16 .* got \("):
        maskc.flex_attention(q, k, v, block_mask=theirs)


def test_lse_is_torchs_natural_log_with_its_shape_and_dtype():
    block_mask = maskc.create_block_mask(masks.causal, None, None, 48, 48, device="cpu", BLOCK_SIZE=16)
    q, k, v = qkv(1, 2, 2, 48, 48, seed=3)
    out, lse = maskc.flex_attention(q, k, v, block_mask=block_mask, scale=0.3, return_lse=True)
    expected_out, expected_lse = _torch_flex(q, k, v, block_mask=block_mask, scale=0.3, return_lse=True)
    assert lse.shape == expected_lse.shape == (1, 2, 48) and lse.dtype == expected_lse.dtype == torch.float32
    torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=2e-5)
    scores = (q @ k.transpose(-1, -2)).double() * 0.3
    natural = torch.logsumexp(scores.masked_fill(~torch.ones(48, 48, dtype=torch.bool).tril(), -math.inf), -1)
    torch.testing.assert_close(lse.double(), natural, atol=2e-5, rtol=2e-5)
    # the newer spelling returns the same lse inside an AuxOutput
    out2, aux = maskc.flex_attention(q, k, v, block_mask=block_mask, scale=0.3,
                                     return_aux=torch_flex.AuxRequest(lse=True))
    assert isinstance(aux, torch_flex.AuxOutput) and aux.max_scores is None
    torch.testing.assert_close(aux.lse, lse, atol=0, rtol=0)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)


@pytest.mark.parametrize("permutation", [(0, 2, 1, 3), (2, 0, 1, 3), (0, 1, 2, 3)], ids=["BLHD", "LBHD", "BHLD"])
def test_out_is_laid_out_as_q_as_torch_lays_it_out(permutation):
    """torch returns out in q's stride order (its test_flex_attention_stride_ordering), so a
    model's out.transpose(1, 2).view(B, L, H * D) works; a contiguous out broke it."""
    B, H, L, D = 2, 2, 40, 16
    shape = [(B, H, L, D)[d] for d in permutation]
    inverse = [permutation.index(d) for d in range(4)]
    q, k, v = (torch.randn(shape).permute(inverse) for _ in range(3))
    want = _torch_flex(q, k, v, score_mod=lambda s, b, h, i, j: s + (i - j) / 8)
    with torch.no_grad():
        out = maskc.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + (i - j) / 8)
        decoding = maskc.compiled_attention(q[:, :, :1], k, v, kv_lens=torch.full((B,), L))
    assert out.stride() == want.stride() == q.stride()
    # (a dimension of size 1 may have any stride)
    assert [s for s, n in zip(decoding.stride(), decoding.shape) if n > 1] == [
        s for s, n in zip(torch.empty_like(q[:, :, :1]).stride(), decoding.shape) if n > 1]
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    q.requires_grad_()
    assert maskc.flex_attention(q, k, v, block_mask=maskc.create_block_mask(
        masks.causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)).stride() == q.stride()


def test_gradients_flow_through_flex_attention():
    # torch's flex_attention has no backward on CPU; maskc's runs through the interpreter
    block_mask = maskc.create_block_mask(_document_causal, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    q, k, v = qkv(1, 2, 1, 40, 40, dtype=torch.float64, seed=4, requires_grad=True)
    out = maskc.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    ref, _ = attention_reference(q, k, v, mask_mod=_document_causal, enable_gqa=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected = torch.autograd.grad(ref.sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-8, rtol=1e-8)


def test_a_block_mask_is_converted_once_and_again_when_its_mask_changes():
    docs = DOCS[:64].clone()

    def documents(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    block_mask = maskc.create_block_mask(documents, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    first = flex.converted(block_mask)
    assert flex.converted(block_mask) is first
    docs[40:] = 1  # in place: the mask_mod now reads other values, the BlockMask's tiles stay as made
    second = flex.converted(block_mask)
    assert second is not first and torch.equal(second.to_dense(), first.to_dense())
    q, k, v = qkv(1, 1, 1, 64, 64, seed=5)
    out = maskc.flex_attention(q, k, v, block_mask=block_mask)  # accepted: the map records the new values
    torch.testing.assert_close(out, _torch_flex(q, k, v, block_mask=block_mask), atol=2e-5, rtol=2e-5)


def test_a_maskc_block_map_is_a_block_mask_too():
    bm = maskc.block_map(masks.sliding_window(10), 40, 40, block_size=16)
    q, k, v = qkv(1, 1, 1, 40, 40, seed=6)
    out = maskc.flex_attention(q, k, v, block_mask=bm)
    ref, _ = attention_reference(q, k, v, mask_mod=masks.sliding_window(10))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_kernel_options_are_accepted_and_said_to_be_ignored(caplog):
    q, k, v = qkv(1, 1, 1, 16, 16, seed=7)
    options = {"BLOCK_M": 64, "BLOCK_N": 64, "PRESCALE_QK": False, "fwd_num_warps": 4}
    with caplog.at_level(logging.INFO, logger="maskc.integrations.flex"):
        flex.flex_attention(q, k, v, kernel_options=options)
        flex.flex_attention(q, k, v, kernel_options=options)
    said = [r.getMessage() for r in caplog.records if "kernel_options" in r.getMessage()]
    assert len(said) == 1 and "BLOCK_M" in said[0]  # once per process for the same keys


# -- what maskc cannot honour, said clearly -------------------------------------------------------
def test_errors_say_what_flex_attention_cannot_take():
    q, k, v = qkv(1, 1, 1, 64, 64)
    block_mask = maskc.create_block_mask(masks.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="return_lse or return_aux, not both"):
        maskc.flex_attention(q, k, v, return_lse=True, return_aux=torch_flex.AuxRequest(lse=True))
    with pytest.raises(NotImplementedError, match="max_scores"):
        maskc.flex_attention(q, k, v, return_aux=torch_flex.AuxRequest(lse=True, max_scores=True))
    with pytest.raises(ValueError, match=r"Q_LEN=64, KV_LEN=64 .* q_len=48, kv_len=48; create it with create_block"):
        maskc.flex_attention(q[:, :, :48], k[:, :, :48], v[:, :, :48], block_mask=block_mask)
    odd = torch_flex.create_block_mask(masks.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=24)
    with pytest.raises(ValueError, match=r"block_mask BLOCK_SIZE sizes must be multiples of 16 .* got \(24, 24\)"):
        maskc.flex_attention(q, k, v, block_mask=odd)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask .* got Tensor"):
        maskc.flex_attention(q, k, v, block_mask=torch.ones(64, 64, dtype=torch.bool))
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        maskc.flex_attention(q, k, v, kernel_options=["BLOCK_M"])
    with pytest.raises(RuntimeError, match="sliced BlockMask"):  # torch's own message, raised by its mask_mod
        maskc.flex_attention(q, k, v, block_mask=block_mask[0])


def test_errors_say_what_a_block_mask_lists_wrongly():
    def with_full(full_idx):
        return torch_flex.BlockMask.from_kv_blocks(
            torch.tensor([[[1, 1]]], dtype=torch.int32), torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32),
            torch.tensor([[[1, 0]]], dtype=torch.int32), full_idx, BLOCK_SIZE=32, seq_lengths=(64, 64))

    with pytest.raises(ValueError, match="both in kv_indices and in full_kv_indices"):
        maskc.BlockMap.from_flex_block_mask(with_full(torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)))
    once = with_full(torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32))
    assert maskc.BlockMap.from_flex_block_mask(once).num_full == 1
    # a block past the keys holds none that FlexAttention attends (torch 2.13's _adjust keeps such
    # full blocks): it is dropped; a negative index is refused
    past = torch_flex.BlockMask.from_kv_blocks(torch.tensor([[[1, 1]]], dtype=torch.int32),
                                               torch.tensor([[[[0, 1], [2, 0]]]], dtype=torch.int32),
                                               BLOCK_SIZE=32, seq_lengths=(64, 64))
    assert maskc.BlockMap.from_flex_block_mask(past).to_dense().tolist() == [[[[PARTIAL, EMPTY], [EMPTY, EMPTY]]]]
    negative = torch_flex.BlockMask.from_kv_blocks(torch.tensor([[[1, 1]]], dtype=torch.int32),
                                                   torch.tensor([[[[0, 1], [-1, 0]]]], dtype=torch.int32),
                                                   BLOCK_SIZE=32, seq_lengths=(64, 64))
    with pytest.raises(ValueError, match=r"kv_indices lists a negative block index"):
        maskc.BlockMap.from_flex_block_mask(negative)
    with pytest.raises(ValueError, match="kv_num_blocks of shape \\[B, H, q_blocks\\]"):
        maskc.BlockMap.from_flex_block_mask(torch_flex.BlockMask.from_kv_blocks(
            torch.tensor([1, 1], dtype=torch.int32), torch.tensor([[0, 1], [1, 0]], dtype=torch.int32), BLOCK_SIZE=32))
