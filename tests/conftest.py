"""What every test module shares: hypothesis profiles, the lanes, and a kernel cache of its own.

Profiles: `maskc` (the default) keeps the default lane to minutes on a small CPU and draws the
same examples every run; pass `--hypothesis-profile=thorough` for a long fuzzing run of fresh
draws. Every failure prints the `@reproduce_failure` blob that replays it.

Lanes: the default lane is `python -m pytest -q -n auto`; `-m slow` runs the exhaustive sweeps
that the default lane samples; tests/gpu/ (marked `gpu`) runs on a CUDA machine and skips
elsewhere.

The run's kernels go to one temporary directory shared by its workers, never to the user's
`~/.cache/maskc`; tests that need a cache of their own still point `MASKC_CACHE_DIR` elsewhere
with monkeypatch.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# Drawing a mask traces it with sympy, which hypothesis's health check can take for a slow strategy.
# The lanes draw the same examples on every run (derandomize): a red run is a change in maskc or
# in .ci/constraints.txt, never a new draw; the thorough profile draws afresh.
settings.register_profile("maskc", max_examples=50, deadline=None, print_blob=True, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", parent=settings.get_profile("maskc"), max_examples=2000, derandomize=False)
settings.load_profile("maskc")


@pytest.fixture(scope="session", autouse=True)
def _run_kernel_cache(tmp_path_factory):
    """Points MASKC_CACHE_DIR at a directory of this run's, shared by its xdist workers (the
    parent of each worker's base temp), so a kernel rendered by one worker is read by the others."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "maskc_kernels"
    path.mkdir(exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("MASKC_CACHE_DIR", str(path))
    yield path
    mp.undo()


@pytest.fixture
def fresh_caches():
    """maskc's in-process caches emptied before and after the test: kernels, plans, block maps
    and decode plans, for tests that count hits or misses or load files again."""
    from maskc.inference import decode
    from maskc.runtime import plan
    from maskc.runtime.cache import KERNELS

    def clear():
        for cache in (KERNELS, plan.PLANS, plan.BLOCK_MAPS, decode.DECODES):
            cache.clear()

    clear()
    yield
    clear()
