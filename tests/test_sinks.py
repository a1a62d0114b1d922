"""Attention sinks (`sinks=`, one logit per query head) against the float64 reference, whose
sink is one more column of dense logits: out, lse and the gradients of q, k, v and sinks, in
compiled_attention (with and without kv_lens), paged_attention, the torch.compile operators and
maskc.distributed.attention.

Shapes stay small (Triton's interpreter); lengths are not tile multiples, and the sinks are
large enough to move every row's output.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import maskc
import maskc.distributed  # a submodule maskc does not import
from _inputs import qkv, randn
from maskc.runtime.sinks import with_sinks
from maskc.testing import attention_reference, decode_reference

DOC_IDS = torch.tensor([0] * 30 + [1] * 25 + [2] * 15)  # 70 tokens


def _sinks(H, seed=7, requires_grad=True):
    return randn(H, seed=seed).mul(2.0).requires_grad_(requires_grad)


def _grads(out, lse, tensors, d_out, d_lse):
    loss = (out.double() * d_out.double()).sum() + (lse.double() * d_lse.double()).sum()
    return torch.autograd.grad(loss, tensors)


def _close(ours, ref, atol=2e-5, rtol=2e-4):
    torch.testing.assert_close(ours.double(), ref.double(), atol=atol, rtol=rtol)


@maskc.mask_mod
def _document_row_9_empty(b, h, q_idx, kv_idx):
    # causal documents, and a query row that keeps no key at all
    return (DOC_IDS[q_idx] == DOC_IDS[kv_idx]) & (q_idx >= kv_idx) & (q_idx != 9)


@maskc.score_mod
def _distance_penalty(score, b, h, q_idx, kv_idx):
    return score - 0.05 * torch.abs(q_idx - kv_idx)


CASES = {
    "causal_gqa_score_mod": dict(shape=dict(Hq=4, Hkv=2, Lq=70), mask=maskc.masks.causal, score=_distance_penalty),
    "sliding_window_ragged": dict(shape=dict(Hq=2, Lq=45, Lkv=77), mask=maskc.masks.sliding_window(8), score=None),
    "document_empty_row": dict(shape=dict(Hq=2, Lq=70), mask=_document_row_9_empty, score=None),
}


@pytest.mark.parametrize("name", CASES)
def test_forward_lse_and_gradients_match_the_reference(name):
    case = CASES[name]
    q, k, v, d_out = qkv(**case["shape"], D=16, requires_grad=True, grad_out=True)
    sinks = _sinks(q.shape[1])
    d_lse = randn(*q.shape[:3], seed=3)
    gqa = q.shape[1] != k.shape[1]
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=case["mask"], score_mod=case["score"], enable_gqa=gqa,
                                        return_lse=True, sinks=sinks)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, ref_lse = attention_reference(*ref_inputs[:3], case["mask"], case["score"], enable_gqa=gqa,
                                           sinks=ref_inputs[3])
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    _close(out, ref_out)
    _close(lse, ref_lse)
    if name == "document_empty_row":
        assert torch.equal(out[:, :, 9], torch.zeros_like(out[:, :, 9]))
        _close(lse[:, :, 9], sinks.detach()[None, :].expand(q.shape[0], -1))
    ours = _grads(out, lse, (q, k, v, sinks), d_out, d_lse)
    theirs = _grads(ref_out, ref_lse, ref_inputs, d_out, d_lse)
    for label, a, b in zip("q k v sinks".split(), ours, theirs):
        assert torch.isfinite(a).all(), label
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-3, msg=label)


def test_the_sink_changes_the_result():
    # the reference's sink is not a no-op at these values, so the tests above can fail
    q, k, v = qkv(Hq=2, Lq=20, D=16)
    sinks = _sinks(2, requires_grad=False)
    with_sink = attention_reference(q, k, v, maskc.masks.causal, sinks=sinks)
    without = attention_reference(q, k, v, maskc.masks.causal)
    assert (with_sink[0] - without[0]).abs().max() > 0.05
    assert (with_sink[1] - without[1]).abs().min() > 1e-3


@pytest.mark.parametrize("Lq", [1, 3])
def test_decoding_with_kv_lens_matches_the_reference(Lq):
    # q, k, v without gradients (decoding), sinks with: its gradient comes through the epilogue;
    # sequence 0 holds 2 tokens, so with Lq = 3 its first query sits before position 0
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Lq=Lq, Lkv=40, D=16)
    kv_lens = torch.tensor([2, 37], dtype=torch.int32)
    sinks = _sinks(4)
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, enable_gqa=True, kv_lens=kv_lens,
                                        return_lse=True, sinks=sinks)
    ref_sinks = sinks.detach().double().requires_grad_()
    ref_out, ref_lse = decode_reference(q, k, v, kv_lens, maskc.masks.causal, enable_gqa=True, sinks=ref_sinks)
    _close(out, ref_out)
    _close(lse, ref_lse)
    d_out, d_lse = randn(*out.shape, seed=4), randn(*lse.shape, seed=5)
    (ours,), (theirs,) = _grads(out, lse, (sinks,), d_out, d_lse), _grads(ref_out, ref_lse, (ref_sinks,), d_out,
                                                                          d_lse)
    torch.testing.assert_close(ours.double(), theirs, atol=1e-4, rtol=1e-3)


def test_paged_attention_matches_the_reference():
    P, h_kv, D, capacity = 8, 2, 16, 32
    cache = maskc.PagedKVCache(8, P, h_kv, D, dtype=torch.float32, max_seqs=3, max_pages_per_seq=capacity // P)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    lens = [13, 27]
    k, v = torch.zeros(2, h_kv, capacity, D), torch.zeros(2, h_kv, capacity, D)
    for b, n in enumerate(lens):
        k[b, :, :n], v[b, :, :n] = randn(h_kv, n, D, seed=10 + b), randn(h_kv, n, D, seed=20 + b)
        cache.append(slots[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
    q = randn(2, 4, 2, D, seed=6)
    sinks = _sinks(4, requires_grad=False)
    out, lse = maskc.paged_attention(q, cache, slots, mask_mod=maskc.masks.causal, enable_gqa=True, return_lse=True,
                                     sinks=sinks)
    ref_out, ref_lse = decode_reference(q, k, v, torch.tensor(lens), maskc.masks.causal, enable_gqa=True,
                                        sinks=sinks)
    _close(out, ref_out)
    _close(lse, ref_lse)
    torch._dynamo.reset()

    def attend(q, sinks):
        return maskc.paged_attention(q, cache, slots, mask_mod=maskc.masks.causal, enable_gqa=True,
                                     return_lse=True, sinks=sinks)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, sinks)
    torch._dynamo.reset()
    for a, b in zip(compiled, (out, lse)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("decoding", [False, True], ids=["prefill", "kv_lens"])
def test_torch_compile_gives_the_eager_values(decoding):
    torch._dynamo.reset()
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Lq=3 if decoding else 40, Lkv=40, D=16, requires_grad=not decoding)
    kv_lens = torch.tensor([5, 40], dtype=torch.int32) if decoding else None
    sinks = _sinks(4)

    def attend(q, k, v, sinks):
        return maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal, enable_gqa=True, kv_lens=kv_lens,
                                        return_lse=True, sinks=sinks)

    results = []
    for fn in (attend, torch.compile(attend, backend="aot_eager", fullgraph=True)):
        out, lse = fn(q, k, v, sinks)
        wrt = (sinks,) if decoding else (q, k, v, sinks)
        results.append((out, lse, *_grads(out, lse, wrt, randn(*out.shape, seed=8), randn(*lse.shape, seed=9))))
    torch._dynamo.reset()
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)


def test_a_row_with_no_key_and_a_sink_of_minus_infinity_stays_empty():
    # a sink of -inf turns a head's sink off: the epilogue alone, its gradients finite
    out = torch.zeros(1, 2, 1, 4, requires_grad=True)
    lse = torch.full((1, 2, 1), float("-inf"), requires_grad=True)
    sinks = torch.tensor([float("-inf"), 0.5], requires_grad=True)
    new_out, new_lse = with_sinks(out, lse, sinks)
    assert new_lse.tolist() == [[[float("-inf")], [0.5]]]
    assert torch.equal(new_out, torch.zeros_like(new_out))
    (new_out.sum() + new_lse[:, 1].sum()).backward()
    for t in (out, lse, sinks):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("sinks, error, words", [
    (torch.zeros(3), ValueError, ["shape [Hq] = [2]", "got shape [3]"]),
    (torch.zeros(1, 2), ValueError, ["shape [Hq] = [2]", "got shape [1, 2]"]),
    (torch.zeros(2, dtype=torch.int64), TypeError, ["float tensor of shape [Hq] = [2]", "torch.int64",
                                                    "sinks.float()"]),
    (torch.zeros(2, device="meta"), ValueError, ["q's device cpu", "got meta", "sinks.to(q.device)"]),
    ([0.0, 0.0], TypeError, ["shape [Hq] = [2]", "got list"]),
], ids=["length", "2-d", "int", "device", "list"])
def test_bad_sinks_name_the_expected_shape(sinks, error, words):
    q, k, v = qkv(Hq=2, Lq=8, D=16)
    cache = maskc.PagedKVCache(2, 8, 2, 16, dtype=torch.float32, max_seqs=1)
    calls = [lambda: maskc.compiled_attention(q, k, v, sinks=sinks),
             lambda: maskc.paged_attention(q[:, :, :1], cache, torch.tensor([0]), sinks=sinks)]
    for call in calls:
        with pytest.raises(error) as info:
            call()
        for word in words:
            assert word in str(info.value), f"{word!r} not in {info.value}"


# -- maskc.distributed.attention on two gloo processes
def _ring_worker(rank, world_size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        L = 40
        q, k, v, d_out = qkv(Hq=4, Hkv=2, Lq=L, D=16, grad_out=True)
        d_lse = randn(1, 4, L, seed=3)
        sinks = _sinks(4)
        mask = maskc.masks.sliding_window(6)
        plan = maskc.distributed.plan(mask, L)
        mine = [plan.shard(t).detach().requires_grad_() for t in (q, k, v)]
        out, lse = maskc.distributed.attention(*mine, plan, enable_gqa=True, return_lse=True, sinks=sinks)
        ref = [t.double().requires_grad_() for t in (q, k, v, sinks.detach())]
        ref_out, ref_lse = attention_reference(*ref[:3], mask, enable_gqa=True, sinks=ref[3])
        _close(out, plan.shard(ref_out))
        _close(lse, plan.shard(ref_lse))
        ours = _grads(out, lse, (*mine, sinks), plan.shard(d_out), plan.shard(d_lse))
        theirs = _grads(ref_out, ref_lse, ref, d_out, d_lse)
        for label, a, b in zip("q k v".split(), ours[:3], theirs[:3]):
            torch.testing.assert_close(a.double(), plan.shard(b), atol=1e-4, rtol=1e-3, msg=label)
        # the sinks' gradient is summed over the group, as a captured tensor's
        torch.testing.assert_close(ours[3].double(), theirs[3], atol=1e-4, rtol=1e-3, msg="sinks")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_distributed_attention_matches_the_reference():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ring_worker, args=(2, port), nprocs=2)
