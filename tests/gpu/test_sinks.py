"""Attention sinks on the GPU: gpt-oss's shape of call (sliding window and causal, GQA, bf16),
forward, lse and the gradients of q, k, v and the sinks against the float64 reference, and a
decoding step with kv_lens, on the kernels a call runs there (Gluon's on Hopper included)."""
from __future__ import annotations

import pytest
import torch

import maskc
from maskc.testing import assert_close_to_reference, attention_reference, decode_reference

from ._common import assert_lse_close, randn


@pytest.mark.parametrize("mask", ["causal", "sliding 128"])
def test_sinks_forward_and_gradients(mask):
    gen = torch.Generator().manual_seed(11)
    B, Hq, Hkv, L, D = 1, 8, 2, 1000, 64
    q, k, v = (randn((B, h, L, D), torch.bfloat16, gen).requires_grad_() for h in (Hq, Hkv, Hkv))
    sinks = (2 * torch.randn(Hq, generator=gen)).cuda().requires_grad_()
    mod = maskc.masks.causal if mask == "causal" else maskc.masks.sliding_window(128)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mod, enable_gqa=True, sinks=sinks, return_lse=True)
    ref, ref_lse = attention_reference(*(t.detach().double() for t in (q, k, v)), mod, enable_gqa=True,
                                       sinks=sinks.detach().double())
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert_lse_close(lse, ref_lse)
    d_out = randn(out.shape, torch.bfloat16, gen)
    grads = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, _ = attention_reference(*leaves[:3], mod, enable_gqa=True, sinks=leaves[3])
    ref_grads = torch.autograd.grad(ref_out, leaves, d_out.double())
    for name, got, want in zip("q k v sinks".split(), grads, ref_grads):
        assert_close_to_reference(got, want, torch.bfloat16, what=f"d{name}")


def test_sinks_in_a_decoding_step():
    gen = torch.Generator().manual_seed(12)
    B, Hq, Hkv, L, D = 4, 32, 8, 4096, 64
    q = randn((B, Hq, 1, D), torch.bfloat16, gen)
    k, v = (randn((B, Hkv, L, D), torch.bfloat16, gen) for _ in "kv")
    lens = torch.tensor([4096, 1, 2000, 129], dtype=torch.int32, device="cuda")
    sinks = (2 * torch.randn(Hq, generator=gen)).cuda()
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.sliding_window(128), enable_gqa=True,
                                        kv_lens=lens, sinks=sinks, return_lse=True)
    ref, ref_lse = decode_reference(q.double(), k.double(), v.double(), lens, maskc.masks.sliding_window(128),
                                    enable_gqa=True, sinks=sinks.double())
    assert_close_to_reference(out, ref, torch.bfloat16)
    assert_lse_close(lse, ref_lse)
