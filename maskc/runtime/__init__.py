"""Stage 4 of the pipeline: plan, cache, load and launch generated kernels.

api (public functions) → autograd → launch (LaunchPlans) → plan (validation, tiles, the call's
block map) → kernel (CompiledKernel) → cache/loader; tiles owns tile sizes, settings
(maskc/settings.py) every environment knob. Decoding and the paged KV cache ride on it in
maskc/inference/; PagedKVCache is exported here too.
"""
from maskc.runtime.api import compile, compiled_attention, invalidate, paged_attention
from maskc.runtime.cache import KERNELS, CacheInfo
from maskc.runtime.kernel import CompiledKernel
from maskc.inference.paged import PagedKVCache
from maskc.settings import cache_dir


def cache_info() -> CacheInfo:
    """Counters of the kernel cache: CacheInfo(hits, misses, disk_hits, currsize)."""
    return KERNELS.info()


__all__ = ["CacheInfo", "CompiledKernel", "PagedKVCache", "cache_dir", "cache_info", "compile",
           "compiled_attention", "invalidate", "paged_attention"]
