"""Every in-memory cache is registered in maskc/runtime/state.py with a bound; maskc.cache_info()
reports them all and maskc.clear_caches() empties them, after which calls give the same answers."""
import importlib
import pkgutil
import weakref

import pytest
import torch

import maskc
from _inputs import qkv
from maskc import masks
from maskc._slots import Slots
from maskc.errors import MaskcError
from maskc.runtime import ops, state
from maskc.runtime.cache import SourceCache
from maskc.testing import assert_close_to_reference, attention_reference

# Modules not imported by the walk: running them is their import (`python -m maskc`).
_NOT_IMPORTED = {"maskc.__main__"}
# Module-level containers that calls change but that hold no cache: none today. An entry here
# says why the container is not one.
_NOT_CACHES: dict[str, str] = {}


def _calls():
    """A forward and backward, a captured tensor, decoding with kv_lens, a FlexAttention
    BlockMask and the torch operators: tiny CPU shapes, each checked against float64. Returns
    what the weak tables hold while it lives."""
    q, k, v = qkv(Lq=24, requires_grad=True)
    out = maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
    out.sum().backward()
    assert_close_to_reference(out, attention_reference(q, k, v, masks.causal)[0])
    q, k, v = qkv(Lq=24)
    docs = masks.document(torch.tensor([0] * 10 + [1] * 14), causal=True)
    assert_close_to_reference(maskc.compiled_attention(q, k, v, mask_mod=docs), attention_reference(q, k, v, docs)[0])
    lens = torch.tensor([17], dtype=torch.int32)
    out = maskc.compiled_attention(q[:, :, :1], k, v, mask_mod=masks.causal, kv_lens=lens)
    assert out.shape == (1, 2, 1, 16)
    bm = maskc.create_block_mask(masks.causal, 1, 1, 24, 24, device="cpu")
    causal = attention_reference(q, k, v, masks.causal)[0]
    assert_close_to_reference(maskc.flex_attention(q, k, v, block_mask=bm), causal)
    assert_close_to_reference(ops.attention(q, k, v, masks.causal, None, None, False, None, True)[0], causal)
    return docs, bm


def _modules() -> list:
    found = [maskc]
    for info in pkgutil.walk_packages(maskc.__path__, "maskc."):
        if info.name in _NOT_IMPORTED:
            continue
        try:
            found.append(importlib.import_module(info.name))
        except ImportError:  # an optional dependency (transformers, matplotlib) is missing
            continue
    return found


def _containers(modules) -> dict:
    """{name: (object, its contents)} of every module-level dict, list and set."""
    found = {}
    for module in modules:
        for attribute, value in list(vars(module).items()):
            if type(value) in (dict, list, set) and not attribute.startswith("__"):
                found[f"{module.__name__.removeprefix('maskc.')}.{attribute}"] = (value, repr(value))
    return found


def test_cache_info_reports_every_registered_cache_with_its_bound(fresh_caches):
    alive = _calls()  # noqa: F841 (kept for the weak tables)
    info = maskc.cache_info()
    assert set(info) == set(state.CACHES)
    for name, cache in state.CACHES.items():
        found = info[name]
        assert isinstance(found, state.CacheState)
        assert found.currsize >= 0 and cache.bound and cache.holds, name
        if found.maxsize is not None:
            assert found.currsize <= found.maxsize, name
    for name in ("runtime.plan.PLANS", "runtime.plan.BLOCK_MAPS", "runtime.cache.KERNELS", "inference.decode.DECODES",
                 "runtime.ops._forwards", "runtime.ops.CONVERTED", "trace.mods._BY_SERIAL"):
        assert info[name].currsize > 0, name
    # the kernels are bounded by count, the plans by count and by the bytes they keep alive
    assert info["runtime.cache.KERNELS"].maxsize is not None
    assert info["runtime.plan.PLANS"].nbytes > 0 and info["runtime.plan.PLANS"].maxbytes is not None


def test_clear_caches_empties_them_in_memory_only_and_calls_stay_right(fresh_caches):
    _calls()
    on_disk = sorted(p.name for p in maskc.runtime.cache_dir().glob("*.py"))
    assert on_disk
    maskc.clear_caches()
    info = maskc.cache_info()
    for name, cache in state.CACHES.items():
        if cache.clear is not None:
            assert info[name].currsize == 0, name
    assert info["trace.mods._BY_SERIAL"].currsize > 0  # live mods stay findable by key: not a cache
    assert sorted(p.name for p in maskc.runtime.cache_dir().glob("*.py")) == on_disk  # the files stay
    _calls()  # everything built again, from the files on disk
    assert maskc.runtime.cache_info().misses == 0 and maskc.runtime.cache_info().disk_hits > 0


def test_every_module_level_cache_is_registered(fresh_caches):
    modules = _modules()
    before = _containers(modules)
    alive = _calls()  # noqa: F841 (kept for the weak tables)
    registered, wrong = set(state.CACHES), []
    names: dict = {}  # id of each module-level cache -> (the object, every name it has)
    for module in modules:
        for attribute, value in list(vars(module).items()):
            entries = getattr(value, "entries", None)
            if (isinstance(entries, Slots) or (callable(value) and hasattr(value, "cache_clear"))
                    or isinstance(value, (Slots, SourceCache, weakref.WeakKeyDictionary,
                                          weakref.WeakValueDictionary, weakref.WeakSet))):
                names.setdefault(id(value), (value, []))[1].append(f"{module.__name__.removeprefix('maskc.')}."
                                                                   f"{attribute}")
    for value, found in names.values():
        entries = getattr(value, "entries", None)  # maskc.trace.dag.identity_cache's
        declared = [name for name in found if name in registered]  # imported elsewhere under other names
        if not declared:
            wrong.append(f"{found[0]} is a cache: declare it in maskc/runtime/state.py")
            continue
        slots = entries if isinstance(entries, Slots) else value if isinstance(value, Slots) else None
        if slots is not None or hasattr(value, "cache_info"):  # the declared bound is the real one
            maxsize = slots._size if slots is not None else value.cache_info().maxsize
            if state.CACHES[declared[0]].maxsize != maxsize:
                wrong.append(f"{declared[0]} holds {maxsize} entries at most, declared "
                             f"{state.CACHES[declared[0]].maxsize}")
    for name, (value, _) in _containers(modules).items():
        if name in before and repr(value) != before[name][1] and name not in registered | set(_NOT_CACHES):
            wrong.append(f"{name} changes as maskc runs: declare it in maskc/runtime/state.py, or say in "
                         f"tests/test_state.py why it is no cache")
    for name, cache in state.CACHES.items():  # nothing declared that no longer exists
        attribute = name.removeprefix(cache.owner.removeprefix("maskc.") + ".")
        if not hasattr(importlib.import_module(cache.owner), attribute):
            wrong.append(f"{name} is declared but {cache.owner} has no {attribute}")
    assert not wrong, "\n".join(wrong)


def test_the_kernel_cache_in_memory_drops_its_least_recently_used():
    kernels = SourceCache(2)
    kernels.put("a", 1)
    kernels.put("b", 2)
    assert kernels.get("a") == 1  # "b" is now the least recently used
    kernels.put("c", 3)
    assert (kernels.get("a"), kernels.get("b"), kernels.get("c")) == (1, None, 3)
    assert kernels.info().currsize == 2


def test_a_backward_whose_forward_plan_was_dropped_raises(fresh_caches):
    # the torch.compile operator's backward finds its forward's plan by token: a dropped plan
    # must raise, naming the fix, and never run another plan
    q, k, v = qkv(Lq=24, requires_grad=True)
    out, _ = ops.attention(q, k, v, masks.causal, None, None, False, None, True)
    maskc.clear_caches()
    with pytest.raises(MaskcError, match=r"clear_caches\(\) ran.*run the backward sooner"):
        out.sum().backward()


def test_an_eager_backward_after_clear_caches_is_right(fresh_caches):
    q, k, v = qkv(Lq=24, requires_grad=True)
    out = maskc.compiled_attention(q, k, v, mask_mod=masks.causal)
    maskc.clear_caches()
    out.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    attention_reference(q64, k64, v64, masks.causal)[0].sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert_close_to_reference(got, want)
