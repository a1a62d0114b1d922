"""Triton's one-off set-up for compiled kernels runs in background threads (loader.warm_up):
started once, only for CUDA, joined by the first compiled load, its errors raised there.

The CUDA driver cannot be built on a machine without a GPU, so most tests stand in for that one
step (`loader._driver_utils`); the cache key is the real one, hashed from this Triton's install."""
import json
import threading
import time

import pytest
import torch
import triton.runtime.cache

import maskc
from maskc import masks
from maskc.runtime import KERNELS, loader


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """A process that has warmed nothing up yet, with its own kernel cache, and Triton's own
    triton_key() put back afterwards (a compiled load hands Triton another)."""
    monkeypatch.setenv("MASKC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "_WARM_UP", loader._WarmUp())
    monkeypatch.setattr(triton.runtime.cache, "triton_key", triton.runtime.cache.triton_key)
    KERNELS.clear()
    yield tmp_path
    KERNELS.clear()


@pytest.fixture
def driver_builds(monkeypatch):
    """Stands in for building Triton's CUDA driver: records the thread it ran on, takes a while."""
    threads = []

    def build():
        time.sleep(0.2)
        threads.append(threading.current_thread().name)

    monkeypatch.setattr(loader, "_driver_utils", build)
    return threads


def _kernel_path():
    return maskc.compile(masks.causal, dtype=torch.float32, head_dim=32, device="cpu").path


def test_cpu_kernels_warm_nothing_up(monkeypatch):
    calls = []
    monkeypatch.setattr(loader, "warm_up", lambda: calls.append(1))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    maskc.compiled_attention(q, k, v, mask_mod=masks.sliding_window(8))
    _kernel_path()
    assert calls == []


def test_started_once_and_joined_by_the_first_compiled_load(fresh, driver_builds):
    tritons_own = triton.runtime.cache.triton_key
    path = _kernel_path()
    starters = [threading.Thread(target=loader.warm_up) for _ in range(8)]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    loader.warm_up()
    loader.load(path, interpret=False)
    assert len(driver_builds) == 1 and driver_builds[0].startswith("maskc-warm-up")
    stored = json.loads((fresh / "triton_key.json").read_text())["key"]
    assert triton.runtime.cache.triton_key() == stored == tritons_own()
    loader.warm_up()
    loader.load(path, interpret=False)
    assert len(driver_builds) == 1


def test_stored_key_is_read_in_the_background(fresh, driver_builds):
    (fresh / "triton_key.json").write_text(json.dumps({"stamp": loader._triton_stamp(), "key": "stored"}))
    loader.warm_up()
    loader.load(_kernel_path(), interpret=False)
    assert triton.runtime.cache.triton_key() == "stored"
    assert driver_builds  # the load, quick with a stored key, waited for the slower thread


def test_an_error_in_the_threads_is_raised_at_the_join_once(monkeypatch, driver_builds):
    def unreadable():
        raise OSError("libtriton.so: permission denied")

    monkeypatch.setattr(triton.runtime.cache, "triton_key", unreadable)
    path = _kernel_path()
    loader.warm_up()
    with pytest.raises(OSError, match="permission denied"):
        loader.load(path, interpret=False)
    assert len(driver_builds) == 1  # the other thread was waited for too
    monkeypatch.setattr(triton.runtime.cache, "triton_key", lambda: "readable again")
    loader.load(path, interpret=False)  # nothing pending: the key is computed inline, as before warm-up existed
    assert triton.runtime.cache.triton_key() == "readable again"


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's CUDA driver builds on a machine with a GPU")
def test_tritons_driver_error_without_a_gpu_reaches_the_caller():
    path = _kernel_path()
    loader.warm_up()
    with pytest.raises(RuntimeError, match="active drivers"):
        loader.load(path, interpret=False)
    assert loader.load(path, interpret=False).attention_fwd is not None
