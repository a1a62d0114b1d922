"""Gradients of compiled_attention against float64 autograd of the reference, on CPU
through Triton's interpreter, plus gradcheck on tiny float64 problems."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import maskc
from _inputs import qkv, randn
from maskc import masks, scores
from maskc.runtime import launch
from maskc.runtime.tiles import use_config
from maskc.testing import assert_close_to_reference, attention_reference
from maskc.testing.strategies import AttentionInputs, attention_inputs


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MASKC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernels"))


def _grads(inputs, fn, d_out):
    leaves = [t.detach().clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, d_out.to(out.dtype))
    return out, grads


def _check(inputs, d_out):
    kwargs = inputs.kwargs()
    d_out = d_out.to(inputs.dtype)  # what the kernel is given, so the reference's too
    out, grads = _grads(inputs, lambda q, k, v: maskc.compiled_attention(q, k, v, **kwargs), d_out)
    leaves = [t.detach().double().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    ref, lse = attention_reference(*leaves, **kwargs)
    # The backward forms Delta = rowsum(dO * out) from the output it is given, stored in the
    # input dtype, as FlashAttention and FlexAttention do; an error e in a row's Delta moves
    # each of its score gradients by -P * e, the gradient of -e * lse. Where the softmax is
    # nearly one-hot, dq and dk are small by cancellation in dS = P (dP - Delta) and that term
    # can be most of them (fp16: 0.3-0.8 of |dq|), so the reference carries it exactly.
    delta_error = (d_out.double() * (out.detach().double() - ref.detach())).sum(-1)
    ref_grads = torch.autograd.grad((ref, lse), leaves, (d_out.double(), -delta_error))
    assert_close_to_reference(out.detach(), ref.detach(), inputs.dtype, "output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        if want.norm() == 0:  # e.g. one key: the softmax is constant, dq is 0 up to rounding
            assert got.abs().max() < 1e-4, f"{name} should be zero, got max {got.abs().max()}"
            continue
        assert_close_to_reference(got, want, inputs.dtype, name)
    return grads


@settings(max_examples=15)
@given(inputs=attention_inputs(max_len=64, dtypes=(torch.float32,)), seed=st.integers(0, 2**31))
def test_gradients_match_reference(inputs, seed):
    gen = torch.Generator().manual_seed(seed)
    d_out = torch.randn(*inputs.q.shape[:3], inputs.v.shape[-1], generator=gen)
    _check(inputs, d_out)


@settings(max_examples=5)
@given(inputs=attention_inputs(max_len=48, dtypes=(torch.bfloat16, torch.float16), head_dims=(16, 32)))
def test_gradients_half_precision(inputs):
    _check(inputs, torch.randn(*inputs.q.shape[:3], inputs.v.shape[-1]))


@maskc.mask_mod
def _keys_21_apart(b, h, q_idx, kv_idx):
    return (q_idx * kv_idx + 1) % 21 == 0


def test_half_precision_gradients_of_a_nearly_one_hot_softmax():
    """Rows keep 0, 2 or 3 keys 21 apart, and ALiBi slopes near 1 make each softmax one-hot
    to within e**-10: dq and dk are small by cancellation, and the fp16 rounding of the stored
    output in Delta is most of them (0.3-0.5 of |dq|), which the reference of _check carries."""
    q, k, v, d_out = qkv(Hq=2, Lq=43, Lkv=48, D=16, dtype=torch.float16, grad_out=True)
    alibi = scores.alibi(torch.tensor([0.86, 0.51]))
    _check(AttentionInputs(q, k, v, _keys_21_apart, alibi, None, False), d_out.float())


TINY = [
    (masks.causal, None),
    (masks.sliding_window(3), scores.softcap(2.0)),
    (masks.prefix_lm(4), scores.alibi(scores.alibi_slopes(2))),
    (masks.document(torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3]), causal=True),
     scores.relative_bias(torch.randn(2, 21, dtype=torch.float64), offset=10)),
]


@pytest.mark.parametrize("mask_mod,score_mod", TINY, ids=lambda m: getattr(m, "__name__", "none"))
def test_gradcheck_float64(mask_mod, score_mod):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 11, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 11, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 11, 16, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v):
        return maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, enable_gqa=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_fully_masked_rows_have_zero_gradients():
    # rows q_idx < 3 keep nothing: their outputs are 0 and every gradient through them is 0
    mask = maskc.mask_mod(lambda b, h, q_idx, kv_idx: (q_idx >= 3) & (kv_idx <= q_idx))
    q, k, v = (torch.randn(1, 1, 40, 32, requires_grad=True) for _ in range(3))
    out = maskc.compiled_attention(q, k, v, mask_mod=mask)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for g in (dq, dk, dv):
        assert not torch.isnan(g).any()
    assert torch.count_nonzero(dq[:, :, :3]) == 0
    assert torch.count_nonzero(out[:, :, :3]) == 0


def test_gqa_gradients_sum_over_the_group():
    q = torch.randn(1, 4, 33, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 29, 16, requires_grad=True) for _ in range(2))
    out = maskc.compiled_attention(q, k, v, mask_mod=masks.causal, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref = attention_reference(*(t.double() for t in (q, k, v)), masks.causal, enable_gqa=True)[0]
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    for got, want in zip(grads, ref_grads):
        assert_close_to_reference(got, want, torch.float32)


def test_relative_bias_table_requiring_grad_gets_its_gradient():
    """maskc.scores.relative_bias over a learnable table (tests/test_captured_grads.py has the rest)."""
    table = torch.randn(64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    q, k, v = (torch.randn(1, 1, 16, 16, generator=torch.Generator().manual_seed(s)) for s in range(3))
    out = maskc.compiled_attention(q, k, v, score_mod=scores.relative_bias(table, offset=31))
    (got,) = torch.autograd.grad(out.sum(), table)
    exact = table.detach().double().requires_grad_()
    ref, _ = attention_reference(q.double(), k.double(), v.double(), score_mod=scores.relative_bias(exact, offset=31))
    (want,) = torch.autograd.grad(ref.sum(), exact)
    assert_close_to_reference(got, want, torch.float32, "d table")


@pytest.fixture
def descriptor_calls(monkeypatch):
    """Per request for descriptors by the backward, whether it got them (True) or pointers (False)."""
    calls = []
    real = launch.descriptors

    def spy(operands):
        made = real(operands)
        if len(operands) == 5:  # the dQ launch's q, k, v, dO and dQ (the forward asks for four)
            calls.append(made is not None)
        return made

    monkeypatch.setattr(launch, "descriptors", spy)
    return calls


# Lengths that are not multiples of the CPU tiles (32), GQA groups, head dims padded to the
# next power of two (48 -> 64, 24 -> 32): loads past L and D must read zeros and such rows
# must not reach dq on either path.
BOTH_PATHS = [
    (1, 4, 2, 45, 37, 48, 24, masks.causal, None),
    (2, 3, 1, 29, 70, 48, 48, masks.sliding_window(9), scores.softcap(5.0)),
    (1, 2, 2, 40, 33, 32, 24, None, None),
]


@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lkv,D,Dv,mask_mod,score_mod", BOTH_PATHS)
def test_gradients_on_both_load_paths(B, Hq, Hkv, Lq, Lkv, D, Dv, mask_mod, score_mod, descriptor_calls):
    inputs = AttentionInputs(randn(B, Hq, Lq, D, seed=1), randn(B, Hkv, Lkv, D, seed=2),
                             randn(B, Hkv, Lkv, Dv, seed=3), mask_mod, score_mod, None, enable_gqa=Hq != Hkv)
    # strided along L: the backward copies it, then the copy can have a descriptor
    d_out = randn(B, Lq, Hq, Dv, seed=4).transpose(1, 2)
    grads = {}
    for tma in (True, False):
        descriptor_calls.clear()
        with use_config(descriptors=tma):
            grads[tma] = _check(inputs, d_out)
        # the dQ kernel on the path asked for (dK/dV always takes pointers)
        assert descriptor_calls == ([True] if tma else [])
    # the same values loaded, multiplied and summed: the paths agree far below the reference's tolerance
    for name, with_tma, without in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        torch.testing.assert_close(with_tma, without, atol=1e-5, rtol=1e-5, msg=f"{name} differs between paths")


def _unaligned(*shape, seed):
    # contiguous, but starting 4 bytes past a 16-byte boundary: the copy engine refuses it
    flat = randn(1 + torch.Size(shape).numel(), seed=seed)
    return flat[1:].view(shape)


@pytest.mark.parametrize("case", ["unaligned d_out", "q strided along D", "odd row bytes"])
def test_gradients_where_a_tensor_cannot_have_a_descriptor(case, descriptor_calls):
    B, Hq, Hkv, Lq, Lkv, D, Dv = 1, 2, 1, 37, 45, 32, 32
    q, k, v = randn(B, Hq, Lq, D, seed=1), randn(B, Hkv, Lkv, D, seed=2), randn(B, Hkv, Lkv, Dv, seed=3)
    d_out = randn(B, Hq, Lq, Dv, seed=4)
    if case == "unaligned d_out":
        d_out = _unaligned(B, Hq, Lq, Dv, seed=4)
    elif case == "q strided along D":  # dq = empty_like(q) has its strides too
        q = randn(B, Hq, D, Lq, seed=1).transpose(2, 3)
    else:  # Dv = 18 float32: 72-byte rows of v, out, d_out and dv
        v, d_out = v[..., :18].contiguous(), d_out[..., :18].contiguous()
    inputs = AttentionInputs(q, k, v, masks.causal, None, None, enable_gqa=True)
    _check(inputs, d_out)
    # the dQ kernel asked for descriptors and fell back to pointers
    assert descriptor_calls == [False]


@pytest.mark.parametrize("score_mod", [
    lambda s, b, h, q, kv: torch.sqrt(torch.abs(s)),
    lambda s, b, h, q, kv: torch.log(torch.abs(s)),
], ids=["sqrt|s|", "log|s|"])
def test_a_score_mod_with_an_infinite_derivative_at_zero_keeps_gradients_finite(score_mod):
    # found by a hunt over user-style mods: past ragged lengths the kernels' scores are 0 with
    # p = 0, where d(score_mod)/d(score) is infinite; 0·inf gave NaN in dq and dk
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64, requires_grad=True) for n in (37, 100, 100))
    out = maskc.compiled_attention(q, k, v, score_mod=score_mod)
    want = attention_reference(q, k, v, score_mod=score_mod)[0]
    d_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for got, ref in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(want, (q, k, v), d_out)):
        assert got.isfinite().all()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-8)


def test_create_graph_is_refused_rather_than_losing_the_second_order_terms():
    # a gradient penalty on maskc's first-order gradients: they cannot differentiate further,
    # and torch's once_differentiable would let the penalty's attention terms drop silently
    q, k, v = (torch.randn(1, 2, 24, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)
    with pytest.raises(maskc.MaskcError, match="differentiable once.*create_graph=True"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    (dq,) = torch.autograd.grad(maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal).square().sum(), q)
    assert not dq.requires_grad
