"""Integer widths in the kernel: literals past int32 are int64, as captured numbers are; integer
arithmetic on captured tensors' elements is exact up to int64, as the block-map analysis and
maskc's dense evaluation compute it (torch computes in the table's dtype and wraps)."""
import types

import pytest
import torch

import maskc
from maskc.testing import assert_block_map_exact, assert_close_to_reference, attention_reference, dense_mask
from _inputs import qkv


@pytest.mark.parametrize("mod", [
    lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 10**12,
    lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) < (1 << 40) - 10,
    lambda b, h, q_idx, kv_idx: q_idx - kv_idx >= -(10**12) + q_idx * 0,
    lambda b, h, q_idx, kv_idx: (q_idx * 10**10 + kv_idx) % 3 == 0,
    lambda b, h, q_idx, kv_idx: (q_idx * 2**35) // 2**34 >= kv_idx,
    lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 2**31,
], ids=["10**12", "1 << 40", "-10**12", "q_idx * 10**10 % 3", "q_idx * 2**35 // 2**34", "2**31"])
def test_integer_literals_past_int32_run_as_int64(mod):
    # Triton typed them int32 beside the int32 positions: "Scalar ... is out of range for type int32"
    q, k, v = qkv(Lq=40, Lkv=40)
    out = maskc.compiled_attention(q, k, v, mask_mod=mod)
    assert_close_to_reference(out, attention_reference(q, k, v, mask_mod=mod)[0])
    assert_block_map_exact(mod, 40, 40, (16, 16))


L = 64
# int32 values whose products by 100 pass 2**31 (63e8): torch wraps them, maskc computes exactly
IDS = (torch.arange(L, dtype=torch.int64) * 1_000_000).to(torch.int32)


def spelled_apart(b, h, q_idx, kv_idx):
    return IDS[q_idx] * 100 >= IDS[kv_idx] * 100


def spelled_as_a_difference(b, h, q_idx, kv_idx):
    return IDS[q_idx] * 100 - IDS[kv_idx] * 100 >= 0


def summed(b, h, q_idx, kv_idx):
    return (IDS[q_idx] + IDS[kv_idx]) * 30 > 0


def _with_int64_ids(mod):
    return types.FunctionType(mod.__code__, {**mod.__globals__, "IDS": IDS.long()}, mod.__name__)


def _kernel_mask(mod) -> torch.Tensor:
    """The pairs the kernel keeps: zero scores weigh the kept keys alike, and v = one-hot keys."""
    zeros = torch.zeros(1, 1, L, 16)
    out = maskc.compiled_attention(zeros, zeros, torch.eye(L)[None, None], mask_mod=mod)
    return out[0, 0] > 0


@pytest.mark.parametrize("mod", [spelled_apart, spelled_as_a_difference, summed])
def test_integer_arithmetic_on_captured_elements_is_exact_whatever_the_spelling(mod):
    # The canonical form writes both spellings as 100*IDS[q] - 100*IDS[kv] >= 0; the kernel
    # computed that in int32 (a wrapped difference of wrapped products: neither torch's answer
    # nor the exact one) while the block map's FULL and EMPTY tiles followed the exact one.
    exact = dense_mask(_with_int64_ids(mod), L, L)[0, 0]
    assert not torch.equal(exact, dense_mask(mod, L, L)[0, 0])  # torch's int32 wraps here
    assert torch.equal(_kernel_mask(mod), exact)
    bm = maskc.block_map(mod, L, L, block_size=(16, 16))
    assert torch.equal(bm.to_dense(), maskc.block_map(_with_int64_ids(mod), L, L, block_size=(16, 16)).to_dense())
    assert_block_map_exact(_with_int64_ids(mod), L, L, (16, 16))


def test_the_document_mask_keeps_its_int32_compares():
    # a difference of two int32 values only compared with 0 wraps to 0 exactly when it is 0
    from maskc.codegen.printer import TritonPrinter

    docs = torch.zeros(L, dtype=torch.int32)
    mm = maskc.mask_mod(lambda b, h, q_idx, kv_idx: (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx))
    assert "int64" not in TritonPrinter().doprint(mm.traced.expr)
