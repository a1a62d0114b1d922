"""One owner per decision (issue #41): each rule below is computed in one place, once per call.

- check_tensors validates q, k and v once per call, whatever path the call takes;
- a caller's block map is validated for the call's batch and heads (BlockMap.kernel_rows) once;
- "does a captured tensor need grad" is one rule (trace/mods.py), with a Dynamo-safe entry;
- log2(e) has one Python source, which the kernels' prelude prints and kernel_scale folds.
"""
import sys

import torch

import maskc
from maskc.analysis.blockmap import BlockMap
from maskc.codegen.source import KernelSource
from maskc.runtime import plan
from maskc.trace import mods
from tests._inputs import qkv, randn

rendering = sys.modules["maskc.codegen.render"]  # (maskc.codegen.render is also the function's name)


def _counted(monkeypatch, owner, name):
    calls = []
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def test_an_eager_call_checks_its_tensors_once(monkeypatch):
    calls = _counted(monkeypatch, plan, "check_tensors")
    q, k, v = qkv(Hq=2, Lq=40, D=16)
    maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)
    assert len(calls) == 1


def test_a_short_query_checks_its_tensors_once(monkeypatch):
    # few query rows without gradients: compiled_attention hands the call to decode.contiguous
    calls = _counted(monkeypatch, plan, "check_tensors")
    q, k, v = qkv(Hq=2, Lq=2, Lkv=40, D=16)
    maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)
    assert len(calls) == 1


def test_a_kv_lens_call_checks_its_tensors_once(monkeypatch):
    calls = _counted(monkeypatch, plan, "check_tensors")
    q, k, v = qkv(B=2, Hq=2, Lq=1, Lkv=40, D=16)
    maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, kv_lens=torch.tensor([7, 40]))
    assert len(calls) == 1


def test_a_paged_call_checks_its_tensors_once(monkeypatch):
    cache = maskc.PagedKVCache(8, 16, 1, 16, dtype=torch.float32, device="cpu", max_seqs=2)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    _, k, v = qkv(B=2, Hq=1, Lq=20, D=16, seed=1)
    cache.append(slots, k, v)
    calls = _counted(monkeypatch, plan, "check_tensors")
    maskc.paged_attention(randn(2, 1, 1, 16), cache, slots, mask_mod=maskc.masks.causal)
    assert len(calls) == 1


def test_a_given_block_map_is_checked_for_its_rows_once(monkeypatch):
    calls = _counted(monkeypatch, BlockMap, "kernel_rows")
    q, k, v = qkv(Hq=2, Lq=64, D=16)
    bm = maskc.block_map(maskc.masks.causal, 64, 64, block_size=(16, 16))
    maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, block_map=bm)
    assert len(calls) == 1


def test_a_decoding_call_with_a_block_map_is_checked_for_its_rows_once(monkeypatch):
    calls = _counted(monkeypatch, BlockMap, "kernel_rows")
    q, k, v = qkv(Hq=2, Lq=1, Lkv=64, D=16)
    bm = maskc.block_map(maskc.masks.causal, 64, 64, block_size=(16, 16))
    maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, block_map=bm, kv_lens=torch.tensor([30]))
    assert len(calls) == 1


def test_captured_gradients_are_one_rule_with_a_dynamo_safe_entry():
    bias = randn(8, requires_grad=True)
    fixed = randn(8)

    def learned(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    def constant(score, b, h, q_idx, kv_idx):
        return score + fixed[kv_idx]

    mod, other = mods.as_score_mod(learned), mods.as_score_mod(constant)
    assert mods.captured_needing_grad(mod.traced, other.traced, None) == (bias,)
    assert mods.captured_need_grad_for_dynamo(None, mod) and not mods.captured_need_grad_for_dynamo(other, None)
    with torch.no_grad():
        assert mods.captured_needing_grad(mod.traced) == ()
        assert mods.captured_needing_grad(mod.traced, recording=True) == (bias,)  # an autograd Function's forward
        assert not mods.captured_need_grad_for_dynamo(mod)


def test_log2e_has_one_python_source(monkeypatch):
    assert plan.kernel_scale(0.25, scored=False) == 0.25 * rendering.LOG2E
    assert plan.kernel_scale(0.25, scored=True) == 0.25
    source = KernelSource.of("fwd", None, None, exact=False)
    assert f"LOG2E = tl.constexpr({rendering.LOG2E!r})" in rendering.render(source).text
    monkeypatch.setattr(rendering, "LOG2E", 2.0)  # the template prints what Python holds
    assert "LOG2E = tl.constexpr(2.0)" in rendering.render(source).text
