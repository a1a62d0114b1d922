"""maskc.flex_attention under torch.compile(fullgraph=True) finds a torch BlockMask's converted
BlockMap again (maskc/runtime/ops.py's `converted`): a repeated call does not convert its tile
tensors again, a tile tensor written in place or a new BlockMask of other values is converted
again and gives its own answer (against torch's flex_attention, eager on CPU), and a loop
making a new BlockMask per step keeps at most the cache's bound.

Shapes are tiny: maskc's kernels run in Triton's interpreter.
"""
import warnings

import pytest
import torch
from _inputs import qkv
from torch._dynamo.utils import counters
from torch.nn.attention import flex_attention as torch_flex

import maskc
from maskc import masks
from maskc.analysis import BlockMap
from maskc.integrations import flex

L, BLOCK = 64, 16


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    counters.clear()
    maskc.clear_caches()
    yield
    torch._dynamo.reset()


@pytest.fixture
def conversions(monkeypatch):
    """The calls of BlockMap.from_flex_tiles, each a conversion of a BlockMask's tile tensors."""
    made = []
    convert = BlockMap.from_flex_tiles

    def counted(cls, *args, **kwargs):
        made.append(args)
        return convert(*args, **kwargs)

    monkeypatch.setattr(BlockMap, "from_flex_tiles", classmethod(counted))
    return made


def _torch_flex_of_tiles(q, k, v, block_mask):
    """torch's flex_attention, eager on CPU, of the pairs FlexAttention's kernels attend with
    `block_mask` (its eager path applies only the mask_mod, so the tiles enter as the mask)."""
    keep = torch.zeros(L, L, dtype=torch.bool)
    pos = torch.arange(L)
    for num, idx, full in ((block_mask.kv_num_blocks, block_mask.kv_indices, False),
                           (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True)):
        for row in range(num.shape[-1]):
            for col in idx[0, 0, row, :num[0, 0, row]].tolist():
                rows, cols = slice(row * BLOCK, (row + 1) * BLOCK), slice(col * BLOCK, (col + 1) * BLOCK)
                keep[rows, cols] = True if full else (pos[rows].view(-1, 1) >= pos[cols].view(1, -1))
    dense = torch_flex.create_block_mask(lambda b, h, q_idx, kv_idx: keep[q_idx, kv_idx], None, None, L, L,
                                         device="cpu", BLOCK_SIZE=BLOCK)
    with warnings.catch_warnings():  # eager on CPU is unfused: said once per process
        warnings.simplefilter("ignore")
        return torch_flex.flex_attention(q, k, v, block_mask=dense)


def _compiled():
    return torch.compile(lambda q, k, v, block_mask: maskc.flex_attention(q, k, v, block_mask=block_mask),
                         backend="aot_eager", fullgraph=True)


def _causal():
    return maskc.create_block_mask(masks.causal, None, None, L, L, device="cpu", BLOCK_SIZE=BLOCK)


def _check(out, q, k, v, block_mask):
    torch.testing.assert_close(out, _torch_flex_of_tiles(q, k, v, block_mask), atol=2e-5, rtol=2e-5)


def test_a_repeated_call_with_the_same_block_mask_does_not_convert_again(conversions):
    compiled, block_mask = _compiled(), _causal()
    q, k, v = qkv(1, 1, 1, L, L, seed=1)
    with torch.no_grad():
        first = compiled(q, k, v, block_mask)
        second = compiled(q, k, v, block_mask)
    assert len(conversions) == 1
    _check(first, q, k, v, block_mask)
    torch.testing.assert_close(second, first, atol=0, rtol=0)
    assert sum(counters["graph_break"].values()) == 0


def test_kv_indices_written_in_place_are_converted_again(conversions):
    compiled, block_mask = _compiled(), _causal()
    q, k, v = qkv(1, 1, 1, L, L, seed=2)
    with torch.no_grad():
        before = compiled(q, k, v, block_mask)
        # q block 2 lists kv block 3 (above the diagonal: causal keeps none of it) instead of its
        # diagonal block 2: its queries see kv blocks 0 and 1 (full) only
        assert block_mask.kv_indices[0, 0, 2, 0] == 2
        block_mask.kv_indices[0, 0, 2, 0] = 3
        after = compiled(q, k, v, block_mask)
        again = compiled(q, k, v, block_mask)
    assert len(conversions) == 2
    _check(after, q, k, v, block_mask)
    assert not torch.allclose(after[:, :, 2 * BLOCK:3 * BLOCK], before[:, :, 2 * BLOCK:3 * BLOCK], atol=1e-3)
    torch.testing.assert_close(again, after, atol=0, rtol=0)


def test_a_new_block_mask_of_other_values_gets_its_own_map(conversions):
    compiled, block_mask = _compiled(), _causal()
    q, k, v = qkv(1, 1, 1, L, L, seed=3)
    made = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    # q block 3 lists its full blocks in another order and leaves kv block 1 out; new tensors that
    # no one wrote to, of the first's shapes and versions: only their addresses tell them apart
    full_num = torch.tensor([[[0, 1, 2, 2]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [2, 0, 1, 3]]]], dtype=torch.int32)
    tiles = (made[0].clone(), made[1].clone(), full_num, full_idx)
    assert [(t._version, t.shape) for t in tiles] == [(t._version, t.shape) for t in made]
    other = torch_flex.BlockMask.from_kv_blocks(*tiles, BLOCK_SIZE=BLOCK, mask_mod=masks.causal, seq_lengths=(L, L))
    with torch.no_grad():
        first = compiled(q, k, v, block_mask)
        second = compiled(q, k, v, other)
        assert len(conversions) == 2
        again = compiled(q, k, v, other), compiled(q, k, v, block_mask)
    assert len(conversions) == 2
    _check(first, q, k, v, block_mask)
    _check(second, q, k, v, other)
    assert not torch.allclose(second[:, :, 3 * BLOCK:], first[:, :, 3 * BLOCK:], atol=1e-3)
    for got, want in zip(again, (second, first)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_new_block_mask_per_step_keeps_at_most_the_bound():
    bound = maskc.cache_info()["runtime.ops.CONVERTED"].maxsize
    for length in range(16, 16 * (bound + 8) + 1, 16):
        block_mask = maskc.create_block_mask(masks.causal, None, None, length, length, device="cpu", BLOCK_SIZE=16)
        flex.converted(block_mask)
    info = maskc.cache_info()["runtime.ops.CONVERTED"]
    assert info.currsize == bound and info.nbytes <= info.maxbytes
