"""The integrations on a GPU: torch.compile (inductor), the FlexAttention drop-in and the Hugging
Face backend, each checked against its reference on CUDA.

    bash benchmarks/run_gpu.sh benchmarks/check_gpu_integrations.py [compile|flex|scalars|transformers ...]

Prints one line per check and the number of failures (exit status 1 when any failed).
"""
from __future__ import annotations

import copy
import sys
import traceback

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
import transformers
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import maskc
import maskc.integrations.transformers as maskc_hf
from maskc import masks, scores
from maskc.testing import assert_close_to_reference, attention_reference

DEV = "cuda"


class Attention(torch.nn.Module):
    def __init__(self, mask_mod, score_mod=None, dim=64, heads=4):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim, device=DEV, dtype=torch.bfloat16)
        self.heads, self.mask_mod, self.score_mod = heads, mask_mod, score_mod

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return maskc.compiled_attention(q, k, v, mask_mod=self.mask_mod, score_mod=self.score_mod).sum()


def check_compile():
    ids = torch.tensor([0] * 300 + [1] * 200 + [2] * 12, device=DEV)
    for name, mask, score in (("causal", masks.causal, None), ("document", masks.document(ids, causal=True), None),
                              ("sliding+softcap", masks.sliding_window(64), scores.softcap(20.0))):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        module = Attention(mask, score)
        x = torch.randn(2, 512, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        eager = module(x)
        (g_eager,) = torch.autograd.grad(eager, x)
        compiled = torch.compile(module, fullgraph=True, backend="inductor")
        got = compiled(x)
        (g_got,) = torch.autograd.grad(got, x)
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        assert breaks == 0, f"{breaks} graph breaks"
        torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(g_got, g_eager, rtol=2e-2, atol=2e-2)
        yield f"torch.compile inductor {name}: fullgraph, 0 breaks, loss and dx match eager"


def check_flex():
    B, H, L, D = 2, 4, 1000, 64
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    ids = torch.sort(torch.randint(0, 5, (L,), device=DEV)).values

    def document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    theirs_bm = torch_block_mask(document, None, None, L, L, device=DEV)
    want = torch.compile(torch_flex)(q, k, v, score_mod=softcap, block_mask=theirs_bm)
    ours_bm = maskc.create_block_mask(document, None, None, L, L, device=DEV)
    for label, bm in (("maskc.create_block_mask", ours_bm), ("torch's BlockMask", theirs_bm)):
        got = maskc.flex_attention(q, k, v, score_mod=softcap, block_mask=bm)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        yield f"flex drop-in with {label}: matches torch.compile(flex_attention)"
    ref, _ = attention_reference(q[:1, :1], k[:1, :1], v[:1, :1], mask_mod=document, score_mod=softcap)
    assert_close_to_reference(got[:1, :1], ref, torch.bfloat16)
    yield "flex drop-in: matches the float64 reference on a slice"
    # under inductor with fullgraph: a new BlockMask per batch runs the same graph
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    capped = maskc.score_mod(softcap)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda q, k, v, bm: maskc.flex_attention(q, k, v, score_mod=capped, block_mask=bm),
                             fullgraph=True, backend=counter)
    for n_docs in (5, 9):
        ids.copy_(torch.sort(torch.randint(0, n_docs, (L,), device=DEV)).values)
        bm = maskc.create_block_mask(document, None, None, L, L, device=DEV)
        want = torch.compile(torch_flex)(q, k, v, score_mod=softcap, block_mask=bm)
        torch.testing.assert_close(compiled(q, k, v, bm), want, rtol=2e-2, atol=2e-2)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for two BlockMasks of one shape"
    yield "flex drop-in under torch.compile(inductor, fullgraph): two BlockMasks, one graph, match torch's Flex"


def check_cpu_scalars():
    """0-d CPU tensors in mods run beside CUDA inputs, as in torch: one a mod makes
    (transformers' Gemma 3 ORs `lambda *args: torch.tensor(True)` into its bidirectional mask)
    and a captured one the caller changes in place."""
    B, H, L, D = 2, 4, 300, 64
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    window = torch.tensor(40)
    bias = torch.tensor(0.5)

    def windowed_or_true(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() < window) | ((kv_idx < 0) & torch.tensor(True))

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias * (q_idx >= kv_idx)

    for w, c in ((40, 0.5), (7, -1.0)):
        window.fill_(w), bias.fill_(c)
        out = maskc.compiled_attention(q, k, v, mask_mod=windowed_or_true, score_mod=biased)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, _ = attention_reference(q64, k64, v64, mask_mod=windowed_or_true, score_mod=biased)
        assert_close_to_reference(out, ref, torch.bfloat16)
        for g, r in zip(grads, torch.autograd.grad(ref, (q64, k64, v64), torch.ones_like(ref))):
            assert_close_to_reference(g, r, torch.bfloat16)
        yield f"CPU scalars in a mask and a score mod (window {w}, bias {c}): forward and gradients match"
    out = maskc.compiled_attention(q[:, :, -1:].detach(), k.detach(), v.detach(), mask_mod=windowed_or_true,
                                   kv_lens=torch.full((B,), L, device=DEV))
    ref, _ = attention_reference(q[:, :, -1:].detach(), k.detach(), v.detach(),
                                 mask_mod=lambda b, h, q_idx, kv_idx: windowed_or_true(b, h, q_idx + L - 1, kv_idx))
    assert_close_to_reference(out, ref, torch.bfloat16)
    yield "CPU scalars in decoding: match"


def check_transformers():
    maskc_hf.register()
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=2048)
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="maskc")
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    ours, theirs = (m.to(DEV, torch.float32).eval() for m in (ours, theirs))
    ids = torch.randint(0, 1000, (2, 300), device=DEV)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = theirs(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], rtol=1e-3, atol=1e-3)
    yield "transformers Llama (float32, left padding): logits match sdpa"
    prompt = ids[:1, :64]
    out_a = ours.generate(prompt, max_new_tokens=32, do_sample=False)
    out_b = theirs.generate(prompt, max_new_tokens=32, do_sample=False)
    assert torch.equal(out_a, out_b), "generated tokens differ"
    yield "transformers Llama generate 32 tokens (greedy): same tokens as sdpa"
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(ours, backend="inductor")
    graphs = []
    for pad in (5, 40, 11):
        mask = torch.ones_like(ids)
        mask[1, :pad] = 0
        with torch.no_grad():
            a = compiled(input_ids=ids, attention_mask=mask).logits
            b = theirs(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=1e-3, atol=1e-3)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1], f"recompiled for new padding: unique graphs {graphs}"
    yield f"transformers Llama under torch.compile(inductor): logits match sdpa, three paddings, {graphs[-1]} graphs"


def main():
    failures = 0
    checks = {"compile": check_compile, "flex": check_flex, "scalars": check_cpu_scalars,
              "transformers": check_transformers}
    for check in [checks[name] for name in sys.argv[1:]] or checks.values():
        try:
            for line in check():
                print(f"ok    {line}", flush=True)
        except Exception as error:  # report and go on: one line per failing check
            failures += 1
            print(f"FAIL  {check.__name__}: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc(limit=4)
    print(f"{failures} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
