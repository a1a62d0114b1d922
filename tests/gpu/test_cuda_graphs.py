"""Decoding steps captured in a CUDA graph and replayed on new inputs give the bits of the same
calls made eagerly (DESIGN.md: the family a call runs does not depend on how it was called): a
step over contiguous keys with kv_lens, and a serving step over a paged cache (append one token
to each sequence, then attend). A first eager call plans the step; the capture records launches
only."""
from __future__ import annotations

import pytest
import torch

import maskc

from ._common import lane_sample

MODS = {
    "causal": lambda L, H: (maskc.masks.causal, None),
    "sliding 100, softcap": lambda L, H: (maskc.masks.sliding_window(100), maskc.scores.softcap(30.0)),
    "document, ALiBi": lambda L, H: (
        maskc.masks.document(torch.arange(L, device="cuda") // 300, causal=True),
        maskc.scores.alibi(maskc.scores.alibi_slopes(H).cuda())),
}


def _captured(step):
    """A CUDA graph of step() after two warm-up calls on a side stream, and the outputs it writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@pytest.mark.parametrize("mods, lq", lane_sample([(m, lq) for m in MODS for lq in (1, 4)],
                                                  lambda i, v: i in (0, 3, 4), ids=lambda v: f"{v[0]}-Lq{v[1]}"))
def test_decode_step_replayed(mods, lq):
    B, Hq, Hkv, L, D = 3, 8, 2, 1000, 128
    mask, score = MODS[mods](L, Hq)
    q = torch.randn(B, Hq, lq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    lens = torch.tensor([L, 517, lq], dtype=torch.int32, device="cuda")

    def step():
        return maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=True, kv_lens=lens,
                                        return_lse=True)

    graph, (out, lse) = _captured(step)
    for n in range(3):
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        lens.copy_(torch.tensor([L - n, 300 + 100 * n, lq + n], dtype=torch.int32))
        graph.replay()
        want, want_lse = step()
        assert torch.equal(out, want), f"replay {n}: out differs from the eager call by {(out - want).abs().max():.3g}"
        assert torch.equal(lse, want_lse), f"replay {n}: lse differs from the eager call"


@pytest.mark.parametrize("mods, page_size", lane_sample([(m, p) for m in MODS for p in (16, 64)],
                                                         lambda i, v: i in (1, 2, 5),
                                                         ids=lambda v: f"{v[0]}-page{v[1]}"))
def test_paged_step_replayed(mods, page_size):
    """Each replay appends a token to every sequence and attends over the cache: the outputs equal
    an eager step's over a copy of the cache at the same state."""
    B, Hq, Hkv, D, prompt = 3, 8, 2, 128, 700
    caches = [maskc.PagedKVCache(B * (prompt + 64) // page_size + B, page_size, Hkv, D, dtype=torch.bfloat16,
                                 device="cuda", max_seqs=4, max_pages_per_seq=(prompt + 64) // page_size + 1)
              for _ in range(2)]
    mask, score = MODS[mods](caches[0].capacity, Hq)  # mods see logical positions up to the capacity
    seq_ids = torch.tensor([2, 0, 3], dtype=torch.int32, device="cuda")
    k, v = (torch.randn(B, Hkv, prompt, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    for cache in caches:
        cache.append(seq_ids, k[:, :, :prompt // 3], v[:, :, :prompt // 3])
        cache.append(seq_ids, k[:, :, prompt // 3:], v[:, :, prompt // 3:])
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(B, Hkv, 1, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")

    def step(cache):
        cache.append(seq_ids, k_new, v_new)
        return maskc.paged_attention(q, cache, seq_ids, mask_mod=mask, score_mod=score, enable_gqa=True)

    graph, out = _captured(lambda: step(caches[0]))
    for _ in range(2):  # the eager cache catches up with the warm-up appends (a capture runs nothing)
        step(caches[1])
    for n in range(5):
        for t in (q, k_new, v_new):
            t.copy_(torch.randn_like(t))
        graph.replay()
        want = step(caches[1])
        assert torch.equal(caches[0].lens, caches[1].lens), f"replay {n}: lens differ"
        assert torch.equal(out, want), f"replay {n}: out differs from the eager step by {(out - want).abs().max():.3g}"
    caches[0].check()


@pytest.mark.parametrize("lq, kv_lens", [(1024, False), (1, False), (2, True)],
                         ids=["prefill", "short query", "decoding step"])
def test_eager_compiled_and_replayed_calls_agree_bitwise(lq, kv_lens):
    """One call, three ways of making it: eagerly, under torch.compile(fullgraph=True) with
    Inductor, and replayed from a CUDA graph of the eager call. The kernel a call runs is chosen
    by the call alone, so all three give the same bits (a short no-grad query takes the
    decoding kernel in each)."""
    B, Hq, Hkv, L, D = 2, 8, 2, 1024, 128
    q = torch.randn(B, Hq, lq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    lens = torch.tensor([L, 700], dtype=torch.int32, device="cuda") if kv_lens else None
    # without kv_lens a lone query sits at position 0, where causal would keep a single key
    mask = None if lq == 1 and not kv_lens else maskc.masks.causal

    def call(q):
        return maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True, kv_lens=lens, return_lse=True)

    with torch.no_grad():
        eager = call(q)
        compiled = torch.compile(call, fullgraph=True)(q)
        graph, replayed = _captured(lambda: call(q))
        graph.replay()
        torch.cuda.synchronize()
    for how, got in (("compiled", compiled), ("replayed", replayed)):
        for name, a, b in zip(("out", "lse"), got, eager):
            assert torch.equal(a, b), f"{how}: {name} differs from the eager call by {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("mask", ["causal", "document"])
def test_reduce_overhead_steps_follow_kv_lens(mask):
    """torch.compile(mode="reduce-overhead") records CUDA graphs of a decoding loop whose lengths
    change every step. A causal mask captures nothing, so its operator is recorded and replayed;
    a document mask reads a captured tensor, so its operator runs between the graph's parts. Both
    give every step's eager bits."""
    B, Hq, Hkv, L, D = 2, 8, 2, 512, 64
    torch._dynamo.reset()
    gen = torch.Generator("cuda").manual_seed(3)
    k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")
    mod = (maskc.masks.causal if mask == "causal" else
           maskc.masks.document(torch.arange(L, device="cuda") // 100, causal=True))

    def step(q, lens):
        return maskc.compiled_attention(q * 1.0, k, v, mask_mod=mod, enable_gqa=True, kv_lens=lens, return_lse=True)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for n in range(100, 112):
            q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            lens = torch.tensor([n, n + 250], dtype=torch.int32, device="cuda")
            got = [t.clone() for t in compiled(q, lens)]
            want = step(q, lens)
            for name, a, b in zip(("out", "lse"), got, want):
                assert torch.equal(a, b), f"step {n}: {name} differs by {(a.float() - b.float()).abs().max():.3g}"


def test_a_call_first_made_inside_capture_names_the_rule():
    """A call whose plan does not exist yet cannot build it inside CUDA-graph capture (its
    block map's kernels and host reads): it raises saying so, not a CUDA error."""
    q = torch.randn(1, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, 333, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    lens = torch.tensor([300], dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(maskc.MaskcError, match="inside CUDA-graph capture"):
        with torch.cuda.graph(graph):
            maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.sliding_window(77), kv_lens=lens)


def test_reduce_overhead_prefill_with_a_new_mod_each_step():
    """maskc::attention names its mods by handles, CPU tensors the graph takes as inputs: under
    torch.compile(mode="reduce-overhead") a prefill given a new sliding window each step compiles
    one graph (the operator runs between the graph's parts, tagged cudagraph_unsafe) and gives
    each step's eager bits."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gen = torch.Generator("cuda").manual_seed(4)
    B, H, L, D = 1, 4, 1024, 64
    k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")

    def step(q, mod):
        return maskc.compiled_attention(q * 1.0, k, v, mask_mod=mod)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for window in (64, 200, 17, 500):
            mod = maskc.masks.sliding_window(window)
            q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            got = compiled(q, mod).clone()
            assert torch.equal(got, step(q, mod)), f"window {window}"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs compiled for 4 windows"
