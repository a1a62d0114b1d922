"""Compatibility: Hugging Face transformers' own FlexAttention mask functions, run unchanged.

transformers describes every attention pattern as a FlexAttention-style
`mask_function(batch_idx, head_idx, q_idx, kv_idx)`: the factories of `transformers.masking_utils`
(causal, bidirectional, sliding window, chunked, blockwise, padding, packed sequences, and_masks /
or_masks, offsets), the model files' own (gemma3, gemma4, moonshine_streaming,
nemotron_asr_streaming, step3p7, t5gemma2, unlimited_ocr), and the score_mods of its FlexAttention
backend (`transformers.integrations.flex_attention`: softcap, an additive 4-d mask, a position
bias; doge's). Each is imported and built with transformers' own code, never copied:

- factories are called with small parameters;
- composed masks are what transformers hands to FlexAttention: `create_causal_mask` and its
  siblings run with `attn_implementation="flex_attention"` and the `mask_mod` they pass to
  `create_block_mask` is recorded (padding, cache offsets, packed sequences, block ids folded in);
- score_mods are recorded from `flex_attention_forward` the same way, at its call of FlexAttention.

Each case goes through `maskc.mask_mod` / `maskc.score_mod` (test_trace); masks through
`maskc.block_map`, sound and exact against dense evaluation at lengths that are not multiples of
the tile (test_block_map), and against torch's own evaluation: `create_mask` and
`create_block_mask` (test_matches_torch); and everything through `maskc.compiled_attention`
forward and backward against `maskc.testing.attention_reference` in float64 (test_attention).
Composed masks also go through maskc's transformers backend, whose mask must be the one torch
makes of what transformers hands to FlexAttention (test_maskc_backend).

`test_every_transformers_mask_function_is_covered` fails when transformers ships a mask function
(in masking_utils, the FlexAttention integration or a model file) that this file does not run.

Triton's interpreter on the CPU: tiny shapes (B = 2, H = 2, Lq = 40, Lkv = 56, D = 16), float32.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import pathlib
import re
from typing import Callable
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

import transformers.integrations.flex_attention as hf_flex  # noqa: E402  (after the importorskip)
import transformers.masking_utils as mu  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402

import maskc  # noqa: E402
from _inputs import qkv  # noqa: E402
from _lanes import every  # noqa: E402
from maskc.testing import assert_block_map_exact, dense_mask  # noqa: E402
from test_compat import _close, assert_agrees  # noqa: E402  (the compatibility tests' checks, at their TOL)

BATCH, HEADS, Q_LEN, KV_LEN, DIM = 2, 2, 40, 56, 16
BLOCK_SIZES = ((16, 16), (32, 8))


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKC_CACHE_DIR", str(tmp_path_factory.mktemp("maskc_cache")))
        yield


def _model(name: str):
    """transformers.models.<name>.modeling_<name>, or a skip where this release lacks the model."""
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError as error:
        pytest.skip(f"transformers {transformers.__version__} has no {name}: {error}")


@dataclasses.dataclass(frozen=True)
class Built:
    mask_mod: Callable | None
    score_mod: Callable | None = None
    q_len: int = Q_LEN
    kv_len: int = KV_LEN


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[], Built]
    has_mask: bool = True
    composed: Callable | None = None  # the create_*_mask call, for test_maskc_backend
    padded_rows: bool = False  # rows whose every score is dtype's min: empty in the kernels (docs/guides/masks.md)


_BUILT: dict[str, Built] = {}


def built(case) -> Built:
    if case.id not in _BUILT:
        _BUILT[case.id] = case.build()
    return _BUILT[case.id]


def mask(id, build, **kw):
    return Case(id, lambda: Built(build()), **kw)


def score(id, build, **kw):
    return Case(id, lambda: Built(None, build()), has_mask=False, **kw)


# -- captured tensors: B = 2 rows, lengths covering the keys ---------------------------------------
def _left_padding():
    return torch.tensor([0, 5])


def _block_sequence_ids(length=KV_LEN):
    """Two images in the first sequence, one in the second; text is -1."""
    ids = torch.full((BATCH, length), -1)
    ids[0, 3:11], ids[0, 20:37], ids[1, 30:50] = 0, 1, 0
    return ids


def _padding(length=KV_LEN):
    keep = torch.ones(BATCH, length, dtype=torch.bool)
    keep[0, 50:], keep[1, :9] = False, False
    return keep


def _position_ids(lengths=((20, 15, 21), (33, 23))):
    """Packed sequences: positions restart at each document."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def _packed_sequence_ids():
    return torch.tensor([[0] * 20 + [1] * 15 + [2] * 21, [0] * 33 + [1] * 23])


def _attention_mask_2d(length=KV_LEN):
    """transformers' 2-d attention_mask: the second sequence left-padded by 9 tokens."""
    mask = torch.ones(BATCH, length, dtype=torch.long)
    mask[1, :9] = 0
    return mask


# -- masking_utils' factories, called directly ------------------------------------------------------
FACTORY_CASES = [
    mask("hf-causal_mask_function", lambda: mu.causal_mask_function),
    mask("hf-bidirectional_mask_function", lambda: mu.bidirectional_mask_function),
    mask("hf-sliding_window_overlay", lambda: mu.sliding_window_overlay(10)),
    mask("hf-sliding_window_causal_mask_function", lambda: mu.sliding_window_causal_mask_function(10)),
    mask("hf-sliding_window_bidirectional_overlay", lambda: mu.sliding_window_bidirectional_overlay(6)),
    mask("hf-sliding_window_bidirectional_mask_function", lambda: mu.sliding_window_bidirectional_mask_function(6)),
    mask("hf-chunked_overlay", lambda: mu.chunked_overlay(12, _left_padding())),
    mask("hf-chunked_causal_mask_function", lambda: mu.chunked_causal_mask_function(12, _left_padding())),
    mask("hf-blockwise_overlay", lambda: mu.blockwise_overlay(_block_sequence_ids())),
    mask("hf-padding_mask_function", lambda: mu.padding_mask_function(_padding())),
    mask("hf-packed_sequence_mask_function", lambda: mu.packed_sequence_mask_function(_packed_sequence_ids())),
    mask("hf-remap_positions_for_packed_sequence",
         lambda: mu.remap_positions_for_packed_sequence(mu.causal_mask_function, _position_ids())),
    mask("hf-add_offsets_to_mask_function",
         lambda: mu.add_offsets_to_mask_function(mu.sliding_window_causal_mask_function(10), 16, 0)),
    mask("hf-and_masks", lambda: mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(_padding()),
                                              mu.sliding_window_overlay(20))),
    mask("hf-or_masks", lambda: mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(_block_sequence_ids()),
                                            mu.sliding_window_bidirectional_overlay(2))),
]


# -- what transformers hands to FlexAttention --------------------------------------------------------
class _Enough(Exception):
    """Raised by a recorder once it has what it came for, to leave the caller early."""


@contextlib.contextmanager
def _recording(module, name: str, stop_after: int | None = None):
    """Replace `module.name` (FlexAttention's create_block_mask, or transformers' call of
    flex_attention) with a recorder of its arguments; with `stop_after`, leave the caller by
    _Enough once that many calls are recorded."""
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        if stop_after is not None and len(calls) >= stop_after:
            raise _Enough
        return "recorded"

    with mock.patch.object(module, name, record), contextlib.suppress(_Enough):
        yield calls


def _config(implementation="flex_attention", **kw):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=DIM, **kw)
    config._attn_implementation = implementation
    return config


def _cache(config, past: int, static: bool = False):
    """A cache that has seen `past` tokens in every layer (so the queries sit after them)."""
    kv = torch.zeros(BATCH, HEADS, past, DIM)
    if static:
        cache = transformers.StaticCache(config=config, max_cache_len=64)
        for layer in range(config.num_hidden_layers):
            cache.update(kv, kv, layer, cache_kwargs={"cache_position": torch.arange(past)})
    else:
        cache = transformers.DynamicCache(config=config)
        for layer in range(config.num_hidden_layers):
            cache.update(kv, kv, layer)
    return cache


def _embeds(length=Q_LEN):
    return torch.zeros(BATCH, length, 32)


def _flex_mask(call, index=0, calls=1):
    """The mask_mod (and lengths) that `call(config)` hands to create_block_mask, the `index`-th
    of `calls`, with attn_implementation="flex_attention"."""
    with _recording(mu, "create_block_mask", stop_after=calls) as recorded:
        call(_config())
    args, kwargs = recorded[index]
    assert kwargs["B"] == BATCH, kwargs
    return Built(kwargs["mask_mod"], None, kwargs["Q_LEN"], kwargs["KV_LEN"])


def composed(id, call, **kw):
    return Case(id, lambda: _flex_mask(call), composed=call, **kw)


def _windowed(config):
    config.sliding_window, config.attention_chunk_size = 10, 12
    return config


COMPOSED_CASES = [
    composed("hf-create_causal_mask-padding-dynamic_cache",
             lambda c: mu.create_causal_mask(c, _embeds(), _attention_mask_2d(), _cache(c, 16))),
    composed("hf-create_causal_mask-static_cache",  # q_offset is a 0-d tensor; 64 keys, 8 empty slots
             lambda c: mu.create_causal_mask(c, _embeds(), None, _cache(c, 16, static=True))),
    composed("hf-create_causal_mask-left_padding",  # padded queries see no key: empty rows
             lambda c: mu.create_causal_mask(c, _embeds(KV_LEN), _attention_mask_2d(), None)),
    composed("hf-create_causal_mask-packed_position_ids",
             lambda c: mu.create_causal_mask(c, _embeds(KV_LEN), None, None, position_ids=_position_ids())),
    composed("hf-create_causal_mask-block_sequence_ids",
             lambda c: mu.create_causal_mask(c, _embeds(), _attention_mask_2d(), _cache(c, 16),
                                             block_sequence_ids=_block_sequence_ids())),
    composed("hf-create_causal_mask-decode",
             lambda c: mu.create_causal_mask(c, _embeds(1), _attention_mask_2d(57), _cache(c, 56))),
    composed("hf-create_causal_mask-speculative",
             lambda c: mu.create_causal_mask(c, _embeds(3), _attention_mask_2d(59), _cache(c, 56))),
    composed("hf-create_sliding_window_causal_mask",
             lambda c: mu.create_sliding_window_causal_mask(_windowed(c), _embeds(), _attention_mask_2d(),
                                                            _cache(_windowed(c), 16))),
    composed("hf-create_sliding_window_causal_mask-decode",
             lambda c: mu.create_sliding_window_causal_mask(_windowed(c), _embeds(1), _attention_mask_2d(57),
                                                            _cache(_windowed(c), 56))),
    composed("hf-create_chunked_causal_mask",
             lambda c: mu.create_chunked_causal_mask(_windowed(c), _embeds(), _attention_mask_2d(),
                                                     _cache(_windowed(c), 16))),
    composed("hf-create_chunked_causal_mask-decode",
             lambda c: mu.create_chunked_causal_mask(_windowed(c), _embeds(1), _attention_mask_2d(64),
                                                     _cache(_windowed(c), 63))),
    composed("hf-create_bidirectional_mask-cross_attention",
             lambda c: mu.create_bidirectional_mask(c, _embeds(), _attention_mask_2d(),
                                                    encoder_hidden_states=torch.zeros(BATCH, KV_LEN, 32))),
    composed("hf-create_bidirectional_mask-cross_attention-more_queries",
             lambda c: mu.create_bidirectional_mask(c, _embeds(KV_LEN), _attention_mask_2d(Q_LEN),
                                                    encoder_hidden_states=torch.zeros(BATCH, Q_LEN, 32))),
    composed("hf-create_bidirectional_sliding_window_mask",
             lambda c: mu.create_bidirectional_sliding_window_mask(_windowed(c), _embeds(KV_LEN),
                                                                   _attention_mask_2d())),
]


# -- model files' mask functions ----------------------------------------------------------------------
def _gemma3_bidirectional(index):
    """Gemma3TextModel.forward with use_bidirectional_attention: its full-attention layers get
    or_mask_function=`lambda *args: torch.tensor(True, dtype=torch.bool)` (index 0), its sliding
    layers _bidirectional_window_overlay (index 1)."""
    gemma3 = _model("gemma3")
    config = transformers.Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=HEADS, num_key_value_heads=1, head_dim=DIM,
                                           sliding_window=10, use_bidirectional_attention=True,
                                           layer_types=["sliding_attention", "full_attention"])
    config._attn_implementation = "flex_attention"
    torch.manual_seed(0)
    model = gemma3.Gemma3TextModel(config).eval()
    with _recording(mu, "create_block_mask", stop_after=2) as recorded:
        model(input_ids=torch.zeros(BATCH, Q_LEN, dtype=torch.long), attention_mask=_attention_mask_2d(Q_LEN))
    kwargs = recorded[index][1]
    return Built(kwargs["mask_mod"], None, kwargs["Q_LEN"], kwargs["KV_LEN"])


def _gemma3_vision(index):
    """gemma3's create_masks_for_vision_model: OR(causal, blockwise) for full layers (index 0),
    AND(sliding window, OR(causal, blockwise)) for sliding layers (index 1), with the block ids
    that get_block_sequence_ids_for_mask makes of token_type_ids."""
    gemma3 = _model("gemma3")
    token_type_ids = torch.zeros(BATCH, KV_LEN, dtype=torch.long)
    token_type_ids[0, 4:14], token_type_ids[0, 30:45], token_type_ids[1, 10:30] = 1, 1, 1
    block_ids = gemma3.get_block_sequence_ids_for_mask(token_type_ids)
    config = _windowed(_config())
    with _recording(mu, "create_block_mask") as recorded:
        gemma3.create_masks_for_vision_model(config, _embeds(KV_LEN), _attention_mask_2d(), None,
                                             None, block_sequence_ids=block_ids)
    kwargs = recorded[index][1]
    return Built(kwargs["mask_mod"], None, kwargs["Q_LEN"], kwargs["KV_LEN"])


def _unlimited_ocr(past):
    """create_reference_sliding_window_causal_mask's prefill_overlay: kv_idx - kv_offset < inf."""
    ocr = _model("unlimited_ocr")
    config = _windowed(_config())
    cache = _cache(config, past) if past else None
    with _recording(mu, "create_block_mask") as recorded:
        ocr.create_reference_sliding_window_causal_mask(config, _embeds(Q_LEN if past else KV_LEN),
                                                        _attention_mask_2d(), cache)
    kwargs = recorded[0][1]
    return Built(kwargs["mask_mod"], None, kwargs["Q_LEN"], kwargs["KV_LEN"])


MODEL_CASES = [
    mask("hf-gemma3-_bidirectional_window_overlay", lambda: _model("gemma3")._bidirectional_window_overlay(8)),
    Case("hf-gemma3-forward-bidirectional-full", lambda: _gemma3_bidirectional(0)),
    Case("hf-gemma3-forward-bidirectional-sliding", lambda: _gemma3_bidirectional(1)),
    Case("hf-gemma3-create_masks_for_vision_model-full", lambda: _gemma3_vision(0)),
    Case("hf-gemma3-create_masks_for_vision_model-sliding", lambda: _gemma3_vision(1)),
    mask("hf-gemma4-sliding_window_mask_function", lambda: _model("gemma4").sliding_window_mask_function((8, 4))),
    mask("hf-moonshine_streaming-sliding_window_mask_function",
         lambda: _model("moonshine_streaming").sliding_window_mask_function((6, 9))),
    mask("hf-nemotron_asr_streaming-chunked_limited_mask_function",
         lambda: _model("nemotron_asr_streaming").chunked_limited_mask_function(16, 7)),
    mask("hf-nemotron_asr_streaming-chunked_limited_mask_function-unlimited",
         lambda: _model("nemotron_asr_streaming").chunked_limited_mask_function(-1, 7)),
    mask("hf-step3p7-_bidirectional_window_overlay", lambda: _model("step3p7")._bidirectional_window_overlay(5)),
    mask("hf-t5gemma2-sliding_window_mask_function-causal",
         lambda: _model("t5gemma2").sliding_window_mask_function(10)),
    mask("hf-t5gemma2-sliding_window_mask_function-bidirectional",
         lambda: _model("t5gemma2").sliding_window_mask_function(9, is_causal=False)),
    Case("hf-unlimited_ocr-create_reference_sliding_window_causal_mask", lambda: _unlimited_ocr(16)),
    Case("hf-unlimited_ocr-create_reference_sliding_window_causal_mask-no_cache", lambda: _unlimited_ocr(0)),
]


# -- transformers.integrations.flex_attention -----------------------------------------------------------
def _document_ids():
    """make_flex_block_causal_mask's packed 2-d mask: document numbers, 0 for padding."""
    return torch.tensor([[1] * 20 + [2] * 15 + [3] * 18 + [0] * 3, [1] * 33 + [2] * 23])


def _block_causal(**kw):
    with _recording(hf_flex, "create_block_mask") as recorded:
        hf_flex.make_flex_block_causal_mask(_document_ids(), **kw)
    kwargs = recorded[0][1]
    return Built(kwargs["mask_mod"], None, kwargs["Q_LEN"], kwargs["KV_LEN"])


def _flex_score_mod(module, q_len=Q_LEN, kv_len=KV_LEN, **kw):
    """The score_mod that `module.flex_attention_forward` hands to FlexAttention."""
    q = torch.zeros(BATCH, HEADS, q_len, DIM)
    k = torch.zeros(BATCH, HEADS, kv_len, DIM)
    with _recording(module, "compile_friendly_flex_attention", stop_after=1) as recorded:
        module.flex_attention_forward(torch.nn.Module().eval(), q, k, k, **kw)
    return recorded[0][1]["score_mod"]


def _additive_mask(heads=1, dtype=torch.float32, seed=1):
    """A 4-d additive mask as transformers' eager path makes them (0 or dtype's min), wider than
    the keys (flex_attention_forward slices it), no row fully masked."""
    g = torch.Generator().manual_seed(seed)
    drop = torch.rand(BATCH, heads, Q_LEN, 64, generator=g) < 0.3
    drop[..., 0] = False
    return torch.zeros(BATCH, heads, Q_LEN, 64).masked_fill(drop, torch.finfo(dtype).min).to(dtype)


def _eager_mask(dtype=torch.float32):
    """transformers' own eager_mask for causal attention over a left-padded batch: the padded
    queries of the second sequence (rows 0-8) have every key at dtype's min."""
    return mu.eager_mask(batch_size=BATCH, q_length=KV_LEN, kv_length=KV_LEN, mask_function=mu.causal_mask_function,
                         attention_mask=_attention_mask_2d().bool(), dtype=dtype)


def _position_bias():
    return torch.randn(BATCH, HEADS, Q_LEN, KV_LEN, generator=torch.Generator().manual_seed(2))


# A score below float32's range in log2 units counts as -inf in maskc's kernels, as in FlexAttention's
# compiled ones: a row of only such scores (transformers' padded queries) is empty, where eager
# attention gives the mean of V (docs/guides/masks.md, "Where maskc's answer differs from FlexAttention's"); the reference is told so.
_BELOW_LOG2_RANGE = -torch.finfo(torch.float32).max / 1.4426950408889634

INTEGRATION_CASES = [
    Case("hf-make_flex_block_causal_mask-causal", lambda: _block_causal()),
    Case("hf-make_flex_block_causal_mask-chunked", lambda: _block_causal(attention_chunk_size=12)),
    Case("hf-make_flex_block_causal_mask-bidirectional", lambda: _block_causal(is_causal=False)),
    Case("hf-make_flex_block_causal_mask-offsets",
         lambda: _block_causal(query_length=Q_LEN, key_length=KV_LEN, offsets=(torch.tensor(16), torch.tensor(0)))),
    score("hf-flex_attention_forward-softcap", lambda: _flex_score_mod(hf_flex, attention_mask=None, softcap=2.0)),
    score("hf-flex_attention_forward-additive_mask", lambda: _flex_score_mod(hf_flex, attention_mask=_additive_mask())),
    score("hf-flex_attention_forward-position_bias",
          lambda: _flex_score_mod(hf_flex, attention_mask=None, position_bias=_position_bias())),
    score("hf-flex_attention_forward-all",
          lambda: _flex_score_mod(hf_flex, attention_mask=_additive_mask(), softcap=3.0,
                                  position_bias=_position_bias())),
    Case("hf-flex_attention_forward-eager_mask-padded_rows",
         lambda: Built(None, _flex_score_mod(hf_flex, KV_LEN, KV_LEN, attention_mask=_eager_mask()), KV_LEN, KV_LEN),
         has_mask=False, padded_rows=True),
    Case("hf-flex_attention_forward-eager_mask_bfloat16-padded_rows",
         lambda: Built(None, _flex_score_mod(hf_flex, KV_LEN, KV_LEN, attention_mask=_eager_mask(torch.bfloat16)),
                       KV_LEN, KV_LEN),
         has_mask=False, padded_rows=True),
    score("hf-doge-flex_attention_forward",
          lambda: _flex_score_mod(_model("doge"), attention_mask=_additive_mask(HEADS, seed=3), softcap=2.0)),
    Case("hf-doge-flex_attention_forward-eager_mask-padded_rows",
         lambda: Built(None, _flex_score_mod(_model("doge"), KV_LEN, KV_LEN,
                                             attention_mask=_eager_mask().expand(-1, HEADS, -1, -1), softcap=2.0),
                       KV_LEN, KV_LEN),
         has_mask=False, padded_rows=True),
]

CASES = FACTORY_CASES + COMPOSED_CASES + MODEL_CASES + INTEGRATION_CASES
MASK_CASES = [c for c in CASES if c.has_mask]
ids = lambda c: c.id  # noqa: E731


# -- the stages -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_trace(case):
    b = built(case)
    if b.mask_mod is not None:
        assert isinstance(maskc.mask_mod(b.mask_mod), maskc.MaskMod)
    if b.score_mod is not None:
        assert isinstance(maskc.score_mod(b.score_mod), maskc.ScoreMod)


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda bs: f"{bs[0]}x{bs[1]}")
@pytest.mark.parametrize("case", MASK_CASES, ids=ids)
def test_block_map(case, block_size):
    b = built(case)
    assert_block_map_exact(b.mask_mod, b.q_len, b.kv_len, block_size, B=BATCH, H=HEADS)


@pytest.mark.parametrize("case", MASK_CASES, ids=ids)
def test_matches_torch(case):
    """maskc.testing's dense mask is torch's create_mask, and maskc.create_block_mask's tiles
    are torch's create_block_mask's (B rows, H=None, as transformers asks)."""
    b = built(case)
    want = create_mask(b.mask_mod, BATCH, HEADS, b.q_len, b.kv_len, device="cpu")
    got = dense_mask(b.mask_mod, b.q_len, b.kv_len, BATCH, HEADS)
    assert torch.equal(got, want), f"dense_mask differs from create_mask at {(got != want).nonzero()[:5].tolist()}"
    for size in (16, 32):
        ours = maskc.create_block_mask(b.mask_mod, BATCH, None, b.q_len, b.kv_len, device="cpu", BLOCK_SIZE=size)
        theirs = torch_create_block_mask(b.mask_mod, BATCH, None, b.q_len, b.kv_len, device="cpu", BLOCK_SIZE=size)
        assert torch.equal(ours.to_dense(), theirs.to_dense()), f"create_block_mask tiles differ at BLOCK_SIZE={size}"


def _as_the_kernels_read(score_mod):
    def read(score, b, h, q_idx, kv_idx):
        s = score_mod(score, b, h, q_idx, kv_idx)
        return torch.where(s < _BELOW_LOG2_RANGE, float("-inf"), s)
    return read


@pytest.mark.parametrize("case", every(CASES, 3, ids=ids))  # every case's trace, map and dense mask above
def test_attention(case):
    b = built(case)
    q, k, v, do = qkv(BATCH, HEADS, Lq=b.q_len, Lkv=b.kv_len, D=DIM, requires_grad=True, grad_out=True)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=b.mask_mod, score_mod=b.score_mod, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_score = _as_the_kernels_read(b.score_mod) if case.padded_rows else b.score_mod
    assert_agrees(out, lse, grads, (q, k, v, do), b.mask_mod, ref_score)


@pytest.fixture(scope="module")
def maskc_backend():
    import maskc.integrations.transformers as maskc_hf
    return maskc_hf.register()


@pytest.mark.parametrize("case", [c for c in CASES if c.composed is not None], ids=ids)
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_maskc_backend(case, maskc_backend, grad):
    """maskc's transformers backend, given the same call, makes the mask torch makes of what
    transformers hands to FlexAttention; without gradients (generate()), a decoding step's
    mask is read at the positions its kv_lens gives."""
    b = built(case)
    with torch.set_grad_enabled(grad):
        layer_mask = case.composed(_config(maskc_backend))
    assert (layer_mask.q_len, layer_mask.kv_len) == (b.q_len, b.kv_len)
    want = create_mask(b.mask_mod, BATCH, 1, b.q_len, b.kv_len, device="cpu")
    if layer_mask.kv_lens is None:
        got = dense_mask(layer_mask.mask_mod, b.q_len, b.kv_len, BATCH, 1)
        assert_block_map_exact(layer_mask.mask_mod, b.q_len, b.kv_len, (16, 16), B=BATCH, H=1)
    else:
        # query i sits at kv_lens[b] - q_len + i, and keys from kv_lens[b] on are cut
        assert not grad
        square = dense_mask(layer_mask.mask_mod, b.kv_len, b.kv_len, BATCH, 1)
        got = torch.zeros_like(want)
        for batch, n in enumerate(layer_mask.kv_lens.tolist()):
            got[batch, :, :, :n] = square[batch, :, n - b.q_len:n, :n]
        assert_block_map_exact(layer_mask.mask_mod, b.kv_len, b.kv_len, (16, 16), B=BATCH, H=1)
    assert torch.equal(got, want), f"maskc's layer mask differs at {(got != want).nonzero()[:5].tolist()}"


# -- coverage of the package ----------------------------------------------------------------------------
# masking_utils: function -> the case that runs it
MASKING_UTILS_COVERAGE = {
    "and_masks": "hf-and_masks", "or_masks": "hf-or_masks", "causal_mask_function": "hf-causal_mask_function",
    "bidirectional_mask_function": "hf-bidirectional_mask_function",
    "sliding_window_overlay": "hf-sliding_window_overlay", "chunked_overlay": "hf-chunked_overlay",
    "blockwise_overlay": "hf-blockwise_overlay",
    "sliding_window_causal_mask_function": "hf-sliding_window_causal_mask_function",
    "sliding_window_bidirectional_overlay": "hf-sliding_window_bidirectional_overlay",
    "sliding_window_bidirectional_mask_function": "hf-sliding_window_bidirectional_mask_function",
    "chunked_causal_mask_function": "hf-chunked_causal_mask_function",
    "padding_mask_function": "hf-padding_mask_function",
    "packed_sequence_mask_function": "hf-packed_sequence_mask_function",
    "remap_positions_for_packed_sequence": "hf-remap_positions_for_packed_sequence",
    "add_offsets_to_mask_function": "hf-add_offsets_to_mask_function",
    "create_causal_mask": "hf-create_causal_mask-padding-dynamic_cache",
    "create_bidirectional_mask": "hf-create_bidirectional_mask-cross_attention",
    "create_sliding_window_causal_mask": "hf-create_sliding_window_causal_mask",
    "create_bidirectional_sliding_window_mask": "hf-create_bidirectional_sliding_window_mask",
    "create_chunked_causal_mask": "hf-create_chunked_causal_mask",
    "flex_attention_mask": "hf-create_causal_mask-padding-dynamic_cache",  # every composed case goes through it
}
# masking_utils functions named like mask builders that make no FlexAttention mask function
MASKING_UTILS_NOT_MASKS = {
    "create_recurrent_attention_mask",  # a 2-d padding mask for linear-attention layers
    "create_masks_for_generate",  # calls the create_* above, one per layer type
}
# model files and the FlexAttention integration: "module:function" -> the case that runs it
ELSEWHERE_COVERAGE = {
    "gemma3:_bidirectional_window_overlay": "hf-gemma3-_bidirectional_window_overlay",
    "gemma4:sliding_window_mask_function": "hf-gemma4-sliding_window_mask_function",
    "moonshine_streaming:sliding_window_mask_function": "hf-moonshine_streaming-sliding_window_mask_function",
    "nemotron_asr_streaming:chunked_limited_mask_function": "hf-nemotron_asr_streaming-chunked_limited_mask_function",
    "step3p7:_bidirectional_window_overlay": "hf-step3p7-_bidirectional_window_overlay",
    "t5gemma2:sliding_window_mask_function": "hf-t5gemma2-sliding_window_mask_function-causal",
    "unlimited_ocr:create_reference_sliding_window_causal_mask":
        "hf-unlimited_ocr-create_reference_sliding_window_causal_mask",
    "gemma3:Gemma3TextModel.forward": "hf-gemma3-forward-bidirectional-full",
    # the same lines: modular_step3p7.py derives Step3p7TextModel from Gemma3TextModel
    "step3p7:Step3p7TextModel.forward": "hf-gemma3-forward-bidirectional-full",
    "doge:flex_attention_forward": "hf-doge-flex_attention_forward",
    "flex_attention:make_flex_block_causal_mask": "hf-make_flex_block_causal_mask-causal",
    "flex_attention:flex_attention_forward": "hf-flex_attention_forward-all",
}
_MOD_PARAMS = re.compile(r"^(score, )?(b|batch|batch_idx), (h|head|head_idx), q_idx, kv_idx$")


def _defines_mod(node) -> bool:
    """`node` (a function) is, or defines inside it, a mask_mod or score_mod: a def or lambda
    whose parameters are (b, h, q_idx, kv_idx), a score first for a score_mod, or a lambda
    handed to transformers as an `*_mask_function` (gemma3's `lambda *args: torch.tensor(True)`)."""
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.Lambda)):
            if _MOD_PARAMS.match(", ".join(a.arg for a in inner.args.args)):
                return True
        if isinstance(inner, ast.keyword) and (inner.arg or "").endswith("mask_function"):
            if isinstance(inner.value, ast.Lambda):
                return True
        if isinstance(inner, ast.Assign) and isinstance(inner.value, ast.Lambda):
            for target in inner.targets:
                key = getattr(target, "slice", None)
                if isinstance(key, ast.Constant) and str(key.value).endswith("mask_function"):
                    return True
    return False


def _mod_functions(path: pathlib.Path) -> set[str]:
    """Top-level functions (and methods, as Class.method) of the file that are or build mods."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
        found |= {prefix + f.name for f in members if isinstance(f, ast.FunctionDef) and _defines_mod(f)}
    return found


def test_every_transformers_mask_function_is_covered():
    case_ids = {c.id for c in CASES}
    # masking_utils: what defines a mod, and the create_* builders
    shipped = _mod_functions(pathlib.Path(mu.__file__))
    shipped |= {name for name, fn in inspect.getmembers(mu, inspect.isfunction)
                if fn.__module__ == mu.__name__ and name.startswith("create_") and name.endswith("_mask")}
    shipped |= {name for name in dir(mu) if re.search(r"(_mask_function|_overlay)$", name)}
    unknown = shipped - set(MASKING_UTILS_COVERAGE) - MASKING_UTILS_NOT_MASKS
    assert not unknown, f"transformers.masking_utils ships mask functions this file does not run: {sorted(unknown)}"
    # the FlexAttention integration and every model file that spells (…, q_idx, kv_idx)
    root = pathlib.Path(transformers.__file__).parent
    files = [root / "integrations" / "flex_attention.py", *sorted(root.glob("models/*/modeling_*.py"))]
    elsewhere = set()
    for path in files:
        if "kv_idx" in path.read_text():
            where = path.parent.name if path.parent.parent.name == "models" else path.stem
            elsewhere |= {f"{where}:{name}" for name in _mod_functions(path)}
    unknown = elsewhere - set(ELSEWHERE_COVERAGE)
    assert not unknown, f"transformers ships mask/score functions this file does not run: {sorted(unknown)}"
    missing = {name: case_id for name, case_id in {**MASKING_UTILS_COVERAGE, **ELSEWHERE_COVERAGE}.items()
               if case_id not in case_ids}
    assert not missing, f"coverage names cases that do not exist: {missing}"
