"""Context parallelism on gloo: 2, 3 and 4 spawned processes, the real kernels through the interpreter.

Each worker checks its gathered results itself against single-process maskc and the float64
reference; a failed check fails the spawn, with the worker's traceback.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import maskc
import maskc.distributed as md
from maskc.distributed import layout
from maskc.testing import attention_reference

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world_size: int, *args) -> None:
    mp.spawn(_init_and_run, args=(world_size, _free_port(), fn, args), nprocs=world_size)


def _init_and_run(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)  # every rank draws the same full tensors
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


# -- the cases: (name, length, Hq, Hkv, mask factory, score factory); factories run in the worker
def _documents(L):
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([L // 3, 5, L // 2, L - L // 3 - 5 - L // 2]))
    return maskc.masks.document(ids, causal=True)


def _relative_table(L, H):
    return torch.randn(H, 2 * L - 1, dtype=torch.float32).mul_(0.5).requires_grad_()


CASES = [
    ("causal", 77, 2, 2, lambda L: maskc.masks.causal, None),
    ("sliding window", 90, 2, 2, lambda L: maskc.masks.sliding_window(19), None),
    ("document", 83, 2, 2, _documents, None),
    ("prefix-LM with GQA", 61, 4, 2, lambda L: maskc.masks.prefix_lm(23), None),
    ("causal with learnable relative bias", 70, 2, 2, lambda L: maskc.masks.causal,
     lambda L, H: maskc.scores.relative_bias(_relative_table(L, H))),
    ("no mask, softcap", 45, 2, 1, lambda L: None, lambda L, H: maskc.scores.softcap(2.0)),
]


def _check_cases(rank, world_size):
    for name, L, Hq, Hkv, make_mask, make_score in CASES:
        mask = make_mask(L)
        score = make_score(L, Hq) if make_score else None
        table = [t for t in (score.traced.tensors if score else ()) if t.requires_grad]
        q = torch.randn(1, Hq, L, 16)
        k, v = torch.randn(1, Hkv, L, 16), torch.randn(1, Hkv, L, 16)
        g_out, g_lse = torch.randn(1, Hq, L, 16), torch.randn(1, Hq, L)
        gqa = Hq != Hkv

        plan = md.plan(mask, L, block_size=16)
        qs, ks, vs = (plan.shard(x).requires_grad_() for x in (q, k, v))
        out, lse = md.attention(qs, ks, vs, plan, score_mod=score, enable_gqa=gqa, return_lse=True)
        _loss(out, lse, plan.shard(g_out), plan.shard(g_lse)).backward()
        got = [plan.unshard(t.detach()) for t in (out, lse, qs.grad, ks.grad, vs.grad)] + [t.grad for t in table]
        if rank:
            continue  # every rank gathered the same full tensors: rank 0 checks them

        for t in table:
            t.grad = None
        qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
        o1, l1 = maskc.compiled_attention(qf, kf, vf, mask_mod=mask, score_mod=score, enable_gqa=gqa,
                                          return_lse=True)
        _loss(o1, l1, g_out, g_lse).backward()
        single = [o1, l1, qf.grad, kf.grad, vf.grad] + [t.grad for t in table]

        for t in table:
            t.grad = None
        qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
        o2, l2 = attention_reference(qr, kr, vr, mask_mod=mask, score_mod=score, enable_gqa=gqa)
        _loss(o2, l2, g_out.double(), g_lse.double()).backward()
        reference = [o2, l2, qr.grad, kr.grad, vr.grad] + [t.grad for t in table]

        what = ["out", "lse", "dq", "dk", "dv"] + ["captured table's gradient"] * len(table)
        for w, a, b, c in zip(what, got, single, reference):
            where = f"{name}, {world_size} ranks ({plan.layout}): {w}"
            torch.testing.assert_close(a, b.to(a.dtype), atol=2e-5, rtol=2e-5,
                                       msg=lambda m, where=where: f"{where} vs maskc\n{m}")
            torch.testing.assert_close(a.double(), c.double(), atol=2e-4, rtol=2e-4,
                                       msg=lambda m, where=where: f"{where} vs float64\n{m}")


def _loss(out, lse, g_out, g_lse):
    # lse enters the loss too, where finite: its gradient takes the backward's other path
    return (out * g_out).sum() + torch.where(torch.isinf(lse), 0.0, lse * g_lse).sum()


# 3 and 4 ranks (uneven shards, the zigzag split over more ranks) in the slow lane
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_matches_single_process_and_reference(world_size):
    _spawn(_check_cases, world_size)


def _check_sliding_window_skips(rank, world_size):
    L, window = 256, 16
    mask = maskc.masks.sliding_window(window)
    plan = md.plan(mask, L, block_size=16)
    # each contiguous shard of 64 needs only its left neighbour's keys: steps 2 and 3 do nothing
    assert plan.layout == "contiguous" and plan.steps == (0, 1) and plan.skipped_steps == 2, plan
    sent, lengths = [], []
    batch = dist.batch_isend_irecv

    def counting(ops):
        sent.extend(op.tag // 4 for op in ops)  # the tag's quotient is the ring step
        lengths.extend(op.tensor.shape[2] for op in ops)
        return batch(ops)

    dist.batch_isend_irecv = counting
    try:
        q, k, v = (torch.randn(1, 2, L, 16) for _ in range(3))
        qs, ks, vs = (plan.shard(x).requires_grad_() for x in (q, k, v))
        out = md.attention(qs, ks, vs, plan)
        out.sum().backward()
    finally:
        dist.batch_isend_irecv = batch
    assert set(sent) == {1}, f"rank {rank} exchanged at ring steps {sorted(set(sent))}, wanted only step 1"
    # a shard's queries read only the last tile of keys (window 16) of the shard before it: only
    # those 16 of its 64 keys travel, and their gradients come back
    assert lengths and set(lengths) == {16}, f"rank {rank} exchanged {lengths} positions"
    ref, _ = attention_reference(q, k, v, mask_mod=mask)
    torch.testing.assert_close(plan.unshard(out.detach()).double(), ref, atol=2e-4, rtol=2e-4)


def _check_sliding_window_and_short_ragged(rank, world_size):
    _check_sliding_window_skips(rank, world_size)
    # 3 tiles for 16 chunks: most chunks are empty, and the ragged last tile belongs to a real one
    plan = md.plan(maskc.masks.causal, 40, block_size=16)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    qs = plan.shard(q).requires_grad_()
    out = md.attention(qs, plan.shard(k), plan.shard(v), plan)
    out.sum().backward()
    want, _ = attention_reference(q, k, v, mask_mod=maskc.masks.causal)
    torch.testing.assert_close(plan.unshard(out.detach()).double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow  # 4 ranks; the ring's skip decisions are unit-tested below without processes
def test_sliding_window_skips_ring_steps():
    _spawn(_check_sliding_window_and_short_ragged, 4)


def _check_errors(rank, world_size):
    ids = torch.zeros(64, dtype=torch.long)
    mask = maskc.masks.document(ids)
    with pytest.raises(ValueError, match="every rank must call maskc.distributed.plan with the same"):
        md.plan(mask, 64 if rank == 0 else 80, block_size=16)
    other = torch.zeros(64, dtype=torch.long)
    other[40 + 4 * rank:] = 1  # a document boundary at 40 on rank 0 and 44 on rank 1: same layout, two masks
    with pytest.raises(ValueError, match="every rank must call maskc.distributed.plan with the same"):
        md.plan(maskc.masks.document(other), 64, block_size=16)
    plan = md.plan(mask, 64, block_size=16)
    q = torch.randn(1, 2, plan.local_len, 16)
    with pytest.raises(ValueError, match="this rank's shard of 32 positions"):
        md.attention(torch.randn(1, 2, 64, 16), q, q, plan)
    with pytest.raises(ValueError, match="must be the plan's seq_len 64"):
        plan.shard(q)
    ids[40:] = 1  # the documents changed in place: the plan would skip pairs the mask now keeps, or compute dropped ones
    with pytest.raises(ValueError, match="changed since this plan was made"):
        md.attention(q, q, q, plan)
    with pytest.raises(TypeError, match="ContextParallelPlan"):
        md.attention(q, q, q, "plan")
    _check_ranks_disagree(rank)


def _check_ranks_disagree(rank):
    # every rank raises, naming what differs where, instead of aborting inside gloo (shapes,
    # dtypes) or merging shards computed two ways (scale, score mods)
    plan = md.plan(maskc.masks.causal, 40, block_size=16)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    qs, ks, vs = (plan.shard(x) for x in (q, k, v))
    softcap = maskc.scores.softcap(2.0 + rank)
    differ = {
        "scale is 0.25 on rank 0 and 0.5 on rank 1": dict(scale=0.25 if rank == 0 else 0.5),
        "score_mod is none on rank 0 and 'softcap_2": dict(score_mod=maskc.scores.softcap(2.0) if rank else None),
        r"numbers \(2.0,\).* on rank 0 and .*numbers \(3.0,\).* on rank 1": dict(score_mod=softcap),
        r"q is \[1, 2, \*, 16\] float32 on rank 0 and \[2, 2, \*, 16\] float32 on rank 1":
        dict(q=qs.expand(1 + rank, -1, -1, -1), k=ks.expand(1 + rank, -1, -1, -1), v=vs.expand(1 + rank, -1, -1, -1)),
        "k is .* float32 on rank 0 and .* float64 on rank 1": dict(q=qs.double(), k=ks.double(), v=vs.double())
        if rank else {},
        "backward is recorded on rank 0 and not recorded on rank 1": dict(q=qs.clone().requires_grad_(not rank)),
    }
    for message, change in differ.items():
        args = dict(q=qs, k=ks, v=vs) | change
        with pytest.raises(maskc.MaskcError, match=message):
            md.attention(args.pop("q"), args.pop("k"), args.pop("v"), plan, **args)
    # rank 1 alone fails its own check: it raises that, and rank 0 says where to look
    with pytest.raises(ValueError if rank else maskc.MaskcError,
                       match="this rank's shard" if rank else "failed on rank 1: .*this rank's shard"):
        md.attention(q if rank else qs, ks, vs, plan)
    # the collectives stay in step: the agreed call runs, then a call rank 0 has made before and
    # rank 1 has not is still compared on both (rank 0's cache must not skip the exchange)
    out = plan.unshard(md.attention(qs, ks, vs, plan, scale=0.25))
    want, _ = attention_reference(q, k, v, mask_mod=maskc.masks.causal, scale=0.25)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    with pytest.raises(maskc.MaskcError, match="scale is 0.25 on rank 0 and 0.125 on rank 1"):
        md.attention(qs, ks, vs, plan, scale=0.25 if rank == 0 else 0.125)


def _check_compiled(rank, world_size):
    plan = md.plan(maskc.masks.causal, 50, block_size=16)
    q, k, v = (torch.randn(1, 2, 50, 16) for _ in range(3))
    qs = plan.shard(q).requires_grad_()

    @torch.compile(backend="eager")
    def layer(x):
        return md.attention(x * 2, plan.shard(k), plan.shard(v), plan).relu()

    out = layer(qs)
    out.sum().backward()
    q1 = q.clone().requires_grad_()
    want = maskc.compiled_attention(q1 * 2, k, v, mask_mod=maskc.masks.causal).relu()
    want.sum().backward()
    torch.testing.assert_close(plan.unshard(out.detach()), want.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(plan.unshard(qs.grad), q1.grad, atol=2e-5, rtol=2e-5)
    # the call is a graph break that runs eagerly: ranks that disagree raise there too
    with pytest.raises(maskc.MaskcError, match="scale is 0.5 on rank 0 and 0.25 on rank 1"):
        torch.compile(lambda x: md.attention(x, x, x, plan, scale=0.5 / (1 + rank)), backend="eager")(qs.detach())


_CAP = 2.0


def _capped(score, b, h, q_idx, kv_idx):
    return _CAP * torch.tanh(score / _CAP)


def _check_new_captured_number(rank, world_size):
    global _CAP
    plan = md.plan(maskc.masks.causal, 40, block_size=16)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    score = maskc.score_mod(_capped)
    for cap in (2.0, 0.5):
        _CAP = cap  # read through the mod's guard: the pairs' kernels run with the new value
        out = plan.unshard(md.attention(plan.shard(q), plan.shard(k), plan.shard(v), plan, score_mod=score))
        want, _ = attention_reference(q, k, v, mask_mod=maskc.masks.causal, score_mod=score)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def _check_captured_changes(rank, world_size):
    _check_new_captured_number(rank, world_size)
    # the same table first frozen, then learnable: the second call must compute its gradient
    plan = md.plan(maskc.masks.causal, 40, block_size=16)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    table = torch.randn(2, 79)
    score = maskc.scores.relative_bias(table)
    for learnable in (False, True):
        table.requires_grad_(learnable)
        qs = plan.shard(q).requires_grad_()
        md.attention(qs, plan.shard(k), plan.shard(v), plan, score_mod=score).sum().backward()
    got = table.grad.clone()
    table.grad = None
    want, _ = attention_reference(q, k, v, mask_mod=maskc.masks.causal, score_mod=score)
    want.sum().backward()
    torch.testing.assert_close(got, table.grad, atol=1e-4, rtol=1e-4)


def test_a_score_mods_new_number_and_new_gradient_are_used():
    _spawn(_check_captured_changes, 2)


def test_runs_inside_torch_compile():
    _spawn(_check_compiled, 2)


def _check_subgroup_and_edges(rank, world_size):
    # a group of the last two ranks of three: peers are named by their global ranks
    group = dist.new_group([1, 2])
    q, k, v = (torch.randn(1, 2, 45, 16) for _ in range(3))  # drawn on every rank, which keeps their seeds in step
    if rank:
        mask = maskc.masks.sliding_window(10)
        plan = md.plan(mask, 45, group=group, block_size=16)
        qs = plan.shard(q).requires_grad_()
        out = md.attention(qs, plan.shard(k), plan.shard(v), plan)
        out.sum().backward()
        q1 = q.clone().requires_grad_()
        want = maskc.compiled_attention(q1, k, v, mask_mod=mask)
        want.sum().backward()
        torch.testing.assert_close(plan.unshard(out.detach()), want.detach(), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(plan.unshard(qs.grad), q1.grad, atol=2e-5, rtol=2e-5)
    # fewer tiles than chunks: some ranks hold no position at all
    plan = md.plan(maskc.masks.causal, 20, block_size=16)
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    qs, ks, vs = (plan.shard(t).requires_grad_() for t in (q, k, v))
    out = md.attention(qs, ks, vs, plan)
    out.sum().backward()
    want, _ = attention_reference(q, k, v, mask_mod=maskc.masks.causal)
    torch.testing.assert_close(plan.unshard(out.detach()).double(), want, atol=2e-5, rtol=2e-5)
    assert 0 in plan.lengths, plan.lengths
    # a mask that reads h needs H to plan, as maskc.block_map does
    by_head = maskc.mask_mod(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (h == 0))
    with pytest.raises(ValueError, match="H"):
        md.plan(by_head, 40, block_size=16)
    plan = md.plan(by_head, 40, block_size=16, H=2)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    out = plan.unshard(md.attention(plan.shard(q), plan.shard(k), plan.shard(v), plan))
    want, _ = attention_reference(q, k, v, mask_mod=by_head)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    # a plan for 2 heads would skip pairs head 3 keeps (here none, but a mask may read h anyhow)
    q4 = plan.shard(torch.randn(1, 4, 40, 16))
    with pytest.raises(ValueError, match="reads h, and this plan was made for number of query heads H=2"):
        md.attention(q4, q4, q4, plan)


@pytest.mark.slow  # 3 ranks
def test_subgroups_empty_shards_and_head_masks():
    _spawn(_check_subgroup_and_edges, 3)


def test_errors_name_the_rule():
    _spawn(_check_errors, 2)


def test_plan_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        md.plan(maskc.masks.causal, 128)


# -- layouts, without processes ----------------------------------------------------------------------
def _kept(mask, L, block=16):
    return (maskc.block_map(mask, L, L, block_size=(block, block)).to_dense() > 0).sum(dim=(0, 1))


def test_causal_takes_the_zigzag_split():
    chosen = layout.choose(_kept(maskc.masks.causal, 512), 512, 16, 4)
    assert chosen.name == "zigzag" and chosen.owned == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert len({chosen.rank_work(r) for r in range(4)}) == 1  # every rank keeps the same number of tiles


def test_a_ragged_causal_length_may_balance_finer_than_zigzag():
    # 13 tiles do not cut into 4 equal chunks: 8 chunks handed out evenly leave the busiest rank less
    kept = _kept(maskc.masks.causal, 200)
    chosen = layout.choose(kept, 200, 16, 2)
    zigzag = layout._layout("zigzag", kept, 200, 16, 4, [(0, 3), (1, 2)])
    assert chosen.name == "balanced" and chosen.busiest < zigzag.busiest


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "context_parallel.py"


def _example():
    spec = importlib.util.spec_from_file_location("context_parallel_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines main and SHAPES; runs nothing
    return module


def test_context_parallel_example_shards_as_it_says():
    example = _example()
    assert "the zigzag split" in example.__doc__ and "--nproc-per-node 2" in example.__doc__
    for device, (L, _, _, block) in example.SHAPES.items():
        assert layout.choose(_kept(maskc.masks.causal, L, block), L, block, 2).name == "zigzag", device


@pytest.mark.slow  # two processes through the interpreter, forward and backward: ~30 s on 2 cores
def test_context_parallel_example_prints_the_zigzag_plan():
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(EXAMPLE)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "layout=zigzag" in run.stdout and run.stdout.splitlines()[-1] == "ok", run.stdout


def test_sliding_window_stays_contiguous():
    chosen = layout.choose(_kept(maskc.masks.sliding_window(32), 1024), 1024, 16, 4)
    assert chosen.name == "contiguous" and chosen.steps == (0, 1)


def test_documents_balance_the_busiest_rank():
    lengths = torch.tensor([448, 32, 32, 0, 0, 0, 0, 0])[:3]
    ids = torch.repeat_interleave(torch.arange(3), lengths)
    kept = _kept(maskc.masks.document(ids, causal=True), 512)
    chosen = layout.choose(kept, 512, 16, 2)
    contiguous = layout.choose(kept, 512, 16, 1)  # all on one rank: the total
    assert chosen.busiest <= 0.55 * contiguous.busiest, (chosen.name, chosen.busiest, contiguous.busiest)


def test_chunks_cover_ragged_and_short_sequences():
    for L, n in ((77, 4), (20, 4), (1, 2), (40, 4), (15, 3), (47, 4)):
        kept = _kept(maskc.masks.causal, L)
        chosen = layout.choose(kept, L, 16, n)
        covered = sorted(p for c in range(len(chosen.bounds)) for p in range(*chosen.bounds[c]))
        assert covered == list(range(L)), (L, n, chosen)
        # each tile's work is counted on the chunk that holds its rows (an empty chunk holds none)
        for c, (start, end) in enumerate(chosen.bounds):
            rows = kept[start // 16:-(-end // 16)] if start < end else kept[:0]
            assert sum(chosen.pair_work[c]) == int(rows.sum()), (L, n, c, chosen.bounds)
