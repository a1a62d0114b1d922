"""Small static vectors in a mod, unrolled by the tracer (maskc.trace.vector, issue 40): a row of
a captured tensor (`means[q_idx]`, `topk[b, h, q_tile]`, `modalities[b]`) reduced, dotted,
compared or iterated over, as FlexAttention runs it through vmap.

The mods FlexAttention's tests, attention-gym and lucidrains' transfusion write run end to end
through maskc.flex_attention against torch's own flex_attention (eager on the CPU) and the
float64 reference, gradients included; small vector operations are checked, traced, against the
function evaluated by torch on an index grid; past UNROLL_LIMIT elements the refusal says so.
"""
import os

import attn_gym.masks
import attn_gym.mods
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import compat_mods as fx
import maskc
from _inputs import qkv, randn
from maskc import MaskTraceError
from maskc.analysis.dense import evaluate, symbols_env
from maskc.testing import assert_block_map_exact, attention_reference, dense_mask
from maskc.trace.vector import UNROLL_LIMIT

FILE = os.path.basename(__file__)
B, HEADS, Q_LEN, KV_LEN, DIM = 2, 2, 40, 56, 16
TOL = 1e-4  # float32 kernels against float64, relative to the largest magnitude


# -- the mods, as their authors wrote them -----------------------------------------------------
def transfusion_attn_mask(modalities):
    """lucidrains/transfusion-pytorch's modality mask, as written there: causal, and within each
    modality (a row of (type, offset, length) per batch element) bidirectional."""

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def modality(offset, length):
        def mask_fn(b, h, q_idx, kv_idx):
            return (q_idx >= offset) & (kv_idx < (offset + length))

        return mask_fn

    def mask_mod(b, h, q_idx, kv_idx):
        mask = causal(b, h, q_idx, kv_idx)

        for _, offset, length in modalities[b]:
            mask = mask | modality(offset, length)(b, h, q_idx, kv_idx)

        return mask

    return mask_mod


def _modalities():
    # (B, M, 3): per batch element, two modalities of (type, offset, length); the second row of
    # batch 1 is padding of length 0
    return torch.tensor([[[0, 4, 9], [1, 20, 14]], [[1, 10, 25], [0, 0, 0]]])


def _vsa():
    topk = torch.stack([torch.randperm(7, generator=torch.Generator().manual_seed(i))[:3]
                        for i in range(B * HEADS * 5)]).view(B, HEADS, 5, 3).to(torch.int32)
    return attn_gym.masks.generate_vsa_mask_mod(topk, 8)


def _mla(requires_grad=False):
    query_rope = randn(B, HEADS, Q_LEN, 4, seed=1, requires_grad=requires_grad)
    key_rope = randn(B, 1, KV_LEN, 4, seed=2, requires_grad=requires_grad)
    mod = attn_gym.mods.generate_mla_rope_score_mod(query_rope, key_rope, num_heads=HEADS, scale=0.5)
    return mod, (query_rope, key_rope)


def _seeded(build):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build()


SCORE_MODS = {
    "fa-test_reduction_unrolled": lambda: _seeded(fx.from_test_reduction_unrolled),  # (q - k).pow(2).sum(-1).sqrt()
    "fa-test_captured_reduction": lambda: _seeded(fx.from_test_captured_reduction),  # scale[b].sum(dim=-1)
    "gym-mla_rope": lambda: _mla()[0],  # torch.dot(query_rope[b, h, q_idx], key_rope[b, 0, kv_idx])
}
MASK_MODS = {
    "gym-vsa_topk": _vsa,  # (selected_tiles == kv_tile.unsqueeze(-1)).any(dim=-1)
    "transfusion": lambda: transfusion_attn_mask(_modalities()),  # for _, offset, length in modalities[b]
}


def _close(got, want, what):
    got, want = got.detach().double(), want.detach().double()
    assert not torch.isnan(got).any(), f"{what} has NaN"
    scale = max(float(want.abs().max()), 1.0)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL * scale, msg=lambda m: f"{what}: {m}")


def _float64(*tensors):
    return tuple(t.detach().double().requires_grad_() for t in tensors)


# -- end to end ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_matches_flex_attention_and_float64(name):
    score_mod = SCORE_MODS[name]()
    q, k, v, do = qkv(B, HEADS, Lq=Q_LEN, Lkv=KV_LEN, D=DIM, requires_grad=True, grad_out=True)
    out = maskc.flex_attention(q, k, v, score_mod=score_mod)
    grads = torch.autograd.grad(out, (q, k, v), do)
    flex = torch_flex_attention(q.detach(), k.detach(), v.detach(), score_mod=score_mod)
    q64, k64, v64 = _float64(q, k, v)
    ref, _ = attention_reference(q64, k64, v64, score_mod=score_mod)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    _close(out, flex, "output against torch's flex_attention")
    _close(out, ref, "output")
    for what, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(got, want, what)


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_matches_flex_attention_and_float64(name):
    mask_mod = MASK_MODS[name]()
    q, k, v, do = qkv(B, HEADS, Lq=Q_LEN, Lkv=KV_LEN, D=DIM, requires_grad=True, grad_out=True)
    block_mask = maskc.create_block_mask(mask_mod, B, HEADS, Q_LEN, KV_LEN, BLOCK_SIZE=16)
    out = maskc.flex_attention(q, k, v, block_mask=block_mask)
    grads = torch.autograd.grad(out, (q, k, v), do)
    flex = torch_flex_attention(q.detach(), k.detach(), v.detach(),
                                block_mask=torch_create_block_mask(mask_mod, B, HEADS, Q_LEN, KV_LEN, device="cpu",
                                                                   BLOCK_SIZE=16))
    q64, k64, v64 = _float64(q, k, v)
    ref, _ = attention_reference(q64, k64, v64, mask_mod=mask_mod)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    _close(out, flex, "output against torch's flex_attention")
    _close(out, ref, "output")
    for what, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(got, want, what)


@pytest.mark.parametrize("block_size", ((16, 16), (32, 8)), ids=lambda bs: f"{bs[0]}x{bs[1]}")
@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_block_map_is_exact(name, block_size):
    assert_block_map_exact(MASK_MODS[name](), Q_LEN, KV_LEN, block_size, B=B, H=HEADS)


def test_captured_rows_get_their_gradients():
    """MLA's query_rope and key_rope require grad: each element's load in the unrolled dot product
    gets its share, as float64 autograd through the reference gives it."""
    score_mod, tables = _mla(requires_grad=True)
    q, k, v, do = qkv(B, HEADS, Lq=Q_LEN, Lkv=KV_LEN, D=DIM, requires_grad=True, grad_out=True)
    out = maskc.compiled_attention(q, k, v, score_mod=score_mod)
    got = torch.autograd.grad(out, (q, *tables), do)
    exact = _float64(q, *tables)
    reference_mod = attn_gym.mods.generate_mla_rope_score_mod(*exact[1:], num_heads=HEADS, scale=0.5)
    ref, _ = attention_reference(exact[0], k.detach().double(), v.detach().double(), score_mod=reference_mod)
    want = torch.autograd.grad(ref, exact, do.double())
    for what, g, w in zip(("dq", "d query_rope", "d key_rope"), got, want):
        _close(g, w, what)


def test_captured_reduction_gets_its_gradient():
    """test_captured_reduction's scale[b].sum(dim=-1) with scale learnable: every element of a
    batch's row gets that row's gradient."""
    scale = randn(B, 8, seed=3, requires_grad=True)
    q, k, v, do = qkv(B, HEADS, Lq=Q_LEN, Lkv=KV_LEN, D=DIM, grad_out=True)

    def mod(t):
        return lambda qk, b, h, q_idx, kv_idx: qk + t[b].sum(dim=-1)

    q.requires_grad_()
    out = maskc.compiled_attention(q, k, v, score_mod=mod(scale))
    got = torch.autograd.grad(out, (q, scale), do)
    exact = _float64(q, scale)
    ref, _ = attention_reference(exact[0], k.double(), v.double(), score_mod=mod(exact[1]))
    want = torch.autograd.grad(ref, exact, do.double())
    for what, g, w in zip(("dq", "d scale"), got, want):
        _close(g, w, what)


# -- vector operations, traced against torch on an index grid ------------------------------------
N = 12
ROW = torch.tensor([[3, 7, 1], [0, 5, 9], [2, 2, 8]])  # (3, 3) int
WEIGHTS = torch.tensor([0.5, -1.0, 2.0])
FLAGS = torch.tensor([[True, False], [False, False], [True, True]])
PAIRS = torch.arange(4 * 2 * 3).view(4, 2, 3) % 7


def broadcast_2d(b, h, q_idx, kv_idx):
    return (ROW[q_idx % 3].unsqueeze(-1) == (PAIRS[kv_idx % 4][0]).unsqueeze(0)).any()


def sum_of_booleans_counts(b, h, q_idx, kv_idx):
    return (ROW[q_idx % 3] > kv_idx % 6).sum(-1) >= 2  # True + True counts 2, as torch.sum does


def keepdim_and_extremes(b, h, q_idx, kv_idx):
    row = PAIRS[q_idx % 4]
    return (row.amax(dim=1, keepdim=True) - row.amin(dim=1, keepdim=True)).sum() > kv_idx % 9


def max_min_and_prod(b, h, q_idx, kv_idx):
    row = ROW[kv_idx % 3]
    return (torch.max(row) - row.min() + row.prod() % 5) <= q_idx


def all_and_int_indices(b, h, q_idx, kv_idx):
    flags = FLAGS[q_idx % 3]
    return flags.all(dim=-1) | (flags[0] & (PAIRS[h][1, -1] + PAIRS[kv_idx % 4][0][2] > 5))


def iterates_and_unpacks(b, h, q_idx, kv_idx):
    keep = q_idx < 0
    for first, middle, last in PAIRS[q_idx % 4]:
        keep = keep | ((kv_idx >= first) & (kv_idx <= last + middle))
    return keep


def python_sum_and_len(b, h, q_idx, kv_idx):
    row = ROW[kv_idx % 3]
    return sum(row) + len(row) > q_idx


def gathers_through_a_row(b, h, q_idx, kv_idx):
    return (ROW[ROW[q_idx % 3] % 3, 0] > kv_idx % 4).any() & (PAIRS[h, 1, ROW[kv_idx % 3] % 3] > 2).all()


def where_over_a_row(b, h, q_idx, kv_idx):
    row = ROW[q_idx % 3]
    return torch.where(row > 4, row, -row).sum() < kv_idx - 4


VECTOR_MASKS = [broadcast_2d, sum_of_booleans_counts, keepdim_and_extremes, max_min_and_prod, all_and_int_indices,
                iterates_and_unpacks, python_sum_and_len, gathers_through_a_row, where_over_a_row]


def _grid(B, H, n=N):
    ar = torch.arange
    return ar(B).view(-1, 1, 1, 1), ar(H).view(1, -1, 1, 1), ar(n).view(1, 1, -1, 1), ar(n).view(1, 1, 1, -1)


@pytest.mark.parametrize("fn", VECTOR_MASKS, ids=lambda f: f.__name__)
def test_vector_operations_trace_as_torch_computes_them(fn):
    mm = maskc.mask_mod(fn)
    t = mm.traced
    got = evaluate(mm.expr, symbols_env(*_grid(1, 2)), t.tensors, t.param_values()).expand(1, 2, N, N)
    want = dense_mask(fn, N, N, 1, 2)
    assert torch.equal(got.to(torch.bool), want), f"{mm.expr} differs at {(got != want).nonzero()[:3].tolist()}"


def dot_with_a_whole_tensor(score, b, h, q_idx, kv_idx):
    return score + torch.dot(WEIGHTS, fx_means[q_idx]) * (fx_means[kv_idx] @ WEIGHTS)


fx_means = randn(N, 3, seed=4)


def test_dot_and_matmul_of_rows_with_a_whole_captured_tensor():
    sm = maskc.score_mod(dot_with_a_whole_tensor)
    b, h, q, kv = _grid(1, 1)
    score = randn(1, 1, N, N, seed=5).double()
    got = evaluate(sm.expr, symbols_env(b, h, q, kv, score), sm.traced.tensors, sm.traced.param_values())
    want = torch.vmap(torch.vmap(lambda s, qi, ki: dot_with_a_whole_tensor(s, 0, 0, qi, ki), (0, 0, None)),
                      (0, None, 0))(score[0, 0].float(), torch.arange(N), torch.arange(N))
    torch.testing.assert_close(got.double().expand(1, 1, N, N)[0, 0], want.double(), rtol=1e-5, atol=1e-5)


# -- what stays refused, and how ------------------------------------------------------------------
BIG = torch.randn(4, UNROLL_LIMIT + 1)
SMALL = torch.randn(4, 3)
WIDE = torch.randn(2, 24)


def reduces_a_long_row(score, b, h, q_idx, kv_idx):
    return score + BIG[h].sum(-1)


def iterates_a_long_row(b, h, q_idx, kv_idx):
    keep = q_idx >= kv_idx
    for x in BIG[b]:
        keep = keep | (x > 2)
    return keep


def broadcasts_past_the_limit(b, h, q_idx, kv_idx):
    return (SMALL[h].unsqueeze(-1) == WIDE[q_idx % 2].unsqueeze(0)).any()  # (3, 1) against (1, 24)


def returns_a_row(b, h, q_idx, kv_idx):
    return SMALL[q_idx] > kv_idx


def indexes_a_computed_row_with_a_position(b, h, q_idx, kv_idx):
    return (SMALL[h] + 1)[q_idx % 3] > 0


def _refusal(fn, kind="mask_mod", offset=1) -> str:
    decorate = maskc.mask_mod if kind == "mask_mod" else maskc.score_mod
    with pytest.raises(MaskTraceError) as info:
        decorate(fn)
    message = str(info.value)
    assert message.startswith(f"{kind} '{fn.__name__}' "), message
    assert f" at {FILE}:{fn.__code__.co_firstlineno + offset} " in message, message
    return message


@pytest.mark.parametrize("fn, kind, offset", [(reduces_a_long_row, "score_mod", 1),
                                              (iterates_a_long_row, "mask_mod", 2)],
                         ids=lambda x: getattr(x, "__name__", None))
def test_a_vector_past_the_limit_is_refused(fn, kind, offset):
    message = _refusal(fn, kind, offset)
    assert "indexes a captured tensor of 2 dimensions with 1 indices (1 missing)" in message, message
    assert f"at most {UNROLL_LIMIT} elements, not {UNROLL_LIMIT + 1}" in message, message
    assert message.endswith("like dist = torch.cdist(means, means) and dist[q_idx, kv_idx]"), message


def test_a_broadcast_past_the_limit_is_refused():
    message = _refusal(broadcasts_past_the_limit)
    assert "broadcasts to shape (3, 24): maskc unrolls" in message and "not 72" in message, message


def test_a_vector_where_one_value_is_needed_is_refused_at_its_line():
    message = _refusal(returns_a_row)
    assert "which leaves a vector of shape (3,) where one value is needed" in message, message
    assert "give one index per dimension" in message and ".any(-1)" in message, message


def test_a_computed_row_indexed_by_a_position_is_refused():
    message = _refusal(indexes_a_computed_row_with_a_position)
    assert "indexes a computed vector with Proxy(" in message and "index the captured tensor itself" in message


def test_a_captured_tensor_resized_in_place_is_traced_again():
    """The unrolled trace holds the row's length: a tensor resized in place (its identity, which
    the closure's guard checks, unchanged) must not keep the old length."""
    modalities = torch.tensor([[[0, 2, 3]]])
    mm = maskc.mask_mod(transfusion_attn_mask(modalities))
    for step in ("one modality", "two, after resize_"):
        if step != "one modality":
            modalities.resize_(1, 2, 3).copy_(torch.tensor([[[0, 2, 3], [1, 6, 4]]]))
        t = mm.traced
        got = evaluate(mm.expr, symbols_env(*_grid(1, 1)), t.tensors, t.param_values()).expand(1, 1, N, N)
        assert torch.equal(got.to(torch.bool), dense_mask(mm, N, N, 1, 1)), f"{step}: {mm.expr}"
