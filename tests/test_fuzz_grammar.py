"""The grammar fuzzer (tests/fuzz_grammar.py) on a fixed sample: random mask_mods and score_mods
that nobody wrote by hand, through tracing, block maps and the kernels (Triton's interpreter),
against dense evaluation and the float64 reference. tests/gpu/test_fuzz.py runs many more,
compiled, on a GPU.

A MaskcError is a clear refusal and passes (test_sample_is_mostly_accepted keeps that from
passing vacuously); any other exception, an unsound tile or a wrong answer fails with the seed and
the mod's source. Replay one with `fuzz_grammar.random_mask_mod(seed)` / `random_score_mod(seed)`.
A case whose float64 reference is NaN (a -inf score in a NaN-making operation) is skipped: its
answer is undefined. The `thorough` hypothesis profile runs ten times the sample.
"""
import contextlib
import random

import pytest
import torch
from hypothesis import settings

import maskc
from fuzz_grammar import GeneratedMod, random_mask_mod, random_score_mod
from maskc.errors import MaskcError
from maskc.testing import (assert_block_map_sound, assert_close_to_reference, assert_gradient_close_to_reference,
                           attention_reference, dense_mask)

MAX_LEN = 80
# NOTE: the thorough hypothesis profile (conftest.py) is the suite's long run; it takes ten times the
# sample here too (about 2 minutes on one core, against 15 seconds)
_SCALE = 10 if settings.default.max_examples >= 500 else 1
# 100 masks × 3 tiles: 300 soundness checks, a few seconds
BLOCK_MAP_SEEDS = range(100 * _SCALE)
# 0.2-0.5 s a kernel run in the interpreter at these sizes
FORWARD_SEEDS = range(1000, 1000 + 10 * _SCALE)
BACKWARD_SEEDS = range(2000, 2000 + 4 * _SCALE)
BLOCK_SIZES = ((16, 16), (16, 32), (32, 16))
# float64 runs only, 6e-10 to 2e-7 off against the 1e-10 asked of float64: maskc's float64 kernel
# computes a score's index arithmetic with float literals in float64 where torch computes it in
# float32 (docs/guides/masks.md, "Where maskc's answer differs from FlexAttention's"), and in float32 a literal's product with a parameter
# or a float32 table value, or a reciprocal (score / x.clamp(min=1.0)) where torch divides in
# float64. Each is within float32's tolerance.
FLOAT64_ROUNDING = {1029, 1045, 1051, 2003, 2013, 2029}


def _seeds(seeds):
    return [pytest.param(s, marks=pytest.mark.xfail(reason="float64 rounding of index arithmetic (FLOAT64_ROUNDING)",
                                                    strict=False)) if s in FLOAT64_ROUNDING else s for s in seeds]


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKC_CACHE_DIR", str(tmp_path_factory.mktemp("maskc_cache")))
        yield


@contextlib.contextmanager
def _case(seed: int, *mods: GeneratedMod):
    """One fuzz case: a MaskcError ends it as a pass; any other error fails it, naming the mods."""
    try:
        yield
    except MaskcError:
        return
    except Exception as e:  # noqa: BLE001 (a crash is a finding, reported with its mod)
        described = "; ".join(m.describe() for m in mods if m is not None)
        raise AssertionError(f"seed {seed}: {described}\n{type(e).__name__}: {e}") from e


@pytest.mark.parametrize("seed", BLOCK_MAP_SEEDS)
def test_block_map_is_sound(seed):
    mod = random_mask_mod(seed, max_len=MAX_LEN)
    rng = random.Random(seed)
    with _case(seed, mod):
        mask = maskc.mask_mod(mod.fn)
        for block_size in BLOCK_SIZES:
            # ragged lengths, mostly not multiples of the tiles, each under max_len
            q_len, kv_len = rng.randint(1, MAX_LEN), rng.randint(1, MAX_LEN)
            B, H = rng.choice([(1, 1), (2, 2), (2, 1), (1, 2)])
            assert_block_map_sound(mask, q_len, kv_len, block_size, B=B, H=H)


def test_sample_is_mostly_accepted():
    refused = []
    for seed in BLOCK_MAP_SEEDS:
        try:
            maskc.mask_mod(random_mask_mod(seed, max_len=MAX_LEN).fn)
        except MaskcError as e:
            refused.append(f"seed {seed}: {e}")
    assert len(refused) <= 0.05 * len(BLOCK_MAP_SEEDS), "\n".join(refused)


def _problem(seed: int, grad: bool):
    """A case's mods (a mask, or a score mod with a mask 40% of the time) and inputs, from `seed`."""
    rng = random.Random(seed)
    mask = score = None
    if seed % 2 == 0:
        mask = random_mask_mod(seed, max_len=MAX_LEN)
    else:
        score = random_score_mod(seed, max_len=MAX_LEN)
        if rng.random() < 0.4:
            mask = random_mask_mod(seed, max_len=MAX_LEN, depth=rng.choice([0, 1, 2]))
    B, H = rng.choice([(1, 1), (1, 2), (2, 1), (2, 2)])
    # without gradients, up to 64 query rows take the split-KV decoding kernel
    q_len = rng.choice([65, 70, 80] if grad else [13, 17, 33, 47, 64, 65, 80])
    kv_len = rng.choice([8, 15, 16, 19, 32, 37, 48, 63, 80])
    dtype = rng.choice([torch.float32, torch.float64])
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, 16, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
               for n in (q_len, kv_len, kv_len))
    return mask, score, (q, k, v)


def _check(seed: int, grad: bool):
    mask, score, (q, k, v) = _problem(seed, grad)
    plain = {"mask_mod": mask.fn if mask else None, "score_mod": score.fn if score else None}
    exact = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    ref, ref_lse = attention_reference(*exact, **plain)
    if torch.isnan(ref).any() or torch.isnan(ref_lse).any():
        pytest.skip(f"seed {seed}: the float64 reference is NaN, an undefined answer")
    with _case(seed, mask, score):
        traced = {"mask_mod": mask and maskc.mask_mod(mask.fn), "score_mod": score and maskc.score_mod(score.fn)}
        out, lse = maskc.compiled_attention(q, k, v, return_lse=True, **traced)
        assert_close_to_reference(out.detach(), ref.detach(), q.dtype)
        empty = torch.isneginf(ref_lse.detach())
        assert torch.equal(torch.isneginf(lse.detach()), empty), (
            f"rows that keep nothing differ at {(torch.isneginf(lse.detach()) != empty).nonzero()[:5].tolist()}")
        assert (out.detach()[empty] == 0).all(), "rows that keep nothing must give 0"
        assert_close_to_reference(lse.detach()[~empty], ref_lse.detach()[~empty], q.dtype, what="lse")
        if grad:
            d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            want = torch.autograd.grad(ref, exact, d_out)
            if any(torch.isnan(w).any() for w in want):
                pytest.skip(f"seed {seed}: the float64 reference's gradient is NaN, an undefined answer")
            got = torch.autograd.grad(out, (q, k, v), d_out.to(q.dtype))
            for what, g, w in zip(("dq", "dk", "dv"), got, want):
                assert_gradient_close_to_reference(g, w, q.dtype, what)


@pytest.mark.parametrize("seed", _seeds(FORWARD_SEEDS))
def test_forward_matches_reference(seed):
    _check(seed, grad=False)


@pytest.mark.parametrize("seed", _seeds(BACKWARD_SEEDS))
def test_backward_matches_reference(seed):
    _check(seed, grad=True)


def test_generated_mods_are_valid_at_their_lengths():
    # the grammar's promise (indices in range, no division by zero): a failure here is the grammar's
    for seed in BLOCK_MAP_SEEDS:
        dense_mask(random_mask_mod(seed, max_len=MAX_LEN).fn, MAX_LEN, MAX_LEN, 2, 2)
    q = torch.randn(2, 2, MAX_LEN, 16, dtype=torch.float64)
    for seed in FORWARD_SEEDS:
        attention_reference(q, q, q, score_mod=random_score_mod(seed, max_len=MAX_LEN).fn)
