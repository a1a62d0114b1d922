"""Attention dropout (`dropout_p=`, `generator=`): the Philox rule against Random123's known
answers, the kernels' keep-mask read back exactly, out, lse and the gradients of q, k, v and of
captured tensors against the float64 reference that drops the same pairs
(maskc.testing.dropout_keep), reproducibility by seed, sinks, torch.compile, and the checks.

Every comparison builds the reference from dropout_keep with the generator re-seeded to the
state the call drew from, so a kernel that drops other pairs, or none, fails it. Shapes stay
small (Triton's interpreter); lengths are not tile multiples.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import maskc
from _inputs import qkv, randn
from maskc.testing import (assert_close_to_reference, assert_gradient_close_to_reference, attention_reference,
                           dropout_keep, dropout_scale)
from maskc.testing.dropout import philox4x32_10
from maskc.testing.strategies import masks, score_mods

# Random123's kat_vectors for philox4x32 with 10 rounds: counter[4], key[2] -> output[4]
RANDOM123_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _keep(q, k, p, seed):
    """The keep-mask of a call whose generator was seeded with `seed`."""
    return dropout_keep(q.shape[0], q.shape[1], q.shape[2], k.shape[2], p,
                        generator=torch.Generator().manual_seed(seed))


def _exact(*tensors):
    return tuple(t.detach().double().requires_grad_() for t in tensors)


def _lse_close(got, want, dtype):
    # rows with no kept key have lse -inf in both; the rest compared as any output
    empty = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), empty), "lse is -inf on other rows than the reference's"
    if (~empty).any():
        assert_close_to_reference(got[~empty], want[~empty], dtype, what="lse")


@pytest.mark.parametrize("counter, key, expected", RANDOM123_KAT)
def test_philox_matches_random123_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32_10(counter, key)) == expected


def test_dropout_keep_follows_the_documented_rule():
    # maskc/runtime/dropout.py: Philox4x32-10 of the counter (kv_idx // 8, q_idx, b*Hq + h, 0)
    # under the key (seed's low word, high word); key kv_idx reads output word (kv_idx % 8) // 2,
    # its low 16 bits where kv_idx is even, and is kept iff they reach floor(p * 2**16)
    seed, p, B, H, Lq, Lkv = 0x1234_5678_9ABC_DEF, 0.3, 2, 3, 5, 19
    keep = dropout_keep(B, H, Lq, Lkv, p, seed=seed)
    threshold = int(p * 2 ** 16)
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                for j in range(Lkv):
                    words = philox4x32_10((j // 8, i, b * H + h, 0), (seed & 0xFFFFFFFF, seed >> 32))
                    bits = (int(words[(j % 8) // 2]) >> (16 * (j % 2))) & 0xFFFF
                    assert bool(keep[b, h, i, j]) == (bits >= threshold), (b, h, i, j)


# -- out, lse and gradients against the reference ---------------------------------------------
SHAPES = ({"B": 1, "Hq": 4, "Hkv": 2, "Lq": 37, "Lkv": 70}, {"B": 2, "Hq": 2, "Hkv": 2, "Lq": 70, "Lkv": 37},
          {"B": 2, "Hq": 4, "Hkv": 2, "Lq": 45, "Lkv": 45})


@st.composite
def dropout_cases(draw):
    shape = draw(st.sampled_from(SHAPES))
    B, Hq, Lq, Lkv = shape["B"], shape["Hq"], shape["Lq"], shape["Lkv"]
    mask = draw(st.none() | masks(Lq, Lkv, B=B, H=Hq))
    score = draw(score_mods(Lq, Lkv, H=Hq))
    p = draw(st.sampled_from((0.1, 0.5, 0.8)))
    return shape, mask, score, p, draw(st.integers(0, 2 ** 31))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=5, deadline=None)
@given(case=dropout_cases())
def test_drawn_masks_and_score_mods_match_the_dropout_reference(dtype, case):
    shape, mask, score, p, seed = case
    q, k, v, d_out = qkv(**shape, D=16, dtype=dtype, seed=seed % 1000, requires_grad=True, grad_out=True)
    gqa = shape["Hq"] != shape["Hkv"]
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=gqa, return_lse=True,
                                        dropout_p=p, generator=torch.Generator().manual_seed(seed))
    keep = _keep(q, k, p, seed)
    exact = _exact(q, k, v)
    ref_out, ref_lse = attention_reference(*exact, mask, score, enable_gqa=gqa, dropout_keep=keep, dropout_p=p)
    assert_close_to_reference(out, ref_out, dtype)
    _lse_close(lse, ref_lse, dtype)
    # the lse's gradient too (delta -= d_lse in the backward), zero on rows with no kept key
    d_lse = randn(*lse.shape, seed=seed % 1000 + 1, dtype=lse.dtype).masked_fill(torch.isneginf(ref_lse), 0.0)
    got = torch.autograd.grad((out, lse), (q, k, v), (d_out, d_lse))
    want = torch.autograd.grad((ref_out, ref_lse), exact, (d_out.double(), d_lse.double()))
    for name, a, b in zip("qkv", got, want):
        assert_gradient_close_to_reference(a, b, dtype, what=f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ragged_gqa_with_a_score_mod_matches_the_dropout_reference(dtype):
    # the design's example, with a score mod and the lse's gradient: Lq != Lkv, neither a
    # multiple of 16, two query heads per kv head
    @maskc.score_mod
    def distance(score, b, h, q_idx, kv_idx):
        return score - 0.05 * torch.abs(q_idx - kv_idx)

    q, k, v, d_out = qkv(B=2, Hq=4, Hkv=2, Lq=37, Lkv=70, D=16, dtype=dtype, requires_grad=True, grad_out=True)
    g = torch.Generator().manual_seed(3)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=distance, enable_gqa=True,
                                        return_lse=True, dropout_p=0.3, generator=g)
    g.manual_seed(3)
    keep = dropout_keep(2, 4, 37, 70, 0.3, generator=g)
    assert 0 < keep.sum() < keep.numel()
    exact = _exact(q, k, v)
    ref_out, ref_lse = attention_reference(*exact, maskc.masks.causal, distance, enable_gqa=True, dropout_keep=keep,
                                           dropout_p=0.3)
    plain_out, _ = attention_reference(*exact, maskc.masks.causal, distance, enable_gqa=True)
    assert (ref_out - plain_out).abs().max() > 0.1  # dropping changes the output: the comparison can fail
    assert_close_to_reference(out, ref_out, dtype)
    assert_close_to_reference(lse, ref_lse, dtype, what="lse")
    d_lse = randn(*lse.shape, seed=4, dtype=lse.dtype)
    got = torch.autograd.grad((out, lse), (q, k, v), (d_out, d_lse))
    want = torch.autograd.grad((ref_out, ref_lse), exact, (d_out.double(), d_lse.double()))
    for name, a, b in zip("qkv", got, want):
        assert_close_to_reference(a, b, dtype, what=f"d{name}")


# -- captured tensors' gradients --------------------------------------------------------------
def _learnable(kind: str, H: int, Lq: int, Lkv: int):
    """(tensors, score_mod(tensors)), as tests/test_captured_grads.py writes them: the same code
    builds maskc's mod and the float64 reference's."""
    gen = torch.Generator().manual_seed(5)
    if kind == "alibi":
        return (torch.rand(H, generator=gen),), lambda t: lambda score, b, h, q_idx, kv_idx: (
            score + t[0][h] * (kv_idx - q_idx))
    if kind == "relative_per_head":
        return (torch.randn(H, Lq + Lkv - 1, generator=gen),), lambda t: lambda score, b, h, q_idx, kv_idx: (
            score + t[0][h, q_idx - kv_idx + Lkv - 1])
    return (torch.randn(Lq, generator=gen), torch.randn(Lkv, generator=gen)), (
        lambda t: lambda score, b, h, q_idx, kv_idx: score * 0.5 + t[0][q_idx] + t[1][kv_idx])


@pytest.mark.parametrize("kind, dtype", [("alibi", torch.float64), ("relative_per_head", torch.float64),
                                         ("row_and_column", torch.float64), ("relative_per_head", torch.float32)])
def test_captured_gradients_with_dropout_match_float64_autograd(kind, dtype):
    B, Hq, Hkv, Lq, Lkv, p = 1, 4, 2, 37, 53, 0.4
    tensors, mod = _learnable(kind, Hq, Lq, Lkv)
    tensors = tuple(t.to(dtype).requires_grad_() for t in tensors)
    q, k, v, d_out = qkv(B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lkv=Lkv, D=16, dtype=dtype, seed=2, requires_grad=True,
                         grad_out=True)
    out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.sliding_window(20),
                                   score_mod=maskc.score_mod(mod(tensors)), enable_gqa=True, dropout_p=p,
                                   generator=torch.Generator().manual_seed(8))
    got = torch.autograd.grad(out, (q, k, v, *tensors), d_out)
    exact = _exact(q, k, v, *tensors)
    keep = _keep(q, k, p, 8)
    ref, _ = attention_reference(*exact[:3], maskc.masks.sliding_window(20), mod(exact[3:]), enable_gqa=True,
                                 dropout_keep=keep, dropout_p=p)
    want = torch.autograd.grad(ref, exact, d_out.double())
    assert_close_to_reference(out, ref, dtype)
    for name, a, b in zip("qkv", got[:3], want[:3]):
        assert_close_to_reference(a, b, dtype, what=f"d{name}")
    # the dQ kernel sums captured gradients as integers in units of 2**-32: float64 holds them to
    # that, not to float64's epsilon
    atol, rtol = (1e-7, 1e-7) if dtype == torch.float64 else (1e-4, 1e-4)
    for i, (a, b) in enumerate(zip(got[3:], want[3:])):
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=rtol, msg=lambda m, i=i: f"captured #{i}: {m}")


def test_gradcheck_in_float64_with_the_generator_reseeded_each_call():
    # re-seeding inside the function makes every evaluation drop the same pairs, so dropout is a
    # fixed linear map of the probabilities and finite differences see the kernels' gradient
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
               for shape in ((1, 2, 5, 16), (1, 2, 7, 16), (1, 2, 7, 16)))
    slopes = torch.rand(2, generator=gen, dtype=torch.float64, requires_grad=True)
    dropping = torch.Generator()

    def attend(q, k, v, slopes):
        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        dropping.manual_seed(11)
        return maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=maskc.score_mod(alibi),
                                        dropout_p=0.4, generator=dropping)

    keep = _keep(q, k, 0.4, 11)
    assert 0 < keep[..., torch.ones(5, 7).tril().bool()].sum() < 2 * 5 * 7  # some kept pairs dropped
    assert torch.autograd.gradcheck(attend, (q, k, v, slopes), atol=1e-6, rtol=1e-5, fast_mode=True)


# -- the keep-mask itself ---------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.2, 0.5])
def test_the_kernel_drops_exactly_dropout_keep_and_about_p_of_the_pairs(p):
    # q = 0 and no mask: every probability is 1/Lkv. Key j's value is 2**(j // 16) in column
    # j % 16, so out * Lkv / scale is an integer per column whose bit c says whether key
    # 16c + (column) survived: one call reads the kernel's keep-mask over 70 keys (several
    # kernel tiles, the last group of 8 keys ragged), and a wrong survivor scale leaves fractions
    B, H, Lq, Lkv, D = 2, 4, 77, 70, 16
    j = torch.arange(Lkv)
    v = torch.zeros(Lkv, D, dtype=torch.float64)
    v[j, j % D] = 2.0 ** (j // D).double()
    q = torch.zeros(B, H, Lq, D, dtype=torch.float64)
    k = randn(B, H, Lkv, D, seed=1, dtype=torch.float64)
    out = maskc.compiled_attention(q, k, v.expand(B, H, Lkv, D), dropout_p=p,
                                   generator=torch.Generator().manual_seed(21))
    counts = out * Lkv / dropout_scale(p)
    torch.testing.assert_close(counts, counts.round(), atol=1e-9, rtol=0)
    kernel_keep = ((counts.round().long()[..., j % D] >> (j // D)) & 1).bool()
    assert torch.equal(kernel_keep, _keep(q, k, p, 21))
    assert not torch.equal(kernel_keep[0, 0], kernel_keep[0, 1]) and not torch.equal(kernel_keep[0], kernel_keep[1])
    # the dropped fraction within 5 standard deviations of p, in the kernel's mask and in a
    # larger one of dropout_keep's (B=1, H=2, 64 x 64)
    larger = dropout_keep(1, 2, 64, 64, p, generator=torch.Generator().manual_seed(22))
    for keep in (kernel_keep, larger):
        n = keep.numel()
        dropped = n - int(keep.sum())
        assert abs(dropped - n * p) <= 5 * (n * p * (1 - p)) ** 0.5, f"{dropped} of {n} dropped at p={p}"


# -- reproducibility --------------------------------------------------------------------------
def _run(q, k, v, d_out, **kw):
    out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), d_out))


def test_the_same_seed_reproduces_a_call_bit_for_bit_and_another_seed_differs():
    q, k, v, d_out = qkv(Hq=2, Lq=37, Lkv=45, D=16, requires_grad=True, grad_out=True)
    g = torch.Generator()
    first = _run(q, k, v, d_out, dropout_p=0.3, generator=g.manual_seed(1))
    again = _run(q, k, v, d_out, dropout_p=0.3, generator=g.manual_seed(1))
    following = _run(q, k, v, d_out, dropout_p=0.3, generator=g)  # the generator moved on
    other = _run(q, k, v, d_out, dropout_p=0.3, generator=g.manual_seed(2))
    for name, a, b, c, d in zip(("out", "dq", "dk", "dv"), first, again, following, other):
        assert torch.equal(a, b), name
        assert not torch.equal(a, c), name
        assert not torch.equal(a, d), name


def test_dropout_p_zero_is_the_call_without_dropout_and_draws_nothing():
    q, k, v, d_out = qkv(Hq=2, Lq=37, D=16, requires_grad=True, grad_out=True)
    g = torch.Generator().manual_seed(4)
    state = g.get_state()
    plain = _run(q, k, v, d_out)
    zero = _run(q, k, v, d_out, dropout_p=0.0, generator=g)
    assert torch.equal(g.get_state(), state)
    for name, a, b in zip(("out", "dq", "dk", "dv"), plain, zero):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("Lq", [1, 3])
def test_a_call_without_gradients_and_few_query_rows_still_drops(Lq):
    # without gradients these rows would take the decoding kernel, which has no dropout
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Lq=Lq, Lkv=40, D=16)
    with torch.no_grad():
        out = maskc.compiled_attention(q, k, v, enable_gqa=True, dropout_p=0.5,
                                       generator=torch.Generator().manual_seed(6))
    keep = _keep(q, k, 0.5, 6)
    ref, _ = attention_reference(q, k, v, enable_gqa=True, dropout_keep=keep, dropout_p=0.5)
    plain, _ = attention_reference(q, k, v, enable_gqa=True)
    assert_close_to_reference(out, ref, torch.float32)
    assert (out.double() - plain).abs().max() > 0.1


def test_dropout_with_sinks_matches_the_reference():
    # the sink joins the softmax's denominator and is never dropped: it has no value
    q, k, v, d_out = qkv(B=2, Hq=4, Hkv=2, Lq=37, Lkv=70, D=16, requires_grad=True, grad_out=True)
    sinks = randn(4, seed=7).mul(2.0).requires_grad_()
    d_lse = randn(2, 4, 37, seed=3)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, enable_gqa=True, return_lse=True,
                                        sinks=sinks, dropout_p=0.3, generator=torch.Generator().manual_seed(9))
    keep = _keep(q, k, 0.3, 9)
    exact = _exact(q, k, v, sinks)
    ref_out, ref_lse = attention_reference(*exact[:3], maskc.masks.causal, enable_gqa=True, sinks=exact[3],
                                           dropout_keep=keep, dropout_p=0.3)
    no_sink, _ = attention_reference(*exact[:3], maskc.masks.causal, enable_gqa=True, dropout_keep=keep,
                                     dropout_p=0.3)
    assert (ref_out - no_sink).abs().max() > 0.05
    assert_close_to_reference(out, ref_out, torch.float32)
    assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
    got = torch.autograd.grad((out, lse), (q, k, v, sinks), (d_out, d_lse))
    want = torch.autograd.grad((ref_out, ref_lse), exact, (d_out.double(), d_lse.double()))
    for name, a, b in zip(("q", "k", "v", "sinks"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-3, msg=lambda m, name=name: f"d{name}: {m}")


# -- torch.compile ----------------------------------------------------------------------------
def test_torch_compile_draws_the_seed_the_eager_call_draws():
    # without generator= the seed is drawn in the graph by torch.randint from torch's default
    # generator, as the eager call draws it: torch.manual_seed before each call reproduces both
    q, k, v, d_out = qkv(B=1, Hq=4, Hkv=2, Lq=37, Lkv=45, D=16, requires_grad=True, grad_out=True)

    def attend(q, k, v):
        return maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, enable_gqa=True, dropout_p=0.3)

    def seeded(fn, seed):
        torch.manual_seed(seed)
        out = fn(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), d_out))

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    eager = seeded(attend, 12)
    first, second, other = seeded(compiled, 12), seeded(compiled, 12), seeded(compiled, 13)
    torch.manual_seed(12)
    keep = dropout_keep(1, 4, 37, 45, 0.3)
    ref, _ = attention_reference(q, k, v, maskc.masks.causal, enable_gqa=True, dropout_keep=keep, dropout_p=0.3)
    assert_close_to_reference(first[0], ref, torch.float32)
    for name, e, a, b, c in zip(("out", "dq", "dk", "dv"), eager, first, second, other):
        assert torch.isfinite(a).all() and a.abs().max() > 0, name
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        assert torch.equal(a, b), name
        assert not torch.equal(a, c), name


# -- checks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dropout_p", [-0.1, 1.0, True, "0.1"], ids=["negative", "one", "bool", "str"])
def test_dropout_p_outside_zero_to_one_is_refused(dropout_p):
    q, k, v = qkv(Lq=8, D=16)
    with pytest.raises(ValueError, match=r"dropout_p is the probability .* a float in \[0, 1\), got"):
        maskc.compiled_attention(q, k, v, dropout_p=dropout_p)


@pytest.mark.parametrize("generator", [3, torch.Generator().get_state()], ids=["int", "state_tensor"])
def test_a_generator_that_is_not_a_torch_generator_is_refused(generator):
    q, k, v = qkv(Lq=8, D=16)
    with pytest.raises(TypeError, match="generator must be a torch.Generator, got"):
        maskc.compiled_attention(q, k, v, dropout_p=0.1, generator=generator)


def test_dropout_with_kv_lens_is_refused_and_zero_decodes():
    q, k, v = qkv(Lq=1, Lkv=16, D=16)
    kv_lens = torch.tensor([9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"calls with kv_lens decode.*pass dropout_p=0\.0 when decoding"):
        maskc.compiled_attention(q, k, v, kv_lens=kv_lens, dropout_p=0.1)
    out = maskc.compiled_attention(q, k, v, kv_lens=kv_lens, dropout_p=0.0)  # the fix the message gives
    assert torch.equal(out, maskc.compiled_attention(q, k, v, kv_lens=kv_lens))


def test_activation_checkpointing_recomputes_the_same_seed():
    # non-reentrant checkpointing runs the forward again in the backward; torch's default
    # generator is restored for it, so the recomputed seed, out and lse are the call's
    q, k, v = (randn(1, 2, 40, 16, seed=s, dtype=torch.float64).requires_grad_() for s in range(3))
    d_out = randn(1, 2, 40, 16, seed=9, dtype=torch.float64)

    def attend(q, k, v):
        return maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, dropout_p=0.3)

    grads = []
    for run in (attend, lambda *t: torch.utils.checkpoint.checkpoint(attend, *t, use_reentrant=False)):
        torch.manual_seed(4)
        out = run(q, k, v)
        grads.append(torch.autograd.grad(out, (q, k, v), d_out))
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, atol=1e-12, rtol=1e-12)


def test_a_tensor_dropout_p_is_refused():
    q = randn(1, 1, 16, 16)
    with pytest.raises(ValueError, match=r"dropout_p is the probability .* got tensor"):
        maskc.compiled_attention(q, q, q, dropout_p=torch.tensor(0.1))


def test_a_generator_with_dropout_p_zero_stays_in_the_graph():
    # `dropout_p=p if training else 0.0, generator=g`: in eval mode nothing is drawn, nothing breaks
    q = randn(1, 1, 16, 16)
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(lambda q: maskc.compiled_attention(q, q, q, mask_mod=maskc.masks.causal, dropout_p=0.0,
                                                                generator=g), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q), maskc.compiled_attention(q, q, q, mask_mod=maskc.masks.causal))
