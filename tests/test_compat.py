"""Compatibility: mask and score mods we did not write, run unchanged through every stage.

Two sources:

- attention-gym: every mask and score mod that `attn_gym.masks` and `attn_gym.mods` ship,
  imported and built with the package's own factories (small parameters);
  `test_every_attn_gym_mod_is_covered` fails when a new release ships one this file misses.
- FlexAttention's test suite: tests/compat_mods.py, the mods copied verbatim from PyTorch's
  test_flex_attention.py and test_flex_decoding.py.

Each case goes, as written, through `maskc.mask_mod` / `maskc.score_mod` (test_trace); for
masks through `maskc.block_map`, checked sound and exact against dense evaluation at lengths
that are not multiples of the tile (test_block_map); and through `maskc.compiled_attention`
forward and backward against `maskc.testing.attention_reference` in float64 (test_attention).
test_reference checks that reference itself against FlexAttention's semantics (each mod
called on scalars, through torch.vmap, as FlexAttention does), so a failure can be told
apart from a kernel bug. Small vector operations (a reduction over a row of a captured
tensor, a dot product, top-k membership) run unrolled; what maskc refuses, test_refused asserts
the MaskTraceError and its message (what, file:line, fix).

Everything runs through Triton's interpreter on the CPU: shapes are tiny (B <= 2, H = 2,
Lq = 40, Lkv = 56, D = 16) and float32.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import re
import zlib
from typing import Callable

import attn_gym
import attn_gym.masks
import attn_gym.masks.vsa
import attn_gym.mods
import pytest
import torch
from attn_gym.masks.document_mask import length_to_offsets
from torch.nn.attention.flex_attention import create_mask, noop_mask

import compat_mods as fx
import maskc
from _inputs import qkv
from _lanes import every
from maskc.testing import assert_block_map_exact, attention_reference, dense_mask

Q_LEN, KV_LEN, HEADS, DIM = 40, 56, 2, 16
BLOCK_SIZES = ((16, 16), (32, 8))
TOL = 1e-4  # float32 kernel against the float64 reference, relative to the largest magnitude
# Every stage of a case takes about a second here; a stage past this many seconds has blown up
# (symbolic analysis that explodes, O(L²) work) and fails rather than stalls the suite.
STAGE_TIMEOUT = 120


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKC_CACHE_DIR", str(tmp_path_factory.mktemp("maskc_cache")))
        yield


@dataclasses.dataclass(frozen=True)
class Case:
    """One mod (or a mask and a score mod used together), built on first use."""

    id: str
    build: Callable[[], tuple]  # -> (mask_mod or None, score_mod or None)
    has_mask: bool = True
    B: int = 1  # batch of the attention run: 2 where the mod reads b
    q_len: int = Q_LEN
    kv_len: int = KV_LEN


_BUILT: dict[str, tuple] = {}


def mods(case):
    """The case's (mask_mod, score_mod), built once with a seed of its own."""
    if case.id not in _BUILT:
        with torch.random.fork_rng():
            torch.manual_seed(zlib.crc32(case.id.encode()))
            _BUILT[case.id] = case.build()
    return _BUILT[case.id]


def mask(id, build, **kw):
    return Case(id, lambda: (build(), None), **kw)


def score(id, build, **kw):
    return Case(id, lambda: (None, build()), has_mask=False, **kw)


def both(id, build_mask, build_score, **kw):
    return Case(id, lambda: (build_mask(), build_score()), **kw)


# -- attention-gym, as the package ships it --------------------------------------------------
M, MOD = attn_gym.masks, attn_gym.mods


def _offsets():
    return length_to_offsets([7, 20, 12, 17], "cpu")  # document lengths summing to KV_LEN


def _jetspec_tree():
    parents = [-1] + [(i - 1) // 2 for i in range(1, Q_LEN)]  # a binary tree of 40 nodes
    return M.generate_jetspec_tree_causal_mask_mod(KV_LEN - Q_LEN, M.build_tree_ancestor_matrix(parents, "cpu"))


def _graph(B=2, N=KV_LEN):
    """A ring with a few chords and random edge types, for the Graphormer mods."""
    adjacency = torch.zeros(B, N, N, dtype=torch.bool)
    idx = torch.arange(N)
    adjacency[:, idx, (idx + 1) % N] = True
    adjacency[:, idx, (idx * 7 + 3) % N] = True
    adjacency = adjacency | adjacency.transpose(1, 2)
    return adjacency, torch.randint(0, 3, (B, N, N))


def _graphormer_spatial():
    adjacency, _ = _graph()
    distances = MOD.shortest_path_distances(adjacency, max_distance=4)
    return MOD.generate_graphormer_spatial_bias(torch.randn(HEADS, 6), distances)


def _graphormer_edge():
    adjacency, edge_types = _graph()
    path_edge_types, path_lengths = MOD.shortest_path_edge_types(adjacency, edge_types, max_path_len=2)
    return MOD.generate_graphormer_edge_bias(torch.randn(HEADS, 2, 3), path_edge_types, path_lengths)


def _flamingo():
    intervals = torch.tensor([[0, 12], [8, 25], [20, 40], [30, 40]])
    return M.generate_vision_cross_attention_mask_mod(intervals, image_token_length=14)


def _global_sliding():
    is_global = torch.zeros(KV_LEN, dtype=torch.bool)
    is_global[[0, 17, 33]] = True
    return M.generate_global_sliding_window(5, is_global)


def _shared_prefix():
    offsets = length_to_offsets([10, 8, 9, 12, 17], "cpu")
    return M.generate_shared_prefix_mask_mod(offsets, torch.tensor([0, 0, 0, 3, 3], dtype=torch.int32))


def _vsa():
    topk = torch.stack([torch.randperm(7)[:3] for _ in range(2 * HEADS * 5)]).view(2, HEADS, 5, 3).to(torch.int32)
    return M.generate_vsa_mask_mod(topk, 8)


def _mla():
    query_rope = torch.randn(2, HEADS, Q_LEN, 4)
    key_rope = torch.randn(2, 1, KV_LEN, 4)
    return MOD.generate_mla_rope_score_mod(query_rope, key_rope, num_heads=HEADS, scale=0.5)


GYM_CASES = [
    mask("gym-causal_mask", lambda: M.causal_mask),
    mask("gym-sliding_window", lambda: M.generate_sliding_window(10)),
    mask("gym-prefix_lm", lambda: M.generate_prefix_lm_mask(13)),
    mask("gym-doc_mask-causal", lambda: M.generate_doc_mask_mod(M.causal_mask, _offsets())),
    mask("gym-doc_mask-noop", lambda: M.generate_doc_mask_mod(noop_mask, _offsets())),  # as attn-gym's main()
    mask("gym-packed_causal_doc_mask", lambda: M.generate_packed_causal_doc_mask_mod(_offsets())),
    mask("gym-dilated_sliding_window", lambda: M.generate_dilated_sliding_window(12, 3)),
    mask("gym-natten", lambda: M.generate_natten(canvas_w=8, canvas_h=7, kernel_w=3, kernel_h=3)),
    mask("gym-tiled_natten", lambda: M.generate_tiled_natten(W=8, H=8, K_W=3, K_H=3, T_W=4, T_H=4)),
    mask("gym-morton_natten", lambda: M.generate_morton_natten(canvas_w=8, canvas_h=8, kernel_w=3, kernel_h=3)),
    mask("gym-sta_2d", lambda: M.generate_sta_mask_mod_2d((6, 8), (4, 4), (2, 2), text_seq_len=8)),
    mask("gym-sta_3d", lambda: M.generate_sta_mask_mod_3d((2, 4, 6), (1, 2, 4), (1, 2, 2), text_seq_len=8)),
    mask("gym-svg_spatial_head", lambda: M.generate_spatial_head_mask_mod(6, 5, 10, width=1, round_width=4)),
    mask("gym-svg_spatial_head-attn_sink",
         lambda: M.generate_spatial_head_mask_mod(6, 5, 10, width=1, attn_sink=True, round_width=4)),
    mask("gym-svg_temporal_head", lambda: M.generate_temporal_head_mask_mod(6, 5, 10, width=2)),
    mask("gym-flamingo_vision_cross_attention", _flamingo),
    mask("gym-global_sliding_window", _global_sliding),
    mask("gym-shared_prefix", _shared_prefix),
    mask("gym-block_diffusion", lambda: M.generate_block_diffusion_mask(KV_LEN // 2, 5)),
    mask("gym-jetspec_tree_causal", _jetspec_tree),
    mask("gym-jetspec_training", lambda: M.generate_jetspec_training_mask_mod(KV_LEN - Q_LEN, 8)),
    mask("gym-batchify-causal", lambda: M.batchify_mask_mod(M.causal_mask, 12)),
    mask("gym-vsa_padding", lambda: attn_gym.masks.vsa.generate_vsa_padding_mask_mod(
        torch.tensor([8, 5, 8, 3, 8, 8, 6]), 8)),
    mask("gym-vsa_topk", _vsa, B=2),  # (selected_tiles == kv_tile.unsqueeze(-1)).any(dim=-1), unrolled
    score("gym-alibi", lambda: MOD.generate_alibi_bias(HEADS)),
    score("gym-tanh_softcap", lambda: MOD.generate_tanh_softcap(2)),
    score("gym-activation-gelu", lambda: MOD.generate_activation_score_mod()),
    score("gym-sandwich", lambda: MOD.generate_sandwich_bias(HEADS, KV_LEN, d_bar=16)),
    score("gym-graphormer_spatial", _graphormer_spatial, B=2),
    score("gym-graphormer_edge", _graphormer_edge, B=2),
    score("gym-mla_rope", _mla, B=2),  # torch.dot(query_rope[b, h, q_idx], key_rope[...]), unrolled
    both("gym-causal+alibi", lambda: M.causal_mask, lambda: MOD.generate_alibi_bias(HEADS)),
    both("gym-sliding_window+tanh_softcap", lambda: M.generate_sliding_window(10),
         lambda: MOD.generate_tanh_softcap(2)),
]

# attn_gym.masks / attn_gym.mods exports that are not mods (helpers, data builders, post-processing)
GYM_NOT_MODS = {
    "build_tree_ancestor_matrix", "undo_softmax", "shortest_path_distances", "shortest_path_edge_types",
    "VSACoarseResult", "VSATileMetadata", "compute_vsa_coarse_attention", "compute_vsa_tile_scores",
    "compute_vsa_topk_indices", "create_vsa_block_mask", "create_vsa_flash_block_mask",
    "create_vsa_tile_metadata", "lift_vsa_tile_output", "pool_to_vsa_tiles", "tile_vsa_sequence",
    "untile_vsa_sequence", "validate_vsa_block_mask_inputs", "vsa_additive_combine", "vsa_gated_mix",
    "vsa_topk_from_sparsity",
}
# export name -> the case ids that run it
GYM_COVERAGE = {
    "causal_mask": "gym-causal_mask", "generate_sliding_window": "gym-sliding_window",
    "generate_prefix_lm_mask": "gym-prefix_lm", "generate_doc_mask_mod": "gym-doc_mask-causal",
    "generate_packed_causal_doc_mask_mod": "gym-packed_causal_doc_mask",
    "generate_dilated_sliding_window": "gym-dilated_sliding_window", "generate_natten": "gym-natten",
    "generate_tiled_natten": "gym-tiled_natten", "generate_morton_natten": "gym-morton_natten",
    "generate_sta_mask_mod_2d": "gym-sta_2d", "generate_sta_mask_mod_3d": "gym-sta_3d",
    "generate_spatial_head_mask_mod": "gym-svg_spatial_head", "generate_temporal_head_mask_mod":
    "gym-svg_temporal_head", "generate_vision_cross_attention_mask_mod": "gym-flamingo_vision_cross_attention",
    "generate_global_sliding_window": "gym-global_sliding_window",
    "generate_shared_prefix_mask_mod": "gym-shared_prefix", "generate_block_diffusion_mask": "gym-block_diffusion",
    "generate_jetspec_tree_causal_mask_mod": "gym-jetspec_tree_causal",
    "generate_jetspec_training_mask_mod": "gym-jetspec_training", "batchify_mask_mod": "gym-batchify-causal",
    "generate_vsa_mask_mod": "gym-vsa_topk", "generate_alibi_bias": "gym-alibi",
    "generate_tanh_softcap": "gym-tanh_softcap", "generate_activation_score_mod": "gym-activation-gelu",
    "generate_sandwich_bias": "gym-sandwich", "generate_graphormer_spatial_bias": "gym-graphormer_spatial",
    "generate_graphormer_edge_bias": "gym-graphormer_edge", "generate_mla_rope_score_mod": "gym-mla_rope",
}

# -- FlexAttention's test suite (tests/compat_mods.py) ---------------------------------------
def _pick(build, i):
    return lambda: build()[i]


FLEX_CASES = [
    score("fa-_identity", lambda: fx._identity),
    score("fa-_times_two", lambda: fx._times_two),
    score("fa-_squared", lambda: fx._squared),
    score("fa-_causal", lambda: fx._causal),
    score("fa-_inverse_causal", lambda: fx._inverse_causal),
    score("fa-_rel_bias", lambda: fx._rel_bias),
    score("fa-_rel_causal", lambda: fx._rel_causal),
    score("fa-_generate_alibi_bias", lambda: fx._generate_alibi_bias(8)),
    score("fa-_head_offset", lambda: fx._head_offset(torch.float32)),
    score("fa-_trig", lambda: fx._trig, B=2),
    score("fa-_trig2", lambda: fx._trig2, B=2),
    mask("fa-_causal_mask", lambda: fx._causal_mask),
    mask("fa-_inverse_causal_mask", lambda: fx._inverse_causal_mask),
    mask("fa-noop_mask", lambda: noop_mask),
    both("fa-_causal+_causal_mask", lambda: fx._causal_mask, lambda: fx._causal),
    both("fa-_inverse_causal+_inverse_causal_mask", lambda: fx._inverse_causal_mask, lambda: fx._inverse_causal),
    both("fa-_rel_causal+_causal_mask", lambda: fx._causal_mask, lambda: fx._rel_causal),
    score("fd-_generate_windowed", lambda: fx._generate_windowed(12)),
    score("fa-test_doc_mask_sparse", fx.from_test_doc_mask_sparse),
    score("fa-test_index_multiple", fx.from_test_index_multiple, B=2),
    score("fa-test_index_weird1", fx.from_test_index_weird1, B=2),
    score("fa-test_index_weird2", fx.from_test_index_weird2, B=2),
    score("fa-test_skip_odd_keys", fx.from_test_skip_odd_keys),
    score("fa-test_function_composition", fx.from_test_function_composition),
    score("fa-test_captured_buffers_all_dims", fx.from_test_captured_buffers_all_dims, B=2),
    score("fa-test_seq_masking", fx.from_test_seq_masking),
    score("fa-test_load_from_bias_seq_only", fx.from_test_load_from_bias_seq_only),
    score("fa-test_load_from_bias_seq_batch", fx.from_test_load_from_bias_seq_batch, B=2),
    score("fa-test_load_from_view_buffer", fx.from_test_load_from_view_buffer, B=2),
    score("fa-test_load_from_bias_head_seq_batch", fx.from_test_load_from_bias_head_seq_batch, B=2),
    score("fa-test_load_rel_bias", fx.from_test_load_rel_bias),
    score("fa-test_dependent_causal_bidirectional", fx.from_test_dependent_causal_bidirectional, B=2),
    score("fa-test_natten_2d", fx.from_test_natten_2d),
    score("fa-test_subgraph_respect_decompostion", fx.from_test_subgraph_respect_decompostion),
    score("fa-test_silu_on_score", fx.from_test_silu_on_score),
    score("fa-test_padded_dense_causal", fx.from_test_padded_dense_causal, B=2),
    score("fa-test_captured_scale", fx.from_test_captured_scale),
    score("fa-test_multiple_score_mod_calls-scoremod_1", _pick(fx.from_test_multiple_score_mod_calls, 0)),
    score("fa-test_multiple_score_mod_calls-scoremod_2", _pick(fx.from_test_multiple_score_mod_calls, 1)),
    mask("fa-test_multiple_mask_calls-causal_mask_slidewindow_mod", _pick(fx.from_test_multiple_mask_calls, 1)),
    score("fa-test_inputs_are_realized", fx.from_test_inputs_are_realized),
    mask("fa-test_mask_mod_combiners-and_causal_sliding", _pick(fx.from_test_mask_mod_combiners, 0)),
    mask("fa-test_mask_mod_combiners-and_causal_neg_causal", _pick(fx.from_test_mask_mod_combiners, 1)),
    mask("fa-test_mask_mod_combiners-or_causal_neg_causal", _pick(fx.from_test_mask_mod_combiners, 2)),
    score("fa-test_njt_causal", fx.from_test_njt_causal),
    score("fa-test_new_empty_mask_mod-score_mod", _pick(fx.from_test_new_empty_mask_mod, 0), B=2),
    mask("fa-test_new_empty_mask_mod-causal", _pick(fx.from_test_new_empty_mask_mod, 1), B=2),
    Case("fa-test_fully_masked_out_rows", fx.from_test_fully_masked_out_rows),
    score("fa-test_comparison_vs_sdpa-causal", _pick(fx.from_test_comparison_vs_sdpa, 0)),
    mask("fa-test_block_mask_non_divisible", fx.from_test_block_mask_non_divisible, q_len=fx.S - 1,
         kv_len=fx.S - 1),
    score("fa-test_head_bias_req_grad-no_grad", lambda: fx.from_test_head_bias_req_grad(requires_grad=False)),
    *[score(f"fa-test_comparison_vs_sdpa_with_learnable_bias-{name}",
            getattr(fx, f"from_test_comparison_vs_sdpa_with_learnable_bias_{name}"))
      for name in ("1d", "2d", "2d_index_multiple", "2d_transposed", "3d_transposed")],
    score("fa-test_modular_indexing", fx.from_test_modular_indexing, B=2),
    mask("fa-test_lse_masked_output-sliding_window_causal", _pick(fx.from_test_lse_masked_output, 0)),
    mask("fa-test_lse_masked_output-global_causal", _pick(fx.from_test_lse_masked_output, 1)),
    mask("fa-test_dynamic_shapes_bug_dynamic_batch-partial", fx.from_test_dynamic_shapes_bug_dynamic_batch, B=2),
    Case("fa-test_causal_block_non_divisible_with_captured_buffer",
         lambda: fx.from_test_causal_block_non_divisible_with_captured_buffer()[::-1],
         q_len=fx.S - 3, kv_len=fx.S - 3),
    score("fa-test_non_divisible_with_captured_buffer", fx.from_test_non_divisible_with_captured_buffer),
    mask("fa-test_free_symbol_dynamic-batch_flip_causal", _pick(fx.from_test_free_symbol_dynamic, 0), B=2),
    mask("fa-test_free_symbol_dynamic-lambda", _pick(fx.from_test_free_symbol_dynamic, 1), B=2),
    score("fa-test_symbol_closure_in_score_mod-lambda", fx.from_test_symbol_closure_in_score_mod),
    mask("fa-test_block_mask_attributes-causal_mask", _pick(fx.from_test_block_mask_attributes, 0), B=2),
    mask("fa-test_compiling_create_block_mask", fx.from_test_compiling_create_block_mask),
    mask("fa-test_doc_mask_clamped_repro-generate_doc_mask_mod", _pick(fx.from_test_doc_mask_clamped_repro, 0)),
    mask("fa-test_doc_mask_clamped_repro-clamp", _pick(fx.from_test_doc_mask_clamped_repro, 1)),
    mask("fa-test_block_mask_reuse_with_weird_mask", fx.from_test_block_mask_reuse_with_weird_mask),
    mask("fa-test_document_masking_edge_case", fx.from_test_document_masking_edge_case, B=2),
    *[score(f"fa-TestLearnableBiases-test_{name}", getattr(fx, f"from_test_{name}"), B=2 if name == "weird_bias" else 1)
      for name in ("relative_1d_bias", "head_specific_bias", "local_window_bias", "global_tokens_bias", "weird_bias",
                   "indirect_bias", "symmetric_bias", "head_specific_gate", "distinct_biases")],
    mask("fd-test_paged_attention_page_size-causal_offset_mask", fx.from_test_paged_attention_page_size),
    score("fd-test_captured_buffers", fx.from_test_captured_buffers),
    score("fa-test_captured_reduction", fx.from_test_captured_reduction, B=2),  # scale[b].sum(dim=-1), unrolled
    score("fa-test_reduction_unrolled", fx.from_test_reduction_unrolled),  # .pow(2).sum(-1), unrolled
    score("fa-test_autograd_function_in_score_mod", fx.from_test_autograd_function_in_score_mod),
]

CASES = GYM_CASES + FLEX_CASES
MASK_CASES = [c for c in CASES if c.has_mask]


# Mods maskc refuses, and then must say so clearly.
REFUSED = {
    # an op known by its name alone (attn-gym's inline-PTX tanh registered as
    # torch.ops.approx.tanh) could compute anything
    "gym-tanh_softcap-approx": lambda: ("score_mod", MOD.generate_tanh_softcap(2, approx=True)),
}


# -- the stages ------------------------------------------------------------------------------
@pytest.mark.timeout(STAGE_TIMEOUT)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_trace(case):
    mask_mod, score_mod = mods(case)
    if mask_mod is not None:
        assert isinstance(maskc.mask_mod(mask_mod), maskc.MaskMod)
    if score_mod is not None:
        assert isinstance(maskc.score_mod(score_mod), maskc.ScoreMod)


@pytest.mark.timeout(STAGE_TIMEOUT)
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda bs: f"{bs[0]}x{bs[1]}")
@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: c.id)
def test_block_map(case, block_size):
    assert_block_map_exact(mods(case)[0], case.q_len, case.kv_len, block_size, B=2, H=HEADS)


def _inputs(case):
    """q, k, v and the output's gradient, of the case's shapes."""
    return qkv(case.B, HEADS, Lq=case.q_len, Lkv=case.kv_len, D=DIM, grad_out=True)


def _close(got, want, what):
    """Elementwise within TOL of the float64 value, relative to the largest magnitude; NaN never passes."""
    got, want = got.detach().double(), want.detach()
    assert not torch.isnan(got).any(), f"{what} has NaN at {torch.isnan(got).nonzero()[:3].tolist()}"
    scale = max(float(want.abs().max()), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(STAGE_TIMEOUT)
@pytest.mark.parametrize("case", every(CASES, 3, ids=lambda c: c.id))  # every case's trace and map above
def test_attention(case):
    mask_mod, score_mod = mods(case)
    q, k, v, do = _inputs(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert_agrees(out, lse, grads, (q, k, v, do), mask_mod, score_mod)


def assert_agrees(out, lse, grads, inputs, mask_mod, score_mod):
    """out, lse and the gradients (dq, dk, dv) of `inputs` (q, k, v, d_out) within TOL of the
    float64 reference's. A bias on whole rows (bias[b][q_idx]) leaves out and its gradients
    unchanged; the lse sees it."""
    q, k, v, do = inputs
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, mask_mod=mask_mod, score_mod=score_mod)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    _close(out, ref, "output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(got, want, name)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "lse is -inf on other rows than the reference's"
    _close(lse[~empty], ref_lse[~empty], "lse")


# -- the reference the kernels are checked against ---------------------------------------------
def _vmap_scores(score_mod, scores):
    """FlexAttention's semantics: the mod sees one (b, h, q_idx, kv_idx) at a time, through vmap."""
    fn = score_mod
    for axis in (4, 3, 2, 1):  # kv_idx innermost, b outermost; the score is batched at every level
        fn = torch.vmap(fn, in_dims=(0, *(0 if i == axis else None for i in range(1, 5))))
    return fn(scores, *(torch.arange(n) for n in scores.shape))


def _flex_semantics_attention(q, k, v, mask_mod, score_mod):
    B, H, Lq, D = q.shape
    Lkv = k.shape[2]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / D**0.5
    if score_mod is not None:
        scores = _vmap_scores(score_mod, scores).to(torch.float64)
    if mask_mod is not None:
        scores = scores.masked_fill(~create_mask(mask_mod, B, H, Lq, Lkv, device="cpu"), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)).masked_fill(torch.isinf(lse), 0.0)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference(case):
    """maskc.testing's dense mask and float64 attention agree with FlexAttention's semantics."""
    mask_mod, score_mod = mods(case)
    if mask_mod is not None:
        want = create_mask(mask_mod, 2, HEADS, case.q_len, case.kv_len, device="cpu")
        got = dense_mask(mask_mod, case.q_len, case.kv_len, 2, HEADS)
        assert torch.equal(got, want), (f"maskc.testing.dense_mask differs from FlexAttention's create_mask at "
                                        f"{(got != want).nonzero()[:5].tolist()}")
    q, k, v, _ = (t.double() for t in _inputs(case))
    want = _flex_semantics_attention(q, k, v, mask_mod, score_mod)
    got, _ = attention_reference(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# -- what maskc may refuse, and how ---------------------------------------------------------------
@pytest.mark.parametrize("case_id", sorted(REFUSED))
def test_refused(case_id):
    with torch.random.fork_rng():
        torch.manual_seed(zlib.crc32(case_id.encode()))
        kind, fn = REFUSED[case_id]()
    trace = maskc.mask_mod if kind == "mask_mod" else maskc.score_mod
    with pytest.raises(maskc.MaskTraceError) as info:
        trace(fn)
    message = str(info.value)
    lines, first = inspect.getsourcelines(fn)
    where = re.search(rf"{re.escape(os.path.basename(inspect.getsourcefile(fn)))}:(\d+)", message)
    assert message.startswith(f"{kind} '{fn.__name__}' "), message
    assert where and first <= int(where.group(1)) < first + len(lines), (
        f"the message should name the line in {fn.__name__} (lines {first}-{first + len(lines) - 1}): {message}")
    fix = message[where.end():].split("; ", 1)
    assert len(fix) == 2 and len(fix[1].split()) >= 3, f"the message should end with the fix: {message}"
    q, k, v, _ = _inputs(Case(case_id, None, B=2))
    with pytest.raises(maskc.MaskTraceError):
        maskc.compiled_attention(q, k, v, **{kind: fn})


def test_captured_tensor_requiring_grad_gets_its_gradient():
    """test_head_bias_req_grad's bias (float16, one per head) requires grad: maskc's backward
    gives its gradient, as float64 autograd through the reference does."""
    head_bias = fx.from_test_head_bias_req_grad(requires_grad=True)
    bias = dict(zip(head_bias.__code__.co_freevars, (c.cell_contents for c in head_bias.__closure__)))["bias_flex"]
    q, k, v, do = _inputs(Case("req_grad", None))
    q.requires_grad_()
    out = maskc.compiled_attention(q, k, v, score_mod=head_bias)
    got_q, got_bias = torch.autograd.grad(out, (q, bias), do)
    exact = bias.detach().double().requires_grad_()
    q64 = q.detach().double().requires_grad_()
    ref, _ = attention_reference(q64, k.double(), v.double(), score_mod=lambda s, b, h, qi, kv: s + exact[h])
    want_q, want_bias = torch.autograd.grad(ref, (q64, exact), do.double())
    assert got_bias.dtype == bias.dtype
    _close(got_q, want_q, "dq")
    _close(got_bias.float(), want_bias, "d bias")


# -- closures rebound between calls, as the Flex tests do --------------------------------------------
def test_closure_flag_flipped_between_calls():
    """test_recompile_changed_score_mod: ADD flips after the first run of the same function."""
    score_mod_scale, set_add = fx.from_test_recompile_changed_score_mod()
    q, k, v, _ = _inputs(Case("flip", None))
    for add in (True, False):  # qk + 1 shifts the lse by one; qk * 1 does not
        set_add(add)
        out, lse = maskc.compiled_attention(q, k, v, score_mod=score_mod_scale, return_lse=True)
        ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), score_mod=score_mod_scale)
        _close(out, ref, f"output with ADD={add}")
        _close(lse, ref_lse, f"lse with ADD={add}")


def test_closure_tensor_rebound_between_calls():
    """TestBlockMask.test_block_mask_attributes: offset is rebound from zeros to arange(8) under the
    same causal_mask; the block map and the kernel must follow."""
    causal_mask, rebind_offset = fx.from_test_block_mask_attributes()
    q, k, v, _ = _inputs(Case("rebind", None, B=2))
    for step in ("zeros", "arange"):
        if step == "arange":
            rebind_offset()
        assert_block_map_exact(causal_mask, Q_LEN, KV_LEN, (16, 16), B=2, H=HEADS)
        out = maskc.compiled_attention(q, k, v, mask_mod=causal_mask)
        ref, _ = attention_reference(q.double(), k.double(), v.double(), mask_mod=causal_mask)
        _close(out, ref, f"output with offset {step}")


# -- coverage of the package ------------------------------------------------------------------
def test_every_attn_gym_mod_is_covered():
    ids = {c.id for c in CASES} | set(REFUSED)
    exported = {name for module in (attn_gym.masks, attn_gym.mods) for name in dir(module)
                if not name.startswith("_") and callable(getattr(module, name))}
    unknown = exported - GYM_NOT_MODS - set(GYM_COVERAGE)
    assert not unknown, f"attn_gym ships mods this file does not run: {sorted(unknown)}; add cases for them"
    missing = {name: case_id for name, case_id in GYM_COVERAGE.items() if case_id not in ids}
    assert not missing, f"coverage names cases that do not exist: {missing}"
