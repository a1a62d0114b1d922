"""Soak: thousands of calls through compiled_attention, each with a new mask, new captured
tensors and new lengths, keep the process's memory and every runtime cache bounded.

The slow lane only: about 5 minutes on 2 idle CPU cores through Triton's interpreter (a call
takes about 55 ms at these tiny shapes). Each call captures views of a new 33 MiB storage (4 MiB
of it resident), so a cache or table that kept them would grow the process by gigabytes. The
figures are printed (run with -s to see them)."""
import gc
import random

import pytest
import torch

import maskc
from _inputs import qkv
from maskc.analysis.blockmap import _BY_SERIAL
from maskc.inference import decode
from maskc.runtime import ops, plan
from maskc.runtime.cache import KERNELS
from maskc.trace.mods import _BY_SERIAL as _MODS_BY_SERIAL

CALLS, WARM_UP = 5000, 500
MIB = 1 << 20
# Each call's captured tensors are views of a new storage past glibc's largest mmap threshold
# (32 MiB), so that each is a mapping of its own, returned to the system when freed: the RSS then
# shows what is kept, not the heap's fragmentation (with 1 MiB storages it swung by 70 MiB). Its
# first 4 MiB are written, and so resident: touching all of it took a third of the run.
STORAGE, RESIDENT = 33 * MIB, 4 * MIB
BUDGET = 4 * STORAGE  # MASKC_PLAN_CACHE_MAX_SIZE for the run: four of the calls' storages per cache


def _rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) << 10


def _call(i: int, rng: random.Random) -> None:
    """One call with new lengths, new captured tensors (views of a new storage) and a new mask
    (a new closure, traced on first use); one in ten runs the backward, one in ten decodes with
    kv_lens."""
    Lq = rng.randint(1, 16)
    Lkv = rng.randint(max(Lq, 8), 32)
    q, k, v = qkv(Lq=Lq, Lkv=Lkv, seed=i)
    storage = torch.empty(STORAGE // 4)
    storage[:RESIDENT // 4] = 1.0
    table = storage[:Lq * Lkv].view(Lq, Lkv).normal_(generator=torch.Generator().manual_seed(i))
    ids = storage[-Lkv:].copy_(torch.tensor(sorted(rng.randrange(3) for _ in range(Lkv))))
    window = rng.randint(1, 8)
    if i % 3 == 0:
        def document(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) | (q_idx == kv_idx)
        mods = dict(mask_mod=document)
    elif i % 3 == 1:
        def dense(b, h, q_idx, kv_idx):
            return (table[q_idx, kv_idx] > -0.5) | (q_idx == kv_idx)
        mods = dict(mask_mod=dense)
    else:
        def band(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) | (kv_idx - q_idx <= window)

        def biased(score, b, h, q_idx, kv_idx):
            return score + table[q_idx, kv_idx]
        mods = dict(mask_mod=band, score_mod=biased)
    if i % 10 == 9:
        q.requires_grad_(True)
        maskc.compiled_attention(q, k, v, **mods).sum().backward()
    elif i % 10 == 4:
        lens = torch.tensor([rng.randint(Lq, Lkv)], dtype=torch.int32)
        maskc.compiled_attention(q, k, v, kv_lens=lens, **mods)
    else:
        maskc.compiled_attention(q, k, v, **mods)


def _sizes() -> dict:
    return {"plans": (len(plan.PLANS), plan.PLANS.nbytes), "block maps": (len(plan.BLOCK_MAPS), plan.BLOCK_MAPS.nbytes),
            "decodes": (len(decode.DECODES), decode.DECODES.nbytes), "kernels": KERNELS.info().currsize,
            "pending backwards": len(ops._forwards), "live mods": len(_MODS_BY_SERIAL), "live block maps": len(_BY_SERIAL)}


@pytest.mark.slow
def test_thousands_of_calls_with_new_masks_keep_memory_and_caches_bounded(monkeypatch, fresh_caches):
    monkeypatch.setenv("MASKC_PLAN_CACHE_MAX_SIZE", str(BUDGET))
    rng = random.Random(0)
    start = _rss()
    largest = {name: 0 for name in ("plans", "block maps", "decodes")}
    for i in range(CALLS):
        _call(i, rng)
        if i + 1 == WARM_UP:
            gc.collect()
            warm = _rss()
        for name, (n, nbytes) in ((k, s) for k, s in _sizes().items() if isinstance(s, tuple)):
            assert n <= 64 and (nbytes <= BUDGET or n == 1), (i, name, n, nbytes)
            largest[name] = max(largest[name], nbytes)
    gc.collect()
    end = _rss()
    sizes = _sizes()
    print(f"\nsoak: {CALLS} calls; RSS {start / MIB:.0f} MiB at the start, {warm / MIB:.0f} MiB after {WARM_UP} calls, "
          f"{end / MIB:.0f} MiB at the end ({(end - warm) / MIB:+.0f} MiB since the warm-up); caches at the end "
          f"(entries, MiB held): " + ", ".join(f"{name} {s[0]}, {s[1] / MIB:.1f}" if isinstance(s, tuple) else
                                               f"{name} {s}" for name, s in sizes.items())
          + "; most held by a cache: " + ", ".join(f"{name} {b / MIB:.1f} MiB" for name, b in largest.items()))
    assert end - warm < 200 * MIB  # the resident part of 4,500 calls' storages would be 17 GiB
    assert sizes["kernels"] <= 12  # the mix has a few structures: a new mask of one compiles nothing
    assert sizes["pending backwards"] == 0  # eager calls: ops' table is for torch.compile's backward
    assert sizes["live mods"] <= 3 * 64 + 8 and sizes["live block maps"] <= 3 * 64 + 8
