"""Attention dropout on the GPU: the compiled kernels drop exactly the pairs the torch evaluation
of the rule drops (maskc.testing.dropout_keep, on the GPU too), forward, lse and the gradients
of q, k and v against the float64 reference, with GQA, a mask and lengths that are not tile
multiples; a call on Hopper, where the Gluon kernels would run without dropout, runs the
Triton-language ones with it."""
from __future__ import annotations

import pytest
import torch

import maskc
from maskc.testing import assert_close_to_reference, attention_reference, dropout_keep

from ._common import assert_lse_close, randn


@pytest.mark.parametrize("dtype, mask", [(torch.bfloat16, "causal"), (torch.float32, "document")])
def test_dropout_against_the_reference(dtype, mask):
    gen = torch.Generator().manual_seed(21)
    B, Hq, Hkv, L, D, p = 2, 8, 2, 1000, 64, 0.2
    q, k, v = (randn((B, h, L, D), dtype, gen).requires_grad_() for h in (Hq, Hkv, Hkv))
    mod = maskc.masks.causal if mask == "causal" else maskc.masks.document(
        torch.arange(L, device="cuda") // 300, causal=True)
    drawing = torch.Generator(device="cuda")
    drawing.manual_seed(5)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mod, enable_gqa=True, dropout_p=p, generator=drawing,
                                        return_lse=True)
    drawing.manual_seed(5)
    keep = dropout_keep(B, Hq, L, L, p, generator=drawing)
    assert keep.device.type == "cuda"
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_reference(*leaves, mod, enable_gqa=True, dropout_keep=keep, dropout_p=p)
    assert_close_to_reference(out, ref.detach(), dtype)
    assert_lse_close(lse, ref_lse.detach())
    d_out = randn(out.shape, dtype, gen)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    ref_grads = torch.autograd.grad(ref, leaves, d_out.double())
    for name, got, want in zip("qkv", grads, ref_grads):
        assert_close_to_reference(got, want, dtype, what=f"d{name}")


def test_dropout_is_reproducible_and_its_rate_holds():
    gen = torch.Generator().manual_seed(22)
    q, k, v = (randn((4, 16, 1024, 128), torch.bfloat16, gen) for _ in "qkv")
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, dropout_p=0.1))
    assert torch.equal(*runs)
    torch.manual_seed(7)
    keep = dropout_keep(4, 16, 1024, 1024, 0.1, device="cuda")
    n = keep.numel()
    dropped = n - int(keep.sum())
    assert abs(dropped - 0.1 * n) < 5 * (0.1 * 0.9 * n) ** 0.5


def test_a_captured_dropout_call_draws_a_new_seed_on_each_replay():
    """The seed is drawn by a torch op from the default CUDA generator, whose offset CUDA graphs
    advance on each replay (as for SDPA's dropout): replays drop different pairs, and each drops
    about p of them."""
    gen = torch.Generator().manual_seed(23)
    B, H, L, D, p = 1, 4, 512, 64, 0.5
    q, k = (randn((B, H, L, D), torch.bfloat16, gen) for _ in "qk")
    # one-hot values: out[..., i, j % D] sums the scaled kept probabilities of keys j ≡ that column
    v = torch.zeros(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    v[..., torch.arange(L), torch.arange(L) % D] = 1

    def step():
        return maskc.compiled_attention(q, k, v, dropout_p=p)

    step()  # plans the call outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(out.clone())
    assert not torch.equal(replays[0], replays[1]) and not torch.equal(replays[1], replays[2])
    plain = maskc.compiled_attention(q, k, v).float()
    for got in replays:
        # each row's mass: about 1 - p of it kept, scaled back by 1 / (1 - p), so the mean is ~1
        assert abs(got.float().sum(-1).mean().item() - plain.sum(-1).mean().item()) < 0.05
