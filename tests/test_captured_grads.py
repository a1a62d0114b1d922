"""Gradients of captured tensors: learnable ALiBi slopes, relative-position bias tables, per-head
scalars, row and column biases, computed by the backward kernel (d(score_mod)/d(element) from
sympy) and checked against float64 autograd through the dense reference."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import maskc
from maskc.testing import attention_reference

KINDS = ("alibi", "relative", "relative_per_head", "relative_clamped", "relative_from_the_end", "pair_table",
         "softcap_per_head", "row_and_column", "scalar")


def _learnable(kind: str, H: int, Lq: int, Lkv: int, gen):
    """(tensors, score_mod(tensors)): the mod reads the tensors it is given, so the same code
    builds maskc's mod and the float64 reference's."""
    if kind == "alibi":
        tensors = (torch.rand(H, generator=gen),)
        return tensors, lambda t: lambda score, b, h, q_idx, kv_idx: score + t[0][h] * (kv_idx - q_idx)
    if kind == "relative":
        tensors = (torch.randn(Lq + Lkv - 1, generator=gen),)
        return tensors, lambda t: lambda score, b, h, q_idx, kv_idx: score + t[0][q_idx - kv_idx + Lkv - 1]
    if kind == "relative_per_head":
        tensors = (torch.randn(H, Lq + Lkv - 1, generator=gen),)
        return tensors, lambda t: lambda score, b, h, q_idx, kv_idx: score + t[0][h, q_idx - kv_idx + Lkv - 1]
    if kind == "relative_from_the_end":  # negative distances count from the table's end, as torch indexes
        tensors = (torch.randn(Lq + Lkv - 1, generator=gen),)
        return tensors, lambda t: lambda score, b, h, q_idx, kv_idx: score + t[0][q_idx - kv_idx]
    if kind == "relative_clamped":  # distances past ±5 share the table's ends (T5-style buckets)
        tensors = (torch.randn(H, 11, generator=gen),)
        return tensors, lambda t: lambda score, b, h, q_idx, kv_idx: score + t[0][
            h, torch.clamp(q_idx - kv_idx, -5, 5) + 5]
    if kind == "pair_table":  # an element per (q, kv) pair: not along diagonals
        tensors = (torch.randn(Lq, Lkv, generator=gen),)
        return tensors, lambda t: lambda score, b, h, q_idx, kv_idx: score + t[0][q_idx, kv_idx]
    if kind == "softcap_per_head":
        tensors = (1.0 + 4 * torch.rand(H, generator=gen),)
        return tensors, lambda t: lambda score, b, h, q_idx, kv_idx: t[0][h] * torch.tanh(score / t[0][h])
    if kind == "row_and_column":
        tensors = (torch.randn(Lq, generator=gen), torch.randn(Lkv, generator=gen))
        return tensors, lambda t: lambda score, b, h, q_idx, kv_idx: score * 0.5 + t[0][q_idx] + t[1][kv_idx]
    tensors = (torch.tensor(0.7),)
    return tensors, lambda t: lambda score, b, h, q_idx, kv_idx: score * t[0]


@st.composite
def cases(draw):
    B, h_kv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = h_kv * draw(st.sampled_from((1, 2, 3)))
    Lq, Lkv = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    D = draw(st.sampled_from((16, 32)))
    dtype = draw(st.sampled_from((torch.float32, torch.float16, torch.bfloat16)))
    mask = draw(st.sampled_from((None, maskc.masks.causal, maskc.masks.sliding_window(9))))
    kind = draw(st.sampled_from(KINDS))
    table_dtype = draw(st.sampled_from((torch.float32, torch.float64)))  # a float64 table beside narrower q
    seed = draw(st.integers(0, 2**31))
    return B, H, h_kv, Lq, Lkv, D, dtype, mask, kind, table_dtype, seed


def _grads(q, k, v, tensors, mod, mask, d_out, **kw):
    out = maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=maskc.score_mod(mod(tensors)),
                                   enable_gqa=True, **kw)
    return torch.autograd.grad(out, (q, k, v, *tensors), d_out)


@settings(deadline=None, max_examples=20, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_captured_gradients_match_float64_autograd(case):
    B, H, h_kv, Lq, Lkv, D, dtype, mask, kind, table_dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    tensors, mod = _learnable(kind, H, Lq, Lkv, gen)
    tensors = tuple(t.to(table_dtype).requires_grad_() for t in tensors)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype).requires_grad_()
               for shape in ((B, H, Lq, D), (B, h_kv, Lkv, D), (B, h_kv, Lkv, D)))
    d_out = torch.randn(B, H, Lq, D, generator=gen).to(dtype)
    got = _grads(q, k, v, tensors, mod, mask, d_out)
    exact = tuple(t.detach().double().requires_grad_() for t in (q, k, v, *tensors))
    ref, _ = attention_reference(*exact[:3], mask, mod(exact[3:]), enable_gqa=True)
    want = torch.autograd.grad(ref, exact, d_out.double(), allow_unused=True)
    tolerance = 2e-2 if dtype != torch.float32 else 1e-4
    # A captured element's gradient sums ds · d(score)/d(element) over many pairs, and in half
    # precision every ds carries the rounding of delta = rowsum(dO·O) from the output rounded
    # to the dtype (a bf16 ALiBi case with Lq=1, Lkv=10 was off by 0.033 of a gradient of 0.49
    # while the float32 kernel on the same bf16 values is exact; a bf16 row-and-column bias
    # reached 2.5e-2). So its error is measured against max(|grad|, 1, the largest
    # d(score)/d(element): ALiBi's distance), within 1e-1 in half precision. The float32 cases
    # (1e-4) and gradcheck in float64 hold the same kernel code to its real precision.
    scale = max(Lq, Lkv) if kind == "alibi" else 1.0
    captured_tolerance = 1e-1 if dtype != torch.float32 else tolerance
    for name, a, b in zip(("q", "k", "v", *(f"captured #{i}" for i in range(len(tensors)))), got, want):
        b = torch.zeros_like(a, dtype=torch.float64) if b is None else b
        captured = name.startswith("captured")
        error = (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1.0, scale if captured else 1.0)
        bound = captured_tolerance if captured else tolerance
        assert error < bound, f"{kind}: gradient of {name} off by {error:.2e} (relative to max(|grad|, 1, scale))"


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_in_float64(kind):
    gen = torch.Generator().manual_seed(0)
    tensors, mod = _learnable(kind, 2, 5, 7, gen)
    tensors = tuple(t.double().requires_grad_() for t in tensors)
    # q, k and v's gradients have their own gradchecks (tests/test_backward.py); here only the
    # captured tensors vary, which keeps the finite differences few
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64)
               for shape in ((1, 2, 5, 16), (1, 2, 7, 16), (1, 2, 7, 16)))

    def attend(*tensors):
        return maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=maskc.score_mod(mod(tensors)))

    assert torch.autograd.gradcheck(attend, tensors, atol=1e-6, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("Lq", [40, 2], ids=["attention", "decoding"])
def test_a_float64_table_beside_float32_inputs_is_read_in_float32(Lq):
    """A float64 score reached the float32 accumulators, which Triton refused with an internal
    message ("expected accumulator dtype fp32, got fp64")."""
    table = torch.randn(130, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def pair_bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx] * table[kv_idx]

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, L, 16, generator=gen) for L in (Lq, 40, 40))
    out = maskc.compiled_attention(q, k, v, score_mod=pair_bias)
    ref, _ = attention_reference(q, k, v, score_mod=pair_bias)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_captured_gradients_are_deterministic():
    gen = torch.Generator().manual_seed(1)
    tensors, mod = _learnable("relative_per_head", 4, 60, 60, gen)
    tensors = tuple(t.requires_grad_() for t in tensors)
    q, k, v = (torch.randn(2, 4, 60, 32, generator=gen, requires_grad=True) for _ in range(3))
    d_out = torch.randn(2, 4, 60, 32, generator=gen)
    first = _grads(q, k, v, tensors, mod, maskc.masks.causal, d_out)
    second = _grads(q, k, v, tensors, mod, maskc.masks.causal, d_out)
    assert all(torch.equal(a, b) for a, b in zip(first[3:], second[3:]))


def test_gradients_accumulate_into_the_captured_tensor_without_q_k_v_gradients():
    """A learnable bias gets .grad from backward() even where q, k and v need none."""
    slopes = torch.rand(2, requires_grad=True)

    @maskc.score_mod
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    q, k, v = (torch.randn(1, 2, 3, 16) for _ in range(3))  # 3 query rows: decoding unless gradients are wanted
    maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=alibi).sum().backward()
    first = slopes.grad.clone()
    maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=alibi).sum().backward()
    torch.testing.assert_close(slopes.grad, 2 * first)


def test_query_rows_past_the_length_add_nothing_to_a_captured_gradient():
    # A slope driven negative makes scores grow with q_idx - kv_idx. The dQ kernel's rows past
    # Lq (50 of a 64-row tile) have q = 0 and lse = -inf, so their p = exp2(score) overflowed
    # float32 and ds was NaN, which the integer sum turned into ±2**31 (a helper found it).
    slopes = torch.tensor([0.25, -2.0], requires_grad=True)

    @maskc.score_mod
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 50, 16, generator=gen) for _ in range(3))
    d_out = torch.randn(1, 2, 50, 16, generator=gen)
    out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, score_mod=alibi)
    (got,) = torch.autograd.grad(out, slopes, d_out)
    exact = slopes.detach().double().requires_grad_()

    def reference_alibi(score, b, h, q_idx, kv_idx):
        return score + exact[h] * (kv_idx - q_idx)

    ref, _ = attention_reference(q.double(), k.double(), v.double(), mask_mod=maskc.masks.causal,
                                 score_mod=reference_alibi)
    (want,) = torch.autograd.grad(ref, exact, d_out.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-3)


def test_what_has_no_gradient_is_refused_with_the_rule():
    ids = torch.zeros(8).requires_grad_()

    @maskc.mask_mod
    def same(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    q, k, v = (torch.randn(1, 1, 8, 16) for _ in range(3))
    with pytest.raises(ValueError, match="a mask's values only choose which pairs are kept"):
        maskc.compiled_attention(q, k, v, mask_mod=same)
    bias = torch.zeros(8, requires_grad=True)

    @maskc.score_mod
    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    with pytest.raises(NotImplementedError, match="runs without gradients.*captured tensors"):
        maskc.compiled_attention(q, k, v, score_mod=biased, kv_lens=torch.tensor([8]))

    @maskc.score_mod
    def rounded(score, b, h, q_idx, kv_idx):
        return score + torch.floor(bias[kv_idx])

    with pytest.raises(maskc.MaskcError, match=r"not differentiable in its captured tensor element.*\.detach\(\)"):
        maskc.compiled_attention(q, k, v, score_mod=rounded).sum().backward()

    @maskc.score_mod
    def rounded_detached(score, b, h, q_idx, kv_idx):  # the fix the error gives: no gradient through that read
        return score + torch.floor(bias.detach()[kv_idx]) + bias[kv_idx]

    maskc.compiled_attention(q, k, v, score_mod=rounded_detached).sum().backward()
    assert bias.grad is not None


@pytest.mark.parametrize("kind, reads", [("relative", "diagonals"), ("relative_per_head", "diagonals"),
                                         ("relative_clamped", "diagonals"), ("pair_table", "both"),
                                         ("row_and_column", "rows")])
def test_an_element_read_along_diagonals_is_summed_per_diagonal(kind, reads):
    # one atomic add per diagonal of a tile, not per pair: what the dQ kernel prints for it
    from maskc.codegen.render import _hooks
    from maskc.codegen.source import KernelSource
    tensors, mod = _learnable(kind, 2, 40, 30, torch.Generator().manual_seed(0))
    traced = maskc.score_mod(mod(tensors)).traced
    source = KernelSource.of("bwd", None, traced, exact=False, grad_slots=tuple(range(len(tensors))))
    assert _hooks(source)["load_grads"][0]["reads"] == reads


@pytest.mark.parametrize("block_m, block_n", [(16, 64), (64, 16), (32, 32)])
def test_diagonal_sums_hold_for_any_tile_shape(block_m, block_n):
    # the dQ kernel sums a tile's diagonals a band of BLOCK_N at a time, (BLOCK_M + BLOCK_N - 2)
    # // BLOCK_N + 1 bands: 2, 5 and 2 here; ragged lengths leave partial tiles at both ends
    from maskc.runtime.tiles import BackwardConfig, TileConfig, use_config
    gen = torch.Generator().manual_seed(3)
    Lq, Lkv = 75, 90
    tensors, mod = _learnable("relative_per_head", 2, Lq, Lkv, gen)
    tensors = tuple(t.requires_grad_() for t in tensors)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen, requires_grad=True) for n in (Lq, Lkv, Lkv))
    d_out = torch.randn(1, 2, Lq, 16, generator=gen)
    tiles = BackwardConfig(TileConfig(block_m, block_n, 4, 1), TileConfig(32, 32, 4, 1))
    with use_config(backward=tiles):
        got = _grads(q, k, v, tensors, mod, maskc.masks.sliding_window(40), d_out)
    exact = tuple(t.detach().double().requires_grad_() for t in (q, k, v, *tensors))
    ref, _ = attention_reference(*exact[:3], maskc.masks.sliding_window(40), mod(exact[3:]))
    want = torch.autograd.grad(ref, exact[3:], d_out.double())
    torch.testing.assert_close(got[3].double(), want[0], atol=1e-4, rtol=1e-4)
