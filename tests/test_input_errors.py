"""Bad inputs fail early, in maskc's words: the exception type, and a message naming the problem.

None of these may reach Triton: a compiler or interpreter traceback is not an error message.
"""
import pathlib

import pytest
import torch

import maskc
from _inputs import qkv, randn
from maskc import masks, scores
from maskc.testing import assert_close_to_reference, attention_reference


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKC_CACHE_DIR", str(tmp_path / "kernels"))


def _raises(exc, words, fn, *args, **kwargs):
    """fn(*args, **kwargs) raises `exc` with every one of `words` in its message, and no frame of
    the traceback lies inside triton."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    triton_frames = [entry for entry in info.traceback if "triton" in pathlib.Path(str(entry.path)).parts]
    assert not triton_frames, f"error raised from inside triton: {triton_frames[-1]}"
    return message


attention = maskc.compiled_attention


# -- shapes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("shape", [(40, 32), (2, 40, 32), (1, 1, 2, 40, 32)], ids=["2d", "3d", "5d"])
def test_wrong_rank(which, shape):
    args = list(qkv())
    args[which] = randn(*shape)
    _raises(ValueError, ["qkv"[which], "4 dimensions", str(tuple(shape))], attention, *args)


def test_not_a_tensor():
    q, k, v = qkv()
    _raises(TypeError, ["k", "torch.Tensor", "list"], attention, q, k.tolist(), v)


def test_batch_mismatch():
    q, _, _ = qkv(B=2)
    _, k, v = qkv(B=3)
    _raises(ValueError, ["batch", "2", "3"], attention, q, k, v)


def test_kv_heads_mismatch():
    q, k, _ = qkv(Hq=2, Hkv=2)
    v = randn(1, 1, 40, 32)
    _raises(ValueError, ["heads", "2", "1"], attention, q, k, v, enable_gqa=True)


def test_head_dim_mismatch():
    q, _, v = qkv(D=32)
    k = randn(1, 2, 40, 64)
    _raises(ValueError, ["head dim", "32", "64"], attention, q, k, v)


def test_kv_length_mismatch():
    q, k, _ = qkv(Lkv=40)
    v = randn(1, 2, 41, 32)
    _raises(ValueError, ["length", "40", "41"], attention, q, k, v)


def test_heads_not_a_multiple():
    q, k, v = qkv(Hq=3, Hkv=2)
    _raises(ValueError, ["3", "2", "multiple"], attention, q, k, v, enable_gqa=True)


def test_gqa_needs_enable_gqa():
    q, k, v = qkv(Hq=4, Hkv=2)
    _raises(ValueError, ["enable_gqa=True"], attention, q, k, v)


@pytest.mark.parametrize("D,Dv,word", [(8, 32, "q/k head dim"), (512, 32, "q/k head dim"), (32, 8, "v head dim"),
                                       (32, 512, "v head dim")])
def test_head_dim_out_of_range(D, Dv, word):
    q, k, v = qkv(D=D, Dv=Dv)
    message = _raises(ValueError, [word, "16", "256"], attention, q, k, v)
    assert str(min(D, Dv) if min(D, Dv) < 16 else max(D, Dv)) in message


def test_zero_heads():
    q, k, v = qkv(Hq=0, Hkv=0)
    try:
        out = attention(q, k, v)
    except (ValueError, TypeError) as error:
        assert "head" in str(error)
    else:
        assert out.shape == (1, 0, 40, 16)


# -- dtypes and devices ---------------------------------------------------------------------
def test_dtype_mismatch():
    q, k, v = qkv()
    _raises(TypeError, ["dtype", "float32", "float16"], attention, q, k.half(), v)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float8_e4m3fn, torch.complex64], ids=str)
def test_unsupported_dtype(dtype):
    q, k, v = qkv(dtype=dtype)
    _raises(TypeError, ["float16", "bfloat16", "float32", str(dtype)], attention, q, k, v)


def test_compile_unsupported_dtype_and_head_dim():
    _raises(TypeError, ["dtype", "int32"], maskc.compile, masks.causal, dtype=torch.int32, head_dim=32, device="cpu")
    _raises(ValueError, ["head_dim", "8"], maskc.compile, masks.causal, dtype=torch.float32, head_dim=8,
            device="cpu")
    _raises(ValueError, ["head_dim_v", "512"], maskc.compile, masks.causal, dtype=torch.float32, head_dim=32,
            head_dim_v=512, device="cpu")


def test_device_mismatch():
    q, k, v = qkv()
    _raises(ValueError, ["one device", "meta"], attention, q, k.to("meta"), v)


def test_unsupported_device():
    q, k, v = (t.to("meta") for t in qkv())
    _raises(ValueError, ["meta"], attention, q, k, v)


def test_captured_tensor_on_another_device():
    ids = torch.zeros(40, dtype=torch.long, device="meta")
    q, k, v = qkv()
    _raises(ValueError, ["captured tensor", "meta", "cpu", "document"], attention, q, k, v,
            mask_mod=masks.document(ids))
    slopes = torch.ones(2, device="meta")
    _raises(ValueError, ["captured tensor", "meta", "alibi"], attention, q, k, v, score_mod=scores.alibi(slopes))


# -- block maps -----------------------------------------------------------------------------
def test_block_map_for_other_lengths():
    q, k, v = qkv(Lq=40, Lkv=40)
    bm = maskc.block_map(masks.causal, 64, 40, block_size=(32, 32))
    _raises(ValueError, ["block_map", "q_len=64", "q_len=40"], attention, q, k, v, mask_mod=masks.causal,
            block_map=bm)
    bm = maskc.block_map(masks.causal, 40, 48, block_size=(32, 32))
    _raises(ValueError, ["block_map", "kv_len=48", "kv_len=40"], attention, q, k, v, mask_mod=masks.causal,
            block_map=bm)


@pytest.mark.parametrize("block_size", [(48, 32), (32, 24), (8, 32), (32, 512)], ids=str)
def test_block_map_tile_sizes_not_powers_of_two(block_size):
    q, k, v = qkv()
    bm = maskc.block_map(masks.causal, 40, 40, block_size=block_size)
    _raises(ValueError, ["powers of two", str(block_size)], attention, q, k, v, mask_mod=masks.causal,
            block_map=bm)


def test_block_map_wrong_type():
    q, k, v = qkv()
    _raises(TypeError, ["block_map", "maskc.BlockMap", "Tensor"], attention, q, k, v, mask_mod=masks.causal,
            block_map=torch.zeros(2, 2))


def test_block_map_for_other_batch_or_heads():
    def per_batch(b, h, q_idx, kv_idx):
        return (b == 0) | (q_idx >= kv_idx)

    def per_head(b, h, q_idx, kv_idx):
        return (h == 0) | (q_idx >= kv_idx)

    q, k, v = qkv(B=3, Hq=2)
    bm = maskc.block_map(per_batch, 40, 40, block_size=(32, 32), B=2)
    _raises(ValueError, ["B=2", "B=3"], attention, q, k, v, mask_mod=per_batch, block_map=bm)
    # a map of more batch rows serves fewer inputs with its first rows, as FlexAttention reads a
    # BlockMask (tests/test_flex_api_compat.py: a whole-cache mask for one request)
    bm = maskc.block_map(per_batch, 40, 40, block_size=(32, 32), B=4)
    assert_close_to_reference(attention(q, k, v, mask_mod=per_batch, block_map=bm),
                              attention_reference(q, k, v, mask_mod=per_batch)[0], q.dtype)
    q, k, v = qkv(B=2, Hq=2)
    bm = maskc.block_map(per_head, 40, 40, block_size=(32, 32), H=4)
    _raises(ValueError, ["H=4", "H=2"], attention, q, k, v, mask_mod=per_head, block_map=bm)


def test_block_map_on_another_device():
    q, k, v = qkv()
    bm = maskc.block_map(masks.causal, 40, 40, block_size=(32, 32)).to("meta")
    _raises(ValueError, ["block_map", "meta", "cpu", "block_map.to('cpu')"], attention, q, k, v,
            mask_mod=masks.causal, block_map=bm)


def test_block_map_that_records_no_mask():
    q, k, v = qkv()
    bm = maskc.block_map(masks.causal, 40, 40, block_size=(32, 32)).transposed  # a map of tiles alone
    _raises(ValueError, ["block_map", "records no mask", "maskc.block_map("], attention, q, k, v,
            mask_mod=masks.causal, block_map=bm)


def test_block_map_of_batch_mask_needs_B():
    def per_batch(b, h, q_idx, kv_idx):
        return (b == 0) | (q_idx >= kv_idx)

    def per_head(b, h, q_idx, kv_idx):
        return (h == 1) | (q_idx >= kv_idx)

    _raises(ValueError, ["B=", "per_batch"], maskc.block_map, per_batch, 40, 40)
    _raises(ValueError, ["H=", "per_head"], maskc.block_map, per_head, 40, 40)


def test_compile_rejects_tile_sizes_not_powers_of_two():
    _raises(ValueError, ["powers of two"], maskc.compile, masks.causal, dtype=torch.float32, head_dim=32,
            block_size=(48, 48), device="cpu")


# -- autograd -------------------------------------------------------------------------------
def test_mask_captured_tensor_requiring_grad():
    """A score mod's captured tensor that requires grad gets its gradient
    (tests/test_captured_grads.py); a mask's is refused: its values only choose pairs."""
    q, k, v = qkv()
    ids = torch.zeros(q.shape[2]).requires_grad_()

    @maskc.mask_mod
    def document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    _raises(ValueError, ["captured tensor", "grad", "document", "detach"], attention, q, k, v, mask_mod=document)
    with torch.no_grad():
        attention(q, k, v, mask_mod=document)  # no gradient asked: fine


# -- mods -----------------------------------------------------------------------------------
def test_score_mod_passed_as_mask_mod():
    q, k, v = qkv()
    _raises(TypeError, ["mask_mod", "score_mod", "softcap"], attention, q, k, v, mask_mod=scores.softcap(5.0))
    _raises(TypeError, ["score_mod", "mask_mod", "causal"], attention, q, k, v, score_mod=masks.causal)


def test_mask_mod_that_is_not_a_function():
    q, k, v = qkv()
    _raises(TypeError, ["mask_mod", "function", "int"], attention, q, k, v, mask_mod=3)


def test_mask_mod_with_wrong_arity():
    q, k, v = qkv()
    _raises(maskc.MaskTraceError, ["mask_mod", "4 positional arguments", "(b, h, q_idx, kv_idx)"], attention, q, k,
            v, mask_mod=lambda q_idx, kv_idx: q_idx >= kv_idx)


def halvings(b, h, q_idx, kv_idx):
    x = q_idx
    for _ in range(100):
        x = torch.floor(x / 2) + kv_idx
    return x >= 0


def test_a_mod_nested_past_the_recursion_limit_is_refused_with_the_fix():
    # it was a bare RecursionError from the canonical form
    with pytest.raises(maskc.MaskTraceError, match="recursion limit.*nests deeper.*outside the mod"):
        maskc.mask_mod(halvings).traced
