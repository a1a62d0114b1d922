"""Autotuning (MASKC_AUTOTUNE=1): the fastest candidate is chosen, stored, and read back.

On CPU the candidates run through the interpreter, so the end-to-end test swaps in two small
CPU configs; on CUDA the same code times maskc/runtime/tiles.forward_candidates.
"""
import json

import pytest
import torch
from triton.runtime.errors import OutOfResources

import maskc
from maskc import masks
from maskc.runtime import autotune, launch, plan, tiles
from maskc.runtime.tiles import TileConfig
from maskc.testing import attention_reference

FAST, SLOW = TileConfig(16, 32, 4, 1), TileConfig(32, 32, 4, 1)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MASKC_CACHE_DIR", str(tmp_path))
    autotune.forget()
    yield tmp_path
    autotune.forget()


def test_fastest_by_median_is_stored_and_read_back(_cache):
    timings = {FAST: iter([5.0, 1.0, 1.0]), SLOW: iter([2.0, 2.0, 2.0])}  # FAST has one slow round
    assert autotune.tuned("k", [SLOW, FAST], lambda c: next(timings[c])) == FAST
    assert json.loads((_cache / "autotune.json").read_text()) == {"k": list(FAST)}

    def never(config):
        raise AssertionError("a stored choice must not be timed again")

    assert autotune.tuned("k", [SLOW, FAST], never) == FAST
    autotune.forget()  # as a new process: from the file
    assert autotune.tuned("k", [SLOW, FAST], never) == FAST


def test_other_processes_choices_are_kept(_cache):
    (_cache / "autotune.json").write_text(json.dumps({"theirs": list(SLOW)}))
    autotune.tuned("mine", [SLOW, FAST], lambda c: 1.0 if c == FAST else 2.0)
    assert json.loads((_cache / "autotune.json").read_text()) == {"theirs": list(SLOW), "mine": list(FAST)}


def test_candidates_that_do_not_fit_the_gpu_are_skipped(_cache):
    def seconds(config):
        if config == FAST:
            raise OutOfResources(300000, 232448, "shared memory")
        return 1.0

    assert autotune.tuned("small gpu", [SLOW, FAST], seconds) == SLOW


def test_a_default_that_does_not_fit_is_an_error(_cache):
    def seconds(config):
        raise OutOfResources(300000, 232448, "shared memory")

    with pytest.raises(OutOfResources):
        autotune.tuned("k", [SLOW, FAST], seconds)


def test_lengths_share_a_choice_within_a_power_of_two():
    assert [autotune.bucket(n) for n in (1, 64, 65, 128, 8192, 8193)] == [1, 64, 128, 128, 8192, 16384]


def test_compiled_attention_tunes_once_and_uses_the_choice(_cache, monkeypatch):
    monkeypatch.setenv("MASKC_AUTOTUNE", "1")
    monkeypatch.setattr(tiles, "forward_candidates", lambda head_dim, device_type: [SLOW, FAST])
    timed = []
    seconds = launch.seconds
    monkeypatch.setattr(launch, "seconds", lambda q, k, v, p: timed.append(p.tiles.forward.block_m) or seconds(q, k, v, p))
    mask = maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)  # a new object: no plan cached for it
    gen = torch.Generator().manual_seed(0)
    # 80 query rows: more than the decoding kernel takes (maskc/inference/decode.py)
    q, k, v = (torch.randn(1, 2, 80, 32, generator=gen) for _ in range(3))
    out = maskc.compiled_attention(q, k, v, mask_mod=mask)
    assert sorted(set(timed)) == [16, 32] and len(timed) == 6  # three rounds of two candidates
    chosen = TileConfig(*next(iter(json.loads((_cache / "autotune.json").read_text()).values())))
    problem = next(p for p in plan.PLANS.values() if p.mask_mod is mask)
    assert problem.block_map.block_size == (chosen.block_m, chosen.block_n)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), mask)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_off_by_default(_cache, monkeypatch):
    monkeypatch.delenv("MASKC_AUTOTUNE", raising=False)
    monkeypatch.setattr(tiles, "forward_candidates", lambda head_dim, device_type: [SLOW, FAST])
    q = torch.randn(1, 1, 40, 32)
    maskc.compiled_attention(q, q, q, mask_mod=masks.sliding_window(7))
    assert not (_cache / "autotune.json").exists()
