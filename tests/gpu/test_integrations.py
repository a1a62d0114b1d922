"""The integrations on CUDA, each against its reference: maskc under torch.compile (inductor,
fullgraph), the FlexAttention drop-in (maskc.flex_attention with either library's BlockMask,
eager and compiled), 0-d CPU tensors in mods beside CUDA inputs, and the Hugging Face backend
(logits, greedy generation and torch.compile against transformers' SDPA)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import maskc
from maskc import masks, scores
from maskc.testing import assert_close_to_reference, attention_reference

from ._common import lane_sample


class Attention(torch.nn.Module):
    def __init__(self, mask_mod, score_mod=None, dim=64, heads=4):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim, device="cuda", dtype=torch.bfloat16)
        self.heads, self.mask_mod, self.score_mod = heads, mask_mod, score_mod

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return maskc.compiled_attention(q, k, v, mask_mod=self.mask_mod, score_mod=self.score_mod).sum()


MODULES = {
    "causal": lambda: (masks.causal, None),
    "document": lambda: (masks.document(torch.tensor([0] * 300 + [1] * 200 + [2] * 12, device="cuda"), causal=True),
                         None),
    "sliding+softcap": lambda: (masks.sliding_window(64), scores.softcap(20.0)),
}


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mods", lane_sample(list(MODULES), lambda i, v: v == "sliding+softcap"))
def test_torch_compile_inductor(mods, fresh_dynamo):
    """A module calling maskc compiles with fullgraph and no graph break; loss and dx match eager."""
    module = Attention(*MODULES[mods]())
    x = torch.randn(2, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = module(x)
    (g_eager,) = torch.autograd.grad(eager, x)
    got = torch.compile(module, fullgraph=True, backend="inductor")(x)
    (g_got,) = torch.autograd.grad(got, x)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert breaks == 0, f"{breaks} graph breaks"
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g_got, g_eager, rtol=2e-2, atol=2e-2)


def _flex_problem(n_docs: int = 5):
    B, H, L, D = 2, 4, 1000, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(dtype=torch.bfloat16, device="cuda") for _ in range(3))
    ids = torch.sort(torch.randint(0, n_docs, (L,), generator=g)).values.cuda()

    def document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    return q, k, v, ids, document, softcap


@pytest.mark.parametrize("block_mask", lane_sample(["maskc.create_block_mask", "torch's BlockMask"],
                                                   lambda i, v: v == "torch's BlockMask"))
def test_flex_drop_in(block_mask, fresh_dynamo):
    """maskc.flex_attention matches torch.compile(flex_attention) with either BlockMask, and the
    float64 reference on a slice."""
    q, k, v, ids, document, softcap = _flex_problem()
    L = q.shape[2]
    make = maskc.create_block_mask if block_mask == "maskc.create_block_mask" else torch_block_mask
    bm = make(document, None, None, L, L, device="cuda")
    want = torch.compile(torch_flex)(q, k, v, score_mod=softcap, block_mask=torch_block_mask(
        document, None, None, L, L, device="cuda"))
    got = maskc.flex_attention(q, k, v, score_mod=softcap, block_mask=bm)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    ref, _ = attention_reference(q[:1, :1], k[:1, :1], v[:1, :1], mask_mod=document, score_mod=softcap)
    assert_close_to_reference(got[:1, :1], ref, torch.bfloat16)


def test_flex_drop_in_compiled(fresh_dynamo):
    """Under inductor with fullgraph, a new BlockMask per batch (documents changed in place) runs
    the same graph and matches torch's FlexAttention."""
    q, k, v, ids, document, softcap = _flex_problem()
    L = q.shape[2]
    capped = maskc.score_mod(softcap)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda q, k, v, bm: maskc.flex_attention(q, k, v, score_mod=capped, block_mask=bm),
                             fullgraph=True, backend=counter)
    flex = torch.compile(torch_flex)
    for n_docs in (5, 9):
        ids.copy_(torch.sort(torch.randint(0, n_docs, (L,), device="cuda")).values)
        bm = maskc.create_block_mask(document, None, None, L, L, device="cuda")
        want = flex(q, k, v, score_mod=softcap, block_mask=bm)
        torch.testing.assert_close(compiled(q, k, v, bm), want, rtol=2e-2, atol=2e-2)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for two BlockMasks of one shape"


def _scalar_mods():
    """A mask ORing a 0-d tensor the mod makes (transformers' Gemma 3: `lambda *args:
    torch.tensor(True)`) and a score mod over a captured 0-d CPU tensor, with their tensors."""
    window = torch.tensor(40)
    bias = torch.tensor(0.5)

    def windowed_or_true(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() < window) | ((kv_idx < 0) & torch.tensor(True))

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias * (q_idx >= kv_idx)

    return windowed_or_true, biased, window, bias


@pytest.mark.parametrize("w, c", lane_sample([(40, 0.5), (7, -1.0)], lambda i, v: i == 1))
def test_cpu_scalars_in_mods(w, c):
    """0-d CPU tensors in a mask and a score mod run beside CUDA inputs, as in torch, and a change
    in place between calls is seen: forward and gradients match the reference."""
    B, H, L, D = 2, 4, 300, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask, score, window, bias = _scalar_mods()
    maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score)  # at the first values
    window.fill_(w), bias.fill_(c)
    out = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, mask_mod=mask, score_mod=score)
    assert_close_to_reference(out, ref, torch.bfloat16)
    for what, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q64, k64, v64), torch.ones_like(ref))):
        assert_close_to_reference(g, r, torch.bfloat16, what=what)


def test_cpu_scalars_in_decoding():
    B, H, L, D = 2, 4, 300, 64
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16) for n in (1, L, L))
    mask, _, _, _ = _scalar_mods()
    out = maskc.compiled_attention(q, k, v, mask_mod=mask, kv_lens=torch.full((B,), L, device="cuda"))
    ref, _ = attention_reference(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: mask(b, h, q_idx + L - 1, kv_idx))
    assert_close_to_reference(out, ref, torch.bfloat16)


@pytest.fixture(scope="module")
def llamas():
    """A two-layer Llama with maskc's backend and the same weights with SDPA's, float32."""
    transformers = pytest.importorskip("transformers")
    import maskc.integrations.transformers as maskc_hf
    maskc_hf.register()
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=2048)
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="maskc")
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    return tuple(m.to("cuda", torch.float32).eval() for m in (ours, theirs))


def _ids_and_padding(pad: int):
    ids = torch.randint(0, 1000, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0  # left padding
    return ids, mask


def test_transformers_logits(llamas):
    ours, theirs = llamas
    ids, mask = _ids_and_padding(37)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = theirs(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], rtol=1e-3, atol=1e-3)


def test_transformers_generate(llamas):
    """16 greedy tokens: the same as SDPA's."""
    ours, theirs = llamas
    prompt = _ids_and_padding(0)[0][:1, :64]
    out_a = ours.generate(prompt, max_new_tokens=16, do_sample=False)
    out_b = theirs.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(out_a, out_b), "generated tokens differ"


def test_transformers_compiled(llamas, fresh_dynamo):
    """Under torch.compile(inductor): logits match SDPA's at three paddings, with no recompile for
    a new padding."""
    ours, theirs = llamas
    compiled = torch.compile(ours, backend="inductor")
    graphs = []
    for pad in (5, 40, 11):
        ids, mask = _ids_and_padding(pad)
        with torch.no_grad():
            a = compiled(input_ids=ids, attention_mask=mask).logits
            b = theirs(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=1e-3, atol=1e-3)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1], f"recompiled for new padding: unique graphs {graphs}"


@pytest.mark.parametrize("batch, pad", [(1, 0), (4, 0), (4, 9)], ids=["batch 1", "batch 4", "batch 4, left padding"])
def test_transformers_static_cache_compiled_generate(llamas, fresh_dynamo, batch, pad):
    """transformers' fast path: a static cache, the forward compiled with CUDA graphs
    (mode="reduce-overhead"); the greedy tokens are SDPA's on the same path."""
    ours, theirs = llamas
    ids, mask = _ids_and_padding(pad)
    ids, mask = ids[:1].expand(batch, -1)[:, :64].clone(), mask[1:].expand(batch, -1)[:, :64].clone()
    outs = []
    for model in (ours, theirs):
        torch._dynamo.reset()
        outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                   do_sample=False, cache_implementation="static"))
    assert torch.equal(*outs), "generated tokens differ"
