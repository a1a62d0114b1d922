"""A mod's captured tensor that changes: between a forward and its backward (refused, as autograd
refuses a saved tensor changed in place), by writes that bump no version (`.data =`, seen by the
storage pointer; a numpy buffer under torch.from_numpy, which maskc.invalidate is for), and the
memory the plan caches keep alive (bounded by bytes)."""
import gc
import weakref

import numpy as np
import pytest
import torch

import maskc
from _inputs import qkv, randn
from maskc._slots import Slots
from maskc.inference import decode
from maskc.runtime import plan
from maskc.testing import assert_close_to_reference, attention_reference

L = 128  # four 32-wide CPU tiles a side: a document mask has FULL, PARTIAL and EMPTY ones


def _ids(*starts):
    """Document ids over L positions, a new document at each of `starts`."""
    ids = torch.zeros(L, dtype=torch.int64)
    for s in starts:
        ids[s:] += 1
    return ids


def _document(ids):
    @maskc.mask_mod
    def document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    return document


def _check(q, k, v, **mods):
    out = maskc.compiled_attention(q, k, v, **mods)
    assert_close_to_reference(out, attention_reference(q, k, v, **mods)[0])


# -- a captured tensor changed between the forward and the backward --------------------------
def _bias_score():
    bias = randn(L, L, seed=1)

    @maskc.score_mod
    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx, kv_idx]
    return biased, bias


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile"])
@pytest.mark.parametrize("change", ["mask in place", "score in place", "data assigned"])
def test_a_captured_tensor_changed_before_the_backward_is_refused(change, compiled):
    # doc ids refilled for the next batch, a frozen bias table updated: the backward read the new
    # values against the forward's outputs and map (gradients off by ~250, or nan, no error)
    ids = _ids(40, 90)
    document = _document(ids)
    biased, bias = _bias_score()
    q, k, v = qkv(Lq=L, requires_grad=True)

    def attend(q, k, v):
        return maskc.compiled_attention(q, k, v, mask_mod=document, score_mod=biased)
    if compiled:
        attend = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out = attend(q, k, v)
    if change == "mask in place":
        ids.copy_(_ids(20, 100))
        name = "mask_mod 'document' captured tensor #0 (int64 [128]) is at version"
    elif change == "score in place":
        bias.mul_(100)
        name = "score_mod 'biased' captured tensor #0 (float32 [128, 128]) is at version"
    else:
        ids.data = _ids(20, 100)
        name = "mask_mod 'document' captured tensor #0 (int64 [128]) has had new storage"
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as error:
        out.sum().backward()
    assert name in str(error.value)
    assert "clone it before changing it, or change it after backward()" in str(error.value)


def test_captured_tensors_changed_outside_a_forward_and_backward_are_fine():
    ids = _ids(40, 90)
    document = _document(ids)
    q, k, v = qkv(Lq=L, requires_grad=True)
    for starts in ((40, 90), (10, 70)):
        ids.copy_(_ids(*starts))  # before the forward: the next call plans with the new values
        out = maskc.compiled_attention(q, k, v, mask_mod=document)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        ref = attention_reference(q, k, v, mask_mod=document)[0]
        want = torch.autograd.grad(ref.sum(), (q, k, v))
        for got, expected in zip(grads, want):
            assert_close_to_reference(got, expected, what="gradient")
        ids.add_(0)  # after the backward: nothing is pending


# -- writes that bump no version -------------------------------------------------------------
@pytest.mark.parametrize("Lq", [L, 1], ids=["prefill", "decode"])
def test_data_assignment_is_seen_by_the_plan_caches(Lq):
    # ids.data = new keeps the version: the caches keyed by it kept the old tiles (error 0.92).
    # The allocator hands freed memory back, so a pointer alone would repeat: here every third
    # tensor took the first one's address while the caches could still have held its map.
    ids = _ids(64)
    document = _document(ids)
    q, k, v = qkv(Lq=Lq, Lkv=L)
    for step in range(6):
        ids.data = _ids(16 * (step + 1))
        _check(q, k, v, mask_mod=document)


def test_a_block_map_built_before_data_assignment_is_refused():
    ids = _ids(64)
    document = _document(ids)
    bm = maskc.block_map(document, L, L, block_size=(32, 32))
    ids.data = _ids(32)
    q, k, v = qkv(Lq=L)
    with pytest.raises(ValueError, match=r"given new storage \(.data was assigned\)"):
        maskc.compiled_attention(q, k, v, mask_mod=document, block_map=bm)


def test_invalidate_drops_what_was_built_from_a_buffer_written_behind_torchs_back():
    buf = np.zeros(L, dtype=np.int64)
    buf[64:] = 1
    ids = torch.from_numpy(buf)  # the mask reads buf's memory; a write into buf bumps no version
    document = _document(ids)
    q, k, v = qkv(Lq=L)
    _check(q, k, v, mask_mod=document)
    for starts, given in (((32, 96), ids), ((16,), torch.from_numpy(buf[8:]))):  # any tensor over the memory
        buf[:] = _ids(*starts).numpy()
        assert maskc.invalidate(given) >= 2  # its plan and its block map
        _check(q, k, v, mask_mod=document)


def test_invalidate_keeps_what_other_tensors_built_and_drops_all_without_an_argument(fresh_caches):
    q, k, v = qkv(Lq=L)
    ours, theirs = _ids(64), _ids(32)
    for ids in (ours, theirs):
        maskc.compiled_attention(q, k, v, mask_mod=_document(ids))
    maskc.compiled_attention(q[:, :, :1], k, v, mask_mod=_document(ours))  # a decoding plan too
    caches = (plan.PLANS, plan.BLOCK_MAPS, decode.DECODES)
    assert [len(c) for c in caches] == [2, 3, 1]
    assert maskc.invalidate(ours) == 4
    assert [len(c) for c in caches] == [1, 1, 0]
    assert maskc.invalidate(torch.zeros(3)) == 0
    assert maskc.invalidate() == 2
    assert [len(c) for c in caches] == [0, 0, 0]
    with pytest.raises(TypeError, match=r"pass torch.from_numpy\(array\)"):
        maskc.invalidate(np.zeros(3))


# -- the memory the plan caches keep alive ---------------------------------------------------
def test_slots_evict_past_their_byte_budget_counting_shared_memory_once():
    budget = [100]
    slots = Slots(8, held=dict, max_bytes=lambda: budget[0])
    slots.put("a", {"shared": 60})
    slots.put("b", {"shared": 60, "b": 30})
    slots.put("c", {"c": 5})
    assert len(slots) == 3 and slots.nbytes == 95  # the shared 60 counts once
    assert slots.get("a") is not None  # used: b is now the least recently used
    slots.put("d", {"d": 20})  # 115: b goes, and a keeps the shared 60
    assert sorted(slots._items) == ["a", "c", "d"] and slots.nbytes == 85
    slots.put("e", {"e": 500})  # alone over the budget: the newest stays, by itself
    assert list(slots._items) == ["e"] and slots.nbytes == 500
    budget[0] = None  # read at each put: no bound now but the count
    for key in "fghijklm":
        slots.put(key, {key: 500})
    assert len(slots) == 8
    assert slots.drop(lambda value: "f" in value) == 1 and len(slots) == 7
    slots.clear()
    assert len(slots) == 0 and slots.nbytes == 0


@pytest.mark.parametrize("Lq", [L, 1], ids=["prefill", "decode"])
def test_plan_caches_keep_no_more_than_their_byte_budget_alive(monkeypatch, fresh_caches, Lq):
    # a new 64 KiB mask tensor per call: the caches held the last 64 (16 MiB masks kept 1 GB)
    budget = 200 << 10
    monkeypatch.setenv("MASKC_PLAN_CACHE_MAX_SIZE", "200K")
    q, k, v = qkv(Lq=Lq, Lkv=L)
    alive, held = [], []
    for step in range(8):
        scores = randn(L, L, seed=step)  # 64 KiB

        def above(b, h, q_idx, kv_idx, scores=scores):
            return (scores[q_idx, kv_idx] > 0) | (q_idx == kv_idx)
        maskc.compiled_attention(q, k, v, mask_mod=above)
        alive.append(weakref.ref(scores))
        del scores, above
        held.append([(len(c), c.nbytes) for c in (plan.PLANS, plan.BLOCK_MAPS, decode.DECODES)])
    gc.collect()
    kept = sum(ref() is not None for ref in alive)
    assert 1 <= kept <= 3, kept  # 200 KiB holds three 64 KiB tensors and their small tables
    assert [ref() is None for ref in alive[:5]] == [True] * 5  # the oldest are freed
    assert all(nbytes <= budget or n == 1 for step in held for n, nbytes in step), held  # the caches' own count


def test_plan_caches_bounded_by_count_alone_where_the_setting_is_none(monkeypatch, fresh_caches):
    monkeypatch.setenv("MASKC_PLAN_CACHE_MAX_SIZE", "none")
    q, k, v = qkv(Lq=L)
    for starts in ((16,), (32,), (48,)):
        maskc.compiled_attention(q, k, v, mask_mod=_document(_ids(*starts)))
    assert len(plan.PLANS) == len(plan.BLOCK_MAPS) == 3
    assert plan.PLANS.nbytes >= 3 * L * 8
