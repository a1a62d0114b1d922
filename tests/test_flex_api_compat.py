"""FlexAttention's own API-level tests, rewritten against maskc's drop-in.

Each test names the pytorch test it comes from. Sources (the stored pytorch/pytorch copies were
older, so these were read from a mirror of pytorch main, cyyever/pytorch):

- test/inductor/test_flex_attention.py at 1410d025c7cf84f4dfbbd6d1452758ebc7038571
- test/inductor/test_flex_decoding.py at bdfe4a90e68203319879759b5bc572cbdb18001c

Where the torch test compares a compiled kernel to eager FlexAttention, maskc is compared to
torch's eager `flex_attention` on CPU (and, where the mask is hand-made, to
`maskc.testing.attention_reference` in float64). Shapes are scaled down (lengths <= 256, head
dim 16, B and H <= 2 where the test allows): maskc's kernels run in Triton's interpreter.
Checks of torch's own BlockMask class that maskc does not touch (pure `from_kv_blocks`
bookkeeping, pytree, dq_write_order validation) are left to torch; where the installed torch
(2.13) itself differs from the newer test, the test is not ported (see /tmp/flex_api/REPORT.md).
"""
import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

import maskc
from _inputs import qkv, randn
from maskc import and_masks, create_block_mask, flex_attention, noop_mask, or_masks, BlockMask
from maskc.testing import attention_reference

FA_COMMIT = "1410d025c7cf84f4dfbbd6d1452758ebc7038571"
FD_COMMIT = "bdfe4a90e68203319879759b5bc572cbdb18001c"
TOL = dict(atol=2e-5, rtol=2e-5)


def _torch_flex(*args, **kwargs):
    """torch's eager flex_attention, forward only (it has no backward on CPU): tensors detached."""
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    with warnings.catch_warnings():  # eager on CPU is unfused: said once per process
        warnings.simplefilter("ignore")
        return torch_flex.flex_attention(*args, **kwargs)


def _causal_mask(b, h, q, kv):
    return q >= kv


def _rel_bias(score, b, h, q, kv):
    return score + (q - kv)


def _causal(score, b, h, q, kv):
    return torch.where(q >= kv, score, float("-inf"))


def _times_two(score, b, h, q, kv):
    return score * 2


def _alibi(score, b, h, q, kv):
    scale = torch.exp2(-((h + 1) * 8.0 / 4))
    return score + (kv - q) * scale


SCORE_MODS = [None, _times_two, _causal, _rel_bias, _alibi]
SCORE_IDS = ["identity", "times_two", "causal", "rel_bias", "alibi"]


# -- BlockMask construction and attributes (TestBlockMask) ---------------------------------------
def test_block_mask_attributes():
    """test_flex_attention.py::TestBlockMask::test_block_mask_attributes (pytorch 1410d025)."""
    offset = torch.zeros(8)

    def causal_mask(b, h, q, kv):
        return (q + (offset[b] * 128)) >= kv

    block_mask = create_block_mask(causal_mask, 4, 2, 2048, 2048, device="cpu")
    assert block_mask.shape == (4, 2, 2048, 2048)
    assert block_mask[0].shape == (1, 2, 2048, 2048)
    assert block_mask[0, 0].shape == (1, 1, 2048, 2048)
    assert block_mask.numel() == 4 * 2 * 2048 * 2048
    assert block_mask.sparsity() == 46.875
    assert block_mask[0].sparsity() == 46.875
    assert block_mask[1, 0].sparsity() == 46.875
    assert block_mask.sparsity() == block_mask[1].sparsity()

    offset = torch.arange(8)
    block_mask = create_block_mask(causal_mask, 8, 1, 2048, 2048, device="cpu")
    assert block_mask.sparsity() == 29.1015625
    assert block_mask.sparsity() < block_mask[0].sparsity()
    assert block_mask[0].sparsity() > block_mask[1].sparsity()


@pytest.mark.parametrize("BLOCK_SIZE", [32, 64, 128, 256, (32, 64), (64, 32)])
def test_block_size_changes(BLOCK_SIZE):
    """test_flex_attention.py::TestBlockMask::test_block_size_changes (pytorch 1410d025)."""
    q_bs, kv_bs = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    block_mask = create_block_mask(noop_mask, 4, 2, 2048, 2048, BLOCK_SIZE=BLOCK_SIZE, device="cpu")
    assert block_mask.BLOCK_SIZE == (q_bs, kv_bs)
    assert block_mask.shape == (4, 2, 2048, 2048)
    theirs = torch_flex.create_block_mask(noop_mask, 4, 2, 2048, 2048, BLOCK_SIZE=BLOCK_SIZE, device="cpu")
    assert torch.equal(block_mask.to_dense(), theirs.to_dense())


def test_getitem():
    """test_flex_attention.py::TestBlockMask::test_getitem (pytorch 1410d025)."""
    offset = torch.zeros(8)

    def causal_mask(b, h, q, kv):
        return (q + (offset[b] * 128)) >= kv

    block_mask = create_block_mask(causal_mask, 4, 2, 512, 512, device="cpu")
    assert block_mask.kv_num_blocks.shape == (4, 2, 4)
    assert block_mask.kv_indices.shape == (4, 2, 4, 4)
    assert block_mask[0].kv_num_blocks.shape == (1, 2, 4)
    assert block_mask[0].kv_indices.shape == (1, 2, 4, 4)
    assert block_mask[0, 1].kv_num_blocks.shape == (1, 1, 4)
    assert block_mask[-1, -2].kv_indices.shape == (1, 1, 4, 4)
    assert block_mask[0:2, 1:2].kv_num_blocks.shape == (2, 1, 4)
    sliced = block_mask[0:2, 1:2, torch.tensor([1], dtype=torch.int32)]
    assert sliced.kv_num_blocks.shape == (2, 1, 1) and sliced.kv_indices.shape == (2, 1, 1, 4)
    q_index = torch.tensor([0], dtype=torch.int32)
    new = block_mask[:, :, q_index]
    torch.testing.assert_close(new.kv_num_blocks, block_mask.kv_num_blocks[:, :, q_index])
    torch.testing.assert_close(new.kv_indices, block_mask.kv_indices[:, :, q_index, :])
    assert block_mask.full_kv_num_blocks is not None
    torch.testing.assert_close(new.full_kv_num_blocks, block_mask.full_kv_num_blocks[:, :, q_index])
    torch.testing.assert_close(new.full_kv_indices, block_mask.full_kv_indices[:, :, q_index, :])


def test_block_mask_positional_constructor_preserves_block_size():
    """test_flex_attention.py::TestBlockMask::test_block_mask_positional_constructor_preserves_block_size
    (pytorch 1410d025), on a BlockMask maskc made; the rebuilt one drives maskc.flex_attention."""
    ref = create_block_mask(_causal_mask, B=1, H=1, Q_LEN=128, KV_LEN=128, BLOCK_SIZE=64, device="cpu")
    block_mask = BlockMask(ref.seq_lengths, ref.kv_num_blocks, ref.kv_indices, ref.full_kv_num_blocks,
                           ref.full_kv_indices, ref.q_num_blocks, ref.q_indices, ref.full_q_num_blocks,
                           ref.full_q_indices, ref.BLOCK_SIZE, ref.mask_mod)
    assert block_mask.BLOCK_SIZE == ref.BLOCK_SIZE and block_mask.mask_mod is ref.mask_mod
    q, k, v = qkv(1, 1, Lq=128)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask),
                               flex_attention(q, k, v, block_mask=ref), atol=0, rtol=0)


def test_sliced_blockmask_mask_mod_error():
    """test_flex_attention.py::TestBlockMask::test_sliced_blockmask_mask_mod_error (pytorch 1410d025):
    a q-block slice used with one query."""
    base_mask = create_block_mask(_causal_mask, B=1, H=1, Q_LEN=256, KV_LEN=256, device="cpu")
    sliced_mask = base_mask[:, :, 0]
    q, k, v = qkv(1, 1, Lq=1, Lkv=256)
    with pytest.raises(RuntimeError, match="Cannot use mask_mod from a sliced BlockMask"):
        flex_attention(q, k, v, block_mask=sliced_mask)


def test_block_mask_device_change():
    """test_flex_attention.py::TestBlockMask::test_block_mask_device_change (pytorch 1410d025), on CPU."""
    offset = torch.zeros(8)

    def causal_mask(b, h, q, kv):
        return (q + (offset[b] * 128)) >= kv

    block_mask = create_block_mask(causal_mask, 1, 1, 512, 512, device="cpu")
    for t in (block_mask.kv_indices, block_mask.kv_num_blocks, block_mask.q_indices, block_mask.q_num_blocks):
        assert t.device.type == "cpu"
    moved = block_mask.to("cpu")
    assert moved.q_indices.is_cpu and moved.q_num_blocks.is_cpu and moved.kv_indices.is_cpu
    assert torch.equal(moved.to_dense(), block_mask.to_dense())


def test_block_mask_viz():
    """test_flex_attention.py::TestBlockMask::test_block_mask_viz (pytorch 1410d025): str() as torch prints it."""
    block_mask = create_block_mask(_causal_mask, 1, 1, 2048, 2048, device="cpu")
    assert str(block_mask) == str(torch_flex.create_block_mask(_causal_mask, 1, 1, 2048, 2048, device="cpu"))
    assert str(block_mask).startswith("BlockMask(shape=(1, 1, 2048, 2048), sparsity=46.88%,")
    offset = torch.arange(8)

    def causal_offset_mask(b, h, q, kv):
        return (q + offset[b] * 128) >= kv

    assert "sparsity=29.10" in str(create_block_mask(causal_offset_mask, 8, 1, 2048, 2048, device="cpu"))


@pytest.mark.parametrize("full_indices", [False, True])
def test_from_kv_blocks(full_indices):
    """test_flex_attention.py::TestBlockMask::test_from_kv_blocks (pytorch 1410d025): the hand-made
    BlockMask (indices padded with -1 past the count, default BLOCK_SIZE, seq_lengths inferred as
    (128, 256)) drives maskc.flex_attention as it drives torch's."""
    if full_indices:
        kv_num = torch.tensor([1], dtype=torch.int32).view(1, 1, 1)
        kv_idx = torch.tensor([1, -1], dtype=torch.int32).view(1, 1, 1, 2)
        full_num = torch.tensor([1], dtype=torch.int32).view(1, 1, 1)
        full_idx = torch.tensor([0, -1], dtype=torch.int32).view(1, 1, 1, 2)
    else:
        kv_num = torch.tensor([2], dtype=torch.int32).view(1, 1, 1)
        kv_idx = torch.tensor([0, 1], dtype=torch.int32).view(1, 1, 1, 2)
        full_num = full_idx = None
    block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx)
    assert block_mask.shape == (1, 1, 128, 256)
    q, k, v = qkv(1, 1, Lq=128, Lkv=256, seed=1)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask),
                               _torch_flex(q, k, v, block_mask=block_mask), **TOL)


@pytest.mark.parametrize("full_indices", [False, True])
def test_from_kv_blocks_without_q_computation(full_indices):
    """test_flex_attention.py::TestBlockMask::test_from_kv_blocks_without_q_computation and
    test_forward_pass_with_none_q_indices (pytorch 1410d025): compute_q_blocks=False runs forward."""
    kv_num = torch.tensor([[[4]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 1, 2, 3]]]], dtype=torch.int32)
    block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, compute_q_blocks=False, BLOCK_SIZE=32)
    assert block_mask.q_indices is None and block_mask.shape == (1, 1, 32, 128)
    q, k, v = qkv(1, 1, Lq=32, Lkv=128, seed=2)
    with torch.no_grad():
        out = flex_attention(q, k, v, block_mask=block_mask)
    assert out.shape == (1, 1, 32, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out, _torch_flex(q, k, v, block_mask=block_mask), **TOL)


def test_block_mask_operations_with_none_q_indices():
    """test_flex_attention.py::TestBlockMask::test_block_mask_operations_with_none_q_indices (pytorch 1410d025)."""
    block_mask = BlockMask.from_kv_blocks(torch.tensor([[[4]]], dtype=torch.int32),
                                          torch.tensor([[[[0, 1, 2, 3]]]], dtype=torch.int32), compute_q_blocks=False)
    assert block_mask.shape == (1, 1, 128, 512) and block_mask.BLOCK_SIZE == (128, 128)
    sliced = block_mask[0]
    assert sliced.shape == (1, 1, 128, 512) and sliced.q_indices is None


def test_custom_block_mask_generator():
    """test_flex_attention.py::TestFlexAttention::test_custom_block_mask_generator (pytorch 1410d025)."""
    S, BS = 256, 128
    auto_mask = create_block_mask(_causal_mask, 1, 1, S, S, device="cpu")
    num_blocks = (torch.arange(S // BS) + 1)[None, None, :]
    indices = torch.arange(S // BS).expand(S // BS, S // BS)[None, None, :]
    manual_mask = BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=BS, mask_mod=_causal_mask)
    assert torch.equal(auto_mask.to_dense(), manual_mask.to_dense())
    q, k, v = qkv(1, 2, Lq=S, seed=3)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=manual_mask),
                               flex_attention(q, k, v, block_mask=auto_mask), **TOL)


def test_mask_mod_combiners():
    """test_flex_attention.py::TestFlexAttention::test_mask_mod_combiners (pytorch 1410d025)."""
    def neg_causal_mask(b, h, q, kv):
        return q < kv

    def sliding_window(b, h, q, kv):
        return (q - kv) <= 512

    block_mask = create_block_mask(and_masks(_causal_mask, sliding_window), 1, 1, 2048, 2048, device="cpu")
    assert block_mask.kv_num_blocks.sum().item() == 28
    assert create_block_mask(and_masks(_causal_mask, neg_causal_mask), 1, 1, 2048, 2048,
                             device="cpu").kv_num_blocks.sum() == 0
    either = create_block_mask(or_masks(_causal_mask, neg_causal_mask), 1, 1, 2048, 2048, device="cpu")
    assert either.sparsity() == create_block_mask(noop_mask, 1, 1, 2048, 2048, device="cpu").sparsity()
    small = create_block_mask(and_masks(_causal_mask, lambda b, h, q, kv: (q - kv) <= 40), 1, 1, 128, 128,
                              device="cpu", BLOCK_SIZE=32)
    q, k, v = qkv(1, 2, Lq=128, seed=4)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=small),
                               _torch_flex(q, k, v, block_mask=small), **TOL)


def test_and_or_masks_of_many():
    """and_masks/or_masks of several mods (torch's take any number), against torch's create_mask."""
    mods = [_causal_mask, lambda b, h, q, kv: q - kv < 30, lambda b, h, q, kv: kv % 3 != 1,
            lambda b, h, q, kv: (q // 16) != 2]
    for ours, theirs in ((and_masks(*mods), torch_flex.and_masks(*mods)), (or_masks(*mods), torch_flex.or_masks(*mods))):
        bm = create_block_mask(ours, None, None, 96, 96, device="cpu", BLOCK_SIZE=32)
        assert torch.equal(maskc.create_mask(ours, 1, 1, 96, 96, device="cpu"),
                           torch_flex.create_mask(theirs, 1, 1, 96, 96, device="cpu"))
        q, k, v = qkv(1, 1, Lq=96, seed=5)
        torch.testing.assert_close(flex_attention(q, k, v, block_mask=bm),
                                   _torch_flex(q, k, v, block_mask=bm), **TOL)


def test_kv_order_invariance_padded_causal():
    """test_flex_attention.py::TestFlexAttention::test_kv_order_invariance_padded_causal (pytorch 1410d025),
    scaled down: the tile lists maskc writes, with and without separate full blocks, and equal
    rows for the shared prefix."""
    seq_len, shared_prefix = 256, 201

    def make_block_mask(real_q_len, separate_full_blocks):
        def padded_causal_mask(b, h, q, kv):
            return (q < real_q_len) & (q >= kv)
        return create_block_mask(padded_causal_mask, B=1, H=1, Q_LEN=seq_len, KV_LEN=seq_len, device="cpu",
                                 separate_full_blocks=separate_full_blocks)

    default_partial, default_full = make_block_mask(shared_prefix, True), make_block_mask(seq_len, True)
    assert default_partial.kv_indices[0, 0, 1, :2].tolist() == [0, 1]
    assert default_partial.full_kv_num_blocks[0, 0, 1] == 0
    assert default_full.kv_indices[0, 0, 1, :1].tolist() == [1]
    assert default_full.full_kv_indices[0, 0, 1, :1].tolist() == [0]
    partial, full = make_block_mask(shared_prefix, False), make_block_mask(seq_len, False)
    assert partial.kv_indices[0, 0, 1, :2].tolist() == [0, 1] and partial.full_kv_num_blocks is None
    assert full.kv_indices[0, 0, 1, :2].tolist() == [0, 1] and full.full_kv_num_blocks is None
    q, k, v = qkv(1, 2, Lq=seq_len, Hkv=1, seed=6)
    out_partial = flex_attention(q, k, v, block_mask=partial, enable_gqa=True)
    out_full = flex_attention(q, k, v, block_mask=full, enable_gqa=True)
    torch.testing.assert_close(out_partial[:, :, :shared_prefix], out_full[:, :, :shared_prefix], **TOL)


def test_compacted_block_mask_matches_reference():
    """test_flex_attention.py::TestFlexAttention::test_compacted_block_mask_matches_reference_after_recompile
    (pytorch 1410d025), scaled down: a BlockMask whose index tensors are cut to the largest count."""
    seq_len = 128

    def mask_fn(b, h, q_idx, kv_idx, document_id):
        return (q_idx >= kv_idx) | (document_id[b, q_idx] == document_id[b, kv_idx])

    def make(document_id, compact):
        ref = create_block_mask(functools.partial(mask_fn, document_id=document_id), B=1, H=None, Q_LEN=seq_len,
                                KV_LEN=seq_len, device="cpu", BLOCK_SIZE=32)
        if not compact:
            return ref
        nums = [ref.kv_num_blocks, ref.full_kv_num_blocks, ref.q_num_blocks, ref.full_q_num_blocks]
        idx = [ref.kv_indices, ref.full_kv_indices, ref.q_indices, ref.full_q_indices]
        cut = [i[..., : max(int(n.max()), 1)].contiguous() for n, i in zip(nums, idx)]
        return BlockMask(seq_lengths=ref.seq_lengths, kv_num_blocks=ref.kv_num_blocks, kv_indices=cut[0],
                         full_kv_num_blocks=ref.full_kv_num_blocks, full_kv_indices=cut[1],
                         q_num_blocks=ref.q_num_blocks, q_indices=cut[2], full_q_num_blocks=ref.full_q_num_blocks,
                         full_q_indices=cut[3], BLOCK_SIZE=ref.BLOCK_SIZE, mask_mod=ref.mask_mod)

    document_id = torch.arange(seq_len).repeat(1, 1)
    document_id[:, :100] = 0
    q, k, v = qkv(1, 1, Lq=seq_len, seed=7, requires_grad=True)
    ref_out = _torch_flex(q, k, v, block_mask=make(document_id, False))
    out = flex_attention(q, k, v, block_mask=make(document_id, True))
    torch.testing.assert_close(out, ref_out, **TOL)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want, _ = attention_reference(q.double(), k.double(), v.double(),
                                  mask_mod=functools.partial(mask_fn, document_id=document_id))
    for g, w in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(g, w.float(), atol=1e-4, rtol=1e-4)


def test_compute_dq_write_order_is_accepted_without_effect():
    """test_flex_attention.py::TestBlockMask::test_create_block_mask_defaults_to_spt_dq_write_order
    (pytorch 1410d025). docs/guides/block-maps.md documents `create_block_mask(compute_dq_write_order=, dq_kv_order=)`
    as accepted with no effect: no dq_write_order is computed (torch's is not None)."""
    block_mask = create_block_mask(_causal_mask, B=1, H=1, Q_LEN=256, KV_LEN=256, BLOCK_SIZE=128, device="cpu",
                                   compute_dq_write_order=True)
    assert block_mask.dq_write_order is None
    theirs = torch_flex.create_block_mask(_causal_mask, B=1, H=1, Q_LEN=256, KV_LEN=256, BLOCK_SIZE=128,
                                          device="cpu", compute_dq_write_order=True)
    assert theirs.dq_write_order is not None


# -- create_block_mask with B/H None and broadcast -----------------------------------------------
def test_create_block_mask_b_h_none_broadcasts():
    """test_flex_attention.py::TestFlexAttention::test_GQA_causal_mask / test_causal_block (pytorch
    1410d025): a BlockMask of B=H=None (one row) serves every batch and head."""
    block_mask = create_block_mask(_causal_mask, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    assert block_mask.kv_num_blocks.shape[:2] == (1, 1)
    q, k, v = qkv(2, 2, Lq=128, seed=8)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask),
                               _torch_flex(q, k, v, block_mask=block_mask), **TOL)


def test_larger_block_mask_bug():
    """test_flex_decoding.py::TestFlexDecoding::test_larger_block_mask_bug (pytorch bdfe4a90):
    B=2, H=None, Q=KV=2."""
    mask_2 = create_block_mask(_causal_mask, B=2, H=None, Q_LEN=2, KV_LEN=2, device="cpu")
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.normal(0.0, 3.0, (2, 1, 2, 16), generator=g) for _ in range(3))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=mask_2), _torch_flex(q, k, v, block_mask=mask_2),
                               **TOL)


# -- flex_attention: shapes --------------------------------------------------------------------
@pytest.mark.parametrize("score_mod", SCORE_MODS, ids=SCORE_IDS)
def test_GQA(score_mod):
    """test_flex_attention.py::TestFlexAttention::test_GQA (pytorch 1410d025): Hq = 4 * Hkv and a
    query shorter than the keys (S // 8 against S there; 32 against 128 here)."""
    q, k, v = qkv(1, 4, Lq=32, Hkv=1, Lkv=128, seed=10)
    block_mask = create_block_mask(noop_mask, 1, 4, 32, 128, device="cpu")
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(out, _torch_flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                enable_gqa=True), **TOL)


@pytest.mark.parametrize("batch_dims", [(2, 1)])
@pytest.mark.parametrize("head_dims", [(2, 1), (2, 2)])
@pytest.mark.parametrize("causal", [False, True], ids=["noop", "causal"])
def test_kv_batch_broadcast(batch_dims, head_dims, causal):
    """test_flex_attention.py::TestFlexAttention::test_kv_batch_broadcast and
    test_kv_batch_broadcast_causal_mask (pytorch 1410d025): k and v of batch 1, a BlockMask of q's batch."""
    (Bq, Bkv), (Hq, Hkv) = batch_dims, head_dims
    block_mask = create_block_mask(_causal_mask if causal else noop_mask, Bq, 1, 64, 64, device="cpu", BLOCK_SIZE=32)
    q, k, v = qkv(Bq, Hq, Lq=64, Hkv=Hkv, Bkv=Bkv, seed=11)
    out = flex_attention(q, k, v, score_mod=_rel_bias, block_mask=block_mask, enable_gqa=Hq != Hkv)
    torch.testing.assert_close(out, _torch_flex(q, k, v, score_mod=_rel_bias, block_mask=block_mask,
                                                enable_gqa=Hq != Hkv), **TOL)


@pytest.mark.parametrize("score_mod", SCORE_MODS, ids=SCORE_IDS)
def test_builtin_score_mods_different_seqlen(score_mod):
    """test_flex_attention.py::TestFlexAttention::test_builtin_score_mods_different_seqlen (pytorch 1410d025):
    Lq = Lkv / 2 with torch's noop BlockMask of (B, H)."""
    block_mask = create_block_mask(noop_mask, 2, 2, 64, 128, device="cpu")
    q, k, v = qkv(2, 2, Lq=64, Lkv=128, seed=12)
    torch.testing.assert_close(flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask),
                               _torch_flex(q, k, v, score_mod=score_mod, block_mask=block_mask), **TOL)


@pytest.mark.parametrize("BLOCK_SIZE", [128, 256, (128, 256), (256, 128)])
def test_builtin_score_mods_different_block_size(BLOCK_SIZE):
    """test_flex_attention.py::TestFlexAttention::test_builtin_score_mods_different_block_size (pytorch 1410d025)."""
    block_mask = create_block_mask(noop_mask, 1, 2, 256, 256, BLOCK_SIZE=BLOCK_SIZE, device="cpu")
    q, k, v = qkv(1, 2, Lq=256, seed=13)
    torch.testing.assert_close(flex_attention(q, k, v, score_mod=_causal, block_mask=block_mask),
                               _torch_flex(q, k, v, score_mod=_causal, block_mask=block_mask), **TOL)


@pytest.mark.parametrize("head_dims", [(16, 32), (32, 16)], ids=["Dv=2D", "Dv=D/2"])
def test_non_equal_head_dims(head_dims):
    """test_flex_attention.py::TestFlexAttention::test_non_equal_head_dims and
    test_flex_decoding.py::test_non_equal_head_dims (pytorch): Dv != D, prefill and q_len 1."""
    qk_d, v_d = head_dims
    for lq in (64, 1):
        q, k, v = qkv(1, 2, Lq=lq, D=qk_d, Lkv=64, Dv=v_d, seed=14)
        out = flex_attention(q, k, v, score_mod=_rel_bias)
        assert out.shape == (1, 2, lq, v_d)
        torch.testing.assert_close(out, _torch_flex(q, k, v, score_mod=_rel_bias), **TOL)


def test_head_dim_below_16_is_refused_as_documented():
    """test_flex_attention.py::TestFlexAttention::test_non_equal_head_dims with (D, D // 2) at D=16, and
    test_validate_small_embedding_size_error_message (pytorch 1410d025): eager torch takes head dim 8,
    its compiled GPU kernel refuses it ("at least 16"); docs/guides/block-maps.md documents head dims outside 16..256 as
    refused by maskc."""
    q, k, v = qkv(1, 2, Lq=32, D=16, Dv=8, seed=56)
    assert _torch_flex(q, k, v).shape == (1, 2, 32, 8)
    with pytest.raises(ValueError, match="v head dim must be between 16 and 256, got 8"):
        flex_attention(q, k, v)
    q, k, v = qkv(1, 2, Lq=32, D=8, seed=57)
    with pytest.raises(ValueError, match="between 16 and 256"):
        flex_attention(q, k, v)


@pytest.mark.parametrize("head_dim", [17, 24])
def test_non_pow_2_headdim(head_dim):
    """test_flex_attention.py::TestFlexAttention::test_non_pow_2_headdim (pytorch 1410d025), 17 and 24."""
    q, k, v = qkv(1, 2, Lq=64, D=head_dim, seed=15)
    torch.testing.assert_close(flex_attention(q, k, v, score_mod=_rel_bias),
                               _torch_flex(q, k, v, score_mod=_rel_bias), **TOL)


def test_eager_tracing_correctness():
    """test_flex_attention.py::TestBlockMask::test_eager_tracing_correctness (pytorch 1410d025):
    GQA with Dv = 2 * D, out viewed as [B, Hq, L, 2, D]."""
    q, k, v = qkv(1, 4, Lq=64, D=16, Hkv=2, Dv=32, seed=16)
    out = flex_attention(q, k, v, enable_gqa=True)
    assert out.view(1, 4, 64, 2, 16).shape == (1, 4, 64, 2, 16)
    torch.testing.assert_close(out, _torch_flex(q, k, v, enable_gqa=True), **TOL)


def test_not_pw_of_two_gqa():
    """test_flex_decoding.py::TestFlexDecoding::test_not_pw_of_two (pytorch bdfe4a90): 12 query heads
    on 2 kv heads (a ratio of 6), one query; here 6 on 2."""
    q, k, v = qkv(1, 6, Lq=1, Hkv=2, Lkv=128, seed=17)
    torch.testing.assert_close(flex_attention(q, k, v, enable_gqa=True), _torch_flex(q, k, v, enable_gqa=True),
                               **TOL)


def test_gqa_without_enable_gqa_is_refused():
    """What torch says when Hq != Hkv and enable_gqa is False (flex_attention's input validation)."""
    q, k, v = qkv(1, 4, Lq=32, Hkv=2, seed=18)
    with pytest.raises(ValueError):
        _torch_flex(q, k, v)
    with pytest.raises(ValueError):
        flex_attention(q, k, v)


# -- layouts -----------------------------------------------------------------------------------
def _as_strided(numel, shape, strides, offset, seed):
    return torch.as_strided(randn(numel, seed=seed), shape, strides, offset)


@pytest.mark.parametrize("layout", ["offset", "transposed", "padded_row", "shared_dim"])
def test_strided_inputs(layout):
    """test_flex_attention.py::TestFlexAttention::test_strided_inputs (pytorch 1410d025) with the
    decoding file's input_strides_1..4: an offset, transposed dimensions, rows padded by one and a
    dimension shared by two."""
    B, H, S, D = 2, 2, 64, 16
    strides = {"offset": ((H * S * D, S * D, D, 1), 997), "transposed": ((H * D, D, B * H * D, 1), 499),
               "padded_row": ((S * (D + 1), B * S * (D + 1), D + 1, 1), 293),
               "shared_dim": ((1, D, (B + 1) * (H + 1) * D, 1), 97)}[layout]
    numel = B * H * S * D * 4
    q = _as_strided(numel, (B, H, S // 2, D), *strides, seed=19)
    k = _as_strided(numel, (B, H, S, D), *strides, seed=20)
    v = _as_strided(numel, (B, H, S, D), *strides, seed=21)
    out = flex_attention(q, k, v, score_mod=_alibi)
    torch.testing.assert_close(out, _torch_flex(q, k, v, score_mod=_alibi), **TOL)


@pytest.mark.parametrize("permutation", [(1, 0, 2, 3), (0, 1, 3, 2), (1, 0, 3, 2)])
def test_flex_attention_stride_ordering(permutation):
    """test_flex_attention.py::TestFlexAttention::test_flex_attention_stride_ordering (pytorch 1410d025),
    the permutations test_flex_dropin.py does not cover: out's last stride is 1 and, where q's is, out
    keeps q's stride order."""
    g = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(2, 1, 64, 16, generator=g).permute(permutation) for _ in range(3))
    out = flex_attention(q, k, v)
    assert out.stride()[-1] == 1
    if q.stride()[-1] == 1:
        order = lambda t: sorted(range(4), key=lambda d: -t.stride()[d])  # noqa: E731
        assert order(out) == order(q)
    torch.testing.assert_close(out, _torch_flex(q, k, v), **TOL)


def test_non_contiguous_last_dim():
    """test_flex_attention.py::TestFlexAttention::test_non_contiguous_last_dim (pytorch 1410d025):
    column-major q, k, v (stride[-1] != 1)."""
    for S in (16, 64):
        g = torch.Generator().manual_seed(S)
        q, k, v = (torch.randn(2, 2, S, 16, generator=g).transpose(-1, -2).contiguous().transpose(-1, -2)
                   for _ in range(3))
        assert q.stride()[-1] != 1
        gold, _ = attention_reference(q.double(), k.double(), v.double())
        torch.testing.assert_close(flex_attention(q, k, v).double(), gold, **TOL)


def test_flex_attention_backward_stride_ordering():
    """test_flex_attention.py::TestFlexAttention::test_flex_attention_backward_stride_ordering (pytorch
    1410d025): gradients come back in their input's stride order, and match eager autograd."""
    g = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(2, 2, 32, 16, generator=g).permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
               .requires_grad_() for _ in range(3))
    out = flex_attention(q, k, v)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(qd, kd, vd)
    want = torch.autograd.grad(ref, (qd, kd, vd), grad_out.double())
    order = lambda t: sorted(range(4), key=lambda d: -t.stride()[d])  # noqa: E731
    for leaf, got, w in zip((q, k, v), grads, want):
        assert order(got) == order(leaf)
        torch.testing.assert_close(got.double(), w, atol=1e-4, rtol=1e-4)


def test_strided_backwards():
    """test_flex_attention.py::TestFlexAttention::test_strided_backwards (pytorch 1410d025): K and V
    sliced along the sequence (K[:, :, :-32]); gradients reach the full tensors."""
    g = torch.Generator().manual_seed(24)
    Q, K, V = (torch.randn(1, 2, 96, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = flex_attention(Q, K[:, :, :-32], V[:, :, :-32])
    ref, _ = attention_reference(Q, K[:, :, :-32], V[:, :, :-32])
    grad = torch.rand_like(out)
    for got, want in zip(torch.autograd.grad(out, (Q, K, V), grad), torch.autograd.grad(ref, (Q, K, V), grad)):
        torch.testing.assert_close(got, want, atol=1e-8, rtol=1e-8)


# -- lse and return_aux --------------------------------------------------------------------------
def test_return_aux_variants():
    """test_flex_attention.py::TestFlexAttention::test_return_aux (pytorch 1410d025): AuxRequest()
    gives an AuxOutput of Nones, AuxRequest(lse=True) an lse of [B, H, L] in float32."""
    q, k, v = qkv(2, 2, Lq=61, seed=25)
    out_only = flex_attention(q, k, v, _rel_bias)
    assert isinstance(out_only, torch.Tensor)
    out, aux = flex_attention(q, k, v, _rel_bias, return_aux=torch_flex.AuxRequest(lse=True))
    assert isinstance(aux, torch_flex.AuxOutput) and aux.max_scores is None
    assert aux.lse.shape == (2, 2, 61) and aux.lse.dtype == torch.float32
    out_none, aux_none = flex_attention(q, k, v, _rel_bias, return_aux=torch_flex.AuxRequest())
    assert aux_none.lse is None and aux_none.max_scores is None
    torch.testing.assert_close(out_none, out_only, atol=0, rtol=0)
    _, want = _torch_flex(q, k, v, _rel_bias, return_aux=torch_flex.AuxRequest(lse=True))
    torch.testing.assert_close(aux.lse, want.lse, **TOL)


def test_logsumexp_correctness_float64():
    """test_flex_attention.py::TestFlexAttention::test_logsumexp_correctness (pytorch 1410d025):
    a float64 run returns a float64 lse."""
    q, k, v = qkv(1, 2, Lq=64, seed=26, dtype=torch.float64)
    out, aux = flex_attention(q, k, v, _causal, return_aux=torch_flex.AuxRequest(lse=True))
    ref_out, ref_aux = _torch_flex(q, k, v, _causal, return_aux=torch_flex.AuxRequest(lse=True))
    assert aux.lse.dtype == ref_aux.lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(aux.lse, ref_aux.lse, atol=1e-10, rtol=1e-10)


def test_differentiable_logsumexp():
    """test_flex_attention.py::TestFlexAttention::test_differentiable_logsumexp_compiled and
    test_differentiable_logsumexp_gradcheck (pytorch 1410d025): a loss of out and lse."""
    q, k, v = qkv(1, 2, Lq=32, seed=27, dtype=torch.float64, requires_grad=True)
    lse_mask = torch.randn(1, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(28))
    out, aux = flex_attention(q, k, v, return_aux=torch_flex.AuxRequest(lse=True))
    grads = torch.autograd.grad(out.mean() + (aux.lse * lse_mask).sum(), (q, k, v))
    ref_out, ref_lse = attention_reference(q, k, v)
    want = torch.autograd.grad(ref_out.mean() + (ref_lse * lse_mask).sum(), (q, k, v))
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w, atol=1e-8, rtol=1e-8)


def test_lse_masked_output():
    """test_flex_attention.py::TestFlexAttention::test_lse_masked_output (pytorch 1410d025), eager
    backend, scaled down: two attentions (a window and its causal complement) merged by their lse
    equal causal SDPA, forward and backward."""
    n_ctx, window = 100, 24

    def sliding_window_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    def global_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx > window)

    local = create_block_mask(sliding_window_causal, None, None, n_ctx, n_ctx, device="cpu", BLOCK_SIZE=32)
    glob = create_block_mask(global_causal, None, None, n_ctx, n_ctx, device="cpu", BLOCK_SIZE=32)
    q, k, v = qkv(1, 2, Lq=n_ctx, seed=29, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(1, 2, n_ctx, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(30))
    x_local, aux_local = flex_attention(q, k, v, block_mask=local, return_aux=torch_flex.AuxRequest(lse=True))
    x_global, aux_global = flex_attention(q, k, v, block_mask=glob, return_aux=torch_flex.AuxRequest(lse=True))
    max_lse = torch.maximum(aux_local.lse, aux_global.lse)
    w_local, w_global = torch.exp(aux_local.lse - max_lse), torch.exp(aux_global.lse - max_lse)
    x = (x_local * w_local[..., None] + x_global * w_global[..., None]) / (w_local + w_global)[..., None]
    grads = torch.autograd.grad(x, (q, k, v), grad_out)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(x, out, atol=1e-8, rtol=1e-8)
    for got, want in zip(grads, torch.autograd.grad(out, (q, k, v), grad_out)):
        torch.testing.assert_close(got, want, atol=1e-8, rtol=1e-8)


def test_small_q_kv_len():
    """test_flex_attention.py::TestFlexAttention::test_small_q_kv_len (pytorch 1410d025): one query,
    one key, out, lse and gradients."""
    q, k, v = (torch.ones(1, 1, 1, 16, requires_grad=True) for _ in range(3))
    out, aux = flex_attention(q, k, v, return_aux=torch_flex.AuxRequest(lse=True))
    ref_out, ref_aux = _torch_flex(q, k, v, return_aux=torch_flex.AuxRequest(lse=True))
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(aux.lse, ref_aux.lse, **TOL)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attention_reference(qd, kd, vd)[0].sum(), (qd, kd, vd))
    for got, w in zip(grads, want):
        torch.testing.assert_close(got.double(), w, **TOL)


@pytest.mark.parametrize("gqa", [False, True])
def test_fully_masked_out_rows_0_check(gqa):
    """test_flex_attention.py::TestFlexAttention::test_fully_masked_out_rows_0_check and
    test_flex_decoding.py::test_fully_masked_out_rows_0_check_gqa (pytorch): rows with no key give
    out 0, lse -inf and no gradient, without NaNs."""
    S, M = 64, 32
    q, k, v = qkv(2, 2, Lq=S, Hkv=1 if gqa else 2, seed=31, requires_grad=True)
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx < M, 2, 1, S, S, device="cpu", BLOCK_SIZE=16)
    out, aux = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_aux=torch_flex.AuxRequest(lse=True))
    assert out[:, :, M:, :].sum() == 0 and (aux.lse[:, :, M:] == -float("inf")).all()
    (out.sum() + aux.lse[:, :, :M].sum()).backward()
    assert q.grad[:, :, M:, :].sum() == 0
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    torch.testing.assert_close(out, _torch_flex(q, k, v, block_mask=block_mask, enable_gqa=gqa), **TOL)


def test_scale_argument():
    """flex_attention(scale=...) as every run_test partial passes it through; also scale=0."""
    q, k, v = qkv(1, 2, Lq=48, seed=32)
    for scale in (0.3, 1.0, 0.0):
        torch.testing.assert_close(flex_attention(q, k, v, score_mod=_causal, scale=scale),
                                   _torch_flex(q, k, v, score_mod=_causal, scale=scale), **TOL)


# -- lengths ----------------------------------------------------------------------------------
def test_block_mask_vs_sequence_lengths():
    """test_flex_attention.py::TestBlockMask::test_block_mask_vs_sequence_lengths (pytorch 1410d025):
    a BlockMask for other lengths than the inputs' is refused (torch 2.13 raises ValueError
    "block_mask was created for ..."; the newer test asserts RuntimeError)."""
    block_mask = create_block_mask(_causal_mask, None, None, 128, 128, device="cpu")
    q, k, v = qkv(1, 1, Lq=128, seed=33)
    flex_attention(q, k, v, block_mask=block_mask)
    big = qkv(1, 1, Lq=256, seed=34)
    with pytest.raises(ValueError, match="block_mask was created for"):
        _torch_flex(*big, block_mask=block_mask)
    with pytest.raises(ValueError, match="block_mask was created for"):
        flex_attention(*big, block_mask=block_mask)
    short = create_block_mask(_causal_mask, None, None, 127, 127, device="cpu")
    with pytest.raises(ValueError, match="block_mask was created for"):
        flex_attention(q, k, v, block_mask=short)


@pytest.mark.parametrize("lengths", [(255, 255), (131, 131), (37, 37)])
def test_causal_block_non_divisible(lengths):
    """test_flex_attention.py::TestFlexAttention::test_causal_block_non_divisible and
    test_non_divisible_with_captured_buffer (pytorch 1410d025): lengths off the block size."""
    lq, lkv = lengths
    multiplier = torch.randn(lq, generator=torch.Generator().manual_seed(35))

    def mult(score, b, h, q_idx, kv_idx):
        return score * multiplier[q_idx]

    block_mask = create_block_mask(_causal_mask, 2, 1, lq, lkv, device="cpu")
    q, k, v = qkv(2, 1, Lq=lq, Lkv=lkv, seed=36)
    torch.testing.assert_close(flex_attention(q, k, v, score_mod=mult, block_mask=block_mask),
                               _torch_flex(q, k, v, score_mod=mult, block_mask=block_mask), **TOL)


def test_sparse_block_not_dividing_seqlen():
    """test_flex_attention.py::TestFlexAttention::test_sparse_block_not_dividing_seqlen (pytorch
    1410d025), scaled down: blocks of 128 over 192 positions, only the tail kept."""
    S = 192
    block_mask = create_block_mask(lambda b, h, m, n: n >= 128, None, None, S, S, BLOCK_SIZE=128, device="cpu")
    q, k, v = qkv(1, 2, Lq=S, seed=37, requires_grad=True)
    out = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(out, _torch_flex(q, k, v, block_mask=block_mask), **TOL)
    ref, _ = attention_reference(*(t.detach().double().requires_grad_() for t in (q, k, v)),
                                 mask_mod=lambda b, h, m, n: n >= 128)
    assert torch.autograd.grad(out.sum(), q)[0].isfinite().all()


def test_narrow_kv_block_size():
    """test_flex_attention.py::TestFlexAttention::test_narrow_kv_block_size_uses_clamped_default_config
    (pytorch 1410d025): BLOCK_SIZE=(128, 64)."""
    block_mask = create_block_mask(_causal_mask, None, None, 256, 256, BLOCK_SIZE=(128, 64), device="cpu")
    q, k, v = qkv(1, 1, Lq=256, seed=38)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask),
                               _torch_flex(q, k, v, block_mask=block_mask), **TOL)


def test_zero_length_sequence():
    """test_flex_attention.py::TestFlexAttention::test_zero_length_sequence_error (pytorch 1410d025):
    torch's compiled kernel refuses a query length of 0 ("Query length must be greater than 0") and
    eager torch 2.13 fails inside (IndexError from max() over an empty row); maskc returns an empty
    out, and zeros for queries with no keys at all."""
    q, k, v = (torch.ones(1, 2, 0, 16) for _ in range(3))
    with pytest.raises(IndexError):
        _torch_flex(q, k, v)
    assert flex_attention(q, k, v).shape == (1, 2, 0, 16)
    assert (flex_attention(torch.ones(1, 2, 4, 16), k, v) == 0).all()


# -- decoding ---------------------------------------------------------------------------------
def test_non_divisible_offset_mask():
    """test_flex_decoding.py::TestFlexDecoding::test_non_divisible_offset_mask and
    test_non_divisible_multi_token_offset_mask (pytorch bdfe4a90): one (or three) queries against
    KV_S = S - 3 keys, a captured 0-d offset, GQA."""
    KV_S = 253
    for Q_S, off in ((1, 125), (3, 127)):
        offset_tensor = torch.tensor(off, dtype=torch.int32)

        def mask_mod(b, h, q, kv):
            return kv >= q + offset_tensor

        block_mask = create_block_mask(mask_mod, 2, 1, Q_S, KV_S, device="cpu")
        q, k, v = qkv(2, 4, Lq=Q_S, Hkv=2, Lkv=KV_S, seed=39)
        torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True),
                                   _torch_flex(q, k, v, block_mask=block_mask, enable_gqa=True), **TOL)


def test_head_dependent_mask_mod():
    """test_flex_decoding.py::TestFlexDecoding::test_head_dependent_mask_mod (pytorch bdfe4a90): a
    BlockMask of H = Hq with GQA and one query."""
    Hq, Hkv, S = 4, 2, 128
    head_type = torch.tensor([i % Hq != 0 for i in range(Hq)])

    def mask_mod(b, h, q_idx, kv_idx):
        return head_type[h] & (q_idx >= kv_idx)

    mask = create_block_mask(mask_mod, 1, Hq, 1, S, device="cpu")
    q, k, v = qkv(2, Hq, Lq=1, Hkv=Hkv, Lkv=S, seed=40)
    torch.testing.assert_close(flex_attention(q, k, v, score_mod=_rel_bias, block_mask=mask, enable_gqa=True),
                               _torch_flex(q, k, v, score_mod=_rel_bias, block_mask=mask, enable_gqa=True), **TOL)


def test_windowed_full_mask_vs_sdpa():
    """test_flex_decoding.py::TestFlexDecoding::test_windowed_full_mask_vs_sdpa and
    test_windowed_partial_block_vs_sdpa (pytorch bdfe4a90), offset 100 on 256 keys: against SDPA."""
    offset, Mq, S = 100, 8, 256

    def mask_mod(b, h, q, kv):
        return q + offset >= kv

    def windowed(score, b, h, q, kv):
        return torch.where(q + offset >= kv, score, float("-inf"))

    block_mask = create_block_mask(mask_mod, 1, 1, Mq, S, device="cpu")
    sdpa_mask = torch.tril(torch.ones(S, S, dtype=torch.bool))[offset: offset + Mq]
    q, k, v = qkv(1, 2, Lq=Mq, Lkv=S, seed=41)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask, score_mod=windowed), want, **TOL)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask), want, **TOL)
    torch.testing.assert_close(flex_attention(q, k, v, score_mod=windowed), want, **TOL)


def test_non_sparse_multiple_block_size():
    """test_flex_decoding.py::TestFlexDecoding::test_non_sparse_mulitple_block_size (pytorch bdfe4a90):
    one query, 65 keys, a captured offset of 192."""
    offset = torch.tensor(192, dtype=torch.int32)

    def causal_offset_mask(b, h, q_idx, kv_idx):
        return (offset + q_idx) >= kv_idx

    block_mask = create_block_mask(causal_offset_mask, 1, 1, 1, 65, device="cpu")
    q, k, v = qkv(1, 1, Lq=1, Lkv=65, seed=42)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask),
                               _torch_flex(q, k, v, block_mask=block_mask), **TOL)


@pytest.mark.parametrize("q_seq_len", [4, 23, 64])
def test_multi_block_m(q_seq_len):
    """test_flex_decoding.py::TestFlexDecoding::test_multi_block_m (pytorch bdfe4a90): vLLM's
    BLOCK_SIZE=16 causal mask, GQA, kernel_options BLOCK_M/BLOCK_N (ignored by maskc)."""
    mask = create_block_mask(_causal_mask, B=1, H=1, Q_LEN=q_seq_len, KV_LEN=128, device="cpu", BLOCK_SIZE=16)
    q, k, v = qkv(1, 4, Lq=q_seq_len, Hkv=2, Lkv=128, seed=43)
    kwargs = dict(block_mask=mask, kernel_options=dict(BLOCK_M=16, BLOCK_N=16), enable_gqa=True)
    torch.testing.assert_close(flex_attention(q, k, v, **kwargs), _torch_flex(q, k, v, **kwargs), **TOL)


def test_decode_at_different_input_position():
    """test_flex_decoding.py::TestFlexDecoding::test_decode_at_different_input_position (pytorch
    bdfe4a90), its reference half: a BlockMask of the whole cache, `_adjust(1, kv_len)` and
    seq_lengths (1, kv_len) for one query per request."""
    max_seq_len, page_size = 256, 64
    block_mask = create_block_mask(_causal_mask, 2, 1, max_seq_len, max_seq_len, device="cpu", BLOCK_SIZE=page_size)
    for i, seq_len in enumerate([5, 98, 47, 194]):
        q, k, v = qkv(1, 2, Lq=1, Lkv=seq_len, seed=44 + i)
        slice_block_mask = block_mask._adjust(1, seq_len)
        slice_block_mask.seq_lengths = (1, seq_len)
        for score_mod in (None, _rel_bias):
            torch.testing.assert_close(flex_attention(q, k, v, score_mod, slice_block_mask),
                                       _torch_flex(q, k, v, score_mod, slice_block_mask), **TOL)


def test_broadcasted_head_block_mask():
    """test_flex_attention.py::TestBlockMask::test_broadcasted_head_block_mask (pytorch 1410d025),
    scaled down: a q-block slice of a B=B, H=None mask, its mask_mod replaced by one that adds the
    decoding position, seq_lengths (1, T), against SDPA on the cropped cache."""
    B, T, H, current_pos = 2, 256, 2, 100
    g = torch.Generator().manual_seed(48)
    q = torch.randn(B, H, 1, 16, generator=g)
    k_cache, v_cache = torch.randn(B, H, T, 16, generator=g), torch.randn(B, H, T, 16, generator=g)
    sdpa_output = F.scaled_dot_product_attention(q, k_cache[:, :, : current_pos + 1], v_cache[:, :, : current_pos + 1])
    base_mask = create_block_mask(_causal_mask, B=B, H=None, Q_LEN=T, KV_LEN=T, device="cpu")
    mask_slice = base_mask[:, :, current_pos // base_mask.BLOCK_SIZE[0]]
    offset_tensor = torch.tensor(current_pos)

    def with_offset(b, h, q_idx, kv_idx):
        return _causal_mask(b, h, q_idx + offset_tensor, kv_idx)

    mask_slice.mask_mod = with_offset
    mask_slice.seq_lengths = (1, mask_slice.seq_lengths[1])
    torch.testing.assert_close(flex_attention(q, k_cache, v_cache, block_mask=mask_slice), sdpa_output, **TOL)


def test_adjusted_block_mask_drives_flex_attention():
    """test_flex_attention.py::TestBlockMask::test_adjust_block_mask_ignores_entries_past_num_blocks
    (pytorch 1410d025): on torch 2.13 `_adjust(128, 384)` of a 640-key mask keeps a FULL entry
    for block 3 (past the new 3 blocks) in its count (torch 2.13 and maskc make the same lists;
    the newer torch drops it). Eager torch applies only the mask_mod; maskc reads the adjusted
    mask as well, dropping the stale entry."""
    def mask_mod(b, h, q, kv):
        return (kv < 128) | ((kv >= 384) & (kv < 512))

    adjusted = create_block_mask(mask_mod, 1, 1, 128, 640, device="cpu")._adjust(128, 384)
    assert torch.equal(adjusted.to_dense(), create_block_mask(mask_mod, 1, 1, 128, 384, device="cpu").to_dense())
    q, k, v = qkv(1, 1, Lq=128, Lkv=384, seed=49)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=adjusted),
                               _torch_flex(q, k, v, block_mask=adjusted), **TOL)


# -- mask_mod None, noop_mask, refusals --------------------------------------------------------
def test_block_mask_with_mask_mod_none():
    """BlockMask.from_kv_blocks(..., mask_mod=None) (torch fills in noop_mask): its listed tiles alone
    decide, as in torch's kernels (cf. test_flex_flash_honors_sparse_metadata_with_trivial_mask)."""
    kv_num = torch.tensor([[[1, 1]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)
    block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=32, mask_mod=None, seq_lengths=(64, 64))
    q, k, v = qkv(1, 1, Lq=64, seed=50)
    want, _ = attention_reference(q, k, v, mask_mod=lambda b, h, qi, ki: ki < 32)  # only kv block 0 listed
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask).double(), want, **TOL)


def test_noop_mask_block_mask():
    """run_test's default: create_block_mask(noop_mask, B, H, S, S) with every score_mod."""
    block_mask = create_block_mask(noop_mask, 2, 2, 96, 96, device="cpu")
    assert block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum() == 4
    q, k, v = qkv(2, 2, Lq=96, seed=51)
    for score_mod in SCORE_MODS:
        torch.testing.assert_close(flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask),
                                   _torch_flex(q, k, v, score_mod=score_mod, block_mask=block_mask), **TOL)


def test_mixed_dtypes_are_refused_as_documented():
    """test_flex_attention.py::TestFlexAttention::test_mixed_dtypes_eager (pytorch 1410d025): eager torch
    computes fp32 q with fp16 k, v; docs/guides/block-maps.md documents maskc's TypeError asking for one dtype."""
    q, k, v = qkv(1, 1, Lq=32, seed=52)
    k, v = k.half(), v.half()
    assert _torch_flex(q, k, v).dtype == torch.float32
    with pytest.raises(TypeError, match="cast"):
        flex_attention(q, k, v)


def test_max_scores_is_refused_as_documented():
    """test_flex_attention.py::TestFlexAttention::test_return_max (pytorch 1410d025): docs/guides/block-maps.md documents
    `return_aux=AuxRequest(max_scores=True)` as NotImplementedError."""
    q, k, v = qkv(1, 1, Lq=32, seed=53)
    with pytest.raises(NotImplementedError, match="max_scores"):
        flex_attention(q, k, v, return_aux=torch_flex.AuxRequest(max_scores=True))


def test_nested_tensor_inputs_error():
    """test_flex_attention.py::TestFlexAttention::test_nested_tensor_inputs_error (pytorch 1410d025):
    torch refuses jagged NestedTensor inputs with NotImplementedError; maskc refuses them with an
    error that names them and the fix."""
    def make_nt(lengths):
        g = torch.Generator().manual_seed(54)
        return torch.nested.nested_tensor([torch.randn(s, 2, 16, generator=g) for s in lengths],
                                          layout=torch.jagged).transpose(1, 2)

    q, k, v = make_nt([3, 2]), make_nt([3, 2]), make_nt([3, 2])
    with pytest.raises(NotImplementedError, match="NestedTensor"):
        torch_flex.flex_attention(q, k, v)
    with pytest.raises((NotImplementedError, TypeError, ValueError), match="(?i)nested"):
        flex_attention(q, k, v)


@pytest.mark.parametrize("case", ["3d_query", "head_dim_mismatch", "batch_mismatch", "kv_length_mismatch"])
def test_wrong_shapes_are_refused(case):
    """What torch's _validate_sdpa_input / flex_attention checks refuse, refused by maskc with an
    error naming the shapes (ValueError or RuntimeError, not an IndexError or a Triton error)."""
    q, k, v = qkv(2, 2, Lq=32, seed=55)
    if case == "3d_query":
        q = q[0]
    elif case == "head_dim_mismatch":
        k = torch.randn(2, 2, 32, 8)
    elif case == "batch_mismatch":
        k, v = k.repeat(3, 1, 1, 1)[:3], v.repeat(3, 1, 1, 1)[:3]
    elif case == "kv_length_mismatch":
        v = v[:, :, :16]
    with pytest.raises((ValueError, RuntimeError)):
        _torch_flex(q, k, v)
    with pytest.raises((ValueError, RuntimeError, TypeError)) as info:
        flex_attention(q, k, v)
    assert not isinstance(info.value, (IndexError, AssertionError))
