"""compiled_attention under torch.compile(fullgraph=True): no graph break, the eager results and
gradients, and no recompile when the mods' captured values change (maskc/runtime/ops.py).

CPU tensors run the kernels through Triton's interpreter, so shapes stay tiny; the backends are
the eager-friendly ones ("aot_eager" runs AOTAutograd's forward and backward graphs).
"""
import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import maskc
from _inputs import randn
from maskc import masks, scores
from maskc.testing import assert_close_to_reference, attention_reference

L, DIM, HEADS = 48, 32, 2
DOC_IDS = torch.tensor([0] * 20 + [1] * 17 + [2] * 11)


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKC_CACHE_DIR", str(tmp_path_factory.mktemp("maskc_cache")))
        yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class SelfAttention(torch.nn.Module):
    """A projection to q, k, v (non-contiguous views, as models make them) and maskc."""

    def __init__(self, mask_mod=None, score_mod=None):
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.mask_mod, self.score_mod = mask_mod, score_mod

    def forward(self, x):
        B, n, _ = x.shape
        q, k, v = self.qkv(x).view(B, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        out = maskc.compiled_attention(q, k, v, mask_mod=self.mask_mod, score_mod=self.score_mod)
        return out.transpose(1, 2).reshape(B, n, DIM)


def _model(mask_mod=None, score_mod=None):
    torch.manual_seed(0)
    return SelfAttention(mask_mod, score_mod)


def _x(n=L):
    return randn(1, n, DIM, seed=1)


def _step(model, x):
    """The output, and the gradients of x and of the parameters, of one training step."""
    model.zero_grad()
    x = x.clone().requires_grad_()
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), [x.grad] + [p.grad.clone() for p in model.parameters()]


def _assert_same(got, expected):
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _no_graph_breaks():
    return sum(counters["graph_break"].values()) == 0


CASES = {
    "causal": lambda: (masks.causal, None),
    "document": lambda: (masks.document(DOC_IDS, causal=True), None),
    "score_mod": lambda: (masks.sliding_window(9), scores.softcap(5.0)),
}


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
@pytest.mark.parametrize("case", CASES)
def test_fullgraph_trains_like_eager(case, backend):
    model = _model(*CASES[case]())
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    _assert_steps_agree(compiled, model)
    assert counter.frame_count == 1 and _no_graph_breaks()


def _assert_steps_agree(compiled, model):
    """A training step of the compiled model gives eager maskc's loss and gradients."""
    out, grads = _step(compiled, _x())
    expected, expected_grads = _step(model, _x())
    _assert_same(out, expected)
    for got, want in zip(grads, expected_grads):
        _assert_same(got, want)


def test_explain_finds_one_graph_and_no_break():
    model = _model(masks.document(DOC_IDS), scores.softcap(5.0))
    explained = torch._dynamo.explain(model)(_x())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert "maskc.attention" in str(explained.graphs[0].graph)


def test_captured_values_change_without_recompile():
    ids, window, cap = DOC_IDS, 40, 5.0

    def doc_window(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    def capped(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    model = _model(maskc.mask_mod(doc_window), maskc.score_mod(capped))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    _step(compiled, _x())
    kernels = maskc.runtime.cache_info().misses
    for ids, window, cap in ((torch.tensor([0] * 8 + [1] * 40), 40, 5.0),  # another ids tensor
                             (torch.tensor([0] * 8 + [1] * 40), 6, 2.5)):  # another window and cap
        _assert_steps_agree(compiled, model)
    assert counter.frame_count == 1 and _no_graph_breaks()
    assert maskc.runtime.cache_info().misses == kernels, "a captured value changed the kernel"


def _window_closure(window):
    def within(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return maskc.mask_mod(within)


def _band(b, h, q_idx, kv_idx, lo, hi):
    return (q_idx - kv_idx >= lo) & (q_idx - kv_idx <= hi)


def _key_bias(bias):
    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    return maskc.score_mod(biased)


# (mask_mod, score_mod, block_map) of step 0, 1, 2: a new mod (or map) each step, of the same
# structure, with new captured numbers or tensors of the same shape
NEW_EACH_STEP = {
    "document ids": lambda i: (masks.document(torch.tensor([0] * (9 + 5 * i) + [1] * (L - 9 - 5 * i)), causal=True),
                               None, None),
    "sliding window": lambda i: (masks.sliding_window((8, 16, 3)[i]), None, None),
    "prefix LM": lambda i: (masks.prefix_lm((5, 12, 30)[i]), None, None),
    "user closure": lambda i: (_window_closure((8, 16, 3)[i]), None, None),
    "functools.partial": lambda i: (maskc.mask_mod(functools.partial(_band, lo=-i, hi=4 + 3 * i)), None, None),
    "score mod's tensor": lambda i: (masks.causal, _key_bias(randn(L, seed=10 + i)), None),
    "block map": lambda i: (None, None, maskc.block_map(masks.sliding_window((8, 16, 3)[i]), L, L, block_size=16)),
}


@pytest.mark.parametrize("case", NEW_EACH_STEP)
def test_new_mods_of_one_structure_compile_once(case):
    """A training step given a new mod (a factory's, a closure's, a partial's) or a new block map
    each step runs one compiled graph: the operator names mods and maps by handles, graph inputs
    guarded on shape alone, and reads their values when it runs."""
    counter = CompileCounterWithBackend("aot_eager")

    def step(q, k, v, mask_mod, score_mod, block_map):
        return maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, block_map=block_map)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for i in range(3):
        mods = NEW_EACH_STEP[case](i)
        leaves = [randn(1, HEADS, L, DIM // HEADS, seed=3 * i + s).requires_grad_() for s in range(3)]
        out = compiled(*leaves, *mods)
        d_out = randn(*out.shape, seed=20 + i)
        grads = torch.autograd.grad(out, leaves, d_out)
        eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        want = step(*eager_leaves, *mods)
        want_grads = torch.autograd.grad(want, eager_leaves, d_out)
        _assert_same(out, want)
        for got, expected in zip(grads, want_grads):
            _assert_same(got, expected)
    assert counter.frame_count == 1 and _no_graph_breaks()


def test_compiled_attention_takes_a_torch_block_mask_as_flex_attention_does():
    q, k, v = (randn(1, HEADS, L, 16, seed=s, dtype=torch.float64) for s in range(3))
    want, _ = attention_reference(q, k, v, masks.causal)
    ours = maskc.create_block_mask(masks.causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    theirs = torch.nn.attention.flex_attention.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None,
                                                                 None, L, L, device="cpu", BLOCK_SIZE=16)
    for block_mask in (ours, theirs):
        assert_close_to_reference(maskc.compiled_attention(q, k, v, block_map=block_mask), want, torch.float64)
    compiled = torch.compile(lambda q, k, v, bm: maskc.compiled_attention(q, k, v, block_map=bm), backend="aot_eager",
                             fullgraph=True)
    assert_close_to_reference(compiled(q, k, v, ours), want, torch.float64)


def test_a_new_length_recompiles_once():
    # the first new length makes the graph's lengths symbolic (Dynamo's automatic dynamic
    # shapes); later lengths reuse it. maskc plans each length when the operator runs.
    model = _model(masks.causal)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    frames = []
    with torch.no_grad():
        for n in (32, 48, 40):
            _assert_same(compiled(_x(n)), model(_x(n)))
            frames.append(counter.frame_count)
    assert frames == [1, 2, 2] and _no_graph_breaks()


def test_lse_gqa_and_shared_kv():
    # GQA, k and v of batch 1 shared by q's batch of 2, lse returned and used by the loss
    def attend(q, k, v):
        out, lse = maskc.compiled_attention(q, k, v, mask_mod=masks.causal, enable_gqa=True, return_lse=True)
        return out.square().sum() + lse.sum()

    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(shape, generator=g) for shape in ((2, 4, 40, 16), (1, 2, 40, 16), (1, 2, 40, 16))]
    grads = []
    for fn in (torch.compile(attend, backend="aot_eager", fullgraph=True), attend):
        leaves = [t.clone().requires_grad_() for t in inputs]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        _assert_same(got, want)
    assert _no_graph_breaks()


def test_another_mod_runs_the_same_graph():
    # the graph names its mods by handles, graph inputs: another mod runs the same graph, whose
    # operator reads it when it runs; a map where there was none is another input, a new graph
    def attend(q, mask_mod, block_map=None):
        return maskc.compiled_attention(q, q, q, mask_mod=mask_mod, block_map=block_map)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    q = torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(3))
    sliding = masks.sliding_window(4)
    bm = maskc.block_map(sliding, 32, 32, block_size=16)
    for mask_mod, block_map, frames in ((masks.causal, None, 1), (sliding, None, 1), (masks.causal, None, 1),
                                        (None, bm, 2)):
        _assert_same(compiled(q, mask_mod, block_map), attend(q, mask_mod, block_map))
        assert counter.frame_count == frames


def test_a_new_block_map_of_the_same_shape_runs_the_same_graph():
    # a map is a graph input (its handle tensor), not a constant: per-batch document maps
    # rebuilt for new ids run one graph, and each call reads its own map's tiles
    ids = DOC_IDS.clone()
    document = masks.document(ids, causal=True)

    def attend(q, block_map):
        return maskc.compiled_attention(q, q, q, block_map=block_map)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    q = torch.randn(1, 2, L, 16, generator=torch.Generator().manual_seed(3))
    for cuts in ((20, 37), (5, 44), (30, 31)):
        ids.copy_(torch.bucketize(torch.arange(L), torch.tensor(cuts), right=True))
        bm = maskc.block_map(document, L, L, block_size=16)
        _assert_same(compiled(q, bm), attend(q, bm))
        _assert_same(compiled(q, bm), attention_reference(q, q, q, mask_mod=document)[0].to(q.dtype))
    assert counter.frame_count == 1 and _no_graph_breaks()
    with pytest.raises(Exception, match="block_map was built for q_len=32"):
        compiled(q, maskc.block_map(document, 32, 32, block_size=16))


def test_no_pairs():
    q = torch.randn(1, 2, 0, 16, requires_grad=True)
    k = torch.randn(1, 2, 8, 16, requires_grad=True)
    compiled = torch.compile(lambda q, k: maskc.compiled_attention(q, k, k, mask_mod=masks.causal),
                             backend="aot_eager", fullgraph=True)
    out = compiled(q, k)
    assert out.shape == (1, 2, 0, 16)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))


def test_inputs_are_checked_at_compile_time():
    q, kv = torch.randn(1, 2, 16, 16), torch.randn(1, 1, 16, 16)
    compiled = torch.compile(lambda q, kv: maskc.compiled_attention(q, kv, kv), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="pass enable_gqa=True"):
        compiled(q, kv)


def test_operators_pass_opcheck():
    q, k, v = (torch.randn(1, 2, 24, 16, generator=torch.Generator().manual_seed(s), requires_grad=True)
               for s in range(3))
    softcap = scores.softcap(5.0)
    mods = (masks.causal.handle, softcap.handle, None)
    torch.library.opcheck(torch.ops.maskc.attention.default,
                          (q, k, v, *mods, None, False, [], [0, 0, 0, 0], True, None, 0))
    q, k, v = (t.detach() for t in (q, k, v))  # the backward has no backward of its own
    out, lse, token = torch.ops.maskc.attention(q, k, v, *mods, None, False, [], [0, 0, 0, 0], True, None, 0)
    torch.library.opcheck(torch.ops.maskc.attention_backward.default,
                          (q, k, v, out, lse, token, torch.randn_like(out), None, None, 0))


def test_the_backward_returns_gradients_in_the_layout_its_fake_kernel_promises():
    # A model's q, k and v are [B, L, H, D] transposed; the gradients come back in that layout,
    # as torch.empty_like says in the fake kernel, which Inductor's graph asserts (a 1B Llama's
    # compiled step failed there, dQ from the Gluon kernel; on CPU: k and v shared by a batch)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, 24, 2, 16, generator=g).transpose(1, 2) for batch in (2, 1, 1))
    mods = (masks.causal.handle, None, None)
    out, lse, token = torch.ops.maskc.attention(q, k, v, *mods, None, False, [], [0, 0, 0, 0], True, None, 0)
    args = (q, k, v, out, lse, token, torch.randn_like(out), None, None, 0)
    torch.library.opcheck(torch.ops.maskc.attention_backward.default, args)
    for grad, t in zip(torch.ops.maskc.attention_backward(*args), (q, k, v)):
        assert grad.stride() == t.stride()


def test_a_plain_function_under_compile_runs_outside_the_graph():
    """A plain function mod has no key for the operator to name it by: the call runs outside
    the graph, and fullgraph=True gets Dynamo's error with the fix. It raised a TypeError there,
    which Dynamo took for a graph break, then traced maskc's eager path and Triton's interpreter
    and crashed, and later valid calls of the same compiled function failed too (pytorch's
    test_multiple_score_mod_calls, transformers' compile_friendly_flex_attention)."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def shifted(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) / 8

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 16, generator=g)
    full = torch.compile(lambda q: maskc.compiled_attention(q, q, q, mask_mod=causal), backend="eager",
                         fullgraph=True)
    with pytest.raises(Exception, match=r"a plain function as mask_mod or score_mod runs outside the graph; "
                                        r"decorate it with @maskc.mask_mod"):
        full(q)
    attend = torch.compile(lambda q, mask, score: maskc.compiled_attention(q, q, q, mask_mod=mask, score_mod=score))
    flex = torch.compile(lambda q, score, block_mask: maskc.flex_attention(q, q, q, score_mod=score,
                                                                           block_mask=block_mask))
    block_mask = torch.nn.attention.flex_attention.create_block_mask(causal, None, None, 40, 40, device="cpu")
    for mask, score in ((causal, None), (None, shifted), (causal, shifted), (maskc.mask_mod(causal), None)):
        want, _ = attention_reference(q, q, q, mask_mod=mask, score_mod=score)
        assert_close_to_reference(attend(q, mask, score), want)
    want, _ = attention_reference(q, q, q, mask_mod=causal, score_mod=shifted)
    assert_close_to_reference(flex(q, shifted, block_mask), want)
    # torch's create_block_mask keeps the plain function: outside the graph too
    assert_close_to_reference(flex(q, maskc.score_mod(shifted), block_mask), want)
    full_flex = torch.compile(lambda q, block_mask: maskc.flex_attention(q, q, q, block_mask=block_mask),
                              backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="a plain function as mask_mod or score_mod runs outside the graph"):
        full_flex(q, block_mask)
    block_mask.mask_mod = maskc.mask_mod(causal)  # wrapped once: in the graph
    want, _ = attention_reference(q, q, q, mask_mod=causal)
    assert_close_to_reference(full_flex(q, block_mask), want)


# -- decoding ----------------------------------------------------------------------------------
def test_a_decoding_step_compiles_without_breaks_or_recompiles():
    """compiled_attention with kv_lens and paged_attention under fullgraph: one graph, new
    lengths and new cache contents run it again without recompiling, and outputs match eager."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = torch.randn(2, 2, 40, 16, generator=gen), torch.randn(2, 2, 40, 16, generator=gen)
    window = maskc.masks.sliding_window(9)
    cache = maskc.PagedKVCache(8, 16, 2, 16, dtype=torch.float32, max_seqs=3)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    cache.append(slots, k[:, :, :30], v[:, :, :30])

    def step(q, lens):
        contiguous = maskc.compiled_attention(q, k, v, mask_mod=window, enable_gqa=True, kv_lens=lens)
        paged = maskc.paged_attention(q, cache, slots, mask_mod=masks.causal, enable_gqa=True)
        return contiguous, paged

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for lens, extra in ((torch.tensor([40, 3], dtype=torch.int32), 0), (torch.tensor([7, 0], dtype=torch.int32), 5)):
        if extra:
            cache.append(slots, k[:, :, 30:30 + extra], v[:, :, 30:30 + extra])
        got, expected = compiled(q, lens), step(q, lens)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert counter.frame_count == 1 and _no_graph_breaks()


def test_decoding_operators_pass_opcheck():
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 2, 2, 16, generator=gen), torch.randn(1, 1, 20, 16, generator=gen), \
        torch.randn(1, 1, 20, 16, generator=gen)
    lens = torch.tensor([11], dtype=torch.int32)
    torch.library.opcheck(torch.ops.maskc.decode.default, (q, k, v, lens, masks.causal.key, "", None, None, True))
    cache = maskc.PagedKVCache(4, 16, 1, 16, dtype=torch.float32, max_seqs=2)
    slots = torch.tensor([1], dtype=torch.int32)
    cache.append(slots, k, v)
    torch.library.opcheck(torch.ops.maskc.paged_attention.default,
                          (q, cache.k_pages, cache.v_pages, cache.page_table, cache.lens, slots, 16, masks.causal.key,
                           "", None, True))


def test_a_captured_tensor_requiring_grad_runs_outside_the_graph_under_compile():
    """The operators have no autograd inputs for captured tensors, the eager autograd Function
    has: with gradients on, the call runs outside the graph and the slopes get their gradient;
    fullgraph=True gets Dynamo's error with the fix; under no_grad the call stays in the graph.
    It had been refused inside the graph, which Dynamo without fullgraph took for a graph break,
    tracing maskc's eager path and crashing in Triton's interpreter (a helper found it)."""
    slopes = torch.rand(HEADS, requires_grad=True)

    @maskc.score_mod
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def call(q):
        return maskc.compiled_attention(q, q, q, mask_mod=masks.causal, score_mod=alibi)

    def flex_call(q):
        return maskc.flex_attention(q, q, q, score_mod=alibi)

    q = torch.randn(1, HEADS, L, DIM, generator=torch.Generator().manual_seed(0))
    full = torch.compile(call, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="a captured tensor that requires grad gets its gradient from maskc's eager"):
        full(q)  # only the slopes want a gradient
    with torch.no_grad():
        assert full(q).shape == q.shape
    for fn in (call, flex_call):
        (want,) = torch.autograd.grad(fn(q).square().sum(), slopes)
        (got,) = torch.autograd.grad(torch.compile(fn, backend="aot_eager")(q).square().sum(), slopes)
        torch.testing.assert_close(got, want)


def test_flex_attention_with_new_block_masks_compiles_once():
    # FlexAttention's pattern with maskc's imports: a BlockMask per batch, made outside the
    # compiled code, whose tile tensors are graph inputs; gradients as eager
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    from maskc import create_block_mask, flex_attention

    ids = DOC_IDS.clone()

    def document_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    softcap = scores.softcap(5.0)

    def attend(q, k, v, block_mask):
        return flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask, enable_gqa=True)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    for cuts in ((20, 37), (5, 44), (30, 31)):
        ids.copy_(torch.bucketize(torch.arange(L), torch.tensor(cuts), right=True))
        block_mask = create_block_mask(document_causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)
        results = []
        for fn in (compiled, attend):
            leaves = [torch.randn(shape, generator=torch.Generator().manual_seed(i)).requires_grad_()
                      for i, shape in enumerate(((1, 4, L, 16), (1, 2, L, 16), (1, 2, L, 16)))]
            out = fn(*leaves, block_mask)
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(6))).sum().backward()
            results.append([out.detach()] + [t.grad for t in leaves])
        for got, want in zip(*results):
            _assert_same(got, want)
        ref, _ = attention_reference(*(t.detach() for t in leaves), mask_mod=document_causal, score_mod=softcap,
                                     enable_gqa=True)
        torch.testing.assert_close(results[0][0].double(), ref, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1 and _no_graph_breaks()
    theirs = torch_create_block_mask(document_causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    # torch's BlockMask keeps the plain function: outside the graph, which fullgraph refuses
    with pytest.raises(Exception, match=r"a plain function as mask_mod or score_mod runs outside the graph"):
        compiled(*leaves, theirs)


@pytest.mark.parametrize("lens", [None, torch.tensor([40, 17], dtype=torch.int32)], ids=["no kv_lens", "kv_lens"])
def test_a_short_query_runs_the_same_kernel_eagerly_and_compiled(lens, monkeypatch):
    """A no-grad query of few rows takes the split-KV decoding kernel eagerly (decode.wanted);
    compiled it must take the same one: one call, one kernel choice, bitwise the same answer.
    (On the interpreter the prefill kernel happens to agree bitwise at these sizes, so the test
    also records which kernel ran.)"""
    from maskc.inference import decode
    ran = []
    run = decode.run  # the decoding kernel's launches, whichever operator plans them
    monkeypatch.setattr(decode, "run", lambda *args, **kwargs: ran.append("decode") or run(*args, **kwargs))
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = torch.randn(2, 2, 40, 16, generator=gen), torch.randn(2, 2, 40, 16, generator=gen)

    def step(q):
        # without kv_lens the one query sits at position 0, where causal keeps a single key
        mask = masks.causal if lens is not None else None
        return maskc.compiled_attention(q, k, v, mask_mod=mask, enable_gqa=True, kv_lens=lens, return_lse=True)

    with torch.no_grad():
        eager = step(q)
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(q)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert ran == ["decode", "decode"] and _no_graph_breaks()


def test_a_mod_built_on_the_meta_device_is_named_from_the_cpu():
    # torchtitan builds models under torch.device("meta"): a handle made there would send the
    # operator to its fake kernel (uninitialised outputs)
    with torch.device("meta"):
        mod = masks.sliding_window(5)
    assert mod.handle.device.type == "cpu"
    q = randn(1, HEADS, L, 16, seed=4)
    compiled = torch.compile(lambda q: maskc.compiled_attention(q, q, q, mask_mod=mod), backend="aot_eager",
                             fullgraph=True)
    _assert_same(compiled(q), maskc.compiled_attention(q, q, q, mask_mod=mod))


def test_a_block_mask_with_a_plain_mask_mod_runs_outside_the_graph_and_another_mask_mod_is_refused():
    q = randn(1, HEADS, L, 16, seed=5, dtype=torch.float64)
    theirs = torch.nn.attention.flex_attention.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None,
                                                                 None, L, L, device="cpu", BLOCK_SIZE=16)
    compiled = torch.compile(lambda q, bm: maskc.compiled_attention(q, q, q, block_map=bm), backend="aot_eager")
    assert_close_to_reference(compiled(q, theirs), attention_reference(q, q, q, masks.causal)[0], torch.float64)
    with pytest.raises(ValueError, match="a BlockMask carries its own mask_mod"):
        maskc.compiled_attention(q, q, q, mask_mod=masks.sliding_window(4), block_map=theirs)


def test_a_new_mod_structure_each_step_warns_once(monkeypatch):
    # a step that writes its mask anew each time (a new expression, not new values) pays a trace
    # and a kernel per structure: the operator says so once, naming the mod and the fix
    monkeypatch.setattr(maskc.runtime.ops, "_STRUCTURES", set())
    monkeypatch.setattr(maskc.runtime.ops, "_STRUCTURES_WARNED", 3)
    q = randn(1, HEADS, L, 16, seed=6)
    compiled = torch.compile(lambda q, mod: maskc.compiled_attention(q, q, q, mask_mod=mod), backend="aot_eager",
                             fullgraph=True)
    shapes = [lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, lambda b, h, q_idx, kv_idx: q_idx <= kv_idx,
              lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 3 == 0, lambda b, h, q_idx, kv_idx: q_idx != kv_idx]
    with pytest.warns(UserWarning, match=r"mods of 3 different structures, the latest mask_mod .*build the mod once "
                                         r"outside the step") as warned:
        for fn in shapes:
            compiled(q, maskc.mask_mod(fn))
    assert len([w for w in warned if "different structures" in str(w.message)]) == 1


def test_twenty_steps_of_new_documents_windows_and_maps_compile_one_frame_each():
    """#46's count: a compiled training step given new document ids, a new window or a new block
    map on each of 20 steps compiles once per kind, and every fifth step matches eager."""
    def step(q, k, v, mask_mod, block_map):
        return maskc.compiled_attention(q, k, v, mask_mod=mask_mod, block_map=block_map)

    gen = torch.Generator().manual_seed(7)
    kinds = {
        "documents": lambda i: (masks.document(torch.sort(torch.randint(0, 4, (L,), generator=gen)).values,
                                               causal=True), None),
        "windows": lambda i: (masks.sliding_window(1 + i), None),
        "maps": lambda i: (None, maskc.block_map(masks.sliding_window(2 + 2 * i), L, L, block_size=16)),
    }
    for kind, made in kinds.items():
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        for i in range(20):
            mods = made(i)
            leaves = [randn(1, HEADS, L, DIM // HEADS, seed=100 + 3 * i + s).requires_grad_() for s in range(3)]
            out = compiled(*leaves, *mods)
            out.sum().backward()
            if i % 5 == 4:
                _assert_same(out, step(*(t.detach() for t in leaves), *mods))
        assert counter.frame_count == 1, f"{kind}: {counter.frame_count} frames in 20 steps"
