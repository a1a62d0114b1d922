"""Compatibility: FlexAttention code from training and serving projects, run unchanged on maskc.

The mods and hand-made BlockMasks of tests/compat_projects.py (torchtitan, torchtune, vLLM's
flex backend, modded-nanogpt, gpt-fast, Meta Lingua; sources and commits in its docstring) go
through `maskc.mask_mod`, dense evaluation against torch's `create_mask`, `maskc.block_map`
(exact against dense evaluation at lengths that are not multiples of the tile), and
`maskc.compiled_attention` forward and backward against `maskc.testing.attention_reference` in
float64; then the way each project calls FlexAttention (its BlockMask, its scale, its
torch.compile) through `maskc.flex_attention`. A hand-made BlockMask means what FlexAttention's
compiled kernels read from it: listed tiles only, FULL ones without the mask_mod
(`_as_kernels_read`).

Everything runs through Triton's interpreter on the CPU: tiny shapes, float32. Failures of maskc
are marked xfail(strict=True) with the reason; /tmp/compat_proj/REPORT.md has their repros.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_mask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import compat_projects as cp
import maskc
from _inputs import qkv
from maskc.testing import assert_block_map_exact, attention_reference, dense_mask
from test_compat import _close  # the compatibility tests' elementwise check, at their TOL

HEADS, DIM = 2, 16
EOS = 99


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKC_CACHE_DIR", str(tmp_path_factory.mktemp("maskc_cache")))
        yield


def _qkv(B, q_len, kv_len, grad=False):
    """q, k, v and the output's gradient, of this file's heads and head dim."""
    return qkv(B, HEADS, Lq=q_len, Lkv=kv_len, D=DIM, requires_grad=grad, grad_out=True)


def _as_kernels_read(block_mask, q_len, kv_len, heads=HEADS):
    """bool [B, heads, q_len, kv_len]: what FlexAttention's compiled kernels keep of a BlockMask —
    the tiles it lists, FULL ones whole, partial ones where the mask_mod keeps the pair."""
    B, H = block_mask.kv_num_blocks.shape[:2]
    bq, bk = block_mask.BLOCK_SIZE
    mod = dense_mask(block_mask.mask_mod, q_len, kv_len, B, H)
    keep = torch.zeros(B, H, q_len, kv_len, dtype=torch.bool)
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, False)]
    if block_mask.full_kv_num_blocks is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True))
    for num, idx, full in lists:
        for b in range(B):
            for h in range(H):
                for i in range(num.shape[2]):
                    for j in range(int(num[b, h, i])):
                        rows, cols = slice(i * bq, (i + 1) * bq), slice(int(idx[b, h, i, j]) * bk, None)
                        cols = slice(cols.start, cols.start + bk)
                        keep[b, h, rows, cols] |= True if full else mod[b, h, rows, cols]
    return keep.expand(B, heads, q_len, kv_len).contiguous()


def _reads(keep):
    return lambda b, h, q_idx, kv_idx: keep[b, h, q_idx, kv_idx]


# -- the mask mods, stage by stage ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    build: Callable  # -> mask_mod
    B: int = 1
    q_len: int = 56
    kv_len: int = 56


def _tokens():
    tokens = torch.randint(0, 50, (2, 56), generator=torch.Generator().manual_seed(3))
    tokens[0, [5, 20, 33]] = EOS
    tokens[1, [11, 40, 55]] = EOS
    return tokens


def _vllm(**kw):
    """vLLM's metadata for two requests in a paged cache of 8 blocks of 16 tokens, as
    FlexAttentionMetadataBuilder.build makes it: request 0 has 37 tokens, 32 computed and 5 new
    (chunked prefill); request 1 has 20, all new. Block tables hold garbage past the used blocks."""
    seq_lens = torch.tensor([37, 20], dtype=torch.int32)
    query_start_loc_cpu = torch.tensor([0, 5, 25], dtype=torch.int32)
    block_table = torch.tensor([[3, 5, 1, 7, 6], [7, 2, 4, 4, 4]], dtype=torch.int32)
    return cp.FlexAttentionMetadata(
        num_actual_tokens=25, max_seq_len=37, query_start_loc=query_start_loc_cpu.clone(),
        query_start_loc_cpu=query_start_loc_cpu, seq_lens=seq_lens, block_table=block_table,
        total_cache_tokens=8 * 16, block_size=16,
        physical_to_logical=cp.physical_to_logical_mapping(block_table, seq_lens, 16, 8),
        decode_offset=torch.tensor([32, 0], dtype=torch.int32),
        persistent_kv_indices=torch.empty(8, 16 * 5, dtype=torch.int32),
        persistent_kv_num_blocks=torch.empty(8, dtype=torch.int32),
        persistent_doc_ids=torch.empty(64, dtype=torch.int32), **kw)


def _vllm_meaning(md):
    """bool [25, 128], written independently of vLLM's code: the query at logical position p of
    request r sees the physical slot of each logical key kv < seq_lens[r] with kv <= p (and
    |p - kv| < sliding_window)."""
    keep = torch.zeros(md.num_actual_tokens, md.total_cache_tokens, dtype=torch.bool)
    starts = md.query_start_loc_cpu.tolist()
    for r in range(len(starts) - 1):
        for t in range(starts[r], starts[r + 1]):
            p = t - starts[r] + int(md.decode_offset[r])
            for kv in range(int(md.seq_lens[r])):
                if kv <= p and (md.sliding_window is None or abs(p - kv) < md.sliding_window):
                    keep[t, int(md.block_table[r, kv // md.block_size]) * md.block_size + kv % md.block_size] = True
    return keep


def _vllm_user_score_mod(score, b, h, q_idx, kv_idx, physical_q=None):
    """A user score_mod of the signature vLLM's transformed_score_mod calls (physical_q keyword)."""
    return score - 0.1 * (q_idx - kv_idx) + 0.01 * physical_q


MASKS = [
    Case("torchtitan-causal", lambda: cp.get_causal_mask_mod()),
    Case("torchtitan-document", lambda: cp.get_document_mask_mod(_tokens(), EOS), B=2),
    Case("torchtitan-fixed_block", lambda: cp.get_fixed_block_mask_mod(12)),
    Case("torchtitan-sliding_window", lambda: cp.get_sliding_window_mask_mod(9)),
    Case("torchtitan-llama4-rope", lambda: and_masks(cp.get_causal_mask_mod(), cp.get_document_mask_mod(_tokens(), EOS),
                                                      cp.get_fixed_block_mask_mod(12)), B=2),
    Case("torchtitan-gpt_oss-sliding", lambda: and_masks(cp.get_document_mask_mod(_tokens(), EOS),
                                                          cp.get_sliding_window_mask_mod(9)), B=2),
    Case("torchtune-packed_block_causal", lambda: cp.packed_block_causal_mask(
        [torch.tensor([10, 20, 26]), torch.tensor([30, 5, 21])]).mask_mod, B=2),
    Case("lingua-doc_mask_mod", lambda: cp.generate_doc_mask_mod(cp.lingua_causal_mask, torch.tensor([7, 20, 12, 10]))),
    Case("lingua-doc_mask_mod-kv_lengths", lambda: cp.generate_doc_mask_mod(
        cp.lingua_causal_mask, torch.tensor([7, 20, 13]), torch.tensor([10, 25, 21])), q_len=40),
    Case("vllm-paged-causal", lambda: _vllm().mask_mod, q_len=25, kv_len=128),
    Case("vllm-paged-sliding_window", lambda: _vllm(sliding_window=6).mask_mod, q_len=25, kv_len=128),
    Case("vllm-paged-prefix_lm", lambda: _vllm(mm_prefix_range={0: [(30, 34)], 1: [(2, 9)]}).mask_mod,
         q_len=25, kv_len=128),
    Case("vllm-encoder-bidirectional-sliding", lambda: _vllm(uses_paged_kv=False, sliding_window=5).mask_mod,
         q_len=25, kv_len=25),
    Case("gpt-fast-offset_causal", lambda: cp.get_mask_mod(cp.causal_mask, torch.tensor([13])[0]), q_len=40),
]


@pytest.mark.parametrize("case", MASKS, ids=lambda c: c.id)
def test_mask(case):
    mask_mod = case.build()
    assert isinstance(maskc.mask_mod(mask_mod), maskc.MaskMod)
    want = create_mask(mask_mod, case.B, HEADS, case.q_len, case.kv_len, device="cpu")
    got = dense_mask(mask_mod, case.q_len, case.kv_len, case.B, HEADS)
    assert torch.equal(got, want), f"dense_mask differs from create_mask at {(got != want).nonzero()[:5].tolist()}"
    for block_size in ((16, 16), (32, 8)):
        assert_block_map_exact(mask_mod, case.q_len, case.kv_len, block_size, B=case.B, H=HEADS)
    q, k, v, do = _qkv(case.B, case.q_len, case.kv_len, grad=True)
    out = maskc.compiled_attention(q, k, v, mask_mod=mask_mod)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, mask_mod=mask_mod)
    _close(out, ref, "output")
    for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q64, k64, v64), do.double())):
        _close(g, r, name)
    block_mask = maskc.create_block_mask(mask_mod, case.B, None, case.q_len, case.kv_len, device="cpu", BLOCK_SIZE=16)
    _close(maskc.flex_attention(q, k, v, block_mask=block_mask), ref, "flex_attention output")


@pytest.mark.parametrize("sliding_window", [None, 6], ids=["causal", "sliding"])
def test_vllm_mask_means_what_vllm_says(sliding_window):
    md = _vllm(sliding_window=sliding_window)
    assert torch.equal(create_mask(md.mask_mod, 1, 1, 25, 128, device="cpu")[0, 0], _vllm_meaning(md))


# -- the projects' BlockMasks and calls -------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False], ids=["from_kv_blocks", "create_block_mask"])
@pytest.mark.parametrize("sliding_window", [None, 6], ids=["causal", "sliding"])
def test_vllm_forward(direct, sliding_window):
    """FlexAttentionImpl.forward's call: packed queries against the whole paged cache, the
    transformed score_mod, the direct (from_kv_blocks, compute_q_blocks=False) or compiled
    create_block_mask BlockMask."""
    md = _vllm(sliding_window=sliding_window, score_mod=_vllm_user_score_mod)
    block_mask = md._build_block_mask_direct() if direct else md.build_block_mask()
    q, k, v, _ = _qkv(1, 25, 128)
    out = maskc.flex_attention(q, k, v, md.transformed_score_mod, block_mask, 0.25, enable_gqa=False)
    keep = _as_kernels_read(block_mask, 25, 128)
    assert torch.equal(keep[0, 0], _vllm_meaning(md)), "vLLM's BlockMask lists fewer tiles than its mask keeps"
    ref, _ = attention_reference(q, k, v, mask_mod=_reads(keep), score_mod=md.transformed_score_mod, scale=0.25)
    _close(out, ref, "output")


def test_vllm_window_rebound_on_the_metadata():
    """FlexAttentionImpl.forward sets attn_metadata.sliding_window per layer; the mask_mod made
    before reads self.sliding_window when called, so the same function means another mask."""
    md = _vllm(sliding_window=6)
    mask_mod = md.mask_mod
    q, k, v, _ = _qkv(1, 25, 128)
    for window in (6, 3):
        md.sliding_window = window
        assert torch.equal(dense_mask(mask_mod, 25, 128)[0, 0], _vllm_meaning(md))
        ours = maskc.create_block_mask(mask_mod, None, None, 25, 128, device="cpu", BLOCK_SIZE=16)
        theirs = torch_create_block_mask(mask_mod, None, None, 25, 128, device="cpu", BLOCK_SIZE=16)
        assert torch.equal(ours.to_dense(), theirs.to_dense()), f"tiles with window {window}"
        out = maskc.compiled_attention(q, k, v, mask_mod=mask_mod, scale=0.25)
        ref, _ = attention_reference(q, k, v, mask_mod=mask_mod, scale=0.25)
        _close(out, ref, f"output with window {window}")


def _nanogpt_tokens(L):
    seq = torch.randint(0, 50000, (L,), generator=torch.Generator().manual_seed(1))
    seq[[0, 90, 300]] = 50256  # documents spanning several blocks of 128
    return seq


def _nanogpt_check(block_mask, L, backward):
    q, k, v, do = _qkv(1, L, L, grad=backward)
    out = maskc.flex_attention(q, k, v, block_mask=block_mask, scale=0.12)
    keep = _as_kernels_read(block_mask, L, L)
    assert not torch.equal(keep, dense_mask(block_mask.mask_mod, L, L, 1, HEADS)), "the window should cut the mask"
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, mask_mod=_reads(keep), scale=0.12)
    _close(out, ref, "output")
    if backward:
        grads = torch.autograd.grad(out, (q, k, v), do)
        for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q64, k64, v64), do.double())):
            _close(g, r, name)


# BLOCK_SIZE stays 128, as the script has it; 512 tokens give four blocks.
def test_modded_nanogpt_create_blockmasks_long_and_short_windows():
    seq = _nanogpt_tokens(512)
    long_bm, short_bm = cp.create_blockmasks(None, seq, torch.tensor(2, dtype=torch.int32))
    _nanogpt_check(long_bm, 512, backward=True)
    _nanogpt_check(short_bm, 512, backward=False)


def test_modded_nanogpt_create_doc_swc_block_mask():
    _nanogpt_check(cp.from_forward_45544f53(_nanogpt_tokens(384), torch.tensor(1, dtype=torch.int32)), 384,
                   backward=True)


def test_gpt_fast_prefill():
    mask = cp.from_prefill(torch.arange(0, 40), 256)
    q, k, v, _ = _qkv(1, 40, 256)
    ref, _ = attention_reference(q, k, v, mask_mod=mask.mask_mod)
    _close(maskc.flex_attention(q, k, v, block_mask=mask), ref, "output")


@pytest.mark.parametrize("maker", ["maskc", "torch"])
@pytest.mark.parametrize("pos", [77, 200])
def test_gpt_fast_decode_step(maker, pos):
    """decode_one_token slices the (256, 256) BlockMask to one row of q blocks and wraps its
    mask_mod with input_pos[0]; torch 2.13 then wants seq_lengths set to the decode's lengths."""
    make = cp.from_decode_n_tokens if maker == "maskc" else (
        lambda n: torch_create_block_mask(cp.causal_mask, 1, 1, n, n, device="cpu"))
    mask = cp.from_decode_one_token(torch.tensor([pos]), make(256))
    q, k, v, _ = _qkv(1, 1, 256)
    for flex in (torch_flex_attention, maskc.flex_attention):  # as written (torch 2.5), both refuse
        with pytest.raises(ValueError):
            flex(q, k, v, block_mask=mask)
    mask.seq_lengths = (1, 256)
    ref, _ = attention_reference(q, k, v, mask_mod=mask.mask_mod)
    assert int(dense_mask(mask.mask_mod, 1, 256).sum()) == pos + 1
    _close(torch_flex_attention(q.double(), k.double(), v.double(), block_mask=mask), ref, "torch output")
    _close(maskc.flex_attention(q, k, v, block_mask=mask), ref, "output")


# -- under torch.compile, as the projects compile it ---------------------------------------------
# backend="eager": Dynamo's tracing decides what follows; Inductor would only add minutes.
FULLGRAPH = ("maskc.flex_attention under torch.compile(fullgraph=True) refuses a BlockMask whose mask_mod "
             "the project made as a plain function (documented in docs/guides/torch-compile.md; torch runs it)")


def test_torchtitan_compiled_create_block_mask():
    """torchtitan: _compiled_create_block_mask = torch.compile(create_block_mask), called on
    and_masks(causal, document) by get_attention_masks; FlexAttentionWrapper compiles flex_attention."""
    mask_mod = and_masks(cp.get_causal_mask_mod(), cp.get_document_mask_mod(_tokens(), EOS))
    block_mask = torch.compile(maskc.create_block_mask, backend="eager")(mask_mod, 2, None, 56, 56)
    q, k, v, _ = _qkv(2, 56, 56)
    out = torch.compile(maskc.flex_attention, backend="eager")(q, k, v, block_mask=block_mask, scale=None,
                                                                 return_lse=False)
    _close(out, attention_reference(q, k, v, mask_mod=mask_mod)[0], "output")


def _nanogpt_forward(input_seq, q, k, v, window):
    long_bm, short_bm = cp.create_blockmasks(None, input_seq, window)
    return maskc.flex_attention(q, k, v, block_mask=long_bm, scale=0.12)


@pytest.mark.xfail(strict=True, raises=torch._dynamo.exc.Unsupported,
                   reason=FULLGRAPH + "; the mask_mod is made inside the compiled forward, so no wrapping outside "
                                      "can reach it (test_fullgraph_refusal_names_the_fix)")
def test_modded_nanogpt_compiled_fullgraph():
    """train_gpt.py: model = torch.compile(model, dynamic=False, fullgraph=True); forward calls
    create_blockmasks and flex_attention."""
    _check_nanogpt(torch.compile(_nanogpt_forward, dynamic=False, fullgraph=True, backend="eager"))


def test_modded_nanogpt_compiled():
    """The same forward compiled without fullgraph: maskc's part runs outside the graph."""
    _check_nanogpt(torch.compile(_nanogpt_forward, dynamic=False, backend="eager"))


def _check_nanogpt(forward):
    seq = _nanogpt_tokens(384)
    q, k, v, _ = _qkv(1, 384, 384)
    window = torch.tensor(2, dtype=torch.int32)
    out = forward(seq, q, k, v, window)
    keep = _as_kernels_read(cp.create_blockmasks(None, seq, window)[0], 384, 384)
    _close(out, attention_reference(q, k, v, mask_mod=_reads(keep), scale=0.12)[0], "output")


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped inside"])
def test_fullgraph_refusal_names_the_fix(wrapped):
    """A mod made inside a fullgraph region (modded-nanogpt, gpt-fast) is refused by Dynamo with
    maskc's reason, which says where to make the mod; wrapping it with maskc.mask_mod there, as
    the first refusal says, gets the second, not an internal error from tracing maskc."""
    docs = torch.tensor([0] * 20 + [1] * 44)

    def forward(q, k, v):
        def document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx])
        mask_mod = maskc.mask_mod(document_causal) if wrapped else document_causal
        block_mask = maskc.BlockMask.from_kv_blocks(torch.ones(1, 1, 1, dtype=torch.int32),
                                                    torch.zeros(1, 1, 1, 1, dtype=torch.int32), BLOCK_SIZE=128,
                                                    mask_mod=mask_mod, seq_lengths=(64, 64))
        return maskc.flex_attention(q, k, v, block_mask=block_mask)

    q, k, v, _ = _qkv(1, 64, 64)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="maskc") as refused:
        torch.compile(forward, fullgraph=True, backend="eager")(q, k, v)
    assert "outside the compiled function" in str(refused.value) and "fullgraph" in str(refused.value)


@pytest.mark.xfail(strict=True, raises=torch._dynamo.exc.Unsupported,
                   reason=FULLGRAPH + "; get_mask_mod wraps it inside the compiled step")
def test_gpt_fast_compiled_decode_fullgraph():
    """generate.py: decode_one_token = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)."""
    block_mask = cp.from_decode_n_tokens(256)

    def step(input_pos, q, k, v, block_mask):
        mask = cp.from_decode_one_token(input_pos, block_mask)
        mask.seq_lengths = (1, 256)
        return maskc.flex_attention(q, k, v, block_mask=mask)

    q, k, v, _ = _qkv(1, 1, 256)
    out = torch.compile(step, fullgraph=True, backend="eager")(torch.tensor([200]), q, k, v, block_mask)
    _close(out, attention_reference(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= 200)[0], "output")


@pytest.mark.xfail(strict=True, raises=torch._dynamo.exc.Unsupported,
                   reason=FULLGRAPH + " (vLLM: flex_attention_compiled = torch.compile(flex_attention, "
                                       "fullgraph=True)); test_vllm_compiled_fullgraph_wrapped is the fix")
def test_vllm_compiled_fullgraph():
    _check_vllm_fullgraph(_vllm(score_mod=_vllm_user_score_mod))


def test_vllm_compiled_fullgraph_wrapped():
    """The fix maskc's refusal names, applied where vLLM makes its mods (__post_init__, outside
    the compiled call): each wrapped once with maskc.mask_mod / maskc.score_mod."""
    md = _vllm(score_mod=_vllm_user_score_mod)
    md.mask_mod = maskc.mask_mod(md.mask_mod)
    md.transformed_score_mod = maskc.score_mod(md.transformed_score_mod)
    _check_vllm_fullgraph(md)


def _check_vllm_fullgraph(md):
    block_mask = md._build_block_mask_direct()
    q, k, v, _ = _qkv(1, 25, 128)
    out = torch.compile(maskc.flex_attention, fullgraph=True, backend="eager")(
        q, k, v, md.transformed_score_mod, block_mask, 0.25, enable_gqa=False)
    keep = _as_kernels_read(block_mask, 25, 128)
    _close(out, attention_reference(q, k, v, mask_mod=_reads(keep), score_mod=md.transformed_score_mod,
                                    scale=0.25)[0], "output")
