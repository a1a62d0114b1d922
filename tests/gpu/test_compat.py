"""Mods we did not write, compiled on CUDA, forward and backward against the float64 reference.

- every case of tests/test_compat.py (attention-gym's masks and mods as the package ships them,
  FlexAttention's own test mods from tests/compat_mods.py) at float32 and bfloat16, at the CPU
  tests' lengths (40 queries, 56 keys: the Triton-language kernels);
- FlexAttention's test mods through the Gluon kernels (MASKC_GLUON=always; they need at least 64
  queries and 128 keys): each case at GLUON_SCALE times its lengths, with compat_mods' S scaled
  alike before the mods are built, bfloat16, D=64 (the dK/dV kernel computing dQ); the reference
  runs on the CPU, on a second build of the mods there;
- attention-gym's mods through the Gluon kernels, each builder given a few hundred tokens
  (document lengths summing to the key length, canvases whose cells are the keys), at D=64 and 128;
- the projects' mods (tests/test_compat_projects.py: torchtitan, torchtune, vLLM, Lingua, gpt-fast)
  and transformers' own (tests/test_compat_transformers_masks.py) at their test lengths.

Compiled code can differ from the interpreter's (integer widths, library functions such as erf,
constexpr folding). The cases are built on the CPU, as the CPU tests build them; their captured
tensors move to the GPU for the test only (`to_cuda`). tests/test_compat.py imports attn_gym,
which the GPU machine lacks: copy it into the ignored .site/ (pip install --no-deps --target .site
attn-gym) and run with PYTHONPATH=$PWD/.site. The lane runs a fixed sample of each list; `-m slow`
runs the rest (hours on an H100).
"""
from __future__ import annotations

import dataclasses
import functools
import zlib

import pytest
import torch

pytest.importorskip("attn_gym", reason="tests/test_compat.py imports attn_gym: copy it into .site/ and run with "
                                       "PYTHONPATH=$PWD/.site (tests/gpu/test_compat.py's docstring)")

import attn_gym.masks as M  # noqa: E402
import attn_gym.masks.vsa as vsa  # noqa: E402
import attn_gym.mods as MOD  # noqa: E402
import test_compat as compat  # noqa: E402
import test_compat_projects as projects  # noqa: E402
from attn_gym.masks.document_mask import length_to_offsets  # noqa: E402
from torch.nn.attention.flex_attention import noop_mask  # noqa: E402

import maskc  # noqa: E402
from maskc.runtime import plan as plans  # noqa: E402
from maskc.testing import attention_reference  # noqa: E402

from ._common import check_gluon, lane_sample, ran  # noqa: E402

try:
    import test_compat_transformers_masks as hf
except pytest.skip.Exception:  # no transformers: its cases are left out
    hf = None

# bf16 keeps 8 bits of mantissa: its inputs are rounded before both computations, so the
# remaining difference is the kernel's bf16 P·V product and output rounding.
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
GLUON_SCALE = 8  # 40 × 56 queries and keys become 320 × 448 (ragged against 128-key tiles)


def to_cuda(fn, monkeypatch, seen=None):
    """`fn` with every tensor it captures (closure cells, globals, partial arguments, through the
    functions it captures) on the GPU: cells, globals and attributes are set through `monkeypatch`,
    so that the CPU tests find them as they were; a partial is rebuilt."""
    seen = set() if seen is None else seen
    if fn is None or id(fn) in seen:
        return fn
    seen.add(id(fn))
    fn = getattr(fn, "fn", fn)
    if isinstance(fn, functools.partial):  # a new partial: its arguments cannot be replaced in place
        return functools.partial(to_cuda(fn.func, monkeypatch, seen), *(_moved(a, monkeypatch, seen) for a in fn.args),
                                 **{k: _moved(a, monkeypatch, seen) for k, a in fn.keywords.items()})
    code = getattr(fn, "__code__", None)
    if code is None:
        return fn
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        monkeypatch.setattr(cell, "cell_contents", _moved(value, monkeypatch, seen))
    for global_name in code.co_names:
        if global_name in fn.__globals__:
            monkeypatch.setitem(fn.__globals__, global_name, _moved(fn.__globals__[global_name], monkeypatch, seen))
    return fn


def _moved(value, monkeypatch, seen):
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, monkeypatch, seen) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and id(value) not in seen:
        seen.add(id(value))  # an object the mod reads attributes of (vLLM's metadata): its tensors
        for attribute, held in vars(value).items():
            if isinstance(held, torch.Tensor):
                monkeypatch.setattr(value, attribute, held.cuda())
        return value
    if callable(value) and not isinstance(value, type):
        to_cuda(value, monkeypatch, seen)
    return value


def _error(got, want) -> float:
    """Largest error relative to the largest magnitude (at least 1); NaN counts as infinite."""
    got, want = got.detach().double(), want.detach().double()
    if not want.numel():
        return 0.0
    if torch.isnan(got).any():
        return float("inf")
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1.0)


def assert_agrees(got, want, dtype) -> None:
    """out, lse, dq, dk and dv within the dtype's TOLERANCE of the reference's, -inf on the same rows."""
    (out, lse, *grads), (ref, ref_lse, *ref_grads) = got, want
    errors = {"out": _error(out, ref)}
    errors.update({n: _error(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    finite = ~torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite), "lse is -inf on other rows than the reference's"
    errors["lse"] = _error(lse[finite], ref_lse[finite])
    off = {n: e for n, e in errors.items() if e > TOLERANCE[dtype]}
    assert not off, ", ".join(f"{n} off by {e:.1e}" for n, e in off.items()) + f" (tolerance {TOLERANCE[dtype]:.0e})"


def _built(case):
    """A fresh build of the case's (mask_mod, score_mod), with its own seed (not the CPU tests'
    cache of built mods, whose tensors stay on the CPU)."""
    with torch.random.fork_rng():
        torch.manual_seed(zlib.crc32(case.id.encode()))
        return case.build()


def run_mods(mask_mod, score_mod, B, q_len, kv_len, dtype, monkeypatch, reference_score=None) -> None:
    """The mods compiled on CUDA against the float64 reference (which takes `reference_score` for
    the score_mod where given)."""
    mask_mod, score_mod, reference_score = (to_cuda(m, monkeypatch) for m in (mask_mod, score_mod, reference_score))
    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (B, compat.HEADS, q_len, 64), (B, compat.HEADS, kv_len, 64)
    q, k, v = (torch.randn(s, generator=g, device="cuda").to(dtype).requires_grad_()
               for s in (shape_q, shape_kv, shape_kv))
    do = torch.randn(shape_q, generator=g, device="cuda").to(dtype)
    try:
        out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, return_lse=True)
    except maskc.MaskTraceError as e:
        pytest.skip(f"refused by the tracer: {str(e)[:200]}")
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, mask_mod=mask_mod, score_mod=reference_score or score_mod)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    assert_agrees((out, lse, *grads), (ref, ref_lse, *ref_grads), dtype)


# the lane: every twenty-fourth case, in float32 and bfloat16 by turns
COMPILED = lane_sample([(c, d) for c in compat.CASES for d in TOLERANCE], lambda i, v: i % 48 in (0, 25),
                       ids=lambda v: f"{v[0].id}-{str(v[1])[6:]}")


@pytest.mark.parametrize("case, dtype", COMPILED)
def test_compiled(case, dtype, monkeypatch):
    run_mods(*_built(case), case.B, case.q_len, case.kv_len, dtype, monkeypatch)


@pytest.mark.parametrize("case", lane_sample(compat.FLEX_CASES, lambda i, v: i % 24 == 0, ids=lambda c: c.id))
def test_gluon_flex_mods(case, gluon_kernels, monkeypatch):
    monkeypatch.setattr(compat.fx, "S", compat.fx.S * GLUON_SCALE)  # the mods read it when they are built
    monkeypatch.setattr(compat.fx, "seq_length", compat.fx.S)  # a copy of S that the learnable-bias mods read
    Lq, Lkv = case.q_len * GLUON_SCALE, case.kv_len * GLUON_SCALE
    g = torch.Generator().manual_seed(0)
    # values bf16 can hold: a mod that compares scores with a threshold (padded_dense_causal) sees
    # the kernel's scores on the reference's side of it
    q64, k64, v64 = (torch.randn(case.B, compat.HEADS, n, 64, generator=g).to(torch.bfloat16).double()
                     .requires_grad_() for n in (Lq, Lkv, Lkv))
    do = torch.randn(case.B, compat.HEADS, Lq, 64, generator=g, dtype=torch.float64)
    mask_mod, score_mod = _built(case)
    try:
        ref, ref_lse = attention_reference(q64, k64, v64, mask_mod=mask_mod, score_mod=score_mod)
    except (IndexError, RuntimeError) as e:
        pytest.skip(f"the reference cannot run the mod at {GLUON_SCALE}x its lengths (its captured sizes do not "
                    f"follow S): {type(e).__name__}: {str(e)[:120]}")
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do)
    mask_mod, score_mod = (to_cuda(m, monkeypatch) for m in _built(case))
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in (q64, k64, v64))
    plans.PLANS.clear()
    try:
        out, lse = maskc.compiled_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, return_lse=True)
    except maskc.MaskTraceError as e:
        pytest.skip(f"refused by the tracer: {str(e)[:200]}")
    grads = torch.autograd.grad(out, (q, k, v), do.to("cuda", torch.bfloat16))
    assert ran("hfwd"), "the Gluon forward did not run"
    # dQ from the dK/dV kernel unless a captured tensor needs a gradient (hopper.computes_dq)
    assert ran("hbwd") or ran("hbwd+dq"), "the Gluon dK/dV kernel did not run"
    assert_agrees([t.cpu() for t in (out, lse, *grads)], (ref, ref_lse, *ref_grads), torch.bfloat16)


# -- attention-gym's mods at the Gluon kernels' lengths ---------------------------------------------
H = 2


def _graphormer_spatial(N):
    adjacency, _ = compat._graph(2, N)  # test_compat's graph, at N nodes
    distances = MOD.shortest_path_distances(adjacency, max_distance=4).cuda()
    return MOD.generate_graphormer_spatial_bias(torch.randn(H, 6, device="cuda"), distances)


def _graphormer_edge(N):
    adjacency, edge_types = compat._graph(2, N)
    path_edge_types, path_lengths = MOD.shortest_path_edge_types(adjacency, edge_types, max_path_len=2)
    return MOD.generate_graphormer_edge_bias(torch.randn(H, 2, 3, device="cuda"), path_edge_types.cuda(),
                                             path_lengths.cuda())


def _global_sliding(N):
    is_global = torch.zeros(N, dtype=torch.bool, device="cuda")
    is_global[[0, 130, 257]] = True
    return M.generate_global_sliding_window(40, is_global)


def _jetspec_tree(Lq, Lkv):
    parents = [-1] + [(i - 1) // 2 for i in range(1, Lq)]  # a binary tree
    return M.generate_jetspec_tree_causal_mask_mod(Lkv - Lq, M.build_tree_ancestor_matrix(parents, "cuda"))


def _offsets(*lengths):
    return length_to_offsets(list(lengths), "cuda")


# (id, B, Lq, Lkv, build -> (mask_mod, score_mod)); 384 keys fill three tiles, 448 do not
GYM_CASES = [
    ("causal_mask", 1, 384, 384, lambda: (M.causal_mask, None)),
    ("sliding_window", 1, 448, 448, lambda: (M.generate_sliding_window(100), None)),
    ("prefix_lm", 1, 448, 448, lambda: (M.generate_prefix_lm_mask(130), None)),
    ("doc_mask-causal", 1, 384, 384,
     lambda: (M.generate_doc_mask_mod(M.causal_mask, _offsets(70, 150, 60, 104)), None)),
    ("doc_mask-noop", 1, 448, 448, lambda: (M.generate_doc_mask_mod(noop_mask, _offsets(200, 8, 140, 100)), None)),
    ("packed_causal_doc_mask", 1, 384, 384,
     lambda: (M.generate_packed_causal_doc_mask_mod(_offsets(70, 150, 60, 104)), None)),
    ("dilated_sliding_window", 1, 448, 448, lambda: (M.generate_dilated_sliding_window(96, 3), None)),
    ("natten", 1, 384, 384, lambda: (M.generate_natten(canvas_w=16, canvas_h=24, kernel_w=5, kernel_h=5), None)),
    ("tiled_natten", 1, 256, 256, lambda: (M.generate_tiled_natten(W=16, H=16, K_W=5, K_H=5, T_W=4, T_H=4), None)),
    ("morton_natten", 1, 256, 256,
     lambda: (M.generate_morton_natten(canvas_w=16, canvas_h=16, kernel_w=5, kernel_h=5), None)),
    ("sta_2d", 1, 448, 448, lambda: (M.generate_sta_mask_mod_2d((16, 24), (8, 8), (4, 4), text_seq_len=64), None)),
    ("sta_3d", 1, 448, 448,
     lambda: (M.generate_sta_mask_mod_3d((4, 8, 12), (2, 4, 8), (2, 4, 4), text_seq_len=64), None)),
    ("svg_spatial_head", 1, 384, 384,
     lambda: (M.generate_spatial_head_mask_mod(64, 5, 64, width=1, round_width=32), None)),
    ("svg_spatial_head-attn_sink", 1, 384, 384,
     lambda: (M.generate_spatial_head_mask_mod(64, 5, 64, width=1, attn_sink=True, round_width=32), None)),
    ("svg_temporal_head", 1, 384, 384, lambda: (M.generate_temporal_head_mask_mod(64, 5, 64, width=2), None)),
    ("flamingo_vision_cross_attention", 1, 256, 384, lambda: (M.generate_vision_cross_attention_mask_mod(
        torch.tensor([[0, 80], [60, 170], [150, 256], [200, 256]], device="cuda"), image_token_length=96), None)),
    ("global_sliding_window", 1, 384, 384, lambda: (_global_sliding(384), None)),
    ("shared_prefix", 1, 448, 448, lambda: (M.generate_shared_prefix_mask_mod(
        _offsets(100, 60, 90, 120, 78), torch.tensor([0, 0, 0, 3, 3], dtype=torch.int32, device="cuda")), None)),
    ("block_diffusion", 1, 384, 384, lambda: (M.generate_block_diffusion_mask(192, 40), None)),
    ("jetspec_tree_causal", 1, 128, 448, lambda: (_jetspec_tree(128, 448), None)),
    ("jetspec_training", 1, 128, 384, lambda: (M.generate_jetspec_training_mask_mod(256, 32), None)),
    ("batchify-causal", 1, 384, 384, lambda: (M.batchify_mask_mod(M.causal_mask, 96), None)),
    ("vsa_padding", 1, 384, 384, lambda: (vsa.generate_vsa_padding_mask_mod(
        torch.tensor([64, 40, 64, 17, 64, 50], device="cuda"), 64), None)),
    ("alibi", 1, 448, 448, lambda: (None, MOD.generate_alibi_bias(H))),
    ("tanh_softcap", 1, 384, 384, lambda: (None, MOD.generate_tanh_softcap(2))),
    ("activation-gelu", 1, 384, 384, lambda: (None, MOD.generate_activation_score_mod())),
    ("sandwich", 1, 448, 448, lambda: (None, MOD.generate_sandwich_bias(H, 448, d_bar=16))),
    ("graphormer_spatial", 2, 384, 384, lambda: (None, _graphormer_spatial(384))),
    ("graphormer_edge", 2, 256, 256, lambda: (None, _graphormer_edge(256))),
    ("causal+alibi", 1, 384, 384, lambda: (M.causal_mask, MOD.generate_alibi_bias(H))),
    ("sliding_window+tanh_softcap", 1, 448, 448,
     lambda: (M.generate_sliding_window(100), MOD.generate_tanh_softcap(2))),
]


# the lane: every sixteenth case, at D=64 and 128 by turns
@pytest.mark.parametrize("case, D", lane_sample([(c, D) for c in GYM_CASES for D in (64, 128)],
                                                lambda i, v: i % 32 in (0, 17), ids=lambda v: f"{v[0][0]}-D{v[1]}"))
def test_gluon_gym_mods(case, D, gluon_kernels, monkeypatch):
    _, B, Lq, Lkv, build = case
    # tensors a builder made on the CPU (sandwich's table) go beside q, as a user's would
    mask, score = (to_cuda(m, monkeypatch) for m in build())
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H, Lkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check_gluon(q, k, v, mask, score)


# -- the projects' and transformers' mods -------------------------------------------------------------
def _project_runs():
    """(id, runner of (dtype, monkeypatch)) of every project and transformers case."""
    runs = [(c.id, functools.partial(lambda c, dtype, mp: run_mods(c.build(), None, c.B, c.q_len, c.kv_len, dtype, mp),
                                     c))
            for c in projects.MASKS]
    if hf is None:
        return runs

    def run_hf(c, dtype, mp):
        b = c.build()
        reference = hf._as_the_kernels_read(b.score_mod) if c.padded_rows else None
        run_mods(b.mask_mod, b.score_mod, hf.BATCH, b.q_len, b.kv_len, dtype, mp, reference)
    return runs + [(c.id, functools.partial(run_hf, c)) for c in hf.CASES]


# the lane: every twentieth case, in float32 and bfloat16 by turns
@pytest.mark.parametrize("run, dtype", lane_sample([(r, d) for r in _project_runs() for d in TOLERANCE],
                                                   lambda i, v: i % 40 in (0, 21),
                                                   ids=lambda v: f"{v[0][0]}-{str(v[1])[6:]}"))
def test_projects(run, dtype, monkeypatch):
    run[1](dtype, monkeypatch)
