"""What the tracer refuses because a trace could not describe it: random numbers, side effects,
integers no kernel integer holds. Each refusal is a MaskTraceError that names the mod and the fix."""
import pytest
import torch
import torch.nn.functional as F

import maskc
from maskc.errors import MaskTraceError


# -- random numbers --------------------------------------------------------------------------
# Called without a traced argument they ran as plain torch: one draw frozen into the trace.
@pytest.mark.parametrize("name, draw", [
    ("torch.randint", lambda q: torch.randint(0, 10, ())),
    ("torch.rand", lambda q: torch.rand(()) * 10),
    ("torch.randn", lambda q: torch.randn(())),
    ("torch.randperm", lambda q: torch.randperm(4)[0]),
    ("torch.normal", lambda q: torch.normal(0.0, 1.0, size=())),
    ("torch.bernoulli", lambda q: torch.bernoulli(torch.tensor(0.5))),
    ("Tensor.uniform_", lambda q: torch.empty(()).uniform_()),
    ("torch.nn.functional.dropout", lambda q: F.dropout(torch.ones(()))),
    ("torch.rand_like", lambda q: torch.rand_like(q.float())),
], ids=lambda x: x if isinstance(x, str) else None)
def test_random_numbers_in_a_mask_are_refused(name, draw):
    def noisy(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < draw(q_idx)

    with pytest.raises(MaskTraceError, match=rf"mask_mod 'noisy' calls {name}, which draws random numbers.*"
                                             rf"draw the random values outside the mod"):
        maskc.mask_mod(noisy)


def test_random_numbers_in_a_score_mod_are_refused():
    def jitter(score, b, h, q_idx, kv_idx):
        return score + torch.randn(())

    with pytest.raises(MaskTraceError, match=r"score_mod 'jitter' calls torch.randn, which draws random numbers"):
        maskc.score_mod(jitter)


def test_tensors_made_without_randomness_still_trace():
    mm = maskc.mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < torch.tensor(3))
    assert len(mm.traced.tensors) == 1


# -- side effects ------------------------------------------------------------------------------
CALLS = 0
SEEN = []
LIMITS = {"window": 4}


class _Config:
    window = 4


CONFIG = _Config()


def counting(b, h, q_idx, kv_idx):
    global CALLS
    CALLS += 1
    return q_idx >= kv_idx


def forgetting(b, h, q_idx, kv_idx):
    global CALLS
    del CALLS
    return q_idx >= kv_idx


def _nonlocal_counter():
    count = 0

    def counted(b, h, q_idx, kv_idx):
        nonlocal count
        count += 1
        return q_idx >= kv_idx

    return counted


def through_a_helper(b, h, q_idx, kv_idx):
    def bump():
        global CALLS
        CALLS = 3

    bump()
    return q_idx >= kv_idx


@pytest.mark.parametrize("mod, what", [
    (counting, r"mask_mod 'counting' assigns the global 'CALLS' at test_trace_refusals.py:\d+"),
    (forgetting, r"mask_mod 'forgetting' deletes the global 'CALLS'"),
    (_nonlocal_counter(), r"mask_mod 'counted' assigns the enclosing function's variable 'count'"),
    (through_a_helper, r"mask_mod 'through_a_helper' assigns the global 'CALLS'"),
], ids=["global", "del global", "nonlocal", "global in an inner function"])
def test_a_mod_that_writes_a_global_or_a_closure_variable_is_refused(mod, what):
    # the tracer runs a copy of the function with a copy of its globals: the write never landed
    with pytest.raises(MaskTraceError, match=what + r".*a mod must have no side effects.*outside the mod"):
        maskc.mask_mod(mod)
    assert CALLS == 0


def appending(b, h, q_idx, kv_idx):
    SEEN.append(1)
    return q_idx - kv_idx <= len(SEEN)


def setting(b, h, q_idx, kv_idx):
    LIMITS["other"] = 1
    return q_idx - kv_idx <= LIMITS["window"]


def incrementing(b, h, q_idx, kv_idx):
    CONFIG.window += 1
    return q_idx - kv_idx <= CONFIG.window


@pytest.mark.parametrize("mod, what", [(appending, "SEEN"), (setting, "LIMITS"), (incrementing, "CONFIG.window")])
def test_a_mod_that_changes_what_it_reads_is_refused(mod, what):
    # it was traced again on every call, its body (and the change) running each time
    before = (list(SEEN), dict(LIMITS), CONFIG.window)
    try:
        with pytest.raises(MaskTraceError, match=rf"mask_mod '{mod.__name__}' changes '{what}', which it reads, "
                                                 rf"while it is traced.*no side effects"):
            maskc.mask_mod(mod)
    finally:
        SEEN[:] = before[0]
        LIMITS.clear()
        LIMITS.update(before[1])
        CONFIG.window = before[2]


def test_a_mod_that_reads_globals_and_builds_its_own_lists_traces_once():
    def reading(b, h, q_idx, kv_idx):
        terms = [q_idx - kv_idx <= LIMITS["window"]]
        terms.append(q_idx >= kv_idx)
        return terms[0] & terms[1]

    mm = maskc.mask_mod(reading)
    assert mm.traced is mm.traced  # its guards hold: no trace on use


# -- integers no kernel integer holds ----------------------------------------------------------
@pytest.mark.parametrize("mod", [lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 2**70,
                                 lambda b, h, q_idx, kv_idx: q_idx * 2**40 * 2**40 >= kv_idx,
                                 lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 2**63 - 1],
                         ids=["2**70", "a product past int64", "sys.maxsize"])
def test_integer_literals_outside_the_kernels_range_are_refused(mod):
    # 2**70: the block-map analysis raised OverflowError ("can't convert negative int to
    # unsigned"); sys.maxsize as "no window": the kernel's kv_idx + W - q_idx wrapped (error
    # 0.99) while the map called every tile FULL
    with pytest.raises(MaskTraceError, match=r"computes with the integer \d+, outside ±2\*\*62.*"
                                             r"use integers within ±2\*\*62"):
        maskc.mask_mod(mod)
